"""What the fake does: its settings (``FakeSettings``) and a request's own plan (``Plan``: the
settings with the request's ``"fake"`` override), the schedule an answer follows (TTFT, then a
token every ``interval``), the faults it injects (``MODES``), the connection habits of real
servers (``accept_delay``, ``close_after_response``, ``keepalive_timeout``, ``late_close``), and
the serving model of the balance bench (running slots, the prefix cache's TTFT).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from proxy.testing.fake_upstream.clock import Job, Ticker
from proxy.testing.fake_upstream.content import prompt_tokens
from proxy.testing.fake_upstream.prefix_cache import PrefixCache, prompt_bytes
from proxy.testing.fake_upstream.recorder import Recorder, RequestRecord
from proxy.testing.fake_upstream.wire import (
    Answer,
    Connection,
    End,
    Request,
    http_response,
    stream_head,
    until_client_leaves,
)
from proxy.testing.kv_events import (
    FakeVllmPublisher,
    block_removed,
    block_stored,
    vllm_hashes,
)

MODES: Final[frozenset[str]] = frozenset(
    {"ok", "refuse", "status", "reset", "eof", "stall", "stall_headers", "malformed"}
)

MALFORMED_EVENT: Final = b"this is not server-sent events\n\n"

_OVERRIDABLE: Final = frozenset(
    {"ttft", "interval", "tokens", "mode", "at", "status", "usage", "fail_attempts"}
)


@dataclass
class FakeSettings:
    """Server-wide defaults; a request may override ttft, interval, tokens, mode, at, status
    and usage with an extra ``"fake": {...}`` object in its JSON body (in a multipart body: a
    ``fake`` field holding that object as JSON text).

    ``mode``/``at``/``status`` apply to the model endpoints (every ``POST`` one) only: a proxy's
    health check or model listing must not turn a streaming test into a different test.

    With ``via_proxy`` the listener speaks plain HTTP, as a proxy does: TLS, if set, starts
    inside each CONNECT tunnel, and absolute-form requests are answered in plain HTTP. The
    fake's own ``/_fake/`` endpoints answer direct requests either way.
    """

    ttft: float = 0.05
    interval: float = 0.02
    tokens: int = 50
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    mode: str = "ok"
    at: int = 0
    status: int = 500
    sndbuf: int | None = None
    max_records: int = 100_000
    # Connection habits of real servers; at most one of the three applies.
    close_after_response: bool = False
    keepalive_timeout: float | None = None
    late_close: float | None = None
    # False: answers carry no usage blocks (a stream asked for include_usage gets none, a whole
    # answer has no "usage"), as servers that count nothing; the proxy must count itself.
    usage: bool = True
    # HTTPS: PEM files; with a client CA, a client must present a certificate it signed.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    via_proxy: bool = False
    # The serving model (the package docstring): 0 turns each off.
    max_running: int = 0
    prefix_cache_size: int = 0
    prefix_block_bytes: int = 256
    ttft_hit: float = 0.02
    ttft_miss: float = 0.3
    # The token-block cache (the package docstring): blocks of this many tokens instead of
    # prefix_block_bytes (0: bytes), TTFT ttft_hit plus this many seconds per token not cached,
    # one prompt's prefill at a time.
    prefix_block_tokens: int = 0
    prefill_token_seconds: float = 0.0
    # vLLM's KV events of the token-block cache, published on this port (0: a free one; None:
    # off), with a replay socket on kv_replay_port (0: a free one).
    kv_events_port: int | None = None
    kv_replay_port: int = 0
    # GET /metrics: this body instead of the fake's own gauges, and this status.
    metrics_text: str | None = None
    metrics_status: int = 200
    # Hold each accepted plain-HTTP connection this many seconds before reading a request from
    # it: on loopback the kernel completes the TCP handshake at once, so this is how a slow
    # accept (or a handshake that stalls) looks to a client, still connecting as far as any
    # answer goes. A client that closes meanwhile is stamped in ``Recorder.closed_while_held``
    # (its bytes are kept, and served after the hold if it stays). 0: off.
    accept_delay: float = 0.0

    def __post_init__(self) -> None:
        check_seconds("ttft", self.ttft)
        check_seconds("interval", self.interval)
        check_int("tokens", self.tokens, 0)
        check_int("at", self.at, 0)
        check_int("status", self.status, 200, 599)
        check_int("max_records", self.max_records, 1)
        check_mode(self.mode)
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise Invalid("models must be a non-empty list of non-empty strings")
        if self.sndbuf is not None:
            check_int("sndbuf", self.sndbuf, 1)
        check_bool("close_after_response", self.close_after_response)
        check_bool("via_proxy", self.via_proxy)
        check_bool("usage", self.usage)
        if self.keepalive_timeout is not None:
            check_seconds("keepalive_timeout", self.keepalive_timeout)
        if self.late_close is not None:
            check_seconds("late_close", self.late_close)
        timers = (self.keepalive_timeout, self.late_close)
        if self.close_after_response + sum(t is not None for t in timers) > 1:
            # Each ends a kept-alive connection its own way: two would shadow each other.
            raise Invalid("set at most one of close_after_response, keepalive_timeout, late_close")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if not isinstance(getattr(self, name), str):
                raise Invalid(f"{name} must be a path (a string)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise Invalid("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise Invalid("tls_client_ca needs tls_cert and tls_key")
        check_int("max_running", self.max_running, 0)
        check_int("prefix_cache_size", self.prefix_cache_size, 0)
        check_int("prefix_block_bytes", self.prefix_block_bytes, 1)
        check_seconds("ttft_hit", self.ttft_hit)
        check_seconds("ttft_miss", self.ttft_miss)
        check_int("prefix_block_tokens", self.prefix_block_tokens, 0)
        check_seconds("prefill_token_seconds", self.prefill_token_seconds)
        if self.kv_events_port is not None:
            check_int("kv_events_port", self.kv_events_port, 0, 65535)
            if not self.prefix_block_tokens:
                raise Invalid("kv_events_port needs prefix_block_tokens (events tell of tokens)")
        check_int("kv_replay_port", self.kv_replay_port, 0, 65535)
        check_int("metrics_status", self.metrics_status, 100, 599)
        check_seconds("accept_delay", self.accept_delay)


class Invalid(ValueError):
    """A bad setting or request field; a request gets it back as a 400 BadRequestError."""


def check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"{name} must be a number")
    if not math.isfinite(value) or value < 0:
        raise Invalid(f"{name} must be a finite number >= 0")
    return float(value)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"{name} must be an integer")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise Invalid(f"{name} must be {bounds}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"{name} must be a boolean")
    return value


def check_mode(value: object) -> str:
    if not isinstance(value, str) or value not in MODES:
        raise Invalid(f"mode must be one of {sorted(MODES)}")
    return value


@dataclass(frozen=True, slots=True)
class Plan:
    """The effective fake parameters of one request: settings plus its ``"fake"`` override."""

    ttft: float
    interval: float
    tokens: int
    mode: str
    at: int
    status: int
    usage: bool = True
    # With a fault ``mode``: only the first this many attempts of one request (its
    # X-Request-ID) get it, the later ones an answer (0: every attempt), so that a retry can
    # succeed.
    fail_attempts: int = 0

    @classmethod
    def build(cls, settings: FakeSettings, body: dict[str, Any]) -> Plan:
        """Raise Invalid on a malformed override."""
        fake = body.get("fake")
        if fake is None:
            fake = {}
        if not isinstance(fake, dict):
            raise Invalid('"fake" must be an object')
        unknown = set(fake) - _OVERRIDABLE
        if unknown:
            raise Invalid(f'unknown "fake" fields: {sorted(unknown)}')
        return cls(
            ttft=check_seconds("fake.ttft", fake.get("ttft", settings.ttft)),
            interval=check_seconds("fake.interval", fake.get("interval", settings.interval)),
            tokens=check_int("fake.tokens", fake.get("tokens", settings.tokens), 0),
            mode=check_mode(fake.get("mode", settings.mode)),
            at=check_int("fake.at", fake.get("at", settings.at), 0),
            status=check_int("fake.status", fake.get("status", settings.status), 200, 599),
            usage=check_bool("fake.usage", fake.get("usage", settings.usage)),
            fail_attempts=check_int("fake.fail_attempts", fake.get("fail_attempts", 0), 0),
        )


# --------------------------------------------------------------------------- connection habits


async def hold(conn: Connection, delay: float, recorder: Recorder) -> bool:
    """Hold a fresh connection for ``delay`` seconds (``accept_delay``), reading only to notice
    the client leave; False if it did (the caller then closes the connection)."""
    recorder._held(1)
    try:
        with trio.move_on_after(delay):
            await until_client_leaves(conn)
            recorder._closed_during_hold()
            return False
        return True
    finally:
        recorder._held(-1)


async def next_request_wanted(settings: FakeSettings, conn: Connection) -> bool:
    """Whether the fake reads another request after an answer, per its habits; a response
    that said keep-alive is no promise."""
    if settings.close_after_response:
        return False
    if settings.late_close is not None:
        # Nothing reads meanwhile: a request written in these seconds meets the close.
        await trio.sleep(settings.late_close)
        return False
    if settings.keepalive_timeout is not None and not conn.buf:
        # Only the wait for a request's first byte is timed, as in uvicorn.
        with trio.move_on_after(settings.keepalive_timeout):
            return await conn.receive_more()
        return False
    return True


# --------------------------------------------------------------------------- the serving model


class ServingModel:
    """A serving model, when asked (the package docstring): at most ``max_running`` requests
    generate at once and the others wait, in order; with a prefix cache, a prompt's TTFT runs
    from ``ttft_hit`` to ``ttft_miss`` by the fraction of it not cached, or, with token
    blocks, is ``ttft_hit`` after its uncached tokens' prefill (one at a time), and the blocks
    stored and evicted are published as vLLM's KV events when a ``publisher`` is set.
    ``metrics_text`` tells both as vLLM's gauges. ``/tokenize`` and ``/detokenize`` pass by
    (vLLM's API server answers them without the engine)."""

    def __init__(self, settings: FakeSettings) -> None:
        self.cache = PrefixCache(settings.prefix_cache_size)
        self.running = 0
        self.waiting = 0
        self._slots = trio.CapacityLimiter(max(1, settings.max_running))
        self._prefill = trio.Lock()
        # vLLM's block hashes are seeded at random per process (NONE_HASH): so are these.
        self._seed = os.urandom(32)
        self.publisher: FakeVllmPublisher | None = None

    @contextlib.asynccontextmanager
    async def admitted(
        self, settings: FakeSettings, record: RequestRecord, plan: Plan
    ) -> AsyncIterator[Plan]:
        """Hold a running slot (waiting for one, in order) while the answer is sent; yield its
        plan with the prefix cache's TTFT, counted from when the slot was had."""
        if record.path in _NO_ENGINE:
            yield plan
            return
        async with contextlib.AsyncExitStack() as stack:
            if settings.max_running:
                self._slots.total_tokens = settings.max_running
                self.waiting += 1
                try:
                    await stack.enter_async_context(self._slots)
                finally:
                    self.waiting -= 1
                record.queued_seconds = trio.current_time() - record.received_at
            self.running += 1
            stack.callback(self._stopped_running)
            ttft = plan.ttft
            if settings.prefix_cache_size and record.body is not None:
                fake = record.body.get("fake")
                overridden = isinstance(fake, dict) and "ttft" in fake
                self.cache.capacity = settings.prefix_cache_size
                if settings.prefix_block_tokens:
                    await self._prefilled(settings, record)
                    if not overridden:
                        ttft = settings.ttft_hit
                else:
                    blocks, hit, uncached = self.cache.lookup(
                        prompt_bytes(record.body), settings.prefix_block_bytes
                    )
                    record.prefix_blocks, record.prefix_hit_blocks = blocks, hit
                    if not overridden:
                        ttft = settings.ttft_hit + (settings.ttft_miss - settings.ttft_hit) * (
                            uncached
                        )
            waited = trio.current_time() - record.received_at
            if waited or ttft != plan.ttft:
                plan = dataclasses.replace(plan, ttft=waited + ttft)
            yield plan

    async def _prefilled(self, settings: FakeSettings, record: RequestRecord) -> None:
        """The token-block cache: once the prompt's turn to prefill comes (one prompt at a
        time), its cached blocks looked up, its other tokens prefilled
        (``prefill_token_seconds`` each), then its blocks stored, and the KV events of what was
        stored and evicted published.

        The lookup waits for the turn as vLLM's scheduler looks a waiting request's prefix up
        when it schedules it, by then holding the blocks of the prefills scheduled before: a
        prompt sent while another with its prefix is prefilled hits what that one stores
        (looked up on arrival, it would miss and prefill the prefix a second time)."""
        assert record.body is not None
        size = settings.prefix_block_tokens
        tokens = prompt_tokens(record.body) or []
        names = vllm_hashes(tokens, size, self._seed)
        turn = self._prefill if settings.prefill_token_seconds else contextlib.nullcontext()
        async with turn:
            hit = self.cache.match(names)
            record.prefix_blocks, record.prefix_hit_blocks = len(names), hit
            uncached = len(tokens) - hit * size
            if uncached and settings.prefill_token_seconds:
                await trio.sleep(uncached * settings.prefill_token_seconds)
            new, evicted = self.cache.store(names)
        if self.publisher is not None and (new or evicted):
            self.publisher.publish(kv_events(names, tokens, size, new, evicted))

    def _stopped_running(self) -> None:
        self.running -= 1

    def metrics_text(self, settings: FakeSettings) -> str:
        """What GET /metrics answers: vLLM's names, this fake's figures."""
        if settings.metrics_text is not None:
            return settings.metrics_text
        label = f'{{model_name="{settings.models[0]}"}}'
        usage = self.running / settings.max_running if settings.max_running else 0.0
        lines = [
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", self.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", usage),
            ("vllm:prefix_cache_queries", "counter", self.cache.queries),
            ("vllm:prefix_cache_hits", "counter", self.cache.hits),
        ]
        out = []
        for name, kind, value in lines:
            sample = f"{name}_total" if kind == "counter" else name
            out += [f"# TYPE {name} {kind}", f"{sample}{label} {float(value)}"]
        return "\n".join(out) + "\n"


