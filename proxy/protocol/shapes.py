"""How each API says that something failed, sans-IO: before the head (a status and a JSON body)
and in-band (an event on a stream already started).

The relay and the HTTP layer ask :func:`error_shape` for the endpoint's, so that a refusal, a
limit or an upstream failure reads the same way on every transport, in the API's own shape:
OpenAI's ``{"error": {...}}`` (a ``data:`` event on chat and completions streams, an ``error``
event on Responses streams) or Anthropic's ``{"type": "error", "error": {...}}``.
"""

from __future__ import annotations

import json

from proxy.protocol.anthropic import anthropic_error_body
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import Endpoint
from proxy.protocol.sse import error_event


class ErrorShape:
    """OpenAI's: the error object, and the stream's ``data:`` event carrying it."""

    def body(self, error: ApiError) -> bytes:
        return error.body()

    def event(self, error: ApiError) -> bytes:
        return error_event(error)


class ResponsesErrorShape(ErrorShape):
    """The Responses API's in-band error: an ``error`` event (the SDK raises it as an
    APIError). Its sequence number is unknown to a relay that forwards the upstream's events
    as bytes, so it says 0."""

    def event(self, error: ApiError) -> bytes:
        payload = {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "sequence_number": 0,
        }
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"


class AnthropicErrorShape(ErrorShape):
    def body(self, error: ApiError) -> bytes:
        return anthropic_error_body(error)

    def event(self, error: ApiError) -> bytes:
        return b"event: error\ndata: " + anthropic_error_body(error) + b"\n\n"


OPENAI = ErrorShape()
RESPONSES = ResponsesErrorShape()
ANTHROPIC = AnthropicErrorShape()


def error_shape(endpoint: Endpoint | None) -> ErrorShape:
    if endpoint is Endpoint.MESSAGES:
        return ANTHROPIC
    if endpoint is Endpoint.RESPONSES:
        return RESPONSES
    return OPENAI


def endpoint_of(path: str) -> Endpoint | None:
    """The native endpoint served at ``path``, if any (for refusals made before routing)."""
    for endpoint in Endpoint:
        if endpoint.value == path:
            return endpoint
    return None
