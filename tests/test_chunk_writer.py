"""chunk_writer: body frames written straight to hypercorn's socket, byte-exact and in order.

The fast path bypasses h11 for the body, so every test here checks the bytes on the wire
against h11's own framing (or parses them as strictly as a client must), and checks that
hypercorn's view of the connection stayed true afterwards (the next request on it works).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import h11
import pytest
import trio
from hypercorn.events import RawData
from hypercorn.protocol.http_stream import HTTPStream

from proxy import chunk_writer
from proxy.asgi import transport_socket
from proxy.chunk_writer import ChunkWriter, chunk_frame
from proxy.fake_upstream import token_text
from tests.support import (
    DEADLINE,
    OPEN_RAW_CLIENTS,
    Proxy,
    RawClient,
    chat_body,
    connect_client,
    poll_until,
    start_fake,
    start_proxy,
)

CHAT = "/v1/chat/completions"
# h11 writes the size in lowercase hex with no chunk extensions; anything else is not ours.
_SIZE_LINE = re.compile(rb"[0-9a-f]+")


# --------------------------------------------------------------------------- framing


@pytest.mark.parametrize("size", [0x1, 0xF, 0x10, 4096, 70000])
def test_chunk_frame_matches_h11(size: int) -> None:
    connection = h11.Connection(our_role=h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(connection.next_event(), h11.Request)
    assert isinstance(connection.next_event(), h11.EndOfMessage)
    # No Content-Length: h11 picks chunked framing for an HTTP/1.1 peer, as under hypercorn.
    head = connection.send(h11.Response(status_code=200, headers=[]))
    assert head is not None and b"transfer-encoding: chunked" in head.lower()
    # Distinct byte values, so a frame that dropped or repeated a span would not compare equal.
    chunk = bytes(itertools.islice(itertools.cycle(range(256)), size))
    assert chunk_frame(chunk) == connection.send(h11.Data(data=chunk))
    # And the terminator the fast path leaves to h11 still closes what it wrote.
    assert connection.send(h11.EndOfMessage()) == b"0\r\n\r\n"


# --------------------------------------------------------------------------- observing


@dataclass
class Observed:
    """What the fast path did, seen from outside proxy code."""

    # The writer per relayed response (start_response's, else attach()'s): a ChunkWriter,
    # or None (ASGI send used).
    attached: list[ChunkWriter | None] = field(default_factory=list)
    # write_nowait()'s results: True (all written), None (partial), False (nothing).
    direct: list[bool | None] = field(default_factory=list)
    # http.response.body messages with bytes in them that went through hypercorn's ASGI send.
    asgi_body_sends: int = 0
    # Set once hypercorn has handled a response's last body message: every byte of the
    # response, the terminator included, has been handed to the kernel.
    response_ended: trio.Event = field(default_factory=trio.Event)
    # Set by a test: SO_SNDBUF for the proxy's side of the client connection, so that a
    # client that stops reading fills it after a few KiB instead of autotuned megabytes.
    server_sndbuf: int | None = None


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch) -> Observed:
    seen = Observed()
    original_attach = chunk_writer.attach

    def attach(
        send: Any, headers: list[tuple[bytes, bytes]], stall_timeout: float
    ) -> ChunkWriter | None:
        if seen.server_sndbuf is not None:
            sock = transport_socket(send)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, seen.server_sndbuf)
        writer = original_attach(send, headers, stall_timeout)
        seen.attached.append(writer)
        return writer

    original_start = chunk_writer.start_response

    def start_response(
        send: Any, status: int, headers: list[tuple[bytes, bytes]], stall_timeout: float
    ) -> ChunkWriter | None:
        if seen.server_sndbuf is not None:
            sock = transport_socket(send)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, seen.server_sndbuf)
        writer = original_start(send, status, headers, stall_timeout)
        if writer is not None:  # else asgi.py sends the head through ASGI, then attach()es
            seen.attached.append(writer)
        return writer

    # asgi.py calls both through the module, so these are the ones it gets.
    monkeypatch.setattr(chunk_writer, "attach", attach)
    monkeypatch.setattr(chunk_writer, "start_response", start_response)
    original_write_nowait = ChunkWriter.write_nowait

    def write_nowait(self: ChunkWriter, chunk: bytes) -> bool | None:
        result = original_write_nowait(self, chunk)
        seen.direct.append(result)
        return result

    monkeypatch.setattr(ChunkWriter, "write_nowait", write_nowait)
    original_app_send = HTTPStream.app_send

    async def app_send(self: HTTPStream, message: Any) -> None:
        body = message is not None and message["type"] == "http.response.body"
        if body and message["body"]:
            seen.asgi_body_sends += 1
        try:
            await original_app_send(self, message)
        finally:
            # finally: for a "Connection: close" response the send ends cancelled, in
            # hypercorn's close of the connection, after the last bytes went out.
            if body and not message.get("more_body", False):
                seen.response_ended.set()

    # Bound per request, after this patch: attach still finds the HTTPStream as __self__.
    monkeypatch.setattr(HTTPStream, "app_send", app_send)
    return seen


def force_partial_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other write the fast path makes takes only half its frame: the partial-write
    paths (a pending tail, the rest through protocol_send) run on every stream, not only when
    the kernel happens to split a frame at a buffer boundary."""
    calls = itertools.count()

    def write(fd: int, data: bytes) -> int:
        if next(calls) % 2 == 0 and len(data) > 1:
            data = data[: len(data) // 2]
        return os.write(fd, data)

    monkeypatch.setattr(chunk_writer, "os", SimpleNamespace(write=write))


# --------------------------------------------------------------------------- a strict client


class Conn:
    """An HTTP/1.x client connection that parses the response framing itself, byte by byte,
    and keeps whatever follows a response (which must be nothing)."""

    def __init__(self, stream: trio.SocketStream, host: str, port: int) -> None:
        self.stream = stream
        self.host = f"{host}:{port}"
        self.buffer = bytearray()
        self.pos = 0
        # Closed by support's fixture if the test fails half-way.
        OPEN_RAW_CLIENTS.append(RawClient(stream))

    @classmethod
    async def open(cls, proxy: Proxy, *, rcvbuf: int | None = None, mss: int | None = None) -> Conn:
        host, port = proxy.host_port
        return cls(await connect_client(proxy, rcvbuf=rcvbuf, mss=mss), host, port)

    async def post(self, body: dict[str, Any], *, version: str = "HTTP/1.1") -> None:
        payload = json.dumps(body).encode()
        head = (
            f"POST {CHAT} {version}\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        await self.stream.send_all(head + payload)

    async def _fill(self, size: int) -> bool:
        """At least ``size`` unread bytes buffered; False if the connection ended first."""
        while len(self.buffer) - self.pos < size:
            data = await self.stream.receive_some(65536)
            if not data:
                return False
            if self.pos > 65536:
                del self.buffer[: self.pos]
                self.pos = 0
            self.buffer += data
        return True

    async def take(self, size: int) -> bytes:
        if not await self._fill(size):
            raise EOFError(f"connection closed; unread {self.unread()[-300:]!r}")
        data = bytes(self.buffer[self.pos : self.pos + size])
        self.pos += size
        return data

    async def line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n", self.pos)) < 0:
            if not await self._fill(len(self.buffer) - self.pos + 1):
                raise EOFError(f"connection closed mid-line; unread {self.unread()!r}")
        return await self.take(end + 2 - self.pos)

    async def head(self) -> tuple[bytes, dict[bytes, bytes]]:
        status = await self.line()
        headers: dict[bytes, bytes] = {}
        while (line := await self.line()) != b"\r\n":
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def frame(self) -> bytes | None:
        """The payload of the body's next chunk; None for the terminating zero-size chunk."""
        size_line = await self.line()
        assert _SIZE_LINE.fullmatch(size_line[:-2]), size_line
        size = int(size_line, 16)
        if size == 0:
            # No trailers: the terminator is exactly 0\r\n\r\n.
            assert await self.take(2) == b"\r\n"
            return None
        payload = await self.take(size)
        assert await self.take(2) == b"\r\n", "a frame overran its size line"
        return payload

    async def chunked_body(self) -> list[bytes]:
        """The payloads of the body's chunks, up to the terminating zero-size chunk."""
        frames: list[bytes] = []
        while (payload := await self.frame()) is not None:
            frames.append(payload)
        return frames

    async def until(self, marker: bytes) -> bytes:
        """Everything up to and including ``marker``."""
        while (end := self.buffer.find(marker, self.pos)) < 0:
            if not await self._fill(len(self.buffer) - self.pos + 1):
                raise EOFError(f"connection closed before {marker!r}; unread {self.unread()!r}")
        return await self.take(end + len(marker) - self.pos)

    async def whatever_follows(self, seconds: float) -> bytes:
        """What arrives within ``seconds`` (or until EOF): bytes that should not be there."""
        with trio.move_on_after(seconds):
            while await self._fill(len(self.buffer) - self.pos + 1):
                pass
        return await self.take(len(self.buffer) - self.pos)

    def unread(self) -> bytes:
        return bytes(self.buffer[self.pos :])


def check_events(body: bytes, tokens: int) -> None:
    """``body`` is exactly the fake's chat stream: the role event, ``tokens`` content events
    in order, the finish event, then data: [DONE]; nothing lost, repeated or moved."""
    assert body.endswith(b"\n\n"), body[-300:]
    blocks = body[:-2].split(b"\n\n")
    assert blocks[-1] == b"data: [DONE]", blocks[-3:]
    contents: list[str | None] = []
    for block in blocks[:-1]:
        assert block.startswith(b"data: "), block[:300]
        (choice,) = json.loads(block[len(b"data: ") :])["choices"]
        contents.append(choice["delta"].get("content"))
    expected = ["", *(token_text(i) for i in range(tokens)), None]
    first_wrong = next(
        (i for i, (got, want) in enumerate(zip(contents, expected, strict=False)) if got != want),
        None,
    )
    assert first_wrong is None, (first_wrong, contents[max(0, first_wrong - 2) : first_wrong + 3])
    assert len(contents) == len(expected)


async def read_stream_head(conn: Conn) -> None:
    status, headers = await conn.head()
    assert status.startswith(b"HTTP/1.1 200"), status
    assert headers[b"transfer-encoding"] == b"chunked"
    assert b"content-length" not in headers
    assert headers[b"content-type"].startswith(b"text/event-stream")


async def read_stream(conn: Conn, tokens: int) -> list[bytes]:
    """Read one streamed chat response; check its head, framing and events; its frames."""
    await read_stream_head(conn)
    frames = await conn.chunked_body()
    # The relay writes whole events (several, coalesced, at most): a frame that ends
    # mid-event would mean a chunk was split or its bytes shuffled on the way.
    assert all(frame.endswith(b"\n\n") for frame in frames)
    check_events(b"".join(frames), tokens)
    return frames


# --------------------------------------------------------------------------- through the proxy


async def test_stream_is_framed_exactly_and_the_connection_stays_usable(
    nursery: trio.Nursery, observed: Observed
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=40)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        await read_stream(conn, 40)
        # Nothing after the terminator: the fast path wrote no stray bytes past h11's end.
        assert conn.unread() == b""
        # A second request on the same connection: h11's and hypercorn's state after the
        # fast path still says "response complete, keep the connection".
        await conn.post(chat_body(fake={"tokens": 7}))
        await read_stream(conn, 7)
        assert conn.unread() == b""
        assert len(fake.recorder.records) == 2
        # Both bodies took the fast path: attach gave a writer, and no body bytes went
        # through hypercorn's ASGI send (only the empty end-of-body message did).
        assert len(observed.attached) == 2
        assert all(isinstance(writer, ChunkWriter) for writer in observed.attached)
        assert observed.asgi_body_sends == 0


async def test_http10_client_gets_a_close_delimited_body_through_asgi(
    nursery: trio.Nursery, observed: Observed
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=10)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body(), version="HTTP/1.0")
        status, headers = await conn.head()
        assert status.startswith(b"HTTP/1.1 200"), status
        # An HTTP/1.0 client knows no chunked coding: the body ends where the connection does.
        assert b"transfer-encoding" not in headers
        assert b"content-length" not in headers
        assert headers[b"connection"] == b"close"
        # Not read to EOF: hypercorn under quart-trio never closes a connection after a
        # "Connection: close" response (see the report); [DONE] is the end of the stream.
        body = await conn.until(b"data: [DONE]\n\n")
        # Raw SSE from the first byte: a chunk-size line here would corrupt the stream.
        assert body.startswith(b"data: "), body[:100]
        check_events(body, 10)
        # Nor after it: no 0\r\n\r\n terminator, which an HTTP/1.0 client would read as data.
        with trio.fail_after(2):
            await observed.response_ended.wait()
        assert await conn.whatever_follows(0.05) == b""
        assert observed.attached == [None]
        assert observed.direct == []
        assert observed.asgi_body_sends > 0


async def test_non_streamed_json_keeps_its_content_length_and_asgi_send(
    nursery: trio.Nursery, observed: Observed
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=5)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body(stream=False))
        status, headers = await conn.head()
        assert status.startswith(b"HTTP/1.1 200"), status
        assert b"transfer-encoding" not in headers
        body = await conn.take(int(headers[b"content-length"]))
        answer = json.loads(body)
        assert answer["choices"][0]["message"]["content"] == "The quick brown fox jumps "
        assert observed.attached == [None]
        assert observed.direct == []
        assert observed.asgi_body_sends == 1
        # Content-Length framing ended the response exactly: the connection serves on.
        await conn.post(chat_body(fake={"tokens": 3}))
        await read_stream(conn, 3)