# The paths that vLLM's API server answers without its engine: no slot, no prefill.
_NO_ENGINE: Final = frozenset({"/tokenize", "/detokenize"})


def kv_events(
    names: Sequence[bytes],
    tokens: Sequence[int],
    size: int,
    new: Sequence[int],
    evicted: Sequence[bytes],
) -> list[Any]:
    """One batch of vLLM's KV events: a ``BlockStored`` for each run of newly stored blocks
    (``new``: indexes into ``names``, each block's parent the block before it), then a
    ``BlockRemoved`` of the ``evicted``."""
    events: list[Any] = []
    run: list[int] = []
    for i in [*new, -1]:
        if run and i != run[-1] + 1:
            first, last = run[0], run[-1] + 1
            parent = names[first - 1] if first else None
            block_tokens = tokens[first * size : last * size]
            events.append(block_stored(names[first:last], parent, block_tokens, size))
            run = []
        if i >= 0:
            run.append(i)
    if evicted:
        events.append(block_removed(evicted))
    return events


# --------------------------------------------------------------------------- schedule and faults


class Responder:
    """Sends one planned answer: a stream's head at once and token ``i`` at
    ``ttft + i * interval`` (handed to the clock), a whole answer when its last token would be
    due, or the plan's fault instead (``MODES``)."""

    def __init__(self, recorder: Recorder, ticker: Ticker) -> None:
        self.recorder = recorder
        self._ticker = ticker

    async def send(
        self,
        conn: Connection,
        request: Request,
        record: RequestRecord,
        plan: Plan,
        answer: Answer,
        errors: Callable[[int, str], bytes],
    ) -> End:
        mode = plan.mode
        if mode == "refuse":
            self.recorder._finish(record, "failed_injected")
            return End.CLOSE
        if mode == "stall_headers":
            await trio.sleep_forever()
        if mode == "status":
            await trio.sleep_until(record.received_at + plan.ttft)
            body = errors(plan.status, "fake upstream error")
            await conn.stream.send_all(
                http_response(plan.status, body, keep_alive=request.keep_alive)
            )
            self.recorder._finish(record, "failed_injected")
            return End.KEEP if request.keep_alive else End.CLOSE
        if answer.stream:
            return await self._stream(conn, request, record, plan, answer)
        return await self._whole(conn, request, record, plan, answer)

    async def _stream(
        self,
        conn: Connection,
        request: Request,
        record: RequestRecord,
        plan: Plan,
        answer: Answer,
    ) -> End:
        frames = answer.frames(chunked=request.chunked)
        n = answer.tokens
        # The fault fires where token `at` would go; past the end, right before the tail.
        fault_at = min(plan.at, n)
        ends_early = plan.mode not in ("ok", "malformed")
        if plan.mode == "malformed":
            frames.insert_before(fault_at, frames.frame(MALFORMED_EVENT))
        start = record.received_at + plan.ttft
        # What a server sends before generating (the Responses API's response.created) goes
        # with the head.
        await conn.stream.send_all(stream_head(request) + frames.head)
        stop = fault_at if ends_early else n
        if stop:
            job = Job(
                conn.stream, conn.fd, record, self.recorder, frames, start, plan.interval, stop
            )
            await self._ticker.send_tokens(job)
        # Token k is due at start + k * interval; the tail goes with the last token.
        await trio.sleep_until(start + min(stop, max(n - 1, 0)) * plan.interval)
        if ends_early:
            return await self._inject(plan.mode, record)
        await conn.stream.send_all(frames.before(n) + frames.tail)
        if n == 0:
            self.recorder._token_sent(record, 0)
        self.recorder._finish(record, "completed" if plan.mode == "ok" else "failed_injected")
        return End.KEEP if request.keep_alive else End.CLOSE

    async def _inject(self, mode: str, record: RequestRecord) -> End:
        """The fault that ends a response early: reset, clean EOF, or silence until it leaves."""
        if mode == "stall":
            await trio.sleep_forever()
        self.recorder._finish(record, "failed_injected")
        return End.RESET if mode == "reset" else End.CLOSE

    async def _whole(
        self,
        conn: Connection,
        request: Request,
        record: RequestRecord,
        plan: Plan,
        answer: Answer,
    ) -> End:
        n = answer.tokens
        last = max(n - 1, 0)
        if plan.mode == "ok":
            await trio.sleep_until(record.received_at + plan.ttft + last * plan.interval)
            keep = request.keep_alive
            await conn.stream.send_all(http_response(200, answer.whole_body(), keep_alive=keep))
            self.recorder._token_sent(record, n)
            self.recorder._finish(record, "completed")
            return End.KEEP if keep else End.CLOSE
        # Without a stream, a fault fires where token `at` would have been generated.
        fault_time = plan.ttft + min(plan.at, last) * plan.interval
        await trio.sleep_until(record.received_at + fault_time)
        if plan.mode == "eof":
            # A truncated body: the client has its headers, so a retry would not be safe.
            body = answer.whole_body()
            head = http_response(200, b"", keep_alive=False, content_length=len(body))
            await conn.stream.send_all(head + body[: len(body) // 2])
        elif plan.mode == "malformed":
            await conn.stream.send_all(http_response(200, MALFORMED_EVENT, keep_alive=False))
        return await self._inject(plan.mode, record)
