"""The lifetime contract on every path, the cancellation-correctness harness: a client leaves in
every phase of a request, over every transport, in front of every backend, and the request must
leave nothing behind.

Testing policy
--------------

* **What is proved.** For each (phase, transport, backend) the client disconnects — a real TCP
  close from :class:`tests.support.RawClient`, so the test, not an HTTP library, decides the
  moment — and then, each with a bound:

  - the work stops: the fake upstream sees its connection close within ``CANCEL_BOUND`` of the
    client's close; the local worker thread returns and frees its slot within the model step in
    progress plus ``LOCAL_MARGIN`` (and starts at most that one step after the close);
  - no task of the request remains: no relay in the tracker, no producer task, and the proxy's
    whole task tree is back to the set it had when idle;
  - no socket of the request remains: no pooled upstream connection that served it (every pooled
    connection is idle, one for one with the fake's open connections), and no file descriptor of
    this process that was not open before the request;
  - its memory is released: after ``gc.collect()`` no :class:`~proxy.relay.RelayBody` is alive;
  - the next request works. Every proxy here runs with ``[upstream] max_connections = 1`` and one
    local slot, so a leaked semaphore slot, pool connection (httpcore #1093) or model slot makes
    that next request hang, and its ``fail_after`` fails the test.

* **Phases are reached, not slept into.** Before the client leaves, each driver waits for a
  condition showing that the request is in its phase: waiting on the replica's semaphore or in
  the admission queue, the producer parked in httpcore's connect or header read or in
  ``_relay_stream`` (read from the producer task's await frames), the model inside its prefill,
  tokens received. The one exception is the upstream's non-streaming "mid_stream", which nothing
  outside the fake can see: the driver waits until the fake's schedule is three tokens in.

* **Baselines.** Each case starts its own fake upstream and proxy on 127.0.0.1, port 0, warms both
  backends with one complete request, waits until the proxy's task tree is idle again, and only
  then records tasks, file descriptors and counters. "After the last token" has nothing to
  cancel, and must leak nothing either; its upstream connection goes back to the pool, idle.

* **Matrix and marks.** ``PHASES`` x ``TRANSPORTS`` x ``BACKENDS``, less ``NOT_APPLICABLE``
  (with the reason for each). The upstream backend appears twice, once per upstream transport:
  ``upstream`` (the lean HTTP/1.1 client) and ``upstream-httpx`` (a model with ``transport =
  "httpx"`` in front of the same fake), with the same drivers and bounds. The endpoint axis
  (``_endpoint_matrix``): the upstream backends' drivers again, with the Responses API,
  Anthropic Messages, embeddings and a pass-through path (``/tokenize``) in place of chat;
  embeddings and pass-through answer whole and at once, so they have no SSE column and no
  "mid_stream". The SSE column (for the other endpoints, on the lean transport) is the fast
  subset that ``make test`` runs; the rest is ``slow``. A hypothesis test picks the
  moment of the disconnect (anywhere in the stream, or after it) and the transport and backend
  at random, and checks the same invariants.

* **A pipelined byte, on both server paths** (``_pipelined_byte_matrix``): the same phases,
  transports and backends, each on the fast path and on hypercorn (``[server] fast_path =
  false``), with a client that sends one more byte (the start of a next request) once its
  request is in its phase, lets the proxy take it in, and then leaves. Such a byte ends the
  fast path's wait for the socket's EOF and pauses hypercorn's reader behind the first answer,
  so the FIN is seen only when something else wakes the loop: the bounds above must hold all
  the same. The fast subset: SSE on the lean transport, on both paths; the rest is ``slow``.

* **Traces.** Every case runs with tracing on (only the standard ``OTEL_EXPORTER_OTLP_*``
  variables), exporting to a real OTLP/HTTP receiver in this process. Each request a case sends
  carries a ``traceparent`` with a fresh trace id; once the invariants above hold, the spans
  are flushed, and every such request must have one access line and a trace that says the same
  (:func:`proxy.testing.trace_check.judge`: every span ended, nested, with the line's outcome,
  and a departure's events). The trial's line must say :func:`expected_outcome` of its phase,
  the same expectation the cancellation counter is checked against. The warm-up's traces are
  not looked at (their ids are not kept), nor the exporter's connections counted as the
  request's descriptors.

* **Hygiene.** Every test runs under ``trio.fail_after``. No virtual clock: real sockets, real
  worker threads. Conditions are waited for (events, or polling where there is none), never
  assumed after a fixed sleep.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import logging
import re
import socket
import struct
import termios
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy.server.run
from inference.batching import DEFAULT_PREFILL_CHUNK_ALONE
from proxy.backends.local import LocalBackend
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.bench.sweep.observe import AccessLines, open_fds, task_tree
from proxy.ops import tracing
from proxy.ops.logs import ACCESS_LOGGER
from proxy.relay.state import Phase
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream
from proxy.testing.otlp_receiver import Receiver, otlp_receiver
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    RawClient,
    SlowModel,
    chat_body,
    per_token_slowed,
    poll_until,
    producer_tasks,
    slowed,
    start_fake,
    start_proxy,
)
from tests.tracing_support import (
    Traced,
    flush,
    new_traceparent,
    verdict,
    without_collector,
)

CHAT = "/v1/chat/completions"
# "Within a few milliseconds" (DESIGN.md); 50 ms leaves room for a loaded 2-core machine.
CANCEL_BOUND = 0.05
# Past the model step in progress, for the thread to notice and return and the slot to free.
LOCAL_MARGIN = 0.1
# For the rest of the request's state to go (tasks, sockets) once its work has stopped.
SETTLE = 2.0
# The local model's slowed prefill, for "first_token".
PREFILL = 0.3
# A decode step, for "mid_stream" and for a request that holds the only slot.
STEP = 0.05
# A local answer that runs for as long as any cell needs, and fits the tiny model's 512-token
# context beside a short chat's prompt (a request past the context is refused before it queues).
LONG_ANSWER = 400
# A long upstream stream: the client always leaves before its end.
LONG_STREAM = {"ttft": 0, "interval": 0.02, "tokens": 1000}
# How long a band-0 request waits before it pauses a less urgent stream (the paused phase's).
PREEMPT_AFTER = 0.05
# The band of the paused phase's trial (a request may make itself less urgent, in its body).
BATCH_BAND = 5

PHASES = tuple(Phase)
# WebSocket: add "websocket" here (and to Rig.post/read_to_end) once the proxy serves it.
TRANSPORTS = ("sse", "json")
# "upstream" relays through the lean HTTP/1.1 client, "upstream-httpx" through httpx (the same
# fake upstream, a model with transport = "httpx"): both keep every contract.
BACKENDS = ("upstream", "upstream-httpx", "local")
UPSTREAM_BACKENDS = ("upstream", "upstream-httpx")
# Where each upstream transport's producer parks while it connects, and while it waits for
# the response head (read from the producer task's await frames).
CONNECTING_IN = {"upstream": "_connect_to_address", "upstream-httpx": "connect_tcp"}
READING_HEAD_IN = {"upstream": "_read_head", "upstream-httpx": "_receive_response_headers"}


# What a client that left at a random moment may have ended its request with.
ANY_ENDING = ("completed", *(f"cancelled({phase})" for phase in Phase))


# The access line names the phase by what the proxy has seen and handed on, the matrix by
# where the work is; they differ in these cells. A whole (JSON) response: an upstream's head
# comes with its end, so the proxy still waits for it (head); the local model hands its answer
# on at the end, so no token went out (first_token).
WHOLE_SEEN_AS = {
    (Phase.FIRST_TOKEN, "upstream"): Phase.HEAD,
    (Phase.MID_STREAM, "upstream"): Phase.HEAD,
    (Phase.MID_STREAM, "local"): Phase.FIRST_TOKEN,
}


def expected_outcome(phase: Phase, transport: str, backend: str, endpoint: str) -> str:
    """What the access line (and so the trace) says of a trial that leaves in ``phase``."""
    if phase == Phase.AFTER_LAST:
        return "completed"
    kind = "local" if backend == "local" else "upstream"
    if transport == "json":
        phase = WHOLE_SEEN_AS.get((phase, kind), phase)
    return f"cancelled({phase})"


NOT_APPLICABLE = {
    (Phase.CONNECTING, "local"): "the local backend opens no connection",
    (Phase.HEAD, "local"): (
        "no phase of its own: the local worker sets the head right before the prefill (SSE) "
        "or after the whole generation (JSON), which first_token and mid_stream cover"
    ),
}


# The endpoint axis (upstream backends; the local model's Responses and Messages are in
# tests/api/test_endpoints.py): each endpoint's request, and how its stream says it is done.
ENDPOINT_PATHS = {
    "chat": CHAT,
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "embeddings": "/v1/embeddings",
    "passthrough": "/tokenize",
}
STREAM_ENDS = {
    "chat": b"data: [DONE]",
    "responses": b"event: response.completed",
    "messages": b"event: message_stop",
}
# A token on each endpoint's stream (what "mid_stream" counts).
TOKEN_MARKS = {"chat": b"data: ", "responses": b"output_text.delta", "messages": b"text_delta"}
# Embeddings and pass-through answer whole, at once: no stream, and no middle to leave in.
WHOLE_ONLY = ("embeddings", "passthrough")


def endpoint_body(endpoint: str, model: str, stream: bool, **options: Any) -> dict[str, Any]:
    fake = options.pop("fake", {})
    if endpoint == "chat":
        return chat_body(model, stream=stream, fake=fake, **options)
    shaped: dict[str, Any] = {
        "responses": {"input": "hello there", "stream": stream},
        "messages": {
            "max_tokens": 1000,
            "messages": [{"role": "user", "content": "hello there"}],
            "stream": stream,
        },
        "embeddings": {"input": "hello there"},
        "passthrough": {"prompt": "hello there"},
    }[endpoint]
    return {"model": model, **shaped, "fake": fake, **options}


# Only a stream is ever paused (a whole answer has no client stream to carry on), and only on
# the endpoints whose answer can be continued (chat and completions).
PAUSED_TRANSPORTS = ("sse",)


def applies(phase: Phase, transport: str) -> bool:
    return phase != Phase.PAUSED or transport in PAUSED_TRANSPORTS


def _endpoint_matrix() -> list[Any]:
    cases = []
    for endpoint in ("responses", "messages", *WHOLE_ONLY):
        for phase in PHASES:
            if endpoint in WHOLE_ONLY and phase == Phase.MID_STREAM:
                continue  # the answer comes whole, at once: there is no middle
            if phase == Phase.PAUSED:
                continue  # never paused: its answer cannot be continued
            for backend in UPSTREAM_BACKENDS:
                for transport in ("json",) if endpoint in WHOLE_ONLY else TRANSPORTS:
                    fast = transport == "sse" and backend == "upstream"
                    cases.append(
                        pytest.param(
                            endpoint,
                            phase,
                            transport,
                            backend,
                            marks=() if fast else (pytest.mark.slow,),
                            id=f"{endpoint}-{backend}-{transport}-{phase}",
                        )
                    )
    return cases


def _matrix() -> list[Any]:
    cases = []
    for phase in PHASES:
        for backend in BACKENDS:
            if (phase, backend) in NOT_APPLICABLE:
                continue  # omitted, not skipped: the combination does not exist (see above)
            for transport in TRANSPORTS:
                if not applies(phase, transport):
                    continue
                marks = () if transport == "sse" else (pytest.mark.slow,)
                cases.append(
                    pytest.param(
                        phase, transport, backend, marks=marks, id=f"{backend}-{transport}-{phase}"
                    )
                )
    return cases


def _pipelined_byte_matrix() -> list[Any]:
    """The chat matrix again, with a pipelined byte before the client leaves, on both server
    paths (fast path: True); the fast subset is SSE on the lean transport."""
    cases = []
    for fast_path in (True, False):
        server = "fast_path" if fast_path else "hypercorn"
        for phase in PHASES:
            for backend in BACKENDS:
                if (phase, backend) in NOT_APPLICABLE:
                    continue
                for transport in TRANSPORTS:
                    if not applies(phase, transport):
                        continue
                    fast = transport == "sse" and backend == "upstream"
                    cases.append(
                        pytest.param(
                            fast_path,
                            phase,
                            transport,
                            backend,
                            marks=() if fast else (pytest.mark.slow,),
                            id=f"{server}-{backend}-{transport}-{phase}",
                        )
                    )
    return cases


# -- tracing ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as running:
        yield running


@pytest.fixture
def traced(receiver: Receiver) -> Iterator[Traced]:
    """Tracing on for the proxy a case starts, and its access lines kept; off again after, so
    that no later test is traced (tracing.ACTIVE is the process's)."""
    lines = AccessLines()
    access = logging.getLogger(ACCESS_LOGGER)
    level = access.level
    access.addHandler(lines)
    access.setLevel(logging.INFO)
    try:
        yield Traced(receiver, lines)
    finally:
        access.removeHandler(lines)
        access.setLevel(level)
        if tracing.ACTIVE is not None:
            tracing.ACTIVE.shutdown()


# -- what the harness observes ---------------------------------------------------------------


def proxy_tasks() -> set[trio.lowlevel.Task]:
    """Every task of the proxy: the tree under ``proxy.server.run.serve`` (hypercorn, quart-trio,
    the relays). The fake upstream and the test itself are not part of it."""
    serve_code = proxy.server.run.serve.__code__
    roots = [
        task
        for task in task_tree(trio.lowlevel.current_root_task())
        if getattr(task.coro, "cr_code", None) is serve_code
    ]
    assert len(roots) == 1, roots
    return task_tree(roots[0])


def connection_handlers(tasks: set[trio.lowlevel.Task]) -> list[trio.lowlevel.Task]:
    """hypercorn's task per client connection (trio.serve_listeners runs each handler in one)."""
    return [task for task in tasks if task.name.endswith("serve_listeners._run_handler")]


def producer_stacks() -> list[list[str]]:
    """The function names each live producer task is awaiting in, outermost first."""
    return [
        [frame.f_code.co_name for frame, _ in task.iter_await_frames()] for task in producer_tasks()
    ]


async def wait_for_producer_in(function: str) -> None:
    await poll_until(lambda: any(function in stack for stack in producer_stacks()))


def worker_threads_busy() -> int:
    """Trio worker threads running a request's job now (its prompt's tokenizing; trio renames
    a worker after its job ends). The model's batch engine has a thread of its own."""
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("_prepare from "))


