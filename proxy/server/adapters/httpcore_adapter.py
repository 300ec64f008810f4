"""httpcore (under httpx): the HTTP/2 stream reset that httpcore does not do, and the reach to
httpcore's pool inside httpx's transport.

* ``http2``: when a response is closed before its end (its client left), httpcore 1.0.x
  forgets the stream but never tells the server (httpcore #943, #1022; PR #1098 open): no
  RST_STREAM is sent, so the upstream keeps generating for nobody, and h2's count of open
  streams drifts by one per cancelled request until the connection refuses new ones ("Max
  outbound streams is 100, 100 open"). :func:`install` wraps
  ``AsyncHTTP2Connection._response_closed`` to reset a stream still open, through h2's public
  API (``reset_stream``), and to write the frame at once, under httpcore's write lock, shielded
  and bounded. Without these internals HTTP/2 is not offered: ALPN says http/1.1 only, and
  every contract holds over HTTP/1.1.
* ``idle_sweep``: httpcore keeps an idle connection that its server closed until it next
  assigns a request (see ``proxy.backends.upstream.httpx_pool``, whose sweep closes them).
  The sweep goes through httpcore's public connection interface (``connections``,
  ``is_idle()``, ``has_expired()``, ``aclose()``), but the pool itself is httpx's attribute
  ``AsyncHTTPTransport._pool``: :func:`connection_pool` reads it, checked at start-up on a
  transport made for the purpose. Without it the sweep does nothing: those connections stay
  open (in CLOSE_WAIT) until the replica's next request, as httpcore alone keeps them.
* ``tls_cancel``: httpcore's trio stream closes its socket when the TLS handshake fails with an
  ``Exception``, not when it is cancelled (``trio.Cancelled`` is a BaseException), and the
  connection that asked for it never had the stream: a client that leaves while its upstream
  handshake runs left the socket open until the garbage collector found it. :func:`install`
  wraps ``TrioStream.start_tls`` to close it then too (shielded, bounded: a socket close).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from proxy.backends.upstream import httpx_pool
from proxy.server.adapters.base import Adapter, Internal

if TYPE_CHECKING:
    import httpcore
    import httpx

__all__ = [
    "HTTPCORE",
    "connection_pool",
    "install",
    "original_response_closed",
    "original_start_tls",
]

log = logging.getLogger("sluice.adapters")

_H2_CONNECTION = "httpcore._async.http2.AsyncHTTP2Connection"
# The instance attributes the reset uses, set by AsyncHTTP2Connection.__init__.
_CONNECTION_ATTRIBUTES = ("_h2_state", "_write_lock", "_network_stream", "_write_exception")
# Writing one RST_STREAM frame: a few bytes, unless the connection is itself stuck.
_RESET_WRITE_TIMEOUT = 1.0
# httpx.AsyncHTTPTransport's attribute holding its httpcore pool (httpx 0.28).
_TRANSPORT_POOL = "_pool"
_TRIO_STREAM = "httpcore._backends.trio.TrioStream"
# Closing the socket of a cancelled handshake: no I/O to wait for.
_CLOSE_TIMEOUT = 1.0


def _connection_has_its_attributes() -> bool:
    try:
        import httpcore
        from httpcore._async.http2 import AsyncHTTP2Connection

        connection = AsyncHTTP2Connection(
            origin=httpcore.Origin(b"https", b"example.invalid", 443),
            stream=None,  # type: ignore[arg-type]  # never used: nothing is sent
        )
    except Exception:  # noqa: BLE001 - any failure means "not usable"; Cancelled is not one
        return False
    return all(hasattr(connection, name) for name in _CONNECTION_ATTRIBUTES)


def connection_pool(transport: httpx.AsyncHTTPTransport) -> httpcore.AsyncConnectionPool | None:
    """The httpcore pool inside an ``httpx.AsyncHTTPTransport`` (a proxy's is one too), or
    None where the transport keeps it elsewhere."""
    import httpcore

    pool = getattr(transport, _TRANSPORT_POOL, None)
    return pool if isinstance(pool, httpcore.AsyncConnectionPool) else None


def _transport_holds_its_pool() -> bool:
    try:
        import httpx

        # No socket, no CA bundle: only the objects are made.
        transport = httpx.AsyncHTTPTransport(verify=False, trust_env=False)
    except Exception:  # noqa: BLE001 - any failure means "not usable"; Cancelled is not one
        return False
    return connection_pool(transport) is not None


def _h2_has_its_api() -> bool:
    try:
        import h2.connection
        import h2.errors
    except ImportError:
        return False
    return hasattr(h2.connection.H2Connection, "reset_stream") and hasattr(
        h2.errors.ErrorCodes, "CANCEL"
    )


HTTPCORE = Adapter(
    "httpcore",
    floor="1.0.9",
    below="1.1",
    internals=[
        Internal(f"{_H2_CONNECTION}._response_closed", "http2", parameters=("stream_id",)),
        Internal(f"{_H2_CONNECTION}.__init__", "http2", check=_connection_has_its_attributes),
        Internal("h2.connection.H2Connection.reset_stream", "http2", check=_h2_has_its_api),
        Internal(
            "httpx.AsyncHTTPTransport.__init__", "idle_sweep", check=_transport_holds_its_pool
        ),
        Internal("httpcore.AsyncConnectionPool.connections", "idle_sweep"),
        Internal(
            f"{_TRIO_STREAM}.start_tls",
            "tls_cancel",
            parameters=("ssl_context", "server_hostname", "timeout"),
        ),
        Internal(f"{_TRIO_STREAM}.aclose", "tls_cancel"),
    ],
    fallbacks={
        "http2": "HTTP/2 is not offered to upstreams (http2 = true falls back to HTTP/1.1): "
        "without the stream reset a client's disconnect would not reach the server",
        "idle_sweep": "over the httpx transport, an idle upstream connection that its server "
        "closed stays open (CLOSE_WAIT) until the replica's next request",
        "tls_cancel": "over the httpx transport, a request cancelled during its upstream TLS "
        "handshake leaves that socket open until the garbage collector closes it",
    },
)

# httpcore's own methods, kept once wrapped (tests show what they do alone).
original_response_closed: Any = None
original_start_tls: Any = None


def install() -> bool:
    """Give the httpx transport what this adapter vouches for: the reach to httpcore's pool
    for the idle sweep, and the HTTP/2 stream reset (once per process). True when the reset
    is in place, and then the httpx transport offers HTTP/2 where configured."""
    # Set on every call, from the check as it stands: after a check that found the internal
    # missing, the fallback takes effect too.
    usable = HTTPCORE.usable("idle_sweep")
    httpx_pool.connection_pool_of = connection_pool if usable else httpx_pool.out_of_reach
    _install_tls_cancel_close()
    return _install_stream_reset()


def _install_tls_cancel_close() -> None:
    global original_start_tls
    if original_start_tls is not None or not HTTPCORE.usable("tls_cancel"):
        return
    from httpcore._backends.trio import TrioStream

    start_tls = original_start_tls = TrioStream.start_tls

    async def _start_tls(
        self: Any,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature, httpcore calls it
    ) -> Any:
        try:
            return await start_tls(self, ssl_context, server_hostname, timeout)
        except BaseException as error:
            if not isinstance(error, Exception):  # httpcore closed it for an Exception
                with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                    await self.aclose()
            raise

    TrioStream.start_tls = _start_tls  # type: ignore[method-assign]


def _install_stream_reset() -> bool:
    global original_response_closed
    if original_response_closed is not None:
        return True
    if not HTTPCORE.usable("http2"):
        return False
    from httpcore._async.http2 import AsyncHTTP2Connection

    response_closed = original_response_closed = AsyncHTTP2Connection._response_closed

    async def _response_closed(self: Any, stream_id: int) -> None:
        try:
            await reset_open_stream(self, stream_id)
        finally:
            await response_closed(self, stream_id)

    AsyncHTTP2Connection._response_closed = _response_closed  # type: ignore[method-assign]
    httpx_pool.http2_stream_reset_installed = True
    return True


async def reset_open_stream(connection: Any, stream_id: int) -> None:
    """Reset ``stream_id`` if it is still open (its response was closed before its end) and
    send the frame now: the server cancels the request (a vLLM behind an HTTP/2 front aborts
    the sequence) and both sides agree the stream is gone."""
    import h2.errors
    import h2.exceptions
    import httpcore

    state = connection._h2_state
    stream = state.streams.get(stream_id)
    if stream is None or stream.closed:
        return
    try:
        state.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
    except h2.exceptions.ProtocolError:
        return  # closed meanwhile (the server reset it, or the connection ended)
    # Shielded: this runs as a cancelled request unwinds. Bounded: by the write's own timeout
    # and by this scope, should another task hold the write lock on a stuck connection.
    with trio.move_on_after(_RESET_WRITE_TIMEOUT, shield=True):
        async with connection._write_lock:
            data = state.data_to_send()
            if not data or connection._write_exception is not None:
                return
            try:
                await connection._network_stream.write(data, _RESET_WRITE_TIMEOUT)
            except (httpcore.NetworkError, OSError) as error:
                # The connection is broken: httpcore's next read or write on it says so.
                log.debug("HTTP/2 stream %d reset not sent: %s", stream_id, error)
