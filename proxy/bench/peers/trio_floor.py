"""The floor: a bare trio relay on raw sockets, the reference for what trio itself costs per
request and per event (``--peer trio-floor``). One task per client connection, HTTP/1.1
keep-alive on both sides, and no contracts at all: no auth, no JSON, no access log, no
metrics, no stall limit, no deadline, no admission. A client that leaves is noticed only when
a write to it fails (Sluice's lifetime contract notices it at once, even while idle), and then
the upstream connection is closed, not kept.

It relays what the bench's loads need: a request with a ``Content-Length`` body (or none),
forwarded as it came but for its ``Connection`` header, to one upstream over a pool of
kept-alive connections. A pooled connection the upstream has closed is seen before reuse
(a non-blocking peek) and dropped; a request that meets a close before any byte of its answer
is sent once more on a fresh connection. The answer goes to the client read by read as it
arrives: a chunked body passes through unchanged, its framing followed only to know where it
ends. Each socket is a plain ``socket.socket`` driven by ``trio.lowlevel.wait_readable`` and
``wait_writable``: one wait, one ``recv`` and one ``send`` per relayed read.

Standalone (trio and the standard library, nothing of ``proxy``), so that its process holds the
relay and nothing else::

    python proxy/bench/peers/trio_floor.py --port 8100 --upstream http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
from typing import Final
from urllib.parse import urlsplit

import trio

RECV: Final = 64 * 1024
MAX_HEAD: Final = 64 * 1024
MAX_IDLE: Final = 1024  # kept-alive upstream connections, at most
BAD_GATEWAY: Final = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
NOT_IMPLEMENTED: Final = (
    b"HTTP/1.1 501 Not Implemented\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class Closed(Exception):
    """The other side closed the connection."""


class Conn:
    """A non-blocking socket and the bytes read from it that are not used yet."""

    __slots__ = ("buf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.buf = b""

    async def recv(self) -> bytes:
        while True:
            await trio.lowlevel.wait_readable(self.sock)
            try:
                data = self.sock.recv(RECV)
            except BlockingIOError:
                continue
            if not data:
                raise Closed
            return data

    async def send(self, data: bytes) -> None:
        while True:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
            await trio.lowlevel.wait_writable(self.sock)

    async def head(self) -> bytes:
        """Up to and including the blank line that ends a head."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > MAX_HEAD:
                raise Closed
            self.buf += await self.recv()
        head, self.buf = self.buf[: end + 4], self.buf[end + 4 :]
        return head

    async def exactly(self, size: int) -> bytes:
        while len(self.buf) < size:
            self.buf += await self.recv()
        data, self.buf = self.buf[:size], self.buf[size:]
        return data

    def idle_and_open(self) -> bool:
        """Whether a kept-alive connection is still open and has sent nothing unasked."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: open, and quiet
        except OSError:
            return False
        return False  # closed (b""), or bytes that no request asked for

    def close(self) -> None:
        self.sock.close()


class Chunked:
    """Where a chunked body ends, fed the bytes as they arrive (they pass on unchanged)."""

    __slots__ = ("last", "partial", "skip")

    def __init__(self) -> None:
        self.skip = 0  # bytes of chunk data (and its CRLF) still to come
        self.partial = b""  # the start of a size or trailer line
        self.last = False  # the zero-size chunk seen: trailer lines until an empty one

    def feed(self, data: bytes) -> int:
        """The offset in ``data`` just past the body's end, or -1 while it goes on."""
        if self.skip >= len(data):
            self.skip -= len(data)
            return -1
        offset = len(self.partial)
        buf = self.partial + data if offset else data
        pos, self.skip, self.partial = self.skip, 0, b""  # a partial line: skip was 0
        while (eol := buf.find(b"\r\n", pos)) >= 0:
            if self.last:
                if eol == pos:
                    return eol + 2 - offset
                pos = eol + 2
                continue
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            self.last = size == 0
            pos = eol + 2 + (size + 2 if size else 0)
            if pos > len(buf):
                self.skip = pos - len(buf)
                return -1
        if len(buf) - pos > MAX_HEAD:
            raise ValueError("a chunk size line without its end")
        self.partial = buf[pos:]
        return -1


