"""proxy.protocol.http1: the upstream client's HTTP/1.1 framing, by example and against h11."""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.protocol.http1 import (
    MAX_CHUNK_LINE_BYTES,
    MAX_HEAD_BYTES,
    MAX_TRAILER_BYTES,
    LocalProtocolError,
    ProtocolError,
    ResponseHead,
    ResponseReader,
    encode_request,
)

OK = b"HTTP/1.1 200 OK\r\n"
CHUNKED = OK + b"Transfer-Encoding: chunked\r\n\r\n"


def read(*pieces: bytes, method: bytes = b"GET", eof: bool = False) -> tuple[ResponseReader, bytes]:
    reader = ResponseReader(method)
    body = b"".join([reader.feed(piece) for piece in pieces])
    if eof:
        reader.feed_eof()
    return reader, body


def head_of(reader: ResponseReader) -> ResponseHead:
    assert reader.head is not None
    return reader.head


def state(reader: ResponseReader) -> tuple[bool, bool]:
    """(complete, reusable), read through a call so mypy's narrowing of one feed's assertion
    does not carry over to the next."""
    return reader.complete, reader.reusable


def response(*fields: bytes, body: bytes = b"", status_line: bytes = OK) -> bytes:
    return status_line + b"".join(field + b"\r\n" for field in fields) + b"\r\n" + body


# --- framing ---------------------------------------------------------------------------------


def test_head_fields() -> None:
    reader, body = read(
        response(
            b"X-A: 1", b"Content-Length: 2", b"x-a:  2 \t", status_line=b"HTTP/1.1 201 Made It\r\n"
        )
        + b"hi"
    )
    head = head_of(reader)
    assert (head.version, head.status, head.reason) == (b"1.1", 201, b"Made It")
    assert head.headers == [(b"x-a", b"1"), (b"content-length", b"2"), (b"x-a", b"2")]
    assert head.values(b"x-a") == [b"1", b"2"]
    assert head.values(b"x-b") == []
    assert body == b"hi"
    assert state(reader) == (True, True)


def test_status_line_without_reason() -> None:
    head = head_of(read(response(b"Content-Length: 0", status_line=b"HTTP/1.0 404\r\n"))[0])
    assert (head.version, head.status, head.reason) == (b"1.0", 404, b"")


def test_content_length_body_split_across_feeds() -> None:
    reader = ResponseReader()
    outputs = []
    for piece in (response(b"Content-Length: 10", body=b"012"), b"3456", b"789"):
        assert not reader.complete
        outputs.append(reader.feed(piece))
    assert outputs == [b"012", b"3456", b"789"]
    assert state(reader) == (True, True)


@pytest.mark.parametrize(
    ("pieces", "method", "expected"),
    [
        ((response(b"Content-Length: 2", body=b"hiHTTP/1.1"),), b"GET", b"hi"),
        ((response(b"Content-Length: 2", body=b"hi"), b"X"), b"GET", b"hi"),
        ((response(b"Content-Length: 0", body=b"X"),), b"GET", b""),
        ((CHUNKED + b"2\r\nhi\r\n0\r\n\r\nX",), b"GET", b"hi"),
        ((CHUNKED + b"2\r\nhi\r\n0\r\n\r\n", b"\r\n"), b"GET", b"hi"),
        ((response(b"Content-Length: 5", body=b"hello"),), b"HEAD", b""),
    ],
)
def test_bytes_after_the_response_make_the_connection_unusable(
    pieces: tuple[bytes, ...], method: bytes, expected: bytes
) -> None:
    # A server that sends more than it framed is out of step; reusing it would read garbage.
    reader, body = read(*pieces, method=method)
    assert body == expected
    assert state(reader) == (True, False)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (CHUNKED + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),
        (CHUNKED + b"5;name=value;flag\r\nhello\r\n0;last=1\r\n\r\n", b"hello"),
        (CHUNKED + b"5\r\nhello\r\n0\r\nX-Sum: abc\r\nX-Other: d\r\n\r\n", b"hello"),
        (CHUNKED + b"5\nhello\n0\n\n", b"hello"),
        (b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n5\nhello\n0\nX-T: 1\n\n", b"hello"),
        (CHUNKED + b"000A\r\n0123456789\r\na \t\r\n0123456789\r\n0\r\n\r\n", b"0123456789" * 2),
        (CHUNKED + b"0000000000000003\r\nabc\r\n0\r\n\r\n", b"abc"),
        (CHUNKED + b"0\r\n\r\n", b""),
        (response(b"Transfer-Encoding: Chunked", body=b"2\r\nhi\r\n0\r\n\r\n"), b"hi"),
    ],
)
def test_chunked(data: bytes, expected: bytes) -> None:
    reader, body = read(data)
    assert body == expected
    assert state(reader) == (True, True)
    # Trailer fields are skipped, never merged into the head.
    assert [name for name, _ in head_of(reader).headers] == [b"transfer-encoding"]


