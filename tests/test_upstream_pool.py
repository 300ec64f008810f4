"""The upstream pool (proxy/upstream_pool.py) against small hand-written HTTP/1.1 servers.

Each server counts the TCP connections it accepts and notes when the client closes one (EOF or
reset), so every test can say which connection a request used and whether a connection the
pool let go of was really closed. The pool tests run over both network backends the proxy
uses: the lean one (plain http:// upstreams) and httpcore's own trio backend (https://).
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpcore
import httpx
import pytest
import trio
import trio.testing

from proxy.upstream_pool import (
    KeepAlivePool,
    LeanSocketStream,
    LeanTrioBackend,
    UpstreamResponse,
)
from tests.support import DEADLINE, poll_until

BODY = b"hello"
# A client's close reaches the server within milliseconds on loopback; 50 ms leaves room for a
# loaded CI machine (the same bound as test_lifetime's).
CLOSE_BOUND = 0.05


@dataclass(eq=False)
class ServerConnection:
    """One accepted TCP connection, as the server saw it."""

    index: int
    stream: trio.SocketStream
    buffer: bytes = b""
    requests: int = 0
    request_seen: trio.Event = field(default_factory=trio.Event)
    # The client closed its end (EOF, or a reset when it left bytes unread).
    gone: trio.Event = field(default_factory=trio.Event)
    gone_at: float | None = None
    # The server closed its end.
    closed: trio.Event = field(default_factory=trio.Event)

    async def receive(self) -> bytes:
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            data = b""
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

    async def respond(self, body: bytes = BODY, *, length: int | None = None) -> None:
        """A keep-alive response (no ``Connection: close``) naming this connection."""
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Length: {len(body) if length is None else length}\r\n"
            f"X-Conn: {self.index}\r\n\r\n"
        )
        await self.stream.send_all(head.encode() + body)

    async def wait_gone(self) -> None:
        while await self.receive():
            pass


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
    """Promises 100 bytes, sends 5, and closes."""
    if await conn.read_request():
        await conn.respond(length=100)


class RawServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.connections: list[ServerConnection] = []
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> RawServer:
        serve = partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, self._handle, 0)
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/"
        return self

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = ServerConnection(len(self.connections), stream)
        self.connections.append(conn)
        try:
            await self.behaviour(conn)
        finally:
            await trio.aclose_forcefully(stream)
            conn.closed.set()


async def start_server(nursery: trio.Nursery, behaviour: Behaviour) -> RawServer:
    return await RawServer(behaviour).start(nursery)


@pytest.fixture(params=["lean", "httpcore"])
def backend(request: pytest.FixtureRequest) -> str:
    """The network backend under the pool: LeanTrioBackend, or httpcore's own (for TLS)."""
    return str(request.param)


@asynccontextmanager
async def pooled_client(
    backend: str, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, KeepAlivePool]]:
    """An httpx client over a KeepAlivePool, built as UpstreamReplica builds its own."""
    settings = {"max_keepalive": 8, "keepalive_expiry": 60.0, **settings}
    pool = KeepAlivePool(
        network_backend=LeanTrioBackend() if backend == "lean" else None, **settings
    )
    async with httpx.AsyncClient(transport=pool, trust_env=False) as client:
        yield client, pool


