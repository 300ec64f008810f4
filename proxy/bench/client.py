"""The load-generating client: one streaming chat request per connection on a raw trio socket,
its response read with ``protocol/http1.py`` (the proxy's own HTTP/1.1 codec) and its SSE events
counted with ``bytes.find``, no JSON decoded per token; and a plain GET for the fake's records
and the metrics.

It shares the machine with the relay it measures, so what it costs per event is what it adds
to every figure: no per-byte Python loops, one pass of ``bytes.find`` over each read."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

import trio

from proxy.bench.settings import Role
from proxy.protocol import http1

RECV_SIZE: Final = 64 * 1024
_DONE: Final = b"data: [DONE]"
_ERROR: Final = b'data: {"error"'
# A chat delta with text. The role chunk carries ``"content":""`` and is not a token; the byte
# after this marker tells them apart (34 is a double quote).
_CONTENT: Final = b'"content":"'
_QUOTE: Final = 34


class ProtocolError(http1.ProtocolError, ValueError):
    """The server's bytes are not an HTTP/1.1 response (as ``protocol/http1.py`` reads them).
    A ValueError too: callers of :func:`http_get` (the matrix) catch it as one."""


class EventCounter:
    """Count server-sent events in a payload stream without decoding them.

    ``events``: ``data:`` events of any kind; ``content``: those that carry a chat token (not
    the role chunk, the finish chunk, usage or ``[DONE]``); ``done``: ``data: [DONE]`` seen;
    ``errors``: in-band ``data: {"error"...}`` events. Events are delimited by a blank line
    (LF LF), which is how vLLM, the fake and the proxy frame them.
    """

    __slots__ = ("_buffer", "content", "done", "errors", "events")

    def __init__(self) -> None:
        self._buffer = b""
        self.events = 0
        self.content = 0
        self.errors = 0
        self.done = False

    def feed(self, data: bytes) -> int:
        """Return how many token events this data completed."""
        buffer = self._buffer + data if self._buffer else data
        start = 0
        new = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            if buffer.startswith(b"data:", start):
                self.events += 1
                mark = buffer.find(_CONTENT, start, end)
                if mark >= 0 and buffer[mark + len(_CONTENT)] != _QUOTE:
                    new += 1
                elif buffer.startswith(_DONE, start):
                    self.done = True
                elif buffer.startswith(_ERROR, start):
                    self.errors += 1
            start = end + 2
        self._buffer = buffer[start:] if start else buffer
        self.content += new
        return new


class ResponseParser:
    """One HTTP/1.1 response as the relay's client reads it: ``protocol/http1.py``'s
    :class:`~proxy.protocol.http1.ResponseReader` frames it (status line and headers, then a
    chunked, sized or close-delimited body), and the body goes to an :class:`EventCounter`
    (or, with ``collect``, into ``body``). The bench has no HTTP/1.1 codec of its own."""

    __slots__ = ("_collect", "_reader", "body", "complete", "events", "status")

    def __init__(self, *, collect: bool = False, method: bytes = b"POST") -> None:
        self.status: int | None = None
        self.complete = False  # the body ended as its framing said (not cut short)
        self.events = EventCounter()
        self.body = bytearray()
        self._collect = collect
        self._reader = http1.ResponseReader(method)

    def feed(self, data: bytes) -> int:
        """Return how many token events this data completed."""
        reader = self._reader
        try:
            payload = reader.feed(data)
        except http1.ProtocolError as error:
            raise ProtocolError(str(error)) from error
        if self.status is None and reader.head is not None:
            self.status = reader.head.status
        self.complete = reader.complete
        if not payload:
            return 0
        if self._collect:
            self.body += payload
            return 0
        return self.events.feed(payload)

    def feed_eof(self) -> None:
        """The server closed: that ends a body without framing, and nothing else (a response
        cut short stays incomplete, which is what the stream's result reports)."""
        with contextlib.suppress(http1.ProtocolError):
            self._reader.feed_eof()
        self.complete = self._reader.complete


def build_request(
    host: str, port: int, path: str, body: bytes, extra: Iterable[tuple[str, str]] = ()
) -> bytes:
    """A streaming POST of ``body`` to ``path``, one per connection (``Connection: close``);
    ``extra``: headers the system under test needs (a gateway's key, its routing headers)."""
    headers = [
        (b"Host", f"{host}:{port}".encode("latin-1")),
        (b"Content-Type", b"application/json"),
        (b"Accept", b"text/event-stream"),
        (b"Content-Length", b"%d" % len(body)),
        (b"Connection", b"close"),
        *((name.encode("latin-1"), value.encode("latin-1")) for name, value in extra),
    ]
    return http1.encode_request(b"POST", path.encode("latin-1"), headers, body)


def chat_body(model: str, tag: str, ttft: float, interval: float, tokens: int) -> bytes:
    """A streaming chat request; ``fake`` pins the fake's schedule whatever it was started
    with, and ``user`` is the tag that matches the request with the fake's record. The tag is
    in the message too, for a relay that rewrites the body to its own fields (sglang-router
    drops ``user`` and ``fake``: the fake then keeps the schedule it was started with)."""
    body = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": f"Tell me about foxes. ({tag})"}],
        "user": tag,
        "fake": {"ttft": ttft, "interval": interval, "tokens": tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(slots=True)
class StreamResult:
    """What one client saw; times are ``time.monotonic()``."""

    index: int
    tag: str
    role: Role
    started: float | None = None  # before connect()
    connected: float | None = None
    sent: float | None = None  # request written
    first_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    closed_at: float | None = None  # a dropping client's close()
    status: int | None = None
    events: int = 0
    content: int = 0
    done: bool = False
    complete: bool = False
    error_events: int = 0
    error: str | None = None  # a socket or protocol failure
    ended: bool = False  # False: still running when the run's deadline hit
    ended_at: float | None = None  # the socket closed, for whatever reason


def classify(result: StreamResult) -> str | None:
    """Why this stream counts as an error, or None when it behaved as planned."""
    if result.error is not None:
        return result.error
    if not result.ended:
        return "timeout"
    if result.status != 200:
        return f"HTTP {result.status}" if result.status is not None else "no response"
    if result.error_events:
        return "in-band error event"
    if result.role == "drop":
        return None if result.closed_at is not None else "ended before its drop point"
    if not result.done:
        return "truncated (no [DONE])"
    return None


@dataclass
class _Progress:
    started: int = 0
    finished: int = 0
    failed: int = 0


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def run_stream(
    address: tuple[str, int],
    request: bytes,
    result: StreamResult,
    *,
    start_at: float,
    drop_at: int,
    slow_delay: float,
    slow_rcvbuf: int = 0,
    slow_mss: int = 0,
    progress: _Progress | None = None,
) -> None:
    """Run one client at ``start_at`` (trio clock), filling ``result`` as it goes.

    Never raises for what the server did: a refused connection or a garbled response is the
    result's ``error``; only cancellation leaves (with ``ended`` False).

    A slow reader's ``slow_rcvbuf`` (SO_RCVBUF) and ``slow_mss`` (TCP_MAXSEG) are set before
    connect, where they shape the connection: a small receive window fills after a few events,
    and an MSS like a real network's keeps the proxy's send buffer at the size it would have
    there (on loopback's 64 KiB MSS the kernel grows it to ~4 MiB, which absorbs a whole
    stream before the proxy ever sees a full socket).
    """
    await trio.sleep_until(start_at)
    if progress is not None:
        progress.started += 1
    parser = ResponseParser()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # The request is one small write; without NODELAY it could wait for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if result.role == "slow":
            if slow_rcvbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, slow_rcvbuf)
            if slow_mss:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, slow_mss)
        result.started = time.monotonic()
        await sock.connect(address)
        result.connected = time.monotonic()
        await _send_all(sock, request)
        result.sent = last = time.monotonic()
        gaps = result.gaps
        dropping = result.role == "drop"
        slow = result.role == "slow"
        while True:
            data = await sock.recv(RECV_SIZE)
            now = time.monotonic()
            if not data:
                parser.feed_eof()
                break
            new = parser.feed(data)
            if new:
                if result.first_token is None:
                    result.first_token = now
                    new -= 1
                elif not slow:
                    # Tokens that arrive in one read arrived together: one real gap, then 0s.
                    gaps.append(now - last)
                    new -= 1
                if new and not slow:
                    gaps.extend([0.0] * new)
                last = now
            if parser.complete:
                break
            if dropping and parser.events.content >= drop_at:
                result.closed_at = time.monotonic()
                sock.close()
                break
            if slow and result.first_token is not None:
                # Slow from the first token on: its TTFT must not include its own sleep.
                await trio.sleep(slow_delay)
        result.ended = True
    except OSError as exc:
        # Refused, reset, or any other socket failure: part of what is measured.
        result.error = f"socket: {type(exc).__name__}"
        result.ended = True
    except ProtocolError as exc:
        result.error = f"protocol: {exc}"
        result.ended = True
    finally:
        sock.close()
        result.ended_at = time.monotonic()
        result.status = parser.status
        counter = parser.events
        result.events, result.content = counter.events, counter.content
        result.done, result.error_events = counter.done, counter.errors
        result.complete = parser.complete
        if progress is not None:
            progress.finished += 1
            if classify(result) is not None:
                progress.failed += 1


async def http_get(address: tuple[str, int], path: str) -> tuple[int, bytes]:
    """A GET with ``Connection: close``; raise OSError or ProtocolError on failure."""
    host, port = address
    headers = [(b"Host", f"{host}:{port}".encode("latin-1")), (b"Connection", b"close")]
    request = http1.encode_request(b"GET", path.encode("latin-1"), headers, b"")
    parser = ResponseParser(collect=True, method=b"GET")
    with trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        await sock.connect(address)
        await _send_all(sock, request)
        while not parser.complete:
            data = await sock.recv(RECV_SIZE)
            if not data:
                parser.feed_eof()
                break
            parser.feed(data)
    if parser.status is None or not parser.complete:
        raise ProtocolError(f"incomplete response to GET {path}")
    return parser.status, bytes(parser.body)