async def settle(predicate: Callable[[], object], describe: Callable[[], str]) -> None:
    """Wait up to SETTLE for ``predicate``; fail with ``describe()`` if it never holds."""
    with trio.move_on_after(SETTLE):
        await poll_until(predicate)
        return
    raise AssertionError(f"not within {SETTLE}s: {describe()}")


@contextlib.contextmanager
def unreachable_port() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A listener that never accepts, with its backlog full: the kernel drops further SYNs, so a
    connect hangs like one to an unreachable host, without leaving loopback."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield listener, filler


# -- one proxy in front of both backends -----------------------------------------------------


@dataclass
class Rig:
    proxy: Proxy
    fake: Fake
    model: SlowModel
    # The baseline, taken once the warm-up request of each backend is done and gone.
    idle_tasks: set[trio.lowlevel.Task] = field(default_factory=set)
    fds: Counter[str] = field(default_factory=Counter)
    fd_count: int = 0
    cancelled: int = 0
    records: int = 0
    # Which upstream transport the drivers use: "upstream" (lean) or "upstream-httpx".
    upstream: str = "upstream"
    # Which endpoint the upstream drivers' requests go to (ENDPOINT_PATHS).
    endpoint: str = "chat"
    traced: Traced | None = None
    # Whether each request's client sends one more byte before it leaves (PipeliningClient).
    pipelined_byte: bool = False
    # Each request sent since the baseline: its trace id and backend.
    sent: dict[RawClient, tuple[str, str]] = field(default_factory=dict)

    @property
    def local(self) -> LocalBackend:
        return self.proxy.state.local_backends["tiny"]

    @property
    def replica(self) -> UpstreamReplica:
        return self.replica_of(self.upstream)

    def replica_of(self, backend: str) -> UpstreamReplica:
        if backend == "upstream-httpx":
            return self.proxy.state.replicas[f"{self.fake.url} (httpx)"]
        return self.proxy.state.replicas[self.fake.url]

    def upstream_waiting(self) -> int:
        """Requests waiting in Sluice's queue for an upstream replica, over every model."""
        return sum(
            backend.admission.waiting
            for backend in self.proxy.state.backends.values()
            if isinstance(backend, UpstreamBackend)
        )

    def fake_replicas(self) -> list[UpstreamReplica]:
        return [self.replica_of(backend) for backend in UPSTREAM_BACKENDS]

    def model_name(self, name: str) -> str:
        """The lean model ``name``, or its httpx twin when the drivers use httpx."""
        return f"{name}-httpx" if self.upstream == "upstream-httpx" else name

    def path(self, backend: str, endpoint: str | None = None) -> str:
        if backend not in UPSTREAM_BACKENDS:
            return CHAT
        return ENDPOINT_PATHS[endpoint or self.endpoint]

    def body(
        self, backend: str, transport: str, endpoint: str | None = None, **options: Any
    ) -> dict[str, Any]:
        stream = transport == "sse"
        if backend in UPSTREAM_BACKENDS:
            default = "fake-httpx" if backend == "upstream-httpx" else "fake-model"
            model = options.pop("model", default)
            return endpoint_body(endpoint or self.endpoint, model, stream, **options)
        return chat_body("tiny", stream=stream, max_tokens=options.pop("max_tokens", 5), **options)

    async def post(
        self, backend: str, transport: str, endpoint: str | None = None, **options: Any
    ) -> RawClient:
        if backend == "upstream":
            backend = self.upstream
        body = self.body(backend, transport, endpoint, **options)
        trace_id, traceparent = new_traceparent()
        client = PipeliningClient if self.pipelined_byte else RawClient
        raw = await client.post(
            self.proxy, self.path(backend, endpoint), body, headers={"traceparent": traceparent}
        )
        self.sent[raw] = (trace_id, backend)
        return raw

    def request_fds(self) -> Counter[str]:
        """This process's descriptors, less the exporter's and the receiver's connections."""
        fds = open_fds()
        return fds if self.traced is None else without_collector(fds, self.traced.port)

    def in_flight_connections(self) -> set[Any]:
        """Upstream connections serving a request now (connecting, or not idle)."""
        return {
            connection
            for replica in self.proxy.state.replicas.values()
            for connection in replica.pool_connections()
            if not connection.is_idle()
        }

    async def warm_up(self) -> None:
        for backend in BACKENDS:
            raw = await self.post(backend, "sse")
            await read_to_end(raw, "sse")
            await raw.close()
        await self.proxy.state.tracker.wait_idle()
        # hypercorn starts its listener tasks only after reporting the bind, so the idle set
        # is taken now: listening, and no client connection left.
        await settle(
            lambda: not connection_handlers(proxy_tasks()),
            lambda: f"the warm-up's connections remain: {connection_handlers(proxy_tasks())}",
        )
        # The warm-up's garbage (httpx's and httpcore's objects among it) is collected now, not
        # by an automatic collection in the middle of a timed disconnect.
        gc.collect()
        self.idle_tasks = proxy_tasks()
        self.fds = self.request_fds()
        self.fd_count = sum(self.fds.values())
        self.sent.clear()
        self.cancelled = self.proxy.state.tracker.cancelled
        self.records = len(self.fake.recorder.records)


