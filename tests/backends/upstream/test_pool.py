"""The upstream pool (proxy/upstream_pool.py) against small hand-written HTTP/1.1 servers.

Each server counts the TCP connections it accepts and notes when the client closes one (EOF or
reset), so every test can say which connection a request used and whether a connection the
pool let go of was really closed. The pool tests run over both transports the pool has: plain
TCP (http://, :class:`PlainTransport`) and TLS (https://, :class:`TLSTransport`, against a
server whose certificate comes from a throwaway trustme CA).
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import httpx
import pytest
import trio
import trio.testing
import trustme

from proxy.backends.upstream.pool import (
    KeepAlivePool,
    Origin,
    PlainTransport,
    TLSTransport,
    Transport,
    UpstreamConnection,
    UpstreamRequest,
    UpstreamResponse,
    connect,
)
from proxy.protocol import http1
from tests.support import DEADLINE, poll_until

BODY = b"hello"
# A client's close reaches the server within milliseconds on loopback; 50 ms leaves room for a
# loaded CI machine (the same bound as test_lifetime's).
CLOSE_BOUND = 0.05


# -- the transports under test -----------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """How the pool reaches the test servers: plain TCP, or TLS (both contexts set)."""

    name: str
    server_context: ssl.SSLContext | None = None
    client_context: ssl.SSLContext | None = None

    @property
    def tls(self) -> bool:
        return self.server_context is not None

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def url(self, port: int) -> str:
        return f"{self.scheme}://127.0.0.1:{port}/"

    def origin(self, port: int) -> Origin:
        return Origin(self.scheme, "127.0.0.1", port)


PLAIN = Backend("plain")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls(ca: trustme.CA) -> Backend:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    return Backend("tls", server_context, client_context)


@pytest.fixture(params=["plain", "tls"])
def backend(request: pytest.FixtureRequest, tls: Backend) -> Backend:
    return PLAIN if request.param == "plain" else tls


def raw_socket(transport: Transport) -> Any:
    """The TCP socket under a transport (a stdlib socket for plain, trio's under TLS)."""
    if isinstance(transport, PlainTransport):
        return transport.socket
    assert isinstance(transport, TLSTransport)
    return transport._stream.transport_stream.socket


# -- the servers ---------------------------------------------------------------------------------


@dataclass(eq=False)
class ServerConnection:
    """One accepted TCP connection, as the server saw it."""

    index: int
    # The TCP stream, or a server-side SSLStream over it (its handshake runs in the first
    # receive).
    stream: trio.abc.Stream
    tcp: trio.SocketStream
    buffer: bytes = b""
    requests: int = 0
    # What each receive returned, in order (b"" for the end).
    reads: list[bytes] = field(default_factory=list)
    request_seen: trio.Event = field(default_factory=trio.Event)
    # Set by a test to let a behaviour go on.
    proceed: trio.Event = field(default_factory=trio.Event)
    # The client closed its end (EOF, or a reset when it left bytes unread; under TLS also a
    # failed handshake, or a close without close_notify).
    gone: trio.Event = field(default_factory=trio.Event)
    gone_at: float | None = None
    # The server closed its end.
    closed: trio.Event = field(default_factory=trio.Event)

    async def receive(self) -> bytes:
        try:
            data = bytes(await self.stream.receive_some(65536))
        except trio.BrokenResourceError:
            data = b""
        self.reads.append(data)
        if not data and not self.gone.is_set():
            self.gone_at = trio.current_time()
            self.gone.set()
        return data

    async def read_request(self) -> bool:
        """Reads one request head (the tests send only GETs, no body); False at EOF."""
        while b"\r\n\r\n" not in self.buffer:
            data = await self.receive()
            if not data:
                return False
            self.buffer += data
        _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        self.requests += 1
        self.request_seen.set()
        return True

    def response(
        self, body: bytes = BODY, *, length: int | None = None, headers: str = ""
    ) -> bytes:
        """A keep-alive response (no ``Connection: close``) naming this connection."""
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Length: {len(body) if length is None else length}\r\n"
            f"X-Conn: {self.index}\r\n{headers}\r\n"
        )
        return head.encode() + body

    async def respond(self, body: bytes = BODY, **kwargs: Any) -> None:
        # One send: the head and the body arrive together (one TLS record under TLS).
        await self.stream.send_all(self.response(body, **kwargs))

    async def wait_gone(self) -> None:
        while await self.receive():
            pass

    async def close(self) -> None:
        """Close as a well-behaved server does: under TLS with a close_notify first. (The
        RawServer's own close, in its finally, is forceful: no close_notify.)"""
        await self.stream.aclose()

    def sees_eof_now(self) -> bool:
        """Whether the kernel already holds the client's FIN for this connection: a peek
        through a duplicate of its descriptor, so no trio task runs (and so the client's
        request task cannot have closed anything in the meantime). Under TLS as well: by then
        the server has read every byte the client sent before its FIN."""
        sock = self.tcp.socket
        with socket.fromfd(sock.fileno(), sock.family, sock.type) as peek:
            try:
                return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:
                return False
            except ConnectionResetError:
                return True


Behaviour = Callable[[ServerConnection], Awaitable[None]]


async def keep_alive(conn: ServerConnection) -> None:
    while await conn.read_request():
        await conn.respond()


async def respond_once_then_close(conn: ServerConnection) -> None:
    """Closes an idle keep-alive connection, as servers do after their own idle timeout."""
    if await conn.read_request():
        await conn.respond()


async def stop_mid_body(conn: ServerConnection) -> None:
    """Sends the head and the start of a long body, then nothing more."""
    if await conn.read_request():
        await conn.respond(length=1_000_000)
        await conn.wait_gone()


async def silent(conn: ServerConnection) -> None:
    """Reads the request and never answers."""
    if await conn.read_request():
        await conn.wait_gone()


async def malformed_status_line(conn: ServerConnection) -> None:
    if await conn.read_request():
        await conn.stream.send_all(b"HTTP/1.1 banana\r\n\r\n")
        await conn.wait_gone()


async def truncated_body(conn: ServerConnection) -> None:
    """Promises 100 bytes, sends 5, and closes (cleanly: under TLS a close_notify says this is
    the server's close, so the client's error is the response's, not the transport's)."""
    if await conn.read_request():
        await conn.respond(length=100)
        await conn.close()


