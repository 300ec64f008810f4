"""The upstream connection pool: httpcore's HTTP/1.1 connections, kept in O(1), read leanly.

Why not httpx's default transport (httpcore's ``AsyncConnectionPool``)? Profiling the relay at
a few hundred streams showed two costs that grow with load and buy this proxy nothing:

* The pool rescans *every* connection on each request and on each response close, and its
  check of an idle connection (``has_expired``) is a ``poll()`` syscall. strace at 100 streams:
  2.6 ``poll`` calls per relayed event, the proxy's most frequent syscall; with n connections
  it is O(n) per request, O(n²) per burst. Here idle connections wait on a LIFO stack: a
  request takes the most recently used one (checked once), a close puts it back.
* httpcore's trio stream wraps every read in ``fail_after`` plus two exception-mapping context
  managers, and trio's ``recv`` first tries the syscall and, as the next token is rarely there
  yet, fails with EAGAIN before it waits. :class:`LeanSocketStream` waits for readability and
  reads once, and uses a deadline only when the caller asked for a timeout.

Request concurrency is bounded before this pool (``UpstreamReplica.slots``), so nothing ever
waits in here: a request with no idle connection gets a new one. The HTTP/1.1 protocol itself
(h11, response framing, keep-alive state, closing a half-read response) stays httpcore's.

The network stream's and backend's method signatures (``timeout`` parameters included) are
httpcore's interface, hence the ASYNC109 exemptions.
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx
import trio

# httpcore's errors as httpx's (most specific first): the relay and its callers see httpx's.
_ERRORS: tuple[tuple[type[Exception], type[httpx.HTTPError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
)
_CORE_ERRORS = tuple(core_type for core_type, _ in _ERRORS)
# Closing a connection is a socket close; the bound only guards against the unexpected.
_CLOSE_TIMEOUT = 5.0


def as_httpx_error(error: Exception) -> Exception:
    """The httpx exception for an httpcore one."""
    for core_type, httpx_type in _ERRORS:
        if isinstance(error, core_type):
            mapped = httpx_type(str(error))
            mapped.__cause__ = error
            return mapped
    raise AssertionError(f"not an httpcore error: {error!r}")


class LeanSocketStream(httpcore.AsyncNetworkStream):
    """A plain TCP connection as httpcore's network stream, on a non-blocking stdlib socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._closed = False

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if timeout is None:
            return await self._read(max_bytes)
        with trio.move_on_after(timeout):
            return await self._read(max_bytes)
        raise httpcore.ReadTimeout(f"no data within {timeout:g}s")

    async def _read(self, max_bytes: int) -> bytes:
        sock = self._sock
        while True:
            if self._closed:
                # trio cannot wait on a closed socket's descriptor (-1: ValueError).
                await trio.lowlevel.checkpoint()
                raise httpcore.ReadError("connection closed")
            # Waiting first: the relay reads right after the previous chunk, so a speculative
            # recv would almost always fail with EAGAIN. The wait is the checkpoint.
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError as error:
                raise httpcore.ReadError("connection closed") from error
            try:
                return sock.recv(max_bytes)
            except BlockingIOError:
                continue
            except OSError as error:
                raise httpcore.ReadError(str(error)) from error

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._write(buffer)
            return
        raise httpcore.WriteTimeout(f"could not write within {timeout:g}s")

    async def _write(self, buffer: bytes) -> None:
        sock = self._sock
        view = memoryview(buffer)
        await trio.lowlevel.checkpoint_if_cancelled()
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError as error:
                    raise httpcore.WriteError("connection closed") from error
                continue
            except OSError as error:
                raise httpcore.WriteError(str(error)) from error
            view = view[sent:]

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            # Wakes a task waiting on this socket (with ClosedResourceError) before the fd
            # number can be reused.
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        await trio.lowlevel.checkpoint()

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.UnsupportedProtocol("TLS upstreams use httpcore's own trio backend")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":
            return self._is_readable()
        if info == "socket":
            return self._sock
        if self._closed:
            return None
        if info == "client_addr":
            return self._sock.getsockname()
        if info == "server_addr":
            return self._sock.getpeername()
        return None

    def _is_readable(self) -> bool:
        """An idle HTTP/1.1 connection with something to read has been closed by the server
        (or broke the protocol): either way it must not be reused."""
        if self._closed:
            return True
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return True


