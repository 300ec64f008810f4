"""Plain requests to the app's responder, served on the connection's own task, without
hypercorn's and Quart's per-request machinery; everything else still goes to them.

A short request through hypercorn and Quart costs a handful of tasks (the connection's, its read
loop and keep-alive timer, the request's message and handler tasks), h11's event objects, an
ASGI scope, Quart's request and app contexts and its hooks, before the pipeline does anything:
measured, about half of the CPU of a 3-token request (docs/benchmarks.md, "Per-request cost").

:class:`FastPathServer` is the connection server hypercorn runs for every accepted connection.
While the requests on the connection are plain (``protocol/http1_server.py``: HTTP/1.1, one
Content-Length, nothing to interpret) and the responder serves them (``Responder.serves``: the
API's POST routes), it reads them, hands each to the same responder Quart's routes call, and
writes the answer with the same writer (``server/writer.py``), over a :class:`FastPathWire`. At
the first request that is not, before a byte of its answer is written, it hands the
connection, with every byte read so far and its one connection state, to hypercorn
(``super().run()``), which serves the rest of the connection as it serves any other. So a
client never sees which of the two answered, and every protection of hypercorn and h11 still
judges every request that is not plainly well-formed; bytes that cannot even start a request
(a TLS ClientHello on the plain port) are handed over at once, for h11's 400.

What hypercorn does per connection and this keeps, through the one
:class:`~proxy.protocol.connection_state.ConnectionState`:

* the wait for a request's head, bounded by the connection's head deadline
  (``keep_alive_timeout`` from the moment it waits, running until a whole head has come, as
  hypercorn's timer does, and carried over a hand-off: a slow head is closed at the same moment
  whoever reads it), and the end of idle connections when the server's drain begins;
* ``Connection: close`` when the client asks for it, at ``keep_alive_max_requests`` (counting the
  requests of both servers), and during a drain; the close RFC 9112 9.6 asks for after the last
  answer (our side first, then the client's input read and discarded, bounded);
* a request whose body is slow to arrive or whose head or body is too big is hypercorn's, which
  has the bounds and the answers for both;
* requests already waiting in the buffer are served one per scheduler turn: a burst of pipelined
  refusals does not hold the event loop;
* a client that leaves mid-answer: whichever hears it first, the loop's hangup watcher (or,
  without one, a task waiting for the socket's EOF), runs the relay's disconnect hook and
  cancels the writing, as hypercorn's read task and quart-trio's message task do;
* a client that stops reading: every write is bounded by the stall limit, then the connection is
  reset.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from proxy.protocol.http1_server import (
    RequestHead,
    encode_response_head,
    end_of_head,
    head_has_ended,
    head_is_over_bound,
    may_start_request,
    parse_plain_request_head,
)
from proxy.relay.body import DirectWriter
from proxy.server.adapters.hypercorn_adapter import MAX_RECV, Event, RawData
from proxy.server.call import Call, Responder
from proxy.server.chunk_writer import ChunkWriter
from proxy.server.connection_server import (
    ConnectionServer,
    client_socket,
    close_gracefully,
    reason_phrase,
    reset_socket,
)
from proxy.server.writer import write_answer

log = logging.getLogger("sluice.fast_path")

# A request whose body has not all come this long after its head is handed to hypercorn, whose
# bounds and answers (Quart's 408 for a body too slow) then apply.
PROMPT_REQUEST_SECONDS = 1.0
_LAST_CHUNK = b"0\r\n\r\n"
# How a connection the fast path served ends: its last answer written (then closed as RFC 9112
# 9.6 says), or nothing more to say on it (idle past its deadline, the client gone, a drain,
# an answer that could not be finished): closed at once.
_AFTER_LAST_ANSWER = "after last answer"
_AT_ONCE = "at once"


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


class FastPathServer(ConnectionServer):
    """hypercorn's connection server (through Sluice's), serving plain requests to the app's
    responder itself until the first that is not (see the module's docstring)."""

    # True while the fast path owns the connection: a write that ChunkWriter leaves to the
    # server (on a socket found closed or broken) then has no hypercorn protocol to go to.
    _serving_fast = False
    # Bytes read by the fast path that hypercorn is to read first, after a hand-off.
    _replay = b""

    async def run(self) -> None:
        responder = None if self.seam is None else self.seam.responder
        sock = client_socket(self)
        if responder is None or sock is None:
            await super().run()
            return
        self._serving_fast = True
        try:
            outcome = await self._serve_plain(responder, sock)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            outcome = _AT_ONCE
        finally:
            self._serving_fast = False
        if isinstance(outcome, bytes):
            self._replay = outcome
            await super().run()
        elif outcome is _AFTER_LAST_ANSWER:
            await close_gracefully(self.stream)
        else:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _read_data(self) -> None:
        if self._replay:
            replay, self._replay = self._replay, b""
            await self.protocol.handle(RawData(replay))
        await super()._read_data()

    async def protocol_send(self, event: Event) -> None:
        if self._serving_fast:
            return  # the fast path finds a closed or broken connection itself
        await super().protocol_send(event)

    async def _serve_plain(self, responder: Responder, sock: Any) -> bytes | str:
        """Serve plain requests to the responder; the bytes to hand to hypercorn at the first
        other request, or how to close the connection once it is done."""
        state = self.connection_state
        buffer = b""
        client = _peer_host(sock)
        while True:
            if not head_has_ended(buffer):
                read = await self._wait_for_head(sock, buffer)
                if read is None:
                    return _AT_ONCE
                buffer = read
            head, body, buffer = await self._read_request(sock, buffer, responder)
            if head is None:
                return buffer  # hypercorn's, with everything read of it
            state.request_received(head.keep_alive)
            headers = Headers(head.headers)
            call = Call(
                head.method.decode("ascii"),
                head.path,
                headers,
                client,
                body=body,
                request_id=headers.get("x-request-id"),
            )
            answer = await responder.respond(call)
            if not await write_answer(FastPathWire(self, sock), answer):
                return _AT_ONCE
            if state.last_answer:
                return _AFTER_LAST_ANSWER
            state.waiting(trio.current_time())
            if buffer:
                # The next request is here already, read in the same batch: every other task
                # has its turn before it is served (900 pipelined refusals in one write held
                # the loop for 147 ms when served in one step).
                await trio.lowlevel.checkpoint()

    async def _wait_for_head(self, sock: Any, buffer: bytes) -> bytes | None:
        """``buffer`` and what follows it, up to a whole head at least; or up to bytes that
        are the server of record's to judge at once (not the start of a request, or more than
        the bound of a head); or to a close that cut a head short (likewise). None when the
        client closes before a byte of it, the head deadline passes, or the drain begins."""
        assert self.seam is not None  # the fast path serves only with one
        connections = self.seam.connections
        with trio.move_on_at(self.connection_state.head_deadline) as waiting:
            if not connections.add_idle(waiting):
                return None
            try:
                while (
                    not head_has_ended(buffer)
                    and not head_is_over_bound(buffer)
                    and may_start_request(buffer)
                ):
                    data: bytes = await sock.recv(MAX_RECV)
                    if not data:
                        break
                    buffer += data
            finally:
                connections.discard_idle(waiting)
            return buffer or None
        return None

    async def _read_request(
        self, sock: Any, buffer: bytes, responder: Responder
    ) -> tuple[RequestHead | None, bytes, bytes]:
        """The request whose head ``buffer`` holds, read whole: its head, its body and the
        bytes after it. Or (None, b"", every byte read) when it is hypercorn's: a head too
        big, cut short or not in CRLF lines, not plain, not the responder's, or a body too
        big, slow to come or cut short."""
        end = end_of_head(buffer)
        if end < 0:
            return None, b"", buffer
        head = parse_plain_request_head(buffer[:end])
        if (
            head is None
            or head.content_length > responder.max_body_bytes
            or not responder.serves(head.method.decode("ascii"), head.path)
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


class FastPathWire:
    """An answer's way out on the fast path (``writer.Wire``): Sluice's own HTTP/1.1 framing,
    written straight to the socket within the stall limit."""

    __slots__ = ("_chunked", "_gone_at", "_raw", "_server", "_socket")

    def __init__(self, server: FastPathServer, sock: Any) -> None:
        assert server.seam is not None
        self._server = server
        self._socket = sock
        self._raw = ChunkWriter(server, sock, server.seam.stall_timeout)
        self._gone_at: float | None = None
        self._chunked = False

    @property
    def last_answer(self) -> bool:
        return self._server.connection_state.last_answer

    def server_headers(self) -> list[tuple[bytes, bytes]]:
        # hypercorn's own (date, server), so that a client cannot tell which server answered.
        headers: list[tuple[bytes, bytes]] = self._server.config.response_headers("h11")
        return headers

    def gone_at(self) -> float | None:
        return self._gone_at

    def abort(self) -> None:
        _reset_if_open(self._socket)

    @asynccontextmanager
    async def watching(self, on_gone: Callable[[], bool]) -> AsyncIterator[None]:
        server = self._server

        def gone() -> None:
            if self._gone_at is None:
                self._gone_at = trio.current_time()
            on_gone()

        server.relay_started(gone)
        try:
            if server.watched:
                yield
            else:
                # No hangup watcher (not Linux, or the kernel's epoll limits): a task waiting
                # for the socket's EOF, as hypercorn's read task would be.
                async with trio.open_nursery() as watchers:
                    watchers.start_soon(_wait_for_eof, self._socket, server.client_gone)
                    yield
                    watchers.cancel_scope.cancel()
        finally:
            server.relay_ended()

    def chunked_writer(
        self, status: int, headers: list[tuple[bytes, bytes]]
    ) -> DirectWriter | None:
        self._raw.hold(encode_response_head(status, reason_phrase(status), headers))
        self._chunked = True
        return self._raw

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> None:
        head = encode_response_head(status, reason_phrase(status), headers)
        await self._raw.write_raw(head + first)

    async def send(self, chunk: bytes) -> None:
        await self._raw.write_raw(chunk)

    async def end(self) -> None:
        if self._chunked:
            await self._raw.write_raw(_LAST_CHUNK)


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
    """Call ``on_gone`` when the client's FIN or reset arrives. Bytes that arrive first (a
    pipelined request) are left unread, and the watch ends there: what comes after them
    cannot be seen without reading them (the hangup watcher, where there is one, can)."""
    try:
        peeked = await sock.recv(1, socket.MSG_PEEK)
    except (OSError, trio.ClosedResourceError):
        peeked = b""
    if not peeked:
        on_gone()
