"""Guards in the request's nursery: the trio shell around ``proxy.guards`` (the public API)
and ``proxy.guards.window`` (what is held, windowed and released, sans-IO).

* :func:`call_guard`: one guard call, bounded by its ``timeout``, its failure decided by its
  ``on_error``, counted (``sluice_guard_decisions_total``, ``sluice_guard_seconds``) and
  traced (a span per call). It catches ``Exception`` only: ``trio.Cancelled`` always passes.
* :func:`guarded_producer`: the ``prompt`` and ``output`` stages, as one layer around a
  producer (as the key's limits and the meter are). The producer gets a
  :class:`GuardedSink`, which holds the answer's chunks while guards decide; the guards run
  in one task of a nursery inside the producer's own task, so inside the request's nursery:
  a client that leaves cancels them with the upstream. A refusal cancels the producer's scope
  and shuts the upstream connection in the same scheduler step (the callbacks the producer
  registered for a disconnect), so at most the event already read comes after it; the
  tokens that do are counted for nobody, with cause ``guard``.
* :class:`AfterHooks`: the ``after`` stage, in a bounded nursery owned by the server.

A request with no guard that applies never meets any of this: the pipeline adds the layer
only when a guard applies (a feature that is off costs nothing).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from proxy.guards import Outcome, Prompt, Refusal, Stage, Window
from proxy.guards.window import (
    DueWindow,
    OutputLedger,
    TextReader,
    rewrite_closing,
    rewrite_events,
    rewrite_whole,
    whole_text,
)
from proxy.ops.logs import AccessRecord
from proxy.ops.metrics import Metrics
from proxy.protocol.errors import INVALID_REQUEST, SERVER_ERROR, ApiError
from proxy.relay.body import RelaySink, Sink
from proxy.relay.state import Phase

log = logging.getLogger("sluice.guards")

# The verdicts sluice_guard_decisions_total counts (dropped: an after hook over the bound).
VERDICTS = ("pass", "refuse", "error", "timeout", "dropped")
# The after hooks running at once at most; past it a call is dropped (and counted).
MAX_AFTER_CALLS = 1024

GuardCall = Callable[[Any], Awaitable[Any]]


# What a whole (non-streamed) answer held counts as: every token of it went to nobody, however
# many (the accounting takes the smaller of this and the answer's output).
EVERY_TOKEN = 1 << 62


@dataclass(frozen=True, slots=True)
class Guard:
    """One ``[[guards]]`` table, built: what the relay needs of it."""

    name: str
    stage: Stage
    call: GuardCall
    timeout: float
    # on_error = "deny": a failure or a timeout refuses.
    deny_on_error: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    window_tokens: int = 32
    overlap_tokens: int = 8
    hold_back_tokens: int = 32
    release_after: bool = True


def refusal_error(refusal: Refusal) -> ApiError:
    """A refusal as the client gets it, in the endpoint's own shape."""
    return ApiError(
        refusal.status,
        refusal.message,
        type=SERVER_ERROR if refusal.status >= 500 else INVALID_REQUEST,
        code=refusal.code,
    )


def failed_refusal(guard: Guard, verdict: str) -> Refusal:
    """What ``on_error = "deny"`` answers for a guard that failed or timed out."""
    return Refusal(
        "a policy check could not be made, and the request was refused",
        status=503,
        code="guard_unavailable",
        reason=f"{guard.name}: {verdict}",
    )


class GuardObserver:
    """Where a guard call's decision goes: the metrics, the request's trace."""

    def __init__(self, metrics: Metrics | None, access: AccessRecord | None = None) -> None:
        self.metrics = metrics
        self.access = access

    def decided(self, guard: Guard, verdict: str, started: float, ended: float) -> None:
        metrics = self.metrics
        if metrics is not None:
            metrics.guard_decisions.labels(guard.name, guard.stage, verdict).inc()
            metrics.guard_seconds.labels(guard.name, guard.stage).observe(ended - started)
        trace = None if self.access is None else self.access.trace
        if trace is not None:
            trace.guard_call(guard.name, guard.stage, verdict, started, ended)

    def refused(self, guard: Guard, refusal: Refusal) -> None:
        """The request's access line names the guard that refused it, and why."""
        if self.access is not None:
            self.access.guard = guard.name
            self.access.guard_reason = refusal.reason