def unacknowledged(stream: trio.SocketStream) -> int:
    """Bytes ``stream`` has sent that its peer's kernel has not acknowledged yet."""
    (count,) = struct.unpack("i", fcntl.ioctl(stream.socket.fileno(), termios.TIOCOUTQ, b"\0" * 4))
    return int(count)


async def taken_in(stream: trio.SocketStream) -> None:
    """Once what ``stream`` sent is in the proxy's socket (acknowledged: a loaded machine may
    deliver loopback segments late), and the proxy has run on it (its read, or its watch for
    EOF, woken and done) and waits again, as every task does."""
    await poll_until(lambda: unacknowledged(stream) == 0)
    await trio.testing.wait_all_tasks_blocked()


async def send_pipelined_byte(stream: trio.SocketStream) -> None:
    """One byte after the request (the start of a next one), taken in by the proxy: a FIN that
    comes after it is then seen only if the proxy watches past it."""
    await stream.send_all(b"P")
    await taken_in(stream)


def leave_at_once(raw: RawClient) -> float:
    """Close ``raw``'s socket with no checkpoint after it; the time of the close. A client in
    another process wakes nothing in the proxy's loop when it leaves; this one's ``aclose``
    would (its checkpoint runs a scheduler round, and the hangup watcher's poll with it, right
    after the FIN), and so hide a departure that nothing else would notice. The caller's next
    await should be the one wait for what it expects."""
    raw.stream.socket.close()
    return trio.current_time()