@pytest.mark.parametrize("forced_partial", [False, True], ids=["kernel", "forced-partial"])
async def test_producer_writes_directly_while_the_client_keeps_up(
    nursery: trio.Nursery,
    observed: Observed,
    monkeypatch: pytest.MonkeyPatch,
    forced_partial: bool,
) -> None:
    tokens = 30
    if forced_partial:
        force_partial_writes(monkeypatch)
    with trio.fail_after(DEADLINE):
        # Tokens far apart compared to a loopback write: the body task is parked on an empty
        # channel when each one arrives, which is when the producer may write it itself.
        fake = await start_fake(nursery, ttft=0.01, interval=0.005, tokens=tokens)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        await read_stream(conn, tokens)
        (writer,) = observed.attached
        assert writer is not None
        if forced_partial:
            # Direct writes that went out in part left tails that the body flushed first;
            # read_stream above found the frames whole and in order all the same.
            assert observed.direct.count(None) >= 5, observed.direct
        else:
            # Most tokens (all but the first, queued before the body starts, and any that
            # arrived together) went out from the producer without waking the body.
            assert observed.direct.count(True) >= tokens // 2, observed.direct
        # And the connection is still in a state to serve the next request.
        await conn.post(chat_body(fake={"tokens": 4}))
        await read_stream(conn, 4)


