"""The disconnect hook: the upstream connection is shut down in the step that sees the client go.

When hypercorn reports ``http.disconnect``, RelayHTTPConnection calls the body's
``client_disconnected()`` before it cancels the request; the callbacks a producer registered with
``sink.on_disconnect`` run there, synchronously. The upstream producer registers its response's
``abort`` (a SHUT_RDWR of the upstream socket), so the upstream sees the close without waiting
for the producer's task to be scheduled and unwind.

The RelayBody tests need no socket: virtual time. The end-to-end tests run a real proxy in front
of the fake upstream on 127.0.0.1 (port 0), with a wrapper around ``UpstreamResponse.abort`` that
records each call.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from traceback import walk_stack
from typing import Any

import httpx
import pytest
import trio

from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.pool import (
    Exchange,
    PlainTransport,
    UpstreamConnection,
    UpstreamResponse,
)
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.config import config_from_mapping
from proxy.ops.metrics import Metrics
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import Endpoint, parse_completion_request
from proxy.relay.body import RelayBody, RelaySink
from proxy.server import hangup
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    RawClient,
    chat_body,
    poll_until,
    producer_tasks,
    sse_payloads,
    start_fake,
)
from tests.support import (
    start_proxy as start_any_proxy,
)


async def start_proxy(nursery: trio.Nursery, models: dict[str, Any], **sections: Any) -> Proxy:
    """A proxy whose requests all go through hypercorn and Quart: these tests are of
    the disconnect hook under hypercorn and quart-trio
    (the fast path's own are in test_fast_path.py)."""
    sections["server"] = {"fast_path": False, **sections.get("server", {})}
    return await start_any_proxy(nursery, models, **sections)


CHAT = "/v1/chat/completions"

# ------------------------------------------------------------------------- RelayBody alone


def relay_body(produce: Callable[[RelaySink], Any]) -> RelayBody:
    return RelayBody(produce, streaming=True, channel_capacity=4, stall_timeout=10)


class Hook:
    """A disconnect callback that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def parked_producer(hook: Hook, registered: trio.Event) -> Callable[[RelaySink], Any]:
    """A producer that starts the stream, registers ``hook``, says so, and stays at work (the
    upstream still streaming)."""

    async def produce(sink: RelaySink) -> None:
        sink.begin(200, "text/event-stream")
        sink.on_disconnect(hook)
        registered.set()
        await trio.sleep_forever()

    return produce


async def test_client_disconnected_runs_the_callback_once_synchronously(
    autojump_clock: trio.abc.Clock,
) -> None:
    hook = Hook()
    registered = trio.Event()
    body = relay_body(parked_producer(hook, registered))
    async with body:
        await registered.wait()
        body.client_disconnected()
        # Synchronous: run before client_disconnected returned, with no checkpoint between
        # (the point of the hook: the upstream is shut down in this very scheduler step).
        assert hook.calls == 1
        # Called again (a second disconnect report): the callback is not run twice.
        body.client_disconnected()
        assert hook.calls == 1
        # The hook does not stop the producer itself: the cancellation that follows does.
        assert producer_tasks() != []
    assert body.cancelled
    assert hook.calls == 1


async def test_every_registered_callback_runs(autojump_clock: trio.abc.Clock) -> None:
    """A retried or hedged request registers one abort per upstream attempt: each one runs."""
    hooks = [Hook(), Hook()]
    registered = trio.Event()

    async def produce(sink: RelaySink) -> None:
        for hook in hooks:
            sink.on_disconnect(hook)
        sink.begin(200, "text/event-stream")
        registered.set()
        await trio.sleep_forever()

    body = relay_body(produce)
    async with body:
        await registered.wait()
        body.client_disconnected()
        assert [hook.calls for hook in hooks] == [1, 1]


async def test_no_callback_once_the_producer_has_finished(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A producer that is done has given its upstream connection back (maybe to another
    request by now): a disconnect while its last chunks are still going out runs nothing."""
    hook = Hook()

    async def produce(sink: RelaySink) -> None:
        sink.begin(200, "text/event-stream")
        sink.on_disconnect(hook)
        await sink.send(b"data: last\n\n")

    body = relay_body(produce)
    async with body:
        # Read to the end: the producer has returned (it is marked finished before the end
        # of the stream is visible), while the body itself is still open.
        assert [chunk async for chunk in body] == [b"data: last\n\n"]
        assert body.disconnect_callbacks == [hook]  # still registered: the guard must hold
        body.client_disconnected()
        assert hook.calls == 0
    assert not body.cancelled
    assert hook.calls == 0


async def test_no_callback_once_the_body_has_closed(autojump_clock: trio.abc.Clock) -> None:
    """The producer was cancelled (never finished), and the body closed: a disconnect reported
    after that (hypercorn reports one for every finished exchange) runs nothing."""
    hook = Hook()
    registered = trio.Event()
    body = relay_body(parked_producer(hook, registered))
    async with body:
        await registered.wait()
    # Cancelled, not finished: only the close's clearing of the callbacks protects them.
    assert body.cancelled
    body.client_disconnected()
    assert hook.calls == 0


# ------------------------------------------------------------------- through a real proxy


@dataclass
class AbortCall:
    """One call of UpstreamResponse.abort, as the wrapper saw it."""

    response: UpstreamResponse
    connection: UpstreamConnection
    # The response's exchange (its ``async with pool.stream(...)``) had not been closed yet:
    # the abort was not a late one, on a connection already given back.
    body_open: bool
    # Relay producer tasks alive at the call: the request's task had not unwound yet.
    producers: int
    # The upstream socket's TCP state right after the call (None: no socket).
    tcp_state: int | None = None


TCP_ESTABLISHED = 1  # linux/tcp_states.h; the first byte of struct tcp_info


def tcp_state(connection: UpstreamConnection) -> int | None:
    # The fake upstreams are http://: a plain transport, its socket in reach.
    transport = connection.transport
    if not isinstance(transport, PlainTransport) or transport.socket.fileno() < 0:
        return None
    return int(transport.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0])


