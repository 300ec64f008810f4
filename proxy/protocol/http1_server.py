"""HTTP/1.1 as Sluice's own server, sans-IO: which request heads the fast path may serve
itself, which bytes are never a request, and the head of every answer, on either server.

The fast path (``proxy/server/fast_path.py``) serves only requests whose framing leaves nothing
to interpret: HTTP/1.1, an origin-form target, well-formed header lines, one Content-Length of
digits, no Transfer-Encoding, no Expect, no Upgrade, a Host. Every other request, including
every malformed one, is left to the HTTP server of record (and h11) exactly as they would have
read it, so their protections (the framing and size checks, 100-continue, chunked request
bodies, their own 400s) stay the only ones that ever judge an unusual request. That is the
point of the strict subset: a request the fast path takes is one that h11 would have read the
same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from proxy.protocol.http1 import DIGITS, TOKEN

# The HTTP server's own bound on a request head (h11_max_incomplete_size): the server of record
# refuses a head only once its buffer is over this size, so a head still unfinished at exactly
# this size is waited for as that server waits for it, and one over it is that server's to
# refuse (431).
MAX_REQUEST_HEAD_BYTES = 16 * 1024
# The longest method the fast path serves ("OPTIONS"), with room: a first line whose method is
# still unfinished past this cannot be a plain request.
_MAX_METHOD_BYTES = 16
# An origin-form target (RFC 9112 3.2.1): a path of visible ASCII, no fragment, no spaces.
_ORIGIN_FORM = re.compile(rb"/[!-~]*")
# Control characters other than horizontal tab are never valid in a field value; obs-text
# (bytes over 0x7f) is legal but h11 and the fast path's latin-1 reading could disagree on
# it, so such a request is the server of record's.
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f-\xff]")
_WHITESPACE = b" \t"
_LINE_BREAKING = re.compile(rb"[\x00\r\n]")
# Headers whose presence means the request is not the plain shape the fast path serves.
_NOT_PLAIN = frozenset({b"transfer-encoding", b"expect", b"upgrade"})


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A request head the fast path may serve (see :func:`parse_plain_request_head`)."""

    method: bytes
    path: str
    query: bytes
    # Names lowercased, values with surrounding whitespace removed, in the order sent.
    headers: tuple[tuple[bytes, bytes], ...]
    content_length: int
    # False when the client asked to close after this request (``Connection: close``).
    keep_alive: bool


def end_of_head(buffer: bytes | bytearray) -> int:
    """The offset just after the blank line that ends a request head, or -1 before it has
    come. Only CRLF line ends: a bare-LF head is not plain, and -1 here (once
    :func:`head_has_ended`) hands it to the server of record, which reads it as it always
    has."""
    end = buffer.find(b"\r\n\r\n")
    return -1 if end < 0 else end + 4


def may_start_request(buffer: bytes | bytearray) -> bool:
    """Whether ``buffer`` can still be the start of a plain request: a method (so far) of
    token characters, then a space. Anything else (a TLS ClientHello, a stray blank line,
    binary) never becomes a request the fast path serves, so it is the server of record's to
    answer at once (h11 refuses most such first bytes with a 400 on sight), not something to
    wait a keep-alive timeout for."""
    method, space, _ = bytes(buffer[: _MAX_METHOD_BYTES + 1]).partition(b" ")
    if not space:
        return len(method) <= _MAX_METHOD_BYTES and (not method or bool(TOKEN.fullmatch(method)))
    return TOKEN.fullmatch(method) is not None


def head_is_over_bound(buffer: bytes | bytearray) -> bool:
    """Whether ``buffer``, with no end of head in it, is over the bound on a head: the server
    of record's to refuse (431) at once."""
    return len(buffer) > MAX_REQUEST_HEAD_BYTES


def head_has_ended(buffer: bytes | bytearray) -> bool:
    """Whether a blank line has come, with any line ends (CRLF, bare LF, or a mix): the head
    is whole, as :func:`end_of_head` reads it or as the server of record does."""
    return b"\n\n" in buffer or b"\n\r\n" in buffer


