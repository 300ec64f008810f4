"""Bytes of an answer written straight to the client's socket, each write within the stall
limit: what both servers' wires (``server/writer.py``) write with.

Each body chunk sent through ASGI costs hypercorn an ``app_send`` state check, a ``Body``
event, an h11 ``Data`` event framed by h11's ChunkedWriter, a ``RawData`` event, a lock, a
shielded cancel scope and trio's ``send_all`` (which ends in a full scheduler round trip). In the
hot-path profile that was a quarter of the proxy's CPU, for what is, once the response head is
out, one ``write`` of ``<hex length>\\r\\n<chunk>\\r\\n`` per chunk.

:class:`ChunkWriter` writes that frame itself, with one non-blocking ``write`` on the socket,
when nothing else is writing on the connection (the connection server's send lock is free);
whatever the kernel does not take at once (a slow reader) is written as room comes, under that
lock and within ``stall_timeout``; a closed or broken connection is left to the connection
server's ``protocol_send`` to find out. Under hypercorn only chunked bodies and bytes h11 has
framed itself are written so, so h11's view of the connection stays true.
"""

from __future__ import annotations

import contextlib
import os
import select
from typing import Any

import trio

from proxy.relay.body import ClientStalled
from proxy.server.adapters.hypercorn_adapter import RawData, TCPServer


def chunk_frame(chunk: bytes) -> bytes:
    """One chunk of HTTP/1.1 chunked transfer coding, as h11's ChunkedWriter frames it."""
    return b"%x\r\n%b\r\n" % (len(chunk), chunk)


class ChunkWriter:
    """Writes one answer's bytes on a connection: chunked body frames (:meth:`write`,
    :meth:`write_nowait`) and bytes framed already (:meth:`write_raw`)."""

    __slots__ = ("_pending", "_server", "_socket", "_stall_timeout")

    def __init__(self, server: TCPServer, sock: Any, stall_timeout: float) -> None:
        self._server = server
        self._socket = sock
        self._stall_timeout = stall_timeout
        # The tail of a frame the socket took only part of (write_nowait); written first.
        self._pending = b""

    def hold(self, data: bytes) -> None:
        """Keep ``data`` (a response head) to go out before, and in one write with, the next
        chunk: the head and the first token leave together."""
        self._pending += data

    def _write_now(self, frame: bytes) -> int:
        """Bytes of ``frame`` the kernel took at once: 0 while the server is writing (its lock
        is held), on a full socket, or on a closed or broken one."""
        # The descriptor is looked up per write: after the server (or an abort) closes the
        # socket it reads -1, and a stale number could name someone else's socket.
        fd = self._socket.fileno()
        if fd < 0 or self._server.send_lock.locked():
            return 0
        try:
            return os.write(fd, frame)
        except OSError:
            # Full (BlockingIOError): the caller queues, or write() waits for room. Broken:
            # the server's own write finds out.
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
        # A deadline of our own: a client that stops reading once the producer is done (nothing
        # left to fill the channel and trip the producer's stall limit) would otherwise hold
        # this task, and the server's shutdown, forever. Under the server's lock, so that its
        # own writers wait.
        with trio.move_on_after(self._stall_timeout) as deadline:
            async with self._server.send_lock:
                rest = await self._write_all(rest)
        if deadline.cancelled_caught:
            raise ClientStalled(f"the client took nothing for {self._stall_timeout:g}s")
        if rest:
            # Closed or broken: the server's own write finds out and closes its side.
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
        """Return once the socket can take a write (before the body's last chunk, which the
        server writes); :class:`ClientStalled` after ``stall_timeout``."""
        fd = self._socket.fileno()
        if fd < 0 or _writable(fd):
            return
        with trio.move_on_after(self._stall_timeout):
            async with self._server.send_lock:
                # Closed: the server's write will find out.
                with contextlib.suppress(trio.ClosedResourceError):
                    await trio.lowlevel.wait_writable(self._socket)
            return
        raise ClientStalled(f"the client took nothing for {self._stall_timeout:g}s")


def _writable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))
