"""What an answer says about itself, read from the bytes the client was sent: the response's
id and model, why it finished, and its token usage (for the GenAI span attributes), and, only
when content capture is on, its text and the prompt's.

Read once, when the request ends, and only with tracing on; never per event. A stream is read
from its first write (the id and model are in the first event of every shape) and its last
two (the finish reason and the usage come last); a whole body from its bytes. The reading does
not depend on the endpoint: each shape names its fields differently enough that one reader
knows them all.

* OpenAI chat and completions: ``id``, ``model``, ``choices[].finish_reason``, ``usage``
  with ``prompt_tokens`` and ``completion_tokens``;
* Responses: the ``response`` object of ``response.created`` and ``response.completed`` (or
  ``.incomplete``, ``.failed``): ``id``, ``model``, ``status`` (or
  ``incomplete_details.reason``), ``usage`` with ``input_tokens`` and ``output_tokens``;
* Anthropic Messages: ``message_start``'s ``message`` (``id``, ``model``,
  ``usage.input_tokens``), ``message_delta``'s ``delta.stop_reason`` and ``usage.output_tokens``;
  a whole message's ``stop_reason``;
* embeddings: ``model`` and ``usage.prompt_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Text captured per attribute at most (content capture only): a span is no place for a book.
MAX_CAPTURED_CHARS = 16 * 1024


@dataclass
class ResponseFacts:
    response_id: str | None = None
    model: str | None = None
    # Why each choice finished, by its index (a stream's choices may finish in any order).
    reasons: dict[int, str] = field(default_factory=dict)
    input_tokens: int | None = None
    output_tokens: int | None = None

    @property
    def finish_reasons(self) -> list[str]:
        return [self.reasons[index] for index in sorted(self.reasons)]

    def attributes(self) -> dict[str, Any]:
        """The GenAI attributes of what is known (nothing for what is not)."""
        found: dict[str, Any] = {}
        if self.response_id is not None:
            found["gen_ai.response.id"] = self.response_id
        if self.model is not None:
            found["gen_ai.response.model"] = self.model
        if self.reasons:
            found["gen_ai.response.finish_reasons"] = self.finish_reasons
        if self.input_tokens is not None:
            found["gen_ai.usage.input_tokens"] = self.input_tokens
        if self.output_tokens is not None:
            found["gen_ai.usage.output_tokens"] = self.output_tokens
        return found

    def take(self, answer: Mapping[str, Any]) -> None:
        """Learn what one event (or a whole answer) says."""
        kind = answer.get("type")
        if isinstance(kind, str):
            if kind == "message_start":
                inner = answer.get("message")
                if isinstance(inner, Mapping):
                    # Its output_tokens is the count at the start (0 or 1), not the answer's
                    # (message_delta's): a stream cut before that is counted by its deltas.
                    output = self.output_tokens
                    self.take(inner)
                    self.output_tokens = output
                return
            if kind == "message_delta":
                delta = answer.get("delta")
                if isinstance(delta, Mapping):
                    self._finish(delta.get("stop_reason"), 0)
                self._usage(answer.get("usage"))
                return
            if kind.startswith("response."):
                inner = answer.get("response")
                if isinstance(inner, Mapping):
                    self.take(inner)
                return
        if self.response_id is None and isinstance(answer.get("id"), str):
            self.response_id = answer["id"]
        if self.model is None and isinstance(answer.get("model"), str):
            self.model = answer["model"]
        choices = answer.get("choices")
        if isinstance(choices, list):
            for position, choice in enumerate(choices):
                if isinstance(choice, Mapping):
                    self._finish(choice.get("finish_reason"), choice.get("index", position))
        if "stop_reason" in answer:
            self._finish(answer.get("stop_reason"), 0)
        if answer.get("object") == "response":
            details = answer.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, Mapping) else None
            status = answer.get("status")
            if status != "in_progress":
                self._finish(reason or status, 0)
        self._usage(answer.get("usage"))

    def _finish(self, reason: object, index: object) -> None:
        if isinstance(reason, str) and reason and isinstance(index, int):
            self.reasons[index] = reason

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        for name in ("input_tokens", "prompt_tokens"):
            if isinstance(usage.get(name), int):
                self.input_tokens = usage[name]
                break
        for name in ("output_tokens", "completion_tokens"):
            if isinstance(usage.get(name), int):
                self.output_tokens = usage[name]
                break


def sse_payloads(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of the ``data:`` lines in ``data`` (a run of SSE events, perhaps cut
    at either end): a line that is not whole JSON (a cut one, ``[DONE]``) is skipped."""
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload.startswith(b"{") and (value := whole_payload(payload)) is not None:
                yield value


