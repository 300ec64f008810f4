"""The per-request relay: one nursery, one bounded channel, one cancel scope per request.

Every backend (an upstream server, the local model) is a *producer*: an async function that
receives a :class:`RelaySink`, decides the response head once it knows it (status, content
type), then hands body chunks on. The :class:`RelayBody` owns the producer's task:

* ``__aenter__`` opens the request's nursery, starts the producer, and waits for the head, so
  the HTTP status can still say "upstream failed" until the first byte is ready;
* the chunks: while the body's task waits on an empty channel, the producer writes each chunk
  straight to the client's socket (:meth:`RelaySink.offer` -> the server's ``DirectWriter``),
  with no wake-up of the body's task. The channel carries only the overflow: a chunk the socket
  does not take at once goes into it (and from then on every chunk, in order, until the body
  has written them all), so a slow reader fills it and the producer blocks, within
  ``stall_timeout``, which pauses the upstream's reads. ``__anext__`` takes what is queued
  (several chunks at once when they are already waiting: one write);
* the lifecycle: the producer's side and the client's each have a state
  (:class:`~proxy.relay.state.RelayState`), moved only by :meth:`RelayBody._fire` through the
  table in ``state``;
* the end, in this order: the disconnect callbacks (:meth:`client_disconnected`, called
  synchronously in the scheduler step that saw the client go, shut the upstream connection
  down); then the nursery's cancellation (the producer unwinds: the upstream exchange, or the
  model thread at its next step); then ``__aexit__``'s close callbacks (the key's concurrency
  lease), the tracker (metrics, drain), and the access line.

An outcome is decided when the response is complete: a known-length answer whose every byte has
been handed to the socket is complete, and a client that closes after it cancels nothing.
There is no nursery inside an async generator here (trio #638): everything runs in the task
that sends the response, plus the one producer task the nursery visibly owns.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any, Protocol

import trio
from quart.wrappers.response import ResponseBody

from proxy.ops.logs import AccessRecord
from proxy.ops.metrics import Metrics
from proxy.ops.tracing import RequestTrace
from proxy.protocol.errors import ApiError, deadline_exceeded, internal_error, shutting_down
from proxy.protocol.shapes import OPENAI as OPENAI_ERRORS
from proxy.protocol.shapes import ErrorShape
from proxy.protocol.sse import FIRST_TOKEN
from proxy.protocol.stream_end import ends_stream
from proxy.relay.accounting import RelayAccount
from proxy.relay.state import Phase, RelayEvent, RelayState, step

log = logging.getLogger("sluice.relay")

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
# Headers every streamed response carries: no proxy between us and the client may buffer it.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Events coalesced into one write at most; bounds the size of a single send.
_MAX_COALESCE = 64
# Module globals for the per-chunk checks: one global load and an identity comparison.
_GONE = RelayState.GONE


class ClientStalled(Exception):
    """The client did not take an event within ``stall_timeout``."""


class RelaySink:
    """A producer's only view of the request: set the head once, then send chunks."""

    __slots__ = ("_body",)

    def __init__(self, body: RelayBody) -> None:
        self._body = body

    def set_phase(self, phase: Phase) -> None:
        """Where the producer is now: QUEUED, CONNECTING, HEAD or FIRST_TOKEN (the relay
        itself sets MID_STREAM and AFTER_LAST); reported with cancellations."""
        body = self._body
        body.account.phase = phase
        if phase is not Phase.QUEUED:
            body.dispatched()

    @property
    def started(self) -> bool:
        """True once the head is decided: from then on, failures go in-band."""
        return self._body.head_ready.is_set()

    @property
    def client_gone(self) -> bool:
        """True once the client has disconnected: a failure now (the upstream connection shut
        down under the producer) says nothing about the upstream."""
        return self._body.client_state is _GONE

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        self._body.set_head(status, content_type, headers, content_length)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the response body closes (the producer is gone by then),
        however the request ended: to release what the producer held for the whole response,
        including events still waiting for the client after the producer returned."""
        self._body.close_callbacks.append(callback)

    def offer(self, chunk: bytes) -> bool:
        """Hand a chunk on if that can be done now: written to the client's socket at once
        (see RelayBody.write_through) or queued in the channel; False (nothing done) if the
        channel is full."""
        return self._body.offer(chunk)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` at once (synchronously, before any task unwinds) if the client
        disconnects while the producer is still at work: to shut the upstream connection down
        in the same scheduler step that saw the disconnect. It must be safe to call late."""
        self._body.disconnect_callbacks.append(callback)

    async def send(self, chunk: bytes) -> None:
        """Queue a chunk for the client; block (bounded) while the client is not reading."""
        body = self._body
        body.direct_ok = False
        if not offer_to(body.send_channel, chunk):
            body.in_hand = chunk
            await wait_to_send(body.send_channel, chunk, body.stall_timeout)
            body.in_hand = None
        if body._numbered:
            body.handed_numbered(chunk)