async def never_handshakes(conn: ServerConnection) -> None:
    """A TCP server that takes a connection and says nothing (a TLS client's hello unread)."""
    await conn.wait_gone()


class RawServer:
    def __init__(self, behaviour: Behaviour, backend: Backend = PLAIN) -> None:
        self.behaviour = behaviour
        self.backend = backend
        self.connections: list[ServerConnection] = []
        self.url = ""
        self.port = 0

    async def start(self, nursery: trio.Nursery) -> RawServer:
        serve = partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, self._handle, 0)
        self.port = listeners[0].socket.getsockname()[1]
        self.url = self.backend.url(self.port)
        return self

    async def _handle(self, tcp: trio.SocketStream) -> None:
        context = self.backend.server_context
        stream: trio.abc.Stream = (
            tcp if context is None else trio.SSLStream(tcp, context, server_side=True)
        )
        conn = ServerConnection(len(self.connections), stream, tcp)
        self.connections.append(conn)
        try:
            await self.behaviour(conn)
        finally:
            await trio.aclose_forcefully(stream)
            conn.closed.set()


async def start_server(
    nursery: trio.Nursery, behaviour: Behaviour, backend: Backend = PLAIN
) -> RawServer:
    return await RawServer(behaviour, backend).start(nursery)


@asynccontextmanager
async def pooled_client(
    backend: Backend, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, KeepAlivePool]]:
    """An httpx client over a KeepAlivePool, built as UpstreamReplica builds its own (with a
    client context that trusts the test CA, for TLS)."""
    settings = {
        "max_keepalive": 8,
        "keepalive_expiry": 60.0,
        "ssl_context": backend.client_context,
        **settings,
    }
    pool = KeepAlivePool(**settings)
    async with httpx.AsyncClient(transport=pool, trust_env=False) as client:
        yield client, pool


def upstream_get(
    url: str, *, connect_timeout: float | None = None, read_timeout: float | None = None
) -> UpstreamRequest:
    """A request as the relay sends it on ``pool.stream``, Host header included."""
    parsed = httpx.URL(url)
    return UpstreamRequest(
        Origin.of(parsed),
        b"GET",
        parsed.raw_path,
        [(b"host", parsed.netloc)],
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
    )


async def read_body(response: UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in response.chunks()])


async def _request_seen(server: RawServer) -> None:
    await poll_until(lambda: server.connections)
    await server.connections[0].request_seen.wait()


@contextmanager
def unreachable_port() -> Iterator[int]:
    """A listener that never accepts, with its backlog full: the kernel drops further SYNs, so
    a connect hangs like one to an unreachable host, without leaving loopback. (As in
    test_harness.)"""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        yield listener.getsockname()[1]


# -- reuse, LIFO, expiry, bounds ---------------------------------------------------------------


