"""What one request really used, in tokens, sans-IO: the body edits that make an upstream say
it, the stream splitter that counts as events pass, and the charge that results.

The truth, in order of preference:

1. the model's own count: a local model's (prompt tokens, tokens generated), or the upstream's
   usage block (``usage`` of a chat or completions answer, asked for in a stream with
   ``stream_options.include_usage``; Responses' ``response.completed``; Messages'
   ``message_start`` and ``message_delta``);
2. without one (the client left, the upstream broke, a deadline passed), what was received as
   it streamed: **one token per content delta event** (an event carrying answer text: chat's
   ``"content":"`` or ``"reasoning_content":"`` with text after it, so not the opening role
   delta's ``"content":""``, completions' ``"text":"`` likewise, a Responses
   ``*.delta`` event, a Messages ``content_block_delta``), those received for a client that
   had already left included;
3. input tokens without a count from the model are an **estimate**: the prompt's characters
   / 4 (rounded up), and the charge says it is one.

The per-event cost is one ``bytes.count`` per upstream read (see :class:`MeteredSplitter`);
events are inspected one by one only when a read holds something that is not a content delta
(the opening, the end, a usage block), a few per stream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.response_facts import (
    ResponseFacts,
    answer_text,
    sse_payloads,
    whole_payload,
)
from proxy.protocol.sse import SSESplitter

# What a request reserves for its output when it names no maximum and its key has no cap
# (an upstream's own default is unknown here; a local model's is its default_max_tokens).
DEFAULT_RESERVED_OUTPUT = 4096
# The characters one token stands for in an estimate (OpenAI's rule of thumb for English).
CHARS_PER_TOKEN = 4

# A content delta event, by endpoint: counted with one bytes.count per read. Compact JSON, as
# vLLM, SGLang, llama.cpp and OpenAI write it; "ontent" covers content and reasoning_content.
_DELTA: dict[Endpoint, bytes] = {
    Endpoint.CHAT: b'ontent":"',
    Endpoint.COMPLETIONS: b'"text":"',
    Endpoint.RESPONSES: b'.delta"',
    Endpoint.MESSAGES: b'"content_block_delta"',
}
# The same, spaced (Python's json.dumps default): looked for in the events inspected one by one.
_SPACED_DELTA: dict[Endpoint, bytes] = {
    Endpoint.CHAT: b'ontent": "',
    Endpoint.COMPLETIONS: b'"text": "',
}
# A delta marker with nothing after it (chat's opening role delta, ``"content":""``): no token.
_EMPTY_DELTA: dict[Endpoint, tuple[bytes, bytes]] = {
    Endpoint.CHAT: (b'ontent":""', b'ontent": ""'),
    Endpoint.COMPLETIONS: (b'"text":""', b'"text": ""'),
}
_NO_EMPTY_DELTA: tuple[bytes, bytes] = (b"\0", b"\0")
# An event that may carry a usage block (prompt_tokens, output_tokens, ...).
_USAGE = b'_tokens"'

# The output maximum's field of each endpoint; chat has two (the newer one is set when the
# client named neither).
_MAX_FIELDS: dict[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
    Endpoint.RESPONSES: ("max_output_tokens",),
    Endpoint.MESSAGES: ("max_tokens",),
}
# The prompt's fields, by endpoint family: what an input estimate reads.
_PROMPT_FIELDS = ("messages", "prompt", "input", "system", "instructions")


class UsageMeter:
    """One request's count, filled in as it runs (by the exchange's splitter, its whole-body
    read, or the local model) and read once when it ends."""

    __slots__ = (
        "answered",
        "deltas",
        "endpoint",
        "estimated_input",
        "facts",
        "generated",
        "local",
        "local_for_nobody",
        "prompt_tokens",
        "streamed",
        "strip_usage",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        streamed: bool,
        estimated_input: int,
        strip_usage: bool = False,
        local: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.streamed = streamed
        self.estimated_input = estimated_input
        # The client did not ask for the usage chunk the proxy asked for: it is not relayed.
        self.strip_usage = strip_usage
        self.local = local
        # Content delta events received (a stream), and whether an answer came: a stream
        # that began (the upstream's 200 with events), or a whole answer.
        self.deltas = 0
        self.answered = False
        # What the answer's usage blocks said (input_tokens, output_tokens; None: nothing).
        self.facts = ResponseFacts()
        # A local model's own count: its prompt's tokens and the tokens it generated (None:
        # it generated nothing), of which for a client already gone.
        self.prompt_tokens: int | None = None
        self.generated: int | None = None
        self.local_for_nobody = 0

    def output_so_far(self) -> int:
        """Output tokens so far: the answer's own count once it has given one, else its
        content deltas (a stream's tokens as they come)."""
        output = self.facts.output_tokens
        return self.deltas if output is None else output

    def local_generation(self, prompt_tokens: int, generated: int, for_nobody: int) -> None:
        """A local sequence ended (one per choice): its own count."""
        self.prompt_tokens = prompt_tokens
        self.generated = (self.generated or 0) + generated
        self.local_for_nobody += for_nobody

    def tokens_in(self, chunks: Iterable[bytes]) -> int:
        """The content delta events in ``chunks`` (written bytes of the stream, whole events):
        the tokens of what never reached a client that left."""
        delta = _DELTA.get(self.endpoint, b"\0")
        spaced = _SPACED_DELTA.get(self.endpoint, b"\0")
        empty, spaced_empty = _EMPTY_DELTA.get(self.endpoint, _NO_EMPTY_DELTA)
        return sum(
            event.count(delta) + event.count(spaced)
            > event.count(empty) + event.count(spaced_empty)
            for chunk in chunks
            for event in chunk.split(b"\n\n")
        )

    def events(self, events: list[bytes]) -> list[bytes]:
        """Inspect ``events`` one by one (a read that is not all content deltas): count the
        deltas, learn the usage blocks, and leave out the usage chunk the client did not ask
        for."""
        kept: list[bytes] = []
        delta = _DELTA.get(self.endpoint, b"\0")
        spaced = _SPACED_DELTA.get(self.endpoint, b"\0")
        empty, spaced_empty = _EMPTY_DELTA.get(self.endpoint, _NO_EMPTY_DELTA)
        for event in events:
            # A marker with text after it: "content":"" beside "reasoning_content":"..." is one.
            markers = event.count(delta) + event.count(spaced)
            if markers > event.count(empty) + event.count(spaced_empty):
                self.deltas += 1
            elif _USAGE in event:
                usage_chunk = False
                for payload in sse_payloads(event):
                    self.facts.take(payload)
                    usage_chunk = payload.get("choices") == [] and "usage" in payload
                if usage_chunk and self.strip_usage:
                    continue
            kept.append(event)
        return kept

    def whole(self, body: bytes) -> None:
        """A whole (non-streamed) answer: its usage block, or its text for an estimate."""
        payload = whole_payload(body)
        if payload is None:
            return
        self.answered = True
        self.facts.take(payload)
        if self.facts.output_tokens is None:
            self.deltas = estimate_tokens(len(answer_text((payload,))))

    def usage(self, reserved_output: int, *, client_left: bool, failed: str | None) -> Usage:
        """What the request used: see the module's docstring for the order of the sources.
        ``reserved_output`` is charged for a whole answer that never came while the upstream
        may have been generating it (the client left, or a deadline passed): nothing said how
        much was made, and charging nothing would be the dodge; all of it is for nobody, as no
        client had any of it. A stream that never began
        (refused, failed, or left before the upstream answered) made nothing: no charge."""
        if self.local:
            if self.generated is None:
                return Usage(0, 0, 0, False)
            return Usage(
                self.prompt_tokens or 0, self.generated, self.local_for_nobody, estimated=False
            )
        facts = self.facts
        estimated = facts.input_tokens is None
        input_tokens = self.estimated_input if estimated else facts.input_tokens or 0
        if facts.output_tokens is not None:
            output = facts.output_tokens
        elif self.answered:
            output = self.deltas
        elif not self.streamed and (
            client_left or (failed is not None and failed.endswith("timeout"))
        ):
            # Charged, and for nobody: whatever the model made of it reached no client.
            return Usage(input_tokens, reserved_output, reserved_output, estimated)
        else:
            # Refused or failed before the model was reached (an upstream's 4xx, no replica).
            return Usage(0, 0, 0, False)
        return Usage(input_tokens, output, 0, estimated)


@dataclass(frozen=True, slots=True)
class Usage:
    """A request's tokens: in, out, and of those out, generated for a client already gone."""

    input: int
    output: int
    for_nobody: int
    estimated: bool

    def charge(self, counted: str) -> int:
        """What a budget counting ``counted`` ("total" or "output") is charged."""
        return self.output if counted == "output" else self.input + self.output


class MeteredSplitter(SSESplitter):
    """An :class:`SSESplitter` that counts a metered request's events as they come (renamed
    too, for an aliased model). Per read: one ``bytes.count`` of the endpoint's delta marker;
    a read whose every event is a content delta is counted and passed on as it is. ``splice``:
    a paused stream's continuation, whose events become the client's before they are counted
    (protocol/continuation.py).

    ``counting``: False until the stream is the client's (:meth:`begin_counting`, once the
    response head is decided): a hedged request's attempts share one meter, and what the
    losing attempt read before the race was decided is not what the client was sent."""

    __slots__ = ("_delta", "_empty", "_meter", "_rename", "_splice", "counting")

    def __init__(
        self,
        max_event_bytes: int,
        meter: UsageMeter,
        rename: Callable[[bytes], bytes] | None = None,
        splice: Callable[[list[bytes]], list[bytes]] | None = None,
        *,
        checked: bool = False,
        counting: bool = True,
    ) -> None:
        super().__init__(max_event_bytes, checked=checked)
        self.counting = counting
        self._splice = splice
        # Made for a stream that began: the upstream answered 200 with an event stream.
        meter.answered = True
        self._meter = meter
        self._delta = _DELTA.get(meter.endpoint, b"\0")
        self._empty = _EMPTY_DELTA.get(meter.endpoint, _NO_EMPTY_DELTA)[0]
        self._rename = rename

    def feed(self, chunk: bytes) -> list[bytes]:
        events = super().feed(chunk)
        if events and self._splice is not None:
            events = self._splice(events)
        if events and self.counting:
            return self._counted(events)
        return events

    def begin_counting(self, events: list[bytes]) -> list[bytes]:
        """The stream is the client's from ``events`` (fed while not counting) on."""
        self.counting = True
        return self._counted(events) if events else events

    def _counted(self, events: list[bytes]) -> list[bytes]:
        whole = events[0] if len(events) == 1 else b"".join(events)
        counted = whole.count(self._delta)
        if counted == len(events) and self._empty not in whole:
            self._meter.deltas += counted
        else:
            events = self._meter.events(events)
        if self._rename is not None:
            rename = self._rename
            return [rename(event) for event in events]
        return events

    @property
    def renamed_pending(self) -> bytes:
        rename = self._rename
        pending = self.pending
        return rename(pending) if rename is not None and pending else pending


def estimate_tokens(characters: int) -> int:
    return math.ceil(characters / CHARS_PER_TOKEN)


def estimate_input_tokens(body: Mapping[str, Any]) -> int:
    """The prompt's tokens, estimated: the characters of its text fields / 4."""
    return estimate_tokens(sum(_characters(body.get(name)) for name in _PROMPT_FIELDS))


def _characters(value: object, depth: int = 0) -> int:
    if isinstance(value, str):
        return len(value)
    if depth > 16:
        return 0
    if isinstance(value, list):
        return sum(_characters(item, depth + 1) for item in value)
    if isinstance(value, Mapping):
        return sum(_characters(item, depth + 1) for item in value.values())
    return 0


def requested_output(request: CompletionRequest) -> int | None:
    """The most output tokens ``request`` asks for, in its endpoint's field; None: it says
    nothing."""
    asked = [
        value
        for name in _MAX_FIELDS.get(request.endpoint, ())
        if type(value := request.body.get(name)) is int and value >= 0
    ]
    return min(asked) if asked else None


def cap_edits(request: CompletionRequest, cap: int) -> dict[str, Any]:
    """The body edits that hold ``request`` to ``cap`` output tokens: each of its endpoint's
    fields that asks for more is lowered, and one is set when it names none."""
    fields = _MAX_FIELDS.get(request.endpoint, ())
    if not fields or cap <= 0:
        return {}
    body = request.body
    named = [name for name in fields if body.get(name) is not None]
    if not named:
        return {fields[0]: cap}
    return {name: cap for name in named if not (type(body[name]) is int and 0 <= body[name] <= cap)}


def usage_edits(request: CompletionRequest) -> dict[str, Any]:
    """The edit that makes an upstream end a chat or completions stream with its usage block,
    unless the client asked for it already."""
    chat_like = request.endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS)
    if request.stream and chat_like and not request.include_usage:
        return {"stream_options.include_usage": True}
    return {}


def generates(endpoint: Endpoint) -> bool:
    """Whether ``endpoint`` answers with generated tokens (embeddings do not)."""
    return endpoint in _MAX_FIELDS


def meters(endpoint: Endpoint) -> bool:
    """Whether a request to ``endpoint`` is metered (a pass-through is not: its format is not
    Sluice's to read)."""
    return endpoint is not Endpoint.PASSTHROUGH


# The request's meter, for the producers that count (the upstream exchange, the local model):
# set by the key limits' layer in the producer's task, inherited by the tasks it starts.
CURRENT_METER: ContextVar[UsageMeter | None] = ContextVar("sluice_usage_meter", default=None)
