"""Shared fixtures: a fake upstream and a real hypercorn-served proxy, both on 127.0.0.1:0.

Testing policy (after trio-websocket's): real sockets on loopback only, port 0, a
``fail_after`` around every test that does I/O, virtual time only where no socket is involved.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from proxy.api.app import create_app
from proxy.api.state import SluiceState, state_of
from proxy.cli import start_fake_upstream
from proxy.config import Config, config_from_mapping
from proxy.ops.logs import ACCESS_LOGGER
from proxy.server.asgi import SluiceQuart
from proxy.server.run import serve
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream
from tests import processes

# Generous enough for a loaded 2-core CI machine; every I/O test runs under a fail_after.
DEADLINE = 15


class ServerPath:
    """Which server reads a test proxy's plain requests when the test does not say: the fast
    path (the default, as in production), or hypercorn and Quart for every request. The whole
    suite runs on hypercorn's with ``TEST_FAST_PATH=0`` (not under ``SLUICE_``: a server the
    tests start would read it as a config key); a module that must hold on both uses
    :func:`each_server_path`."""

    fast_path = os.environ.get("TEST_FAST_PATH", "1") != "0"


@pytest.fixture(params=[True, False], ids=["fast-path", "hypercorn"])
def each_server_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    """The test runs twice: its proxies with the fast path, then without."""
    saved = ServerPath.fast_path
    ServerPath.fast_path = request.param
    try:
        yield request.param
    finally:
        ServerPath.fast_path = saved


@dataclass
class Fake:
    upstream: FakeUpstream
    url: str

    @property
    def recorder(self) -> Any:
        return self.upstream.recorder


async def start_fake(nursery: trio.Nursery, **settings: Any) -> Fake:
    upstream = FakeUpstream(FakeSettings(**settings))
    port = await nursery.start(upstream.serve, "127.0.0.1", 0)
    return Fake(upstream, f"http://127.0.0.1:{port}")


async def start_configured_fake(nursery: trio.Nursery, config: Config) -> str | None:
    """With [fake_upstream] enabled, its fake upstream (for the models' ``fake:`` upstreams),
    started in ``nursery`` as `sluice serve` starts it beside the app: its URL for
    ``create_app(config, fake_upstream_url=...)``. Without, None."""
    if not config.fake_upstream.enabled:
        return None
    return await start_fake_upstream(nursery, config)


@dataclass
class Proxy:
    url: str
    app: SluiceQuart
    config: Config

    @property
    def state(self) -> SluiceState:
        return state_of(self.app)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port


# The checkout the tests run from: a script run beside them imports its packages.
REPOSITORY = Path(__file__).resolve().parents[1]


def run_python(
    script: str, *, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -c script`` to its end, from the repository's root and importing this
    checkout's packages; ``env`` in place of this process's environment."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(REPOSITORY)},
    )


async def start_proxy(
    nursery: trio.Nursery,
    models: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    local_models: dict[str, Any] | None = None,
    keys: list[dict[str, Any]] | None = None,
    guards: list[dict[str, Any]] | None = None,
    **sections: dict[str, Any],
) -> Proxy:
    """Serve a proxy; ``models`` maps a name to a list of upstream URLs or a full model table;
    ``keys`` are ``[[keys]]`` tables, ``guards`` ``[[guards]]`` tables."""
    data: dict[str, Any] = {name: dict(table) for name, table in sections.items()}
    if keys is not None:
        data["keys"] = [dict(table) for table in keys]
    if guards is not None:
        data["guards"] = [dict(table) for table in guards]
    data.setdefault("server", {})["port"] = 0
    data["server"].setdefault("fast_path", ServerPath.fast_path)
    # No spare upstream connections unless a test asks: most tests count the upstream's
    # connections exactly (tests/backends/upstream/test_preconnect.py covers the default).
    data.setdefault("upstream", {}).setdefault("preconnect", 0)
    data["models"] = {
        name: {"upstreams": spec} if isinstance(spec, list) else spec
        for name, spec in models.items()
    }
    config = config_from_mapping(data, "test", env={})
    app = create_app(
        config,
        env=env or {},
        local_models=local_models,
        fake_upstream_url=await start_configured_fake(nursery, config),
    )
    binds = await nursery.start(serve, app, config)
    return Proxy(binds[0], app, config)


# The two upstream transports, for tests that must hold over both (model key "transport").
UPSTREAM_TRANSPORTS = ("lean", "httpx")


def only_replica(proxy: Proxy) -> Any:
    """The proxy's one upstream replica, whichever transport reaches it."""
    (replica,) = proxy.state.replicas.values()
    return replica


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Fake:
    return await start_fake(nursery, ttft=0.02, interval=0.01, tokens=5)


@pytest.fixture
async def proxy(nursery: trio.Nursery, fake: Fake) -> Proxy:
    return await start_proxy(nursery, {"fake-model": [fake.url]})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        yield client


def chat_body(model: str = "fake-model", *, stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
        **extra,
    }


def chunked_body(raw: bytes) -> str:
    """The body of a whole chunked HTTP/1.1 response (``raw``: its head, then its chunks up to
    the last, empty one), its framing taken off."""
    framed = raw.split(b"\r\n\r\n", 1)[1]
    body = b""
    while True:
        size_line, framed = framed.split(b"\r\n", 1)
        size = int(size_line, 16)
        if not size:
            return body.decode()
        body, framed = body + framed[:size], framed[size + 2 :]


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The JSON access lines ``caplog`` captured (its ``sluice.access`` logger at INFO)."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]


def sse_payloads(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]


def stream_text(payloads: list[str]) -> str:
    parts = []
    for payload in payloads:
        if payload == "[DONE]":
            continue
        for choice in json.loads(payload).get("choices", []):
            parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def producer_tasks() -> list[trio.lowlevel.Task]:
    """Live relay producer tasks anywhere in this trio run."""
    found = []
    root = trio.lowlevel.current_root_task()
    assert root is not None  # inside a trio run
    stack = [root]
    while stack:
        task = stack.pop()
        if task.name.startswith("relay producer"):
            found.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found


OPEN_RAW_CLIENTS: list[RawClient] = []


@pytest.fixture(autouse=True)
def close_raw_clients() -> Iterator[None]:
    """A failing test must not leave its raw sockets for the GC to warn about in the next.
    (Synchronous, so that it serves sync tests too; closing a socket needs no await.)"""
    yield
    while OPEN_RAW_CLIENTS:
        sock = OPEN_RAW_CLIENTS.pop().stream.socket
        if sock.fileno() >= 0:
            # The test's trio run is over: close the descriptor directly (a trio socket's
            # close() would notify a run that no longer exists).
            os.close(sock.detach())


async def connect_client(
    proxy: Proxy, *, rcvbuf: int | None = None, mss: int | None = None
) -> trio.SocketStream:
    """A client connection to ``proxy``, with a small receive buffer and MSS if asked."""
    sock = trio.socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, rcvbuf)
    if mss is not None:
        # Loopback's 64 KiB MSS lets the kernel buffer megabytes toward a slow reader; a
        # network-sized MSS keeps the sender's buffer small, so backpressure shows.
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_MAXSEG, mss)
    await sock.connect(proxy.host_port)
    return trio.SocketStream(sock)


