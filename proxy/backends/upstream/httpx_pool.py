"""The httpx transport: a replica's requests through ``httpx.AsyncHTTPTransport``.

For what the lean pool does not do: HTTP(S) proxies (absolute-form requests for http, CONNECT
tunnels for https) and HTTP/2. The relay uses the transport directly, not an
``httpx.AsyncClient``: no cookies, auth, redirects or event hooks to pass through per request
(redirects are never followed: see the backend), and httpx's own exception types, which the
backend already maps to the client's errors.

What this module guards against, and where:

* httpcore #1093 (open in 1.0.9): a request cancelled while it waits for a pool slot leaks a
  ``CONNECTING`` connection, until every request gets ``PoolTimeout``. Nothing waits in here:
  Sluice's queue dispatches at most ``max_connections`` requests to a replica
  (``UpstreamReplica.room``), and httpcore's pool is that large, so a request always gets a
  connection at once. The pool wait is bounded anyway (by connect_timeout), so a bug would be
  an error, not a hang.
* The keep-alive race: httpcore does not retry a request whose reused connection the server
  closed as it went out. :meth:`HttpxPool.open` does, as the lean pool does; httpx's ``trace``
  extension says whether the connection was opened for the request.
* HTTP/2 cancellation (httpcore #943/#1022): httpcore never resets the stream of a response
  closed early, so the upstream would keep generating for nobody. See
  ``proxy.server.adapters.httpcore_adapter``, which is the only module that touches httpcore's
  internals; HTTP/2 is offered only while its guard is installed.
* Idle connections that their server closed (right after its answer, which is legal
  HTTP/1.1, or after idling a while, as uvicorn does): httpcore keeps such a connection as
  idle and sees the close (``has_expired()``: idle, with a readable socket) only when it next
  assigns requests, which it does as each request comes and as each response closes. A close
  that arrives after the last response would hold a socket in CLOSE_WAIT until the next
  request, and every fd must come back. :meth:`HttpxPool.keep_spare`, run for the pool's
  lifetime in the app's nursery, sleeps while no connection is idle (a response's close wakes
  it); while one is, it closes once a second the connections that are ``is_idle()`` and
  ``has_expired()`` (HTTP/2's are multiplexed: only those too). Never while a request is
  inside httpcore's pool: httpcore marks the connection it handed a request active only after
  awaiting a lock, so until then it looks idle. Otherwise nothing awaits between the check and
  ``aclose()``, which marks the connection closed before its first await, and trio runs one
  task at a time: no request can be handed it in between (httpcore drops closed connections
  at its next assignment). The pool inside httpx's transport is an httpx internal, reached
  through ``connection_pool_of``, which the adapter installs after its start-up check; without
  it idle connections are left to httpcore, as before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import trio

from proxy.backends.upstream.pool import KEEPALIVE_RACE, Origin, UpstreamRequest
from proxy.backends.upstream.transports import ConnectionSettings

if TYPE_CHECKING:
    import httpcore

log = logging.getLogger("sluice.upstream")

# Set by proxy.server.adapters.httpcore_adapter.install once httpcore resets the streams of
# cancelled HTTP/2 responses; until then HTTP/2 is not offered (ALPN says http/1.1 only).
http2_stream_reset_installed = False


def out_of_reach(transport: httpx.AsyncHTTPTransport) -> httpcore.AsyncConnectionPool | None:
    """The fallback: no pool to look at, so the sweep does nothing."""
    return None


# The httpcore pool inside an httpx transport, or None: installed by
# proxy.server.adapters.httpcore_adapter.install once its start-up check found the internal.
connection_pool_of: Callable[[httpx.AsyncHTTPTransport], httpcore.AsyncConnectionPool | None]
connection_pool_of = out_of_reach

# How often the idle connections are looked at while there are any: "about a second" after
# their server closed them is soon enough for the fd count, and each look is a poll() per idle
# connection.
SWEEP_INTERVAL = 1.0
# Closing one idle connection: a socket close, or a TLS close_notify that nobody waits for.
_CLOSE_TIMEOUT = 1.0


class HttpxPool:
    """One replica's connections, kept by httpcore's pool inside httpx's transport."""

    def __init__(
        self,
        settings: ConnectionSettings,
        *,
        max_connections: int,
        max_keepalive: int,
        keepalive_expiry: float,
        socket_options: Iterable[Sequence[Any]] | None = None,
    ) -> None:
        self.settings = settings
        self._max_keepalive = max_keepalive
        self._closed = trio.Event()
        # Requests inside httpcore's pool (handed a connection, or about to be) and not yet
        # answered: while there are any, the sweep touches nothing.
        self._requests_in_pool = 0
        # Set when a connection may have become idle: the sweep's wake-up call.
        self._released = trio.Event()
        http2 = settings.http2 and http2_stream_reset_installed
        if settings.http2 and not http2:
            log.warning(
                "HTTP/2 is off for this replica: httpcore's HTTP/2 streams cannot be reset "
                "when a client leaves (the start-up log says which internal is missing)"
            )
        self.http2 = http2
        self._tls = settings.ssl_context(alpn=["h2", "http/1.1"] if http2 else ["http/1.1"])
        self._transport = httpx.AsyncHTTPTransport(
            verify=self._tls,
            http1=True,
            http2=http2,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_keepalive,
                keepalive_expiry=keepalive_expiry,
            ),
            proxy=settings.proxy,
            retries=0,
            socket_options=[tuple(option) for option in socket_options or ()] or None,
            trust_env=False,
        )

    def stream(self, request: UpstreamRequest) -> HttpxExchange:
        return HttpxExchange(self, request)

    def tls_context(self) -> ssl.SSLContext:
        return self._tls

    def connections(self) -> list[Any]:
        """httpcore's connections that are not closed (each with ``is_idle()``), for tests and
        diagnostics; empty where the adapter cannot reach httpcore's pool."""
        pool = connection_pool_of(self._transport)
        if pool is None:
            return []
        return [connection for connection in pool.connections if not connection.is_closed()]

    async def keep_spare(self, origin: Origin, connect_timeout: float | None) -> None:
        """This pool's background work, run by its owner in its nursery for as long as the
        pool is open. httpcore opens connections on demand only, so there are no spares to
        keep (the lean pool's ``preconnect``); instead, idle connections whose server closed
        them are closed here (see the module's docstring). Returns when the pool closes, or
        at once where httpcore's pool is out of reach."""
        pool = connection_pool_of(self._transport)
        if pool is None:
            await trio.lowlevel.checkpoint()
            return
        while not self._closed.is_set():
            if not any(connection.is_idle() for connection in pool.connections):
                self._released = trio.Event()
                await self._released.wait()
                continue
            # The owner's nursery waits for this task once the pool closes: no full sleep then.
            with trio.move_on_after(SWEEP_INTERVAL):
                await self._closed.wait()
            await self._sweep(pool)

    async def _sweep(self, pool: httpcore.AsyncConnectionPool) -> None:
        """Close the idle connections that have expired (their server closed them, or they
        outlived the keep-alive expiry)."""
        for connection in pool.connections:
            # Checked again after every close: a request may have come in meanwhile.
            if self._requests_in_pool or self._closed.is_set():
                return
            # Nothing awaits between this check and aclose() marking the connection closed, so
            # no request can be handed it in between.
            if connection.is_idle() and connection.has_expired():
                with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                    await connection.aclose()

    def _connection_released(self) -> None:
        self._released.set()

    async def open(self, request: UpstreamRequest) -> HttpxResponse:
        url = f"{request.origin.scheme}://{_authority(request.origin)}{request.target.decode()}"
        timeout = request.connect_timeout
        timeouts = {"connect": timeout, "write": timeout, "read": request.read_timeout}
        # Bounded though nothing should wait for the pool (see the module's docstring).
        timeouts["pool"] = timeout
        # httpcore cannot be asked for a fresh connection, and every idle one may be in its
        # server's closing window (a burst after a quiet spell): a race costs httpcore that
        # connection, so the retries are bounded by the idle connections it can hold, plus one.
        races = 0
        on_sent = request.on_sent
        while True:
            fresh = False

            async def trace(event: str, info: dict[str, Any]) -> None:
                nonlocal fresh
                if event == "connection.connect_tcp.started":
                    fresh = True
                elif (
                    on_sent is not None
                    # Written (HTTP/1.1 and HTTP/2 alike); the head is awaited now.
                    and event.endswith(".receive_response_headers.started")
                    # Through an https proxy, the tunnel's CONNECT is answered first.
                    and info["request"].method != b"CONNECT"
                ):
                    on_sent()

            outgoing = httpx.Request(
                request.method.decode(),
                url,
                headers=list(request.headers),
                content=request.body,
                extensions={"timeout": timeouts, "trace": trace},
            )
            self._requests_in_pool += 1
            try:
                response = await self._transport.handle_async_request(outgoing)
            except KEEPALIVE_RACE as error:
                races += 1
                if fresh or races > self._max_keepalive:
                    raise
                # As in the lean pool: a reused connection that the server closed as the
                # request went out, with no answer on it; sent again, and the replica is not
                # blamed.
                log.debug("reused connection closed before an answer (%s); retrying", error)
                continue
            except BaseException:
                # Failed or cancelled in there: a connection it was handed may be left idle.
                self._connection_released()
                raise
            finally:
                self._requests_in_pool -= 1
            return HttpxResponse(response, self)

    async def aclose(self) -> None:
        self._closed.set()
        self._connection_released()  # the sweep sees the pool closed, and returns
        with trio.move_on_after(5, shield=True):
            await self._transport.aclose()


