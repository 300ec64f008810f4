"""The upstream connection pool: HTTP/1.1 connections of our own, kept in O(1), read leanly.

Why not httpx's transport (httpcore's ``AsyncConnectionPool`` over h11)? Profiling the relay
found costs that buy this proxy nothing, each removed here and measured (docs/benchmarks.md,
"Hot path"):

* httpcore's pool rescans *every* connection on each request and on each response close, and its
  check of an idle connection is a ``poll()`` syscall: O(n) per request with n connections.
  Here idle connections wait on a LIFO stack: a request takes the most recently used one
  (checked once), a close puts it back.
* httpcore's trio stream wraps every read in ``fail_after`` plus two exception-mapping context
  managers, and trio's ``recv`` first tries the syscall and, as the next token is rarely there
  yet, fails with EAGAIN before it waits. :class:`PlainTransport` waits for readability and
  reads once, and uses a deadline only when the caller asked for a timeout.
* h11 and httpcore's layers cost ~10 us of pure Python per relayed chunk and ~0.5 ms per
  request (and they write a request's head and body in two writes). The protocol is
  proxy/protocol/http1.py, sans-IO: one write per request, ``bytes.find`` over each read.

Request concurrency is bounded before this pool (a request waits in Sluice's queue for room on
``UpstreamReplica.room``), so nothing ever waits in here: a request with no idle connection gets
a new one. Errors are httpx's exception
types, so callers (and the tests' httpx clients, see :meth:`KeepAlivePool.handle_async_request`)
see what they would see from httpx.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import math
import os
import select
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, Protocol

import httpx
import trio

from proxy.protocol import http1

log = logging.getLogger("sluice.upstream_pool")

# Closing a connection is a socket close (a TLS one may try to say goodbye); the bound only
# guards against the unexpected.
_CLOSE_TIMEOUT = 5.0
_READ_SIZE = 65536
# Retrying a spare connection that failed (KeepAlivePool.keep_spare): from, and up to.
_SPARE_BACKOFF_MIN = 1.0
_SPARE_BACKOFF_MAX = 30.0
# The clock of keep-alive expiry (a module global, so tests can move it).
monotonic = time.monotonic


class Origin:
    """Where a connection goes: scheme, host, port."""

    __slots__ = ("address_family", "host", "port", "scheme")

    def __init__(self, scheme: str, host: str, port: int) -> None:
        if scheme not in ("http", "https"):
            raise httpx.UnsupportedProtocol(f"unsupported upstream scheme {scheme!r}")
        self.scheme = scheme
        self.host = host
        self.port = port
        # An IP address's family (connected to directly), None for a name to resolve.
        self.address_family: socket.AddressFamily | None
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            self.address_family = None
        else:
            self.address_family = socket.AF_INET6 if address.version == 6 else socket.AF_INET

    @classmethod
    def of(cls, url: httpx.URL) -> Origin:
        return cls(url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Origin) and (self.scheme, self.host, self.port) == (
            other.scheme,
            other.host,
            other.port,
        )

    def __hash__(self) -> int:
        return hash((self.scheme, self.host, self.port))

    def __repr__(self) -> str:
        return f"Origin({self.scheme}://{self.host}:{self.port})"


class UpstreamRequest:
    """One request for the pool. ``headers`` are sent as given (``host`` and
    ``content-length`` included); timeouts in seconds, ``None`` for none. ``on_sent``, if
    given, is called once the request is written and its response head is awaited."""

    __slots__ = (
        "body",
        "connect_timeout",
        "headers",
        "method",
        "on_sent",
        "origin",
        "read_timeout",
        "target",
    )

    def __init__(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes = b"",
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        self.origin = origin
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        # Bounds the connection (TCP and TLS) and the request's write.
        self.connect_timeout = connect_timeout
        # Bounds each read; the relay has its own deadlines (first token, idle) and sets none.
        self.read_timeout = read_timeout
        self.on_sent = on_sent


class Transport(Protocol):
    """A connected byte stream: plain TCP or TLS."""

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...

    def is_readable(self) -> bool:
        """An idle HTTP/1.1 connection with something to read has been closed by the server
        (or broke the protocol): either way it must not be reused."""

    def shutdown(self) -> None:
        """Shut the connection down now, without closing it (any task may call this)."""

    def has_unread_data(self) -> bool:
        """Bytes taken off the socket that no read has returned yet."""

    async def aclose(self) -> None: ...


class PlainTransport:
    """A plain TCP connection on a non-blocking stdlib socket (trio waits on its descriptor)."""

    __slots__ = ("_closed", "socket")

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._closed = False

    async def read(self) -> bytes:
        sock = self.socket
        while True:
            if self._closed:
                # trio cannot wait on a closed socket's descriptor (-1: ValueError).
                await trio.lowlevel.checkpoint()
                raise httpx.ReadError("connection closed")
            # Waiting first: the relay reads right after the previous chunk, so a speculative
            # recv would almost always fail with EAGAIN. The wait is the checkpoint.
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError as error:
                raise httpx.ReadError("connection closed") from error
            try:
                return sock.recv(_READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as error:
                raise httpx.ReadError(str(error) or type(error).__name__) from error

    async def write(self, data: bytes) -> None:
        sock = self.socket
        await trio.lowlevel.checkpoint_if_cancelled()
        view = memoryview(data)
        while view:
            if self._closed:
                raise httpx.WriteError("connection closed")
            try:
                sent = sock.send(view)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError as error:
                    raise httpx.WriteError("connection closed") from error
                continue
            except OSError as error:
                raise httpx.WriteError(str(error) or type(error).__name__) from error
            view = view[sent:]

    def is_readable(self) -> bool:
        if self._closed:
            return True
        try:
            self.socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True

    def shutdown(self) -> None:
        if not self._closed:
            with contextlib.suppress(OSError):
                self.socket.shutdown(socket.SHUT_RDWR)

    def has_unread_data(self) -> bool:
        return False  # each read returns all that recv took

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            _close_socket(self.socket)
        await trio.lowlevel.checkpoint()


class TLSTransport:
    """A TLS connection: trio's SSLStream over its socket stream."""

    __slots__ = ("_closed", "_stream")

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self._stream = stream
        self._closed = False

    async def read(self) -> bytes:
        try:
            return bytes(await self._stream.receive_some(_READ_SIZE))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise httpx.ReadError(str(error) or type(error).__name__) from error

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise httpx.WriteError(str(error) or type(error).__name__) from error

    def is_readable(self) -> bool:
        if self._closed:
            return True
        if self.has_unread_data():
            return True
        poll = select.poll()
        poll.register(self._stream.transport_stream.socket.fileno(), select.POLLIN)
        return bool(poll.poll(0))

    def shutdown(self) -> None:
        if not self._closed:
            with contextlib.suppress(OSError):
                self._stream.transport_stream.socket.shutdown(socket.SHUT_RDWR)

    def has_unread_data(self) -> bool:
        # A record after the response's, taken off the socket in the same read, waits in
        # the SSLStream where polling the socket cannot see it. trio has no public way to
        # ask, so its innards are asked; a layout that differs counts as "yes" (the
        # connection is then not reused, which is always safe).
        incoming = getattr(self._stream, "_incoming", None)
        ssl_object = getattr(self._stream, "_ssl_object", None)
        if incoming is None or ssl_object is None:
            return True
        return bool(incoming.pending or ssl_object.pending())

    async def aclose(self) -> None:
        self._closed = True
        await trio.aclose_forcefully(self._stream)