class RawClient:
    """A client that speaks HTTP/1.1 by hand, so a test controls exactly when it reads and when
    it leaves (httpx cannot leave while it waits for response headers)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = b""

    @classmethod
    async def post(
        cls,
        proxy: Proxy,
        path: str,
        body: dict[str, Any] | bytes,
        *,
        rcvbuf: int | None = None,
        mss: int | None = None,
        extra: bytes = b"",
        headers: dict[str, str] | None = None,
    ) -> RawClient:
        host, port = proxy.host_port
        stream = await connect_client(proxy, rcvbuf=rcvbuf, mss=mss)
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        more = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{more}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        await stream.send_all(head + payload + extra)
        client = cls(stream)
        OPEN_RAW_CLIENTS.append(client)
        return client

    async def read_until(self, marker: bytes, count: int = 1) -> None:
        while self.received.count(marker) < count:
            data = await self.stream.receive_some(65536)
            if not data:
                raise EOFError(f"connection closed; received {self.received[-300:]!r}")
            self.received += data

    async def ready_to_leave(self) -> None:
        """What the client does just before it leaves (nothing; a client that pipelines a
        byte first sends it), so that a test counts from the moment of the close itself."""

    async def close(self) -> float:
        """Leave abruptly; returns the time at which the connection was closed."""
        await self.stream.aclose()
        return trio.current_time()


async def wait_until_steady(sample: Callable[[], int], *, interval: float = 0.1) -> list[int]:
    """Sample until three samples in a row are equal (the producer is paused); returns them.
    No deadline of its own: callers run under fail_after. A busy machine only makes it take
    longer, never pass wrongly."""
    samples = [sample()]
    while len(samples) < 3 or len(set(samples[-3:])) > 1:
        await trio.sleep(interval)
        samples.append(sample())
    return samples


class SlowModel:
    """A loaded model's network, slowed: each generation's prefill (a call without position
    ids: the engine passes them only to a decode step; a prefill may start from a prefix
    cache's KV, so the cache does not tell) sleeps ``prefill_seconds``, every decode step
    ``step_seconds``. Counts both. The delays may be changed between requests."""

    def __init__(
        self, inner: Any, step_seconds: float = 0.0, prefill_seconds: float | None = None
    ) -> None:
        self.inner = inner
        self.config = inner.config
        self.step_seconds = step_seconds
        self.prefill_seconds = step_seconds if prefill_seconds is None else prefill_seconds
        self.steps = 0
        self.prefills = 0

    def __call__(self, **kwargs: Any) -> Any:
        # Counted before the sleep: a test that sees the count go up knows the step is running.
        self.steps += 1
        if kwargs.get("position_ids") is None:
            self.prefills += 1
            time.sleep(self.prefill_seconds)
        else:
            time.sleep(self.step_seconds)
        return self.inner(**kwargs)


class GatedModel(SlowModel):
    """A :class:`SlowModel` whose calls wait (in the engine's thread) while ``gate`` is clear,
    so that a test can hold the engine until every request it needs is inside; it records how
    many rows each decode step carries."""

    def __init__(self, inner: Any, step_seconds: float) -> None:
        super().__init__(inner, step_seconds)
        self.gate = threading.Event()
        self.gate.set()
        self.decode_rows: list[int] = []

    def __call__(self, **kwargs: Any) -> Any:
        # Bounded: a test that fails with the gate shut must not hold the engine's thread,
        # which the server's shutdown waits for.
        self.gate.wait(DEADLINE)
        if kwargs.get("position_ids") is not None:
            self.decode_rows.append(int(kwargs["input_ids"].shape[0]))
        return super().__call__(**kwargs)


def slowed(loaded: Any, step_seconds: float = 0.0, prefill_seconds: float | None = None) -> Any:
    """A copy of ``loaded`` (an ``inference.LoadedModel``) whose model is a :class:`SlowModel`."""
    slow = SlowModel(loaded.serving, step_seconds, prefill_seconds)
    # As its model too: tests read the counts through `.model`.
    return dataclasses.replace(loaded, model=slow, forward=slow)


def gated(loaded: Any, step_seconds: float) -> Any:
    """A copy of ``loaded`` (an ``inference.LoadedModel``) whose model is a
    :class:`GatedModel` (its ``.model``, for the gate and the counts)."""
    model = GatedModel(loaded.serving, step_seconds)
    return dataclasses.replace(loaded, model=model, forward=model)


class PerTokenSlowModel:
    """A loaded model's network, slowed as a real model is: a prefill chunk (a call without
    position ids) sleeps ``per_token`` for each token it feeds, so that a chunk costs in
    proportion to its size and a whole long prompt in one pass would be long; a decode step
    sleeps ``step_seconds``. Records each chunk's size."""

    def __init__(self, inner: Any, per_token: float, step_seconds: float) -> None:
        self.inner = inner
        self.config = inner.config
        self.per_token = per_token
        self.step_seconds = step_seconds
        self.chunks: list[int] = []

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is None:
            # Recorded before the sleep: a test that sees it knows the chunk is running.
            tokens = int(kwargs["input_ids"].shape[1])
            self.chunks.append(tokens)
            time.sleep(self.per_token * tokens)
        else:
            time.sleep(self.step_seconds)
        return self.inner(**kwargs)


def per_token_slowed(loaded: Any, per_token: float, step_seconds: float) -> Any:
    """A copy of ``loaded`` whose network is a :class:`PerTokenSlowModel` (its ``.forward``)."""
    return dataclasses.replace(
        loaded, forward=PerTokenSlowModel(loaded.serving, per_token, step_seconds)
    )


async def poll_until(predicate: Callable[[], object], *, interval: float = 0.005) -> None:
    """Poll ``predicate`` until it is true, for state that has no event to wait on (a worker
    thread's counters, a semaphore's queue, health set by a background check). No deadline of
    its own: callers run under one."""
    while True:
        if predicate():
            return
        await trio.sleep(interval)


async def cancel_while_waiting_then_mid_stream(
    proxy: Proxy, fake: Fake, *, stay: float = 0.0
) -> float:
    """Two clients leave: one while the upstream thinks (before the first token), one in the
    middle of its stream, each after ``stay`` seconds there. Returns once the proxy is idle
    again: the two leavings' times from the close to the proxy idle, added up."""
    windows = 0.0
    waiting = await RawClient.post(proxy, "/v1/chat/completions", chat_body(fake={"ttft": 30}))
    await fake.recorder.wait_for(lambda r: len(r.records) == 1)
    await trio.sleep(stay)
    left = trio.current_time()
    await waiting.close()
    await proxy.state.tracker.wait_idle()
    windows += trio.current_time() - left
    streaming = await RawClient.post(
        proxy,
        "/v1/chat/completions",
        chat_body(fake={"ttft": 0, "interval": 0.01, "tokens": 1000}),
    )
    await streaming.read_until(b"data: ", count=3)
    await trio.sleep(stay)
    left = trio.current_time()
    await streaming.close()
    await proxy.state.tracker.wait_idle()
    return windows + trio.current_time() - left


async def read_request_head(stream: trio.SocketStream) -> bytes | None:
    """For a hand-written test server: everything received up to and including the first
    request's blank line (and what followed it in the same reads); None if the client left."""
    received = b""
    while b"\r\n\r\n" not in received:
        data = await stream.receive_some(65536)
        if not data:
            return None
        received += data
    return received


async def read_request(stream: trio.SocketStream) -> tuple[bytes, bytes] | None:
    """For a hand-written test server: the first request's head and its whole body (by its
    ``Content-Length``, so that no request byte is left unread); None if the client left."""
    received = await read_request_head(stream)
    if received is None:
        return None
    head, _, body = received.partition(b"\r\n\r\n")
    found = re.search(rb"(?im)^content-length: *(\d+)", head)
    length = int(found.group(1)) if found else 0
    while len(body) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        body += data
    return head, body


LOCKSTEP_WORDS = ("The ", "quick ", "brown ", "fox ")


def mark_read(read: Sequence[trio.Event], text: str) -> None:
    """For :func:`serve_in_lockstep`'s client: sets the event of every word that ``text`` (the
    answer read so far) has whole."""
    for count, event in enumerate(read, start=1):
        if text.startswith("".join(LOCKSTEP_WORDS[:count])):
            event.set()


async def serve_in_lockstep(
    read: Sequence[trio.Event], *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """An upstream that shows whether a relay holds events back: it answers a streamed chat
    with an opening event, then each of ``LOCKSTEP_WORDS`` as a token event sent only once
    ``read`` says the client has read the one before, then [DONE] and the body's end; then
    it waits for the relay to close. A relay that held an event back would never finish,
    whatever the machine's load (gaps between arrival times, a loaded machine squeezes).
    Its port."""

    def chunk(payload: object) -> bytes:
        event = b"data: %b\n\n" % json.dumps(payload, separators=(",", ":")).encode()
        return b"%x\r\n%b\r\n" % (len(event), event)

    def delta(**fields: str) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}

    async def handle(stream: trio.SocketStream) -> None:
        if await read_request(stream) is None:
            return
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunk(delta(role="assistant"))
        )
        for word, seen in zip(LOCKSTEP_WORDS, read, strict=True):
            await stream.send_all(chunk(delta(content=word)))
            await seen.wait()
        await stream.send_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        while await stream.receive_some(65536):
            pass

    async with trio.open_nursery() as nursery:
        serving = functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1")
        listeners = await nursery.start(serving)
        task_status.started(listeners[0].socket.getsockname()[1])


