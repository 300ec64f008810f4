"""The sweep's client: one request by hand on a plain socket, and a departure that can happen
between any two task steps.

The socket is the standard library's, non-blocking, read through ``trio.lowlevel``'s
readiness waits: :meth:`SweepClient.leave` is synchronous, so the checkpoint counter can call
it from inside the run loop, right after the request's k-th step, with no await of its own
(an await would be a step of its own and move the moment).

Two ways to leave:

* ``close``: the socket is closed (a FIN; a reset if bytes arrive after it). What the proxy
  wrote after the close is lost, so what the client received bounds what was sent from below;
* ``fin``: ``shutdown(SHUT_WR)``, and the client reads on to the end. The proxy sees the same
  FIN, and everything it handed to the socket arrives: what was sent is exactly what was read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
from dataclasses import dataclass
from typing import Any

import trio

LEAVES = ("close", "fin")
RECEIVE = 65536


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]

    def encode(self, host: str, port: int) -> bytes:
        payload = json.dumps(self.body).encode()
        more = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{more}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload


class SweepClient:
    """One connection, one request. ``received``: every byte read; ``left``: whether (and how)
    it left before the end."""

    def __init__(self, leave: str = "close") -> None:
        assert leave in LEAVES, leave
        self.how = leave
        self.sock = socket.socket()
        self.sock.setblocking(False)
        self.received = bytearray()
        self.left = False
        self.closed = False
        # Bytes read after the departure (a fin client reads on).
        self.after_leaving = 0

    async def send(self, host: str, port: int, request: Request) -> None:
        sock = self.sock
        try:
            sock.connect((host, port))
        except BlockingIOError:
            if not await self._connected():
                return  # it left while connecting (a cut in the first steps)
        data = memoryview(request.encode(host, port))
        while data and not self.left:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError:
                    return
                continue
            except OSError:
                return  # it left while sending (a cut in the first steps)
            data = data[sent:]

    async def _connected(self) -> bool:
        """Once a connect under way is done: True, or False if the client left meanwhile."""
        try:
            await trio.lowlevel.wait_writable(self.sock)
        except trio.ClosedResourceError:
            return False
        if self.left:
            return False
        error = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, errno.errorcode.get(error, "connect failed"))
        return True

    def _drain(self) -> bool:
        """Everything the kernel holds for us now, without waiting; False at EOF or reset."""
        while True:
            try:
                data = self.sock.recv(RECEIVE)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            if self.left:
                self.after_leaving += len(data)
            self.received += data

    async def read_until(self, done: Any) -> None:
        """Read until ``done(received)`` says the answer is whole, the server closes, or the
        client has closed its socket."""
        while not self.closed and not done(bytes(self.received)):
            try:
                await trio.lowlevel.wait_readable(self.sock)
            except trio.ClosedResourceError:
                return
            if self.closed or not self._drain():
                return

    def leave(self) -> None:
        """Leave now, synchronously: what was already received is read first (it was sent)."""
        if self.left or self.closed:
            return
        self._drain()
        self.left = True
        if self.how == "fin":
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
            return
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
