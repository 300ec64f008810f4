"""The local backend: a model's sequences decoded together by one batch engine, behind the same
relay.

The engine (:mod:`inference.batching`) runs in one worker thread that :meth:`LocalBackend.run`
owns, started in the app's nursery with the model. Each request holds an admission slot (one
row of the batch) from its prompt to its last token; its pieces come back through a bounded
channel of its own, handed over once per step with ``TrioToken.run_sync_soon`` (the engine
never waits for the event loop). A reader that falls behind parks its own sequence, never the
batch; a client that leaves marks its sequence cancelled, and the request returns (its slot
free) only once the engine has taken it out, before its next step.

A streamed request may be paused for a more urgent one (``[scheduling] preempt_after``): its
sequence leaves the batch with its KV kept aside (``paused_kv_bytes``), the request gives its
slot up (:meth:`~proxy.relay.admission.Lease.pause`), and once it holds one again the sequence
rejoins from its own KV, token for token as if it had never left.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from functools import partial
from typing import Any, Protocol

import trio

from inference import (
    DONE,
    ChunkFormatter,
    GenerationResult,
    Generator,
    LoadedModel,
    PromptError,
    SamplingParams,
    Usage,
    cache_rows,
    sampling_from_body,
)
from inference.batching import DEFAULT_WINDOW, BatchEngine, Generation, Piece
from inference.prefix_cache import EVICTION, HIT, PrefixCache
from proxy.config import LocalModel
from proxy.ops import tracing
from proxy.ops.metrics import Metrics
from proxy.protocol.anthropic import MessagesStream, whole_message
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import CompletionRequest, Endpoint, check_local_parameters
from proxy.protocol.responses import ResponsesStream, whole_response
from proxy.protocol.scheduling import SchedulingSettings, Ticket
from proxy.protocol.token_usage import CURRENT_METER
from proxy.relay.admission import Admission, Dispatcher, Lease, Room
from proxy.relay.body import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, Sink
from proxy.relay.state import Phase

log = logging.getLogger("sluice.local")

_STEP_HISTORY = 4096
# A sequence's engine normally leaves within one step; this bounds the wait if a step hangs.
_LEAVE_TIMEOUT = 30.0


class _Tally:
    """The tokens one request's sequences have handed on so far (and, once a sequence ended,
    those it made that were not handed on)."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens = 0

    def count(self) -> int:
        return self.tokens


# The tally of the request the current task produces (set once it holds its slot).
_TALLY: ContextVar[_Tally | None] = ContextVar("sluice_local_tally", default=None)


class _Pausing:
    """A streamed request's way to be paused (the :class:`~proxy.relay.admission.Pausable` its
    producer registers): its slot's lease, its sink (the comments while paused), and the
    sequence the engine runs for it now."""

    __slots__ = ("done", "engine", "lease", "progress", "sequence", "sink", "wanted")

    def __init__(
        self, lease: Lease, sink: Sink, engine: BatchEngine, progress: Callable[[], int]
    ) -> None:
        self.lease = lease
        self.sink = sink
        self.engine = engine
        self.progress = progress
        self.sequence: Generation | None = None
        # Asked before its sequence was submitted (its prompt still being tokenized): the
        # sequence is paused as soon as it is.
        self.wanted = False
        # Its sequence has left the engine, or is leaving it: no notice comes any more.
        self.done = False

    def ask(self) -> bool:
        """The dispatcher asks: the engine takes the sequence out at its next step and says so
        with a notice piece, one for each pause asked, even one asked while a resume it has
        not taken yet is pending (see :meth:`BatchEngine.pause`); one that ends in the step
        already running simply ends, and its slot frees then. Once its sequence has left (or
        is leaving) it declines: nothing would make it give its slot up before its end, and
        the dispatcher asks another."""
        if self.done:
            return False
        sequence = self.sequence
        if sequence is None:
            self.wanted = True
            return True
        if sequence.cancelled:
            return False
        self.engine.pause(sequence)
        return True

    def withdraw(self) -> bool:
        """Not paused after all, unless the engine has taken the pause already
        (:meth:`BatchEngine.withdraw_pause`): then its notice comes as for any pause."""
        if self.done:
            return False
        sequence = self.sequence
        if sequence is None:
            withdrawn, self.wanted = self.wanted, False
            return withdrawn
        return self.engine.withdraw_pause(sequence)

    def started(self, sequence: Generation) -> None:
        """``sequence`` was submitted for this request."""
        self.sequence = sequence
        if self.wanted:
            self.wanted = False
            self.engine.pause(sequence)

    def finished(self) -> None:
        """Its sequence is out of the engine (or is leaving it), for good."""
        self.sequence = None
        self.done = True


