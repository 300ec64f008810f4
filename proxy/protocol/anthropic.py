"""Anthropic Messages API shapes (``POST /v1/messages``), sans-IO.

The same three jobs as ``responses.py``: validate what routing and a local generation need
(:func:`parse_messages_request`), write a locally generated answer in the Messages wire format
(:class:`MessagesStream`, :func:`whole_message`), and tell the upstream relay whether a stream
ended properly (:func:`is_terminal_event`).

Validation raises the proxy's one error type, :class:`ApiError`; the HTTP layer renders it with
:func:`anthropic_error_body` on this endpoint, so one refusal has one cause whatever the shape.
The shapes are the ones the official ``anthropic`` SDK's pydantic models accept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.protocol.errors import ApiError, bad_request
from proxy.protocol.openai import chat_sampling, required_model
from proxy.protocol.responses import data_type, event_name

ROLES = frozenset({"user", "assistant"})
TERMINAL_EVENTS = frozenset({b"message_stop", b"error"})
# A data-only event is decoded only when it holds one of these (see responses.py).
_TERMINAL_MARKERS = (b'"message_stop"', b'"error"')
# The API's documented error types by HTTP status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def anthropic_error_type(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP status."""
    known = _ERROR_TYPES.get(status)
    if known is not None:
        return known
    # The API says it may use invalid_request_error for any other 4xx.
    return "api_error" if status >= 500 else "invalid_request_error"


def _error_dict(error: ApiError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": anthropic_error_type(error.status), "message": error.message},
    }


def anthropic_error_body(error: ApiError) -> bytes:
    """``error`` as the body of an Anthropic-shaped HTTP error response."""
    return _dumps(_error_dict(error)).encode()


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    model: str
    stream: bool
    body: dict[str, Any]

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation in chat-completions form, for a text-only local model.

        Only the local backend calls this: refusing an image or a tool block here refuses it
        for the local model alone, and the upstream relay forwards whatever its server takes.
        """
        messages: list[dict[str, str]] = []
        system = self.body.get("system")
        if system is not None:
            messages.append({"role": "system", "content": _text_of(system, "system")})
        for index, message in enumerate(self.body["messages"]):
            messages.append(
                {
                    "role": message["role"],
                    "content": _text_of(message["content"], f"messages[{index}].content"),
                }
            )
        return messages

    def sampling_body(self) -> dict[str, Any]:
        """The sampling fields in chat-completions terms, only those the client set."""
        return chat_sampling(
            self.body,
            (
                ("max_tokens", "max_tokens"),
                ("temperature", "temperature"),
                ("top_p", "top_p"),
                ("stop_sequences", "stop"),
            ),
        )


def _text_of(content: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for index, block in enumerate(content):
        if block["type"] != "text":
            block_param = f"{param}[{index}]"
            raise bad_request(
                f"The local model takes text only and cannot read '{block_param}', "
                f"a content block of type '{block['type']}'.",
                param=block_param,
                code="unsupported_content",
            )
        texts.append(block["text"])
    # Joined as vLLM joins text parts for a chat template, so local and upstream prompts match.
    return "\n".join(texts)


def parse_messages_request(body: dict[str, Any]) -> MessagesRequest:
    """Validate a parsed Messages request; raise a 400 :class:`ApiError` naming the bad field."""
    model = required_model(body)

    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise bad_request("Missing required parameter: 'max_tokens'.", param="max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request("'max_tokens' must be a positive integer.", param="max_tokens")

    messages = body.get("messages")
    if messages is None:
        raise bad_request("Missing required parameter: 'messages'.", param="messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{param}' must be an object.", param=param)
        if message.get("role") not in ROLES:
            raise bad_request(
                f"'{param}.role' must be 'user' or 'assistant'.", param=f"{param}.role"
            )
        _check_content(message.get("content"), f"{param}.content")

    system = body.get("system")
    if system is not None:
        _check_system(system)

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")

    stop_sequences = body.get("stop_sequences")
    if stop_sequences is not None and not (
        isinstance(stop_sequences, list) and all(isinstance(item, str) for item in stop_sequences)
    ):
        raise bad_request("'stop_sequences' must be an array of strings.", param="stop_sequences")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise bad_request(f"'{name}' must be a number.", param=name)
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise bad_request("'top_k' must be a non-negative integer.", param="top_k")

    return MessagesRequest(model=model, stream=stream, body=body)


def _check_content(content: object, param: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content blocks.", param=param)
    for index, block in enumerate(content):
        block_param = f"{param}[{index}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(
                f"'{block_param}' must be an object with a string 'type'.", param=block_param
            )
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise bad_request(
                f"'{block_param}.text' must be a string.", param=f"{block_param}.text"
            )


def _check_system(system: object) -> None:
    if isinstance(system, str):
        return
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or an array of text blocks.", param="system")
    for index, block in enumerate(system):
        param = f"system[{index}]"
        # The API takes text blocks only here, for any model.
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad_request(f"'{param}' must be a text block.", param=param)


# --- the local model's answer, in Messages form --------------------------------------------


def stop_reason(finish_reason: str, stop_sequence: str | None = None) -> str:
    """The Messages ``stop_reason`` for the local generator's ``finish_reason``."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _stop_fields(finish_reason: str, stop_sequence: str | None) -> dict[str, Any]:
    reason = stop_reason(finish_reason, stop_sequence)
    # The API names the sequence only when it is why the message stopped.
    return {
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
    }


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _dumps(payload).encode() + b"\n\n"