async def test_sequential_requests_reuse_one_connection(
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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
            assert not server.connections[0].gone.is_set()


async def test_the_most_recently_released_connection_is_taken_first(
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body)
        async with pooled_client(backend) as (client, pool):
            async with client.stream("GET", server.url) as response:
                # aclosing: the test stops iterating mid-body, as a relay whose client left.
                async with aclosing(response.aiter_raw()) as chunks:
                    assert await anext(chunks) == BODY
                assert len(pool.connections()) == 1  # busy while the response is open
            # The rest of the body will never be read: the connection cannot serve another
            # request, and the upstream must see the close (that is how it learns to abort).
            assert pool.connections() == []
            (conn,) = server.connections
            await conn.gone.wait()


async def test_a_connection_the_server_closed_while_idle_is_not_reused(
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, respond_once_then_close)
        async with pooled_client(backend) as (client, pool):
            assert (await client.get(server.url)).headers["x-conn"] == "0"
            (idle,) = pool.connections()
            await server.connections[0].closed.wait()
            # Wait for the server's FIN to arrive (immediate on loopback; polled so the test
            # cannot race it). Before it arrives no client could know; after, reusing the
            # socket would fail the request with "server disconnected without a response".
            await poll_until(idle.has_expired)
            response = await client.get(server.url)
            assert response.status_code == 200
            assert response.headers["x-conn"] == "1"
            assert len(server.connections) == 2
            assert idle.is_closed()
            assert idle not in pool.connections()


class FrozenTime:
    """Stands in for the ``time`` module inside httpcore's HTTP/1.1 connection, the only place
    keep-alive expiry reads the clock: expiry is tested to the millisecond, without sleeping.
    (trio's own clock is perf_counter, untouched.)"""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def frozen_time(monkeypatch: pytest.MonkeyPatch) -> FrozenTime:
    frozen = FrozenTime()
    # raising=True (the default): if httpcore stops reading time this way, this fails loudly
    # instead of the expiry tests silently testing nothing.
    monkeypatch.setattr("httpcore._async.http11.time", frozen)
    return frozen


async def test_an_idle_connection_past_keepalive_expiry_is_not_reused(
    backend: str, nursery: trio.Nursery, frozen_time: FrozenTime
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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
    backend: str, nursery: trio.Nursery, frozen_time: FrozenTime
) -> None:
    """Only the top of the stack is taken; the bottom (longest idle) is checked on the way, so
    a stack that shrank in use does not hold dead sockets for ever."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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


async def test_connection_refused_is_an_httpx_connect_error(backend: str) -> None:
    with trio.fail_after(DEADLINE):
        # Bound but not listening: connecting is refused, and no other test can take the port.
        with trio.socket.socket() as unused:
            await unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
            async with pooled_client(backend) as (client, pool):
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"http://127.0.0.1:{port}/")
                assert pool.connections() == []


async def test_a_malformed_status_line_is_an_httpx_remote_protocol_error(
    backend: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, malformed_status_line)
        async with pooled_client(backend) as (client, pool):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert pool.connections() == []
            await server.connections[0].gone.wait()


async def test_a_truncated_body_is_an_httpx_remote_protocol_error(
    backend: str, nursery: trio.Nursery
) -> None:
    """An error while reading the body (raised through the pool's body stream, not its
    request) is httpx's type too, and the connection is not kept."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, truncated_body)
        async with pooled_client(backend) as (client, pool):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert pool.connections() == []
            # A request after it gets a fresh connection (the server closed the first anyway).
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(server.url)
            assert len(server.connections) == 2


@pytest.mark.parametrize("behaviour", [silent, stop_mid_body], ids=["awaiting headers", "mid-body"])
async def test_a_read_timeout_is_an_httpx_read_timeout(
    backend: str, behaviour: Behaviour, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, behaviour)
        async with pooled_client(backend) as (client, pool):
            started = trio.current_time()
            with pytest.raises(httpx.ReadTimeout):
                await client.get(server.url, timeout=httpx.Timeout(5.0, read=0.2))
            assert trio.current_time() - started >= 0.2  # the read timeout, nothing sooner
            assert pool.connections() == []
            await server.connections[0].gone.wait()


@pytest.mark.parametrize("behaviour", [silent, stop_mid_body], ids=["awaiting headers", "mid-body"])
async def test_a_cancelled_request_closes_its_connection(
    backend: str, behaviour: Behaviour, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, behaviour)
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


async def _request_seen(server: RawServer) -> None:
    await poll_until(lambda: server.connections)
    await server.connections[0].request_seen.wait()


async def test_aclose_closes_every_connection(backend: str, nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
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
    backend: str, nursery: trio.Nursery
) -> None:
    """httpcore marks a connection idle again when a fully received response is closed, even
    if the connection was closed under it meanwhile: the pool must not keep it once closed."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        async with pooled_client(backend) as (client, pool):
            async with client.stream("GET", server.url) as response:
                # The raw stream, not aread(): read to its end without closing the response
                # (and so without releasing the connection before the pool is closed).
                assert b"".join([chunk async for chunk in response.stream]) == BODY
                assert len(pool.connections()) == 1
                await pool.aclose()
                await server.connections[0].gone.wait()
            assert pool.connections() == []


def core_get(url: str) -> httpcore.Request:
    """A request as the relay sends it on ``pool.stream``: httpcore's, Host header included."""
    return httpcore.Request(b"GET", url, headers=[(b"host", httpx.URL(url).netloc)])


async def read_body(response: UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in response.chunks()])


