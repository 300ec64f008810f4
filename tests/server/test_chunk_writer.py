"""The writer under hypercorn (asgi.H11Wire over chunk_writer): answers written straight to
hypercorn's socket, byte-exact and in order.

A chunked body's frames bypass h11, and every head and known-length body is framed by h11 but
written by Sluice, so every test here checks the bytes on the wire against h11's own framing
(or parses them as strictly as a client must), and checks that hypercorn's view of the
connection stayed true afterwards (the next request on it works).
"""

from __future__ import annotations

import contextlib
import email.utils
import functools
import itertools
import json
import os
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import h11
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import RawData
from hypercorn.protocol.http_stream import HTTPStream

from proxy.server import asgi, chunk_writer
from proxy.server import run as proxy_server
from proxy.server.asgi import transport_socket
from proxy.server.chunk_writer import ChunkWriter, chunk_frame
from proxy.server.connection_server import ConnectionServer
from proxy.testing.fake_upstream import token_text
from tests.support import (
    DEADLINE,
    OPEN_RAW_CLIENTS,
    Proxy,
    RawClient,
    chat_body,
    connect_client,
    poll_until,
    read_request,
    start_fake,
)
from tests.support import (
    start_proxy as start_any_proxy,
)


async def start_proxy(nursery: trio.Nursery, models: dict[str, Any], **sections: Any) -> Proxy:
    """A proxy whose requests all go through hypercorn and Quart: these tests are of
    chunk_writer under hypercorn's own connection handling
    (the fast path's own are in test_fast_path.py)."""
    sections["server"] = {"fast_path": False, **sections.get("server", {})}
    return await start_any_proxy(nursery, models, **sections)


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
    """What the writer did under hypercorn, seen from outside proxy code."""

    # The wire of each answer, in order: "h11" (written straight to the socket, framed by
    # hypercorn's h11 connection) or "asgi" (through hypercorn's ASGI send).
    wires: list[str] = field(default_factory=list)
    # What H11Wire.chunked_writer returned per chunked answer: the ChunkWriter holding its
    # head, to leave with the first event.
    started: list[ChunkWriter | None] = field(default_factory=list)
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
    # Set by a test: the answers (numbered from 0, in order) written through ASGI instead, as
    # where the socket-level wire does not apply: hypercorn then makes their heads.
    through_asgi: set[int] = field(default_factory=set)