class PipeliningClient(RawClient):
    """A client that, when it leaves, first sends one byte after its request and lets the proxy
    take it in (:func:`send_pipelined_byte`), then closes (:func:`leave_at_once`)."""

    _sent = False

    async def ready_to_leave(self) -> None:
        if not self._sent:
            self._sent = True
            with contextlib.suppress(trio.BrokenResourceError):
                await send_pipelined_byte(self.stream)

    async def close(self) -> float:
        await self.ready_to_leave()
        return leave_at_once(self)


async def start_rig(
    nursery: trio.Nursery,
    loaded: Any,
    traced: Traced | None,
    server: dict[str, Any] | None = None,
    *,
    local_slots: int = 1,
    **more_models: Any,
) -> Rig:
    fake = await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)
    slow = slowed(loaded)
    proxy = await start_proxy(
        nursery,
        {
            "fake-model": {"upstreams": [fake.url], "passthrough": ["/tokenize"]},
            "fake-httpx": {
                "upstreams": [fake.url],
                "transport": "httpx",
                "passthrough": ["/tokenize"],
            },
            "tiny": {
                "backend": "local",
                "path": "unused-preloaded",
                "default_temperature": 0.0,
                "slots": local_slots,
                "queue_timeout": 30,
            },
            **more_models,
        },
        env=None if traced is None else traced.env,
        local_models={"tiny": slow},
        upstream={"max_connections": 1},
        server=server or {},
        # A request of band 0 that waits this long pauses a running one of a less urgent band
        # (the paused phase's); every other driver's requests are all of band 0.
        scheduling={"preempt_after": PREEMPT_AFTER},
    )
    rig = Rig(proxy, fake, slow.model, traced=traced)
    await rig.warm_up()
    return rig


async def read_to_end(raw: RawClient, transport: str, endpoint: str = "chat") -> None:
    """Read the whole response: through the stream's last event (``[DONE]`` on chat) and the
    chunked terminator (SSE), or the head and ``Content-Length`` bytes (JSON)."""
    if transport == "sse":
        await raw.read_until(STREAM_ENDS[endpoint])
        await raw.read_until(b"\r\n0\r\n\r\n")
        return
    await raw.read_until(b"\r\n\r\n")
    head = raw.received.split(b"\r\n\r\n", 1)[0]
    match = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
    assert match is not None, head
    total = len(head) + 4 + int(match[1])
    while len(raw.received) < total:
        data = await raw.stream.receive_some(65536)
        if not data:
            raise EOFError(f"connection closed; received {raw.received[-300:]!r}")
        raw.received += data


# -- the bounds ------------------------------------------------------------------------------


async def assert_upstream_saw_close(rig: Rig, record: Any, closed_at: float) -> None:
    with trio.fail_after(SETTLE):
        await rig.fake.recorder.wait_for(lambda _: record.outcome != "pending")
    assert record.outcome == "client_disconnected", record
    assert record.disconnected_at - closed_at < CANCEL_BOUND, record.disconnected_at - closed_at


async def assert_local_stopped(
    rig: Rig, closed_at: float, step: float, steps_at_close: int, *, new_steps: int = 1
) -> None:
    """The worker returned, and the slot is free, within the step in progress plus a margin;
    at most ``new_steps`` steps started after the close."""
    with trio.fail_after(SETTLE):
        await rig.local.admission.wait_free()
    freed_after = trio.current_time() - closed_at
    assert freed_after < step + LOCAL_MARGIN, freed_after
    assert rig.local.active_generations == 0
    assert rig.model.steps - steps_at_close <= new_steps, (rig.model.steps, steps_at_close)