def whole_payload(body: bytes) -> dict[str, Any] | None:
    """``body`` as a JSON object; None if it is not one (a RecursionError is an upstream's
    too deep nesting, read when the request ends: it must not fail the relay's close)."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def facts_of(answers: Iterable[Mapping[str, Any]]) -> ResponseFacts:
    facts = ResponseFacts()
    for answer in answers:
        facts.take(answer)
    return facts


def stream_facts(*writes: bytes) -> ResponseFacts:
    """The facts of a stream from some of its writes, in order: its first and its last few
    (where every shape puts the id and model, and the finish reason and usage). The same write
    may be passed twice (a stream of one write is its first and its last): it is read once."""
    distinct: list[bytes] = []
    for write in writes:
        if write and not any(write is seen for seen in distinct):
            distinct.append(write)
    # Joined with a newline: two writes' events never run together, even cut ones.
    return facts_of(sse_payloads(b"\n".join(distinct)))


def body_facts(body: bytes) -> ResponseFacts:
    """The facts of a whole (non-streamed) JSON answer; none if it is not JSON."""
    payload = whole_payload(body)
    return facts_of(() if payload is None else (payload,))


# -- content capture (opt-in) -------------------------------------------------------------------


def _clip(text: str) -> str:
    return text if len(text) <= MAX_CAPTURED_CHARS else text[:MAX_CAPTURED_CHARS] + "…"


def _text_of(content: object) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "".join(texts)
    return ""


def _message(role: str, text: str) -> dict[str, Any]:
    """A message in the GenAI conventions' shape (v1.41: role and parts)."""
    return {"role": role, "parts": [{"type": "text", "content": _clip(text)}]}


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The prompt of a request of any endpoint, as GenAI input messages."""
    messages: list[dict[str, Any]] = []
    system = body.get("system") if "system" in body else body.get("instructions")
    if system:
        messages.append(_message("system", _text_of(system)))
    given = body.get("messages")
    if given is None:
        given = body.get("input")
    if isinstance(given, str):
        messages.append(_message("user", given))
    elif isinstance(given, list):
        for message in given:
            if isinstance(message, Mapping):
                role = message.get("role")
                messages.append(
                    _message(
                        role if isinstance(role, str) else "user", _text_of(message.get("content"))
                    )
                )
            elif isinstance(message, str):
                messages.append(_message("user", message))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        messages.append(_message("user", prompt))
    elif isinstance(prompt, list):
        messages.extend(_message("user", p) for p in prompt if isinstance(p, str))
    return messages


def _answer_piece(answer: Mapping[str, Any]) -> str:
    """The answer text one event (or a whole answer) carries."""
    kind = answer.get("type")
    if kind == "response.output_text.delta":
        delta = answer.get("delta")
        return delta if isinstance(delta, str) else ""
    if kind == "content_block_delta":
        delta = answer.get("delta")
        return _text_of([delta]) if isinstance(delta, Mapping) else ""
    if isinstance(kind, str) and kind.startswith(("response.", "message_", "content_block_")):
        return ""
    if answer.get("object") == "response":
        texts = []
        for item in answer.get("output") or ():
            if isinstance(item, Mapping):
                texts.append(_text_of(item.get("content")))
        return "".join(texts)
    if kind == "message":
        return _text_of(answer.get("content"))
    texts = []
    for choice in answer.get("choices") or ():
        if not isinstance(choice, Mapping):
            continue
        if isinstance(choice.get("text"), str):
            texts.append(choice["text"])
        for part in ("delta", "message"):
            inner = choice.get(part)
            if isinstance(inner, Mapping):
                texts.append(_text_of(inner.get("content")))
    return "".join(texts)


def answer_text(answers: Iterable[Mapping[str, Any]]) -> str:
    """The text of an answer (every event of a stream, or a whole answer), unclipped."""
    return "".join(_answer_piece(answer) for answer in answers)


def output_messages(answers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The answer (every event of a stream, or a whole answer) as one GenAI output message."""
    text = answer_text(answers)
    return [_message("assistant", text)] if text else []
