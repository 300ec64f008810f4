"""Writing a relayed stream's body chunks straight to the client's socket, under hypercorn.

Each body chunk sent through ASGI costs hypercorn an ``app_send`` state check, a ``Body``
event, an h11 ``Data`` event framed by h11's ChunkedWriter, a ``RawData`` event, a lock, a
shielded cancel scope and trio's ``send_all`` (which ends in a full scheduler round trip). In the
hot-path profile that was a quarter of the proxy's CPU, for what is, once the response head is
out, one ``write`` of ``<hex length>\\r\\n<chunk>\\r\\n`` per chunk.

:class:`ChunkWriter` writes that frame itself, with one non-blocking ``write`` on the socket,
when nothing else is writing on the connection (hypercorn's send lock is free); whatever the
kernel does not take at once (a slow reader) is written as room comes, under hypercorn's send
lock and within ``stall_timeout``; a closed or broken connection is left to hypercorn's own
``protocol_send`` to find out, as always. Only chunked HTTP/1.1 responses qualify: h11 keeps
no per-chunk state for them, so the head (before) and the final ``0\\r\\n\\r\\n`` (after,
through ASGI) stay hypercorn's and h11's, and h11's view of the connection stays true.
Anything else (HTTP/2, TLS, HTTP/1.0, a Content-Length body, a hypercorn whose layout differs)
gets ``None`` from :func:`attach`, and the caller uses ASGI ``send`` as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
from typing import Any, NamedTuple

import h11
import trio

from proxy.relay.body import ClientStalled
from proxy.server import adapters
from proxy.server.adapters.hypercorn_adapter import (
    ASGIHTTPState,
    H11Protocol,
    HTTPStream,
    RawData,
    TCPServer,
    build_and_validate_headers,
)
from proxy.server.connection_server import reason_phrase, send_chain

log = logging.getLogger("sluice.chunk_writer")


def chunk_frame(chunk: bytes) -> bytes:
    """One chunk of HTTP/1.1 chunked transfer coding, as h11's ChunkedWriter frames it."""
    return b"%x\r\n%b\r\n" % (len(chunk), chunk)


class ChunkWriter:
    """Writes body chunks of one chunked HTTP/1.1 response on hypercorn's connection."""

    __slots__ = ("_pending", "_server", "_socket", "_stall_timeout")

    def __init__(self, server: TCPServer, sock: Any, stall_timeout: float) -> None:
        self._server = server
        self._socket = sock
        self._stall_timeout = stall_timeout
        # The tail of a frame the socket took only part of (write_nowait); written first.
        self._pending = b""

    def _write_now(self, frame: bytes) -> int:
        """Bytes of ``frame`` the kernel took at once: 0 while hypercorn is writing (its lock
        is held), on a full socket, or on a closed or broken one."""
        # The descriptor is looked up per write: after hypercorn (or asgi.abort_transport)
        # closes the socket it reads -1, and a stale number could name someone else's socket.
        fd = self._socket.fileno()
        if fd < 0 or self._server.send_lock.locked():
            return 0
        try:
            return os.write(fd, frame)
        except OSError:
            # Full (BlockingIOError): the caller queues, or write() waits for room. Broken:
            # hypercorn's own write finds out.
            return 0

    def write_nowait(self, chunk: bytes) -> bool | None:
        """Write ``chunk`` (after anything pending) now if the socket takes any of it. True:
        all of it; None: part, the rest pending for the next :meth:`write`; False: nothing
        (the caller queues the chunk; what was pending stays so)."""
        if not chunk:
            return False
        frame = self._pending + chunk_frame(chunk) if self._pending else chunk_frame(chunk)
        sent = self._write_now(frame)
        if sent == len(frame):
            self._pending = b""
            return True
        if sent <= len(self._pending):
            # Nothing of the chunk went: what was pending is left of it, the chunk is queued.
            self._pending = self._pending[sent:]
            return False
        self._pending = frame[sent:]
        return None

    async def write(self, chunk: bytes) -> None:
        """Write what is pending and ``chunk`` (an empty chunk would end the body: skipped),
        waiting for room in the socket when the kernel does not take it at once. Raises
        :class:`ClientStalled` if the client takes nothing for ``stall_timeout``."""
        frame = self._pending + chunk_frame(chunk) if chunk else self._pending
        self._pending = b""
        if not frame:
            return
        sent = self._write_now(frame)
        if sent == len(frame):
            return
        rest = memoryview(frame)[sent:]
        # Our own wait, not hypercorn's: its write is shielded from cancellation and has no
        # deadline, so a client that stops reading once the producer is done (nothing left
        # to fill the channel and trip the producer's stall limit) would hold this task, and
        # the server's shutdown, forever. Under hypercorn's lock, so its writers wait.
        with trio.move_on_after(self._stall_timeout) as deadline:
            async with self._server.send_lock:
                rest = await self._write_all(rest)
        if deadline.cancelled_caught:
            raise ClientStalled(f"the client took nothing for {self._stall_timeout:g}s")
        if rest:
            # Closed or broken: hypercorn's own write finds out and closes its side.
            await self._server.protocol_send(RawData(data=bytes(rest)))

    async def write_raw(self, data: bytes) -> None:
        """Write what is pending and ``data`` as they are (a head, a known-length body, the
        last chunk), as :meth:`write` does, stall limit included."""
        self._pending += data
        await self.write(b"")

    async def _write_all(self, data: memoryview) -> memoryview:
        """Write ``data``, waiting for room; what is left unwritten if the socket is closed
        or broken (empty when all went out)."""
        while data:
            fd = self._socket.fileno()
            if fd < 0:
                return data
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(self._socket)
                except trio.ClosedResourceError:
                    return data
            except OSError:
                return data
        return data

    async def wait_for_room(self) -> None:
        """Return once the socket can take a write (the body's last chunk goes through
        hypercorn, unbounded); :class:`ClientStalled` after ``stall_timeout``."""
        fd = self._socket.fileno()
        if fd < 0 or _writable(fd):
            return
        with trio.move_on_after(self._stall_timeout):
            async with self._server.send_lock:
                # Closed: hypercorn's write will find out.
                with contextlib.suppress(trio.ClosedResourceError):
                    await trio.lowlevel.wait_writable(self._socket)
            return
        raise ClientStalled(f"the client took nothing for {self._stall_timeout:g}s")