async def call_guard(guard: Guard, context: object, observer: GuardObserver) -> Any:
    """Call ``guard``: its verdict (None, a :class:`Refusal`, or what the stage lets it
    return), within its timeout; a failure or a timeout is a refusal under ``on_error =
    "deny"`` and a pass under ``"allow"``."""
    started = trio.current_time()
    verdict = "pass"
    value: Any = None
    try:
        with trio.move_on_after(guard.timeout) as bound:
            value = await guard.call(context)
    except Refusal as refusal:
        value = refusal
    except Exception:
        log.warning("guard %r failed (%s stage)", guard.name, guard.stage, exc_info=True)
        verdict = "error"
    else:
        if bound.cancelled_caught:
            verdict = "timeout"
            log.warning("guard %r timed out after %gs", guard.name, guard.timeout)
    if isinstance(value, Refusal):
        verdict = "refuse"
    elif verdict != "pass":
        value = failed_refusal(guard, verdict) if guard.deny_on_error else None
    observer.decided(guard, verdict, started, trio.current_time())
    return value


async def prompt_stage(
    guards: Sequence[Guard], prompt: Prompt, observer: GuardObserver
) -> tuple[Guard, Refusal] | None:
    """Every ``prompt`` guard in order; the first refusal stops the rest."""
    for guard in guards:
        verdict = await call_guard(
            guard, replace(prompt, guard=guard.name, options=guard.options), observer
        )
        if isinstance(verdict, Refusal):
            return guard, verdict
    return None


@dataclass(frozen=True, slots=True)
class RequestGuards:
    """The guards of one request at the ``prompt`` and ``output`` stages, and what their
    contexts say of it."""

    prompt: tuple[Guard, ...]
    output: tuple[Guard, ...]
    # The request as the prompt guards see it (guard and options filled in per guard).
    context: Prompt
    observer: GuardObserver

    def ledger(self) -> OutputLedger | None:
        """One answer's windows, cut once for all its output guards: the smallest window,
        the largest overlap and hold-back; held until checked if any guard says so."""
        guards = self.output
        if not guards:
            return None
        window = min(guard.window_tokens for guard in guards)
        return OutputLedger(
            window,
            min(window - 1, max(guard.overlap_tokens for guard in guards)),
            max(guard.hold_back_tokens for guard in guards),
            release_after=any(guard.release_after for guard in guards),
        )

    @property
    def prompt_hold(self) -> int:
        """The events held at most while the prompt guards decide."""
        return max((guard.hold_back_tokens for guard in self.prompt), default=0)


def guarded_producer(
    produce: Callable[[Sink], Awaitable[None]], guards: RequestGuards
) -> Callable[[RelaySink], Awaitable[None]]:
    """``produce`` with the request's ``prompt`` and ``output`` guards around it."""

    async def guarded(sink: RelaySink) -> None:
        await GuardedRun(sink, guards).run(produce)

    return guarded


_END = object()


