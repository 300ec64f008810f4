"""The fast path's request heads: only the plain shape is its, and everything else (every
malformed or unusual head) is left to hypercorn, never refused here; the bytes that cannot
start a request at all, and the bound on a head, as h11 reads them; and the header block every
answer's head is made of, on either server."""

from __future__ import annotations

import h11
import pytest

from proxy.protocol.http1_server import (
    MAX_REQUEST_HEAD_BYTES,
    encode_response_head,
    end_of_head,
    head_has_ended,
    head_is_over_bound,
    header_block,
    keeps_alive,
    may_start_request,
    parse_plain_request_head,
)

PLAIN = (
    b"POST /v1/chat/completions HTTP/1.1\r\n"
    b"Host: proxy\r\n"
    b"Content-Type: application/json\r\n"
    b"Authorization:   Bearer sk-1  \r\n"
    b"Content-Length: 17\r\n"
    b"\r\n"
)


def test_a_plain_head_is_read_with_its_headers_lowercased_and_trimmed() -> None:
    head = parse_plain_request_head(PLAIN)
    assert head is not None
    assert head.method == b"POST"
    assert head.path == "/v1/chat/completions"
    assert head.query == b""
    assert head.content_length == 17
    assert head.keep_alive
    assert dict(head.headers)[b"authorization"] == b"Bearer sk-1"
    assert [name for name, _ in head.headers] == [
        b"host",
        b"content-type",
        b"authorization",
        b"content-length",
    ]


def test_the_query_is_apart_from_the_path() -> None:
    head = parse_plain_request_head(PLAIN.replace(b"completions HTTP", b"completions?x=1 HTTP"))
    assert head is not None
    assert (head.path, head.query) == ("/v1/chat/completions", b"x=1")


@pytest.mark.parametrize(
    "connection, keep_alive",
    [(b"close", False), (b"keep-alive", True), (b"Keep-Alive, CLOSE", False)],
)
def test_connection_close_ends_keep_alive(connection: bytes, keep_alive: bool) -> None:
    head = parse_plain_request_head(
        PLAIN.replace(b"\r\n\r\n", b"\r\nConnection: %b\r\n\r\n" % connection)
    )
    assert head is not None
    assert head.keep_alive is keep_alive


def _with(line: bytes) -> bytes:
    return PLAIN.replace(b"Host: proxy\r\n", b"Host: proxy\r\n" + line + b"\r\n")


@pytest.mark.parametrize(
    "head",
    [
        # Not HTTP/1.1, or not origin-form, or not a request line at all.
        PLAIN.replace(b"HTTP/1.1", b"HTTP/1.0"),
        PLAIN.replace(b"HTTP/1.1", b"HTTP/2.0"),
        PLAIN.replace(b"POST /v1", b"POST http://proxy/v1"),
        PLAIN.replace(b"POST /v1/chat/completions", b"POST  /v1/chat/completions"),
        PLAIN.replace(b"POST", b"PO(ST"),
        PLAIN.replace(b"/v1/chat/completions", b"/v1/chat completions"),
        # Framing anyone could read two ways: the smuggling shapes, and bodies that are not
        # one plain Content-Length.
        _with(b"Transfer-Encoding: chunked"),
        _with(b"Content-Length: 17"),
        PLAIN.replace(b"Content-Length: 17", b"Content-Length: +17"),
        PLAIN.replace(b"Content-Length: 17", b"Content-Length: 1,7"),
        PLAIN.replace(b"Content-Length: 17\r\n", b""),
        # What hypercorn answers itself: 100-continue, upgrades.
        _with(b"Expect: 100-continue"),
        _with(b"Upgrade: websocket"),
        _with(b"Connection: Upgrade"),
        # Malformed lines: obs-fold, a space before the colon, no colon, control characters,
        # obs-text.
        _with(b"X-Folded: a\r\n b"),
        _with(b"X-Space : a"),
        _with(b"NoColon"),
        _with(b"X-Ctl: a\x01b"),
        _with(b"X-Del: a\x7fb"),
        _with(b"X-Latin: caf\xe9"),
        # No Host, or two.
        PLAIN.replace(b"Host: proxy\r\n", b""),
        _with(b"Host: other"),
    ],
)
def test_anything_but_the_plain_shape_is_hypercorns(head: bytes) -> None:
    assert parse_plain_request_head(head) is None


def test_the_end_of_a_head_is_its_crlf_blank_line_only() -> None:
    assert end_of_head(PLAIN + b"{}") == len(PLAIN)
    assert end_of_head(PLAIN[:-2]) == -1
    # A bare-LF head never ends here: it is whole (below), and goes to hypercorn.
    assert end_of_head(b"POST / HTTP/1.1\nHost: a\n\n") == -1


@pytest.mark.parametrize(
    ("head", "ended"),
    [
        (PLAIN, True),
        (PLAIN[:-1], False),
        (PLAIN[:-2], False),
        (b"POST / HTTP/1.1\nHost: a\n\n", True),
        (b"POST / HTTP/1.1\r\nHost: a\n\r\n", True),
        (b"POST / HTTP/1.1\r\nHost: a\r\n\n", True),
        (b"POST / HTTP/1.1\r\nHost: a\r\n", False),
        (b"POST / HTTP/1.1\r\n\r", False),
        (b"", False),
    ],
)
def test_a_head_has_ended_at_a_blank_line_of_any_line_ends(head: bytes, ended: bool) -> None:
    assert head_has_ended(head) is ended


