"""The fake's side of the wire: a hand-written HTTP/1.1 server side on raw trio sockets (one
request read from a connection, the response heads, the OpenAI- and Anthropic-shaped error
bodies), and the framing of a streamed answer (SSE events, each one HTTP chunk), precomputed so
that a token costs one lookup.

Why not ``proxy/protocol/http1.py``, the proxy's own codec (which the bench's client uses): speed.
The fake shares the machine with the proxy under test in every benchmark, so every microsecond
it spends is one the proxy does not get, and it must feed ~1000 concurrent streams at 20 ms per
token from one core. Hand-written, with every byte of a stream but the tokens decided before the
first and each token one precomputed ``bytes`` object (written by ``clock.Ticker``), it measured
about 14 us of CPU per token at 1000 streams, connection setup included. It parses only what a
client of a vLLM server sends (a ``Content-Length`` body, no chunked requests) and refuses the
rest with a status, as a strict server does.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final, Protocol

import trio

from proxy.testing.fake_upstream.content import TOKEN_JSON

MAX_HEADER_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 8 * 1024 * 1024
# Bytes a client may pipeline behind a request in progress before the fake stops reading
# (and so stops noticing a disconnect): bounded like everything else.
MAX_PIPELINED_BYTES: Final = MAX_HEADER_BYTES + MAX_BODY_BYTES
RECEIVE_SIZE: Final = 64 * 1024


class HTTPError(Exception):
    """A request the fake refuses to parse; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class End(enum.Enum):
    """How a connection continues after a response."""

    KEEP = "keep"
    CLOSE = "close"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    # The request line carried a whole URL, as a client sends it to a proxy.
    absolute: bool

    @property
    def chunked(self) -> bool:
        return self.version == "HTTP/1.1"


