"""The local backend: a model generating in a worker thread, behind the same relay.

The thread sends each chunk with ``trio.from_thread.run(sink.send, chunk)``: while the client
is slow, the channel is full and the *model itself* waits there; when the client leaves, that
call (or the ``checkpoint`` before each decode step) raises ``Cancelled`` inside the thread,
which ends generation within one step. ``abandon_on_cancel=False`` makes the request wait for
the thread to return, so its slot is free only once the model really stopped.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from collections import deque
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
    sampling_from_body,
)
from proxy.config import ModelConfig
from proxy.ops.metrics import Metrics
from proxy.protocol.anthropic import MessagesStream, whole_message
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import CompletionRequest, Endpoint, check_local_parameters
from proxy.protocol.responses import ResponsesStream, whole_response
from proxy.relay.admission import Admission
from proxy.relay.body import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, Sink

log = logging.getLogger("sluice.local")

_STEP_HISTORY = 4096


class LocalBackend:
    def __init__(
        self, model: ModelConfig, loaded: LoadedModel, metrics: Metrics | None = None
    ) -> None:
        self.model = model
        self.metrics = metrics
        self.generator = Generator(loaded, slow_step_seconds=model.slow_step_seconds)
        self.admission = Admission(
            f"model '{model.name}'",
            slots=model.slots,
            max_queue=model.max_queue,
            queue_timeout=model.queue_timeout,
            on_leave=None if metrics is None else self._left_queue,
        )
        if metrics is not None:
            # Read at scrape time: nothing to update as requests come and go.
            metrics.queue_depth.labels(model.name).set_function(lambda: self.admission.waiting)
        # Admission already bounds concurrency to `slots`; this limiter only has to let that
        # many threads run (trio's default limiter is shared with every other thread user).
        self.threads = trio.CapacityLimiter(model.slots)
        self.active_threads = 0
        # Recent per-token decode latencies (bounded), and prefill times: the step-time watch.
        self.decode_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)
        self.prefill_seconds: deque[float] = deque(maxlen=_STEP_HISTORY)
        self.slow_steps = 0

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
        async with self.admission.slot():
            sink.set_phase("awaiting_first_token")
            await trio.to_thread.run_sync(
                self._work,
                request,
                request_id,
                sink,
                abandon_on_cancel=False,
                limiter=self.threads,
            )

    def _left_queue(self, seconds: float, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.queue_wait.labels(self.model.name, outcome).observe(seconds)

    def _work(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
        """Runs in the worker thread."""
        self.active_threads += 1
        try:
            self._generate(request, request_id, sink)
        finally:
            self.active_threads -= 1

    def _record_steps(self, result: GenerationResult) -> None:
        """Runs in the worker thread, once per finished generation."""
        steps = result.step_seconds
        if steps:
            self.prefill_seconds.append(steps[0])
            self.decode_seconds.extend(steps[1:])
            if self.metrics is not None:
                name = self.model.name
                self.metrics.local_prefill.labels(name).observe(steps[0])
                if len(steps) > 1:
                    # Bucketed here, off the event loop, and merged under one lock.
                    self.metrics.local_steps.observe_all((name,), steps[1:])
        self.slow_steps += result.slow_steps

    def _generate(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
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
            )
        except PromptError as error:
            raise ApiError(400, str(error), param=error.param, code=error.code) from None
        wire = _wire(request, model.name, len(prompt_ids), params.logprobs is not None)

        def send(chunk: bytes) -> None:
            trio.from_thread.run(sink.send, chunk)

        choices = (body.get("n") or 1) if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS) else 1
        if choices > 1:
            assert isinstance(wire, _CompletionsWire)
            self._generate_choices(request, request_id, sink, wire, prompt_ids, params, choices)
            return

        if request.stream:
            trio.from_thread.run_sync(sink.begin, 200, SSE_CONTENT_TYPE)
            for event in wire.start():
                send(event)
            result = generator.generate(
                prompt_ids,
                params,
                emit=lambda text: send(wire.text(text)),
                checkpoint=trio.from_thread.check_cancelled,
                request_id=request_id,
                on_logprob=wire.record,
            )
            self._record_steps(result)
            for event in wire.end(result):
                send(event)
            return
        pieces: list[str] = []
        result = generator.generate(
            prompt_ids,
            params,
            emit=pieces.append,
            checkpoint=trio.from_thread.check_cancelled,
            request_id=request_id,
            on_logprob=wire.record,
        )
        self._record_steps(result)
        whole = wire.whole("".join(pieces), result)

        def begin_whole() -> None:
            sink.begin(200, JSON_CONTENT_TYPE, content_length=len(whole))

        trio.from_thread.run_sync(begin_whole)
        send(whole)

    def _generate_choices(
        self,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        wire: _CompletionsWire,
        prompt_ids: list[int],
        params: SamplingParams,
        choices: int,
    ) -> None:
        """``n`` choices: one generation each, one after another in this slot (so a client
        that leaves stops the one in progress and no other starts). A request's seed gives
        each choice its own (seed + index), so that they differ and repeat alike."""

        def send(chunk: bytes) -> None:
            trio.from_thread.run(sink.send, chunk)

        if request.stream:
            trio.from_thread.run_sync(sink.begin, 200, SSE_CONTENT_TYPE)
        answers: list[tuple[str, str, list[dict[str, Any]] | None]] = []
        completion_tokens = 0
        for index in range(choices):
            choice_wire = wire.for_choice(index)
            formatter = choice_wire.formatter
            seed = None if params.seed is None else (params.seed + index) % (2**63)
            choice_params = dataclasses.replace(params, seed=seed)
            pieces: list[str] = []
            if request.stream and formatter.chat:
                send(formatter.role())

            def stream_text(text: str, choice: _CompletionsWire = choice_wire) -> None:
                send(choice.text(text))

            result = self.generator.generate(
                prompt_ids,
                choice_params,
                emit=stream_text if request.stream else pieces.append,
                checkpoint=trio.from_thread.check_cancelled,
                request_id=request_id,
                on_logprob=choice_wire.record,
            )
            self._record_steps(result)
            completion_tokens += result.usage.completion_tokens
            if request.stream:
                send(formatter.finish(result.finish_reason))
            else:
                answers.append(("".join(pieces), result.finish_reason, choice_wire.logprobs))
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens)
        if request.stream:
            if request.include_usage:
                send(wire.formatter.usage(usage))
            send(DONE)
            return
        whole = wire.formatter.whole_choices(answers, usage)

        def begin_whole() -> None:
            sink.begin(200, JSON_CONTENT_TYPE, content_length=len(whole))

        trio.from_thread.run_sync(begin_whole)
        send(whole)

    def describe(self) -> dict[str, Any]:
        decode = sorted(self.decode_seconds)

        def quantile_ms(q: float) -> float | None:
            return round(decode[int(q * (len(decode) - 1))] * 1000, 2) if decode else None

        return {
            "slots": self.admission.limiter.total_tokens,
            "busy": self.admission.limiter.borrowed_tokens,
            "queued": self.admission.waiting,
            "decode_step_ms_p50": quantile_ms(0.5),
            "decode_step_ms_p99": quantile_ms(0.99),
            "slow_steps": self.slow_steps,
        }


# The endpoints a local model answers from its own generation.
_GENERATED = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES})


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


def _wire(
    request: CompletionRequest, model: str, prompt_tokens: int, logprobs: bool = False
) -> _Wire:
    if request.endpoint is Endpoint.RESPONSES:
        return _ResponsesWire(model)
    if request.endpoint is Endpoint.MESSAGES:
        return _MessagesWire(model, prompt_tokens)
    return _CompletionsWire(request, model, logprobs)