async def test_pool_stream_keeps_a_fully_read_connection(
    backend: str, nursery: trio.Nursery
) -> None:
    """``pool.stream`` (the relay's way in, no httpx client) keeps the same contract."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        async with pooled_client(backend) as (_, pool):
            for _ in range(2):
                async with pool.stream(core_get(server.url)) as response:
                    assert response.status_code == 200
                    assert response.headers["x-conn"] == "0"  # names lower-cased
                    assert await read_body(response) == BODY
            assert len(server.connections) == 1
            (idle,) = pool.connections()
            assert idle.is_idle()


@pytest.mark.parametrize("leaving", ["stops reading", "raises"])
async def test_pool_stream_left_half_read_closes_its_connection(
    backend: str, leaving: str, nursery: trio.Nursery
) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body)
        async with pooled_client(backend) as (_, pool):
            with pytest.raises(ZeroDivisionError) if leaving == "raises" else nullcontext():
                async with pool.stream(core_get(server.url)) as response:
                    async for chunk in response.chunks():
                        assert chunk == BODY
                        if leaving == "raises":
                            raise ZeroDivisionError
                        break
            assert pool.connections() == []
            await server.connections[0].gone.wait()


async def test_pool_stream_errors_are_httpx_errors(backend: str, nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, truncated_body)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(core_get(server.url)) as response:
                with pytest.raises(httpx.RemoteProtocolError):
                    await read_body(response)
            assert pool.connections() == []
            with trio.socket.socket() as unused:
                await unused.bind(("127.0.0.1", 0))  # bound, not listening: refused
                port = unused.getsockname()[1]
                with pytest.raises(httpx.ConnectError):
                    async with pool.stream(core_get(f"http://127.0.0.1:{port}/")):
                        pytest.fail("no response without a connection")
            assert pool.connections() == []


async def test_socket_options_are_applied(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        async with pooled_client("lean", socket_options=options) as (client, _):
            response = await client.get(server.url)
            sock = response.extensions["network_stream"].get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1


async def test_a_socket_option_that_fails_is_a_connect_error(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        options = [(socket.SOL_SOCKET, 0x7FFF, 1)]  # no such option: ENOPROTOOPT
        async with pooled_client("lean", socket_options=options) as (client, pool):
            with pytest.raises(httpx.ConnectError):
                await client.get(server.url)
            assert pool.connections() == []
            # The socket it had connected was closed, not leaked.
            await poll_until(lambda: server.connections)
            await server.connections[0].gone.wait()


async def test_lean_stream_is_readable_only_when_an_idle_connection_is_unusable() -> None:
    """httpcore asks an idle connection's stream ``is_readable`` to tell whether the server has
    closed it (or broken the protocol): it must be False while all is quiet."""
    with trio.fail_after(DEADLINE):
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listener:
            port = listener.socket.getsockname()[1]
            stream = await LeanTrioBackend().connect_tcp("127.0.0.1", port)
            assert isinstance(stream, LeanSocketStream)
            sock = stream.get_extra_info("socket")
            async with await listener.accept() as server_side:
                assert stream.get_extra_info("is_readable") is False
                # Unexpected bytes on an idle connection: unusable too. (Peeked, not consumed.)
                await server_side.send_all(b"x")
                await trio.lowlevel.wait_readable(sock)
                assert stream.get_extra_info("is_readable") is True
                assert stream.get_extra_info("is_readable") is True
                assert await stream.read(100) == b"x"
                assert stream.get_extra_info("is_readable") is False
            # The server side is closed: its FIN makes the socket readable (b"" then).
            await trio.lowlevel.wait_readable(sock)
            assert stream.get_extra_info("is_readable") is True
            assert await stream.read(100) == b""
            assert stream.get_extra_info("server_addr") == ("127.0.0.1", port)
            await stream.aclose()
            assert stream.get_extra_info("is_readable") is True
            assert stream.get_extra_info("server_addr") is None
            assert sock.fileno() == -1


async def test_lean_stream_read_timeout_and_close_wake_a_reader() -> None:
    with trio.fail_after(DEADLINE):
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listener:
            port = listener.socket.getsockname()[1]
            stream = await LeanTrioBackend().connect_tcp("127.0.0.1", port)
            async with await listener.accept():
                with pytest.raises(httpcore.ReadTimeout):
                    await stream.read(100, timeout=0.05)
                # A reader blocked on the socket is woken with ReadError when the stream is
                # closed under it (notify_closing), instead of waiting on a closed fd.
                async with trio.open_nursery() as tasks:

                    async def read() -> None:
                        with pytest.raises(httpcore.ReadError):
                            await stream.read(100)

                    tasks.start_soon(read)
                    await trio.testing.wait_all_tasks_blocked()
                    await stream.aclose()


def server_sees_eof_now(conn: ServerConnection) -> bool:
    """Whether the kernel already holds the client's FIN for the server's side of ``conn``: a
    peek through a duplicate of its descriptor, so no trio task runs (and so the client's
    request task cannot have closed anything in the meantime)."""
    stream_socket = conn.stream.socket
    with socket.fromfd(stream_socket.fileno(), stream_socket.family, stream_socket.type) as peek:
        try:
            return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except ConnectionResetError:
            return True


def wait_for_eof_without_yielding(conn: ServerConnection) -> None:
    """Block the whole trio run (at most CLOSE_BOUND) until the server's side sees EOF.
    Loopback delivers a FIN within the shutdown call in practice; the loop only covers a kernel
    that defers it. No checkpoint: every other task stays parked meanwhile."""
    started = time.monotonic()
    while not server_sees_eof_now(conn):
        assert time.monotonic() - started < CLOSE_BOUND, "the server never saw the abort's FIN"
        time.sleep(0.001)  # blocking on purpose: no other task may run


async def test_abort_shuts_the_connection_down_under_a_parked_reader(
    backend: str, nursery: trio.Nursery
) -> None:
    """response.abort() from another task (the relay's disconnect hook runs in hypercorn's
    message task) closes the upstream's side at once, while the task reading the body is
    still parked: that task then fails cleanly, and the connection is discarded."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body)
        async with pooled_client(backend) as (_, pool):
            responses: list[UpstreamResponse] = []
            reader_failed: list[BaseException] = []
            leave = trio.Event()

            async def request() -> None:
                async with pool.stream(core_get(server.url)) as response:
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
                sock = response._network_stream.get_extra_info("socket")
                response.abort()
                # The server sees EOF before any other task has run: the abort itself closed
                # the upstream's side, not the request task unwinding (it is still parked).
                wait_for_eof_without_yielding(conn)
                assert sock.fileno() >= 0  # shut down, not closed: that is the task's job
                assert pool.connections() == [connection]  # busy still
                assert reader_failed == []
                response.abort()  # twice: harmless
                # Now the parked reader wakes: it reads the end of the stream mid-body, which
                # is httpx's protocol error (not a hang, not some other exception), the one the
                # relay maps to upstream_protocol_error.
                await poll_until(lambda: reader_failed)
                (error,) = reader_failed
                assert isinstance(error, httpx.RemoteProtocolError), error
                await conn.gone.wait()
                assert pool.connections() == [connection]  # the block has not exited yet
                leave.set()
            # Aborted: discarded on the way out, never kept for another request.
            assert pool.connections() == []
            assert connection.is_closed()
            response.abort()  # after the block: a no-op, still harmless