def _authority(origin: Origin) -> str:
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    return f"{host}:{origin.port}"


class HttpxResponse:
    """An httpx response as the relay reads it (:class:`transports.Response`)."""

    __slots__ = ("_pool", "_response", "aborted", "closed", "headers", "status_code")

    def __init__(self, response: httpx.Response, pool: HttpxPool) -> None:
        self._response = response
        self._pool = pool
        self.status_code = response.status_code
        self.headers = response.headers
        self.aborted = False
        self.closed = False

    @property
    def http_version(self) -> str:
        version = self._response.extensions.get("http_version", b"HTTP/1.1")
        return version.decode("ascii", "replace") if isinstance(version, bytes) else str(version)

    def abort(self) -> None:
        """Shut an HTTP/1.1 connection (or the tunnel through a proxy) down now, so that the
        server sees the client's disconnect before this request's task has unwound. An
        HTTP/2 connection carries other requests' streams: this one's is reset when its
        response closes, as the cancelled task unwinds."""
        if self.aborted or self.closed or self.http_version.startswith("HTTP/2"):
            return
        self.aborted = True
        stream = self._response.extensions.get("network_stream")
        sock = None if stream is None else stream.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: httpx's raw stream (no content decoding)."""
        stream = self._response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        return stream.__aiter__()

    async def aclose(self) -> None:
        self.closed = True
        stream = self._response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        # Shielded and bounded: this runs as a cancelled request unwinds, and closing is what
        # tells the server (a socket close, or an HTTP/2 stream reset).
        try:
            with trio.move_on_after(5, shield=True):
                await stream.aclose()
        finally:
            self._pool._connection_released()


class HttpxExchange:
    """``async with pool.stream(request) as response``, as the lean pool's Exchange."""

    __slots__ = ("_pool", "_request", "_response")

    def __init__(self, pool: HttpxPool, request: UpstreamRequest) -> None:
        self._pool = pool
        self._request = request
        self._response: HttpxResponse | None = None

    async def __aenter__(self) -> HttpxResponse:
        self._response = await self._pool.open(self._request)
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        if self._response is not None:
            await self._response.aclose()


__all__ = [
    "SWEEP_INTERVAL",
    "HttpxExchange",
    "HttpxPool",
    "HttpxResponse",
    "connection_pool_of",
    "http2_stream_reset_installed",
    "out_of_reach",
]