async def test_sequential_requests_reuse_one_connection(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (client, pool):
            for _ in range(2):
                response = await client.get(server.url)
                assert response.status_code == 200
                assert response.content == BODY  # read in full: the connection goes back
                assert response.headers["x-conn"] == "0"
            assert len(server.connections) == 1
            assert server.connections[0].requests == 2
            (idle,) = pool.connections()
            assert idle.is_idle()
            assert isinstance(idle.transport, TLSTransport if backend.tls else PlainTransport)
            assert not server.connections[0].gone.is_set()


async def test_the_most_recently_released_connection_is_taken_first(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (client, pool):
            # Two responses open at once need two connections. Reading a body in full releases
            # its connection (httpx closes the response at the end), so the order of the reads
            # is the order of the releases: connection 1 first, then the older connection 0,
            # which ends on top. A FIFO pool, or one preferring its newest connection, would
            # take connection 1 next.
            async with (
                client.stream("GET", server.url) as first,
                client.stream("GET", server.url) as second,
            ):
                assert (first.headers["x-conn"], second.headers["x-conn"]) == ("0", "1")
                assert await second.aread() == BODY
                assert await first.aread() == BODY
            assert len(pool.connections()) == 2
            response = await client.get(server.url)
            assert response.headers["x-conn"] == "0"
            assert len(server.connections) == 2
            assert len(pool.connections()) == 2  # both kept, neither closed
            assert not any(conn.gone.is_set() for conn in server.connections)


async def test_a_response_closed_half_read_closes_its_connection(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body, backend)
        async with pooled_client(backend) as (client, pool):
            async with client.stream("GET", server.url) as response:
                # aclosing: the test stops iterating mid-body, as a relay whose client left.
                # (An async generator, typed as a plain iterator.)
                raw = cast(AsyncGenerator[bytes, None], response.aiter_raw())
                async with aclosing(raw) as chunks:
                    assert await anext(chunks) == BODY
                assert len(pool.connections()) == 1  # busy while the response is open
            # The rest of the body will never be read: the connection cannot serve another
            # request, and the upstream must see the close (that is how it learns to abort).
            assert pool.connections() == []
            (conn,) = server.connections
            await conn.gone.wait()


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, respond_once_then_close, backend)
        async with pooled_client(backend) as (client, pool):
            assert (await client.get(server.url)).headers["x-conn"] == "0"
            (idle,) = pool.connections()
            await server.connections[0].closed.wait()
            # Wait for the server's FIN to arrive (immediate on loopback; polled so the test
            # cannot race it). Before it arrives no client could know; after, reusing the
            # socket would fail the request with "server disconnected without a response".
            await poll_until(lambda: idle.has_expired(60.0))
            response = await client.get(server.url)
            assert response.status_code == 200
            assert response.headers["x-conn"] == "1"
            assert len(server.connections) == 2
            assert idle.is_closed()
            assert idle not in pool.connections()


class FrozenTime:
    """Stands in for ``proxy.backends.upstream.pool.monotonic``, the only clock keep-alive expiry
    reads: expiry is tested to the millisecond, without sleeping. (trio's clock is untouched.)"""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def frozen_time(monkeypatch: pytest.MonkeyPatch) -> FrozenTime:
    frozen = FrozenTime()
    # raising=True (the default): if the pool stops reading its clock this way, this fails
    # loudly instead of the expiry tests silently testing nothing.
    monkeypatch.setattr("proxy.backends.upstream.pool.monotonic", frozen.monotonic)
    return frozen


async def test_an_idle_connection_past_keepalive_expiry_is_not_reused(
    backend: Backend, nursery: trio.Nursery, frozen_time: FrozenTime
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend, keepalive_expiry=5.0) as (client, pool):
            await client.get(server.url)
            frozen_time.now += 4.9  # idle, but not for long enough
            assert (await client.get(server.url)).headers["x-conn"] == "0"
            frozen_time.now += 5.1  # idle since the second response: past expiry
            response = await client.get(server.url)
            assert response.status_code == 200
            assert response.headers["x-conn"] == "1"
            # The expired connection was closed, not just skipped.
            await server.connections[0].gone.wait()
            assert len(pool.connections()) == 1
            assert not server.connections[1].gone.is_set()


async def test_the_longest_idle_connection_is_pruned_once_expired(
    backend: Backend, nursery: trio.Nursery, frozen_time: FrozenTime
) -> None:
    """Only the top of the stack is taken; the bottom (longest idle) is checked on the way, so
    a stack that shrank in use does not hold dead sockets for ever."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend, keepalive_expiry=5.0) as (client, pool):
            async with (
                client.stream("GET", server.url) as first,
                client.stream("GET", server.url) as second,
            ):
                # Each read in full releases its connection (see the LIFO test).
                await second.aread()  # connection 1: bottom of the stack, expires at 5
                frozen_time.now += 3
                await first.aread()  # connection 0: top of the stack, expires at 8
            frozen_time.now += 2.5
            response = await client.get(server.url)
            assert response.headers["x-conn"] == "0"  # the top one, still fresh, reused
            await server.connections[1].gone.wait()  # the bottom one closed on the way
            (kept,) = pool.connections()
            assert kept.is_idle()
            assert len(server.connections) == 2


async def test_max_keepalive_bounds_the_idle_connections(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend, max_keepalive=1) as (client, pool):
            async with (
                client.stream("GET", server.url) as first,
                client.stream("GET", server.url) as second,
            ):
                # Each read in full releases its connection (see the LIFO test).
                await second.aread()  # connection 1: kept (the pool had room for one)
                await first.aread()  # connection 0: no room left, closed
                assert len(pool.connections()) == 1
                await server.connections[0].gone.wait()
            # The kept one is open and reused.
            assert (await client.get(server.url)).headers["x-conn"] == "1"
            assert len(server.connections) == 2
            assert not server.connections[1].gone.is_set()


# -- what goes over the wire ---------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_response_whose_head_and_body_arrive_in_one_read(
    backend: Backend, framing: str, nursery: trio.Nursery
) -> None:
    """The body bytes read along with the head are the first chunk; a response complete in
    that one read needs no other read, and its connection is kept."""

    async def whole_response_at_once(conn: ServerConnection) -> None:
        while await conn.read_request():
            if framing == "chunked":
                head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                await conn.stream.send_all(head.encode() + b"5\r\nhello\r\n0\r\n\r\n")
            else:
                await conn.respond()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, whole_response_at_once, backend)
        async with pooled_client(backend) as (_, pool):
            for _ in range(2):
                async with pool.stream(upstream_get(server.url)) as response:
                    (connection,) = pool.connections()
                    # Complete before the body was asked for: it all came with the head (one
                    # send on loopback, one TLS record, is one read).
                    assert connection.response_complete
                    chunks = response.chunks()
                    assert await anext(chunks) == BODY
                    with pytest.raises(StopAsyncIteration):
                        await anext(chunks)
            assert len(server.connections) == 1
            assert server.connections[0].requests == 2


async def test_a_response_trickled_a_byte_at_a_time_reads_the_same(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """Every boundary of the head and of the chunked framing split across reads."""
    content = b"hello, world"
    response = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: yes\r\n\r\n"
    )

    async def trickle(conn: ServerConnection) -> None:
        while await conn.read_request():
            for byte in response:
                await conn.stream.send_all(bytes([byte]))
                # Lets the client read each byte by itself (mostly: a slow client may get two).
                await trio.testing.wait_all_tasks_blocked()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, trickle, backend)
        async with pooled_client(backend) as (client, pool):
            for _ in range(2):
                async with client.stream("GET", server.url) as streamed:
                    chunks = [chunk async for chunk in streamed.aiter_raw()]
                assert b"".join(chunks) == content
                assert len(chunks) > 2  # it did come in pieces
            # Read to its end, trailers included: kept, and reused.
            assert len(server.connections) == 1
            assert len(pool.connections()) == 1


async def test_a_request_head_and_body_leave_in_one_write(
    backend: Backend, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One write per request (the head and the body used to go out in two): the server gets
    the whole request in its first read."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    writes: list[bytes] = []

    def spy(original: Callable[[Any, bytes], Awaitable[None]]) -> Any:
        async def write(self: Any, data: bytes) -> None:
            writes.append(bytes(data))
            await original(self, data)

        return write

    monkeypatch.setattr(PlainTransport, "write", spy(PlainTransport.write))
    monkeypatch.setattr(TLSTransport, "write", spy(TLSTransport.write))

    async def read_once_then_respond(conn: ServerConnection) -> None:
        # One receive only: a request sent in two writes could arrive in two reads.
        if await conn.receive():
            await conn.respond()
            await conn.wait_gone()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, read_once_then_respond, backend)
        host = f"127.0.0.1:{server.port}".encode()
        headers = [(b"host", host), (b"content-length", str(len(body)).encode())]
        request = UpstreamRequest(
            backend.origin(server.port), b"POST", b"/v1/chat/completions", headers, body
        )
        async with pooled_client(backend) as (_, pool), pool.stream(request) as response:
            assert await read_body(response) == BODY
        expected = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host + b"\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        assert writes == [expected]
        (conn,) = server.connections
        await conn.gone.wait()
        assert conn.reads[0] == expected


async def test_a_connection_close_response_does_not_keep_its_connection(
    backend: Backend, nursery: trio.Nursery
) -> None:
    async def respond_with_close(conn: ServerConnection) -> None:
        if await conn.read_request():
            await conn.respond(headers="Connection: close\r\n")
            # The server leaves its end open: the client's close is the one the test sees.
            await conn.wait_gone()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, respond_with_close, backend)
        async with pooled_client(backend) as (client, pool):
            response = await client.get(server.url)
            assert response.content == BODY
            assert pool.connections() == []
            await server.connections[0].gone.wait()
            assert (await client.get(server.url)).headers["x-conn"] == "1"


async def test_bytes_after_a_response_make_its_connection_unusable(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """What follows a response on a kept connection would be read as the next response's
    start: such a connection is closed, not kept."""

    async def respond_with_extra(conn: ServerConnection) -> None:
        while await conn.read_request():
            await conn.stream.send_all(conn.response() + b"HTTP/1.1 200 OK\r\n")

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, respond_with_extra, backend)
        async with pooled_client(backend) as (client, pool):
            for index in range(2):
                response = await client.get(server.url)
                assert response.content == BODY
                assert response.headers["x-conn"] == str(index)
                assert pool.connections() == []
                await server.connections[index].gone.wait()


async def test_a_response_without_a_length_is_read_until_the_close(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """No Content-Length, not chunked: the body ends when the server closes (a clean close,
    under TLS with a close_notify), and so the connection cannot be kept."""

    async def until_close(conn: ServerConnection) -> None:
        if await conn.read_request():
            await conn.stream.send_all(b"HTTP/1.1 200 OK\r\nX-Conn: 0\r\n\r\n" + BODY)
            await conn.proceed.wait()
            await conn.stream.send_all(b", more")
            await conn.close()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, until_close, backend)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(upstream_get(server.url)) as response:
                assert response.headers["x-conn"] == "0"
                chunks = response.chunks()
                assert await anext(chunks) == BODY
                server.connections[0].proceed.set()
                assert b"".join([chunk async for chunk in chunks]) == b", more"
            # Read to its end (else the block would have discarded it), yet not kept.
            assert pool.connections() == []
            await server.connections[0].closed.wait()


async def test_a_head_response_has_no_body_whatever_its_head_says(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """A HEAD response's Content-Length is the GET's: the response ends with its head, and
    the connection is kept (waiting for 100 body bytes would hang, then discard it)."""

    async def head_responses(conn: ServerConnection) -> None:
        while await conn.read_request():
            await conn.stream.send_all(conn.response(b"", length=100))

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, head_responses, backend)
        async with pooled_client(backend) as (client, pool):
            for _ in range(2):
                response = await client.head(server.url)
                assert response.headers["content-length"] == "100"
                assert response.content == b""
            assert len(server.connections) == 1
            (idle,) = pool.connections()
            assert idle.is_idle()


async def test_tls_bytes_after_a_response_in_a_record_of_their_own(
    tls: Backend, nursery: trio.Nursery
) -> None:
    """As above, with the extra bytes in a TLS record of their own that arrives with the
    response's in one TCP segment (TCP_CORK holds both until both are written): one socket
    read takes both records, the SSL object hands out the first, and the second waits in the
    SSLStream's buffer, where polling the socket cannot see it."""

    async def respond_then_stale_response(conn: ServerConnection) -> None:
        while await conn.read_request():
            conn.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            await conn.respond()
            # A whole response that answers nothing: read as the next one's, a desync.
            await conn.stream.send_all(conn.response(b"stale", headers="X-Stale: yes\r\n"))
            conn.tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, respond_then_stale_response, tls)
        async with pooled_client(tls) as (client, pool):
            response = await client.get(server.url)
            assert response.content == BODY
            assert pool.connections() == []
            second = await client.get(server.url)
            assert (second.headers["x-conn"], second.content) == ("1", BODY)