@pytest.mark.parametrize("forced_partial", [False, True], ids=["kernel", "forced-partial"])
async def test_a_client_that_stops_reading_still_gets_every_frame_in_order(
    nursery: trio.Nursery,
    observed: Observed,
    monkeypatch: pytest.MonkeyPatch,
    forced_partial: bool,
) -> None:
    tokens = 800
    capacity = 4
    if forced_partial:
        force_partial_writes(monkeypatch)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.0002, tokens=tokens)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            # Never cut off here: the client resumes as soon as the backlog is full.
            relay={"channel_capacity": capacity, "stall_timeout": DEADLINE},
        )
        observed.server_sndbuf = 4096
        conn = await Conn.open(proxy, rcvbuf=4096, mss=1460)
        await conn.post(chat_body())
        # The client reads nothing until both socket buffers are full and the relay's channel
        # holds its whole backlog: direct writes are refused or partial, the body is blocked
        # in hypercorn's protocol_send, and the producer waits on the channel.
        await proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        assert fake.recorder.last().tokens_sent < tokens  # still mid-stream when it stopped
        frames = await read_stream(conn, tokens)
        assert conn.unread() == b""
        assert len(frames) > 1
        (writer,) = observed.attached
        assert writer is not None
        # Before the buffers filled, the producer wrote (all or part of) events directly:
        # that path fed the backlog, and handed over to the channel when the socket was full.
        assert sum(result is not False for result in observed.direct) >= 10, observed.direct
        await conn.post(chat_body(fake={"tokens": 3, "interval": 0}))
        await read_stream(conn, 3)


