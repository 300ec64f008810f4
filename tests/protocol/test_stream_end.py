"""Where each endpoint's stream ends, read from what was written (one event, or several)."""

from __future__ import annotations

import pytest

from proxy.protocol.stream_end import ends_stream, last_event

TOKEN = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'


@pytest.mark.parametrize(
    ("endpoint", "end"),
    [
        ("chat", b"data: [DONE]\n\n"),
        ("completions", b"data: [DONE]\n\n"),
        ("responses", b'event: response.completed\ndata: {"type":"response.completed"}\n\n'),
        ("messages", b'event: message_stop\ndata: {"type":"message_stop"}\n\n'),
    ],
)
def test_a_write_that_ends_with_the_last_event_ends_the_stream(endpoint: str, end: bytes) -> None:
    assert ends_stream(endpoint, end)
    assert ends_stream(endpoint, TOKEN + end)  # coalesced: the last event is what counts
    assert not ends_stream(endpoint, end + TOKEN)
    assert not ends_stream(endpoint, TOKEN)
    assert not ends_stream(endpoint, b"")


def test_an_endpoint_without_a_known_end_never_ends() -> None:
    assert not ends_stream("embeddings", b"data: [DONE]\n\n")
    assert not ends_stream("passthrough", b"data: [DONE]\n\n")


def test_the_last_event_of_a_write() -> None:
    assert last_event(TOKEN) == TOKEN
    assert last_event(TOKEN + b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
