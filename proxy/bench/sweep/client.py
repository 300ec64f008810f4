"""The sweep's client: one request by hand on a plain socket, and a departure that can happen
between any two task steps.

The socket is the standard library's, non-blocking, read through ``trio.lowlevel``'s
readiness waits: :meth:`SweepClient.leave` is synchronous, so the checkpoint counter can call
it from inside the run loop, right after the request's k-th step, with no await of its own
(an await would be a step of its own and move the moment).

Three ways to leave:

* ``close``: the socket is closed (a FIN; a reset if bytes arrive after it). What the proxy
  wrote after the close is lost, so what the client received bounds what was sent from below;
* ``fin``: ``shutdown(SHUT_WR)``, and the client reads on to the end. The proxy sees the same
  FIN, and everything it handed to the socket arrives: what was sent is exactly what was read;
* ``close-frame`` (a WebSocket): a close frame, and the client reads on to the server's close,
  so that, as with ``fin``, what was sent is what was read.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import trio

LEAVES = ("close", "fin", "close-frame")
RECEIVE = 65536
# A WebSocket close frame from the client (masked, as a client's must be): code 1000.
CLOSE_FRAME = b"\x88\x82" + b"\x00\x00\x00\x00" + b"\x03\xe8"


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    # A WebSocket: the handshake (a GET asking to upgrade), then the body as one text message.
    websocket: bool = False

    def encode(self, host: str, port: int) -> bytes:
        if self.websocket:
            key = base64.b64encode(os.urandom(16)).decode()
            more = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
            return (
                f"GET {self.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{more}"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        payload = json.dumps(self.body).encode()
        more = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{more}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload

    def message(self) -> bytes:
        """The body as one WebSocket text frame, masked (a zero mask: the bytes as they are)."""
        payload = json.dumps(self.body).encode()
        size = len(payload)
        if size < 126:
            length = bytes([0x80 | size])
        elif size < 65536:
            length = bytes([0x80 | 126]) + size.to_bytes(2, "big")
        else:
            length = bytes([0x80 | 127]) + size.to_bytes(8, "big")
        return b"\x81" + length + b"\x00\x00\x00\x00" + payload


class SweepClient:
    """One connection, one request. ``received``: every byte read; ``left``: whether (and how)
    it left before the end."""

    def __init__(self, leave: str = "close") -> None:
        assert leave in LEAVES, leave
        self.how = leave
        self.sock = socket.socket()
        self.sock.setblocking(False)
        # As browsers and SDKs do: a small write (a close frame after the message) goes at once
        # instead of waiting, by Nagle's rule, for the ACK of the last (40 ms, delayed).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.received = bytearray()
        self.left = False
        self.closed = False
        # Bytes read after the departure (a fin client reads on).
        self.after_leaving = 0
        # A WebSocket's handshake was answered: frames may go both ways; its message was sent
        # whole (a request, with its access line, exists).
        self.upgraded = False
        self.message_sent = False

    @property
    def reads_on(self) -> bool:
        """Whether, having left, it reads on to the end and so holds everything Sluice handed to
        the connection (``fin``). Not after a WebSocket's close frame: the HTTP server answers it
        and ends the stream, then drops what the app sends before it has handed the app its
        disconnect (a closed stream's sends return at once), so the client's
        messages bound what was sent from below, as after a ``close``."""
        return self.how == "fin"

    async def send(self, host: str, port: int, request: Request) -> None:
        sock = self.sock
        try:
            sock.connect((host, port))
        except BlockingIOError:
            if not await self._connected():
                return  # it left while connecting (a cut in the first steps)
        await self._send_all(request.encode(host, port))
        if request.websocket and not self.left:
            # The message goes once the handshake is answered (101), as a client's must.
            await self.read_until(lambda got: b"\r\n\r\n" in got)
            if self.received.startswith(b"HTTP/1.1 101 ") and not self.left:
                self.upgraded = True
                await self._send_all(request.message())
                self.message_sent = not self.left

    async def _send_all(self, payload: bytes) -> None:
        sock = self.sock
        data = memoryview(payload)
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
        if self.how == "close-frame":
            if self.upgraded:
                # A WebSocket's own goodbye; it reads on, to the server's close. Before the
                # handshake is answered there is no WebSocket to close: the TCP connection is.
                with contextlib.suppress(OSError):
                    self.sock.send(CLOSE_FRAME)
                return
            self.close()
            return
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