SAMPLES = [
    CHUNKED + b"5;ext=1\r\nhello\r\n2\r\n\r\n\r\n0\r\nX-T: 1\r\n\r\n",
    CHUNKED + b"5\nhello\n0\n\n",
    response(b"Content-Length: 7", body=b"\r\n\r\nabc"),
    b"HTTP/1.1 100 Continue\r\n\r\n" + response(b"Content-Length: 2", body=b"hi"),
]


@pytest.mark.parametrize("data", SAMPLES)
def test_every_split_gives_the_same_result(data: bytes) -> None:
    # The network may cut anywhere: between a CR and its LF, inside a chunk-size line...
    whole, expected = read(data)
    assert state(whole) == (True, True)
    for cut in range(len(data) + 1):
        reader, body = read(data[:cut], data[cut:])
        assert (body, *state(reader)) == (expected, True, True), cut
    reader, body = read(*(data[i : i + 1] for i in range(len(data))))
    assert (body, *state(reader)) == (expected, True, True)


def test_chunk_crlf_split_between_feeds() -> None:
    reader = ResponseReader()
    assert reader.feed(CHUNKED + b"5\r\nhello\r") == b"hello"
    assert reader.feed(b"\n0\r") == b""
    assert reader.feed(b"\n\r") == b""
    assert not reader.complete
    assert reader.feed(b"\n") == b""
    assert state(reader) == (True, True)


# A streaming upstream's reads: one whole chunk each (the reader's shortcut), and the shapes
# beside it that the shortcut must leave to the general reader.
STREAM_READS = [
    (b"5\r\nhello\r\n", b"hello"),
    (b"A\r\n0123456789\r\n", b"0123456789"),
    (b"0003\r\nabc\r\n", b"abc"),
    (b"3;ext=1\r\nabc\r\n", b"abc"),
    (b"3\nabc\n", b"abc"),
    (b"3 \r\nabc\r\n", b"abc"),
    (b"2\r\nab\r\n2\r\ncd\r\n", b"abcd"),
    # Data that holds CRLFs and looks like chunk framing itself.
    (b"6\r\n1\r\nx\r\n\r\n", b"1\r\nx\r\n"),
    (b"%x\r\n%b\r\n" % (300, b"e" * 300), b"e" * 300),
]


@pytest.mark.parametrize(("frame", "data"), STREAM_READS)
def test_a_read_of_whole_chunks(frame: bytes, data: bytes) -> None:
    reader = ResponseReader()
    assert reader.feed(CHUNKED) == b""
    assert [reader.feed(frame) for _ in range(3)] == [data] * 3
    assert not reader.complete
    assert reader.feed(b"0\r\n\r\n") == b""
    assert state(reader) == (True, True)