async def test_abort_then_leaving_the_block_is_clean(backend: str, nursery: trio.Nursery) -> None:
    """The relay's order: the hook aborts (here twice), then the cancellation unwinds the
    request's task through the block; closing the shut-down connection raises nothing."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, stop_mid_body)
        async with pooled_client(backend) as (_, pool):
            with trio.CancelScope() as scope:
                async with pool.stream(core_get(server.url)) as response:
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
    backend: str, nursery: trio.Nursery
) -> None:
    """httpcore would keep a fully read connection (idle, reusable), but once shut down it
    serves nobody: an aborted body's connection is discarded, never pooled."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(core_get(server.url)) as response:
                assert await read_body(response) == BODY
                response.abort()
            assert pool.connections() == []
            await server.connections[0].gone.wait()
            # The next request gets a fresh connection, and works.
            async with pool.stream(core_get(server.url)) as response:
                assert response.headers["x-conn"] == "1"
                assert await read_body(response) == BODY
            assert len(pool.connections()) == 1


async def test_abort_after_the_block_exited_is_a_no_op(backend: str, nursery: trio.Nursery) -> None:
    """A late abort (the disconnect hook of a request that already gave its connection back)
    must not touch the connection: it may be serving another request by then."""
    with trio.fail_after(DEADLINE):
        server = await start_server(nursery, keep_alive)
        async with pooled_client(backend) as (_, pool):
            async with pool.stream(core_get(server.url)) as response:
                assert await read_body(response) == BODY
            (idle,) = pool.connections()
            response.abort()
            response.abort()
            # Not shut down: the server holds no FIN, and the pool still has it, idle.
            assert not server_sees_eof_now(server.connections[0])
            assert pool.connections() == [idle]
            assert idle.is_idle()
            # The next request reuses it (a shut-down socket would read as expired, and the
            # pool would open connection 1 instead) and succeeds.
            async with pool.stream(core_get(server.url)) as response:
                assert response.headers["x-conn"] == "0"
                assert await read_body(response) == BODY
            assert len(server.connections) == 1
            assert server.connections[0].requests == 2
            assert pool.connections() == [idle]
            assert not server.connections[0].gone.is_set()


async def test_read_after_close_is_an_httpcore_read_error() -> None:
    # KeepAlivePool.aclose closes busy connections too: a producer reading one then must get
    # the ReadError the relay maps to an upstream error, not trio's ValueError for fd -1.
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        stream = LeanSocketStream(ours)
        await stream.aclose()
        with pytest.raises(httpcore.ReadError):
            await stream.read(10)
    finally:
        theirs.close()