def offer_to(channel: trio.MemorySendChannel[bytes], chunk: bytes) -> bool:
    """Put ``chunk`` in a client's channel if there is room now; False if it is full."""
    try:
        channel.send_nowait(chunk)
    except trio.WouldBlock:
        return False
    return True


async def wait_to_send(
    channel: trio.MemorySendChannel[bytes], chunk: bytes, stall_timeout: float
) -> None:
    """Send ``chunk`` into a client's full channel once it has room; raise
    :class:`ClientStalled` if the client takes nothing for ``stall_timeout``. The slow path
    only: the common case (room now, :func:`offer_to`) costs no cancel scope."""
    with trio.move_on_after(stall_timeout):
        await channel.send(chunk)
        return
    raise ClientStalled


class Sink(Protocol):
    """What a producer needs of its sink; RelaySink, or a wrapper such as a hedge's entrant."""

    @property
    def started(self) -> bool: ...

    @property
    def client_gone(self) -> bool: ...

    def set_phase(self, phase: Phase) -> None: ...

    def offer(self, chunk: bytes) -> bool: ...

    def on_disconnect(self, callback: Callable[[], None]) -> None: ...

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None: ...

    async def send(self, chunk: bytes) -> None: ...


Producer = Callable[[RelaySink], Awaitable[None]]


class DirectWriter(Protocol):
    """Writes body chunks to the client's connection (chunk_writer.ChunkWriter)."""

    def write_nowait(self, chunk: bytes) -> bool | None:
        """Write ``chunk`` now, without waiting. True: all of it went out; None: part did and
        the rest is pending, flushed by the next ``write``; False: nothing was written."""
        ...

    async def write(self, chunk: bytes) -> None:
        """Write what is pending, then ``chunk`` (empty: only what is pending), waiting for
        the socket; :class:`ClientStalled` if the client takes nothing for a stall timeout."""
        ...

    async def wait_for_room(self) -> None:
        """Wait until the socket can take a write; :class:`ClientStalled` likewise."""
        ...


class ClientConnection(Protocol):
    """The client's connection, as the server that carries a relayed answer offers it to the
    body (``RelayBody.attach``): the body's only view of the server."""

    def gone_at(self) -> float | None:
        """When the server saw the client leave; None while it has not."""
        ...

    def abort(self) -> None:
        """Drop the connection: after a stall, the body's writer is stuck in a write the
        client will not take."""
        ...

    def start_stream(self, status: int, headers: Mapping[str, str]) -> DirectWriter | None:
        """Called by set_head, in the producer's task, for a streamed 200 head: a writer with
        that head pending in it, to leave with the first event in one write; None where the
        server cannot (the body's task then sends the head)."""
        ...


class _Detached:
    """No server: a body not (or no longer) writing to a client."""

    def gone_at(self) -> float | None:
        return None

    def abort(self) -> None:
        pass

    def start_stream(self, status: int, headers: Mapping[str, str]) -> DirectWriter | None:
        return None


DETACHED: ClientConnection = _Detached()