@pytest.mark.parametrize(
    "frame",
    [
        b"3\r\nabcd\r\n",  # data longer than its size: no CRLF where one must be
        b"3\r\nabc\r\r",
        b"g\r\nabc\r\n",
        b"-3\r\nabc\r\n",
        b"+3\r\nabc\r\n",
        b"0x3\r\nabc\r\n",
        b"11111111111111111\r\n" + b"a" * 5,  # 17 hex digits
    ],
)
def test_a_read_that_only_looks_like_a_chunk(frame: bytes) -> None:
    reader = ResponseReader()
    reader.feed(CHUNKED)
    with pytest.raises(ProtocolError):
        reader.feed(frame)
        reader.feed(b"0\r\n\r\n")


def test_whole_chunk_reads_then_a_split_one() -> None:
    reader = ResponseReader()
    assert reader.feed(CHUNKED + b"2\r\nab\r\n") == b"ab"
    assert reader.feed(b"2\r\ncd\r\n3\r\ne") == b"cde"
    assert reader.feed(b"fg\r\n") == b"fg"
    assert reader.feed(b"1\r\nh\r\n0\r\n\r\n") == b"h"
    assert state(reader) == (True, True)


@pytest.mark.parametrize("connection", [b"", b"Connection: keep-alive"])
def test_body_without_length_ends_at_close(connection: bytes) -> None:
    reader = ResponseReader()
    assert reader.feed(response(*filter(None, [connection]), body=b"abc")) == b"abc"
    assert reader.feed(b"def") == b"def"
    assert not reader.complete
    reader.feed_eof()
    # The close is the framing, so the connection is gone whatever the server said.
    assert state(reader) == (True, False)
    assert not head_of(reader).keep_alive


@pytest.mark.parametrize(
    ("method", "status_line", "framing"),
    [
        (b"HEAD", b"HTTP/1.1 200 OK\r\n", b"Content-Length: 5"),
        (b"HEAD", b"HTTP/1.1 200 OK\r\n", b"Transfer-Encoding: chunked"),
        (b"GET", b"HTTP/1.1 204 No Content\r\n", b"Content-Length: 5"),
        (b"GET", b"HTTP/1.1 304 Not Modified\r\n", b"Content-Length: 5"),
        (b"POST", b"HTTP/1.1 304 Not Modified\r\n", b"Transfer-Encoding: gzip"),
    ],
)
def test_responses_without_a_body(method: bytes, status_line: bytes, framing: bytes) -> None:
    reader, body = read(response(framing, status_line=status_line), method=method)
    assert body == b""
    assert state(reader) == (True, True)


def test_interim_responses_are_skipped() -> None:
    reader = ResponseReader()
    assert reader.feed(b"HTTP/1.1 100 Continue\r\n\r\n") == b""
    assert reader.head is None
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
    assert reader.feed(hints + response(b"Content-Length: 2", body=b"hi")) == b"hi"
    assert head_of(reader).status == 200
    assert head_of(reader).values(b"link") == []
    assert state(reader) == (True, True)


def test_switching_protocols_is_an_error() -> None:
    with pytest.raises(ProtocolError, match="switched protocols"):
        ResponseReader().feed(response(b"Upgrade: websocket", status_line=b"HTTP/1.1 101 S\r\n"))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (response(b"Content-Length: 5", body=b"hel"), b"hel"),
        (CHUNKED + b"3\r\nabc\r\n2\r\nde", b"abcde"),
        (response(body=b"abc"), b"abc"),
    ],
)
def test_body_bytes_in_the_head_feed_are_returned(data: bytes, expected: bytes) -> None:
    reader = ResponseReader()
    assert reader.feed(data) == expected
    assert not reader.complete


def test_bare_lf_head_end_followed_by_a_body_starting_with_crlf() -> None:
    # The first b"\n\r\n" here begins inside the head's own bare-LF end: the body's CRLF must
    # not be taken for the head's blank line, whichever way the bytes are split.
    data = b"HTTP/1.1 200 OK\nContent-Length: 4\n\n\r\nab"
    assert read(data[:-4], data[-4:])[1] == b"\r\nab"
    assert read(data)[1] == b"\r\nab"


