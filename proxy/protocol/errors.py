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
