"""SSE framing, sans-IO: splitting byte chunks into events, and framing our own events."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.errors import ApiError
from proxy.protocol.sse import (
    DONE_EVENT,
    SSEProtocolError,
    SSESplitter,
    check_event,
    data_event,
    error_event,
    is_done,
)

# Line text: any Unicode (multi-byte UTF-8 included) except line breaks and lone surrogates.
_text = st.text(st.characters(exclude_characters="\r\n", exclude_categories=["Cs"]), max_size=12)
_field = st.sampled_from(["data: ", "data:", "event: ", "id: ", ": "])
_line = st.builds(lambda field, text: (field + text).encode(), _field, _text)
# An event's lines, without the blank line that ends it.
_event_lines = st.lists(_line, min_size=1, max_size=3)


def _cuts(data: st.DataObject, stream: bytes, extra: set[int] = frozenset()) -> list[bytes]:
    """Split ``stream`` at random offsets (plus ``extra``); empty chunks allowed."""
    offsets = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
    bounds = sorted({0, len(stream), *offsets, *extra})
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    if data.draw(st.booleans()):
        chunks.insert(data.draw(st.integers(0, len(chunks))), b"")
    return chunks


def _check_split(wire_events: list[bytes], expected: list[bytes], chunks: list[bytes]) -> None:
    """Feeding ``chunks`` yields each event exactly when its last wire byte has arrived."""
    ends, total = [], 0
    for event in wire_events:
        total += len(event)
        ends.append(total)
    splitter = SSESplitter()
    got: list[bytes] = []
    fed = 0
    for chunk in chunks:
        got.extend(splitter.feed(chunk))
        fed += len(chunk)
        complete = sum(1 for end in ends if end <= fed)
        assert got == expected[:complete], f"after {fed} bytes"
    assert got == expected
    assert splitter.pending == b""


@given(st.lists(_event_lines, max_size=6), st.data())
def test_lf_events_survive_any_chunking(events: list[list[bytes]], data: st.DataObject) -> None:
    wire = [b"\n".join(lines) + b"\n\n" for lines in events]
    _check_split(wire, wire, _cuts(data, b"".join(wire)))


@given(st.lists(_event_lines, max_size=6), st.booleans(), st.data())
def test_crlf_events_are_normalised_under_any_chunking(
    events: list[list[bytes]], split_every_crlf: bool, data: st.DataObject
) -> None:
    wire = [b"\r\n".join(lines) + b"\r\n\r\n" for lines in events]
    stream = b"".join(wire)
    # Optionally cut between every CR and its LF, the hardest case for the normaliser.
    extra = (
        {i + 1 for i, byte in enumerate(stream) if byte == ord("\r")} if split_every_crlf else set()
    )
    expected = [b"\n".join(lines) + b"\n\n" for lines in events]
    _check_split(wire, expected, _cuts(data, stream, extra))


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_byte_by_byte(newline: bytes) -> None:
    stream = b"data: \xe4\xbd\xa0\xe5\xa5\xbd" + newline * 2 + b"data: \xf0\x9f\x98\x80" + newline
    splitter = SSESplitter()
    got = [event for i in range(len(stream)) for event in splitter.feed(stream[i : i + 1])]
    assert got == [b"data: \xe4\xbd\xa0\xe5\xa5\xbd\n\n"]
    assert splitter.pending == b"data: \xf0\x9f\x98\x80\n"


def test_pending_event_over_limit_raises() -> None:
    splitter = SSESplitter(max_event_bytes=16)
    assert splitter.feed(b"data: " + b"x" * 10) == []  # exactly at the limit: still fine
    with pytest.raises(SSEProtocolError, match="16 bytes"):
        splitter.feed(b"y")


def test_complete_events_do_not_count_towards_limit() -> None:
    splitter = SSESplitter(max_event_bytes=16)
    events = [b"data: %d\n\n" % i for i in range(10)]
    assert splitter.feed(b"".join(events) + b"data: ") == events
    assert splitter.pending == b"data: "


def test_sse_protocol_error_is_a_value_error() -> None:
    assert issubclass(SSEProtocolError, ValueError)


@pytest.mark.parametrize(
    "event",
    [
        b"data: {}\n\n",
        b"data:{}\n\n",
        b"event: x\ndata: 1\n\n",
        b"id: 7\n\n",
        b"retry: 5\n\n",
        b": keep-alive\n\n",
        b"data\n\n",
    ],
)
def test_check_event_accepts_sse_fields(event: bytes) -> None:
    check_event(event)


@pytest.mark.parametrize(
    "event", [b"<html><body>502</body></html>\n\n", b'{"error": "x"}\n\n', b"HTTP/1.1 200\n\n"]
)
def test_check_event_rejects_non_sse(event: bytes) -> None:
    with pytest.raises(SSEProtocolError, match="malformed"):
        check_event(event)


def test_extra_blank_lines_between_events_are_valid() -> None:
    splitter = SSESplitter()
    for event in splitter.feed(b"data: a\n\n\ndata: b\n\n"):
        check_event(event)


@pytest.mark.parametrize(
    ("event", "done"),
    [
        (DONE_EVENT, True),
        (b"data:[DONE]\n\n", True),
        (b'data: {"x": "[DONE]"}\n\n', False),
        (b": data: [DONE]\n\n", False),
    ],
)
def test_is_done(event: bytes, done: bool) -> None:
    assert is_done(event) is done


def test_data_event_is_one_compact_event() -> None:
    payload = {"text": "你好 😀", "lines": "a\n\nb", "n": [1, 2]}
    event = data_event(payload)
    assert event.startswith(b"data: {")
    assert event.count(b"\n\n") == 1 and event.endswith(b"\n\n")
    assert b", " not in event and b": " not in event[len(b"data: ") :]
    assert SSESplitter().feed(event) == [event]
    assert json.loads(event[len(b"data: ") : -2]) == payload


def test_error_event_carries_openai_error_object() -> None:
    error = ApiError(502, "upstream went away", type="upstream_error", code="upstream_eof")
    event = error_event(error)
    check_event(event)
    assert json.loads(event[len(b"data: ") : -2]) == {
        "error": {
            "message": "upstream went away",
            "type": "upstream_error",
            "param": None,
            "code": "upstream_eof",
        }
    }
