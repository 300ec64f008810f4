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
from proxy.protocol.scheduling import DEFAULT_SCHEDULE, Schedule

# No size limit of its own: the server's (max_body_bytes) applies before this is called.
UNLIMITED = sys.maxsize


class Endpoint(Enum):
    """What a request asks for: the API endpoints Sluice understands (their paths), and
    PASSTHROUGH, a path a model lists in ``passthrough``, relayed byte for byte."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"
    EMBEDDINGS = "/v1/embeddings"
    PASSTHROUGH = "passthrough"

    @property
    def label(self) -> str:
        """The metrics' and access log's name for it."""
        return self.name.lower()


# The endpoints with a path of their own (a route each).
NATIVE_ENDPOINTS = tuple(endpoint for endpoint in Endpoint if endpoint is not Endpoint.PASSTHROUGH)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One request, validated as far as routing (and a local model) needs; ``raw`` is what
    the upstream receives, as the client sent it."""

    endpoint: Endpoint
    model: str
    stream: bool
    include_usage: bool
    body: dict[str, Any]
    raw: bytes
    # The upstream path (the endpoint's own; a pass-through's is the client's path).
    path: str = ""
    content_type: str = "application/json"
    # The endpoint's own parsed form (responses.ResponsesRequest, anthropic.MessagesRequest).
    detail: Any = None
    # The value of the model's affinity_header, when it has one and the client sent it: the
    # conversation's key for balance = "prefix_affinity".
    session: str = ""
    # Who it is for the scheduler, and its deadlines (the pipeline's; the default: a request
    # of no key, band 0, no deadline).
    schedule: Schedule = DEFAULT_SCHEDULE

    @property
    def upstream_path(self) -> str:
        return self.path or self.endpoint.value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_optional(body: dict[str, Any], name: str, ok: bool, expected: str) -> None:
    if name in body and body[name] is not None and not ok:
        raise bad_request(f"'{name}' must be {expected}.", param=name)


# What a local model does not do, by endpoint: each is refused by name (400
# unsupported_parameter) rather than silently ignored. response_format json_object would need
# constrained decoding: lm-format-enforcer 0.11.3, the lightest well-kept library for it (a
# vLLM guided-decoding backend), cannot import its transformers integration under
# transformers 5.x (tokenization_utils moved), so it is refused rather than hand-written. A
# value that asks for nothing (an empty tools list, response_format text) passes.
_UNSUPPORTED_LOCALLY: dict[str, tuple[str, ...]] = {
    "/v1/chat/completions": (
        "tools",
        "tool_choice",
        "functions",
        "function_call",
        "response_format",
        "logit_bias",
        "audio",
        "modalities",
        "prediction",
        "web_search_options",
    ),
    "/v1/completions": ("best_of", "logprobs", "echo", "suffix", "logit_bias"),
    "/v1/responses": ("tools", "tool_choice", "text", "reasoning", "previous_response_id"),
    "/v1/messages": ("tools", "tool_choice", "thinking"),
}


# Choices a local model generates for one request (one after another, in its slot).
MAX_LOCAL_CHOICES = 8


def _asks_nothing(value: object) -> bool:
    # Types compared too: True == 1, and logprobs: true asks for something.
    if value is None or value is False:
        return True
    if type(value) is int:
        return value == 1
    return value in ([], {}, "auto", "none", "text")


def check_local_parameters(body: dict[str, Any], endpoint: Endpoint) -> None:
    """Raise a 400 ``unsupported_parameter`` for the first parameter a local model would
    otherwise ignore (and a 400 for an ``n`` it cannot give)."""
    if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS) and "n" in body:
        n = body["n"]
        if n is not None and (type(n) is not int or not 1 <= n <= MAX_LOCAL_CHOICES):
            raise bad_request(
                f"'n' must be an integer from 1 to {MAX_LOCAL_CHOICES} on a local model "
                "(each choice is one more generation).",
                param="n",
            )
    for name in _UNSUPPORTED_LOCALLY.get(endpoint.value, ()):
        value = body.get(name)
        if _asks_nothing(value) or _asks_for_text(name, value):
            continue
        raise bad_request(
            f"'{name}' is not supported by this local model (it would be ignored): remove it, "
            "or use a model served by an upstream that supports it.",
            param=name,
            code="unsupported_parameter",
        )


def _asks_for_text(name: str, value: object) -> bool:
    """response_format / text.format / modalities that ask for plain text: the default."""
    if name == "response_format" and isinstance(value, dict):
        return value.get("type") == "text"
    if name == "text" and isinstance(value, dict):
        fmt = value.get("format")
        return fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")
    if name == "modalities":
        return value == ["text"]
    return False


def embeddings_request(body: dict[str, Any], raw: bytes) -> CompletionRequest:
    """Validate an embeddings request: a model and an input to embed, never streamed."""
    model = required_model(body)
    inputs = body.get("input")
    if inputs is None:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    if not isinstance(inputs, str | list) or (isinstance(inputs, list) and not inputs):
        raise bad_request(
            "'input' must be a string or a non-empty array of strings or token arrays.",
            param="input",
        )
    if body.get("stream"):
        raise bad_request("Embeddings are not streamed: 'stream' must be false.", param="stream")
    return CompletionRequest(Endpoint.EMBEDDINGS, model, False, False, body, raw)


def chat_sampling(body: dict[str, Any], names: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """An endpoint's sampling fields in chat-completions terms (``(its name, chat's name)``
    pairs), only those the client set: what a local model's sampling reads."""
    return {chat: body[own] for own, chat in names if body.get(own) is not None}


def required_model(body: dict[str, Any]) -> str:
    """The request's ``model``, every endpoint's one required field, or a 400 naming it."""
    model = body.get("model")
    if model is None:
        raise bad_request("Missing required parameter: 'model'.", param="model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string.", param="model")
    return model


def parse_completion_request(
    raw: bytes, endpoint: Endpoint, max_bytes: int = UNLIMITED
) -> CompletionRequest:
    """Validate an OpenAI completion request body; raise a 400 :class:`ApiError` if it is not."""
    return completion_request(parse_json_object(raw, max_bytes), raw, endpoint)


def completion_request(body: dict[str, Any], raw: bytes, endpoint: Endpoint) -> CompletionRequest:
    """Validate a parsed completion request whose bytes (to forward) are ``raw``."""
    model = required_model(body)

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


def models_list(
    names: list[str], upstream_entries: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The served models; each with what its upstream said of it, when known (its own id and
    object stay Sluice's: the name a client must use)."""
    entries = upstream_entries or {}
    return {
        "object": "list",
        "data": [
            {
                "created": 0,
                "owned_by": "sluice",
                **entries.get(name, {}),
                "id": name,
                "object": "model",
            }
            for name in names
        ],
    }