async def assert_nothing_left(rig: Rig, request_connections: set[Any]) -> None:
    state = rig.proxy.state
    tracker = state.tracker
    with trio.fail_after(SETTLE):
        await tracker.wait_idle()
    assert producer_tasks() == []
    await settle(
        lambda: proxy_tasks() == rig.idle_tasks,
        lambda: f"tasks of the request remain: {proxy_tasks() - rig.idle_tasks}",
    )
    # The local model: thread returned, slot free, queue empty.
    with trio.fail_after(SETTLE):
        await rig.local.admission.wait_free()
    assert rig.local.active_generations == 0
    assert rig.local.engine.sequences == 0
    assert worker_threads_busy() == 0
    assert rig.local.admission.waiting == 0
    # Upstream pools: nothing of the request; every pooled connection idle and reusable, and
    # no semaphore slot held.
    for replica in state.replicas.values():
        pooled = replica.pool_connections()
        assert not request_connections & set(pooled), pooled
        assert all(connection.is_idle() for connection in pooled), pooled
        assert replica.room.in_flight == 0
    assert rig.upstream_waiting() == 0

    # The fake holds open exactly the connections the pools keep (the lean one's and
    # httpx's), no half-closed one.
    def pooled() -> int:
        return sum(len(replica.pool_connections()) for replica in rig.fake_replicas())

    await settle(
        lambda: rig.fake.recorder.open_connections == pooled(),
        lambda: f"{rig.fake.recorder.open_connections} open at the fake, {pooled()} pooled",
    )

    # Sockets: no descriptor that the baseline lacks, and no more of them. Waited for, not read
    # once: the exporter's socket is not known as the collector's before it connects.
    def fds_back() -> bool:
        fds = rig.request_fds()
        return not fds - rig.fds and sum(fds.values()) <= rig.fd_count

    await settle(
        fds_back,
        lambda: (
            f"descriptors of the request remain: {rig.request_fds() - rig.fds} "
            f"({sum(rig.request_fds().values())} open, {rig.fd_count} before)"
        ),
    )
    # Memory: the request's body (its channel, buffers, producer state) is unreachable. Often
    # refcounting alone has freed it; a full collection (~0.2 s with torch loaded) only if not.
    if len(tracker.alive):
        gc.collect()
    assert list(tracker.alive) == []


async def assert_next_request_works(rig: Rig, backend: str, transport: str, **options: Any) -> None:
    rig.model.step_seconds = rig.model.prefill_seconds = 0.0
    body = rig.body(backend, transport, **options)
    # Short: with one upstream connection and one local slot, a leak makes this hang.
    with trio.fail_after(5):
        async with httpx.AsyncClient(timeout=None, trust_env=False) as client:
            response = await client.post(rig.proxy.url + rig.path(backend), json=body)
    assert response.status_code == 200, response.text
    endpoint = rig.endpoint if backend in UPSTREAM_BACKENDS else "chat"
    if transport == "sse":
        assert (
            response.text.rstrip("\n").split("\n\n")[-1].startswith(STREAM_ENDS[endpoint].decode())
        ), response.text[-300:]
    elif endpoint == "chat":
        assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    else:
        assert isinstance(response.json(), dict)


async def assert_traces_say_what_happened(rig: Rig, trial: RawClient, expected: str | None) -> str:
    """Every request sent since the baseline has one access line, and a trace that says the
    same (ended, nested, the line's outcome, a departure's events); the trial's line says
    ``expected`` (None: any completed or cancelled one). Returns the trial's outcome."""
    traced = rig.traced
    assert traced is not None
    sent = dict(rig.sent)
    # The line is written (and the server span ended with it) as the request's relay closes.
    await settle(
        lambda: all(traced.access.of_trace(trace_id) for trace_id, _ in sent.values()),
        lambda: (
            f"no access line for {[t for t, _ in sent.values() if not traced.access.of_trace(t)]}"
        ),
    )
    await flush()
    said = ""
    for raw, (trace_id, backend) in sent.items():
        lines = traced.access.of_trace(trace_id)
        assert len(lines) == 1, lines
        outcome = lines[0]["outcome"]
        if raw is trial:
            said = outcome
            if expected is None:
                assert outcome in ANY_ENDING, lines[0]
            else:
                assert outcome == expected, lines[0]
        reason = verdict(traced.receiver, trace_id, outcome, local=backend == "local")
        assert reason is None, reason
    assert trial in sent
    return said


# -- the phases ------------------------------------------------------------------------------


@dataclass
class Left:
    """What a driver saw: the upstream connections the request used while in its phase, how
    many relays the disconnect cancelled, and the request that left in the phase (the trial;
    a driver may send others, as the queued ones' holder)."""

    connections: set[Any]
    cancelled: int
    trial: RawClient


async def upstream_queued(rig: Rig, transport: str) -> Left:
    holder = await rig.post("upstream", "sse", endpoint="chat", fake=LONG_STREAM)
    await holder.read_until(b"data: ")
    holder_record = rig.fake.recorder.last()
    raw = await rig.post("upstream", transport)
    # The replica's only slot is the holder's: this one waits in Sluice's queue.
    await poll_until(lambda: rig.upstream_waiting() == 1)
    connections = rig.in_flight_connections()
    closed_at = await raw.close()
    await rig.proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
    assert trio.current_time() - closed_at < CANCEL_BOUND
    assert rig.upstream_waiting() == 0
    assert len(rig.fake.recorder.records) == rig.records + 1  # it never reached the upstream
    closed_at = await holder.close()
    await assert_upstream_saw_close(rig, holder_record, closed_at)
    return Left(connections, 2, raw)


async def upstream_connecting(rig: Rig, transport: str) -> Left:
    raw = await rig.post("upstream", transport, model=rig.model_name("unreachable"))
    await wait_for_producer_in(CONNECTING_IN[rig.upstream])
    # A lean connection joins its pool once connected; httpcore's is in its pool, CONNECTING.
    # Either way a leaked socket would show in the descriptors assert_nothing_left compares.
    connections = rig.in_flight_connections()
    assert len(connections) == (1 if rig.upstream == "upstream-httpx" else 0), connections
    closed_at = await raw.close()
    with trio.fail_after(SETTLE):
        await rig.proxy.state.tracker.wait_idle()
    assert trio.current_time() - closed_at < CANCEL_BOUND
    assert len(rig.fake.recorder.records) == rig.records
    return Left(connections, 1, raw)


async def _upstream_leave_parked(rig: Rig, transport: str, fake: dict[str, Any], in_: str) -> Left:
    raw = await rig.post("upstream", transport, fake=fake)
    await rig.fake.recorder.wait_for(lambda r: len(r.records) == rig.records + 1)
    record = rig.fake.recorder.last()
    await wait_for_producer_in(in_)
    connections = rig.in_flight_connections()
    closed_at = await raw.close()
    await assert_upstream_saw_close(rig, record, closed_at)
    return Left(connections, 1, raw)


async def upstream_head(rig: Rig, transport: str) -> Left:
    fake = {"mode": "stall_headers"}
    return await _upstream_leave_parked(rig, transport, fake, READING_HEAD_IN[rig.upstream])


