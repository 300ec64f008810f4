"""OpenAI-shaped errors: one exception type that knows its HTTP status and its JSON body.

Everything the proxy refuses or fails at becomes an :class:`ApiError`. Before streaming starts
it is sent as the HTTP status and body; after, as one SSE ``data:`` event (see ``sse.py``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

INVALID_REQUEST = "invalid_request_error"
UPSTREAM_ERROR = "upstream_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """A failure the client should see, with the status and OpenAI error object that say why."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})
        # Only meaningful to the upstream backend: may this failure be retried on another
        # replica, given that nothing has reached the client yet?
        self.retryable = retryable

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.to_dict()).encode()

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.code!r}, {self.message!r})"


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code or "invalid_request")


def deadline_exceeded(*, before_first_byte: bool) -> ApiError:
    """A request that reached its deadline while it ran (its client's read timeout before the
    first byte, or its own deadline): 504, and its work cancelled."""
    which = (
        "its client stops waiting for a first byte (the SDK's read timeout)"
        if before_first_byte
        else "its deadline (x-sluice-deadline, or the key's max_request_seconds)"
    )
    return ApiError(
        504,
        f"The request was stopped at {which}; its work was cancelled.",
        type=SERVER_ERROR,
        code="deadline_exceeded",
        # Past its own total deadline the same request would ask for the same work and be cut
        # again: the SDKs are told not to retry it. Past the read timeout the SDK would have
        # given up and retried by itself anyway, so its own rule stands.
        headers=None if before_first_byte else {"x-should-retry": "false"},
    )


# What a client refused during a drain is told to wait: another instance takes it.
_SHUTDOWN_RETRY_AFTER = 1


def shutting_down() -> ApiError:
    """The refusal of a request the drain leaves no time for: another instance can take it."""
    return ApiError(
        503,
        "the server is shutting down; retry the request (another instance will take it).",
        type=SERVER_ERROR,
        code="shutting_down",
        headers={"Retry-After": str(_SHUTDOWN_RETRY_AFTER), "x-should-retry": "true"},
    )


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist or is not served here; see GET /v1/models.",
        code="model_not_found",
        param="model",
    )


def request_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"Request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )


def internal_error() -> ApiError:
    return ApiError(
        500,
        "The server failed while handling the request; see its log.",
        type=SERVER_ERROR,
        code="internal_error",
    )


def is_json(body: bytes) -> bool:
    """Whether ``body`` is one whole JSON value (what a non-streamed answer must be)."""
    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


def says_model_missing(body: bytes) -> bool:
    """Whether an upstream's 404 says that the model it was asked for does not exist (vLLM:
    "The model `x` does not exist."; OpenAI: code ``model_not_found``), rather than a path."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return False
    if not isinstance(error, dict):
        return False
    message = error.get("message")
    return error.get("code") == "model_not_found" or (
        isinstance(message, str) and "model" in message.lower() and "not exist" in message
    )


def attributed(body: bytes, upstream: str) -> bytes:
    """An upstream's own error body, its message saying it came from ``upstream`` (so that a
    client, or a newcomer reading it, knows it is not Sluice's own); as it was if it is not an
    error object with a message."""
    try:
        answer = json.loads(body)
        error = answer["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return body
    if not isinstance(message, str):
        return body
    error["message"] = f"The upstream {upstream} answered: {message}"
    return json.dumps(answer).encode()