def _writable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))


class _Chain(NamedTuple):
    """hypercorn's objects under an app's ASGI send, for a plain-TCP HTTP/1.1 connection."""

    stream: HTTPStream
    protocol: H11Protocol
    server: TCPServer
    socket: Any
    h11: h11.Connection


def _chain_of(send: Any, headers: list[tuple[bytes, bytes]]) -> _Chain | None:
    """The fast path's view of the connection, or None where it does not apply: a body with a
    Content-Length, HTTP/2, TLS, an HTTP/1.0 client (close-delimited framing), a hypercorn
    whose layout differs."""
    if any(name.lower() == b"content-length" for name, _ in headers):
        return None
    if not adapters.usable("chunk_writer"):
        return None
    stream, protocol, server = send_chain(send)
    if not (
        isinstance(stream, HTTPStream)
        and isinstance(protocol, H11Protocol)
        and isinstance(server, TCPServer)
    ):
        return None
    transport: Any = server.stream  # typed as an SSLStream; a SocketStream without TLS
    connection = protocol.connection
    if (
        not isinstance(transport, trio.SocketStream)
        or not isinstance(connection, h11.Connection)
        or connection.their_http_version != b"1.1"
        or not isinstance(getattr(server, "send_lock", None), trio.Lock)
    ):
        return None
    return _Chain(stream, protocol, server, transport.socket, connection)


def attach(
    send: Any, headers: list[tuple[bytes, bytes]], stall_timeout: float
) -> ChunkWriter | None:
    """A :class:`ChunkWriter` for the response whose head was just sent through ``send``
    (hypercorn's ASGI send) with ``headers``, or None where the fast path does not apply."""
    chain = _chain_of(send, headers)
    if chain is None or chain.h11.our_state is not h11.SEND_BODY:
        return None
    return ChunkWriter(chain.server, chain.socket, stall_timeout)


def start_response(
    send: Any, status: int, headers: list[tuple[bytes, bytes]], stall_timeout: float
) -> ChunkWriter | None:
    """Begin a chunked HTTP/1.1 response on hypercorn's connection without hypercorn's send
    path, or return None where the fast path does not apply (the caller then sends the head
    through ASGI, and may :func:`attach`).

    h11 makes the head, exactly as hypercorn's H11Protocol would (its own response headers,
    ``connection: close`` at keep_alive_max_requests), so h11's and the stream's states move
    as if hypercorn had sent it; the head then waits in the writer and leaves with the first
    chunk, in one write (the head and first token were two writes and a trip through
    hypercorn's send path: ~0.8 ms of the time to first token at no load)."""
    chain = _chain_of(send, headers)
    if (
        chain is None
        or chain.stream.state is not ASGIHTTPState.REQUEST
        or chain.stream.closed
        or chain.h11.our_state is not h11.SEND_RESPONSE
    ):
        return None
    stream, protocol, connection = chain.stream, chain.protocol, chain.h11
    config = protocol.config
    h11_headers = [*build_and_validate_headers(headers), *config.response_headers("h11")]
    if protocol.keep_alive_requests >= config.keep_alive_max_requests:
        h11_headers.append((b"connection", b"close"))
    head = connection.send(
        h11.Response(status_code=status, headers=h11_headers, reason=reason_phrase(status))
    )
    assert head is not None  # a Response always has bytes; h11's type says "maybe"
    stream.response = {"type": "http.response.start", "status": status, "headers": headers}
    stream.state = ASGIHTTPState.RESPONSE
    writer = ChunkWriter(chain.server, chain.socket, stall_timeout)
    writer._pending = head
    return writer