async def connect(
    origin: Origin,
    *,
    connect_timeout: float | None,
    socket_options: Iterable[Sequence[Any]] = (),
    ssl_context: ssl.SSLContext | None = None,
) -> Transport:
    """A new connection to ``origin`` (the TLS handshake too, for https), within
    ``connect_timeout``. An IP address is connected to directly; a name goes through trio's
    open_tcp_stream (resolution in a thread, happy eyeballs over its addresses)."""
    with trio.move_on_after(math.inf if connect_timeout is None else connect_timeout):
        try:
            if origin.address_family is not None:
                sock = await _connect_to_address(origin, socket_options)
            else:
                stream = await trio.open_tcp_stream(origin.host, origin.port)
                sock = socket.socket(fileno=stream.socket.detach())
                sock.setblocking(False)
                _apply_options(sock, socket_options)
        except OSError as error:
            raise httpx.ConnectError(str(error) or type(error).__name__) from error
        if origin.scheme == "http":
            return PlainTransport(sock)
        assert ssl_context is not None
        # https_compatible: most servers close without a TLS close_notify, which must end a
        # body delimited by the close, not fail it.
        tls = trio.SSLStream(
            trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
            ssl_context,
            server_hostname=origin.host,
            https_compatible=True,
        )
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as error:
            await trio.aclose_forcefully(tls)
            # Its cause says why (the certificate did not verify...): the message to show.
            reason = error.__cause__ or error
            raise httpx.ConnectError(str(reason) or type(reason).__name__) from error
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        return TLSTransport(tls)
    where = f"{origin.host}:{origin.port}"
    raise httpx.ConnectTimeout(f"no connection to {where} within {connect_timeout:g}s")