@pytest.fixture
def abort_calls(monkeypatch: pytest.MonkeyPatch) -> list[AbortCall]:
    calls: list[AbortCall] = []
    # Which exchange each response belongs to: the response holds no reference to it, and the
    # exchange's own flag (``_done``, set as its block closes) is the one precise signal of a
    # late abort. The connection's state is not: once given back, it may be idle in the pool,
    # or already serving the next request (busy again, open, not idle).
    exchanges: dict[UpstreamResponse, Exchange] = {}
    original_enter = Exchange.__aenter__
    original_abort = UpstreamResponse.abort

    async def enter(self: Exchange) -> UpstreamResponse:
        response = await original_enter(self)
        exchanges[response] = self
        return response

    def abort(self: UpstreamResponse) -> None:
        exchange = exchanges[self]
        connection = self._connection
        call = AbortCall(self, connection, not exchange._done, len(producer_tasks()))
        calls.append(call)
        original_abort(self)
        # Read synchronously, before any task runs: did this call itself shut the socket down?
        call.tcp_state = tcp_state(connection)

    monkeypatch.setattr(Exchange, "__aenter__", enter)
    monkeypatch.setattr(UpstreamResponse, "abort", abort)
    return calls


async def request_works(proxy: Proxy, client: httpx.AsyncClient, model: str) -> None:
    response = await client.post(proxy.url + CHAT, json=chat_body(model, fake={"ttft": 0}))
    assert response.status_code == 200
    assert sse_payloads(response.text)[-1] == "[DONE]"