def parse_plain_request_head(head: bytes) -> RequestHead | None:
    """``head`` (up to and including its blank line) as a :class:`RequestHead`, or None when
    it is anything but the plain shape; None means "the server of record's", never
    "refused"."""
    lines = head[:-4].split(b"\r\n")
    request_line = lines[0].split(b" ")
    if len(request_line) != 3 or request_line[2] != b"HTTP/1.1":
        return None
    method, target, _ = request_line
    if not TOKEN.fullmatch(method) or not _ORIGIN_FORM.fullmatch(target):
        return None
    raw_path, _, query = target.partition(b"?")
    headers: list[tuple[bytes, bytes]] = []
    content_length: int | None = None
    host = False
    keep_alive = True
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        # A name must be a token with no space before its colon (RFC 9112 5.1), which also
        # refuses obs-fold continuation lines (they begin with whitespace).
        if not colon or not TOKEN.fullmatch(name):
            return None
        value = value.strip(_WHITESPACE)
        if _BAD_VALUE.search(value):
            return None
        name = name.lower()
        if name in _NOT_PLAIN:
            return None
        if name == b"content-length":
            if content_length is not None or not DIGITS.fullmatch(value):
                return None
            content_length = int(value)
        elif name == b"host":
            if host:
                return None
            host = True
        elif name == b"connection":
            tokens = _connection_tokens(value)
            if b"upgrade" in tokens:
                return None
            if b"close" in tokens:
                keep_alive = False
        headers.append((name, value))
    if content_length is None or not host:
        return None
    return RequestHead(
        method, raw_path.decode("ascii"), query, tuple(headers), content_length, keep_alive
    )


# Headers that frame a message or manage its connection: decided by :func:`header_block`
# alone, whatever the answer or the relay says.
_HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})


def has_body(status: int) -> bool:
    """Whether a response with ``status`` has a body to frame (RFC 9110 6.4.1)."""
    return status >= 200 and status not in (204, 304)


def header_block(
    status: int,
    answer: Iterable[tuple[str, str]],
    relayed: Mapping[str, str] | None,
    *,
    length: int | None,
    closes: bool,
    server: Iterable[tuple[bytes, bytes]],
) -> list[tuple[bytes, bytes]]:
    """The header block of every response Sluice writes, on either server, made here alone.

    In order: the answer's own (its request id, trace and CORS headers), less those the relay
    sets itself; the relay's (its content type, a stream's no-buffering headers, what the
    upstream's answer carries on); the framing, decided here and nowhere else (a known
    ``length``, else chunked; none for a status that has no body); the server's own (date,
    server); ``connection: close`` when this answer is the connection's last; a chunked body's
    ``transfer-encoding``. Framing and connection headers from either source are dropped: only
    this function frames a response. The order is the one h11 sends the same list in (it moves
    the framing to the end), so both servers' heads are the same bytes; only a client's own
    ``Connection: close`` h11 moves after the framing too.
    """
    relay_names = {name.lower() for name in relayed} if relayed else frozenset()
    headers: list[tuple[bytes, bytes]] = []
    for name, value in answer:
        lower = name.lower()
        if lower not in _HOP_BY_HOP and lower not in relay_names:
            headers.append((lower.encode("latin-1"), value.encode("latin-1")))
    if relayed:
        for name, value in relayed.items():
            lower = name.lower()
            if lower not in _HOP_BY_HOP:
                headers.append((lower.encode("latin-1"), value.encode("latin-1")))
    framed = has_body(status)
    if framed and length is not None:
        headers.append((b"content-length", b"%d" % length))
    headers.extend(server)
    if closes:
        headers.append((b"connection", b"close"))
    if framed and length is None:
        # Spelled as h11 spells the header it sets itself.
        headers.append((b"Transfer-Encoding", b"chunked"))
    return headers


def _connection_tokens(value: bytes) -> set[bytes]:
    return {token.strip(_WHITESPACE).lower() for token in value.split(b",")}


def keeps_alive(headers: Iterable[tuple[bytes, bytes]], http_version: bytes) -> bool:
    """Whether a request lets the connection carry another after it, as h11 reads it: not
    when it says ``Connection: close``, nor below HTTP/1.1."""
    for name, value in headers:
        if name.lower() == b"connection" and b"close" in _connection_tokens(value):
            return False
    return http_version >= b"1.1"


def encode_response_head(
    status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """A response's status line and header block, ending in its blank line. Raises
    ValueError for a name that is not a token or a value that could end its line: values may
    come from an upstream's response, and must never split this one (as h11 refuses them)."""
    lines = [b"HTTP/1.1 %d %b" % (status, reason)]
    for name, value in headers:
        if not TOKEN.fullmatch(name) or _LINE_BREAKING.search(value):
            raise ValueError(f"invalid response header {name!r}: {value!r}")
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
