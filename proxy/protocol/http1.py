"""HTTP/1.1 as the upstream's client, sans-IO: a request's bytes out, a response's head and body in.

Why not h11 (under httpcore), which the relay used before? It is correct and general, and its
generality is paid per relayed event: each upstream chunk went through h11's event objects and
state machine and httpcore's generator and trace layers, ~10 us of pure Python per token before
the relay saw a byte, plus ~0.5 ms per request to write the request and read the head. The
relay needs one shape of exchange (a request, then one response read to its end, on a
connection it owns), so this module does just that, with ``bytes.find`` over buffers.

Strict where laxness is unsafe (message framing: chunk sizes, content lengths, transfer codings
are checked and anything ambiguous is an error, so a response can never bleed into the next
one on a kept connection), lenient where well-behaved servers differ (bare LF line ends).
Errors are :class:`ProtocolError`; the pool turns them into httpx's.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable

# Bounds, so a broken or hostile upstream cannot make the proxy buffer without limit.
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE_BYTES = 4096
MAX_TRAILER_BYTES = 16 * 1024

# A token (RFC 9110 5.6.2: a method, a header name) and a decimal length: the server side
# (http1_server.py) reads requests with the same two.
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
DIGITS = re.compile(rb"[0-9]{1,19}")
_STATUS = re.compile(rb"[1-9][0-9][0-9]")
# Control characters other than horizontal tab are never valid in a field value.
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_WHITESPACE = b" \t"


class ProtocolError(Exception):
    """The upstream's bytes are not a valid HTTP/1.1 response (or over a bound)."""


class LocalProtocolError(ValueError):
    """A request this proxy was about to send is malformed (a header with a line break...)."""


