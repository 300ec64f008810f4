"""The lifetime and backpressure contracts, measured over real sockets.

A request's work lives exactly as long as its client: whatever phase the client leaves in,
the upstream connection closes within milliseconds, no task of the request remains, the httpx
pool does not keep the connection, and the next request works.
"""

from __future__ import annotations

import gc
import json
import socket
from typing import Any

import httpx
import pytest
import trio

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
    start_proxy,
    wait_until_steady,
)

CHAT = "/v1/chat/completions"
# The contract says "within a few milliseconds"; 50 ms leaves room for a loaded CI machine.
# The benchmark measures the real figure.
CANCEL_BOUND = 0.05


async def assert_request_gone(proxy: Proxy, fake: Fake, closed_at: float) -> None:
    with trio.fail_after(2):
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
    record = fake.recorder.last()
    assert record.outcome == "client_disconnected"
    assert record.disconnected_at - closed_at < CANCEL_BOUND, record.disconnected_at - closed_at
    with trio.fail_after(2):
        await proxy.state.tracker.wait_idle()
    assert producer_tasks() == []
    assert proxy.state.tracker.cancelled == 1
    # The half-read connection was closed, not returned to the pool.
    for replica in proxy.state.replicas.values():
        assert replica.pool_connections() == []


async def assert_next_request_works(proxy: Proxy, client: httpx.AsyncClient) -> None:
    response = await client.post(proxy.url + CHAT, json=chat_body(fake={"ttft": 0}))
    assert response.status_code == 200
    assert sse_payloads(response.text)[-1] == "[DONE]"


PHASES: dict[str, tuple[dict[str, Any], bytes | None]] = {
    # fake override, and what the client waits to read before it leaves (None: nothing)
    "awaiting upstream headers": ({"mode": "stall_headers"}, None),
    "awaiting first token": ({"ttft": 30}, None),
    "mid-stream": ({"ttft": 0, "interval": 0.02, "tokens": 1000}, b"data: "),
    "stalled upstream mid-stream": ({"ttft": 0, "mode": "stall", "at": 3}, b"data: "),
}


@pytest.mark.parametrize("phase", list(PHASES))
async def test_stream_disconnect_in_each_phase(
    phase: str, nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    override, wait_for = PHASES[phase]
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        raw = await RawClient.post(proxy, CHAT, chat_body(fake=override))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        if wait_for is not None:
            await raw.read_until(wait_for, count=3)
        else:
            await trio.sleep(0.05)  # really idle in that phase, not racing the request
        assert len(proxy.state.tracker.active) == 1
        closed_at = await raw.close()
        await assert_request_gone(proxy, fake, closed_at)
        await assert_next_request_works(proxy, client)


async def test_non_streaming_disconnect(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        raw = await RawClient.post(proxy, CHAT, chat_body(stream=False, fake={"ttft": 30}))
        await fake.recorder.wait_for(lambda r: len(r.records) == 1)
        await trio.sleep(0.05)
        closed_at = await raw.close()
        await assert_request_gone(proxy, fake, closed_at)
        await assert_next_request_works(proxy, client)


async def test_disconnect_while_queued_for_an_upstream_slot(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    """httpcore #1093: a request cancelled while it waits for a pool slot must not leak one."""
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, upstream={"max_connections": 2}
        )
        busy = [await RawClient.post(proxy, CHAT, chat_body(fake={"ttft": 30})) for _ in "ab"]
        await fake.recorder.wait_for(lambda r: len(r.records) == 2)
        # Three clients queue behind the two busy slots, then leave.
        queued = [await RawClient.post(proxy, CHAT, chat_body()) for _ in "cde"]
        await proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 5)
        for client_conn in queued:
            await client_conn.close()
        for client_conn in busy:
            await client_conn.close()
        await proxy.state.tracker.wait_idle()
        assert len(fake.recorder.records) == 2  # the queued ones never reached the upstream
        (replica,) = proxy.state.replicas.values()
        assert replica.pool_connections() == []
        # If slots had leaked, these would hang or fail with PoolTimeout.
        async with trio.open_nursery() as requests:
            for _ in range(4):
                requests.start_soon(assert_next_request_works, proxy, client)


async def test_disconnect_with_pipelined_bytes_is_seen_on_the_next_write(
    nursery: trio.Nursery, fake: Fake
) -> None:
    """Bytes after a request pause h11's reader, so hypercorn learns of the close only when a
    write fails: the upstream must still close, one token interval later at most."""
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        pipelined = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        raw = await RawClient.post(
            proxy,
            CHAT,
            chat_body(fake={"ttft": 0, "interval": 0.05, "tokens": 1000}),
            extra=pipelined,
        )
        await raw.read_until(b"data: ", count=2)
        closed_at = await raw.close()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        record = fake.recorder.last()
        assert record.disconnected_at - closed_at < 0.05 * 3 + CANCEL_BOUND
        await proxy.state.tracker.wait_idle()
        assert producer_tasks() == []


async def test_slow_reader_applies_backpressure_then_is_cut_off(nursery: trio.Nursery) -> None:
    capacity = 4
    stall_timeout = 2.0
    with trio.fail_after(DEADLINE):
        # A fast, long stream with small socket buffers on both upstream legs, so that the
        # pause reaches the fake upstream after little data.
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=200_000, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": capacity, "stall_timeout": stall_timeout},
            upstream={"socket_rcvbuf": 4096},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096)
        await raw.read_until(b"data: ", count=3)
        stopped_reading = trio.current_time()
        # The client stops reading. The proxy's socket buffers fill, then the channel, then
        # the producer blocks, then the upstream read stops: the fake stops sending.
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        buffered: list[int] = []

        def sample_sent() -> int:
            buffered.append(relay.buffered())
            return int(fake.recorder.last().tokens_sent)

        sent = await wait_until_steady(sample_sent)  # the upstream is paused...
        assert sent[-1] < 200_000 // 4, sent  # ...long before the end of its stream
        assert max(buffered) <= capacity
        assert buffered[-1] == capacity  # the backlog is held in the bounded channel
        # After stall_timeout without progress the client is cut off and its upstream closed.
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        record = fake.recorder.last()
        assert record.outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()
        # hypercorn's send_all is shielded, so the relay frees the handler by resetting the
        # client's connection (asgi.abort_transport) when it detects the stall.
        assert trio.current_time() - stopped_reading < stall_timeout + 1 + 2
        assert proxy.state.tracker.stalled == 1
        assert proxy.state.metrics.registry.get_sample_value("sluice_stalled_clients_total") == 1
        assert producer_tasks() == []
        # The connection itself is dropped too, though this client never closed it:
        # draining what was buffered ends in EOF or reset.
        try:
            while await raw.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        await raw.stream.aclose()