# --- keep-alive -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "connection", "keep_alive"),
    [
        (b"1.1", [], True),
        (b"1.1", [b"Connection: keep-alive"], True),
        (b"1.1", [b"Connection: close"], False),
        (b"1.1", [b"Connection: keep-alive, Close"], False),
        (b"1.1", [b"Connection: upgrade", b"connection: CLOSE"], False),
        (b"1.0", [], False),
        (b"1.0", [b"Connection: keep-alive"], True),
        (b"1.0", [b"Connection: Keep-Alive"], True),
        (b"1.0", [b"Connection: keep-alive,close"], False),
    ],
)
def test_keep_alive(version: bytes, connection: list[bytes], keep_alive: bool) -> None:
    status_line = b"HTTP/" + version + b" 200 OK\r\n"
    reader, body = read(response(*connection, b"Content-Length: 0", status_line=status_line))
    assert head_of(reader).keep_alive is keep_alive
    assert (body, *state(reader)) == (b"", True, keep_alive)


def test_transfer_encoding_wins_over_content_length_but_closes() -> None:
    # Both framings at once is how requests get smuggled; the connection must not carry another.
    data = response(
        b"Content-Length: 100", b"Transfer-Encoding: chunked", body=b"3\r\nabc\r\n0\r\n\r\n"
    )
    reader, body = read(data)
    assert body == b"abc"
    assert state(reader) == (True, False)
    assert not head_of(reader).keep_alive


@pytest.mark.parametrize(
    "lengths", [[b"5, 5"], [b"5", b"5"], [b"  5\t"], [b"005"], [b"5 ,5", b"5"]]
)
def test_agreeing_content_lengths_are_accepted(lengths: list[bytes]) -> None:
    reader, body = read(response(*(b"Content-Length: " + n for n in lengths), body=b"hello"))
    assert body == b"hello"
    assert reader.reusable


# --- errors -----------------------------------------------------------------------------------


def _te(*values: bytes) -> bytes:
    return response(*(b"Transfer-Encoding: " + value for value in values))


def _cl(*values: bytes) -> bytes:
    return response(*(b"Content-Length: " + value for value in values))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"HTTP/1.1 20 OK\r\n\r\n", "invalid status code"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "invalid status code"),
        (b"HTTP/1.1 099 OK\r\n\r\n", "invalid status code"),
        (b"HTTP/1.1 abc OK\r\n\r\n", "invalid status code"),
        (b"HTTP/1.1  200 OK\r\n\r\n", "invalid status code"),
        (b"HTTP/1.1\r\n\r\n", "invalid status line"),
        (b"HTTP/2 200 OK\r\n\r\n", "invalid status line"),
        (b"http/1.1 200 OK\r\n\r\n", "invalid status line"),
        (b"ICY 200 OK\r\n\r\n", "invalid status line"),
        (b"\r\n\r\n", "invalid status line"),
        (response(b"X-A: a", b" b"), "line folding"),
        (response(b"X-A: a", b"\tb"), "line folding"),
        (response(b"X-A a"), "invalid response header line"),
        (response(b"X-A : a"), "invalid response header line"),
        (response(b": a"), "invalid response header line"),
        (response(b"X(A): a"), "invalid response header line"),
        (response(b"X-A: a\x01b"), "invalid characters"),
        (response(b"X-A: a\x00"), "invalid characters"),
        (response(b"X-A: a\x7f"), "invalid characters"),
        (response(b"X-A: a\rb"), "invalid characters"),
        (_te(b"gzip"), "unsupported transfer-encoding"),
        (_te(b"identity"), "unsupported transfer-encoding"),
        (_te(b"gzip, chunked"), "unsupported transfer-encoding"),
        (_te(b"chunked, gzip"), "unsupported transfer-encoding"),
        # One chunked coding only: a doubled one could be read twice by a proxy in between.
        (_te(b"chunked, chunked"), "unsupported transfer-encoding"),
        (_te(b"chunked", b"chunked"), "unsupported transfer-encoding"),
        (_te(b"chunked,"), "unsupported transfer-encoding"),
        (_cl(b"1, 2"), "invalid content-length"),
        (_cl(b"1", b"2"), "invalid content-length"),
        (_cl(b"5,"), "invalid content-length"),
        (_cl(b""), "invalid content-length"),
        (_cl(b"-1"), "invalid content-length"),
        (_cl(b"+5"), "invalid content-length"),
        (_cl(b"5a"), "invalid content-length"),
        (_cl(b"0x5"), "invalid content-length"),
        (_cl(b"1" * 20), "invalid content-length"),
    ],
)
def test_malformed_head(data: bytes, match: str) -> None:
    reader = ResponseReader()
    with pytest.raises(ProtocolError, match=match):
        reader.feed(data)