class GuardedRun:
    """One request's guarded answer: what is held, the guards' task, the release."""

    def __init__(self, sink: Sink, guards: RequestGuards) -> None:
        self.sink = sink
        self.guards = guards
        self.ledger = guards.ledger()
        # The answer's text, read once per chunk without a full parse of its events.
        self.reader = TextReader()
        self.observer = guards.observer
        self.after = self.ledger is not None and self.ledger.release_after
        self.prompt_pending = bool(guards.prompt)
        # Chunks held for the prompt guards only (release "before", or no output guard),
        # and their events.
        self.waiting: deque[bytes] = deque()
        self.waiting_events = 0
        self.waiting_tokens = 0
        # A chunk the producer holds while it waits for the guards to make room.
        self.in_hand: bytes | None = None
        # Whether a chunk may go straight to the client (nothing held, nothing to hold).
        self.direct = not self.prompt_pending and not self.after
        # The producer's head, once it decided it; sent with the first release.
        self.head: tuple[int, str, Mapping[str, str] | None] | None = None
        self.head_sent = False
        self.committed = False
        # An answer no guard reads (an error status, a body that is not SSE).
        self.passthrough = False
        # A whole (non-streamed) answer: its bytes, checked and released at its end.
        self.whole: list[bytes] | None = None
        self.refusal: tuple[Guard, Refusal] | None = None
        # A Responses stream held per window: each window's text as the client got it, and
        # the answer's original length, for its closing events once a guard rewrote a window
        # (they repeat the whole text).
        self.sent_texts: list[str] | None = (
            [] if guards.context.endpoint == "responses" and self.after else None
        )
        self.original_length = 0
        self.rewrote = False
        # Tokens held when a guard refused (made, never sent), and made after the refusal.
        self.withheld_at_verdict = 0
        self.after_verdict_tokens = 0
        self.failure: Exception | None = None
        self.dispatched = trio.Event()
        self.windows: deque[object] = deque()
        self._window_ready = trio.Event()
        self._room = trio.Event()
        self.disconnect_callbacks: list[Callable[[], None]] = []
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None

    # -- the run ---------------------------------------------------------------------------

    async def run(self, produce: Callable[[Sink], Awaitable[None]]) -> None:
        error: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._decide, name="guards")
                try:
                    with self._scope:
                        await produce(GuardedSink(self))
                except Exception as raised:  # noqa: BLE001 - re-raised below, out of the nursery
                    error = raised
                    nursery.cancel_scope.cancel()
                else:
                    if self.refusal is None and self.failure is None:
                        self._end()
        finally:
            access = self.guards.observer.access
            if access is not None and self.refusal is not None:
                # Refused (its client may have left since): what the guards held at the
                # verdict and what came after it, made for nobody.
                access.guard_waste = (
                    self.withheld_at_verdict + self.after_verdict_tokens + self._in_hand_tokens()
                )
            elif access is not None:
                # However else it ended (its client gone, most often): what the guards still
                # held was made and never sent, the client's tokens for nobody.
                access.guard_withheld = self.held_tokens()
        if self.refusal is not None:
            guard, refusal = self.refusal
            self.guards.observer.refused(guard, refusal)
            raise refusal_error(refusal)
        if self.failure is not None:
            raise self.failure
        if error is not None:
            raise error

    def _end(self) -> None:
        """The producer returned: the last window, then the end, to the guards' task."""
        self.dispatched.set()
        if self.passthrough:
            # Nothing of this answer is any guard's: the prompt's verdict is not waited for.
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            return
        if self.ledger is not None and self.whole is None:
            window = self.ledger.finish()
            if window is not None:
                self._queue(window)
        self._queue(_END)

    def _queue(self, item: object) -> None:
        self.windows.append(item)
        self._window_ready.set()

    async def _decide(self) -> None:
        """The guards' task: the prompt's verdict, then each window's, releasing as they pass."""
        try:
            if self.prompt_pending:
                await self.dispatched.wait()
                refused = await prompt_stage(
                    self.guards.prompt, self.guards.context, self.guards.observer
                )
                if refused is not None:
                    self._refuse(*refused)
                    return
                self.prompt_pending = False
                await self._flush_waiting()
            while True:
                while not self.windows:
                    self._window_ready = trio.Event()
                    await self._window_ready.wait()
                item = self.windows.popleft()
                if item is _END:
                    await self._flush_whole()
                    return
                assert isinstance(item, DueWindow)
                if not await self._check(item):
                    return
        except Exception as error:  # noqa: BLE001 - the client stalled, in a release: the producer's
            self.failure = error
            self._scope.cancel()

    async def _check(self, due: DueWindow) -> bool:
        """``due`` through every output guard; its chunks released once it passed. False:
        refused."""
        text: str | None = None
        window = self._window(due.text, due.new_text, due.index, due.final)
        for guard in self.guards.output:
            verdict = await call_guard(
                guard, replace(window, guard=guard.name, options=guard.options), self.observer
            )
            if isinstance(verdict, Refusal):
                self._refuse(guard, verdict)
                return False
            if isinstance(verdict, str) and self.after and verdict != window.new_text:
                text = verdict
                window = replace(window, text=window.overlap + verdict, new_text=verdict)
        assert self.ledger is not None
        freed = self.ledger.passed(due)
        self._wake()
        sent = self.sent_texts
        if sent is not None:
            sent.append(window.new_text)
            self.original_length += len(due.new_text)
        if text is not None:
            self.rewrote = True
            data = self._rewritten(due, freed, text)
        elif freed:
            data = b"".join(freed)
        else:
            return True
        if self.rewrote and sent is not None:
            data = rewrite_closing(data, "".join(sent), self.original_length)
        await self._release(data)
        return True

    def _rewritten(self, due: DueWindow, freed: list[bytes], text: str) -> bytes:
        """The chunks a rewritten window frees, carrying ``text`` (its new text as the client
        is to get it). They do not hold the window's new text alone: they begin with the chunks
        the previous window kept for its overlap (that text is the previous window's, and goes
        out as it is: a window that rewrote keeps none), and they end before this window's own
        kept chunks (released with the next window). The rewrite keeps them held when it left
        their text as it was; else they go now, so that no text is sent twice or lost."""
        assert self.ledger is not None
        kept = self.ledger.kept(due)
        read = self.reader.read_chunk
        every = "".join(read(chunk).text for chunk in (*freed, *kept))
        carried = every[: len(every) - len(due.new_text)] if every.endswith(due.new_text) else ""
        kept_text = "".join(read(chunk).text for chunk in kept)
        if due.new_text.endswith(kept_text) and text.endswith(kept_text):
            placed = carried + text[: len(text) - len(kept_text)]
            # (An event of the freed ones must carry it.)
            if not placed or any(read(chunk).tokens for chunk in freed):
                return rewrite_events(freed, placed)
        return rewrite_events([*freed, *self.ledger.release_kept(due)], carried + text)

    def _window(self, text: str, new_text: str, index: int, final: bool) -> Window:
        context = self.guards.context
        return Window(
            "",
            context.request_id,
            context.endpoint,
            context.model,
            context.key,
            text,
            new_text,
            index,
            final,
        )

    async def _flush_waiting(self) -> None:
        """The prompt passed: what it held goes out (unless output guards hold it still)."""
        while self.waiting:
            chunk = self.waiting.popleft()
            read = self.reader.read_chunk(chunk)
            self.waiting_events = max(0, self.waiting_events - read.events)
            self.waiting_tokens = max(0, self.waiting_tokens - read.tokens)
            await self._release(chunk)
        if not self.after and self.whole is None:
            self.direct = True
        self._wake()

    async def _flush_whole(self) -> None:
        """A whole answer, at its end: checked as one window, then released."""
        whole = self.whole
        if whole is None:
            if self.head is not None and not self.head_sent:
                await self._release(b"")  # an empty answer: its head all the same
            return
        body = b"".join(whole)
        if self.guards.output:
            text = whole_text(body)
            window = self._window(text, text, 0, True)
            for guard in self.guards.output:
                verdict = await call_guard(
                    guard,
                    replace(window, guard=guard.name, options=guard.options),
                    self.guards.observer,
                )
                if isinstance(verdict, Refusal):
                    self._refuse(guard, verdict)
                    return
                if isinstance(verdict, str) and verdict != window.new_text:
                    window = replace(window, text=verdict, new_text=verdict)
                    body = rewrite_whole(body, verdict)
        await self._release(body, length=len(body))

    async def _release(self, data: bytes, *, length: int | None = None) -> None:
        sink = self.sink
        if not self.head_sent:
            assert self.head is not None
            status, content_type, headers = self.head
            self.head_sent = True
            sink.begin(status, content_type, headers, content_length=length)
        if data and not sink.offer(data):
            await sink.send(data)

    def held_tokens(self, *, in_hand: bool = True) -> int:
        """Tokens taken from the producer and not handed on to the client: in the output
        guards' windows, waiting for the prompt's verdict, and (``in_hand``) in the chunk the
        producer holds while it waits for room; EVERY_TOKEN for a whole answer held."""
        if self.whole:
            return EVERY_TOKEN
        held = self.waiting_tokens
        if self.ledger is not None:
            held += sum(tokens for _, tokens in self.ledger.held)
        return held + self._in_hand_tokens() if in_hand else held

    def _in_hand_tokens(self) -> int:
        return self.reader.read_chunk(self.in_hand).tokens if self.in_hand else 0

    def _refuse(self, guard: Guard, refusal: Refusal) -> None:
        self.refusal = (guard, refusal)
        # (The chunk in the producer's hand is counted where it ends: taken after the
        # verdict, or still in hand when the run ends.)
        self.withheld_at_verdict = self.held_tokens(in_hand=False)
        if self.ledger is not None:
            self.ledger.drop()
        self.waiting.clear()
        self.whole = None
        # The upstream connection shut in this step, as for a client that left; the
        # producer's scope cancelled (its task unwinds at its next checkpoint).
        callbacks, self.disconnect_callbacks = self.disconnect_callbacks, []
        for callback in callbacks:
            callback()
        self._scope.cancel("refused by guard " + guard.name)
        self._wake()

    def _wake(self) -> None:
        self._room.set()

    # -- what the producer drives (through GuardedSink) ------------------------------------

    def full(self) -> bool:
        """Whether the producer must wait: the prompt's hold (or its release) is at its
        bound, or the output guards are behind by a window and the hold-back."""
        if not self.after and self.waiting_events >= max(1, self.guards.prompt_hold):
            return True
        return self.ledger is not None and self.ledger.full

    async def wait_for_room(self) -> None:
        while self.full() and self.refusal is None:
            self._room = trio.Event()
            await self._room.wait()

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None,
        content_length: int | None,
    ) -> None:
        self.committed = True
        self.dispatched.set()
        if status != 200 or not (
            content_type.startswith("text/event-stream") or content_length is not None
        ):
            self.passthrough = True
            self.direct = True
            self.head_sent = True
            self.sink.begin(status, content_type, headers, content_length=content_length)
            return
        self.head = (status, content_type, headers)
        if content_length is not None:
            self.whole = []
            self.direct = False
        elif self.direct:
            self.head_sent = True
            self.sink.begin(status, content_type, headers)

    def take(self, chunk: bytes) -> None:
        """A chunk the producer handed on, held or counted (the producer checked for room)."""
        if self.refusal is not None:
            self.after_verdict_tokens += self.reader.read_chunk(chunk).tokens
            return
        if self.whole is not None:
            self.whole.append(chunk)
            return
        ledger = self.ledger
        read = self.reader.read_chunk(chunk)
        if ledger is not None:
            due = ledger.take(chunk, read)
            if due is not None:
                self._queue(due)
        if not self.after:
            self.waiting.append(chunk)
            self.waiting_events += max(1, read.events)
            self.waiting_tokens += read.tokens

    def offer_direct(self, chunk: bytes) -> bool:
        """A chunk straight on (nothing held): checked beside (``release = "before"``)."""
        ledger = self.ledger
        if ledger is not None and ledger.full:
            return False
        if not self.sink.offer(chunk):
            return False
        self.went_out(chunk)
        return True

    def offer_comment(self, chunk: bytes) -> bool:
        """An SSE comment while the answer is held: no guard reads it (it has no text), and it
        must reach the client now, not with the next window: a paused stream's keep-alive
        (``: paused``) is what keeps the client's read timeout from firing while no window
        comes, and held, each one would pile up behind the last window's overlap. Before the
        head is out it is dropped: it cannot precede the head, and sending the head would
        commit the status that a refusal may still need."""
        if self.refusal is not None or self.whole is not None or not self.head_sent:
            return True
        return self.sink.offer(chunk)

    def went_out(self, chunk: bytes) -> None:
        """A chunk went straight on: its text still goes to the output guards' windows."""
        ledger = self.ledger
        if ledger is not None:
            due = ledger.take(chunk, self.reader.read_chunk(chunk))
            if due is not None:
                self._queue(due)