async def upstream_first_token(rig: Rig, transport: str) -> Left:
    # A streaming response has its head at once (vLLM's way); a whole one has nothing until
    # the end, so the proxy still waits for the head.
    parked_in = "_relay_stream" if transport == "sse" else READING_HEAD_IN[rig.upstream]
    return await _upstream_leave_parked(rig, transport, {"ttft": 30}, parked_in)


async def upstream_mid_stream(rig: Rig, transport: str) -> Left:
    raw = await rig.post("upstream", transport, fake=LONG_STREAM)
    await rig.fake.recorder.wait_for(lambda r: len(r.records) == rig.records + 1)
    record = rig.fake.recorder.last()
    if transport == "sse":
        await raw.read_until(TOKEN_MARKS[rig.endpoint], count=3)
    else:
        # Nothing of a whole response is visible before its end: the upstream is three tokens
        # into its generation by the fake's schedule.
        await trio.sleep_until(record.received_at + 3 * LONG_STREAM["interval"])
        assert producer_stacks() != []
    connections = rig.in_flight_connections()
    closed_at = await raw.close()
    await assert_upstream_saw_close(rig, record, closed_at)
    return Left(connections, 1, raw)


async def upstream_after_last_token(rig: Rig, transport: str) -> Left:
    raw = await rig.post("upstream", transport)
    await read_to_end(raw, transport, rig.endpoint)
    if transport == "json":
        # A whole body has no terminator: "after the last token" is once the proxy is done.
        await rig.proxy.state.tracker.wait_idle()
    record = rig.fake.recorder.last()
    await raw.close()
    with trio.fail_after(SETTLE):
        await rig.fake.recorder.wait_for(lambda _: record.outcome != "pending")
    assert record.outcome == "completed"
    assert record.disconnected_at is None
    # Its connection, fully read, is back in the pool and reusable (checked idle later).
    assert len(rig.replica.pool_connections()) == 1
    return Left(set(), 0, raw)


async def local_queued(rig: Rig, transport: str) -> Left:
    rig.model.step_seconds = STEP
    holder = await rig.post("local", "sse", max_tokens=LONG_ANSWER)
    await holder.read_until(b'"content":"')
    raw = await rig.post("local", transport)
    await rig.local.admission.wait_queued(1)
    closed_at = await raw.close()
    await rig.local.admission.wait_queued(0)
    await rig.proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
    assert trio.current_time() - closed_at < CANCEL_BOUND
    # The steps counted from the moment the holder leaves (after anything it sends first).
    await holder.ready_to_leave()
    steps = rig.model.steps
    closed_at = await holder.close()
    await assert_local_stopped(rig, closed_at, STEP, steps)
    return Left(set(), 2, raw)


async def local_first_token(rig: Rig, transport: str) -> Left:
    rig.model.prefill_seconds = PREFILL
    prefills = rig.model.prefills
    raw = await rig.post("local", transport, max_tokens=50)
    await poll_until(lambda: rig.model.prefills > prefills)  # the worker is in the prefill
    await raw.ready_to_leave()
    steps = rig.model.steps
    closed_at = await raw.close()
    # The prefill runs to its end (a model step cannot be interrupted), then nothing more.
    await assert_local_stopped(rig, closed_at, PREFILL, steps, new_steps=0)
    return Left(set(), 1, raw)


async def local_mid_stream(rig: Rig, transport: str) -> Left:
    rig.model.step_seconds = STEP
    steps = rig.model.steps
    raw = await rig.post("local", transport, max_tokens=400)
    if transport == "sse":
        await raw.read_until(b'"content":"', count=4)
    else:
        await poll_until(lambda: rig.model.steps >= steps + 4)
    await raw.ready_to_leave()
    steps = rig.model.steps
    closed_at = await raw.close()
    await assert_local_stopped(rig, closed_at, STEP, steps)
    return Left(set(), 1, raw)


async def local_after_last_token(rig: Rig, transport: str) -> Left:
    raw = await rig.post("local", transport, max_tokens=5)
    await read_to_end(raw, transport)
    if transport == "json":
        await rig.proxy.state.tracker.wait_idle()
    await raw.close()
    return Left(set(), 0, raw)


async def upstream_paused(rig: Rig, transport: str) -> Left:
    assert transport == "sse"
    raw = await rig.post(
        "upstream", transport, endpoint="chat", fake=LONG_STREAM, priority=BATCH_BAND
    )
    await raw.read_until(b"data: ", count=3)
    paused_record = rig.fake.recorder.last()
    # A band-0 request waits for the replica's one slot, then pauses the trial and takes it.
    urgent = await rig.post("upstream", "sse", endpoint="chat", fake=LONG_STREAM)
    await raw.read_until(b": paused")
    await urgent.read_until(b"data: ")
    urgent_record = rig.fake.recorder.last()
    assert urgent_record is not paused_record
    # The pause closed the trial's upstream stream, as a departure does.
    with trio.fail_after(SETTLE):
        await rig.fake.recorder.wait_for(lambda _: paused_record.outcome != "pending")
    assert paused_record.outcome == "client_disconnected", paused_record
    await poll_until(lambda: rig.upstream_waiting() == 1)  # paused: waiting to be continued
    connections = rig.in_flight_connections()
    closed_at = await raw.close()
    # Leaving while paused ends it at once, with nothing left queued and nothing sent again.
    await rig.proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
    assert trio.current_time() - closed_at < CANCEL_BOUND
    assert rig.upstream_waiting() == 0
    records = len(rig.fake.recorder.records)
    closed_at = await urgent.close()
    await assert_upstream_saw_close(rig, urgent_record, closed_at)
    assert len(rig.fake.recorder.records) == records
    return Left(connections, 2, raw)


