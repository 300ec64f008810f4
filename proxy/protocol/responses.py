"""OpenAI Responses API shapes (``POST /v1/responses``), sans-IO.

Three jobs, one per caller:

- :func:`parse_responses_request` checks what routing and a local generation need. The upstream
  relay forwards the client's own bytes, so everything else in the body is left alone.
- :class:`ResponsesStream` and :func:`whole_response` turn a locally generated text into the
  Responses wire format (the streamed event sequence, or the one ``response`` object).
- :func:`is_terminal_event` tells the upstream relay, which forwards events as raw bytes,
  whether the stream ended properly or was cut.

The shapes are the ones the official ``openai`` SDK's pydantic models accept; the tests hold
every event and body against those models.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from proxy.protocol.errors import ApiError, bad_request
from proxy.protocol.openai import chat_sampling, required_model

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
# Events after which the Responses API sends nothing more for that response.
TERMINAL_EVENTS = frozenset(
    {b"response.completed", b"response.incomplete", b"response.failed", b"error"}
)
# What a data-only event (one without an ``event:`` line) must contain before it is worth
# decoding to read its type: a token's delta cannot hold these with unescaped quotes unless it
# is exactly one of them, so the common case stays a few ``in`` checks.
_TERMINAL_MARKERS = (
    b'"response.completed"',
    b'"response.incomplete"',
    b'"response.failed"',
    b'"error"',
)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    model: str
    stream: bool
    body: dict[str, Any]

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation in chat-completions form, for a text-only local model.

        Only the local backend calls this, so refusing an item here (an image, a tool call, a
        tool's output) refuses it for the local model alone; the upstream relay forwards any
        item its server supports.
        """
        messages: list[dict[str, str]] = []
        instructions = self.body.get("instructions")
        if instructions is not None:
            messages.append({"role": "system", "content": instructions})
        items = self.body["input"]
        if isinstance(items, str):
            messages.append({"role": "user", "content": items})
            return messages
        for index, item in enumerate(items):
            kind = item.get("type", "message")
            if kind != "message":
                raise _unsupported(f"an input item of type '{kind}'", f"input[{index}]")
            role = item["role"]
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _text_of(item["content"], f"input[{index}].content"),
                }
            )
        return messages

    def sampling_body(self) -> dict[str, Any]:
        """The sampling fields in chat-completions terms, only those the client set."""
        return chat_sampling(
            self.body,
            (
                ("max_output_tokens", "max_tokens"),
                ("temperature", "temperature"),
                ("top_p", "top_p"),
            ),
        )


def _unsupported(what: str, param: str) -> ApiError:
    return bad_request(
        f"The local model takes text only and cannot read '{param}', {what}.",
        param=param,
        code="unsupported_content",
    )


def _text_of(content: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for index, part in enumerate(content):
        if part["type"] not in TEXT_PARTS:
            raise _unsupported(f"a content part of type '{part['type']}'", f"{param}[{index}]")
        texts.append(part["text"])
    # Joined the way vLLM joins text parts for a chat template, so a conversation reads the same
    # to the local model as to an upstream one.
    return "\n".join(texts)


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """Validate a parsed Responses request; raise a 400 :class:`ApiError` naming the bad field."""
    model = required_model(body)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")

    items = body.get("input")
    if items is None:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    if isinstance(items, list):
        for index, item in enumerate(items):
            _check_item(item, f"input[{index}]")
    elif not isinstance(items, str):
        raise bad_request("'input' must be a string or an array of input items.", param="input")

    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string.", param="instructions")
    max_output_tokens = body.get("max_output_tokens")
    if max_output_tokens is not None and not _is_positive_int(max_output_tokens):
        raise bad_request(
            "'max_output_tokens' must be a positive integer.", param="max_output_tokens"
        )
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise bad_request(f"'{name}' must be a number.", param=name)

    return ResponsesRequest(model=model, stream=stream, body=body)


def _check_item(item: object, param: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"'{param}' must be an object.", param=param)
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise bad_request(f"'{param}.type' must be a string.", param=f"{param}.type")
    if kind != "message":
        # Tool calls, their outputs, reasoning, item references: the upstream's to judge.
        return
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise bad_request(
            f"'{param}.role' must be one of 'user', 'assistant', 'system' or 'developer'.",
            param=f"{param}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(
            f"'{param}.content' must be a string or an array of content parts.",
            param=f"{param}.content",
        )
    for index, part in enumerate(content):
        part_param = f"{param}.content[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(
                f"'{part_param}' must be an object with a string 'type'.", param=part_param
            )
        if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
            raise bad_request(f"'{part_param}.text' must be a string.", param=f"{part_param}.text")


# --- the local model's answer, in Responses form -------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    # The details objects are required by the SDK's ResponseUsage; a local model caches and
    # reasons nothing, so they are zeros.
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_text_part(text)],
    }


def _response_object(
    *,
    response_id: str,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete" else None),
        "model": model,
        "output": output,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": usage,
        "metadata": {},
    }


def _final_status(finish_reason: str) -> str:
    # "length" is the local generator's word for running out of max_output_tokens.
    return "incomplete" if finish_reason == "length" else "completed"


def _error_object(error: ApiError) -> dict[str, Any]:
    # The SDK types response.error.code as a closed set of the API's own codes, so the
    # proxy's code cannot go there; its message carries the detail.
    code = "rate_limit_exceeded" if error.status == 429 else "server_error"
    return {"code": code, "message": error.message}