# The pausing of the request the current task produces (None: it is never paused).
_PAUSING: ContextVar[_Pausing | None] = ContextVar("sluice_local_pausing", default=None)


class LocalGenerationError(RuntimeError):
    """The model failed while generating (a bug or a broken model): the request's 500."""


class LocalBackend:
    def __init__(
        self,
        model: LocalModel,
        loaded: LoadedModel,
        metrics: Metrics | None = None,
        scheduling: SchedulingSettings | None = None,
    ) -> None:
        self.model = model
        self.metrics = metrics
        self.generator = Generator(loaded, slow_step_seconds=model.slow_step_seconds)
        # Sluice's queue for the model's slots: its requests wait there in the scheduler's
        # order (relay/admission.py), as an upstream's do.
        self.room = Room(f"local model {model.name}", model.slots)
        dispatcher = Dispatcher(scheduling)
        dispatcher.room(self.room)
        self.admission = Admission(
            model.name,
            dispatcher,
            max_queue=model.max_queue,
            queue_timeout=model.queue_timeout,
            on_leave=None if metrics is None else self._left_queue,
            rooms=[self.room],
        )
        self.loaded = loaded
        # Reuse needs the same cache editing as batching (rows taken out of a batch): with
        # several slots, the engine's thread checks it before its first step
        # (_engine_thread); alone (one slot), the engine checks the first prompt's cache.
        self.prefix_cache = (
            PrefixCache(model.prefix_cache_bytes, on_event=self._on_prefix_event)
            if model.prefix_cache_bytes > 0
            else None
        )
        self.engine = BatchEngine(
            self.generator,
            max_batch=model.slots,
            prefill_chunk=model.prefill_chunk_tokens,
            prefill_chunk_alone=model.prefill_chunk_alone_tokens,
            batching=True,
            deliver=self._deliver,
            on_step=self._on_step,
            on_prefill=self._on_prefill,
            prefix_cache=self.prefix_cache,
            paused_bytes=model.paused_kv_bytes,
        )
        # Each sequence's way back: its pieces' channel, and the event set when it is out.
        self._listeners: dict[Generation, tuple[trio.MemorySendChannel[Piece], trio.Event]] = {}
        self._token: trio.lowlevel.TrioToken | None = None
        if metrics is not None:
            # Read at scrape time: nothing to update as requests come and go.
            name = model.name
            metrics.queue_depth.labels(name).set_function(lambda: self.admission.waiting)
            metrics.local_batch_size.labels(name).set_function(lambda: self.engine.batch_size)
            metrics.local_prefix_bytes.labels(name).set_function(
                lambda: 0 if self.prefix_cache is None else self.prefix_cache.bytes
            )
            self.admission.on_preempt = partial(metrics.paused, name, seconds=None)
            self.admission.on_resume = partial(metrics.paused, name)
        # Recent decode step latencies (bounded), and prefill times: the step-time watch.
        self.decode_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)
        self.prefill_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)

    @property
    def active_generations(self) -> int:
        """Sequences inside the engine now (decoding, parked, or waiting for their prefill)."""
        return len(self._listeners)

    @property
    def slow_steps(self) -> int:
        return self.engine.slow_steps

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The engine's thread, for as long as the server runs; cancelling this stops it after
        the step in progress (every sequence still inside then leaves)."""
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: trio.to_thread.run_sync(
                    self._engine_thread,
                    abandon_on_cancel=False,
                    limiter=trio.CapacityLimiter(1),
                    thread_name=f"sluice engine {self.model.name}",
                )
            )
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self.engine.stop()

    def _engine_thread(self) -> None:
        """The engine's thread: every forward pass of this model runs here, the start-up check
        of its cache included, so that no other thread keeps an OpenMP team that would make
        the engine's workers sleep between the regions of a step
        (:mod:`inference.torch_threads`). Requests submitted meanwhile wait in its inbox."""
        if self.model.slots > 1:
            unbatchable = cache_rows.check(self.loaded.serving)
            if unbatchable is not None:
                log.warning(
                    "model %s: continuous batching is unavailable (%s); its %d slots generate "
                    "one at a time",
                    self.model.name,
                    unbatchable,
                    self.model.slots,
                )
                self.engine.unbatched()
                self.prefix_cache = None
        self.engine.run()

    def _deliver(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        """Runs in the engine thread, once per step: hand the step's pieces to the loop."""
        assert self._token is not None
        self._token.run_sync_soon(self._hand_out, pieces, gone)

    def _hand_out(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        """Runs in the event loop."""
        for sequence, piece in pieces:
            listener = self._listeners.get(sequence)
            if listener is None:
                continue
            try:
                listener[0].send_nowait(piece)
            except trio.BrokenResourceError:
                pass  # its request has stopped reading: it is leaving
            except trio.WouldBlock:
                # Never: the engine steps a sequence only while its reader is less than a
                # window behind, and the channel holds a window and one more. Were it to
                # happen, a piece lost would corrupt the answer: end the sequence instead.
                log.exception("request %s: its piece channel is full", sequence.request_id)
                sequence.cancelled = True
                self.engine.wake()
        for sequence in gone:
            listener = self._listeners.pop(sequence, None)
            if listener is not None:
                listener[0].close()
                listener[1].set()

    def _on_step(self, batch_size: int, seconds: float) -> None:
        """Runs in the engine thread, after each decode step."""
        self.decode_seconds.append(seconds)
        if self.metrics is not None:
            name = self.model.name
            self.metrics.local_steps.observe_all((name, str(batch_size)), (seconds,))
            self.metrics.local_tokens.labels(name).inc(batch_size)

    def _on_prefill(self, seconds: float) -> None:
        """Runs in the engine thread, once per prompt."""
        self.prefill_seconds.append(seconds)
        if self.metrics is not None:
            self.metrics.local_prefill.labels(self.model.name).observe(seconds)
            self.metrics.local_tokens.labels(self.model.name).inc()

    def _on_prefix_event(self, kind: str) -> None:
        """Runs in the engine thread: a prefix cache lookup's outcome, or an eviction."""
        if self.metrics is not None:
            name = self.model.name
            if kind == HIT:
                self.metrics.local_prefix_hits.labels(name).inc()
            elif kind == EVICTION:
                self.metrics.local_prefix_evictions.labels(name).inc()
            else:
                self.metrics.local_prefix_misses.labels(name).inc()

    async def produce(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
        if request.endpoint not in _GENERATED:
            # Before the queue: a request this model cannot answer waits for nothing.
            raise ApiError(
                400,
                f"model '{self.model.name}' is a local text-generation model: it does not "
                f"serve {request.upstream_path} (embeddings need a model that makes them)",
                param="model",
                code="model_not_supported",
            )
        check_local_parameters(request.body, request.endpoint)
        # Templating and tokenizing a long prompt takes milliseconds: off the loop. Before the
        # queue, so that a prompt this model cannot take (past its context, with the output
        # asked for) is refused without holding a queue place or a slot.
        prepared = await trio.to_thread.run_sync(self._prepare, request)
        trace = tracing.current()
        queued = trio.current_time()
        admitted = False
        ticket = request.schedule.ticket()
        generated = _Tally()
        try:
            async with self.admission.lease(ticket) as lease:
                admitted = True
                pausing = (
                    _Pausing(lease, sink, self.engine, generated.count)
                    if _pausable(request)
                    else None
                )
                # Its tokens counted for its key's fair share as they are generated.
                self.admission.dispatcher.track(
                    ticket,
                    generated.count,
                    room=lease.room,
                    pause=pausing,
                )
                _TALLY.set(generated)
                _PAUSING.set(pausing)
                if trace is not None:
                    trace.stage("queue wait", queued, trio.current_time())
                await self._answer(request, request_id, sink, *prepared)
        finally:
            if trace is not None and not admitted:
                trace.stage("queue wait", queued, trio.current_time(), {"sluice.admitted": False})

    async def _answer(
        self,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        prompt_ids: list[int],
        params: SamplingParams,
        body: dict[str, Any],
    ) -> None:
        """The request, once it holds a slot of the model."""
        sink.set_phase(Phase.FIRST_TOKEN)
        wire = _wire(request, self.model.name, len(prompt_ids), params.logprobs is not None)
        endpoint = request.endpoint
        choices = (body.get("n") or 1) if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS) else 1
        if choices > 1:
            assert isinstance(wire, _CompletionsWire)
            await self._generate_choices(
                request, request_id, sink, wire, prompt_ids, params, choices
            )
        else:
            await self._generate_one(request, request_id, sink, wire, prompt_ids, params)

    def configure(self, scheduling: SchedulingSettings) -> None:
        """The scheduling settings of a reloaded config (its counters and queue stay)."""
        self.admission.dispatcher.queue.configure(scheduling)

    def _left_queue(self, ticket: Ticket, seconds: float, outcome: str) -> None:
        if self.metrics is not None:
            service = self.admission.dispatcher.queue.counters.get(ticket.tenant, 0.0)
            self.metrics.left_queue(self.model.name, ticket, seconds, outcome, "local", service)

    def _prepare(
        self, request: CompletionRequest
    ) -> tuple[list[int], SamplingParams, dict[str, Any]]:
        """Runs in a worker thread: the prompt's token ids and the sampling parameters."""
        model = self.model
        generator = self.generator
        endpoint = request.endpoint
        body = request.body
        try:
            if endpoint is Endpoint.CHAT:
                prompt_ids = generator.chat_prompt(body["messages"])
            elif endpoint is Endpoint.COMPLETIONS:
                prompt_ids = generator.text_prompt(body["prompt"])
            else:
                prompt_ids = generator.chat_prompt(request.detail.chat_messages())
                body = request.detail.sampling_body()
            params = generator.check_length(
                prompt_ids,
                sampling_from_body(
                    body,
                    default_max_tokens=model.default_max_tokens,
                    default_temperature=model.default_temperature,
                    default_repetition_penalty=model.default_repetition_penalty,
                ),
                asked=_asked_max_tokens(endpoint, body),
                prompt_param=_PROMPT_PARAM[endpoint],
            )
        except PromptError as error:
            raise ApiError(400, str(error), param=error.param, code=error.code) from None
        return prompt_ids, params, body

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        on_piece: Callable[[Piece], Awaitable[None]],
    ) -> GenerationResult:
        """One sequence through the engine: ``on_piece`` awaited with each piece, in order.
        However this ends (finished, the client gone, cancelled), it returns or raises only
        once the sequence is out of the batch."""
        sequence = Generation(prompt_ids, params, request_id=request_id, window=DEFAULT_WINDOW)
        # A window of pieces, one more, and a pause's notice (one at a time: a request is asked
        # to pause again only once it holds a slot again, its notice read).
        send, receive = trio.open_memory_channel[Piece](DEFAULT_WINDOW + 2)
        left = trio.Event()
        self._listeners[sequence] = (send, left)
        trace = tracing.current()
        stages = _Stages(trace, len(prompt_ids))
        pausing = _PAUSING.get()
        self.engine.submit(sequence)
        if pausing is not None:
            pausing.started(sequence)
        try:
            async with receive:
                async for piece in receive:
                    if piece.paused:
                        assert pausing is not None
                        await self._paused(sequence, pausing)
                        continue
                    if piece.error is not None:
                        raise LocalGenerationError(
                            f"model '{self.model.name}' failed while generating: "
                            f"{type(piece.error).__name__}: {piece.error}"
                        ) from piece.error
                    if stages.decoding is None:
                        stages.prefilled()
                    await on_piece(piece)
                    sequence.consumed += 1
                    if (tally := _TALLY.get()) is not None:
                        tally.tokens += 1
                    if sequence.parked:
                        self.engine.wake()
                    if piece.result is not None:
                        stages.finished(piece.result.usage.completion_tokens)
                        return piece.result
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        finally:
            if pausing is not None:
                pausing.finished()
            for_nobody = 0
            if not left.is_set():
                # Read before the flag is set: a pass that starts after it is one too many.
                passes_at_cancel, produced_at_cancel = sequence.progress
                sequence.cancelled = True
                self.engine.wake()
                # Shielded and bounded: the slot is free only once the model stopped.
                with trio.CancelScope(shield=True) as scope:
                    scope.deadline = trio.current_time() + _LEAVE_TIMEOUT
                    await left.wait()
                if left.is_set():
                    passes, produced = sequence.progress
                    for_nobody = produced - produced_at_cancel
                    stages.stopped(passes, produced - produced_at_cancel)
                    if self.metrics is not None:
                        name = self.model.name
                        self.metrics.local_steps_after_cancel.labels(name).observe(
                            passes - passes_at_cancel
                        )
                        self.metrics.local_tokens_for_nobody.labels(name).inc(
                            produced - produced_at_cancel
                        )
                if scope.cancelled_caught:
                    log.error(
                        "request %s: the engine did not release its sequence in %.0fs",
                        request_id,
                        _LEAVE_TIMEOUT,
                    )
                    self._listeners.pop(sequence, None)
            if (tally := _TALLY.get()) is not None:
                # Its key's fair share is charged what the engine made, not only what was
                # handed on: the tokens made for nobody after a cut were service too.
                tally.tokens += max(0, sequence.progress[1] - sequence.consumed)
            if (meter := CURRENT_METER.get()) is not None:  # a key's token budget
                meter.local_generation(len(prompt_ids), sequence.progress[1], for_nobody)

    async def _paused(self, sequence: Generation, pausing: _Pausing) -> None:
        """The engine took ``sequence`` out for a more urgent request: give the slot up, wait
        (the client hears ``: paused``), hold a slot again, and put the sequence back, from
        its own KV."""
        sink, lease = pausing.sink, pausing.lease
        sink.set_phase(Phase.PAUSED)
        ticket = lease.ticket
        # What it prefills again on resuming: nothing while its KV is kept, else its prompt and
        # answer so far (its key's counter is charged for that, as for any input).
        kept = sequence.kept_bytes > 0
        reprefill = 0 if kept else len(sequence.prompt_ids) + len(sequence.generated)
        await lease.pause([self.room], sink.offer, input_tokens=reprefill)
        # Resumed before the dispatcher may ask again, so that any pause it asks comes after
        # the resume, and the engine owes it a notice whether or not it has taken the resume.
        self.engine.resume(sequence)
        self.admission.dispatcher.track(
            ticket,
            pausing.progress,
            room=lease.room,
            pause=pausing,
            counted=pausing.progress(),
        )
        sink.set_phase(Phase.MID_STREAM if sequence.produced else Phase.FIRST_TOKEN)

    async def _generate_one(
        self,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        wire: _Wire,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        if request.stream:
            sink.begin(200, SSE_CONTENT_TYPE)
            for event in wire.start():
                await sink.send(event)

            async def stream(piece: Piece) -> None:
                for entry in piece.logprobs or ():
                    wire.record(entry)
                if piece.text:
                    await sink.send(wire.text(piece.text))

            result = await self.generate(prompt_ids, params, request_id, stream)
            for event in wire.end(result):
                await sink.send(event)
            return
        pieces: list[str] = []

        async def collect(piece: Piece) -> None:
            for entry in piece.logprobs or ():
                wire.record(entry)
            pieces.append(piece.text)

        result = await self.generate(prompt_ids, params, request_id, collect)
        whole = wire.whole("".join(pieces), result)
        sink.begin(200, JSON_CONTENT_TYPE, content_length=len(whole))
        await sink.send(whole)

    async def _generate_choices(
        self,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        wire: _CompletionsWire,
        prompt_ids: list[int],
        params: SamplingParams,
        choices: int,
    ) -> None:
        """``n`` choices: one sequence each, one after another in this slot (so a client that
        leaves stops the one in progress and no other starts). A request's seed gives each
        choice its own (seed + index), so that they differ and repeat alike."""
        if request.stream:
            sink.begin(200, SSE_CONTENT_TYPE)
        answers: list[tuple[str, str, list[dict[str, Any]] | None]] = []
        completion_tokens = 0
        for index in range(choices):
            choice_wire = wire.for_choice(index)
            formatter = choice_wire.formatter
            seed = None if params.seed is None else (params.seed + index) % (2**63)
            choice_params = dataclasses.replace(params, seed=seed)
            pieces: list[str] = []
            if request.stream and formatter.chat:
                await sink.send(formatter.role())

            async def take(
                piece: Piece, choice: _CompletionsWire = choice_wire, pieces: list[str] = pieces
            ) -> None:
                for entry in piece.logprobs or ():
                    choice.record(entry)
                if not request.stream:
                    pieces.append(piece.text)
                elif piece.text:
                    await sink.send(choice.text(piece.text))

            result = await self.generate(prompt_ids, choice_params, request_id, take)
            completion_tokens += result.usage.completion_tokens
            if request.stream:
                await sink.send(formatter.finish(result.finish_reason))
            else:
                answers.append(("".join(pieces), result.finish_reason, choice_wire.logprobs))
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens)
        if request.stream:
            if request.include_usage:
                await sink.send(wire.formatter.usage(usage))
            await sink.send(DONE)
            return
        whole = wire.formatter.whole_choices(answers, usage)
        sink.begin(200, JSON_CONTENT_TYPE, content_length=len(whole))
        await sink.send(whole)

    def describe(self) -> dict[str, Any]:
        decode = sorted(self.decode_seconds)

        def quantile_ms(q: float) -> float | None:
            return round(decode[int(q * (len(decode) - 1))] * 1000, 2) if decode else None

        return {
            "slots": self.room.capacity,
            "busy": self.room.in_flight,
            "queued": self.admission.waiting,
            "batching": self.engine.batching,
            "batch_size": self.engine.batch_size,
            "decode_step_ms_p50": quantile_ms(0.5),
            "decode_step_ms_p99": quantile_ms(0.99),
            "slow_steps": self.slow_steps,
            # Read from the engine thread's plain counters: a moment's figures.
            "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.describe(),
        }