async def local_paused(rig: Rig, transport: str) -> Left:
    assert transport == "sse"
    rig.model.step_seconds = STEP
    raw = await rig.post("local", transport, max_tokens=LONG_ANSWER, priority=BATCH_BAND)
    await raw.read_until(b'"content":"', count=3)
    # A band-0 request waits for the one slot, then pauses the trial (its sequence out of the
    # batch, its KV kept aside) and takes it.
    urgent = await rig.post("local", "sse", max_tokens=LONG_ANSWER)
    await raw.read_until(b": paused")
    await urgent.read_until(b'"content":"')
    await rig.local.admission.wait_queued(1)  # paused: waiting to be continued
    assert rig.local.engine.paused_kv_bytes > 0
    closed_at = await raw.close()
    # Leaving while paused ends it: nothing queued, its kept KV let go. The relay ends once the
    # engine thread has dropped the paused sequence, which it does before its next step: within
    # the step in progress (the urgent request's), not at once.
    await rig.proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
    assert trio.current_time() - closed_at < STEP + LOCAL_MARGIN
    assert rig.local.admission.waiting == 0
    await settle(
        lambda: rig.local.engine.paused_kv_bytes == 0,
        lambda: f"{rig.local.engine.paused_kv_bytes} bytes of paused KV kept",
    )
    await urgent.ready_to_leave()
    steps = rig.model.steps
    closed_at = await urgent.close()
    await assert_local_stopped(rig, closed_at, STEP, steps)
    return Left(set(), 2, raw)


# A prompt of several thousand tokens on a model with SmolLM2's context, whose prefill chunks
# cost in proportion to their tokens (a chunk alone about 0.4 s): the client leaves in the
# middle of the prefill, while a short chat sent meanwhile has had its answer.
LONG_PROMPT = "The river runs to the sea. " * 430
PER_PROMPT_TOKEN = 0.003
LONG_CHUNK = DEFAULT_PREFILL_CHUNK_ALONE * PER_PROMPT_TOKEN


async def local_long_prompt(rig: Rig, transport: str, tokenizer: Any) -> Left:
    """The client of a 3,000-token prompt leaves mid-prefill: it is let go within two chunks'
    time, with at most the chunk in progress fed after the close; a short request sent while
    the prompt is prefilled gets its first token (here its whole one-token answer) within three
    chunks' time, the long prefill still going on."""
    chunked = rig.model.inner
    messages = [{"role": "user", "content": LONG_PROMPT}]
    template = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tokenizer.encode(template, add_special_tokens=False))
    assert prompt_tokens > 2500, prompt_tokens
    chunked.chunks.clear()
    raw = await rig.post("local", transport, messages=messages, max_tokens=20)
    await poll_until(lambda: len(chunked.chunks) >= 2)
    sent_at = trio.current_time()
    short = await rig.post("local", "sse", messages=[{"role": "user", "content": "Hi"}])
    await read_to_end(short, "sse")
    first_token = trio.current_time() - sent_at
    assert first_token < 3 * LONG_CHUNK, f"first token after {first_token:.2f} s"
    await short.close()
    # The long prompt's prefill is still under way (the short one's chunks counted too).
    assert sum(chunked.chunks) < prompt_tokens, chunked.chunks
    await raw.ready_to_leave()
    fed = len(chunked.chunks)
    closed_at = await raw.close()
    with trio.fail_after(SETTLE):
        await rig.local.admission.wait_free()
    let_go = trio.current_time() - closed_at
    assert let_go < 2 * LONG_CHUNK, f"let go {let_go:.2f} s after its client left"
    assert len(chunked.chunks) <= fed + 1, chunked.chunks
    assert rig.local.engine.sequences == 0
    return Left(set(), 1, raw)


def _long_prompt_matrix() -> list[Any]:
    """Both transports on both server paths; the fast subset is SSE on the fast path."""
    return [
        pytest.param(
            fast_path,
            transport,
            marks=() if fast_path and transport == "sse" else (pytest.mark.slow,),
            id=f"{'fast_path' if fast_path else 'hypercorn'}-{transport}",
        )
        for fast_path in (True, False)
        for transport in TRANSPORTS
    ]


@pytest.mark.parametrize(("fast_path", "transport"), _long_prompt_matrix())
async def test_a_long_prompt_left_mid_prefill_leaves_nothing_behind(
    fast_path: bool,
    transport: str,
    nursery: trio.Nursery,
    long_context_loaded_model: Any,
    traced: Traced,
) -> None:
    """The local backend's prefill phase at real length: two slots (so that a short request
    can run beside the long prompt), the model slowed per prompt token; the bounds in
    :func:`local_long_prompt`, then the matrix's own checks."""
    loaded = per_token_slowed(long_context_loaded_model, PER_PROMPT_TOKEN, 0.0)
    with trio.fail_after(DEADLINE):
        rig = await start_rig(nursery, loaded, traced, {"fast_path": fast_path}, local_slots=2)
        left = await local_long_prompt(rig, transport, loaded.tokenizer)
        await assert_nothing_left(rig, left.connections)
        assert rig.proxy.state.tracker.cancelled - rig.cancelled == left.cancelled
        expected = expected_outcome(Phase.FIRST_TOKEN, transport, "local", "chat")
        await assert_traces_say_what_happened(rig, left.trial, expected)
        await assert_next_request_works(rig, "local", transport)


Driver = Callable[[Rig, str], Awaitable[Left]]
DRIVERS: dict[tuple[str, str], Driver] = {
    **{
        (phase, backend): driver
        for backend in UPSTREAM_BACKENDS
        for phase, driver in (
            (Phase.QUEUED, upstream_queued),
            (Phase.CONNECTING, upstream_connecting),
            (Phase.HEAD, upstream_head),
            (Phase.FIRST_TOKEN, upstream_first_token),
            (Phase.MID_STREAM, upstream_mid_stream),
            (Phase.PAUSED, upstream_paused),
            (Phase.AFTER_LAST, upstream_after_last_token),
        )
    },
    (Phase.QUEUED, "local"): local_queued,
    (Phase.FIRST_TOKEN, "local"): local_first_token,
    (Phase.MID_STREAM, "local"): local_mid_stream,
    (Phase.PAUSED, "local"): local_paused,
    (Phase.AFTER_LAST, "local"): local_after_last_token,
}


def test_the_matrix_is_complete() -> None:
    """Every combination is either driven or listed as not applicable, never both."""
    for phase in PHASES:
        for backend in BACKENDS:
            assert ((phase, backend) in DRIVERS) != ((phase, backend) in NOT_APPLICABLE)


@pytest.mark.parametrize(("phase", "transport", "backend"), _matrix())
async def test_disconnect_leaves_nothing_behind(
    phase: Phase,
    transport: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: Traced,
) -> None:
    await leave_and_check(nursery, tiny_loaded_model, traced, "chat", phase, transport, backend)