@pytest.mark.parametrize(
    "line", [b"0x5", b"+5", b" 1_0", b"", b"-1", b"g", b";ext", b"5 5", b"0" * 16 + b"5"]
)
def test_invalid_chunk_size(line: bytes) -> None:
    with pytest.raises(ProtocolError, match="invalid chunk size"):
        read(CHUNKED + line + b"\r\nhello\r\n0\r\n\r\n")


@pytest.mark.parametrize(
    "pieces",
    [
        (CHUNKED + b"5\r\nhelloX\r\n0\r\n\r\n",),
        (CHUNKED + b"5\r\nhello\rX",),
        (CHUNKED + b"5\r\nhello\r", b"X"),
    ],
)
def test_chunk_data_not_followed_by_crlf(pieces: tuple[bytes, ...]) -> None:
    with pytest.raises(ProtocolError, match="not followed by CRLF"):
        read(*pieces)


def padded_head(end: int) -> bytes:
    """A complete head whose blank line starts just after offset ``end`` (where the reader
    measures a head's size)."""
    start = OK + b"Content-Length: 0\r\nX-Pad: "
    return start + b"a" * (end - len(start) - 1) + b"\r\n\r\n"


def test_head_at_the_bound_is_accepted() -> None:
    assert padded_head(MAX_HEAD_BYTES).index(b"\n\r\n") == MAX_HEAD_BYTES
    reader, _ = read(padded_head(MAX_HEAD_BYTES))
    assert state(reader) == (True, True)


def test_unfinished_head_over_the_bound() -> None:
    reader = ResponseReader()
    start = OK + b"X-Pad: "
    reader.feed(start + b"a" * (MAX_HEAD_BYTES - len(start)))
    assert reader.head is None
    with pytest.raises(ProtocolError, match="head over"):
        reader.feed(b"a")


@pytest.mark.parametrize("cut", [None, MAX_HEAD_BYTES - 100])
def test_head_ending_past_the_bound(cut: int | None) -> None:
    data = padded_head(MAX_HEAD_BYTES + 1)
    pieces = (data,) if cut is None else (data[:cut], data[cut:])
    with pytest.raises(ProtocolError, match="head over"):
        read(*pieces)


def _chunk_line(size: int) -> bytes:
    return b"5;" + b"x" * (size - 3) + b"\r"


def test_chunk_line_at_the_bound_is_accepted() -> None:
    _, body = read(CHUNKED + _chunk_line(MAX_CHUNK_LINE_BYTES) + b"\nhello\r\n0\r\n\r\n")
    assert body == b"hello"


@pytest.mark.parametrize(
    "data",
    [
        CHUNKED + _chunk_line(MAX_CHUNK_LINE_BYTES + 1) + b"\nhello\r\n0\r\n\r\n",
        CHUNKED + _chunk_line(MAX_CHUNK_LINE_BYTES + 1),
    ],
)
def test_chunk_line_over_the_bound(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="chunk-size line over"):
        read(data)