def whole_message(
    *,
    model: str,
    message_id: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    stop_sequence: str | None = None,
) -> bytes:
    """The body of a non-streamed Messages response: one text block."""
    body = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        **_stop_fields(finish_reason, stop_sequence),
        "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens},
    }
    return _dumps(body).encode()


class MessagesStream:
    """The Messages streaming events of one locally generated answer, as wire bytes.

    One text content block at index 0. Every event has an ``event:`` line naming its type,
    as the API sends them (the SDK skips events without one).
    """

    # Everything in a text delta event but the text itself, serialised once.
    _DELTA_PREFIX = (
        b"event: content_block_delta\n"
        b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":'
    )
    _DELTA_SUFFIX = b"}}\n\n"

    def __init__(self, *, model: str, message_id: str) -> None:
        self.model = model
        self.message_id = message_id

    def start(self, prompt_tokens: int) -> bytes:
        """message_start (with the prompt's token count), the text block's start, a ping."""
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return b"".join(
            (
                _event("message_start", {"type": "message_start", "message": message}),
                _event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": 0,
                        "content_block": {"type": "text", "text": ""},
                    },
                ),
                _event("ping", {"type": "ping"}),
            )
        )

    def text(self, delta: str) -> bytes:
        return self._DELTA_PREFIX + _dumps(delta).encode() + self._DELTA_SUFFIX

    def finish(
        self, finish_reason: str, completion_tokens: int, stop_sequence: str | None = None
    ) -> bytes:
        """The block's stop, the stop reason and output token count, then message_stop."""
        return b"".join(
            (
                _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": _stop_fields(finish_reason, stop_sequence),
                        "usage": {"output_tokens": completion_tokens},
                    },
                ),
                _event("message_stop", {"type": "message_stop"}),
            )
        )

    def error(self, error: ApiError) -> bytes:
        """A failure after the stream has started: the API's ``error`` event, which ends it."""
        return _event("error", _error_dict(error))


def is_terminal_event(event: bytes) -> bool:
    """Whether ``event`` (one complete SSE event) ends a Messages stream: message_stop or error.

    Byte checks on the ``event:`` name in the common case (the API always sends one).
    """
    name = event_name(event)
    if name is not None:
        return name in TERMINAL_EVENTS
    if not any(marker in event for marker in _TERMINAL_MARKERS):
        return False
    kind = data_type(event)
    return kind is not None and kind.encode() in TERMINAL_EVENTS
