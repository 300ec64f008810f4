"""Server-sent events, sans-IO: split a byte stream into complete events, frame our own.

The hot path of the relay. Events are forwarded as the exact bytes the upstream sent, found with
``bytes.find``; nothing here decodes JSON, so relaying costs the same for any payload.
"""

from __future__ import annotations

import json
import re
from typing import Any

from proxy.protocol.errors import ApiError

DONE_EVENT = b"data: [DONE]\n\n"
_LF_DELIMITER = b"\n\n"
# A field name is what comes before the first colon; these are the only ones the SSE spec
# defines, plus the empty name of a comment line.
_VALID_FIELD_STARTS = (b"data", b"event", b"id", b"retry", b":")


class SSEProtocolError(ValueError):
    """The upstream sent bytes that are not server-sent events, or an event over the limit."""


class SSESplitter:
    """Accumulate chunks; hand back each complete event (delimiter included) as soon as it is.

    Bounded: a pending event longer than ``max_event_bytes`` raises instead of growing.

    ``checked``: every event must be made of SSE field lines (see :func:`check_event`). The
    first that is not ends the stream there: ``feed`` hands back the events before it, and
    ``malformed`` holds the error to raise once they are relayed. Checked here, before a
    subclass counts or renames them, so that nothing after the fault is metered as made when
    it is never sent (one read often brings the bad event with good ones on either side).
    """

    __slots__ = ("_buffer", "_carry_cr", "_checked", "_crlf", "_max_event_bytes", "malformed")

    def __init__(self, max_event_bytes: int = 1 << 20, *, checked: bool = False) -> None:
        self._buffer = b""
        self._carry_cr = b""
        self._crlf = False
        self._max_event_bytes = max_event_bytes
        self._checked = checked
        self.malformed: SSEProtocolError | None = None

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.malformed is not None:
            return []
        if not self._crlf and b"\r" in chunk:
            # Rare: servers that frame with CRLF. Normalising to LF here keeps the common path
            # to one ``find`` per event.
            self._crlf = True
        if self._crlf:
            chunk = self._carry_cr + chunk
            # A CR at the end may be the first half of a CRLF split across chunks.
            self._carry_cr = b"\r" if chunk.endswith(b"\r") else b""
            if self._carry_cr:
                chunk = chunk[:-1]
            chunk = chunk.replace(b"\r\n", b"\n")
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[bytes] = []
        start = 0
        while (end := buffer.find(_LF_DELIMITER, start)) >= 0:
            end += 2
            if buffer[start] == 10:  # b"\n": extra blank lines between events are allowed
                start += 1
                continue
            if end - start > self._max_event_bytes:
                raise SSEProtocolError(f"upstream event exceeds {self._max_event_bytes} bytes")
            event = buffer[start:end]
            if self._checked and not event.startswith(_VALID_FIELD_STARTS):
                self.malformed = malformed_event(event)
                self._buffer = b""
                return events
            events.append(event)
            start = end
        self._buffer = buffer[start:] if start else buffer
        if len(self._buffer) > self._max_event_bytes:
            raise SSEProtocolError(
                f"upstream event exceeds {self._max_event_bytes} bytes without a delimiter"
            )
        return events

    @property
    def pending(self) -> bytes:
        """Bytes received after the last complete event (an unfinished event)."""
        return self._buffer


def check_event(event: bytes) -> None:
    """Raise :class:`SSEProtocolError` unless ``event`` is made of SSE field lines.

    Checks only the first line: cheap enough for every event, and it catches the failure that
    matters (an upstream that answers with something other than an event stream).
    """
    if not event.startswith(_VALID_FIELD_STARTS):
        raise malformed_event(event)


def malformed_event(event: bytes) -> SSEProtocolError:
    preview = event[:80].decode("utf-8", "replace")
    return SSEProtocolError(f"upstream sent a malformed server-sent event: {preview!r}")


def is_done(event: bytes) -> bool:
    return event.startswith((b"data: [DONE]", b"data:[DONE]"))


def data_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_event(error: ApiError) -> bytes:
    """The in-band form of an error, for a stream whose HTTP status has already been sent."""
    return data_event(error.to_dict())


# What a written chunk of each endpoint's stream holds once it holds a token (text, reasoning,
# a tool call), by the endpoint's label: an answer may open with events that carry none (a chat
# role delta with empty content, Responses' response.created and in_progress, Anthropic's
# message_start), and the time to those is not the time to the first token. A chunk is searched
# only until the first one matches.
FIRST_TOKEN: dict[str, re.Pattern[bytes]] = {
    "chat": re.compile(rb'"(?:content|reasoning_content|reasoning)":\s*"(?!")|"tool_calls":\s*\['),
    "completions": re.compile(rb'"text":\s*"(?!")'),
    "responses": re.compile(rb"response\.[a-z_.]*delta"),
    "messages": re.compile(rb"content_block_delta"),
}