@pytest.mark.parametrize(
    "pieces",
    [
        (CHUNKED + b"0\r\nX-T: " + b"a" * MAX_TRAILER_BYTES + b"\r\n\r\n",),
        (CHUNKED + b"0\r\nX-T: " + b"a" * MAX_TRAILER_BYTES,),
        (CHUNKED + b"0\r\n", *[b"X-T: " + b"a" * 95 + b"\r\n"] * (MAX_TRAILER_BYTES // 100 + 1)),
    ],
)
def test_trailers_over_the_bound(pieces: tuple[bytes, ...]) -> None:
    with pytest.raises(ProtocolError, match="trailers over"):
        read(*pieces)


@pytest.mark.parametrize(
    ("pieces", "where"),
    [
        ((), "head"),
        ((b"HTTP/1.1 200 OK\r\nContent-Le",), "head"),
        ((b"HTTP/1.1 100 Continue\r\n\r\n",), "head"),
        ((response(b"Content-Length: 5"),), "body"),
        ((response(b"Content-Length: 5", body=b"hel"),), "body"),
        ((CHUNKED + b"5\r\nhel",), "body"),
        ((CHUNKED + b"5\r\nhello\r\n",), "body"),
        ((CHUNKED + b"5\r\nhello\r\n0\r\nX-T: 1\r\n",), "body"),
    ],
)
def test_close_in_the_middle(pieces: tuple[bytes, ...], where: str) -> None:
    reader, _ = read(*pieces)
    with pytest.raises(ProtocolError, match=f"middle of the response {where}"):
        reader.feed_eof()


def test_close_after_a_complete_response_is_fine() -> None:
    reader, body = read(response(b"Content-Length: 2", body=b"hi"), eof=True)
    assert body == b"hi"
    assert reader.complete


# --- encode_request ---------------------------------------------------------------------------


def test_encode_request_exact_bytes() -> None:
    headers = iter([(b"Host", b"up:8000"), (b"Content-Length", b"2"), (b"X-T", b"a\tb")])
    assert encode_request(b"POST", b"/v1/chat?x=1", headers, b"{}") == (
        b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: up:8000\r\nContent-Length: 2\r\nX-T: a\tb\r\n\r\n{}"
    )
    assert encode_request(b"GET", b"/", [], b"") == b"GET / HTTP/1.1\r\n\r\n"


def test_encoded_request_reads_back_in_h11() -> None:
    data = encode_request(b"POST", b"/p", [(b"Host", b"h"), (b"Content-Length", b"3")], b"a\r\n")
    server = h11.Connection(h11.SERVER)
    server.receive_data(data)
    request = server.next_event()
    assert isinstance(request, h11.Request)
    assert (request.method, request.target) == (b"POST", b"/p")
    assert list(request.headers) == [(b"host", b"h"), (b"content-length", b"3")]
    data_event = server.next_event()
    assert isinstance(data_event, h11.Data)
    assert data_event.data == b"a\r\n"
    assert isinstance(server.next_event(), h11.EndOfMessage)


@pytest.mark.parametrize(
    "header",
    [
        (b"X-A", b"a\r\nX-Injected: 1"),
        (b"X-A", b"a\nb"),
        (b"X-A", b"a\rb"),
        (b"X-A", b"a\x00b"),
        (b"X-A\r\nX-B", b"a"),
        (b"X-A\x00", b"a"),
        (b"X A", b"a"),
        (b"", b"a"),
    ],
)
def test_encode_request_rejects_a_bad_header(header: tuple[bytes, bytes]) -> None:
    with pytest.raises(LocalProtocolError):
        encode_request(b"GET", b"/", [(b"Host", b"h"), header], b"")


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"GET", b"/a b"), (b"GET", b"/a\r\nX: 1"), (b"GET", b"/\x00"), (b"G T", b"/"), (b"", b"/")],
)
def test_encode_request_rejects_a_bad_request_line(method: bytes, target: bytes) -> None:
    with pytest.raises(LocalProtocolError):
        encode_request(method, target, [(b"Host", b"h")], b"")