async def test_a_streamed_request_body_from_httpx_is_framed(nursery: trio.Nursery) -> None:
    """An httpx client sending a body of unknown length (an async iterator) declares it
    chunked; the transport must then send it chunked (or declare its length instead)."""

    async def read_once_then_respond(conn: ServerConnection) -> None:
        if await conn.receive():  # the request is one write
            await conn.respond()
            await conn.wait_gone()

    async def content() -> AsyncIterator[bytes]:
        yield b"hel"
        yield b"lo"

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, read_once_then_respond)
        async with pooled_client(PLAIN) as (client, _):
            assert (await client.post(server.url, content=content())).content == BODY
        head, _, rest = server.connections[0].reads[0].partition(b"\r\n\r\n")
        framing = [
            line
            for line in head.split(b"\r\n")[1:]
            if line.lower().startswith((b"content-length:", b"transfer-encoding:"))
        ]
        # Read back with the pool's own parser, given the request's framing headers.
        reader = http1.ResponseReader(b"POST")
        try:
            body = reader.feed(b"\r\n".join([b"HTTP/1.1 200 OK", *framing, b"", rest]))
        except http1.ProtocolError as error:
            pytest.fail(f"a badly framed request body: {error}; {framing} {rest!r}")
        assert reader.complete
        assert body == b"hello"


async def test_a_tls_response_read_until_a_close_without_close_notify(
    tls: Backend, nursery: trio.Nursery
) -> None:
    """Most HTTPS servers skip close_notify, which HTTP's own framing makes redundant: httpx
    (httpcore's trio backend, https_compatible=True) and browsers take such a close as the end
    of a body without a length, and so should the pool."""

    async def until_abrupt_close(conn: ServerConnection) -> None:
        if await conn.read_request():
            await conn.stream.send_all(b"HTTP/1.1 200 OK\r\n\r\n" + BODY)
            # Returning closes forcefully: a FIN, no close_notify.

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, until_abrupt_close, tls)
        async with pooled_client(tls) as (client, pool):
            response = await client.get(server.url)
            assert response.content == BODY
            assert pool.connections() == []


# -- errors ------------------------------------------------------------------------------------


def test_an_unsupported_scheme_is_an_httpx_error() -> None:
    with pytest.raises(httpx.UnsupportedProtocol):
        Origin.of(httpx.URL("ftp://127.0.0.1/"))


async def test_connection_refused_is_an_httpx_connect_error(backend: Backend) -> None:
    with trio.fail_after(DEADLINE):
        # Bound but not listening: connecting is refused, and no other test can take the port.
        with trio.socket.socket() as unused:
            await unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
            async with pooled_client(backend) as (client, pool):
                with pytest.raises(httpx.ConnectError):
                    await client.get(backend.url(port))
                assert pool.connections() == []