async def test_the_tail_of_a_partial_direct_write_goes_out_before_the_next_event(
    nursery: trio.Nursery, observed: Observed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pending tail must not wait for the next token (seconds, on a slow model): the
    producer wakes the body to flush it at once."""
    tokens = 3
    in_direct_write = False
    original_write_nowait = ChunkWriter.write_nowait  # observed's recording wrapper

    def write_nowait(self: ChunkWriter, chunk: bytes) -> bool | None:
        nonlocal in_direct_write
        in_direct_write = True
        try:
            return original_write_nowait(self, chunk)
        finally:
            in_direct_write = False

    def write(fd: int, data: bytes) -> int:
        # Every direct write goes out in part; the body's flushes go out whole.
        if in_direct_write and len(data) > 1:
            data = data[: len(data) // 2]
        return os.write(fd, data)

    monkeypatch.setattr(ChunkWriter, "write_nowait", write_nowait)
    monkeypatch.setattr(chunk_writer, "os", SimpleNamespace(write=write))
    with trio.fail_after(DEADLINE):
        # Far apart, so that an event whose tail waited for the next one shows plainly.
        fake = await start_fake(nursery, ttft=0.01, interval=0.25, tokens=tokens)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        await read_stream_head(conn)
        record = fake.recorder.last()
        frames: list[bytes] = []
        received_tokens = 0
        while (payload := await conn.frame()) is not None:
            frames.append(payload)
            received_tokens += payload.count(b'"delta":{"content":"')
            # Every token the upstream has sent is whole at the client already.
            assert record.tokens_sent <= received_tokens, (record.tokens_sent, frames)
        check_events(b"".join(frames), tokens)
        assert observed.direct.count(None) >= 2, observed.direct


# --------------------------------------------------------------------------- unit level


class StandInServer:
    """What ChunkWriter uses of hypercorn's TCPServer: the send lock, and protocol_send for
    what the kernel did not take at once (as hypercorn's: under the lock, with send_all)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.send_lock = trio.Lock()
        self.sent_through: list[bytes] = []

    async def protocol_send(self, event: RawData) -> None:
        async with self.send_lock:
            self.sent_through.append(event.data)
            await self.stream.send_all(event.data)


@contextlib.asynccontextmanager
async def tcp_pair(
    *, rcvbuf: int | None = None, sndbuf: int | None = None
) -> AsyncIterator[tuple[trio.SocketStream, trio.SocketStream]]:
    """(sending, receiving): a connected pair on loopback. The sending side is the accepted
    socket, as hypercorn's is; ``rcvbuf`` is set before connecting, so the window honours it."""
    listener = trio.socket.socket()
    receiver = trio.socket.socket()
    sender = None
    try:
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        if rcvbuf is not None:
            receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await receiver.connect(listener.getsockname())
        sender, _ = await listener.accept()
        if sndbuf is not None:
            sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        listener.close()
        yield trio.SocketStream(sender), trio.SocketStream(receiver)
    finally:
        for sock in (listener, receiver, sender):
            if sock is not None:
                sock.close()


async def read_to_eof(stream: trio.SocketStream, into: bytearray) -> None:
    while data := await stream.receive_some(65536):
        into += data


def writer_over(sending: trio.SocketStream) -> tuple[ChunkWriter, StandInServer]:
    server = StandInServer(sending)
    return ChunkWriter(cast(Any, server), sending.socket, stall_timeout=30.0), server


async def test_a_partial_write_leaves_a_tail_that_goes_out_before_anything_else() -> None:
    with trio.fail_after(DEADLINE):
        async with tcp_pair(rcvbuf=4096, sndbuf=4096) as (sending, receiving):
            writer, server = writer_over(sending)
            # Distinct byte values: a tail written twice, or from the wrong offset, shows.
            big = bytes(range(256)) * 1024
            expected = bytearray()
            for _ in range(64):
                result = writer.write_nowait(big)
                expected += chunk_frame(big)  # True: all of it; None: its head, the rest pending
                if result is None:
                    break
                assert result is True
            else:
                pytest.fail("the socket took 16 MiB from a peer that reads nothing")
            # While a tail is pending, nothing may go ahead of it: the caller queues instead.
            assert writer.write_nowait(b"jumps the queue") is False
            assert server.sent_through == []
            received = bytearray()
            async with trio.open_nursery() as readers:
                readers.start_soon(read_to_eof, receiving, received)
                await writer.write(b"")  # the body's flush: only what is pending
                await writer.write(b"after")
                expected += chunk_frame(b"after")
                await sending.send_eof()
            assert received == expected
            # The pending tail waited for room itself (bounded by stall_timeout), not in
            # hypercorn's unbounded write: the connection was never broken.
            assert server.sent_through == []


async def test_nothing_is_written_while_hypercorn_holds_its_send_lock() -> None:
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, server = writer_over(sending)
            async with server.send_lock:
                # hypercorn is mid-write: a frame now would land inside its bytes.
                assert writer.write_nowait(b"early") is False
            # An empty chunk would read as the terminator of the body.
            assert writer.write_nowait(b"") is False
            assert writer.write_nowait(b"now") is True
            await writer.write(b"")  # nothing pending: writes nothing at all
            await sending.send_eof()
            received = bytearray()
            await read_to_eof(receiving, received)
            assert received == chunk_frame(b"now")


async def test_a_closed_socket_is_never_written_even_when_its_number_is_reused() -> None:
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, _receiving):
            writer, _ = writer_over(sending)
            old_fd = sending.socket.fileno()
            sending.socket.close()  # as hypercorn, or asgi.abort_transport, would
            assert sending.socket.fileno() == -1
            assert writer.write_nowait(b"into the void") is False
            async with tcp_pair() as (other_sending, other_receiving):
                # Give the old number to a live connection (the kernel would, sooner or
                # later): a writer that kept the number would now write into a stranger's
                # stream. dup2 only onto a free number, never closing anything in use.
                duplicate = None
                if old_fd not in (other_sending.socket.fileno(), other_receiving.socket.fileno()):
                    with pytest.raises(OSError):  # free: dup2 would close whatever held it
                        os.fstat(old_fd)
                    duplicate = os.dup2(other_sending.socket.fileno(), old_fd)
                try:
                    assert writer.write_nowait(b"into a stranger") is False
                finally:
                    if duplicate is not None:
                        os.close(duplicate)
                # Whatever end got the old number, each end sees only its peer's marker.
                await other_sending.send_all(b"marker one")
                await other_sending.send_eof()
                await other_receiving.send_all(b"marker two")
                await other_receiving.send_eof()
                one, two = bytearray(), bytearray()
                await read_to_eof(other_receiving, one)
                await read_to_eof(other_sending, two)
                assert (one, two) == (b"marker one", b"marker two")
