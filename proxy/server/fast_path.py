"""The hot routes served on the connection's own task, without hypercorn's and Quart's per-request
machinery; everything else still goes to them.

A short request through hypercorn and Quart costs a handful of tasks (the connection's, its read
loop and keep-alive timer, the request's message and handler tasks), h11's event objects, an
ASGI scope, Quart's request and app contexts and its hooks, before the pipeline does anything:
measured, about half of the CPU of a 3-token request (docs/benchmarks.md, "Per-request cost").

:class:`FastPathServer` is the connection server hypercorn runs for every accepted connection.
While the requests on the connection are plain (``protocol/http1_server.py``: HTTP/1.1, one
Content-Length, nothing to interpret) and go to a hot route (the api layer's :class:`HotRoutes`:
the completion endpoints), it reads them, hands them to the routes (which run the same hooks,
pipeline and error shapes as the Quart routes do) and writes the answers itself. At the first
request that is not, before a byte of its answer is written, it hands the connection, with every
byte read so far, to hypercorn (``super().run()``), which serves the rest of the connection as it
serves any other. So a client never sees which of the two answered, and every protection of
hypercorn and h11 still judges every request that is not plainly well-formed.

What hypercorn does per connection and this keeps:

* the keep-alive timer (``keep_alive_timeout``) between requests and before the first, running
  until a whole head has come, as hypercorn's does (so a slow head is closed at the same moment),
  and the end of idle connections when the server begins its graceful shutdown
  (:class:`ConnectionSet`);
* ``Connection: close`` when the client asks for it, at ``keep_alive_max_requests`` (counting the
  requests of both, across a hand-off), and during a graceful shutdown; its ``date`` and
  ``server`` headers;
* a request whose body is slow to arrive or whose head or body is too big is hypercorn's, which
  has the bounds and the answers for both;
* a client that leaves mid-answer: whichever hears it first, the loop's hangup watcher or a task
  waiting for the socket's EOF, runs the relay's disconnect hook and cancels the request, as
  hypercorn's read task and quart-trio's message task do;
* a client that stops reading: every write is bounded by the relay's stall limit, then the
  connection is reset.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from proxy.protocol.http1_server import (
    MAX_REQUEST_HEAD_BYTES,
    RequestHead,
    encode_response_head,
    end_of_head,
    head_has_ended,
    parse_plain_request_head,
)
from proxy.relay.body import ClientStalled, RelayBody
from proxy.server import adapters
from proxy.server.adapters.hypercorn_adapter import MAX_RECV, Event, H11Protocol, RawData
from proxy.server.chunk_writer import ChunkWriter
from proxy.server.connection_server import (
    ConnectionServer,
    ConnectionSet,
    reason_phrase,
    reset_socket,
)

log = logging.getLogger("sluice.fast_path")

# A request whose body has not all come this long after its head is handed to hypercorn, whose
# bounds and answers (Quart's 408 for a body too slow) then apply.
PROMPT_REQUEST_SECONDS = 1.0
_LAST_CHUNK = b"0\r\n\r\n"


class Headers:
    """A request's headers looked up by name, case-insensitively (the pipeline's HeaderLookup),
    the first of repeated ones as werkzeug's ``get`` gives."""

    __slots__ = ("_values",)

    def __init__(self, pairs: tuple[tuple[bytes, bytes], ...]) -> None:
        values: dict[str, str] = {}
        for name, value in pairs:
            values.setdefault(name.decode("ascii"), value.decode("ascii"))
        self._values = values

    def get(self, key: str, /) -> str | None:
        return self._values.get(key.lower())


@dataclass(slots=True)
class PlainRequest:
    """A request the fast path read whole."""

    head: RequestHead
    headers: Headers
    body: bytes
    client: str


