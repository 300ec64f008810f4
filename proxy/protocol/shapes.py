"""How each API says that something failed, sans-IO: before the head (a status and a JSON body)
and in-band (an event on a stream already started).

The relay and the HTTP layer ask :func:`error_shape` for the endpoint's, so that a refusal, a
limit or an upstream failure reads the same way on every transport, in the API's own shape:
OpenAI's ``{"error": {...}}`` (a ``data:`` event on chat and completions streams, an ``error``
event on Responses streams) or Anthropic's ``{"type": "error", "error": {...}}``.
"""

from __future__ import annotations

import json
import re

from proxy.protocol.anthropic import anthropic_error_body
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import Endpoint
from proxy.protocol.sse import error_event


class ErrorShape:
    """OpenAI's: the error object, and the stream's ``data:`` event carrying it."""

    # Whether the stream's events are numbered, so that an in-band error must follow the last
    # number the client was handed (the relay then keeps the last chunk that had one).
    numbered = False

    def body(self, error: ApiError) -> bytes:
        return error.body()

    def event(self, error: ApiError, after: bytes = b"") -> bytes:
        """The in-band error; ``after``: the last chunk handed to the client that carried a
        sequence number (``numbered`` shapes only)."""
        return error_event(error)


# A Responses event's number, wherever the upstream put it in its JSON (compact or spaced).
_SEQUENCE = re.compile(rb'"sequence_number"\s*:\s*(\d+)')


class ResponsesErrorShape(ErrorShape):
    """The Responses API's in-band error: an ``error`` event (the SDK raises it as an
    APIError). Its ``sequence_number`` is the one after the last event the client was handed
    (the upstream's numbers, as relayed; 0 when none was), so that the numbers the client
    reads stay strictly increasing whatever was held back and dropped before the error."""

    numbered = True

    def event(self, error: ApiError, after: bytes = b"") -> bytes:
        numbers = _SEQUENCE.findall(after)
        payload = {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "sequence_number": int(numbers[-1]) + 1 if numbers else 0,
        }
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"


class AnthropicErrorShape(ErrorShape):
    def body(self, error: ApiError) -> bytes:
        return anthropic_error_body(error)

    def event(self, error: ApiError, after: bytes = b"") -> bytes:
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