# The endpoints a local model answers from its own generation.
_GENERATED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES})
# Each endpoint's field that holds the prompt, named by a refusal for its length.
_PROMPT_PARAM = {
    Endpoint.CHAT: "messages",
    Endpoint.COMPLETIONS: "prompt",
    Endpoint.RESPONSES: "input",
    Endpoint.MESSAGES: "messages",
}


def _asked_max_tokens(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """The field in which the client set the output limit (as the client spelled it), or None
    when the model's default applies. ``body`` is in chat-completions terms (the Responses and
    Messages requests' sampling body); a zero or null counts as unset, as
    :func:`inference.sampling_from_body` reads it."""
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens"):
        return "max_completion_tokens"
    if not body.get("max_tokens"):
        return None
    return "max_output_tokens" if endpoint is Endpoint.RESPONSES else "max_tokens"


class _Stages:
    """One sequence's stages in its request's trace (nothing when the request is untraced):
    ``prefill``, from its submission to its first piece (the wait for the engine's next step
    included), then ``decode``, to its last piece or to the step where the engine let go of
    it, and, for a request that left, the ``generation stopped`` event."""

    __slots__ = ("decoding", "prompt_tokens", "submitted", "trace")

    def __init__(self, trace: tracing.RequestTrace | None, prompt_tokens: int) -> None:
        self.trace = trace
        self.prompt_tokens = prompt_tokens
        self.submitted = trio.current_time()
        # When the first piece arrived (the end of the prefill).
        self.decoding: float | None = None

    def prefilled(self) -> None:
        self.decoding = now = trio.current_time()
        if self.trace is not None:
            self.trace.stage(
                "prefill", self.submitted, now, {"gen_ai.usage.input_tokens": self.prompt_tokens}
            )

    def finished(self, generated: int) -> None:
        if self.trace is not None:
            self._decoded({"sluice.local.tokens": generated})
            self.trace.local_usage(self.prompt_tokens, generated)

    def stopped(self, decode_step: int, for_nobody: int) -> None:
        if self.trace is None:
            return
        if self.decoding is None:
            self.trace.stage(
                "prefill", self.submitted, trio.current_time(), {"sluice.stopped": True}
            )
        else:
            self._decoded({"sluice.stopped": True})
        self.trace.generation_stopped(trio.current_time(), decode_step, for_nobody)

    def _decoded(self, attributes: dict[str, Any]) -> None:
        assert self.trace is not None
        if self.decoding is not None:
            self.trace.stage("decode", self.decoding, trio.current_time(), attributes)


class _Wire(Protocol):
    """One generation in an endpoint's shape: the stream's events, or the whole body."""

    def record(self, entry: dict[str, Any]) -> None:
        """A token's logprobs entry (only chat asks for them)."""

    def start(self) -> list[bytes]: ...

    def text(self, text: str) -> bytes: ...

    def end(self, result: GenerationResult) -> list[bytes]: ...

    def whole(self, text: str, result: GenerationResult) -> bytes: ...


class _CompletionsWire:
    """Chat completions and legacy completions: OpenAI's chunks, then ``data: [DONE]``. With
    logprobs, each text chunk carries the entries of the tokens whose text it is."""

    def __init__(self, request: CompletionRequest, model: str, logprobs: bool = False) -> None:
        chat = request.endpoint is Endpoint.CHAT
        self.include_usage = request.include_usage
        self.formatter = ChunkFormatter(
            chat=chat,
            model=model,
            response_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        )
        # Entries not yet sent with a chunk, and all of them (for a whole body).
        self.pending: list[dict[str, Any]] | None = [] if logprobs else None
        self.entries: list[dict[str, Any]] = []

    def for_choice(self, index: int) -> _CompletionsWire:
        """The wire of choice ``index`` of the same response (``n``): its own chunks and
        logprobs, the response's id."""
        choice = copy.copy(self)
        choice.formatter = self.formatter.for_choice(index)
        choice.pending = None if self.pending is None else []
        choice.entries = []
        return choice

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        """Every entry so far, or None when the request asked for none."""
        return None if self.pending is None else self.entries

    def record(self, entry: dict[str, Any]) -> None:
        if self.pending is not None:
            self.pending.append(entry)
            self.entries.append(entry)

    def text(self, text: str) -> bytes:
        if self.pending is None:
            return self.formatter.text(text)
        chunk = self.formatter.text(text, self.pending)
        self.pending = []
        return chunk

    def start(self) -> list[bytes]:
        return [self.formatter.role()] if self.formatter.chat else []

    def end(self, result: GenerationResult) -> list[bytes]:
        events = [self.formatter.finish(result.finish_reason)]
        if self.include_usage:
            events.append(self.formatter.usage(result.usage))
        return [*events, DONE]

    def whole(self, text: str, result: GenerationResult) -> bytes:
        return self.formatter.whole(text, result.finish_reason, result.usage, self.logprobs)


class _ResponsesWire:
    """The Responses API's typed events (response.created ... response.completed)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.response_id = "resp_" + uuid.uuid4().hex
        self.stream = ResponsesStream(model=model, response_id=self.response_id)
        self.text = self.stream.text

    def record(self, entry: dict[str, Any]) -> None:
        pass  # the Responses API's logprobs are not offered here

    def start(self) -> list[bytes]:
        return [self.stream.start()]

    def end(self, result: GenerationResult) -> list[bytes]:
        usage = result.usage
        return [
            self.stream.finish(result.finish_reason, usage.prompt_tokens, usage.completion_tokens)
        ]

    def whole(self, text: str, result: GenerationResult) -> bytes:
        return whole_response(
            model=self.model,
            response_id=self.response_id,
            text=text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
        )


class _MessagesWire:
    """Anthropic's Messages events (message_start ... message_stop)."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.message_id = "msg_" + uuid.uuid4().hex
        self.stream = MessagesStream(model=model, message_id=self.message_id)
        self.text = self.stream.text

    def record(self, entry: dict[str, Any]) -> None:
        pass  # the Messages API has no logprobs

    def start(self) -> list[bytes]:
        return [self.stream.start(self.prompt_tokens)]

    def end(self, result: GenerationResult) -> list[bytes]:
        return [
            self.stream.finish(
                result.finish_reason, result.usage.completion_tokens, result.stop_sequence
            )
        ]

    def whole(self, text: str, result: GenerationResult) -> bytes:
        return whole_message(
            model=self.model,
            message_id=self.message_id,
            text=text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.usage.prompt_tokens,
            completion_tokens=result.usage.completion_tokens,
            stop_sequence=result.stop_sequence,
        )


def _pausable(request: CompletionRequest) -> bool:
    """Whether a request may be paused: a stream (its client hears why it waits) of one
    sequence (``n`` choices run one after another in one slot)."""
    if not request.stream:
        return False
    if request.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        return request.body.get("n") in (None, 1)
    return True


def _wire(
    request: CompletionRequest, model: str, prompt_tokens: int, logprobs: bool = False
) -> _Wire:
    if request.endpoint is Endpoint.RESPONSES:
        return _ResponsesWire(model)
    if request.endpoint is Endpoint.MESSAGES:
        return _MessagesWire(model, prompt_tokens)
    return _CompletionsWire(request, model, logprobs)
