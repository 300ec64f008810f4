"""HTTP/1.1 as the server of the hot routes, sans-IO: which request heads the fast path may
serve itself, and the bytes of its responses' heads.

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
from collections.abc import Iterable
from dataclasses import dataclass

# The HTTP server's own bound on a request head (h11_max_incomplete_size): a head still
# unfinished at this size is handed to that server, which answers it as it always has.
MAX_REQUEST_HEAD_BYTES = 16 * 1024

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DIGITS = re.compile(rb"[0-9]{1,19}")
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
    if not _TOKEN.fullmatch(method) or not _ORIGIN_FORM.fullmatch(target):
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
        if not colon or not _TOKEN.fullmatch(name):
            return None
        value = value.strip(_WHITESPACE)
        if _BAD_VALUE.search(value):
            return None
        name = name.lower()
        if name in _NOT_PLAIN:
            return None
        if name == b"content-length":
            if content_length is not None or not _DIGITS.fullmatch(value):
                return None
            content_length = int(value)
        elif name == b"host":
            if host:
                return None
            host = True
        elif name == b"connection":
            tokens = {token.strip(_WHITESPACE).lower() for token in value.split(b",")}
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


def encode_response_head(
    status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """A response's status line and header block, ending in its blank line. Raises
    ValueError for a name that is not a token or a value that could end its line: values may
    come from an upstream's response, and must never split this one (as h11 refuses them)."""
    lines = [b"HTTP/1.1 %d %b" % (status, reason)]
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or _LINE_BREAKING.search(value):
            raise ValueError(f"invalid response header {name!r}: {value!r}")
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)