def test_a_response_head_ends_in_its_blank_line() -> None:
    head = encode_response_head(200, b"OK", [(b"content-length", b"2")])
    assert head == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


@pytest.mark.parametrize(
    "name, value",
    [(b"x-evil", b"a\r\nset-cookie: b"), (b"x-nul", b"a\x00"), (b"bad name", b"v")],
)
def test_a_response_header_that_could_split_the_head_is_refused(name: bytes, value: bytes) -> None:
    with pytest.raises(ValueError, match="invalid response header"):
        encode_response_head(502, b"Bad Gateway", [(name, value)])


@pytest.mark.parametrize(
    ("buffer", "may"),
    [
        (b"", True),
        (b"P", True),
        (b"POS", True),
        (b"POST", True),
        (b"POST ", True),
        (b"POST /v1/chat HTTP/1.1\r\n", True),
        (b"OPTIONS * HTTP/1.1\r\n", True),
        # A TLS ClientHello on the plain port: its first byte is 0x16.
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", False),
        (b"\r\nPOST / HTTP/1.1\r\n", False),
        (b" POST / HTTP/1.1\r\n", False),
        (b"\x00", False),
        (b"PO\x16", False),
        (b"GET\t/ HTTP/1.1", False),
        # A "method" longer than any is not one.
        (b"A" * 17, False),
        (b"A" * 16, True),
    ],
)
def test_bytes_that_cannot_start_a_request_are_told_at_once(buffer: bytes, may: bool) -> None:
    assert may_start_request(buffer) is may


def test_a_head_is_over_its_bound_only_past_it_as_h11_reads_it() -> None:
    h11_like = h11.Connection(h11.SERVER)
    exactly = b"POST / HTTP/1.1\r\nX: " + b"a" * (MAX_REQUEST_HEAD_BYTES - 20)
    assert len(exactly) == MAX_REQUEST_HEAD_BYTES
    h11_like.receive_data(exactly)
    assert h11_like.next_event() is h11.NEED_DATA  # h11 waits on at exactly the bound
    assert not head_is_over_bound(exactly)
    assert head_is_over_bound(exactly + b"a")
    h11_like.receive_data(b"a")
    with pytest.raises(h11.RemoteProtocolError):
        h11_like.next_event()


@pytest.mark.parametrize(
    ("headers", "version", "keeps"),
    [
        ([], b"1.1", True),
        ([(b"connection", b"keep-alive")], b"1.1", True),
        ([(b"connection", b"close")], b"1.1", False),
        ([(b"Connection", b"Upgrade, Close")], b"1.1", False),
        ([], b"1.0", False),
        ([(b"connection", b"keep-alive")], b"1.0", False),
    ],
)
def test_keeps_alive_as_h11_reads_a_request(
    headers: list[tuple[bytes, bytes]], version: bytes, keeps: bool
) -> None:
    assert keeps_alive(headers, version) is keeps
    connection = h11.Connection(h11.SERVER)
    head = b"GET / HTTP/" + version + b"\r\nHost: x\r\n"
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers) + b"\r\n"
    connection.receive_data(head)
    assert isinstance(connection.next_event(), h11.Request)
    connection.next_event()  # its end
    # h11's verdict: the connection goes on (DONE) or must close after this request.
    assert (connection.their_state is h11.DONE) is keeps


def test_the_header_block_frames_every_answer_in_one_place() -> None:
    answer = [("X-Request-ID", "abc"), ("Content-Type", "text/html"), ("Content-Length", "9")]
    relayed = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    server = [(b"date", b"today"), (b"server", b"hypercorn-h11")]
    # A stream: the relay's content type wins; no length, so chunked; the server's own after.
    assert header_block(200, answer, relayed, length=None, closes=False, server=server) == [
        (b"x-request-id", b"abc"),
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache"),
        (b"date", b"today"),
        (b"server", b"hypercorn-h11"),
        (b"Transfer-Encoding", b"chunked"),
    ]
    # A plain answer of a known length, the connection's last: the length the writer knows,
    # whatever the answer's own headers said.
    assert header_block(404, answer, None, length=12, closes=True, server=server) == [
        (b"x-request-id", b"abc"),
        (b"content-type", b"text/html"),
        (b"content-length", b"12"),
        (b"date", b"today"),
        (b"server", b"hypercorn-h11"),
        (b"connection", b"close"),
    ]
    # The last answer of a stream: the framing last, as h11 puts it.
    assert header_block(200, [], relayed, length=None, closes=True, server=[])[-2:] == [
        (b"connection", b"close"),
        (b"Transfer-Encoding", b"chunked"),
    ]
    # No body to frame: no framing at all.
    block = header_block(204, [], None, length=0, closes=False, server=[])
    assert block == []


def test_the_header_block_is_the_one_h11_sends_for_the_same_list() -> None:
    """The fast path writes the block as it is; hypercorn's h11 sends it through its own
    clean-up: the two heads must be the same bytes (here the connection's last answer, by the
    server's choice: keep_alive_max_requests, a drain)."""
    block = header_block(
        200,
        [("X-Request-ID", "abc")],
        {"Content-Type": "text/event-stream"},
        length=None,
        closes=True,
        server=[(b"date", b"today"), (b"server", b"hypercorn-h11")],
    )
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    connection.next_event()
    connection.next_event()
    by_h11 = connection.send(h11.Response(status_code=200, headers=block, reason=b"OK"))
    assert by_h11 == encode_response_head(200, b"OK", block)