async def test_a_client_leaving_mid_stream_aborts_its_upstream_connection(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient, abort_calls: list[AbortCall]
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (replica,) = proxy.state.replicas.values()
        # A request that completes: the hook must not fire for it (its connection is kept).
        await request_works(proxy, client, "fake-model")
        await proxy.state.tracker.wait_idle()
        assert abort_calls == []
        (kept,) = replica.pool_connections()
        # Then one whose client leaves mid-stream (it takes the kept connection: LIFO).
        raw = await RawClient.post(
            proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.02, "tokens": 1000})
        )
        await raw.read_until(b"data: ", count=3)
        await raw.close()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        left = fake.recorder.last()
        assert left.outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()
        # The hook fired once, for this request, while its body was open and its producer
        # still alive: the abort is what closed the upstream, ahead of the task's unwinding.
        (call,) = abort_calls
        assert call.body_open
        assert call.producers == 1
        assert call.connection is kept
        # And the call itself shut the socket down (FIN sent: out of ESTABLISHED at once).
        assert call.tcp_state not in (None, TCP_ESTABLISHED)
        # Aborted, so discarded: the pool holds nothing that served the request.
        assert call.connection not in replica.pool_connections()
        assert call.connection.is_closed()
        assert replica.pool_connections() == []
        # The next request works, on a new upstream connection, and does not fire the hook.
        await request_works(proxy, client, "fake-model")
        assert fake.recorder.last().connection != left.connection
        await proxy.state.tracker.wait_idle()
        assert len(abort_calls) == 1
        assert len(replica.pool_connections()) == 1


async def test_a_client_leaving_a_hedged_request_aborts_every_attempt(
    nursery: trio.Nursery, client: httpx.AsyncClient, abort_calls: list[AbortCall]
) -> None:
    """Both hedged attempts are waiting for their first token (headers received, so each has
    registered its abort through its _Entrant) when the client leaves: both are shut down."""
    with trio.fail_after(DEADLINE):
        fakes = [await start_fake(nursery, ttft=30, interval=0.01, tokens=3) for _ in "ab"]
        proxy = await start_proxy(
            nursery, {"m": {"upstreams": [fake.url for fake in fakes], "hedge_after": 0.05}}
        )
        raw = await RawClient.post(proxy, CHAT, chat_body("m"))
        for fake in fakes:
            await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        (body,) = proxy.state.tracker.active
        # Registered once each attempt has its response head (the fake sends it before the
        # first token's wait).
        await poll_until(lambda: len(body.disconnect_callbacks) == 2)
        await raw.close()
        for fake in fakes:
            await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
            assert fake.recorder.last().outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()
        assert len(abort_calls) == 2
        assert len({id(call.response) for call in abort_calls}) == 2  # one per attempt
        assert all(call.body_open for call in abort_calls)
        assert all(call.tcp_state not in (None, TCP_ESTABLISHED) for call in abort_calls)
        for replica in proxy.state.replicas.values():
            assert replica.pool_connections() == []
        await request_works(proxy, client, "m")
        assert len(abort_calls) == 2


@pytest.mark.parametrize("watcher", [True, False], ids=["hangup-watcher", "no-watcher"])
async def test_the_hangup_is_acted_on_before_the_request_is_cancelled(
    nursery: trio.Nursery, fake: Fake, monkeypatch: pytest.MonkeyPatch, watcher: bool
) -> None:
    # The earliest moment the proxy can know: the loop's hangup watcher, between task steps
    # (proxy/hangup.py), or where there is none (no epoll), the connection's read task as it
    # reads the EOF; the request's message task (a scheduler turn later) finds the work stopped.
    if watcher and not hangup.available():
        pytest.skip("no epoll here")
    if not watcher:
        monkeypatch.setattr(hangup, "available", lambda: False)
    seen_in: list[str] = []
    original = RelayBody.client_disconnected

    def client_disconnected(self: RelayBody) -> None:
        callers = {frame.f_code.co_qualname for frame, _ in walk_stack(sys._getframe(1))}
        if "HangupWatcher.poll" in callers:
            seen_in.append("hangup watcher")
        elif "ConnectionServer._read_data" in callers:
            seen_in.append("read loop")
        else:
            seen_in.append("message task")
        original(self)

    monkeypatch.setattr(RelayBody, "client_disconnected", client_disconnected)
    # The server's watcher polls after every wait for I/O: on a loop this idle it otherwise
    # polls once a millisecond, and the read task may come first.
    monkeypatch.setattr(hangup, "DEFAULT_INTERVAL", 0)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        raw = await RawClient.post(
            proxy, CHAT, chat_body(fake={"ttft": 0, "interval": 0.02, "tokens": 1000})
        )
        await raw.read_until(b"data: ", count=3)
        await raw.close()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        await proxy.state.tracker.wait_idle()
        # The message task gets its turn after the body has closed, and the response's task
        # lets go of the body as it finishes: wait for both, within the deadline.
        await poll_until(lambda: len(seen_in) == 2)
        # Freed (test_lifetime checks that no cyclic GC is needed for it).
        await poll_until(lambda: not proxy.state.tracker.alive)
    # First the earliest observer, then the message task's call finds it done.
    assert seen_in == ["hangup watcher" if watcher else "read loop", "message task"]