class LeanTrioBackend(httpcore.AsyncNetworkBackend):
    """Connects with trio (happy eyeballs, resolution in a thread), then hands the socket to
    :class:`LeanSocketStream`."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                stream = await trio.open_tcp_stream(host, port, local_address=local_address)
        except trio.TooSlowError as error:
            raise httpcore.ConnectTimeout(f"no connection within {timeout:g}s") from error
        except OSError as error:
            raise httpcore.ConnectError(str(error)) from error
        trio_socket = stream.socket
        try:
            for option in socket_options or ():
                trio_socket.setsockopt(*option)
        except OSError as error:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            raise httpcore.ConnectError(str(error)) from error
        # The same descriptor under a stdlib socket object (trio's epoll registration is per
        # descriptor, so it carries over); trio's socket object lets go of it without closing.
        sock = socket.socket(fileno=trio_socket.detach())
        sock.setblocking(False)
        return LeanSocketStream(sock)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:  # pragma: no cover - upstreams are TCP URLs
        raise httpcore.UnsupportedProtocol("unix sockets are not supported")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


class KeepAlivePool(httpx.AsyncBaseTransport):
    """One replica's connections: in use, or idle on a LIFO stack (most recent on top)."""

    def __init__(
        self,
        *,
        max_keepalive: int,
        keepalive_expiry: float,
        socket_options: Iterable[Any] | None = None,
        network_backend: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._max_keepalive = max_keepalive
        self._keepalive_expiry = keepalive_expiry
        self._socket_options = list(socket_options or [])
        self._backend = network_backend
        self._idle: deque[httpcore.AsyncHTTPConnection] = deque()
        self._busy: set[httpcore.AsyncHTTPConnection] = set()
        self._closed = False

    def connections(self) -> list[httpcore.AsyncHTTPConnection]:
        """Every connection the pool holds, in use or idle (for tests and diagnostics)."""
        return [*self._busy, *self._idle]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """As an httpx transport, for any httpx client (the tests use it so; the relay uses
        :meth:`stream`, the health checks a client of their own)."""
        url = request.url
        response, body = await self.send(
            httpcore.Request(
                method=request.method,
                url=httpcore.URL(
                    scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
                ),
                headers=request.headers.raw,
                content=request.stream,
                extensions=request.extensions,
            )
        )
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=body,
            extensions=response.extensions,
        )

    def stream(self, request: httpcore.Request) -> Exchange:
        """``async with pool.stream(request) as response``: the relay's way in, without the
        httpx client's per-request machinery (URL and header models, auth and redirect flows,
        cookies, three more wrappers per body chunk). Errors are httpx's all the same."""
        return Exchange(self, request)

    async def send(self, request: httpcore.Request) -> tuple[httpcore.Response, PooledBody]:
        """Send ``request`` on an idle connection or a new one; the response's body gives the
        connection back when it is closed."""
        if self._closed:
            raise RuntimeError("the upstream pool is closed")
        connection = await self._take(request.url.origin)
        self._busy.add(connection)
        try:
            response = await connection.handle_async_request(request)
        except BaseException as error:
            # Whatever state it is in (httpcore closes a connection whose exchange failed or
            # was cancelled), it serves nobody else.
            await self.discard(connection)
            if isinstance(error, _CORE_ERRORS):
                raise as_httpx_error(error) from error
            raise
        return response, PooledBody(self, connection, response.stream)

    async def _take(self, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        idle = self._idle
        # The bottom of the stack is the longest idle: the one most likely past its expiry.
        # Pruning one per request keeps a stack that shrank in use from holding dead sockets.
        if len(idle) > 1 and idle[0].has_expired():
            await self._close(idle.popleft())
        while idle:
            connection = idle.pop()
            if connection.is_available() and not connection.has_expired():
                return connection
            await self._close(connection)
        return httpcore.AsyncHTTPConnection(
            origin,
            keepalive_expiry=self._keepalive_expiry,
            network_backend=self._backend,
            socket_options=self._socket_options or None,
        )

    async def release(self, connection: httpcore.AsyncHTTPConnection) -> None:
        """A response closed: keep its connection if it can take another request."""
        self._busy.discard(connection)
        if not self._closed and connection.is_available() and len(self._idle) < self._max_keepalive:
            self._idle.append(connection)
        else:
            await self._close(connection)

    async def discard(self, connection: httpcore.AsyncHTTPConnection) -> None:
        """Close a connection taken from this pool, whatever its state."""
        self._busy.discard(connection)
        await self._close(connection)

    @staticmethod
    async def _close(connection: httpcore.AsyncHTTPConnection) -> None:
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await connection.aclose()

    async def aclose(self) -> None:
        self._closed = True
        connections = self.connections()
        self._idle.clear()
        self._busy.clear()
        for connection in connections:
            await self._close(connection)


class PooledBody(httpx.AsyncByteStream):
    """A response body that gives its connection back to the pool when closed."""

    def __init__(
        self,
        pool: KeepAlivePool,
        connection: httpcore.AsyncHTTPConnection,
        stream: Any,
    ) -> None:
        self._pool = pool
        self._connection = connection
        self._stream = stream
        self._chunks: Any = None
        self._released = False
        self._aborted = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        # An iterator object, not an async generator: nothing of ours is left for the garbage
        # collector to finalize when a relay stops reading mid-stream.
        self._chunks = self._stream.__aiter__()
        return _Chunks(self._chunks)

    def abort(self, network_stream: Any) -> None:
        """Shut the connection down now, from any task: the upstream sees the close at once
        (and a server like vLLM aborts the generation) while this request's task has yet to
        unwind. A no-op once the body is closed: the connection may serve another request."""
        if self._released or self._aborted:
            return
        self._aborted = True
        sock = network_stream.get_extra_info("socket") if network_stream is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        # Shielded: this runs as a cancelled request unwinds, and httpcore's close takes a
        # lock (a checkpoint). A fully read response leaves the connection idle (reusable); a
        # half-read one closes it, so the upstream sees the client's disconnect.
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            try:
                with contextlib.suppress(httpcore.NetworkError, httpcore.ProtocolError):
                    if self._chunks is not None and hasattr(self._chunks, "aclose"):
                        # httpcore's body generator, finalized now rather than by the GC.
                        await self._chunks.aclose()
                    await self._stream.aclose()
            finally:
                if self._aborted:
                    await self._pool.discard(self._connection)
                else:
                    await self._pool.release(self._connection)


class UpstreamResponse:
    """What the relay reads of an upstream response: status, headers, body chunks."""

    __slots__ = ("_body", "_network_stream", "headers", "status_code")

    def __init__(self, response: httpcore.Response, body: PooledBody) -> None:
        self.status_code = response.status
        # httpcore's HTTP/1.1 responses name their connection's stream (for upgrades).
        self._network_stream = response.extensions.get("network_stream")
        # Lower-case names; of a repeated header the last value (the relay reads only
        # single-valued ones: content-type, retry-after).
        self.headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in response.headers
        }
        self._body = body

    def abort(self) -> None:
        """Shut this response's connection down now (see PooledBody.abort)."""
        self._body.abort(self._network_stream)

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk (transfer framing removed, no decoding)."""
        return self._body.__aiter__()


class Exchange:
    """One request on a pool, as an async context manager: the response is closed when the
    block ends, however it ends (its connection kept if fully read, else closed)."""

    __slots__ = ("_body", "_pool", "_request")

    def __init__(self, pool: KeepAlivePool, request: httpcore.Request) -> None:
        self._pool = pool
        self._request = request
        self._body: PooledBody | None = None

    async def __aenter__(self) -> UpstreamResponse:
        response, self._body = await self._pool.send(self._request)
        return UpstreamResponse(response, self._body)

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._body is not None
        await self._body.aclose()


class _Chunks:
    """httpcore's body chunks, with its errors raised as httpx's."""

    __slots__ = ("_chunks",)

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._chunks.__anext__()
        except _CORE_ERRORS as error:
            raise as_httpx_error(error) from error
