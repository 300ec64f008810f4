"""The httpx transport: a replica's requests through ``httpx.AsyncHTTPTransport``.

For what the lean pool does not do: HTTP(S) proxies (absolute-form requests for http, CONNECT
tunnels for https) and HTTP/2. The relay uses the transport directly, not an
``httpx.AsyncClient``: no cookies, auth, redirects or event hooks to pass through per request
(redirects are never followed: see the backend), and httpx's own exception types, which the
backend already maps to the client's errors.

What this module guards against, and where:

* httpcore #1093 (open in 1.0.9): a request cancelled while it waits for a pool slot leaks a
  ``CONNECTING`` connection, until every request gets ``PoolTimeout``. Nothing waits in here:
  the replica's slots (``UpstreamReplica.slots``) admit at most ``max_connections`` requests,
  and httpcore's pool is that large, so a request always gets a connection at once. The pool
  wait is bounded anyway (by connect_timeout), so a bug would be an error, not a hang.
* The keep-alive race: httpcore does not retry a request whose reused connection the server
  closed as it went out. :meth:`HttpxPool.open` does, as the lean pool does; httpx's ``trace``
  extension says whether the connection was opened for the request.
* HTTP/2 cancellation (httpcore #943/#1022): httpcore never resets the stream of a response
  closed early, so the upstream would keep generating for nobody. See
  ``proxy.server.adapters.httpcore_adapter``, which is the only module that touches httpcore's
  internals; HTTP/2 is offered only while its guard is installed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import httpx
import trio

from proxy.backends.upstream.pool import KEEPALIVE_RACE, Origin, UpstreamRequest
from proxy.backends.upstream.transports import ConnectionSettings

log = logging.getLogger("sluice.upstream")

# Set by proxy.server.adapters.httpcore_adapter.install once httpcore resets the streams of
# cancelled HTTP/2 responses; until then HTTP/2 is not offered (ALPN says http/1.1 only).
http2_stream_reset_installed = False


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
        """httpcore's connections (each with ``is_idle()``), for tests and diagnostics; empty
        if a version of httpx keeps them elsewhere."""
        pool = getattr(self._transport, "_pool", None)
        return list(getattr(pool, "connections", []))

    async def keep_spare(self, origin: Origin, connect_timeout: float | None) -> None:
        """httpcore opens connections on demand only: nothing to keep (the lean pool's
        ``preconnect`` does not apply)."""
        await trio.lowlevel.checkpoint()

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
        while True:
            fresh = False

            async def trace(event: str, info: dict[str, Any]) -> None:
                nonlocal fresh
                if event == "connection.connect_tcp.started":
                    fresh = True

            outgoing = httpx.Request(
                request.method.decode(),
                url,
                headers=list(request.headers),
                content=request.body,
                extensions={"timeout": timeouts, "trace": trace},
            )
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
            return HttpxResponse(response)

    async def aclose(self) -> None:
        with trio.move_on_after(5, shield=True):
            await self._transport.aclose()


def _authority(origin: Origin) -> str:
    host = f"[{origin.host}]" if ":" in origin.host else origin.host
    return f"{host}:{origin.port}"


class HttpxResponse:
    """An httpx response as the relay reads it (:class:`transports.Response`)."""

    __slots__ = ("_response", "aborted", "closed", "headers", "status_code")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
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
        with trio.move_on_after(5, shield=True):
            await stream.aclose()


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


__all__ = ["HttpxExchange", "HttpxPool", "HttpxResponse", "http2_stream_reset_installed"]