async def read_forever(
    raw: RawClient, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reads the answer as it comes; started once its first event is in."""
    await raw.read_until(b"data: ")
    task_status.started()
    while await raw.stream.receive_some(65536):
        pass


async def test_clients_leaving_never_count_against_the_upstream(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    # The abort shuts the upstream socket down under a producer that may still run before its
    # cancellation lands; whatever it then sees (an early EOF) is the client's doing, not the
    # replica's: no failure, no upstream error, no retry, no ejection.
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        (replica,) = proxy.state.replicas.values()
        # Tokens every millisecond, read as they come: at the moment of each disconnect a
        # producer is likely to be runnable already (its upstream readable), the case where
        # it gets to run before its cancellation and reads the shut-down socket's EOF.
        body = chat_body(fake={"ttft": 0, "interval": 0.001, "tokens": 100_000})
        for _ in range(3):
            raws = [await RawClient.post(proxy, CHAT, body) for _ in range(10)]
            async with trio.open_nursery() as readers:
                # Every stream under way before any client leaves (however slow the machine
                # is to start them), then a while of tokens flowing.
                for raw in raws:
                    await readers.start(read_forever, raw)
                await trio.sleep(0.1)
                readers.cancel_scope.cancel()
            for raw in raws:
                await raw.close()
            await proxy.state.tracker.wait_idle()
        assert replica.load.consecutive_failures == 0
        assert not replica.load.ejected(trio.current_time())
        assert proxy.state.tracker.cancelled == 30
        assert "sluice_upstream_errors_total{" not in proxy.state.metrics.render("")[0].decode()
        await request_works(proxy, client, "fake-model")


class GoneSink:
    """A sink whose client has already left: what the producer sees after the read task's
    hook shut its upstream connection down but before its cancellation lands."""

    started = False
    client_gone = True

    def set_phase(self, phase: str) -> None:
        pass

    def offer(self, chunk: bytes) -> bool:
        return True

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        pass

    def begin(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing to begin for a client that left")

    async def send(self, chunk: bytes) -> None:
        raise AssertionError("nothing to send to a client that left")


async def test_a_failure_after_the_client_left_is_not_the_replicas(nursery: trio.Nursery) -> None:
    # Deterministic form of the race above: the exchange fails (here, the upstream answers
    # 500) while the sink says the client is gone. No failure verdict, no upstream error
    # counted, and no retry on the other replica.
    with trio.fail_after(DEADLINE):
        fakes = [await start_fake(nursery, ttft=0, interval=0, tokens=3) for _ in "ab"]
        config = config_from_mapping(
            {"models": {"m": {"upstreams": [fake.url for fake in fakes], "max_attempts": 2}}},
            "test",
            env={},
        )
        (model,) = config.models
        replicas = [UpstreamReplica(url, config.upstream) for url in model.upstreams]
        metrics = Metrics()
        backend = UpstreamBackend(model, replicas, config.relay, metrics=metrics)
        raw = json.dumps(chat_body("m", fake={"mode": "status", "status": 500})).encode()
        request = parse_completion_request(raw, Endpoint.CHAT)
        try:
            with pytest.raises(ApiError):
                await backend.produce(request, "gone-1", GoneSink())
        finally:
            for replica in replicas:
                await replica.aclose()
    assert sum(len(fake.recorder.records) for fake in fakes) == 1
    assert [replica.load.consecutive_failures for replica in replicas] == [0, 0]
    assert "sluice_upstream_errors_total{" not in metrics.render("")[0].decode()
