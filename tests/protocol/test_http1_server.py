"""The fast path's request heads: only the plain shape is its, and everything else (every
malformed or unusual head) is left to hypercorn, never refused here."""

from __future__ import annotations

import pytest

from proxy.protocol.http1_server import (
    encode_response_head,
    end_of_head,
    head_has_ended,
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