class GuardedSink:
    """What the producer writes to: a :class:`~proxy.relay.body.Sink` that holds the answer
    while the guards decide, and stops taking once they refused."""

    __slots__ = ("_run",)

    def __init__(self, run: GuardedRun) -> None:
        self._run = run

    @property
    def started(self) -> bool:
        # The producer's head is decided (held or sent): its failures are no longer retried.
        return self._run.committed or self._run.sink.started

    @property
    def client_gone(self) -> bool:
        return self._run.sink.client_gone

    def set_phase(self, phase: Phase) -> None:
        self._run.sink.set_phase(phase)
        if phase is not Phase.QUEUED:
            self._run.dispatched.set()

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        self._run.disconnect_callbacks.append(callback)
        self._run.sink.on_disconnect(callback)

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        self._run.begin(status, content_type, headers, content_length)

    def offer(self, chunk: bytes) -> bool:
        run = self._run
        if run.direct and run.refusal is None:
            return run.offer_direct(chunk)
        if _only_comments(chunk):
            return run.offer_comment(chunk)
        if run.full() and run.refusal is None:
            return False
        run.take(chunk)
        return True

    async def send(self, chunk: bytes) -> None:
        run = self._run
        if _only_comments(chunk) and not (run.direct and run.refusal is None):
            if not run.offer_comment(chunk):
                await run.sink.send(chunk)
            return
        if run.full() and run.refusal is None:
            # Made, and held here while the guards catch up: cut now, it is withheld.
            run.in_hand = chunk
            await run.wait_for_room()
            run.in_hand = None
        if run.direct and run.refusal is None:
            if not run.sink.offer(chunk):
                await run.sink.send(chunk)
            run.went_out(chunk)
            return
        run.take(chunk)