# --- against h11 ------------------------------------------------------------------------------

_TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_FRAMING = {b"content-length", b"transfer-encoding", b"connection"}
_names = (
    st.text(_TOKEN_CHARS, min_size=1, max_size=10)
    .map(str.encode)
    .filter(lambda name: name.lower() not in _FRAMING)
)
# Tab, space, visible ASCII and obs-text: all a field value (or reason phrase) may hold.
_values = st.lists(st.sampled_from([9, *range(0x20, 0x7F), *range(0x80, 0x100)]), max_size=12).map(
    lambda octets: bytes(octets).strip(b" \t")
)
_ows = st.sampled_from([b"", b" ", b"\t", b" \t "])
_fields = st.lists(st.tuples(_names, _values), max_size=4)
_bodies = st.lists(
    st.binary(max_size=24) | st.sampled_from([b"\r\n", b"\n", b"\r", b"0\r\n\r\n", OK]), max_size=6
).map(b"".join)


INTERIM = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Hints\r\nLink: </a>\r\n\r\n"]


class Case(NamedTuple):
    method: bytes
    wire: bytes
    eof: bool
    cuts: list[int]


class Outcome(NamedTuple):
    version: bytes
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool
    reusable: bool


@st.composite
def chunked_bodies(draw: st.DrawFn, body: bytes) -> bytes:
    out = []
    position = 0
    while position < len(body):
        size = draw(st.integers(1, len(body) - position))
        hex_size = format(size, draw(st.sampled_from(["x", "X", "04x"]))).encode()
        ext = draw(st.sampled_from([b"", b";a", b";name=value", b';q="x;y"', b" "]))
        out.append(hex_size + ext + b"\r\n" + body[position : position + size] + b"\r\n")
        position += size
    trailers = b"".join(name + b": " + value + b"\r\n" for name, value in draw(_fields))
    out.append(b"0" + draw(st.sampled_from([b"", b";end"])) + b"\r\n" + trailers + b"\r\n")
    return b"".join(out)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD"]))
    status = draw(st.integers(200, 599))
    version = draw(st.sampled_from([b"1.1", b"1.0"]))
    # h11 never keeps an HTTP/1.0 connection, so keep-alive is only drawn where they agree.
    connection = draw(
        st.sampled_from([b"", b"close", b"keep-alive"][: 3 if version == b"1.1" else 2])
    )
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    body = draw(_bodies)
    has_body = method != b"HEAD" and status not in (204, 304)
    fields = [name + b":" + draw(_ows) + value + draw(_ows) for name, value in draw(_fields)]
    if connection:
        fields.append(b"Connection: " + connection)
    payload = body
    if framing == "length":
        cl = draw(st.sampled_from([b"Content-Length", b"content-length", b"CONTENT-LENGTH"]))
        fields.append(cl + b": " + str(len(body)).encode())
    elif framing == "chunked":
        te = draw(st.sampled_from([b"Transfer-Encoding", b"transfer-encoding"]))
        fields.append(te + b": chunked")
        payload = draw(chunked_bodies(body))
    status_line = b"HTTP/" + version + b" %d " % status + draw(_values) + b"\r\n"
    interim = draw(st.lists(st.sampled_from(INTERIM), max_size=2))
    eof = framing == "close" and has_body
    extra = b"" if eof else draw(st.sampled_from([b"", b"\r\n", OK]))
    wire = (
        b"".join(interim)
        + response(*draw(st.permutations(fields)), status_line=status_line)
        + (payload if has_body else b"")
        + extra
    )
    cuts = sorted(draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    return Case(method, wire, eof, cuts)


def ours(case: Case, pieces: list[bytes]) -> Outcome:
    reader, body = read(*pieces, method=case.method, eof=case.eof)
    h = head_of(reader)
    return Outcome(h.version, h.status, h.reason, h.headers, body, *state(reader))


def theirs(case: Case) -> Outcome:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=case.method, target=b"/", headers=[(b"host", b"upstream")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(case.wire)
    if case.eof:
        conn.receive_data(b"")
    final = None
    body = b""
    complete = False
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            # Bytes after a response whose connection must close: only its end was in doubt.
            assert complete
            break
        if event is h11.NEED_DATA or event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
            break
        if isinstance(event, h11.Response):
            final = event
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            complete = True
    assert final is not None
    reusable = conn.our_state is h11.DONE and conn.their_state is h11.DONE
    return Outcome(
        final.http_version,
        final.status_code,
        bytes(final.reason),
        list(final.headers),
        body,
        complete,
        reusable and not conn.trailing_data[0],
    )


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_agrees_with_h11(case: Case) -> None:
    bounds = [0, *case.cuts, len(case.wire)]
    pieces = [case.wire[start:end] for start, end in pairwise(bounds)]
    assert ours(case, pieces) == theirs(case)


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_byte_by_byte_equals_all_at_once(case: Case) -> None:
    single_bytes = [case.wire[i : i + 1] for i in range(len(case.wire))]
    assert ours(case, single_bytes) == ours(case, [case.wire])


def test_an_http10_response_with_a_transfer_coding_is_never_reused() -> None:
    # HTTP/1.0 has no transfer codings: RFC 9112 section 6.1 has the client read the body as
    # chunked, then close, whatever Connection says (its framing may not be what it seems).
    reader = ResponseReader(b"POST")
    body = reader.feed(
        b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    assert body == b"hello"
    assert reader.complete
    assert not reader.reusable


def test_content_decoder_takes_the_body_in_pieces_and_bounds_what_it_makes() -> None:
    import gzip

    from proxy.protocol.http1 import ContentDecoder, ProtocolError

    body = b"data: token\n\n" * 1000
    packed = gzip.compress(body)
    decoder = ContentDecoder("gzip", len(body))
    out = b"".join(decoder.feed(packed[i : i + 7]) for i in range(0, len(packed), 7))
    assert out == body
    with pytest.raises(ProtocolError, match="limit"):
        ContentDecoder("gzip", len(body) - 1).feed(packed)
    with pytest.raises(ProtocolError, match="limit"):
        ContentDecoder("gzip", 10**9, chunk_limit=100).feed(packed)
    with pytest.raises(ProtocolError, match="undecodable"):
        ContentDecoder("deflate", 100).feed(b"not deflate at all")


def test_a_chunked_body_as_the_bench_client_reads_it() -> None:
    # The bench's load generator reads the relay's answers with this reader (proxy.bench.client):
    # an event stream in small chunks with extensions and a trailer, cut anywhere.
    events = b"".join(b'data: {"n":%d}\n\n' % i for i in range(5)) + b"data: [DONE]\n\n"
    body = b"".join(
        b"%x;ext=1\r\n%b\r\n" % (len(events[i : i + 37]), events[i : i + 37])
        for i in range(0, len(events), 37)
    )
    data = CHUNKED + body + b"0\r\nX-Trailer: yes\r\n\r\n"
    for cut in range(len(data) + 1):
        reader, out = read(data[:cut], data[cut:])
        assert (out, reader.complete) == (events, True), cut
    # Bytes after the last chunk are not body; garbage framing is an error.
    reader, out = read(CHUNKED + b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 junk")
    assert (out, reader.complete) == (b"abc", True)
    with pytest.raises(ProtocolError):
        read(CHUNKED + b"zz\r\nabc\r\n")
    with pytest.raises(ProtocolError):
        read(CHUNKED + b"3\r\nabcXY")