@dataclass(slots=True)
class PlainResponse:
    """A hot route's answer: a known body, or a relay whose head is decided by its producer.
    ``headers`` are the ones the hooks add (the request id, CORS...); a relay's own follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes | RelayBody


class HotRoutes(Protocol):
    """What the api layer serves on the fast path (api/fast_routes.py)."""

    # Bodies over this many bytes are hypercorn's (Quart's 413, in the API's error shape).
    max_body_bytes: int

    def serves(self, method: bytes, path: str) -> bool: ...

    def respond(self, request: PlainRequest) -> PlainResponse: ...


def attach(hypercorn_config: Any, routes: HotRoutes | None) -> None:
    """Connections served under ``hypercorn_config`` serve ``routes`` on the fast path (None:
    hypercorn serves them all)."""
    hypercorn_config.sluice_hot_routes = routes


class FastPathServer(ConnectionServer):
    """hypercorn's connection server (through Sluice's), serving plain requests to the hot
    routes itself until the first that is not (see the module's docstring)."""

    # True while the fast path owns the connection: a write that ChunkWriter leaves to the
    # server (on a socket found closed or broken) then has no hypercorn protocol to go to.
    _serving_fast = False
    # Bytes read by the fast path that hypercorn is to read first, after a hand-off.
    _replay = b""
    # Requests the fast path served on the connection, towards keep_alive_max_requests
    # (after a hand-off, hypercorn goes on counting from there).
    _served = 0

    async def run(self) -> None:
        routes: HotRoutes | None = getattr(self.config, "sluice_hot_routes", None)
        connections = getattr(self.config, "sluice_connections", None)
        sock = getattr(self.stream, "socket", None)
        if routes is None or not isinstance(connections, ConnectionSet) or sock is None:
            await super().run()
            return
        self._serving_fast = True
        try:
            handed_off = await self._serve_plain(routes, connections, sock)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            handed_off = None
        finally:
            self._serving_fast = False
        if handed_off is None:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()
            return
        self._replay = handed_off
        await super().run()

    async def _read_data(self) -> None:
        if self._served and adapters.usable("request_count"):
            h11 = getattr(self.protocol, "protocol", None)
            if isinstance(h11, H11Protocol):
                h11.keep_alive_requests += self._served
        if self._replay:
            replay, self._replay = self._replay, b""
            await self.protocol.handle(RawData(replay))
        await super()._read_data()

    async def protocol_send(self, event: Event) -> None:
        if self._serving_fast:
            return  # the fast path finds a closed or broken connection itself
        await super().protocol_send(event)

    async def _serve_plain(
        self, routes: HotRoutes, connections: ConnectionSet, sock: Any
    ) -> bytes | None:
        """Serve plain requests to the hot routes; the bytes to hand to hypercorn at the first
        other request, or None once the connection is done (and to be closed)."""
        buffer = b""
        client = _peer_host(sock)
        while True:
            if not head_has_ended(buffer):
                buffer = await self._wait_for_head(sock, connections, buffer)
                if not buffer:
                    return None
            head, body, buffer = await self._read_request(sock, buffer, routes)
            if head is None:
                return buffer  # hypercorn's, with everything read of it
            self._served += 1
            keep_alive = (
                head.keep_alive
                and not connections.closing
                and self._served < self.config.keep_alive_max_requests
            )
            request = PlainRequest(head, Headers(head.headers), body, client)
            if not await self._answer(routes.respond(request), sock, keep_alive, connections):
                return None
            if not keep_alive or connections.closing:
                return None

    async def _wait_for_head(self, sock: Any, connections: ConnectionSet, buffer: bytes) -> bytes:
        """``buffer`` and what follows it up to a whole head at least, or to the bound of one
        (then hypercorn's to refuse), or to a close that cut one short (hypercorn's to answer).
        b"" when the client closes before a byte of it, the keep-alive timer runs out first, or
        a graceful shutdown begins: the timer stops only once a whole head has come, as
        hypercorn's does, so a slowloris head is closed when hypercorn would close it."""
        with trio.move_on_after(self.config.keep_alive_timeout) as idle:
            if not connections.add_idle(idle):
                return b""
            try:
                while not head_has_ended(buffer) and len(buffer) < MAX_REQUEST_HEAD_BYTES:
                    data: bytes = await sock.recv(MAX_RECV)
                    if not data:
                        break
                    buffer += data
            finally:
                connections.discard_idle(idle)
            return buffer
        return b""

    async def _read_request(
        self, sock: Any, buffer: bytes, routes: HotRoutes
    ) -> tuple[RequestHead | None, bytes, bytes]:
        """The request whose head ``buffer`` holds, read whole: its head, its body and the
        bytes after it. Or (None, b"", every byte read) when it is hypercorn's: a head too
        big, cut short or not in CRLF lines, not plain, not a hot route, or a body too big,
        slow to come or cut short."""
        end = end_of_head(buffer)
        if end < 0:
            return None, b"", buffer
        head = parse_plain_request_head(buffer[:end])
        if (
            head is None
            or head.content_length > routes.max_body_bytes
            or not routes.serves(head.method, head.path)
        ):
            return None, b"", buffer
        wanted = end + head.content_length
        with trio.move_on_after(PROMPT_REQUEST_SECONDS):
            while len(buffer) < wanted:
                data = await sock.recv(max(MAX_RECV, wanted - len(buffer)))
                if not data:
                    return None, b"", buffer
                buffer += data
            return head, buffer[end:wanted], buffer[wanted:]
        return None, b"", buffer

    async def _answer(
        self, response: PlainResponse, sock: Any, keep_alive: bool, connections: ConnectionSet
    ) -> bool:
        """Write ``response``; whether the connection may serve another request."""
        extra = self.config.response_headers("h11")
        if not keep_alive:
            extra.append((b"connection", b"close"))
        if isinstance(response.body, RelayBody):
            return await self._relay(response, response.body, sock, extra, connections)
        headers = [
            *response.headers,
            (b"content-length", str(len(response.body)).encode()),
            *extra,
        ]
        head = encode_response_head(response.status, reason_phrase(response.status), headers)
        writer = ChunkWriter(self, sock, _PLAIN_WRITE_SECONDS)
        try:
            await writer.write_raw(head + response.body)
        except ClientStalled:
            reset_socket(sock)
            return False
        return bool(sock.fileno() >= 0)

    async def _relay(
        self,
        response: PlainResponse,
        body: RelayBody,
        sock: Any,
        extra: list[tuple[bytes, bytes]],
        connections: ConnectionSet,
    ) -> bool:
        """Run the relay and write its answer, as asgi's RelayHTTPConnection does for
        hypercorn: the body is entered first (its producer decides the status), then the
        head goes out with the first chunk."""
        stall_timeout = body.stall_timeout
        disconnected: list[float] = []
        framed = True

        def head_bytes() -> bytes:
            nonlocal framed
            # Read now, not before: set_head gives the body a new headers dict.
            relayed = [
                (name.lower().encode(), value.encode()) for name, value in body.headers.items()
            ]
            names = {name for name, _ in relayed}
            framed = b"content-length" not in names
            headers = [pair for pair in response.headers if pair[0] not in names]
            headers += relayed
            if framed:
                headers.append((b"transfer-encoding", b"chunked"))
            headers += extra
            if connections.closing and (b"connection", b"close") not in extra:
                # A graceful shutdown began while the upstream was deciding the head: this
                # answer is the connection's last, and says so.
                headers.append((b"connection", b"close"))
            return encode_response_head(body.status, reason_phrase(body.status), headers)

        def start_stream() -> ChunkWriter | None:
            writer = ChunkWriter(self, sock, stall_timeout)
            writer._pending = head_bytes()
            return writer if framed else None

        with trio.CancelScope() as request_scope:

            def client_gone() -> None:
                disconnected.append(trio.current_time())
                body.client_disconnected()
                request_scope.cancel()

            body.disconnected_at = lambda: disconnected[0] if disconnected else None
            body.abort_connection = lambda: _reset_if_open(sock)
            body.start_stream = start_stream
            async with trio.open_nursery() as watchers:
                # Both ways of hearing the client go, as under hypercorn: the loop's hangup
                # watcher (between task steps, on a busy loop), and a task waiting for the
                # socket's EOF (hypercorn's read task's part: without a wait on the socket an
                # idle loop would not wake for the FIN, and the watcher polls on wake-ups).
                self.relay_started(client_gone)
                watchers.start_soon(_wait_for_eof, sock, self._client_gone)
                try:
                    await self._write_relay(body, sock, head_bytes, lambda: framed)
                except Exception as error:
                    # As hypercorn does for an app that fails mid-answer: logged, and the
                    # connection closed (an answer begun cannot be taken back).
                    log.exception("the relay failed: %s", body, exc_info=error)
                    _reset_if_open(sock)
                    return False
                finally:
                    self.relay_ended()
                    body.start_stream = None
                    watchers.cancel_scope.cancel()
        if request_scope.cancelled_caught or body.client_gone or body.stalled:
            return False
        return sock.fileno() >= 0 and (framed or body.complete)

    async def _write_relay(
        self,
        body: RelayBody,
        sock: Any,
        head_bytes: Callable[[], bytes],
        framed: Callable[[], bool],
    ) -> None:
        ended = False
        async with body:
            started = body.writer
            if isinstance(started, ChunkWriter):
                writer = started
            else:
                writer = ChunkWriter(self, sock, body.stall_timeout)
                writer._pending = head_bytes()
            # Inside the body: a stall raised out of it would reach the nursery's exit (and
            # come out as an exception group).
            try:
                if framed():
                    await body.write_through(writer)
                    ended = not body.client_gone and not body.stalled
                else:
                    async for chunk in body:
                        await writer.write_raw(chunk)
                    await writer.write_raw(b"")
            except ClientStalled:
                body.stall()
        if ended:
            # After the body has closed, as hypercorn writes it after the app returns: what
            # the request held (a key's concurrent-stream lease) is released before the client
            # can see its answer end, so its next request never finds it still held.
            try:
                await writer.write_raw(_LAST_CHUNK)
            except ClientStalled:
                body.stall()


# A known answer (an error, a refusal) is small: a client that takes none of it in this long is
# not reading, and its connection is reset.
_PLAIN_WRITE_SECONDS = 10.0


def _peer_host(sock: Any) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "-"
    return str(peer[0]) if isinstance(peer, tuple) else "-"


def _reset_if_open(sock: Any) -> None:
    if sock.fileno() >= 0:
        reset_socket(sock)


async def _wait_for_eof(sock: Any, on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` when the client's FIN or reset arrives (at most once: the hangup
    watcher's callback and this one both end in the relay's idempotent disconnect hook).
    Bytes that arrive first (a pipelined request) are left unread, and the watch ends there:
    what comes after them cannot be seen without reading them."""
    try:
        peeked = await sock.recv(1, socket.MSG_PEEK)
    except (OSError, trio.ClosedResourceError):
        peeked = b""
    if not peeked:
        on_gone()