@pytest.mark.parametrize(("endpoint", "phase", "transport", "backend"), _endpoint_matrix())
async def test_disconnect_leaves_nothing_behind_on_every_endpoint(
    endpoint: str,
    phase: Phase,
    transport: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: Traced,
) -> None:
    await leave_and_check(nursery, tiny_loaded_model, traced, endpoint, phase, transport, backend)


@pytest.mark.parametrize(("fast_path", "phase", "transport", "backend"), _pipelined_byte_matrix())
async def test_disconnect_after_a_pipelined_byte_leaves_nothing_behind(
    fast_path: bool,
    phase: Phase,
    transport: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: Traced,
) -> None:
    """The client sends a byte after its request, then leaves: on either server path, in every
    phase, the same bounds and nothing left behind."""
    await leave_and_check(
        nursery,
        tiny_loaded_model,
        traced,
        "chat",
        phase,
        transport,
        backend,
        server={"fast_path": fast_path},
        pipelined_byte=True,
    )


async def start_rig_with_unreachable(
    nursery: trio.Nursery,
    loaded: Any,
    traced: Traced,
    port: int,
    server: dict[str, Any] | None = None,
) -> Rig:
    """The rig, with the models ``unreachable`` and ``unreachable-httpx`` whose replica is
    ``port`` (a listener of :func:`unreachable_port`: their connect never completes)."""
    unreachable = {
        "upstreams": [f"http://127.0.0.1:{port}"],
        "connect_timeout": 60,
        "passthrough": ["/tokenize"],
    }
    return await start_rig(
        nursery,
        loaded,
        traced,
        server,
        unreachable=unreachable,
        **{"unreachable-httpx": {**unreachable, "transport": "httpx"}},
    )


async def leave_and_check(
    nursery: trio.Nursery,
    loaded: Any,
    traced: Traced,
    endpoint: str,
    phase: Phase,
    transport: str,
    backend: str,
    *,
    server: dict[str, Any] | None = None,
    pipelined_byte: bool = False,
) -> None:
    with unreachable_port() as (listener, filler), trio.fail_after(DEADLINE):
        port = listener.getsockname()[1]
        rig = await start_rig_with_unreachable(nursery, loaded, traced, port, server)
        # After the warm-up, whose requests end as always.
        rig.pipelined_byte = pipelined_byte
        if backend in UPSTREAM_BACKENDS:
            rig.upstream = backend
            rig.endpoint = endpoint
        left = await DRIVERS[phase, backend](rig, transport)
        await assert_nothing_left(rig, left.connections)
        assert rig.proxy.state.tracker.cancelled - rig.cancelled == left.cancelled
        expected = expected_outcome(phase, transport, backend, endpoint)
        # The counter and the line must agree on whether the trial was cancelled at all.
        assert (expected == "completed") == (left.cancelled == 0), (expected, left.cancelled)
        await assert_traces_say_what_happened(rig, left.trial, expected)
        if phase == Phase.CONNECTING:
            # The same replica, now reachable: its one pool slot and semaphore slot are free.
            listener.close()
            filler.close()
            upstream = FakeUpstream(FakeSettings(ttft=0, interval=0, tokens=3))
            await nursery.start(upstream.serve, "127.0.0.1", port)
            await assert_next_request_works(
                rig, backend, transport, model=rig.model_name("unreachable")
            )
        else:
            await assert_next_request_works(rig, backend, transport)


# -- the disconnect at a random moment -------------------------------------------------------

# Both backends stream about 0.2 s: a first token after 0.05 s, then 15 tokens 10 ms apart.
RANDOM_FAKE = {"ttft": 0.05, "interval": 0.01, "tokens": 15}
RANDOM_PREFILL = 0.05
RANDOM_STEP = 0.01
RANDOM_TOKENS = 15
# The client leaves at a moment in [0, STREAM_TIME]: any phase, or just after the end.
STREAM_TIME = 0.3


async def disconnect_at(
    delay: float, transport: str, backend: str, loaded: Any, traced: Traced
) -> None:
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            rig = await start_rig(nursery, loaded, traced)
            if backend in UPSTREAM_BACKENDS:
                rig.upstream = backend
            rig.model.prefill_seconds = RANDOM_PREFILL
            rig.model.step_seconds = RANDOM_STEP
            raw = await rig.post(backend, transport, fake=RANDOM_FAKE, max_tokens=RANDOM_TOKENS)
            with trio.move_on_after(delay):
                await read_to_end(raw, transport)
            steps = rig.model.steps
            closed_at = await raw.close()
            with trio.fail_after(SETTLE):
                await rig.proxy.state.tracker.wait_idle()
            # Whichever phase it was in: the upstream saw the close at once, or it had
            # finished; the model stopped within the step in progress, or it had finished.
            for record in rig.fake.recorder.records[rig.records :]:
                # (A fake that sent its last byte may stamp "completed" a moment later.)
                with trio.fail_after(SETTLE):
                    await rig.fake.recorder.wait_for(lambda _, r=record: r.outcome != "pending")
                if record.outcome == "client_disconnected":
                    assert record.disconnected_at - closed_at < CANCEL_BOUND
                else:
                    assert record.outcome == "completed", record
            if backend == "local":
                await assert_local_stopped(rig, closed_at, RANDOM_PREFILL, steps)
            # Which connection served it is not known at a random moment; the pool checks
            # (all idle, one for one with the fake's) still hold.
            await assert_nothing_left(rig, set())
            outcome = await assert_traces_say_what_happened(rig, raw, None)
            # The line agrees with the counter: cancelled exactly when the relay counted it.
            cancelled = rig.proxy.state.tracker.cancelled - rig.cancelled
            assert cancelled == (0 if outcome == "completed" else 1), (outcome, cancelled)
            await assert_next_request_works(rig, backend, transport)
            nursery.cancel_scope.cancel()


def _random_disconnect_test(examples: int) -> Any:
    @settings(
        max_examples=examples,
        deadline=None,
        # The only function-scoped fixture is the autouse one that closes stray raw sockets.
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(
        delay=st.floats(0, STREAM_TIME),
        transport=st.sampled_from(TRANSPORTS),
        backend=st.sampled_from(BACKENDS),
    )
    async def test(
        delay: float, transport: str, backend: str, tiny_loaded_model: Any, traced: Traced
    ) -> None:
        await disconnect_at(delay, transport, backend, tiny_loaded_model, traced)

    return test


test_disconnect_at_a_random_moment = _random_disconnect_test(5)
test_disconnect_at_a_random_moment_many = pytest.mark.slow(_random_disconnect_test(40))