async def test_many_clients_leaving_mid_stream_leave_nothing_behind(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=1000)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        clients = [await RawClient.post(proxy, CHAT, chat_body()) for _ in range(20)]
        for raw in clients:
            await raw.read_until(b"data: ", count=2)
        for raw in clients:
            await raw.close()
        await fake.recorder.wait_for(
            lambda r: all(record.disconnected_at is not None for record in r.records)
        )
        await proxy.state.tracker.wait_idle()
        assert producer_tasks() == []
        assert proxy.state.tracker.cancelled == 20
        (replica,) = proxy.state.replicas.values()
        assert replica.pool_connections() == []
        response = await client.post(
            proxy.url + CHAT, json=chat_body(stream=False, fake={"tokens": 2})
        )
        assert json.loads(response.text)["usage"]["completion_tokens"] == 2


async def test_a_slow_reader_that_keeps_reading_is_not_cut_off(nursery: trio.Nursery) -> None:
    """Stalled means no progress for stall_timeout, not slow: a client that reads a little at
    a time, for much longer than stall_timeout in all, gets its whole answer."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=600, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 2, "stall_timeout": 0.5},
            upstream={"socket_rcvbuf": 4096},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096, mss=1460)
        started = trio.current_time()
        fullest = 0
        while b"data: [DONE]" not in raw.received:
            chunk = await raw.stream.receive_some(2048)
            assert chunk, "the proxy cut a client that was still reading"
            raw.received += chunk
            fullest = max([fullest, *(relay.buffered() for relay in proxy.state.tracker.active)])
            await trio.sleep(0.02)
        assert trio.current_time() - started > 1.0  # far longer than stall_timeout in all
        assert fullest == 2  # and the proxy was held back by this reader all along
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.stalled == 0


@pytest.mark.parametrize(
    ("fake", "status"),
    [
        ({}, 200),
        # Failed relays keep their error (for the access log), whose traceback and chained
        # errors held the producer's frames, and so the body: an upstream's 500 before the
        # head, and an error event after it.
        ({"mode": "status", "status": 500}, 502),
        ({"mode": "eof", "at": 2}, 200),
    ],
    ids=["completed", "upstream-500", "in-band-error"],
)
async def test_a_finished_relay_is_freed_by_reference_counting(
    nursery: trio.Nursery, fake: dict[str, Any], status: int
) -> None:
    # A finished relay (its channel, the request body, the producer's state) must not wait for
    # the cyclic garbage collector, which a serving process runs rarely (server.tune_gc): the
    # connection and the body it sends used to refer to each other.
    with trio.fail_after(DEADLINE):
        upstream = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(nursery, {"fake-model": [upstream.url]})
        gc.collect()
        gc.disable()
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                for _ in range(3):
                    response = await client.post(proxy.url + CHAT, json=chat_body(fake=fake))
                    assert response.status_code == status
            await proxy.state.tracker.wait_idle()
            await trio.sleep(0.1)
            assert len(proxy.state.tracker.alive) == 0
        finally:
            gc.enable()


@pytest.fixture
def small_proxy_sndbuf(monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.server import chunk_writer
    from proxy.server.asgi import transport_socket

    original_attach = chunk_writer.attach
    original_start = chunk_writer.start_response

    def small_sndbuf(send: Any) -> None:
        transport_socket(send).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

    def attach(send: Any, headers: Any, stall_timeout: float) -> Any:
        small_sndbuf(send)
        return original_attach(send, headers, stall_timeout)

    def start_response(send: Any, status: int, headers: Any, stall_timeout: float) -> Any:
        # The fast path's way in (the head leaves with the first event): attach is not called.
        small_sndbuf(send)
        return original_start(send, status, headers, stall_timeout)

    monkeypatch.setattr(chunk_writer, "attach", attach)
    monkeypatch.setattr(chunk_writer, "start_response", start_response)


async def test_a_client_that_stalls_after_the_last_token_is_cut_off(
    nursery: trio.Nursery, small_proxy_sndbuf: None
) -> None:
    # The producer's stall limit covers a full channel; once the producer is done (here the
    # whole rest of the stream fits in the channel), the body's own writes must be bounded
    # too, or the request (and the server's shutdown) waits on the client forever.
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3000)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 4000, "stall_timeout": 0.5},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096, mss=1460)
        try:
            await raw.read_until(b"data: ", count=2)  # then never reads again
            await poll_until(lambda: not producer_tasks())
            await poll_until(lambda: proxy.state.tracker.stalled == 1)
            await proxy.state.tracker.wait_idle()
        finally:
            await raw.stream.aclose()