@pytest.mark.parametrize("via", ["pool.stream", "httpx"])
async def test_a_connect_timeout_is_an_httpx_connect_timeout(backend: Backend, via: str) -> None:
    with trio.fail_after(DEADLINE), unreachable_port() as port:
        async with pooled_client(backend) as (client, pool):
            started = trio.current_time()
            with pytest.raises(httpx.ConnectTimeout):
                if via == "httpx":
                    await client.get(backend.url(port), timeout=httpx.Timeout(5.0, connect=0.2))
                else:
                    async with pool.stream(upstream_get(backend.url(port), connect_timeout=0.2)):
                        pytest.fail("no response without a connection")
            assert trio.current_time() - started >= 0.2
            assert pool.connections() == []


async def test_a_tls_handshake_that_never_ends_is_a_connect_timeout(
    tls: Backend, nursery: trio.Nursery
) -> None:
    """The connect timeout bounds the handshake too; the socket it had is closed."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, never_handshakes)  # TCP only: never answers
        async with pooled_client(tls) as (_, pool):
            url = tls.url(server.port)
            with pytest.raises(httpx.ConnectTimeout):
                async with pool.stream(upstream_get(url, connect_timeout=0.2)):
                    pytest.fail("no response without a handshake")
            assert pool.connections() == []
            await server.connections[0].gone.wait()
            # The client did start the handshake: its hello reached the server.
            assert server.connections[0].reads[0].startswith(b"\x16\x03")


@pytest.mark.parametrize("trust", ["another CA", "the default bundle"])
async def test_a_failed_tls_handshake_is_an_httpx_connect_error(
    tls: Backend, trust: str, nursery: trio.Nursery
) -> None:
    """A server certificate the client does not trust: ConnectError, and no connection left."""
    if trust == "another CA":
        context: ssl.SSLContext | None = ssl.create_default_context()
        assert context is not None
        trustme.CA().configure_trust(context)
    else:
        context = None  # the pool's own default: httpx's (certifi), which knows no test CA
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, tls)
        async with pooled_client(tls, ssl_context=context) as (client, pool):
            with pytest.raises(httpx.ConnectError) as caught:
                await client.get(server.url)
            # The verification's failure, under trio's BrokenResourceError (not some other
            # handshake trouble).
            assert isinstance(caught.value.__cause__, trio.BrokenResourceError)
            assert isinstance(caught.value.__cause__.__cause__, ssl.SSLCertVerificationError)
            assert pool.connections() == []
            (conn,) = server.connections
            await conn.gone.wait()
            assert conn.requests == 0


async def test_a_malformed_status_line_is_an_httpx_remote_protocol_error(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, malformed_status_line, backend)
        async with pooled_client(backend) as (client, pool):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert pool.connections() == []
            await server.connections[0].gone.wait()


@pytest.mark.parametrize("where", ["with the head", "mid-body"])
async def test_a_bad_chunk_size_is_an_httpx_remote_protocol_error(
    backend: Backend, where: str, nursery: trio.Nursery
) -> None:
    """A framing error discards the connection: nothing after it can be trusted to be the next
    response's start."""

    async def bad_chunk(conn: ServerConnection) -> None:
        if await conn.read_request():
            head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            if where == "mid-body":
                await conn.stream.send_all(head + b"5\r\nhello\r\n")
                await conn.proceed.wait()
                await conn.stream.send_all(b"zz\r\nhello\r\n0\r\n\r\n")
            else:
                await conn.stream.send_all(head + b"-5\r\nhello\r\n0\r\n\r\n")
            await conn.wait_gone()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, bad_chunk, backend)
        async with pooled_client(backend) as (client, pool):
            if where == "mid-body":
                async with pool.stream(upstream_get(server.url)) as response:
                    chunks = response.chunks()
                    assert await anext(chunks) == BODY
                    server.connections[0].proceed.set()
                    with pytest.raises(httpx.RemoteProtocolError, match="chunk size"):
                        await anext(chunks)
                    assert len(pool.connections()) == 1  # the block still holds it
            else:
                with pytest.raises(httpx.RemoteProtocolError, match="chunk size"):
                    await client.get(server.url)
            assert pool.connections() == []
            await server.connections[0].gone.wait()