def local_model(**overrides: Any) -> dict[str, Any]:
    """A local model's config table, for a model preloaded by the test."""
    return {"backend": "local", "path": "unused-preloaded", "default_temperature": 0.0, **overrides}


async def start_local_proxy(nursery: trio.Nursery, loaded: Any, **overrides: Any) -> Proxy:
    """A proxy serving ``loaded`` as the local model "tiny" (``relay=`` sets [relay])."""
    relay = overrides.pop("relay", {})
    return await start_proxy(
        nursery,
        {"tiny": local_model(**overrides)},
        local_models={"tiny": loaded},
        relay=relay,
    )


def engine_threads() -> int:
    """Threads stepping a local model's batch: one per model, whatever the requests."""
    # trio names a worker thread after its job while it runs (the engine names its own).
    return sum(1 for t in threading.enumerate() if t.name.startswith("sluice engine "))


@pytest.fixture
def quiet_collector() -> Iterator[None]:
    """For a test that times the relay in milliseconds: no full cyclic collection during it.

    A serving process runs ``server.tune_gc`` (its start-up objects frozen out of the
    collector's sight); the test process holds the whole suite's heap instead, and one full
    collection of it, landing mid-test, costs hundreds of milliseconds that are not the relay's.
    Collected once before, then off for the test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def start_sluice(config: Path, *extra: str) -> tuple[trio.Process, str]:
    """``sluice serve`` in a process of its own, and its URL once it serves; :func:`stop` it."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config), *extra],
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    received = b""
    while b"sluice serving" not in received:
        chunk = await process.stdout.receive_some()
        assert chunk, f"sluice serve exited: {received!r}"
        received += chunk
    line = received.split(b"sluice serving", 1)[1].split(b"\n", 1)[0].decode()
    url = next(word for word in line.split() if word.startswith("http://"))
    return process, url


