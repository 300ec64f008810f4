"""OpenAI request shapes, sans-IO: parse a body once, validate what routing needs, keep the bytes.

The proxy forwards the client's original bytes upstream; this module only decides whether the
request is well-formed enough to route, and what the relay needs to know about it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

from proxy.protocol.errors import bad_request
from proxy.protocol.json_body import parse_json_object

# No size limit of its own: the server's (max_body_bytes) applies before this is called.
UNLIMITED = sys.maxsize


class Endpoint(Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    body: dict[str, Any]
    raw: bytes


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_optional(body: dict[str, Any], name: str, ok: bool, expected: str) -> None:
    if name in body and body[name] is not None and not ok:
        raise bad_request(f"'{name}' must be {expected}.", param=name)


def parse_completion_request(
    raw: bytes, endpoint: Endpoint, max_bytes: int = UNLIMITED
) -> CompletionRequest:
    """Validate an OpenAI completion request body; raise a 400 :class:`ApiError` if it is not."""
    return completion_request(parse_json_object(raw, max_bytes), raw, endpoint)


def completion_request(body: dict[str, Any], raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Validate a parsed completion request whose bytes (to forward) are ``raw``."""
    model = body.get("model")
    if model is None:
        raise bad_request("Missing required parameter: 'model'.", param="model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string.", param="model")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", param="stream")

    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if messages is None:
            raise bad_request("Missing required parameter: 'messages'.", param="messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array.", param="messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise bad_request(
                    f"'messages[{index}]' must be an object with a string 'role'.",
                    param=f"messages[{index}]",
                )
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("Missing required parameter: 'prompt'.", param="prompt")
        if not isinstance(prompt, str | list):
            raise bad_request("'prompt' must be a string or an array.", param="prompt")

    max_tokens = body.get("max_tokens")
    _check_optional(
        body,
        "max_tokens",
        isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0,
        "a positive integer",
    )
    max_completion_tokens = body.get("max_completion_tokens")
    _check_optional(
        body,
        "max_completion_tokens",
        isinstance(max_completion_tokens, int)
        and not isinstance(max_completion_tokens, bool)
        and max_completion_tokens > 0,
        "a positive integer",
    )
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        _check_optional(body, name, _is_number(body.get(name)), "a number")
    seed = body.get("seed")
    _check_optional(
        body, "seed", isinstance(seed, int) and not isinstance(seed, bool), "an integer"
    )
    stop = body.get("stop")
    _check_optional(
        body,
        "stop",
        isinstance(stop, str)
        or (isinstance(stop, list) and all(isinstance(item, str) for item in stop)),
        "a string or an array of strings",
    )

    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object.", param="stream_options")
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
            )
        usage_flag = stream_options.get("include_usage", False)
        if not isinstance(usage_flag, bool):
            raise bad_request(
                "'stream_options.include_usage' must be a boolean.",
                param="stream_options.include_usage",
            )
        include_usage = usage_flag

    return CompletionRequest(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=include_usage,
        body=body,
        raw=raw,
    )


def models_list(names: list[str]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "sluice"} for name in names
        ],
    }