def encode_request(
    method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """A request's head and body as one buffer, so it goes out in one write. The caller gives
    every header, ``host`` and ``content-length`` included."""
    lines = [method + b" " + target + b" HTTP/1.1"]
    for name, value in headers:
        if not TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise LocalProtocolError(f"invalid request header {name!r}: {value!r}")
        lines.append(name + b": " + value)
    if not TOKEN.fullmatch(method) or b" " in target or _BAD_VALUE.search(target):
        raise LocalProtocolError(f"invalid request line {method!r} {target!r}")
    lines.append(b"")
    lines.append(body)
    return b"\r\n".join(lines)


class ResponseHead:
    """A final response's status line and headers (names lower-cased, in order)."""

    __slots__ = ("headers", "keep_alive", "reason", "status", "version")

    def __init__(
        self,
        version: bytes,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> None:
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = headers
        # The server may take another request on this connection once the body is read.
        self.keep_alive = keep_alive

    def values(self, name: bytes) -> list[bytes]:
        return [value for field, value in self.headers if field == name]


# Body framing, once the head is read.
_HEAD = 0
_LENGTH = 1  # content-length
_CHUNK_SIZE = 2  # chunked: at a chunk-size line
_CHUNK_DATA = 3  # chunked: inside a chunk
_CHUNK_END = 4  # chunked: at the CRLF after a chunk's data
_TRAILERS = 5  # chunked: after the last chunk, reading trailer lines
_UNTIL_CLOSE = 6  # no length given: the body ends when the server closes
_DONE = 7


class ResponseReader:
    """One response, fed the connection's bytes as they arrive.

    ``feed(data)`` returns the body bytes those bytes complete (transfer framing removed; maybe
    empty); :attr:`head` is set once the head is read (1xx interim responses are skipped) and
    :attr:`complete` once the body is. ``feed_eof()`` when the server closes.
    """

    __slots__ = ("_buffer", "_method", "_remaining", "_state", "_trailer_bytes", "complete", "head")

    def __init__(self, method: bytes = b"POST") -> None:
        self._method = method
        self._buffer = b""
        self._state = _HEAD
        self._remaining = 0
        self._trailer_bytes = 0
        self.head: ResponseHead | None = None
        self.complete = False

    @property
    def reusable(self) -> bool:
        """The connection can carry another request: the response was read to its end, nothing
        followed it, and the server did not ask to close."""
        return self.complete and not self._buffer and self.head is not None and self.head.keep_alive

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        if self._state == _HEAD:
            buffer = self._read_head(buffer)
            if self._state == _HEAD:
                return b""
        state = self._state
        if state == _LENGTH:
            if len(buffer) < self._remaining:
                self._remaining -= len(buffer)
                return buffer
            body, rest = buffer[: self._remaining], buffer[self._remaining :]
            self._finish(rest)
            return body
        if state == _UNTIL_CLOSE:
            return buffer
        if state == _DONE:
            self._buffer = buffer
            return b""
        return self._read_chunked(buffer)

    def feed_eof(self) -> None:
        """The server closed the connection: the end of a body without a length, else an
        error unless the response was complete."""
        if self._state == _UNTIL_CLOSE:
            self._finish(b"")
        elif not self.complete:
            where = "the response head" if self.head is None else "the response body"
            raise ProtocolError(f"the upstream closed the connection in the middle of {where}")

    def _finish(self, rest: bytes) -> None:
        self._state = _DONE
        self.complete = True
        # Bytes after the response: the connection is not reused (see reusable).
        self._buffer = rest

    def _read_head(self, buffer: bytes) -> bytes:
        while self._state == _HEAD:
            end, after = _end_of_head(buffer)
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError(f"response head over {MAX_HEAD_BYTES} bytes")
                self._buffer = buffer
                return b""
            if end > MAX_HEAD_BYTES:
                raise ProtocolError(f"response head over {MAX_HEAD_BYTES} bytes")
            head = _parse_head(buffer[:end])
            buffer = buffer[after:]
            if head.status < 200:
                if head.status == 101:
                    raise ProtocolError("the upstream switched protocols, which was not asked")
                continue  # 100 Continue, 103 Early Hints: the final response follows
            self.head = head
            self._frame(head)
        return buffer

    def _frame(self, head: ResponseHead) -> None:
        """How the body is delimited (RFC 9112 section 6.3)."""
        if self._method == b"HEAD" or head.status in (204, 304):
            self._finish(b"")
            return
        codings = [
            coding.strip(_WHITESPACE).lower()
            for value in head.values(b"transfer-encoding")
            for coding in value.split(b",")
        ]
        lengths = {
            length.strip(_WHITESPACE)
            for value in head.values(b"content-length")
            for length in value.split(b",")
        }
        if codings:
            if codings != [b"chunked"]:
                raise ProtocolError(f"unsupported transfer-encoding {b', '.join(codings)!r}")
            if lengths or head.version == b"1.0":
                # Both: a message smuggling risk; chunked wins and the connection must close.
                # HTTP/1.0 has no transfer codings: its framing is suspect, same verdict
                # (RFC 9112 section 6.1).
                head.keep_alive = False
            self._state = _CHUNK_SIZE
        elif lengths:
            (length,) = lengths if len(lengths) == 1 else (b"",)
            if not DIGITS.fullmatch(length):
                raise ProtocolError(f"invalid content-length {b', '.join(sorted(lengths))!r}")
            self._remaining = int(length)
            self._state = _LENGTH
            if not self._remaining:
                self._finish(b"")
        else:
            head.keep_alive = False
            self._state = _UNTIL_CLOSE

    def _read_chunked(self, buffer: bytes) -> bytes:
        if self._state == _CHUNK_SIZE:
            # A streaming upstream's usual read: exactly one whole chunk, "<hex>CRLF<data>CRLF"
            # (one event each), answered here without the state machine's rounds. Anything
            # else (extensions, bare LF, a split or a second chunk, the last chunk) falls
            # through to the general reader below, which judges it as before.
            line_end = buffer.find(b"\r\n", 0, 18)
            if line_end > 0 and _HEX.fullmatch(buffer, 0, line_end):
                data_end = line_end + 2 + int(buffer[:line_end], 16)
                if (
                    data_end > line_end + 2
                    and len(buffer) == data_end + 2
                    and buffer.endswith(b"\r\n")
                ):
                    return buffer[line_end + 2 : data_end]
        body: list[bytes] = []
        position = 0
        size = len(buffer)
        state = self._state
        while position < size:
            if state == _CHUNK_DATA:
                take = min(self._remaining, size - position)
                body.append(buffer[position : position + take])
                position += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _CHUNK_END
            elif state == _CHUNK_END:
                if buffer.startswith(b"\r\n", position):
                    position += 2
                elif buffer.startswith(b"\n", position):
                    position += 1
                elif size - position == 1 and buffer[position] == 13:  # a CR, its LF to come
                    break
                else:
                    raise ProtocolError("a chunk's data is not followed by CRLF")
                state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                end = buffer.find(b"\n", position)
                if end < 0:
                    if size - position > MAX_CHUNK_LINE_BYTES:
                        raise ProtocolError(f"chunk-size line over {MAX_CHUNK_LINE_BYTES} bytes")
                    break
                if end - position > MAX_CHUNK_LINE_BYTES:
                    raise ProtocolError(f"chunk-size line over {MAX_CHUNK_LINE_BYTES} bytes")
                line = buffer[position:end]
                position = end + 1
                # Chunk extensions (";name=value") carry nothing the relay uses.
                digits = line.split(b";", 1)[0].strip(b" \t\r")
                if not _HEX.fullmatch(digits):
                    raise ProtocolError(f"invalid chunk size {line[:40]!r}")
                self._remaining = int(digits, 16)
                state = _CHUNK_DATA if self._remaining else _TRAILERS
            elif state == _TRAILERS:
                end = buffer.find(b"\n", position)
                if end < 0:
                    if self._trailer_bytes + size - position > MAX_TRAILER_BYTES:
                        raise ProtocolError(f"trailers over {MAX_TRAILER_BYTES} bytes")
                    break
                line = buffer[position:end]
                position = end + 1
                self._trailer_bytes += len(line) + 1
                if self._trailer_bytes > MAX_TRAILER_BYTES:
                    raise ProtocolError(f"trailers over {MAX_TRAILER_BYTES} bytes")
                if line in (b"", b"\r"):
                    # Trailer fields are read past, not used.
                    self._finish(buffer[position:])
                    return b"".join(body)
            else:  # pragma: no cover - _DONE and the others never reach here
                raise AssertionError(state)
        self._state = state
        if position < size:
            self._buffer = buffer[position:]
        if len(body) == 1:
            return body[0]
        return b"".join(body)


def _end_of_head(buffer: bytes) -> tuple[int, int]:
    """Where the head ends (at the newline before its blank line) and the body begins;
    (-1, -1) if the blank line has not arrived. Bare LF line ends are accepted."""
    crlf = buffer.find(b"\n\r\n")
    # A bare-LF blank line counts if it starts before the first CRLF one ends: the "\n\r\n"
    # found may begin with the second LF of a "\n\n" (a body that starts with CRLF).
    lf = buffer.find(b"\n\n", 0, crlf + 2 if crlf >= 0 else len(buffer))
    if lf >= 0:
        return lf, lf + 2
    if crlf >= 0:
        return crlf, crlf + 3
    return -1, -1


def _parse_head(data: bytes) -> ResponseHead:
    lines = data.split(b"\n")
    status_line = lines[0].rstrip(b"\r")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProtocolError(f"invalid status line {status_line[:80]!r}")
    if not _STATUS.fullmatch(parts[1]):
        raise ProtocolError(f"invalid status code in {status_line[:80]!r}")
    version = parts[0][5:]
    headers: list[tuple[bytes, bytes]] = []
    connection_tokens: set[bytes] = set()
    for raw_line in lines[1:]:
        line = raw_line.rstrip(b"\r")
        if line[:1] in (b" ", b"\t"):
            raise ProtocolError("obsolete line folding in a response header")
        name, colon, value = line.partition(b":")
        if not colon or not TOKEN.fullmatch(name):
            raise ProtocolError(f"invalid response header line {line[:80]!r}")
        value = value.strip(_WHITESPACE)
        if _BAD_VALUE.search(value):
            raise ProtocolError(f"invalid characters in response header {name!r}")
        name = name.lower()
        if name == b"connection":
            connection_tokens.update(
                token.strip(_WHITESPACE).lower() for token in value.split(b",")
            )
        headers.append((name, value))
    keep_alive = (
        b"close" not in connection_tokens
        if version == b"1.1"
        else b"keep-alive" in connection_tokens and b"close" not in connection_tokens
    )
    reason = parts[2] if len(parts) > 2 else b""
    return ResponseHead(version, int(parts[1]), reason, headers, keep_alive)


def request_framing_error(
    headers: Iterable[tuple[bytes, bytes]], http_version: bytes
) -> str | None:
    """Why a client's request must be refused for its framing, or None.

    RFC 9112 section 6.1: a request with both ``Transfer-Encoding`` and ``Content-Length`` may
    be an attempt at request smuggling (a front proxy that frames by Content-Length sees a
    different request boundary), and the connection must be closed after answering it.
    Section 6.1 also leaves chunked framing to HTTP/1.1: an HTTP/1.0 peer cannot send it."""
    content_length = transfer_encoding = False
    for name, _ in headers:
        lowered = name.lower()
        if lowered == b"content-length":
            content_length = True
        elif lowered == b"transfer-encoding":
            transfer_encoding = True
    if transfer_encoding and content_length:
        return "a request may not have both Content-Length and Transfer-Encoding"
    if transfer_encoding and http_version == b"1.0":
        return "HTTP/1.0 requests may not use Transfer-Encoding"
    return None


class ContentDecoder:
    """Undoes a response's gzip or deflate Content-Encoding as its chunks arrive (a server that
    ignored ``Accept-Encoding: identity``), never producing more than ``limit`` bytes in all
    nor more than ``chunk_limit`` from one chunk: a small compressed body must not become an
    unbounded one here."""

    def __init__(self, encoding: str, limit: int, chunk_limit: int | None = None) -> None:
        # 16 + MAX_WBITS: a gzip header; MAX_WBITS: zlib-wrapped deflate, as servers send it.
        wbits = 16 + zlib.MAX_WBITS if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._decoder = zlib.decompressobj(wbits)
        self._room = limit
        self._chunk_limit = limit if chunk_limit is None else chunk_limit

    def feed(self, data: bytes) -> bytes:
        most = min(self._room, self._chunk_limit)
        try:
            out = self._decoder.decompress(data, most + 1)
        except zlib.error as error:
            raise ProtocolError(f"undecodable body: {error}") from None
        if len(out) > most or self._decoder.unconsumed_tail:
            raise ProtocolError("the decoded body exceeds this proxy's limit")
        self._room -= len(out)
        return out


# What ContentDecoder undoes; any other encoding is passed on as it came, or refused in a stream.
DECODABLE_ENCODINGS = frozenset({"gzip", "x-gzip", "deflate"})