class RelayTracker:
    """Live relays and lifetime counters: what the tests and metrics look at."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self.active: set[RelayBody] = set()
        # Every body not yet garbage collected: after a request ends, its body (and the
        # channel, buffers and producer state it holds) must become unreachable.
        self.alive: weakref.WeakSet[RelayBody] = weakref.WeakSet()
        self.started = 0
        self.finished = 0
        self.cancelled = 0
        self.stalled = 0
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def opened(self, body: RelayBody) -> None:
        self.active.add(body)
        self.alive.add(body)
        self.started += 1
        if self.metrics is not None:
            self.metrics.active_streams.inc()
        self._notify()

    def closed(self, body: RelayBody) -> None:
        self.active.discard(body)
        self.finished += 1
        if body.cancelled:
            self.cancelled += 1
        if body.stalled:
            self.stalled += 1
        if self.metrics is not None:
            self._observe(self.metrics, body)
        self._notify()

    @staticmethod
    def _observe(metrics: Metrics, body: RelayBody) -> None:
        metrics.active_streams.dec()
        key = "-" if body.access is None else body.access.key_label
        metrics.requests.labels(body.model, str(body.final_status), body.endpoint, key).inc()
        account = body.account
        if account.ttft is not None:
            # A streamed response that wrote at least once: what __anext__ counted, merged.
            metrics.ttft.labels(body.model).observe(account.ttft)
            metrics.token_gaps.merge((body.model,), account.gap_counts, account.gap_sum)
            if account.events_out:
                metrics.tokens_out.labels(body.model).inc(account.events_out)
        if body.stalled:
            metrics.stalled_clients.inc()
        if body.cancelled:
            metrics.cancellations.labels(body.backend, str(account.phase)).inc()
            if account.cancel_seconds is not None:
                metrics.cancel_propagation.labels(body.backend).observe(account.cancel_seconds)
            metrics.wasted_tokens.labels(body.backend).observe(account.undelivered)

    async def wait_until(self, predicate: Callable[[RelayTracker], bool]) -> None:
        """Return once ``predicate(self)`` holds; re-checked on every change. No timeout of
        its own: callers put it under a deadline."""
        while not predicate(self):
            await self._changed.wait()

    async def wait_idle(self) -> None:
        await self.wait_until(lambda tracker: not tracker.active)


class RelayBody(ResponseBody):
    """A response body fed by a producer task that lives exactly as long as the response."""

    def __init__(
        self,
        produce: Producer,
        *,
        deadlines: tuple[float, float] = (math.inf, math.inf),
        streaming: bool,
        channel_capacity: int,
        stall_timeout: float,
        tracker: RelayTracker | None = None,
        description: str = "",
        model: str = "",
        backend: str = "",
        access: AccessRecord | None = None,
        errors: ErrorShape = OPENAI_ERRORS,
        endpoint: str = "",
    ) -> None:
        self._produce = produce
        # When the first byte must be out (the client's SDK gives up then) and when the whole
        # answer must be: past either, the work is cancelled as for a client that left.
        self._first_byte_by, self._done_by = deadlines
        self._deadline_scope: trio.CancelScope | None = None
        self.deadline_passed = False
        # The server's drain has ended this request's grace (shut_down).
        self.drain_ended = False
        # Whether the upstream (or the local model) had the prompt when a deadline cut the
        # request before its first byte: that prefill was work for nobody.
        self.cut_in_prefill = False
        # How this endpoint's API says it failed (before the head, and in-band).
        self.errors = errors
        # A numbered stream (Responses): the last chunk handed on that carried a number, for
        # the in-band error's own.
        self._numbered = errors.numbered
        self.last_numbered = b""
        self.endpoint = endpoint
        self.streaming = streaming
        self.stall_timeout = stall_timeout
        self.tracker = tracker
        self.description = description
        self.capacity = channel_capacity
        self.send_channel, self._receive_channel = trio.open_memory_channel[bytes](channel_capacity)
        # The lifecycle: one state per side, moved only by _fire (the table is state.step).
        self.producer_state = RelayState.HEAD_PENDING
        self.client_state = RelayState.READING
        # Whether the head is decided, and how the body's task waits for it: set by _fire as
        # the producer leaves HEAD_PENDING with a head (a producer that stalls before any head
        # is DONE without one).
        self.head_ready = trio.Event()
        self.status = 500
        self.headers: dict[str, str] = {}
        # The verdicts, each decided once (cancelled: as the body closes; stalled: at the first
        # stall) and read by the tracker and the access line. Not lifecycle states: a client
        # can stall in any state, and a stalled request may be counted cancelled too.
        self.cancelled = False
        self.stalled = False
        # The body's task left before the head was ready (its __aenter__ was cancelled).
        self.unwritten = False
        self.error: ApiError | None = None
        # A known-length (non-streamed) body: its length, and the bytes handed to the writer.
        # Once all of them are, the response is complete (see complete), whatever the client
        # does next.
        self.content_length: int | None = None
        self._handed = 0
        self._nursery_manager: Any = None
        self._nursery: trio.Nursery | None = None
        self.model = model
        self.backend = backend
        # The client's connection, as the server writing this answer offers it (attach).
        self.connection: ClientConnection = DETACHED
        # Registered by the producer (RelaySink.on_close); run when the body closes.
        self.close_callbacks: list[Callable[[], None]] = []
        # Registered by the producer (RelaySink.on_disconnect); run by client_disconnected.
        self.disconnect_callbacks: list[Callable[[], None]] = []
        # The access log line, written when the body closes (None: no line).
        self.access = access
        # What the request is reported with at close (phase, timings, events): kept once per
        # write of a streamed (200, text/event-stream) response. Its write method is bound
        # here, so that the per-write call costs what a method of the body would.
        self.account = RelayAccount()
        self._wrote = self.account.wrote
        if access is not None and access.trace is not None and access.trace.reads_body(streaming):
            self.account.kept = []
        if streaming:
            self.account.opening = FIRST_TOKEN.get(endpoint)
        self._sse = False
        # The write-through hand-off (see write_through): the writer, and whether the producer
        # may use it now. Only the body sets direct_ok (True), when nothing is queued or being
        # written; anything queued through the channel clears it first. A plain bool, not a
        # lifecycle state: it flips chunk by chunk on the benchmarked path, where a bool is
        # the cheapest test there is.
        self._writer: DirectWriter | None = None
        self.direct_ok = False
        # A chunk the producer holds while it waits for room in the channel (the client reads
        # slowly): made, not yet queued. Cut there, it is counted with the unsent.
        self.in_hand: bytes | None = None

    def attach(self, connection: ClientConnection) -> None:
        """The connection this answer is written to, given by the server's writer before the
        body is entered (and DETACHED once it is done, so that neither keeps the other)."""
        self.connection = connection

    # -- the lifecycle ----------------------------------------------------------------------

    def _fire(self, event: RelayEvent) -> bool:
        """The one place the lifecycle moves (by state.step's table); False if ``event``
        changes nothing (a late or repeated report). Raises LifecycleError for a second head."""
        producer, client = step(self.producer_state, self.client_state, event)
        if producer is self.producer_state and client is self.client_state:
            return False
        self.producer_state = producer
        self.client_state = client
        if event is RelayEvent.HEAD:
            self.head_ready.set()
        elif event is RelayEvent.FINISHED and client is RelayState.READING and not self.complete:
            # Everything is handed on; the client has yet to read what is still queued.
            self.account.phase = Phase.AFTER_LAST
        return True

    @property
    def client_gone(self) -> bool:
        """True once the client has disconnected while the producer was at work."""
        return self.client_state is _GONE

    # -- what the producer drives (through RelaySink) --------------------------------------

    def set_head(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None,
        content_length: int | None,
    ) -> None:
        self._fire(RelayEvent.HEAD)
        self.status = status
        self.headers = {"Content-Type": content_type}
        if content_type.startswith("text/event-stream"):
            self.headers.update(STREAM_HEADERS)
            self._sse = status == 200
        if content_length is not None:
            self.headers["Content-Length"] = str(content_length)
            self.content_length = content_length
        if self._deadline_scope is not None:
            # The first byte is decided: only the end's deadline is left.
            self._deadline_scope.deadline = self._done_by
        if headers:
            self.headers.update(headers)
        if self._sse and self.streaming:
            # The head is started here rather than by the body's task once it wakes: the
            # producer's first offer (next, in this same step) then writes the head and the
            # first event in one write, and the time to first token saves a scheduler round
            # trip. Nothing is queued yet, so the producer may write directly (see offer).
            self._writer = self.connection.start_stream(status, self.headers)
            if self._writer is not None and not self.send_channel.statistics().current_buffer_used:
                self.direct_ok = True

    @property
    def writer(self) -> DirectWriter | None:
        """The writer set_head started the stream with, if it did."""
        return self._writer

    async def _run_producer(self) -> None:
        # The channel is closed with close(), not in an async with: aclose() would take a
        # checkpoint after closing, where the body (woken by the end of the stream) usually
        # finishes first and cancels this task, which then ends in a Cancelled raised for
        # nothing (most requests, in a count of the proxy's cancellations).
        try:
            try:
                await self._produce_within_deadlines()
            except ClientStalled:
                self.stall()
            except ApiError as error:
                await self._fail(error)
            except Exception:
                # The boundary of one request: a bug in a producer becomes this request's 500,
                # never a dead server. trio.Cancelled is a BaseException and passes through.
                log.exception("producer failed: %s", self)
                await self._fail(internal_error())
            else:
                if not self.head_ready.is_set():
                    log.error("producer returned without a response: %s", self)
                    await self._fail(internal_error())
            # Before the channel closes, so the body never sees the end of the stream while
            # the producer still reads as at work.
            self._fire(RelayEvent.FINISHED)
        finally:
            self.send_channel.close()

    def dispatched(self) -> None:
        """The request has left the queue (its first attempt is at work): its deadlines are
        this body's to keep from now on. While it waits, the queue keeps them itself and
        refuses it in its own words (503 deadline_unmeetable): two timers at one instant would
        hand the cancellation to this, the outer scope, and the refusal would be lost."""
        scope = self._deadline_scope
        if scope is not None and scope.deadline == math.inf and not self.head_ready.is_set():
            scope.deadline = min(self._first_byte_by, self._done_by)

    async def _produce_within_deadlines(self) -> None:
        first, done = self._first_byte_by, self._done_by
        # One scope for the request's deadlines and for a drain's end (shut_down).
        with trio.CancelScope() as scope:
            self._deadline_scope = scope
            if self.account.phase is not Phase.QUEUED:
                self.dispatched()
            await self._produce(RelaySink(self))
        self._deadline_scope = None
        if scope.cancelled_caught and self.drain_ended:
            # The drain's grace is over: the work is cancelled as for a client that left, and
            # the client hears why (a 503 before the head, an in-band error after it).
            raise shutting_down()
        if scope.cancelled_caught:
            # The work is gone (its scope cancelled, its upstream closed as for a client that
            # left); the client hears why, in the head or in-band.
            self.deadline_passed = True
            waited_for_first = not self.head_ready.is_set() and first <= done
            self.cut_in_prefill = not self.head_ready.is_set() and self.account.phase in (
                Phase.HEAD,
                Phase.FIRST_TOKEN,
            )
            raise deadline_exceeded(before_first_byte=waited_for_first)

    async def _fail(self, error: ApiError) -> None:
        # Kept for the access log and metrics (its code), not its traceback nor the errors
        # chained to it: they hold the producer's frames, which hold this body, and the cycle
        # would leave every failed relay to the cyclic GC (which server.tune_gc makes rare).
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self.error = error
        if not self.head_ready.is_set():
            body = self.errors.body(error)
            self.set_head(error.status, JSON_CONTENT_TYPE, error.headers, len(body))
            self.send_channel.send_nowait(body)  # nothing was sent before the head
        elif self.streaming:
            try:
                await RelaySink(self).send(self.errors.event(error, self.last_numbered))
            except ClientStalled:
                self.stall()

    # -- what the HTTP layer drives ---------------------------------------------------------

    async def __aenter__(self) -> RelayBody:
        self.account.start()
        self._nursery_manager = trio.open_nursery()
        nursery = await self._nursery_manager.__aenter__()
        self._nursery = nursery
        if self.tracker is not None:
            self.tracker.opened(self)
        try:
            nursery.start_soon(self._run_producer, name=f"relay producer {self.description}")
            await self.head_ready.wait()
        except BaseException as error:
            # The client left before the head was ready: __aexit__ will not be called for a
            # failed __aenter__, so close the nursery (cancelling the producer) here. Nothing
            # of the answer will be written, whatever the producer has decided by now.
            self.unwritten = True
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(  # type: ignore[override]  # the nursery may suppress: bool
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        assert self._nursery is not None
        # Cancelled: the client did not get the whole answer because it left (or the relay
        # ended) first. A producer that finished after its client had gone (an upstream
        # error written for nobody) cancelled it as much as one still at work.
        self.cancelled = self.unwritten or (
            not (self.complete or self.client_state is RelayState.ABANDONED)
            and (self.producer_state is not RelayState.DONE or self.client_state is _GONE)
        )
        account = self.account
        if self.cancelled:
            exit_started = trio.current_time()
        # The producer must never outlive the response, whatever ended it.
        self._nursery.cancel_scope.cancel()
        try:
            suppressed: bool = await self._nursery_manager.__aexit__(exc_type, exc_value, tb)
        finally:
            if self.cancelled:
                # What the producer handed on that never reached the client's socket (its
                # tokens went to nobody), once the producer is gone and can add no more.
                account.unsent = self._take_unsent()
                account.undelivered = len(account.unsent)
            self._receive_channel.close()
            if self.cancelled:
                started = account.gone_at or self.connection.gone_at() or exit_started
                account.cancel_seconds = trio.current_time() - started
            self.disconnect_callbacks.clear()
            for callback in self.close_callbacks:
                callback()
            if self.tracker is not None:
                self.tracker.closed(self)
            if self.access is not None:
                if self.access.trace is not None:
                    self._trace_ended(self.access.trace)
                self.access.emit(
                    status=self.final_status,
                    model=self.model or "-",
                    outcome=self.outcome,
                    ended=trio.current_time(),
                    ttft=account.ttft,
                    events=account.events_out,
                )
        return suppressed

    def _trace_ended(self, trace: RequestTrace) -> None:
        account = self.account
        trace.relay_ended(
            outcome=self.outcome,
            status=self.final_status,
            started=account.started_at,
            ttft=account.ttft,
            gone_at=account.gone_at or self.connection.gone_at(),
            cancel_seconds=account.cancel_seconds,
            delivered=account.events_out,
            undelivered=account.undelivered,
            closed=trio.current_time(),
            stream=self._sse,
            writes=(account.first, account.third_last, account.before_last, account.last),
            kept=account.kept,
        )

    def _take_unsent(self) -> list[bytes]:
        unsent: list[bytes] = []
        while True:
            try:
                chunk = self._receive_channel.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                if self.in_hand:
                    # The chunk the producer held, waiting for room: after those queued.
                    unsent.append(self.in_hand)
                    self.in_hand = None
                return unsent
            if chunk:
                unsent.append(chunk)

    def client_disconnected(self) -> None:
        """The HTTP layer saw the client go (the loop's hangup watcher, between task steps;
        the server's read task, as it reads the EOF; or the request's message task): stop the
        producer's work now, in this scheduler step. Its callbacks shut the upstream connection
        down, and its tasks are cancelled; the body writes nothing more. The request's own
        cancellation follows as always. Nothing is stopped once the client has the whole
        answer (see stream_handed): what the producer still does is its own tidying."""
        if self.complete or self.stream_handed or not self._fire(RelayEvent.LEFT):
            return
        self.account.gone_at = trio.current_time()
        callbacks, self.disconnect_callbacks = self.disconnect_callbacks, []
        for callback in callbacks:
            callback()
        if self._nursery is not None:
            # From a hangup watcher's hook trio would name whatever task runs next as the
            # canceller: the reason says who did.
            self._nursery.cancel_scope.cancel("client disconnected")

    @property
    def answered(self) -> bool:
        """Whether a client leaving now cancels nothing: the answer is whole on its socket
        (complete, stream_handed), or all decided (the producer is done, what it handed on
        still queued), so the writer writes it on; a client that only half-closed reads it,
        and one that closed fails the writes, quietly."""
        return self.complete or self.producer_state is RelayState.DONE or self.stream_handed

    @property
    def stream_handed(self) -> bool:
        """An event stream whose last event (its endpoint's: chat's ``[DONE]``, Messages'
        ``message_stop``...) has gone to the client's socket, with nothing queued or being
        written after it (direct_ok: the body is idle). Only asked as the client leaves."""
        return (
            self._sse
            and self.direct_ok
            and not self.buffered()
            and ends_stream(self.endpoint, self.account.last)
        )

    @property
    def complete(self) -> bool:
        """A known-length body whose every byte has been handed to the client's socket: the
        response is done, and a client that closes now is not cancelling anything (curl
        closes as soon as it has read Content-Length bytes)."""
        length = self.content_length
        return length is not None and self._handed >= length

    def shut_down(self) -> bool:
        """The drain's grace is about to end and this request is still at work: stop it now,
        so that its client is told (``shutting_down``) before the server cuts the connection;
        whether it was. Nothing to do once the producer is done (what is queued still goes
        out)."""
        scope = self._deadline_scope
        if scope is None or self.producer_state is RelayState.DONE or self.drain_ended:
            return False
        self.drain_ended = True
        scope.cancel("the server is shutting down")
        return True

    def abandon(self, error: ApiError) -> None:
        """The consumer ends the response itself (a WebSocket's translator met an upstream
        event it cannot relay): the outcome is ``error``, not a cancellation by the client."""
        self._fire(RelayEvent.ABANDON)
        if self.error is None:
            self.error = error

    @property
    def final_status(self) -> int:
        """The status the request ended with: 499 for a client that left before the head."""
        return 499 if self.cancelled and not self.head_ready.is_set() else self.status

    @property
    def outcome(self) -> str:
        """How it ended, for the access log: completed, cancelled(phase), stalled, or the
        error code of a failure (before or after the head)."""
        if self.stalled:
            return "stalled"
        if self.cancelled:
            return f"cancelled({self.account.phase})"
        if self.error is not None:
            return self.error.code or "error"
        return "completed"

    def __aiter__(self) -> RelayBody:
        return self

    async def __anext__(self) -> bytes:
        if self.client_state is _GONE or self.complete:
            # Nobody to write to (what is still queued counts as undelivered), or every byte
            # of a known-length body is out: nothing waits on what the producer does next.
            raise StopAsyncIteration
        receive_channel = self._receive_channel
        if self._writer is not None and not receive_channel.statistics().current_buffer_used:
            # Everything before is written and nothing waits: until something is queued, the
            # producer may write its chunks itself (offer).
            self.direct_ok = True
        try:
            chunk = await receive_channel.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        # Events that are already waiting go out in one write: under load this turns many
        # small socket sends into one, and it never delays an event that is ready now.
        parts: list[bytes] | None = None
        for _ in range(_MAX_COALESCE):
            try:
                more = receive_channel.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if parts is None:
                parts = [chunk]
            parts.append(more)
        if parts is not None:
            chunk = b"".join(parts)
        if self._sse and chunk:
            self._wrote(chunk)
        elif chunk:
            self.account.handed(chunk)
            if self.content_length is not None:
                self._handed += len(chunk)
        return chunk

    def offer(self, chunk: bytes) -> bool:
        """The producer's non-blocking hand-off (RelaySink.offer)."""
        if self.direct_ok:
            assert self._writer is not None
            written = self._writer.write_nowait(chunk)
            if written is not False:
                if self._sse:
                    self._wrote(chunk)
                else:
                    self.account.handed(chunk)
                if written is None:
                    # Part of it is pending: wake the body (an empty chunk) to flush it.
                    self.direct_ok = False
                    self.send_channel.send_nowait(b"")
                if self._numbered:
                    self.handed_numbered(chunk)
                return True
        self.direct_ok = False
        if not offer_to(self.send_channel, chunk):
            return False
        if self._numbered:
            self.handed_numbered(chunk)
        return True

    def handed_numbered(self, chunk: bytes) -> None:
        """A chunk of a numbered stream was handed on (written, or queued for the client)."""
        if b'"sequence_number"' in chunk:
            self.last_numbered = chunk

    def stall(self) -> None:
        """The client took nothing for ``stall_timeout`` (seen by the producer or the body):
        drop its connection, once; the body's writer is stuck in a write it will not take."""
        if self.stalled:
            return
        self.stalled = True
        log.warning("client stalled for %.1fs; cancelled %s", self.stall_timeout, self)
        self.connection.abort()

    async def write_through(self, writer: DirectWriter) -> None:
        """Send the body with ``writer``, letting the producer write a chunk straight to the
        socket when the body is idle (nothing queued, nothing being written): under no
        backpressure a token then costs no wake-up of the body's task. Order holds because
        the producer writes only while the body waits on an empty channel, and whatever the
        socket does not take goes back through the channel; backpressure holds because a
        full socket refuses the direct write, and the channel fills as before."""
        self._writer = writer
        try:
            async for chunk in self:
                await writer.write(chunk)
            await writer.write(b"")  # anything still pending, before the body ends
            await writer.wait_for_room()  # for the last chunk, which the server writes
        except ClientStalled:
            self.stall()
        finally:
            self._writer = None
            self.direct_ok = False

    def buffered(self) -> int:
        """Chunks waiting in this request's channel (never more than its capacity)."""
        return self.send_channel.statistics().current_buffer_used

    def __repr__(self) -> str:
        return f"<RelayBody {self.description} status={self.status}>"

    async def make_conditional(self, begin: int, end: int | None) -> int:  # pragma: no cover
        raise NotImplementedError("range requests make no sense on a relayed stream")