async def stop(process: trio.Process) -> None:
    """SIGKILL, and then its workers (with ``--workers``) must leave on their own: they watch
    their supervisor (proxy/server/supervision.py). Any still there after 5 s are killed, and
    named in an AssertionError."""
    with trio.CancelScope(shield=True):
        below = processes.descendants(process.pid) if process.returncode is None else []
        if process.returncode is None:
            process.kill()
        await process.wait()
        assert process.stdout is not None
        await process.stdout.aclose()
        left = await processes.trio_wait_gone(below, 5.0)
    if left:
        named = [f"{pid}: {processes.cmdline(pid)}" for pid in left]
        processes.kill_all(left)
        raise AssertionError(f"still running 5 s after their supervisor was killed: {named}")


def decode_to_the_end(
    generator: Any, prompts: list[list[int]], params: Any, *, max_batch: int, prefill_chunk: int
) -> list[list[int]]:
    """Each prompt's generated token ids, every prompt through one batch engine (``generator``
    an ``inference.Generator``) stepped by hand until all have finished; a failed piece raises."""
    from inference.batching import BatchEngine, Generation, Piece

    done: set[int] = set()

    def deliver(pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        for sequence, piece in pieces:
            if piece.error is not None:
                raise piece.error
            if piece.result is not None:
                done.add(id(sequence))

    engine = BatchEngine(
        generator, max_batch=max_batch, prefill_chunk=prefill_chunk, deliver=deliver
    )
    sequences = [Generation(ids, params, window=1 << 62) for ids in prompts]
    for sequence in sequences:
        engine.add(sequence)
    while len(done) < len(sequences):
        engine.step()
    return [list(sequence.generated) for sequence in sequences]


def shutdown_trigger(monkeypatch: pytest.MonkeyPatch) -> trio.Event:
    """The next proxy :func:`start_proxy` starts begins its graceful shutdown when the event is
    set."""
    shutdown = trio.Event()
    monkeypatch.setattr(
        "tests.support.serve", functools.partial(serve, shutdown_trigger=shutdown.wait)
    )
    return shutdown


def rss_mb(pid: int) -> float:
    """A process's resident set size now, in MiB (/proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Pauser:
    """A running piece of work's :class:`~proxy.relay.admission.Pausable`: a pause asked cancels
    its scope (the event boundary), and it counts how often it was asked."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.asked = 0

    def ask(self) -> bool:
        self.asked += 1
        self.scope.cancel()
        return True

    def withdraw(self) -> bool:
        return False  # its scope was cancelled as it was asked