class Sized:
    """Where a body of a known length ends."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def feed(self, data: bytes) -> int:
        if len(data) < self.left:
            self.left -= len(data)
            return -1
        end, self.left = self.left, 0
        return end


class UntilClose:
    """A body that ends when the upstream closes its connection."""

    def feed(self, data: bytes) -> int:
        return -1


def _fields(head: bytes) -> tuple[list[bytes], dict[bytes, bytes]]:
    """A head's lines (without the blank one) and its headers, names in lower case; a
    repeated header's last value."""
    lines = head[:-4].split(b"\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    return lines, fields


class Relay:
    """Every client connection's task, and the upstream connections they share."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.idle: list[Conn] = []

    async def serve_client(self, sock: socket.socket) -> None:
        client = Conn(sock)
        try:
            while await self.one_request(client):
                pass
        except (Closed, OSError, ValueError, IndexError):
            pass  # a client gone, or bytes this relay does not read: its connection ends
        finally:
            client.close()

    async def one_request(self, client: Conn) -> bool:
        """Relay one request and its answer; whether the client's connection stays open."""
        try:
            head = await client.head()
        except Closed:
            return False  # the client closed an idle connection
        lines, fields = _fields(head)
        if b"transfer-encoding" in fields:
            await client.send(NOT_IMPLEMENTED)
            return False
        keep = (
            lines[0].endswith(b"HTTP/1.1")
            and b"close" not in fields.get(b"connection", b"").lower()
        )
        body = await client.exactly(int(fields.get(b"content-length", 0)))
        kept = [line for line in lines if not line[:11].lower().startswith(b"connection:")]
        request = b"\r\n".join(kept) + b"\r\n\r\n" + body
        try:
            upstream, answer = await self.exchange(request)
        except (Closed, OSError):
            await client.send(BAD_GATEWAY)
            return False
        try:
            reusable, ended = await self.answer(
                upstream, answer, client, head_request=head[:5] == b"HEAD "
            )
        except BaseException:
            upstream.close()  # an answer cut short: its connection is never reused
            raise
        if reusable and len(self.idle) < MAX_IDLE:
            self.idle.append(upstream)
        else:
            upstream.close()
        return keep and ended

    async def exchange(self, request: bytes) -> tuple[Conn, bytes]:
        """``request`` written upstream and its answer's head read: on a kept-alive
        connection that is still open if there is one, and once more on a fresh one if that
        one closes before the first byte of the answer."""
        while self.idle:
            upstream = self.idle.pop()
            if not upstream.idle_and_open():
                upstream.close()
                continue
            try:
                await upstream.send(request)
                return upstream, await upstream.head()
            except (Closed, OSError):
                upstream.close()
                if upstream.buf:
                    raise  # part of an answer came: not for sending twice
                break
        upstream = await self.connect()
        try:
            await upstream.send(request)
            return upstream, await upstream.head()
        except BaseException:
            upstream.close()
            raise

    async def connect(self) -> Conn:
        upstream = Conn(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        try:
            error = upstream.sock.connect_ex(self.upstream)
            if error == errno.EINPROGRESS:
                await trio.lowlevel.wait_writable(upstream.sock)
                error = upstream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except BaseException:
            upstream.close()
            raise
        if error:
            upstream.close()
            raise OSError(error, os.strerror(error))
        return upstream

    async def answer(
        self, upstream: Conn, head: bytes, client: Conn, *, head_request: bool
    ) -> tuple[bool, bool]:
        """The answer's head and body to the client, each upstream read as one write.
        Whether the upstream connection may be kept for another request, and whether the
        client can tell where the answer ended without its connection closing."""
        lines, fields = _fields(head)
        status = int(lines[0].split(b" ", 2)[1])
        body: Chunked | Sized | UntilClose
        if head_request or status in (204, 304):
            body = Sized(0)
        elif b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            body = Chunked()
        elif b"content-length" in fields:
            body = Sized(int(fields[b"content-length"]))
        else:
            body = UntilClose()
        data, upstream.buf = upstream.buf, b""
        end = body.feed(data)
        await client.send(head + (data if end < 0 else data[:end]))
        while end < 0:
            try:
                data = await upstream.recv()
            except Closed:
                if isinstance(body, UntilClose):
                    return False, False
                raise
            end = body.feed(data)
            await client.send(data if end < 0 else data[:end])
        keep = (
            lines[0].startswith(b"HTTP/1.1")
            and b"close" not in fields.get(b"connection", b"").lower()
        )
        return keep and end == len(data), keep


async def serve(
    host: str,
    port: int,
    upstream: tuple[str, int],
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on ``host:port`` (0: any free port, reported to ``task_status``)
    and relay each one's requests to ``upstream``, a task per connection."""
    relay = Relay(upstream)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(65535)  # the kernel caps it at net.core.somaxconn
        listener.setblocking(False)
        task_status.started(listener.getsockname()[1])
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    await trio.lowlevel.wait_readable(listener)
                    while True:
                        try:
                            sock, _ = listener.accept()
                        except BlockingIOError:
                            break
                        except OSError:
                            await trio.sleep(0.01)  # out of descriptors: wait for some to close
                            break
                        nursery.start_soon(relay.serve_client, sock)
        finally:
            for idle in relay.idle:
                idle.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="http://host:port")
    args = parser.parse_args(argv)
    parts = urlsplit(args.upstream)
    if parts.scheme != "http" or not parts.hostname:
        parser.error("--upstream must be http://host:port")
    trio.run(serve, args.host, args.port, (parts.hostname, parts.port or 80))


if __name__ == "__main__":
    main()