def _only_comments(chunk: bytes) -> bool:
    """Whether ``chunk`` is SSE comment lines only (``: paused``, an upstream's ``: ping``)."""
    return chunk[:1] == b":" and all(
        line[:1] == b":" for line in chunk.split(b"\n") if line.strip(b"\r")
    )


# -- the after stage ------------------------------------------------------------------------


class AfterHooks:
    """The ``after`` stage: each hook call a task in a nursery that the server owns (started
    with the app, :meth:`run`), at most ``limit`` at once (past it a call is dropped and
    counted, never queued without bound). :meth:`drain` waits for the calls running up to a
    deadline (the drain's grace), then cancels them."""

    def __init__(self, metrics: Metrics | None, limit: int = MAX_AFTER_CALLS) -> None:
        self.metrics = metrics
        self.limit = limit
        self.running = 0
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self._deadline = math.inf
        self._done = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self._closing.wait()
                with trio.move_on_at(self._deadline):
                    await self._idle.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._done.set()

    def submit(self, guards: Sequence[Guard], outcome: Outcome) -> None:
        """Run every hook of ``guards`` with ``outcome``, in order, in the server's nursery."""
        if not guards:
            return
        nursery = self._nursery
        if nursery is None or self._closing.is_set() or self.running >= self.limit:
            observer = GuardObserver(self.metrics)
            now = trio.current_time()
            for guard in guards:
                observer.decided(guard, "dropped", now, now)
            return
        self.running += 1
        self._idle = trio.Event()
        nursery.start_soon(self._call_all, guards, outcome, name="after hooks")

    async def _call_all(self, guards: Sequence[Guard], outcome: Outcome) -> None:
        observer = GuardObserver(self.metrics)
        try:
            for guard in guards:
                await call_guard(
                    guard, replace(outcome, guard=guard.name, options=guard.options), observer
                )
        finally:
            self.running -= 1
            if not self.running:
                self._idle.set()

    async def drain(self, deadline: float) -> None:
        """Stop taking calls; wait for those running until ``deadline``, then cancel them."""
        self._deadline = deadline
        self._closing.set()
        if self._nursery is not None:
            await self._done.wait()