@pytest.fixture
def observed(monkeypatch: pytest.MonkeyPatch) -> Observed:
    seen = Observed()
    original_wire_for = asgi.wire_for

    def wire_for(send: Any, scope: Any) -> Any:
        if seen.server_sndbuf is not None:
            sock = transport_socket(send)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, seen.server_sndbuf)
        if len(seen.wires) in seen.through_asgi:
            wire: Any = asgi.ASGIWire(send, None, http2=False)
        else:
            wire = original_wire_for(send, scope)
        seen.wires.append("h11" if isinstance(wire, asgi.H11Wire) else "asgi")
        return wire

    # asgi.py finds it through the module, so this is the one it gets.
    monkeypatch.setattr(asgi, "wire_for", wire_for)
    original_chunked_writer = asgi.H11Wire.chunked_writer

    def chunked_writer(self: asgi.H11Wire, status: int, headers: list[tuple[bytes, bytes]]) -> Any:
        writer = original_chunked_writer(self, status, headers)
        seen.started.append(writer)
        return writer

    monkeypatch.setattr(asgi.H11Wire, "chunked_writer", chunked_writer)
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

    # Bound per request, after this patch: send_chain still finds the HTTPStream as __self__.
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

    async def post(
        self, body: dict[str, Any], *, version: str = "HTTP/1.1", extra: str = "", send: bool = True
    ) -> bytes:
        """Send a request (``extra``: more header lines, each ending in CRLF); its bytes. With
        ``send=False`` only the bytes, for a test that sends several at once."""
        payload = json.dumps(body).encode()
        head = (
            f"POST {CHAT} {version}\r\nHost: {self.host}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        if send:
            await self.stream.send_all(head + payload)
        return head + payload

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
        # Both bodies were written straight to the socket: each head was held in a writer,
        # and no body bytes went through hypercorn's ASGI send (only the empty end-of-body
        # message did).
        assert observed.wires == ["h11", "h11"]
        assert len(observed.started) == 2
        assert all(isinstance(writer, ChunkWriter) for writer in observed.started)
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
        # Read up to [DONE], the end of the stream; that the connection then closes is the
        # connection-close tests' business.
        body = await conn.until(b"data: [DONE]\n\n")
        # Raw SSE from the first byte: a chunk-size line here would corrupt the stream.
        assert body.startswith(b"data: "), body[:100]
        check_events(body, 10)
        # Nor after it: no 0\r\n\r\n terminator, which an HTTP/1.0 client would read as data.
        with trio.fail_after(2):
            await observed.response_ended.wait()
        assert await conn.whatever_follows(0.05) == b""
        # The head too went through hypercorn: no socket-level wire for an HTTP/1.0 peer (a
        # head it made would say chunked, which this client cannot read).
        assert observed.wires == ["asgi"]
        assert observed.started == []
        assert observed.direct == []
        assert observed.asgi_body_sends > 0


async def test_non_streamed_json_keeps_its_content_length_framed_by_h11(
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
        # A Content-Length body is not chunked: no writer held its head; h11 made the head
        # and framed the body (counting its bytes against the length), Sluice wrote them.
        assert observed.wires == ["h11"]
        assert observed.started == []
        assert observed.direct == []
        assert observed.asgi_body_sends == 0
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
        (writer,) = observed.started
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
        (writer,) = observed.started
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


# --------------------------------------------------------------------------- the head


@dataclass
class Wire:
    """Every write on the proxy's client connections, as it left: Sluice's own (``os.write``
    in chunk_writer: the bytes the kernel took) and hypercorn's (its RawData sends, through
    the connection server; the head of any response that went through ASGI included)."""

    direct: list[bytes] = field(default_factory=list)
    through_hypercorn: list[bytes] = field(default_factory=list)


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    seen = Wire()

    def write(fd: int, data: bytes) -> int:
        sent = os.write(fd, data)
        seen.direct.append(bytes(data[:sent]))
        return sent

    # chunk_writer writes only through os.write; the fake upstream is not hypercorn's, so
    # nothing of it shows in either list.
    monkeypatch.setattr(chunk_writer, "os", SimpleNamespace(write=write))
    original_protocol_send = ConnectionServer.protocol_send

    async def protocol_send(self: ConnectionServer, event: Any) -> None:
        if isinstance(event, RawData):
            seen.through_hypercorn.append(bytes(event.data))
        await original_protocol_send(self, event)

    # The fast path's server reaches this through super(), at call time.
    monkeypatch.setattr(ConnectionServer, "protocol_send", protocol_send)
    return seen


def head_and_rest(received: bytes) -> tuple[bytes, bytes]:
    end = received.index(b"\r\n\r\n") + 4
    return received[:end], received[end:]


def head_lines(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The status line and the header fields, in order, names lowercased."""
    status, *lines = head[: -len(b"\r\n\r\n")].split(b"\r\n")
    fields = []
    for line in lines:
        name, sep, value = line.partition(b":")
        assert sep and name == name.strip(), line  # no obs-fold, no space before the colon
        fields.append((name.lower(), value.strip()))
    return status, fields


async def closed_with_nothing_more(conn: Conn) -> None:
    """The server closes ``conn`` (EOF within a few seconds) and sends nothing before."""
    with trio.fail_after(5):
        assert not await conn._fill(1), conn.unread()[:300]
    assert conn.unread() == b""


def limit_keep_alive(monkeypatch: pytest.MonkeyPatch, requests: int) -> None:
    """Proxies started from now on serve at most ``requests`` requests per connection
    (hypercorn's keep_alive_max_requests; serve() builds its config per call)."""
    original = proxy_server.hypercorn_config

    def hypercorn_config(config: Any) -> HypercornConfig:
        hyper = original(config)
        hyper.keep_alive_max_requests = requests
        return hyper

    monkeypatch.setattr(proxy_server, "hypercorn_config", hypercorn_config)


async def test_the_head_leaves_with_the_first_event_in_one_write(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=5)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        frames = await read_stream(conn, 5)
        received = bytes(conn.buffer)  # all of it: Conn drops read bytes only past 64 KiB
        (writer,) = observed.started
        assert writer is not None
        head, _ = head_and_rest(received)
        # The very first write on the connection is the head and the first event's frame,
        # exactly: not the head alone (a second write, and a trip through hypercorn's send
        # path, before the token), nor the event without its head.
        assert wire.direct[0].startswith(b"HTTP/1.1 200 ")
        assert wire.direct[0] == head + chunk_frame(frames[0])
        # hypercorn wrote no head: only the terminator went through it, after the body.
        assert not any(data.startswith(b"HTTP/") for data in wire.through_hypercorn)
        assert wire.through_hypercorn == [b"0\r\n\r\n"]
        # And every byte the client got is one of those writes, in that order: nothing was
        # written twice, nor left out.
        assert b"".join(wire.direct) + b"0\r\n\r\n" == received


async def test_the_head_is_the_one_hypercorn_sends(
    nursery: trio.Nursery, observed: Observed, wire: Wire, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first response's head goes through ASGI (hypercorn's H11Protocol), the second's is
    # the writer's: on the same connection, so the same h11 connection and config.
    observed.through_asgi = {0}
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=3)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        heads = []
        for _ in range(2):
            await conn.post(chat_body(fake={"tokens": 3}))
            heads.append(head_lines(await conn.until(b"\r\n\r\n")))
            check_events(b"".join(await conn.chunked_body()), 3)
        assert conn.unread() == b""
        # The test did what it says: hypercorn sent the first head, the writer the second.
        assert [data[:9] for data in wire.through_hypercorn if data.startswith(b"HTTP/")] == [
            b"HTTP/1.1 "
        ]
        assert observed.wires == ["asgi", "h11"]
        assert len(observed.started) == 1 and observed.started[0] is not None
        assert [data[:13] for data in wire.direct if data.startswith(b"HTTP/")] == [
            b"HTTP/1.1 200 "
        ]
        (asgi_status, asgi_fields), (fast_status, fast_fields) = heads
        assert fast_status == asgi_status == b"HTTP/1.1 200 OK"
        # Same fields, in the same order; the same values but for the date (a clock) and
        # the request id (per request).
        assert [name for name, _ in fast_fields] == [name for name, _ in asgi_fields]
        varying = {b"date", b"x-request-id"}
        assert [field for field in fast_fields if field[0] not in varying] == [
            field for field in asgi_fields if field[0] not in varying
        ]
        fast = dict(fast_fields)
        names = [name for name, _ in fast_fields]
        # hypercorn's own response headers, each exactly once, as its config makes them.
        hyper_names = [
            name for name, _ in proxy_server.hypercorn_config(proxy.config).response_headers("h11")
        ]
        assert hyper_names == [b"date", b"server"]
        for name in hyper_names:
            assert names.count(name) == 1, names
        assert fast[b"server"] == b"hypercorn-h11"
        sent_at = email.utils.parsedate_to_datetime(fast[b"date"].decode())
        assert abs(sent_at.timestamp() - time.time()) < 60
        # The app's and h11's.
        assert fast[b"content-type"].startswith(b"text/event-stream")
        assert len(fast[b"x-request-id"]) == 32
        assert fast[b"x-request-id"] != dict(asgi_fields)[b"x-request-id"]
        assert fast[b"transfer-encoding"] == b"chunked"
        assert names.count(b"transfer-encoding") == 1
        assert b"content-length" not in fast
        assert b"connection" not in fast  # keep-alive is HTTP/1.1's default


async def test_streams_one_after_another_on_one_connection(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        for tokens in (4, 9, 2):
            await conn.post(chat_body(fake={"tokens": tokens}))
            await read_stream(conn, tokens)
        assert conn.unread() == b""
        # Each head was the writer's, each with its first event: h11 and hypercorn's stream
        # state moved by the wire were right for the next request each time.
        assert len(observed.started) == 3 and None not in observed.started
        heads = [data for data in wire.direct if data.startswith(b"HTTP/")]
        assert len(heads) == 3
        assert all(_SIZE_LINE.match(head_and_rest(head)[1]) for head in heads), heads
        assert not any(data.startswith(b"HTTP/") for data in wire.through_hypercorn)


async def test_pipelined_streams_each_get_their_own_head(
    nursery: trio.Nursery, observed: Observed
) -> None:
    """Both requests in one packet: hypercorn holds the second (h11 PAUSED) until the first
    response is complete, then starts it; the writer must find the new cycle."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        first = await conn.post(chat_body(fake={"tokens": 6}), send=False)
        second = await conn.post(chat_body(fake={"tokens": 3}), send=False)
        await conn.stream.send_all(first + second)
        await read_stream(conn, 6)
        await read_stream(conn, 3)
        assert conn.unread() == b""
        assert len(observed.started) == 2 and None not in observed.started


@pytest.mark.parametrize("last_head", ["fast", "asgi"])
async def test_the_last_request_allowed_on_a_connection_gets_connection_close(
    nursery: trio.Nursery,
    observed: Observed,
    wire: Wire,
    monkeypatch: pytest.MonkeyPatch,
    last_head: str,
) -> None:
    limit_keep_alive(monkeypatch, 3)
    if last_head == "asgi":
        # The reference: the same request with the head made by hypercorn itself.
        observed.through_asgi = {2}
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=3)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        for _ in range(2):
            await conn.post(chat_body(fake={"tokens": 3}))
            _, headers = await conn.head()
            assert b"connection" not in headers  # below the limit: kept alive
            check_events(b"".join(await conn.chunked_body()), 3)
        await conn.post(chat_body(fake={"tokens": 3}))
        status, headers = await conn.head()
        assert status.startswith(b"HTTP/1.1 200 ")
        # The third is the last hypercorn allows (keep_alive_requests >= max): it says so...
        assert headers[b"connection"] == b"close"
        assert headers[b"transfer-encoding"] == b"chunked"
        check_events(b"".join(await conn.chunked_body()), 3)
        # ...and then closes the connection, right after the terminator, with nothing more.
        await closed_with_nothing_more(conn)
        heads = [data for data in wire.direct if data.startswith(b"HTTP/")]
        assert len(heads) == (3 if last_head == "fast" else 2)
        assert observed.wires == ["h11", "h11", "h11" if last_head == "fast" else "asgi"]
        assert len(observed.started) == (3 if last_head == "fast" else 2)
        assert None not in observed.started


async def test_a_client_asking_to_close_gets_connection_close_and_a_closed_connection(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=3)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body(), extra="Connection: close\r\n")
        status, headers = await conn.head()
        assert status.startswith(b"HTTP/1.1 200 ")
        # h11 made the head, and h11 honours the client's close (as it does under hypercorn).
        assert headers[b"connection"] == b"close"
        check_events(b"".join(await conn.chunked_body()), 3)
        await closed_with_nothing_more(conn)
        assert observed.started[0] is not None
        assert wire.direct[0].startswith(b"HTTP/1.1 200 ")


async def serve_sse_upstream(nursery: trio.Nursery, answer: bytes) -> tuple[str, list[bytes]]:
    """An upstream that answers every request with ``answer``, then closes: its URL, and the
    requests it got."""
    requests: list[bytes] = []

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request = await read_request(stream)
            if request is None:
                return
            head, _ = request
            assert re.search(rb"(?i)\r\ncontent-length: *\d+", head), head
            requests.append(head)
            await stream.send_all(answer)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}", requests


def sse_answer(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )


async def test_a_stream_of_only_done_gets_its_head_before_the_terminator(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    """The head is decided by the first event, and goes with it: an upstream whose only event
    is [DONE] still makes a whole, well-formed chunked response."""
    with trio.fail_after(DEADLINE):
        url, requests = await serve_sse_upstream(nursery, sse_answer(b"data: [DONE]\n\n"))
        proxy = await start_proxy(nursery, {"fake-model": [url]})
        conn = await Conn.open(proxy)
        for _ in range(2):
            await conn.post(chat_body())
            await read_stream_head(conn)
            assert await conn.chunked_body() == [b"data: [DONE]\n\n"]
        assert conn.unread() == b""
        assert len(requests) == 2
        assert len(observed.started) == 2 and None not in observed.started
        received = bytes(conn.buffer)
        head, _ = head_and_rest(received)
        # Head, [DONE], then hypercorn's terminator: never the terminator before the head.
        assert wire.direct[0] == head + chunk_frame(b"data: [DONE]\n\n")
        assert wire.through_hypercorn == [b"0\r\n\r\n", b"0\r\n\r\n"]


async def test_an_upstream_that_ends_before_any_event_gets_an_error_with_its_length(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    with trio.fail_after(DEADLINE):
        # A 200 event stream with nothing in it: no first event, so no head was decided;
        # the relay answers 502 with a Content-Length body instead.
        url, requests = await serve_sse_upstream(nursery, sse_answer(b""))
        proxy = await start_proxy(nursery, {"fake-model": [url]})
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        status, headers = await conn.head()
        assert status.startswith(b"HTTP/1.1 502"), status
        assert b"transfer-encoding" not in headers
        error = json.loads(await conn.take(int(headers[b"content-length"])))
        assert error["error"]["code"] == "upstream_protocol_error"
        assert requests  # it did ask the upstream
        # A Content-Length body: no writer held its head; h11 framed the head and the body,
        # which the writer wrote (its last byte once the relay had closed), and hypercorn
        # wrote nothing of it (h11's end of a Content-Length body is no bytes at all).
        assert observed.wires == ["h11"]
        assert observed.started == []
        assert wire.direct[0].startswith(b"HTTP/1.1 502 ")
        assert b"".join(wire.direct) == bytes(conn.buffer[: conn.pos])
        assert b"".join(wire.through_hypercorn) == b""
        # The connection serves on (Content-Length framing ended that response exactly).
        assert b"connection" not in headers


async def test_a_client_gone_before_the_first_event_gets_no_head_and_the_proxy_serves_on(
    nursery: trio.Nursery, observed: Observed, wire: Wire
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.002, tokens=3)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        leaving = await RawClient.post(proxy, CHAT, chat_body(fake={"ttft": 30}))
        await fake.recorder.wait_for(lambda recorder: len(recorder.records) == 1)
        await leaving.close()
        await proxy.state.tracker.wait_idle()
        # No head was decided, so none was made or written, by either path.
        assert observed.started == []
        assert wire.direct == []
        assert wire.through_hypercorn == []
        # A client that only half-closes (its EOF is the proxy's word that it left) and
        # keeps reading: it must see the connection end with no byte at all, not a head
        # that nothing follows.
        half = await Conn.open(proxy)
        await half.post(chat_body(fake={"ttft": 30}))
        await fake.recorder.wait_for(lambda recorder: len(recorder.records) == 2)
        await half.stream.send_eof()
        await closed_with_nothing_more(half)
        await proxy.state.tracker.wait_idle()
        assert observed.started == []
        assert wire.direct == []
        # And the proxy serves the next client as ever: head and first event in one write.
        conn = await Conn.open(proxy)
        await conn.post(chat_body())
        frames = await read_stream(conn, 3)
        assert len(observed.started) == 1 and observed.started[0] is not None
        head, _ = head_and_rest(bytes(conn.buffer))
        assert wire.direct[0] == head + chunk_frame(frames[0])


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


async def all_sent(sending: trio.SocketStream, receiving: trio.SocketStream) -> bytearray:
    """Everything written on ``sending``, read on ``receiving`` once ``sending`` half-closes."""
    await sending.send_eof()
    received = bytearray()
    await read_to_eof(receiving, received)
    return received


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
            received = await all_sent(sending, receiving)
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
                assert (bytes(one), bytes(two)) == (b"marker one", b"marker two")


# A head as the wire leaves it held: what the first write must carry before any frame.
HEAD = (
    b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ndate: Sun, 29 Nov 2026 21:00:00 GMT\r\n"
    b"server: hypercorn-h11\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def limit_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[bytes]]:
    """chunk_writer's writes, each cut to the next size in the returned list while it holds
    any (an empty list: writes go out whole), as a kernel with that little room would; and
    the bytes each write offered."""
    sizes: list[int] = []
    offered: list[bytes] = []

    def write(fd: int, data: bytes) -> int:
        offered.append(bytes(data))
        if sizes:
            data = data[: sizes.pop(0)]
        return os.write(fd, data)

    monkeypatch.setattr(chunk_writer, "os", SimpleNamespace(write=write))
    return sizes, offered


async def test_a_pending_head_goes_out_with_the_chunk_in_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, offered = limit_writes(monkeypatch)
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, server = writer_over(sending)
            writer._pending = HEAD
            assert writer.write_nowait(b"data: first\n\n") is True
            assert writer._pending == b""
            assert offered == [HEAD + chunk_frame(b"data: first\n\n")]
            # The head went once: the next chunk is only its frame.
            assert writer.write_nowait(b"data: second\n\n") is True
            received = await all_sent(sending, receiving)
            assert received == HEAD + chunk_frame(b"data: first\n\n") + chunk_frame(
                b"data: second\n\n"
            )
            assert server.sent_through == []


async def test_a_pending_head_is_kept_whole_while_hypercorn_holds_its_send_lock() -> None:
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, _ = writer_over(sending)
            writer._pending = HEAD
            async with _lock_held(writer):
                assert writer.write_nowait(b"data: first\n\n") is False
            assert writer._pending == HEAD
            await writer.write(b"data: first\n\n")  # the body's write of the queued chunk
            assert writer._pending == b""
            received = await all_sent(sending, receiving)
            assert received == HEAD + chunk_frame(b"data: first\n\n")


@contextlib.asynccontextmanager
async def _lock_held(writer: ChunkWriter) -> AsyncIterator[None]:
    async with writer._server.send_lock:
        yield


async def test_short_writes_through_a_pending_head_keep_every_byte_once_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes, offered = limit_writes(monkeypatch)
    chunk = b"data: " + bytes(range(256)) * 4 + b"\n\n"
    frame = chunk_frame(chunk)
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, server = writer_over(sending)
            writer._pending = HEAD
            # The kernel takes less than the head: the chunk was not taken (the caller queues
            # it), and the head's rest stays pending, ahead of it.
            sizes.append(5)
            assert writer.write_nowait(chunk) is False
            assert offered == [HEAD + frame]  # the head and the chunk, offered as one write
            assert writer._pending == HEAD[5:]
            # Into the chunk: it counts as taken (None: in part), its exact rest pending.
            sizes.append(len(HEAD) - 5 + 3)
            assert writer.write_nowait(chunk) is None
            assert offered[-1] == HEAD[5:] + frame
            assert writer._pending == frame[3:]
            # The body's flush: exactly the rest.
            await writer.write(b"")
            assert offered[-1] == frame[3:]
            assert writer._pending == b""
            received = await all_sent(sending, receiving)
            # Every byte once, in order: no part of the head twice, no frame byte ahead of it.
            assert received == HEAD + frame
            assert server.sent_through == []


async def test_a_write_that_takes_exactly_the_pending_head_takes_none_of_the_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sizes, offered = limit_writes(monkeypatch)
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, _ = writer_over(sending)
            writer._pending = HEAD
            sizes.append(len(HEAD))
            # Nothing of the chunk went: False, so the caller queues it, and nothing is left
            # pending (the head is out whole).
            assert writer.write_nowait(b"data: first\n\n") is False
            assert writer._pending == b""
            await writer.write(b"data: first\n\n")
            assert offered[-1] == chunk_frame(b"data: first\n\n")
            received = await all_sent(sending, receiving)
            assert received == HEAD + chunk_frame(b"data: first\n\n")


async def test_a_short_write_of_a_pending_head_then_the_body_writes_the_rest_and_the_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay's path after write_nowait gave False: the chunk is queued, and the body's
    write() of it carries what is left of the head first."""
    sizes, offered = limit_writes(monkeypatch)
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, server = writer_over(sending)
            writer._pending = HEAD
            sizes.append(17)
            assert writer.write_nowait(b"data: first\n\n") is False
            assert writer._pending == HEAD[17:]
            await writer.write(b"data: first\n\n")
            assert offered[-1] == HEAD[17:] + chunk_frame(b"data: first\n\n")  # one write
            assert writer._pending == b""
            received = await all_sent(sending, receiving)
            assert received == HEAD + chunk_frame(b"data: first\n\n")
            assert server.sent_through == []


async def test_a_head_with_no_chunk_after_it_goes_out_on_the_final_flush() -> None:
    """A body that ends with no chunk (the relay's write(b"") before the terminator) still
    writes the head: hypercorn's 0\\r\\n\\r\\n must never be the first bytes."""
    with trio.fail_after(DEADLINE):
        async with tcp_pair() as (sending, receiving):
            writer, _ = writer_over(sending)
            writer._pending = HEAD
            assert writer.write_nowait(b"") is False  # an empty chunk is never written
            assert writer._pending == HEAD
            await writer.write(b"")
            assert writer._pending == b""
            received = await all_sent(sending, receiving)
            assert received == HEAD
