"""The sweep's client: one request on a plain socket, and a departure that can happen between
any two task steps. An HTTP request is written by hand; a WebSocket's handshake and frames are
wsproto's (sans-IO: it hands back the bytes, and the client writes them).

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

import contextlib
import errno
import json
import socket
from dataclasses import dataclass
from typing import Any

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, TextMessage
from wsproto.events import Request as Upgrade

LEAVES = ("close", "fin", "close-frame")
RECEIVE = 65536
# A WebSocket's goodbye: a normal closure.
NORMAL_CLOSURE = 1000


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    # A WebSocket: the handshake (a GET asking to upgrade), then the body as one text message.
    websocket: bool = False

    def encode(self, host: str, port: int) -> bytes:
        """An HTTP request: the POST of the body as JSON."""
        payload = json.dumps(self.body).encode()
        more = "".join(f"{name}: {value}\r\n" for name, value in self.headers.items())
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {host}:{port}\r\n{more}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        return head.encode() + payload

    def upgrade(self, host: str, port: int) -> Upgrade:
        """A WebSocket's handshake: a GET asking to upgrade, with the request's headers."""
        headers = [(name.encode(), value.encode()) for name, value in self.headers.items()]
        return Upgrade(host=f"{host}:{port}", target=self.path, extra_headers=headers)

    def message(self) -> TextMessage:
        """A WebSocket's message: the body as JSON, one text message."""
        return TextMessage(data=json.dumps(self.body))


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
        # A WebSocket's end of the protocol: the bytes of its handshake and frames to send.
        self.websocket: WSConnection | None = None

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
        if not request.websocket:
            await self._send_all(request.encode(host, port))
            return
        self.websocket = WSConnection(ConnectionType.CLIENT)
        await self._send_all(self.websocket.send(request.upgrade(host, port)))
        if self.left:
            return
        # The message goes once the handshake is answered (101), as a client's must.
        await self.read_until(lambda got: b"\r\n\r\n" in got)
        if not self.left and self._accepted():
            self.upgraded = True
            await self._send_all(self.websocket.send(request.message()))
            self.message_sent = not self.left

    def _accepted(self) -> bool:
        """Whether the handshake was answered by a 101 that accepts it (wsproto checks its
        Upgrade, Connection and Sec-WebSocket-Accept, and raises on a 101 that gets them wrong).
        Only the head goes to wsproto: the frames after it are answers.py's to read, and a
        server's close read here would leave wsproto refusing to send the client's message."""
        assert self.websocket is not None
        head, sep, _ = bytes(self.received).partition(b"\r\n\r\n")
        if not sep:
            return False
        self.websocket.receive_data(head + sep)
        return any(isinstance(event, AcceptConnection) for event in self.websocket.events())

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
                assert self.websocket is not None
                goodbye = self.websocket.send(CloseConnection(code=NORMAL_CLOSURE))
                with contextlib.suppress(OSError):
                    self.sock.send(goodbye)
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