def _parse_head(head: bytes) -> tuple[str, str, str, str, dict[str, str], bool]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise HTTPError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if version.startswith("HTTP/"):
            raise HTTPError(505, f"unsupported version {version}")
        raise HTTPError(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        # Whitespace before the colon or a folded line is how request smuggling starts.
        if not sep or not name or name != name.strip() or " " in name or "\t" in name:
            raise HTTPError(400, "malformed header line")
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    absolute = target[0] != "/" and "://" in target
    if absolute:
        target = _origin_form(target)
    path, _, query = target.partition("?")
    return method, path, query, version, headers, absolute


def _origin_form(target: str) -> str:
    """The path and query of an absolute-form target (RFC 9112 §3.2.2)."""
    scheme, _, rest = target.partition("://")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    if scheme.lower() not in ("http", "https") or cut == 0:
        raise HTTPError(400, "malformed absolute-form request target")
    origin = rest[cut:]
    return origin if origin.startswith("/") else "/" + origin


def _content_length(method: str, headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise HTTPError(411, "request bodies must have a Content-Length")
    raw = headers.get("content-length")
    if raw is None:
        if method in ("POST", "PUT", "PATCH"):
            raise HTTPError(411, "request bodies must have a Content-Length")
        return 0
    values = {v.strip() for v in raw.split(",")}
    if len(values) != 1:
        raise HTTPError(400, "conflicting Content-Length")
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise HTTPError(400, "invalid Content-Length")
    length = int(value)
    if length > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return length


def _common_name(cert: Mapping[str, Any] | None) -> str | None:
    """The subject CN of a certificate as ``getpeercert()`` decodes it."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


class Connection:
    """One accepted socket and the bytes read from it but not consumed yet."""

    __slots__ = ("buf", "client_cert_cn", "fd", "id", "stream", "tcp", "tls", "tunnel")

    def __init__(self, tcp: trio.SocketStream, conn_id: int) -> None:
        # Socket options (SO_SNDBUF, SO_LINGER) go on `tcp`; HTTP goes through `stream`.
        self.tcp = tcp
        self.stream: trio.abc.Stream = tcp
        # Where the ticker writes tokens itself; -1 once TLS stands between.
        self.fd = tcp.socket.fileno()
        self.id = conn_id
        self.buf = bytearray()
        self.tls = False
        self.client_cert_cn: str | None = None
        self.tunnel: str | None = None

    def secured(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        """From now on HTTP goes through this TLS stream over ``tcp``."""
        self.stream = stream
        self.fd = -1
        self.tls = True
        self.client_cert_cn = _common_name(stream.getpeercert())

    async def receive_more(self) -> bool:
        data = await self.stream.receive_some(RECEIVE_SIZE)
        self.buf += data
        return bool(data)

    async def read_request(self) -> Request | None:
        """The next request, or None if the client closed the connection first."""
        buf = self.buf
        searched = 0
        while True:
            # Robustness (RFC 9112 §2.2): ignore empty lines before a request line.
            while buf.startswith(b"\r\n"):
                del buf[:2]
            end = buf.find(b"\r\n\r\n", searched)
            if end >= 0:
                break
            if len(buf) > MAX_HEADER_BYTES:
                raise HTTPError(431, f"request head over {MAX_HEADER_BYTES} bytes")
            searched = max(0, len(buf) - 3)
            if not await self.receive_more():
                return None
        if end > MAX_HEADER_BYTES:
            raise HTTPError(431, f"request head over {MAX_HEADER_BYTES} bytes")
        method, path, query, version, headers, absolute = _parse_head(bytes(buf[:end]))
        length = _content_length(method, headers)
        body_end = end + 4 + length
        while len(buf) < body_end:
            if not await self.receive_more():
                return None
        body = bytes(buf[end + 4 : body_end])
        del buf[:body_end]
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        # HTTP/1.0 keep-alive is an opt-in extension that no client here needs.
        keep_alive = version == "HTTP/1.1" and "close" not in tokens
        return Request(method, path, query, version, headers, body, keep_alive, absolute)


async def until_client_leaves(conn: Connection) -> None:
    """Return once the client closes its side (what it sends meanwhile, up to a pipelining
    bound, stays in ``conn.buf`` for the next read); past the bound, wait to be cancelled."""
    try:
        while len(conn.buf) <= MAX_PIPELINED_BYTES:
            if not await conn.receive_more():
                return
        await trio.sleep_forever()
    except trio.BrokenResourceError:
        pass


# --------------------------------------------------------------------------- responses


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _error_type(status: int) -> str:
    named = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        409: "ConflictError",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }
    if status in named:
        return named[status]
    return "InternalServerError" if status >= 500 else "BadRequestError"


def error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": _error_type(status), "code": status}
    return json.dumps({"error": error}).encode()


def http_response(
    status: int,
    body: bytes,
    *,
    keep_alive: bool,
    content_type: str | None = "application/json",
    content_length: int | None = None,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_reason(status)}",
        "server: sluice-fake-upstream",
        f"content-length: {len(body) if content_length is None else content_length}",
    ]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines.append("connection: keep-alive" if keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(status: int, obj: object, *, keep_alive: bool) -> bytes:
    return http_response(status, json.dumps(obj).encode(), keep_alive=keep_alive)


def error_response(status: int, message: str, *, keep_alive: bool) -> bytes:
    return http_response(status, error_body(status, message), keep_alive=keep_alive)


_ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error shape, which vLLM's /v1/messages answers in too."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def stream_head(request: Request) -> bytes:
    lines = [
        "HTTP/1.1 200 OK",
        "server: sluice-fake-upstream",
        "content-type: text/event-stream; charset=utf-8",
        "cache-control: no-cache",
    ]
    if request.chunked:
        lines.append("transfer-encoding: chunked")
    lines.append("connection: keep-alive" if request.keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# --------------------------------------------------------------------------- streams


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def compact_json(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def sse_event(kind: str, obj: object) -> bytes:
    """One typed server-sent event, as vLLM writes the Responses and Messages streams."""
    return f"event: {kind}\ndata: {compact_json(obj)}\n\n".encode()


class Frames:
    """Every byte of one stream but the tokens' own, decided before the first is sent.

    ``head`` goes with the response head, ``extra[i]`` right before token ``i`` (``extra[n]``
    before the tail), ``tail`` after the last token. Each SSE event is one HTTP chunk.
    """

    __slots__ = ("extra", "frame", "head", "tail")

    def __init__(self, *, chunked: bool) -> None:
        self.frame: Callable[[bytes], bytes] = _chunk if chunked else bytes
        self.extra: dict[int, bytes] = {}
        self.head = b""
        self.tail = b""

    def _framed(self, events: Sequence[bytes]) -> bytes:
        return b"".join(self.frame(e) for e in events)

    def _set_tail(self, events: Sequence[bytes]) -> None:
        tail = self._framed(events)
        if self.frame is _chunk:
            tail += b"0\r\n\r\n"
        self.tail = tail

    def insert_before(self, i: int, frame: bytes) -> None:
        self.extra[i] = frame + self.extra.get(i, b"")

    def before(self, i: int) -> bytes:
        return self.extra.get(i, b"")

    def token(self, i: int) -> bytes:
        """Token ``i`` with whatever must precede it."""
        raise NotImplementedError


class EventFrames(Frames):
    """A stream whose token ``i`` is ``before + <its text as JSON> + after``, or, numbered,
    ``before + text + middle + <first + i> + after`` (a Responses ``sequence_number``)."""

    __slots__ = ("_after", "_before", "_cycle", "_first", "_middle")

    def __init__(
        self,
        *,
        chunked: bool,
        head: Sequence[bytes],
        first: Sequence[bytes],
        before: bytes,
        after: bytes,
        tail: Sequence[bytes],
        numbered: tuple[bytes, int] | None = None,
    ) -> None:
        super().__init__(chunked=chunked)
        self.head = self._framed(head)
        if first:
            self.extra[0] = self._framed(first)
        self._set_tail(tail)
        self._before, self._after = before, after
        self._middle, self._first = numbered if numbered is not None else (b"", -1)
        self._cycle = (
            ()
            if numbered is not None
            else tuple(self.frame(before + word + after) for word in TOKEN_JSON)
        )

    def token(self, i: int) -> bytes:
        if self._cycle:
            data = self._cycle[i % len(self._cycle)]
        else:
            word = TOKEN_JSON[i % len(TOKEN_JSON)]
            seq = b"%d" % (self._first + i)
            data = self.frame(self._before + word + self._middle + seq + self._after)
        extra = self.extra.get(i)
        return data if extra is None else extra + data


class Answer(Protocol):
    """What a model endpoint will answer, decided before any byte is sent: what the wire needs
    of an answer (``answers`` has one per endpoint) to send it whole or as a stream."""

    @property
    def stream(self) -> bool: ...

    @property
    def tokens(self) -> int: ...

    def whole_body(self) -> bytes: ...

    def frames(self, *, chunked: bool) -> Frames: ...