def whole_response(
    *,
    model: str,
    response_id: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    created_at: int | None = None,
) -> bytes:
    """The body of a non-streamed response: one assistant message with one text part."""
    status = _final_status(finish_reason)
    body = _response_object(
        response_id=response_id,
        model=model,
        created_at=int(time.time()) if created_at is None else created_at,
        status=status,
        output=[_message_item(_message_id(response_id), text, status)],
        usage=_usage(prompt_tokens, completion_tokens),
    )
    return _dumps(body).encode()


class ResponsesStream:
    """The Responses streaming events of one locally generated answer, as wire bytes.

    Each event is ``event: <type>`` plus one ``data:`` line holding the same ``type`` and the
    next ``sequence_number``. There is no ``[DONE]``: the terminal lifecycle event ends it.
    """

    def __init__(self, *, model: str, response_id: str, created_at: int | None = None) -> None:
        self.model = model
        self.response_id = response_id
        self.created_at = int(time.time()) if created_at is None else created_at
        self.item_id = _message_id(response_id)
        self._sequence = 0
        self._started = False
        # The done events repeat the whole text; keeping the pieces and joining once is cheaper
        # than growing a string per token.
        self._pieces: list[str] = []
        # Everything in a delta event but its sequence number and its text, serialised once.
        self._delta_prefix = (
            b"event: response.output_text.delta\n"
            b'data: {"type":"response.output_text.delta","item_id":'
            + _dumps(self.item_id).encode()
            + b',"output_index":0,"content_index":0,"logprobs":[],"sequence_number":'
        )

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _dumps(data).encode() + b"\n\n"

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return _response_object(
            response_id=self.response_id,
            model=self.model,
            created_at=self.created_at,
            status=status,
            **fields,
        )

    def start(self) -> bytes:
        """The opening events: the response exists, is in progress, and has one empty message."""
        self._started = True
        opening = self._response("in_progress", output=[])
        return b"".join(
            (
                self._event("response.created", {"response": opening}),
                self._event("response.in_progress", {"response": opening}),
                self._event(
                    "response.output_item.added",
                    {
                        "output_index": 0,
                        "item": _message_item(self.item_id, None, "in_progress"),
                    },
                ),
                self._event(
                    "response.content_part.added",
                    {
                        "item_id": self.item_id,
                        "output_index": 0,
                        "content_index": 0,
                        "part": _text_part(""),
                    },
                ),
            )
        )

    def text(self, delta: str) -> bytes:
        self._pieces.append(delta)
        sequence = self._sequence
        self._sequence += 1
        return (
            self._delta_prefix
            + str(sequence).encode()
            + b',"delta":'
            + _dumps(delta).encode()
            + b"}\n\n"
        )

    def finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The closing events: the text and its part and item done, then the response's end."""
        text = "".join(self._pieces)
        status = _final_status(finish_reason)
        item = _message_item(self.item_id, text, status)
        place = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        final = self._response(
            status, output=[item], usage=_usage(prompt_tokens, completion_tokens)
        )
        return b"".join(
            (
                self._event("response.output_text.done", {**place, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**place, "part": _text_part(text)}),
                self._event("response.output_item.done", {"output_index": 0, "item": item}),
                self._event(f"response.{status}", {"response": final}),
            )
        )

    def error(self, error: ApiError) -> bytes:
        """A failure after the stream has started, as one ``response.failed`` event.

        ``response.failed`` rather than the API's ``error`` event: it is the terminal lifecycle
        event clients wait for (the SDK's stream helper, Codex, LangChain), it carries the
        response's state (status ``failed``, its error, the text so far), and the ``error`` event
        is not tied to a response, so sending both would report one failure twice.
        """
        # Clients build their snapshot from response.created; a failure before start() must not
        # be the first event they see.
        opening = b"" if self._started else self.start()
        partial = _message_item(self.item_id, "".join(self._pieces), "incomplete")
        failed = self._response("failed", output=[partial], error=_error_object(error))
        return opening + self._event("response.failed", {"response": failed})


# The two readers below serve anthropic.py too; they are SSE, not Responses, and belong in
# sse.py once that module is free to change.


def event_name(event: bytes) -> bytes | None:
    """The value of an event's ``event:`` field, or None when it has none."""
    if event.startswith(b"event:"):
        start = 6
    else:
        start = event.find(b"\nevent:")
        if start < 0:
            return None
        start += 7
    end = event.find(b"\n", start)
    return event[start : end if end >= 0 else len(event)].strip()


def data_type(event: bytes) -> str | None:
    """The ``type`` of an event's JSON data (its ``data:`` lines joined), if it has one."""
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    try:
        data = json.loads(b"\n".join(lines))
    except ValueError:
        return None
    kind = data.get("type") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def is_terminal_event(event: bytes) -> bool:
    """Whether ``event`` (one complete SSE event) ends a Responses stream.

    Called for every upstream event, so the common case is byte checks: the ``event:`` name when
    there is one (OpenAI and vLLM always send it), and JSON is decoded only for a data-only
    event that contains a terminal type's quoted name at all.
    """
    name = event_name(event)
    if name is not None:
        return name in TERMINAL_EVENTS
    if not any(marker in event for marker in _TERMINAL_MARKERS):
        return False
    kind = data_type(event)
    return kind is not None and kind.encode() in TERMINAL_EVENTS
