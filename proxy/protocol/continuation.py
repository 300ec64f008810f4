"""Continuing a paused stream, sans-IO: what its client has received, the request that carries
on from there, and the continuation's events as the client's one stream goes on.

A streamed chat or completions request paused for a more urgent one (``[scheduling]
preempt_after``) is closed upstream at an event boundary: the client has received exactly the
events handed to it (:meth:`StreamSplice.delivered`). When it holds a slot again, the
continuation goes out (:meth:`StreamSplice.continuation`):

* chat completions: the original messages plus the answer so far as a final assistant message,
  with ``continue_final_message: true`` and ``add_generation_prompt: false`` (vLLM refuses
  both true);
* completions: the prompt with the answer so far appended;
* either: ``max_tokens`` (each maximum the body names) less the tokens already sent.

Its events become the client's (:meth:`StreamSplice.events`): the same ``id``, ``created`` and
``model`` as the first piece, no second role delta, and a usage block that counts the original
prompt once and the completion tokens of every piece. A continuation's own prompt count holds
the answer so far (the engine read it as prompt), so the client's prompt tokens are that count
less the tokens sent before it; its completion tokens, those tokens plus its own. The total is
the engine's; the split between prompt and answer assumes that the answer so far, tokenized
again, is as many tokens as were sent (one per content event, as vLLM streams them). Where a
tokenizer merges them differently the split moves by that difference, never the total.

**What it keeps.** Only the answer's text, and the events handed on since it last read them, at
most :data:`PENDING_BYTES` (they are read into text then): a stream's memory is its text plus
that bound, however long it runs. A splice exists only while the queue preempts; with
preemption off nothing of an answer is kept.

**Its token count.** A continuation asks for ``max_tokens`` less the tokens sent. Where the
upstream reports usage on its events (vLLM's ``stream_options.continuous_usage_stats``), that
is the exact count; otherwise one token per content event, as vLLM streams them. An upstream
that puts several tokens in one event makes that count low, and the whole answer may then run
over ``max_tokens`` by at most the tokens sent less the events that carried them.

Only what can be continued is paused (:meth:`StreamSplice.of`): a streamed chat or completions
request of one choice, with no echo and no structured output (a grammar would start over in
the middle of its answer), whose answer so far is text (not a tool call, not reasoning), and
which has not sent its last event.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.response_facts import sse_payloads, whole_payload
from proxy.protocol.rewrite import with_edits
from proxy.protocol.sse import is_done

# The output maximum's fields of each endpoint that can be continued.
_MAX_FIELDS: dict[Endpoint, tuple[str, ...]] = {
    Endpoint.CHAT: ("max_completion_tokens", "max_tokens"),
    Endpoint.COMPLETIONS: ("max_tokens",),
}
# Fields of a body that make its answer impossible to continue from its text.
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
# A delta that is not answer text: a continuation from the text would lose it.
_NOT_TEXT = ("tool_calls", "function_call", "reasoning_content", "reasoning")
# The events handed on and not read yet, at most (bytes): then they are read into text.
PENDING_BYTES = 64 * 1024


class StreamSplice:
    """One pausable stream: what its client received, and how a continuation carries it on."""

    __slots__ = (
        "_chunks",
        "_ident",
        "_opening",
        "_parts",
        "_pending",
        "_request",
        "_usage_tokens",
        "before",
        "chat",
        "finished",
        "not_text",
        "pieces",
        "tokens",
    )

    def __init__(self, request: CompletionRequest) -> None:
        self._request = request
        self.chat = request.endpoint is Endpoint.CHAT
        # What was handed to the client and not read yet: read only when a pause is asked for
        # (a list append per write until then).
        self._chunks: list[bytes] = []
        self._pending = 0
        self._parts: list[str] = []
        # The completion tokens the last usage block handed on counted (continuous usage
        # stats; a continuation's are made the whole answer's by events()), or None: then
        # content events are counted.
        self._usage_tokens: int | None = None
        # Content events handed to the client (one token each, as vLLM streams them), and of
        # those, the ones sent before the piece now running.
        self.tokens = 0
        self.before = 0
        # Whether its last event (a finish reason, [DONE]) or something other than text (a
        # tool call) has reached the client: then it cannot be paused.
        self.finished = False
        self.not_text = False
        # The first piece's id, created and model: the continuation's events carry them.
        self._ident: dict[str, Any] | None = None
        # Pauses so far; and whether the running continuation's role delta is still to come.
        self.pieces = 0
        self._opening = False

    @classmethod
    def of(cls, request: CompletionRequest) -> StreamSplice | None:
        """A splice for ``request`` if it can be continued once paused, else None."""
        if request.endpoint not in _MAX_FIELDS or not request.stream:
            return None
        body = request.body
        if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
            return None
        if body.get("echo") or any(body.get(name) is not None for name in _STRUCTURED):
            return None
        response_format = body.get("response_format")
        if response_format is not None and (
            not isinstance(response_format, dict) or response_format.get("type") != "text"
        ):
            return None
        if request.endpoint is Endpoint.CHAT:
            # A client continuing its own final message already: ours would be a second one.
            if body.get("continue_final_message") or body.get("add_generation_prompt") is False:
                return None
            if not isinstance(body.get("messages"), list):
                return None
        elif not isinstance(body.get("prompt"), str):
            # A list of prompts is several answers; token ids cannot take the text appended.
            return None
        return cls(request)

    # -- as it streams ---------------------------------------------------------------------

    def delivered(self, chunk: bytes) -> None:
        """``chunk`` (whole events) was handed to the client."""
        self._chunks.append(chunk)
        self._pending += len(chunk)
        if self._pending > PENDING_BYTES:
            self._read()

    def _read(self) -> None:
        chunks, self._chunks = self._chunks, []
        self._pending = 0
        for chunk in chunks:
            if b"[DONE]" in chunk:
                self.finished = True
            for payload in sse_payloads(chunk):
                self._take(payload)
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]

    @property
    def kept_bytes(self) -> int:
        """What it holds of the answer now: the events not read yet and the text."""
        return self._pending + sum(len(part) for part in self._parts)

    def _take(self, payload: dict[str, Any]) -> None:
        if self._ident is None and "id" in payload:
            self._ident = {
                name: payload[name] for name in ("id", "created", "model") if name in payload
            }
        usage = payload.get("usage")
        if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
            # The answer's tokens so far, exactly.
            self._usage_tokens = usage["completion_tokens"]
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") is not None:
                self.finished = True
            if self.chat:
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    continue
                if any(delta.get(name) for name in _NOT_TEXT):
                    self.not_text = True
                text = delta.get("content")
            else:
                text = choice.get("text")
            if isinstance(text, str) and text:
                self._parts.append(text)
                self.tokens += 1

    def pausable(self) -> bool:
        """Whether the stream can be paused now: its answer so far is text, and its last event
        has not reached the client."""
        self._read()
        return not self.finished and not self.not_text

    def paused(self) -> None:
        """The stream was paused: what its client holds is the answer so far."""
        self._read()
        self.pieces += 1
        if self._usage_tokens is not None:
            self.tokens = self._usage_tokens
        self.before = self.tokens
        self._opening = self._ident is not None

    @property
    def text(self) -> str:
        """The answer's text its client holds."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def started(self) -> bool:
        """Whether the client has received any of the answer's events."""
        return self._ident is not None

    # -- the continuation ------------------------------------------------------------------

    def continuation(self) -> CompletionRequest:
        """The request that carries the answer on from what its client holds (the original,
        when it holds no text yet)."""
        request = self._request
        text = self.text
        if not text:
            return request
        body = request.body
        edits: dict[str, Any] = {}
        if self.chat:
            messages = [*body["messages"], {"role": "assistant", "content": text}]
            edits["messages"] = messages
            edits["continue_final_message"] = True
            edits["add_generation_prompt"] = False
        else:
            edits["prompt"] = body["prompt"] + text
        for name in _MAX_FIELDS[request.endpoint]:
            asked = body.get(name)
            if type(asked) is int:
                edits[name] = max(1, asked - self.tokens)
        return with_edits(request, edits)

    def events(self, events: list[bytes]) -> list[bytes]:
        """A continuation's events as the client's stream goes on (see the module's
        docstring). Nothing to do while the client has received nothing."""
        ident = self._ident
        if ident is None:
            return events
        out: list[bytes] = []
        for event in events:
            if not event.startswith(b"data:") or is_done(event):
                out.append(event)
                continue
            payload = whole_payload(event[5:].strip())
            if payload is None:
                out.append(event)
                continue
            changed = False
            for name, value in ident.items():
                if name in payload and payload[name] != value:
                    payload[name] = value
                    changed = True
            if self._opening and self._drop_role(payload):
                changed = True
                if self._empty(payload):
                    continue
            if self._recount(payload.get("usage")):
                changed = True
            if changed:
                event = (
                    b"data: "
                    + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
                    + b"\n\n"
                )
            out.append(event)
        return out

    def _drop_role(self, payload: dict[str, Any]) -> bool:
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if isinstance(delta, dict) and "role" in delta:
                del delta["role"]
                self._opening = False
                return True
        return False

    @staticmethod
    def _empty(payload: dict[str, Any]) -> bool:
        """An event left with nothing for the client: its one choice's delta empty, no finish
        reason, no logprobs, no usage."""
        choices = payload.get("choices")
        if payload.get("usage") or not isinstance(choices, list) or len(choices) != 1:
            return False
        choice = choices[0]
        delta = choice.get("delta") or {}
        return (
            not any(delta.values())
            and choice.get("finish_reason") is None
            and not choice.get("logprobs")
        )

    def _recount(self, usage: object) -> bool:
        if not isinstance(usage, dict):
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if type(prompt) is not int or type(completion) is not int:
            return False
        before = self.before
        usage["prompt_tokens"] = max(0, prompt - before)
        usage["completion_tokens"] = completion + before
        usage["total_tokens"] = prompt + completion
        return True