async def test_a_truncated_body_is_an_httpx_remote_protocol_error(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """An error while reading the body (raised through the pool's body stream, not its
    request) is httpx's type too, and the connection is not kept."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, truncated_body, backend)
        async with pooled_client(backend) as (client, pool):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert pool.connections() == []
            # A request after it gets a fresh connection (the server closed the first anyway).
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert len(server.connections) == 2


@pytest.mark.parametrize("behaviour", [silent, stop_mid_body], ids=["awaiting headers", "mid-body"])
@pytest.mark.parametrize("via", ["pool.stream", "httpx"])
async def test_a_read_timeout_is_an_httpx_read_timeout(
    backend: Backend, behaviour: Behaviour, via: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, behaviour, backend)
        async with pooled_client(backend) as (client, pool):
            started = trio.current_time()
            with pytest.raises(httpx.ReadTimeout):
                if via == "httpx":
                    await client.get(server.url, timeout=httpx.Timeout(5.0, read=0.2))
                else:
                    request = upstream_get(server.url, read_timeout=0.2)
                    async with pool.stream(request) as response:
                        await read_body(response)
            assert trio.current_time() - started >= 0.2  # the read timeout, nothing sooner
            assert pool.connections() == []
            await server.connections[0].gone.wait()


@pytest.mark.parametrize("behaviour", [silent, stop_mid_body], ids=["awaiting headers", "mid-body"])
async def test_a_cancelled_request_closes_its_connection(
    backend: Backend, behaviour: Behaviour, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, behaviour, backend)
        async with pooled_client(backend) as (client, pool):
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as requests:
                    requests.start_soon(client.get, server.url)
                    await _request_seen(server)
                    # The client is now blocked reading (headers, or the rest of the body).
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(pool.connections()) == 1
                    cancelled_at = trio.current_time()
                    scope.cancel()
            assert scope.cancelled_caught
            # Closed as the request unwound, not later.
            assert pool.connections() == []
            (conn,) = server.connections
            await conn.gone.wait()
            assert conn.gone_at is not None
            assert conn.gone_at - cancelled_at < CLOSE_BOUND, conn.gone_at - cancelled_at


async def test_aclose_closes_every_connection(backend: Backend, nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (client, pool):
            async with client.stream("GET", server.url) as busy:
                # Connection 0 stays in use: its body is not read (reading it in full would
                # release it).
                assert busy.headers["x-conn"] == "0"
                idle = await client.get(server.url)  # connection 1: idle afterwards
                assert idle.headers["x-conn"] == "1"
                assert len(pool.connections()) == 2
                await pool.aclose()
                assert pool.connections() == []
                for conn in server.connections:
                    await conn.gone.wait()
            # The busy response closed after the pool: its connection is not taken back.
            assert pool.connections() == []
            with pytest.raises(RuntimeError, match="closed"):
                await client.get(server.url)
            assert len(server.connections) == 2


async def test_a_response_finished_after_aclose_does_not_put_its_connection_back(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """A fully received response closed after the pool closed its connection: the pool must
    not keep that connection (it is closed, and the pool too)."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (client, pool):
            async with client.stream("GET", server.url) as response:
                # The raw stream, not aread(): read to its end without closing the response
                # (and so without releasing the connection before the pool is closed).
                stream = response.stream
                assert isinstance(stream, httpx.AsyncByteStream)
                assert b"".join([chunk async for chunk in stream]) == BODY
                (connection,) = pool.connections()
                await pool.aclose()
                await server.connections[0].gone.wait()
            assert pool.connections() == []
            assert connection.is_closed()


async def test_a_busy_reader_gets_a_read_error_when_the_pool_closes(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """KeepAlivePool.aclose closes busy connections too: a producer parked on one must wake
    with the ReadError the relay maps to an upstream error (not trio's ValueError for fd -1,
    not a hang)."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body, backend)
        async with pooled_client(backend) as (_, pool):
            failed: list[BaseException] = []

            async def read() -> None:
                async with pool.stream(upstream_get(server.url)) as response:
                    chunks = response.chunks()
                    assert await anext(chunks) == BODY
                    try:
                        await anext(chunks)
                    except httpx.ReadError as error:
                        failed.append(error)

            async with trio.open_nursery() as tasks:
                tasks.start_soon(read)
                await _request_seen(server)
                await trio.testing.wait_all_tasks_blocked()
                assert len(pool.connections()) == 1
                await pool.aclose()
            assert len(failed) == 1
            await server.connections[0].gone.wait()


# -- pool.stream, the relay's way in -------------------------------------------------------------


async def test_pool_stream_keeps_a_fully_read_connection(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """``pool.stream`` (the relay's way in, no httpx client) keeps the same contract."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (_, pool):
            for _ in range(2):
                async with pool.stream(upstream_get(server.url)) as response:
                    assert response.status_code == 200
                    assert response.headers["x-conn"] == "0"  # names lower-cased
                    assert (b"x-conn", b"0") in response.raw_headers
                    assert await read_body(response) == BODY
            assert len(server.connections) == 1
            (idle,) = pool.connections()
            assert idle.is_idle()


@pytest.mark.parametrize("leaving", ["stops reading", "raises"])
async def test_pool_stream_left_half_read_closes_its_connection(
    backend: Backend, leaving: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body, backend)
        async with pooled_client(backend) as (_, pool):
            with pytest.raises(ZeroDivisionError) if leaving == "raises" else nullcontext():
                async with pool.stream(upstream_get(server.url)) as response:
                    async for chunk in response.chunks():
                        assert chunk == BODY
                        if leaving == "raises":
                            raise ZeroDivisionError
                        break
            assert pool.connections() == []
            await server.connections[0].gone.wait()


async def test_pool_stream_errors_are_httpx_errors(backend: Backend, nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, truncated_body, backend)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(upstream_get(server.url)) as response:
                with pytest.raises(httpx.RemoteProtocolError):
                    await read_body(response)
            assert pool.connections() == []
            with trio.socket.socket() as unused:
                await unused.bind(("127.0.0.1", 0))  # bound, not listening: refused
                port = unused.getsockname()[1]
                with pytest.raises(httpx.ConnectError):
                    async with pool.stream(upstream_get(backend.url(port))):
                        pytest.fail("no response without a connection")
            assert pool.connections() == []


# -- socket options ------------------------------------------------------------------------------


async def test_socket_options_are_applied(backend: Backend, nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        async with pooled_client(backend, socket_options=options) as (client, pool):
            response = await client.get(server.url)
            assert response.content == BODY
            (connection,) = pool.connections()
            sock = raw_socket(connection.transport)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


async def test_a_socket_option_that_fails_is_a_connect_error(
    backend: Backend, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        options = [(socket.SOL_SOCKET, 0x7FFF, 1)]  # no such option: ENOPROTOOPT
        async with pooled_client(backend, socket_options=options) as (client, pool):
            descriptors = len(os.listdir("/proc/self/fd"))
            with pytest.raises(httpx.ConnectError):
                await client.get(server.url)
            assert pool.connections() == []
            # Options are set before the connect (buffer sizes shape the handshake's window):
            # the server never saw a connection, and the socket was closed, not leaked.
            assert server.connections == []
            assert len(os.listdir("/proc/self/fd")) == descriptors


# -- the transports ------------------------------------------------------------------------------


@asynccontextmanager
async def transport_pair(
    backend: Backend,
) -> AsyncIterator[tuple[Transport, trio.abc.Stream]]:
    """A connected transport and the server's end of it (under TLS handshaken, and with one
    exchange done, as behind any idle pooled connection)."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listener:
        accepted: list[trio.abc.Stream] = []

        async def accept() -> None:
            tcp = await listener.accept()
            stream: trio.abc.Stream = tcp
            if backend.server_context is not None:
                stream = trio.SSLStream(tcp, backend.server_context, server_side=True)
                await stream.do_handshake()
            accepted.append(stream)

        port = listener.socket.getsockname()[1]
        async with trio.open_nursery() as tasks:
            tasks.start_soon(accept)
            transport = await connect(
                backend.origin(port), connect_timeout=None, ssl_context=backend.client_context
            )
        (server_side,) = accepted
        try:
            if backend.tls:
                await transport.write(b"ping")
                assert await server_side.receive_some(100) == b"ping"
                await server_side.send_all(b"pong")
                assert await transport.read() == b"pong"
            yield transport, server_side
        finally:
            await trio.aclose_forcefully(server_side)
            await transport.aclose()


async def test_is_readable_only_when_an_idle_connection_is_unusable(backend: Backend) -> None:
    """``has_expired`` asks an idle connection's transport ``is_readable`` to tell whether the
    server has closed it (or broken the protocol): it must be False while all is quiet."""
    with trio.fail_after(DEADLINE):
        async with transport_pair(backend) as (transport, server_side):
            sock = raw_socket(transport)
            assert isinstance(transport, TLSTransport if backend.tls else PlainTransport)
            assert transport.is_readable() is False
            # Unexpected bytes on an idle connection: unusable too. (Peeked, not consumed.)
            await server_side.send_all(b"x")
            await trio.lowlevel.wait_readable(sock)
            assert transport.is_readable() is True
            assert transport.is_readable() is True
            assert await transport.read() == b"x"
            assert transport.is_readable() is False
            # The server's clean close (its FIN, after a close_notify under TLS) makes the
            # socket readable: an end of stream (b"") then.
            await server_side.aclose()
            await trio.lowlevel.wait_readable(sock)
            assert transport.is_readable() is True
            assert await transport.read() == b""
            assert sock.getpeername()[0] == "127.0.0.1"
            await transport.aclose()
            assert transport.is_readable() is True
            assert sock.fileno() == -1
            # Read and write after close: httpx's errors (the relay maps those), never trio's
            # ValueError for fd -1.
            with pytest.raises(httpx.ReadError):
                await transport.read()
            with pytest.raises(httpx.WriteError):
                await transport.write(b"GET / HTTP/1.1\r\n\r\n")


async def test_a_parked_read_wakes_with_a_read_error_when_closed_from_another_task(
    backend: Backend,
) -> None:
    with trio.fail_after(DEADLINE):
        async with transport_pair(backend) as (transport, _):
            connection = UpstreamConnection(backend.origin(0), transport)
            started = trio.current_time()
            with pytest.raises(httpx.ReadTimeout):
                await connection.read(0.05)
            assert trio.current_time() - started >= 0.05
            # A reader blocked on the socket is woken with ReadError when the connection is
            # closed under it, instead of waiting on a closed descriptor.
            failed: list[BaseException] = []
            async with trio.open_nursery() as tasks:

                async def read() -> None:
                    try:
                        await connection.read(None)
                    except httpx.ReadError as error:
                        failed.append(error)

                tasks.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                await connection.aclose()
            assert len(failed) == 1
            assert connection.is_closed()
            assert connection.has_expired(60.0)


async def test_read_after_close_is_an_httpx_read_error() -> None:
    # A socketpair, no server at all: the closed flag alone must stop a read, before trio is
    # asked to wait on descriptor -1.
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        transport = PlainTransport(ours)
        await transport.aclose()
        await transport.aclose()  # twice: harmless
        with pytest.raises(httpx.ReadError):
            await transport.read()
        with pytest.raises(httpx.WriteError):
            await transport.write(b"x")
        transport.shutdown()  # after close: a no-op, not an EBADF
    finally:
        theirs.close()


# -- abort ---------------------------------------------------------------------------------------


def wait_for_eof_without_yielding(conn: ServerConnection) -> None:
    """Block the whole trio run (at most CLOSE_BOUND) until the server's side sees EOF.
    Loopback delivers a FIN within the shutdown call in practice; the loop only covers a kernel
    that defers it. No checkpoint: every other task stays parked meanwhile."""
    started = time.monotonic()
    while not conn.sees_eof_now():
        assert time.monotonic() - started < CLOSE_BOUND, "the server never saw the abort's FIN"
        time.sleep(0.001)  # blocking on purpose: no other task may run


async def test_abort_shuts_the_connection_down_under_a_parked_reader(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """response.abort() from another task (the relay's disconnect hook runs in hypercorn's
    message task) closes the upstream's side at once, while the task reading the body is
    still parked: that task then fails cleanly, and the connection is discarded."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body, backend)
        async with pooled_client(backend) as (_, pool):
            responses: list[UpstreamResponse] = []
            reader_failed: list[BaseException] = []
            leave = trio.Event()

            async def request() -> None:
                async with pool.stream(upstream_get(server.url)) as response:
                    responses.append(response)
                    chunks = response.chunks()
                    assert await anext(chunks) == BODY
                    try:
                        await anext(chunks)  # parks: the server sends nothing more
                    except httpx.TransportError as error:
                        reader_failed.append(error)
                    # Still inside the block: the body (and the connection) stay open until
                    # the test has looked at the pool.
                    await leave.wait()

            async with trio.open_nursery() as tasks:
                tasks.start_soon(request)
                await _request_seen(server)
                await trio.testing.wait_all_tasks_blocked()
                (response,) = responses
                (conn,) = server.connections
                (connection,) = pool.connections()
                sock = raw_socket(connection.transport)
                response.abort()
                assert response.aborted
                # The server sees EOF before any other task has run: the abort itself closed
                # the upstream's side, not the request task unwinding (it is still parked).
                wait_for_eof_without_yielding(conn)
                assert sock.fileno() >= 0  # shut down, not closed: that is the task's job
                assert pool.connections() == [connection]  # busy still
                assert reader_failed == []
                response.abort()  # twice: harmless
                # Now the parked reader wakes, with an httpx transport error (not a hang, not
                # some other exception), which the relay maps to upstream_protocol_error: the
                # end of the stream mid-body (under TLS too: a transport end without
                # close_notify is an end, as HTTPS clients treat it).
                await poll_until(lambda: reader_failed)
                (error,) = reader_failed
                assert isinstance(error, httpx.RemoteProtocolError), error
                await conn.gone.wait()
                assert pool.connections() == [connection]  # the block has not exited yet
                leave.set()
            # Aborted: discarded on the way out, never kept for another request.
            assert pool.connections() == []
            assert connection.is_closed()
            assert sock.fileno() == -1
            response.abort()  # after the block: a no-op, still harmless


async def test_abort_then_leaving_the_block_is_clean(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """The relay's order: the hook aborts (here twice), then the cancellation unwinds the
    request's task through the block; closing the shut-down connection raises nothing."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body, backend)
        async with pooled_client(backend) as (_, pool):
            with trio.CancelScope() as scope:
                async with pool.stream(upstream_get(server.url)) as response:
                    async for chunk in response.chunks():
                        assert chunk == BODY
                        response.abort()
                        response.abort()
                        scope.cancel()
                        await trio.sleep_forever()  # cancelled at once: never sleeps
            assert scope.cancelled_caught
            assert pool.connections() == []
            (conn,) = server.connections
            await conn.gone.wait()


async def test_abort_of_a_fully_read_response_still_discards_its_connection(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """A fully read connection would be kept (idle, reusable), but once shut down it serves
    nobody: an aborted response's connection is discarded, never pooled."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(upstream_get(server.url)) as response:
                assert await read_body(response) == BODY
                response.abort()
            assert pool.connections() == []
            await server.connections[0].gone.wait()
            # The next request gets a fresh connection, and works.
            async with pool.stream(upstream_get(server.url)) as response:
                assert response.headers["x-conn"] == "1"
                assert await read_body(response) == BODY
            assert len(pool.connections()) == 1


async def test_abort_after_the_block_exited_is_a_no_op(
    backend: Backend, nursery: trio.Nursery
) -> None:
    """A late abort (the disconnect hook of a request that already gave its connection back)
    must not touch the connection: it may be serving another request by then."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive, backend)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(upstream_get(server.url)) as response:
                assert await read_body(response) == BODY
            (idle,) = pool.connections()
            response.abort()
            response.abort()
            # Not shut down: the server holds no FIN, and the pool still has it, idle.
            assert not server.connections[0].sees_eof_now()
            assert pool.connections() == [idle]
            assert idle.is_idle()
            # The next request reuses it (a shut-down socket would read as expired, and the
            # pool would open connection 1 instead) and succeeds.
            async with pool.stream(upstream_get(server.url)) as response:
                assert response.headers["x-conn"] == "0"
                assert await read_body(response) == BODY
            assert len(server.connections) == 1
            assert server.connections[0].requests == 2
            assert pool.connections() == [idle]
            assert not server.connections[0].gone.is_set()


def answer_before_the_body(answer: bytes) -> Behaviour:
    """A server that answers once it has the request's head (a 413, say), then closes with
    the body unread: the kernel resets the connection under the client's write."""

    async def behaviour(conn: ServerConnection) -> None:
        if await conn.read_request():
            await conn.stream.send_all(answer)
            await trio.sleep(0.05)

    return behaviour


async def test_an_answer_sent_before_the_body_was_read_is_the_response(
    nursery: trio.Nursery,
) -> None:
    # As httpcore does: the failed write is not the outcome when the server said why.
    answer = b'{"error":"too large"}'
    head = b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, answer_before_the_body(head % len(answer) + answer))
        async with pooled_client(PLAIN) as (client, pool):
            # Far more than the socket buffers take: the write is still going when reset.
            body = b"x" * (32 * 1024 * 1024)
            response = await client.post(server.url, content=body)
            assert response.status_code == 413
            assert response.content == answer
            # Out of step with the server (the request half sent): never kept.
            assert pool.connections() == []


async def test_a_failed_write_with_no_answer_is_the_write_error(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, answer_before_the_body(b""))
        async with pooled_client(PLAIN) as (client, pool):
            with pytest.raises(httpx.WriteError):
                await client.post(server.url, content=b"x" * (32 * 1024 * 1024))
            assert pool.connections() == []


async def test_a_request_the_server_never_reads_is_a_write_timeout(nursery: trio.Nursery) -> None:
    async def never_reads(conn: ServerConnection) -> None:
        await trio.sleep_forever()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, never_reads)
        async with pooled_client(PLAIN) as (client, pool):
            # The write is bounded by the connect timeout (the relay's reads have deadlines of
            # their own); far more than the socket buffers hold, so it cannot finish.
            with pytest.raises(httpx.WriteTimeout):
                await client.post(
                    server.url, content=b"x" * (32 * 1024 * 1024), timeout=httpx.Timeout(0.2)
                )
            assert pool.connections() == []


# ---------------------------------------------------------------- the keep-alive race


def close_on_second_request(how: str) -> Behaviour:
    """Answers the first request; takes the second and closes without a byte of answer (EOF,
    or a reset), as a server does whose idle close crossed the request on the wire. Any
    later connection is served normally."""

    async def behaviour(conn: ServerConnection) -> None:
        if conn.index > 0:
            await keep_alive(conn)
            return
        if await conn.read_request():
            await conn.respond()
        if await conn.read_request():
            if how == "reset":
                conn.tcp.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
            await trio.aclose_forcefully(conn.stream)

    return behaviour


@pytest.mark.parametrize("how", ["eof", "reset"])
async def test_a_reused_connection_closed_before_any_answer_is_retried_on_a_fresh_one(
    backend: Backend, nursery: trio.Nursery, how: str
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, close_on_second_request(how), backend)
        async with pooled_client(backend) as (client, pool):
            assert (await client.get(server.url)).headers["x-conn"] == "0"
            response = await client.get(server.url)
            assert response.status_code == 200
            assert response.headers["x-conn"] == "1"  # sent again, on a new connection
            assert len(server.connections) == 2
            assert [conn.requests for conn in server.connections] == [2, 1]
            assert len(pool.connections()) == 1


async def test_a_fresh_connection_closed_before_any_answer_is_not_retried(
    backend: Backend, nursery: trio.Nursery
) -> None:
    async def close_at_once(conn: ServerConnection) -> None:
        await conn.read_request()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, close_at_once, backend)
        async with pooled_client(backend) as (client, _):
            with pytest.raises(httpx.TransportError):
                await client.get(server.url)
            assert len(server.connections) == 1  # the server's own fault: said so, not hidden


async def test_the_keep_alive_retry_happens_once(backend: Backend, nursery: trio.Nursery) -> None:
    async def answer_once_then_close_every_request(conn: ServerConnection) -> None:
        if conn.index == 0 and await conn.read_request():
            await conn.respond()
        await conn.read_request()

    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, answer_once_then_close_every_request, backend)
        async with pooled_client(backend) as (client, _):
            assert (await client.get(server.url)).status_code == 200
            with pytest.raises(httpx.TransportError):
                await client.get(server.url)
            assert len(server.connections) == 2  # the reused one, and one retry: no more
