"""Where each endpoint's event stream ends properly, sans-IO: its last event.

Read by the upstream exchange (a stream cut before it is an upstream failure) and by the relay
(a client that leaves once it has been handed the last event had the whole answer, whatever the
producer still does: its upstream connection back to the pool, a hedge's loser cancelled).
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.protocol import anthropic, responses
from proxy.protocol.openai import Endpoint
from proxy.protocol.sse import is_done

STREAM_END: dict[Endpoint, Callable[[bytes], bool]] = {
    Endpoint.CHAT: is_done,
    Endpoint.COMPLETIONS: is_done,
    Endpoint.RESPONSES: responses.is_terminal_event,
    Endpoint.MESSAGES: anthropic.is_terminal_event,
}
_BY_LABEL = {endpoint.label: ends for endpoint, ends in STREAM_END.items()}


def last_event(written: bytes) -> bytes:
    """The last whole event of ``written`` (one write of a stream: one event or several)."""
    end = written.rfind(b"\n\n", 0, len(written) - 2)
    return written if end < 0 else written[end + 2 :]


def ends_stream(endpoint: str, written: bytes) -> bool:
    """Whether ``written`` (a write of ``endpoint``'s stream, by its label) ends with the
    stream's last event. False for an endpoint whose end is not known here."""
    ends = _BY_LABEL.get(endpoint)
    return ends is not None and bool(written) and ends(last_event(written))