def _close_socket(sock: socket.socket) -> None:
    # trio forgets the descriptor (a task waiting on it wakes with ClosedResourceError)
    # before its number can be reused.
    trio.lowlevel.notify_closing(sock)
    sock.close()


def _apply_options(sock: socket.socket, socket_options: Iterable[Sequence[Any]]) -> None:
    try:
        for option in socket_options:
            sock.setsockopt(*option)
    except OSError:
        sock.close()
        raise


async def _connect_to_address(
    origin: Origin, socket_options: Iterable[Sequence[Any]]
) -> socket.socket:
    """A non-blocking connect in this task: trio's open_tcp_stream would resolve the address
    and run its happy-eyeballs nursery for the one address there is (~0.2 ms of CPU and a
    scheduler round trip per new upstream connection, on the path to the first token)."""
    assert origin.address_family is not None
    sock = socket.socket(origin.address_family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        # As trio's SocketStream sets it: a request is one write and must not wait for an ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Before connecting, so that buffer sizes shape the window offered in the handshake.
        _apply_options(sock, socket_options)
        error = sock.connect_ex((origin.host, origin.port))
        if error == errno.EINPROGRESS:
            await trio.lowlevel.wait_writable(sock)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except BaseException:
        _close_socket(sock)  # cancelled in the wait included
        raise
    if error:
        _close_socket(sock)
        raise OSError(error, f"connect to {origin.host}:{origin.port}: {os.strerror(error)}")
    return sock


class UpstreamConnection:
    """One HTTP/1.1 connection: one request at a time, reused while the server keeps it."""

    __slots__ = ("_broken", "_closed", "_idle_since", "_reader", "answered", "origin", "transport")

    def __init__(self, origin: Origin, transport: Transport) -> None:
        self.origin = origin
        self.transport = transport
        self._reader: http1.ResponseReader | None = None
        self._idle_since = monotonic()
        self._closed = False
        # Out of step with the server (a request not fully sent): never reused.
        self._broken = False
        # Whether the request in progress has had any byte of an answer.
        self.answered = False

    def is_idle(self) -> bool:
        return not self._closed and self._reader is None

    def is_closed(self) -> bool:
        return self._closed

    def has_expired(self, keepalive_expiry: float) -> bool:
        return (
            self._closed
            or monotonic() - self._idle_since > keepalive_expiry
            or self.transport.is_readable()
        )

    async def start(self, request: UpstreamRequest) -> tuple[http1.ResponseHead, bytes]:
        """Send ``request``; read until its response head. Returns the head and the body bytes
        that came with it."""
        reader = self._reader = http1.ResponseReader(request.method)
        self.answered = False
        try:
            data = http1.encode_request(
                request.method, request.target, request.headers, request.body
            )
        except http1.LocalProtocolError as error:
            raise httpx.LocalProtocolError(str(error)) from error
        timeout = request.connect_timeout
        write_error: httpx.WriteError | None = None
        with trio.move_on_after(math.inf if timeout is None else timeout) as write_scope:
            try:
                await self.transport.write(data)
            except httpx.WriteError as error:
                # A server may answer before it has read the whole body (413, 401...) and
                # close: the write fails, but its answer is there to read (as httpcore does).
                write_error = error
                self._broken = True
        if write_scope.cancelled_caught:
            raise httpx.WriteTimeout(f"could not send the request within {timeout:g}s")
        if request.on_sent is not None:
            request.on_sent()
        try:
            return await self._read_head(reader, request.read_timeout)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if write_error is not None:
                raise write_error from None  # no answer after all: the write's error says why
            raise

    async def _read_head(
        self, reader: http1.ResponseReader, read_timeout: float | None
    ) -> tuple[http1.ResponseHead, bytes]:
        body = b""
        while reader.head is None:
            data = await self.read(read_timeout)
            self.answered = self.answered or bool(data)
            body = self.feed(data)
        return reader.head, body

    async def read(self, read_timeout: float | None) -> bytes:
        if read_timeout is None:
            return await self.transport.read()
        with trio.move_on_after(read_timeout):
            return await self.transport.read()
        raise httpx.ReadTimeout(f"nothing read within {read_timeout:g}s")

    def feed(self, data: bytes) -> bytes:
        """The body bytes ``data`` completes (an EOF when empty)."""
        reader = self._reader
        assert reader is not None
        try:
            if data:
                return reader.feed(data)
            reader.feed_eof()
            return b""
        except http1.ProtocolError as error:
            raise httpx.RemoteProtocolError(str(error)) from error

    @property
    def response_complete(self) -> bool:
        return self._reader is not None and self._reader.complete

    def finish(self) -> bool:
        """The response is done with: True if the connection can take another request."""
        reader, self._reader = self._reader, None
        self._idle_since = monotonic()
        return (
            not self._closed
            and not self._broken
            and reader is not None
            and reader.reusable
            and not self.transport.has_unread_data()
        )

    def abort(self) -> None:
        """Shut the connection down now (from any task); it is closed later, by its owner."""
        self.transport.shutdown()

    async def aclose(self) -> None:
        self._closed = True
        self._reader = None
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await self.transport.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "idle" if self._reader is None else "active"
        return f"<UpstreamConnection {self.origin!r} {state}>"


# How a reused connection fails when its server closed it as the request went out: EOF or a
# reset while reading the head, EPIPE or a reset while writing.
KEEPALIVE_RACE = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class KeepAlivePool(httpx.AsyncBaseTransport):
    """One replica's connections: in use, or idle on a LIFO stack (most recent on top)."""

    def __init__(
        self,
        *,
        max_keepalive: int,
        keepalive_expiry: float,
        socket_options: Iterable[Sequence[Any]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        spare: int = 0,
    ) -> None:
        self._max_keepalive = max_keepalive
        self._keepalive_expiry = keepalive_expiry
        self._socket_options = list(socket_options or [])
        self._ssl_context = ssl_context
        self._idle: deque[UpstreamConnection] = deque()
        self._busy: set[UpstreamConnection] = set()
        self._closed = False
        # Idle connections keep_spare keeps open ahead of demand, and its wake-up call.
        self._spare = min(spare, max_keepalive)
        self._spare_wanted = trio.Event()

    def connections(self) -> list[UpstreamConnection]:
        """Every connection the pool holds, in use or idle (for tests and diagnostics)."""
        return [*self._busy, *self._idle]

    def stream(self, request: UpstreamRequest) -> Exchange:
        """``async with pool.stream(request) as response``: the relay's way in."""
        return Exchange(self, request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """As an httpx transport, for any httpx client (the tests use it so)."""
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        # Read whole, so sent with a length (a streamed body came with transfer-encoding).
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name.lower() not in (b"transfer-encoding", b"content-length")
        ]
        if body or request.method not in ("GET", "HEAD"):
            headers.append((b"content-length", str(len(body)).encode()))
        exchange = Exchange(
            self,
            UpstreamRequest(
                Origin.of(request.url),
                request.method.encode(),
                request.url.raw_path,
                headers,
                body,
                connect_timeout=timeouts.get("connect"),
                read_timeout=timeouts.get("read"),
            ),
        )
        response = await exchange.__aenter__()
        return httpx.Response(
            status_code=response.status_code,
            headers=response.raw_headers,
            stream=_ExchangeStream(exchange, response),
        )

    async def open(self, request: UpstreamRequest) -> tuple[UpstreamConnection, UpstreamResponse]:
        """Send ``request`` on an idle connection or a new one; read its response head. The
        caller gives the connection back with :meth:`release` or :meth:`discard`."""
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        connection, was_idle = await self._take(request)
        try:
            head, body = await self._start(connection, request)
        except KEEPALIVE_RACE as error:
            if not was_idle or connection.answered:
                raise
            # The keep-alive race: the server closed this idle connection as the request went
            # out (uvicorn after 5 s idle; many servers right after an answer, without saying
            # Connection: close). It never answered on it, so the request is sent once more on
            # a fresh connection, and the replica is not blamed for it.
            log.debug("%r: reused connection closed before an answer (%s); retrying", self, error)
            connection = await self._connect(request.origin, request.connect_timeout)
            head, body = await self._start(connection, request)
        return connection, UpstreamResponse(connection, head, body, request.read_timeout)

    async def _start(
        self, connection: UpstreamConnection, request: UpstreamRequest
    ) -> tuple[http1.ResponseHead, bytes]:
        self._busy.add(connection)
        try:
            return await connection.start(request)
        except BaseException:
            # Whatever state it is in, it serves nobody else.
            await self.discard(connection)
            raise

    async def _take(self, request: UpstreamRequest) -> tuple[UpstreamConnection, bool]:
        """A connection for ``request``, and whether it was idle (kept alive, or a spare)
        rather than opened for it."""
        idle = self._idle
        expiry = self._keepalive_expiry
        # The bottom of the stack is the longest idle: the one most likely past its expiry.
        # Pruning one per request keeps a stack that shrank in use from holding dead sockets.
        if len(idle) > 1 and idle[0].has_expired(expiry):
            await idle.popleft().aclose()
        if len(idle) <= self._spare:
            self._spare_wanted.set()  # this request takes one of the spares (or finds none)
        while idle:
            connection = idle.pop()
            if connection.origin == request.origin and not connection.has_expired(expiry):
                return connection, True
            await connection.aclose()
        return await self._connect(request.origin, request.connect_timeout), False

    async def _connect(self, origin: Origin, connect_timeout: float | None) -> UpstreamConnection:
        transport = await connect(
            origin,
            connect_timeout=connect_timeout,
            socket_options=self._socket_options,
            ssl_context=self.tls_context() if origin.scheme == "https" else None,
        )
        return UpstreamConnection(origin, transport)

    async def keep_spare(self, origin: Origin, connect_timeout: float | None) -> None:
        """Keep the pool's ``spare`` idle connections to ``origin`` open ahead of demand, for
        as long as the pool is open: run by the pool's owner, in its nursery. A request then
        finds a connection ready even in a burst, instead of connecting (and for https,
        handshaking) on its way to the first token. Connections are opened one at a time; a
        failed connect is retried after a backoff (1 s, doubling to 30 s), and only while
        connections are still wanted."""
        backoff = _SPARE_BACKOFF_MIN
        while self._spare and not self._closed:
            if len(self._idle) >= self._spare:
                self._spare_wanted = trio.Event()
                # Woken by a request taking a spare, or once per expiry to let go of idle
                # connections past it (requests prune one per take; a quiet pool does not).
                with trio.move_on_after(self._keepalive_expiry):
                    await self._spare_wanted.wait()
                await self._prune_expired()
                continue
            try:
                connection = await self._connect(origin, connect_timeout)
            except httpx.TransportError as error:
                log.debug("spare connection to %r: %s; again in %gs", origin, error, backoff)
                await trio.sleep(backoff)
                backoff = min(backoff * 2, _SPARE_BACKOFF_MAX)
                continue
            backoff = _SPARE_BACKOFF_MIN
            if self._closed or len(self._idle) >= self._max_keepalive:
                await connection.aclose()
                continue
            self._idle.append(connection)

    async def _prune_expired(self) -> None:
        idle = self._idle
        while idle and idle[0].has_expired(self._keepalive_expiry):
            await idle.popleft().aclose()

    def tls_context(self) -> ssl.SSLContext:
        # Built on first use (loading the CA bundle takes milliseconds): httpx's default, the
        # certifi bundle, and HTTP/1.1 only.
        if self._ssl_context is None:
            self._ssl_context = httpx.create_ssl_context()
            self._ssl_context.set_alpn_protocols(["http/1.1"])
        return self._ssl_context

    async def release(self, connection: UpstreamConnection) -> None:
        """A response closed: keep its connection if it can take another request."""
        self._busy.discard(connection)
        if connection.finish() and not self._closed and len(self._idle) < self._max_keepalive:
            self._idle.append(connection)
        else:
            await connection.aclose()

    async def discard(self, connection: UpstreamConnection) -> None:
        """Close a connection taken from this pool, whatever its state."""
        self._busy.discard(connection)
        await connection.aclose()

    async def aclose(self) -> None:
        self._closed = True
        self._spare_wanted.set()  # keep_spare sees the pool closed, and returns
        connections = self.connections()
        self._idle.clear()
        self._busy.clear()
        for connection in connections:
            await connection.aclose()


class UpstreamResponse:
    """What the relay reads of an upstream response: status, headers, body chunks."""

    __slots__ = (
        "_connection",
        "_first",
        "_read_timeout",
        "aborted",
        "closed",
        "headers",
        "raw_headers",
        "status_code",
    )

    def __init__(
        self,
        connection: UpstreamConnection,
        head: http1.ResponseHead,
        first: bytes,
        read_timeout: float | None,
    ) -> None:
        self._connection = connection
        self.status_code = head.status
        self.raw_headers = head.headers
        # Lower-case names; of a repeated header the last value (the relay reads only
        # single-valued ones: content-type, retry-after).
        self.headers = {
            name.decode("latin-1"): value.decode("latin-1") for name, value in head.headers
        }
        self._first = first
        self._read_timeout = read_timeout
        self.aborted = False
        self.closed = False

    def abort(self) -> None:
        """Shut this response's connection down now, from any task: the upstream sees the close
        at once (and a server like vLLM aborts the generation) while the request's task has yet
        to unwind. The connection is then discarded, never reused. A no-op once the exchange
        is closed: the connection may be serving another request by then."""
        if not (self.aborted or self.closed):
            self.aborted = True
            self._connection.abort()

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk (transfer framing removed, no decoding)."""
        return _Chunks(self)

    async def next_chunk(self) -> bytes | None:
        """The next body bytes; None at the end of the body."""
        if self._first:
            first, self._first = self._first, b""
            return first
        connection = self._connection
        while not connection.response_complete:
            data = connection.feed(await connection.read(self._read_timeout))
            if data:
                return data
        return None


class _Chunks:
    """An iterator object, not an async generator: nothing of ours is left for the garbage
    collector to finalize when a relay stops reading mid-stream."""

    __slots__ = ("_response",)

    def __init__(self, response: UpstreamResponse) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.next_chunk()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class Exchange:
    """One request on a pool, as an async context manager: the response is closed when the
    block ends, however it ends (its connection kept if fully read, else closed, so the
    upstream sees a client's disconnect)."""

    __slots__ = ("_connection", "_done", "_pool", "_request", "_response")

    def __init__(self, pool: KeepAlivePool, request: UpstreamRequest) -> None:
        self._pool = pool
        self._request = request
        self._connection: UpstreamConnection | None = None
        self._response: UpstreamResponse | None = None
        self._done = False

    async def __aenter__(self) -> UpstreamResponse:
        self._connection, self._response = await self._pool.open(self._request)
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._done or self._connection is None or self._response is None:
            return
        self._done = True
        self._response.closed = True
        # No checkpoint before the decision: this runs as a cancelled request unwinds.
        if self._response.aborted or not self._connection.response_complete:
            await self._pool.discard(self._connection)
        else:
            await self._pool.release(self._connection)


class _ExchangeStream(httpx.AsyncByteStream):
    """An exchange's body as an httpx response stream (the transport interface)."""

    def __init__(self, exchange: Exchange, response: UpstreamResponse) -> None:
        self._exchange = exchange
        self._response = response

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Chunks(self._response)

    async def aclose(self) -> None:
        await self._exchange.aclose()
