"""quart-trio, with every answer written by Sluice's one writer (``server/writer.py``).

Quart sends ``http.response.start`` (status and headers) before it enters the response body.
A relay only knows its status once the producer has reached the upstream: whether the stream
started (200), the upstream refused (502), or timed out (504). So every response Quart makes
goes to :func:`~proxy.server.writer.write_answer` instead, over a wire of this module: the
body is entered first (starting its producer and waiting for the head), then the head goes
out with the first chunk.

* :class:`H11Wire`: HTTP/1.1 on a plain socket (hypercorn's usual case). The head and every
  byte h11 frames are made by h11 itself, so h11's and the stream's states move as if
  hypercorn had sent them, then written straight to the socket within the stall limit; a
  chunked body's frames are written as they are (h11 keeps no per-chunk state); the end goes
  through ASGI, so hypercorn ends the stream and recycles (or closes) the connection as always.
* :class:`ASGIWire`: everything else (HTTP/2, a hypercorn whose layout differs, a test client):
  ASGI ``send``, which the connection server bounds.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, Protocol, cast

import h11
import trio

from proxy.protocol.connection_state import ConnectionState
from proxy.relay.body import DirectWriter, RelayBody
from proxy.server import adapters
from proxy.server.adapters.hypercorn_adapter import (
    ASGIHTTPState,
    ASGIReceiveCallable,
    ASGISendCallable,
    H11Protocol,
    HTTPStream,
    TCPServer,
    suppress_body,
)
from proxy.server.adapters.quart_adapter import ASGIHTTPConnection
from proxy.server.adapters.quart_trio_adapter import (
    QuartTrio,
    TrioASGIHTTPConnection,
    TrioASGIWebsocketConnection,
)
from proxy.server.call import Answer, Responder
from proxy.server.chunk_writer import ChunkWriter
from proxy.server.connection_server import (
    ConnectionServer,
    client_socket,
    reason_phrase,
    reset_socket,
    send_chain,
)
from proxy.server.writer import write_answer

log = logging.getLogger("sluice.asgi")


class RelayHTTPConnection(TrioASGIHTTPConnection):
    # The way out of the answer being written (or written): set by _send_response.
    wire: H11Wire | ASGIWire | None = None
    # When the client left, if that was before an answer's wire existed to hear it.
    gone_early: float | None = None

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, receive: ASGIReceiveCallable
    ) -> None:
        # As quart-trio's, but the wire hears the disconnect first: it tells the relay (its
        # upstream is shut down in this step), and says whether there is anything to cancel.
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        wire = self.wire
        if wire is None:
            # No answer begun: the cancellation finds its relay (if one is about to start)
            # with the moment the client left, for its metrics and its trace.
            self.gone_early = trio.current_time()
        elif not wire.client_left():
            # The answer had ended (hypercorn sends http.disconnect from inside the last send,
            # then shuts the socket down or arms its idle timer) or was whole: cancelling here
            # would cancel that work at its first checkpoint. The response's task ends the
            # request itself once its send returns.
            return
        nursery.cancel_scope.cancel()

    async def _send_response(self, send: ASGISendCallable, response: Any) -> None:
        wire = self.wire = wire_for(send, self.scope)
        if self.gone_early is not None:
            wire.left_at(self.gone_early)
        body = getattr(response, "response", None)
        headers = [(name, value) for name, value in response.headers.items()]
        if isinstance(body, RelayBody):
            await write_answer(wire, Answer(response.status_code, headers, body))
        else:
            content = await _whole_body(response)
            await write_answer(wire, Answer(response.status_code, headers, content))


async def _whole_body(response: Any) -> bytes:
    """A plain Quart (or werkzeug) response's body, whole: the app's plain answers are small
    and made in memory (JSON, the chat page's files)."""
    parts: list[bytes] = []
    if hasattr(response.response, "__aenter__"):
        async with response.response as chunks:
            async for data in chunks:
                parts.append(data.encode() if isinstance(data, str) else data)
    else:
        for data in response.response:
            parts.append(data.encode() if isinstance(data, str) else data)
    return b"".join(parts)


class _GoneWatch:
    """The departure bookkeeping every wire shares: when the client left, the writer's callback,
    and whether the answer has ended (a disconnect after that is the server closing)."""

    __slots__ = ("_gone_at", "_on_gone", "ended")

    def __init__(self) -> None:
        self._gone_at: float | None = None
        self._on_gone: Callable[[], bool] | None = None
        self.ended = False

    def gone_at(self) -> float | None:
        return self._gone_at

    def left_at(self, when: float) -> None:
        """The client left at ``when``, before this wire existed."""
        self._gone_at = when

    def client_left(self) -> bool:
        """The server saw the client go; whether the request is to be cancelled."""
        if self.ended:
            return False
        if self._gone_at is None:
            self._gone_at = trio.current_time()
        on_gone = self._on_gone
        return True if on_gone is None else on_gone()


class _Chain(NamedTuple):
    """hypercorn's objects under an app's ASGI send, for a plain-TCP HTTP/1.1 connection."""

    stream: HTTPStream
    protocol: H11Protocol
    server: TCPServer
    socket: Any
    h11: h11.Connection


def _chain_of(send: Any) -> _Chain | None:
    """The socket-level view of an HTTP/1.1 connection under hypercorn, or None where it
    does not apply: HTTP/2, TLS, an HTTP/1.0 client (close-delimited framing), a hypercorn
    whose layout differs."""
    if not adapters.usable("h11_wire"):
        return None
    stream, protocol, server = send_chain(send)
    if not (
        isinstance(stream, HTTPStream)
        and isinstance(protocol, H11Protocol)
        and isinstance(server, TCPServer)
    ):
        return None
    transport: Any = server.stream  # typed as an SSLStream; a SocketStream without TLS
    connection = protocol.connection
    if (
        not isinstance(transport, trio.SocketStream)
        or not isinstance(connection, h11.Connection)
        or connection.their_http_version != b"1.1"
        or not isinstance(getattr(server, "send_lock", None), trio.Lock)
    ):
        return None
    return _Chain(stream, protocol, server, transport.socket, connection)


def wire_for(send: Any, scope: Any) -> H11Wire | ASGIWire:
    """The wire of an answer sent through hypercorn's ASGI ``send`` for ``scope``'s request."""
    method = scope.get("method", "GET")
    chain = _chain_of(send)
    if chain is not None:
        return H11Wire(send, chain, method)
    _, _, server = send_chain(send)
    state = server.connection_state if isinstance(server, ConnectionServer) else None
    return ASGIWire(send, state, http2=scope.get("http_version") == "2")


def _stall_timeout(server: Any) -> float:
    """The stall limit of the connection server's writes (none under a server not Sluice's)."""
    seam = server.seam if isinstance(server, ConnectionServer) else None
    return math.inf if seam is None else seam.stall_timeout


class H11Wire(_GoneWatch):
    """HTTP/1.1 under hypercorn, written to the socket (see the module's docstring)."""

    __slots__ = ("_chain", "_chunked", "_method", "_raw", "_send", "_suppressed")

    def __init__(self, send: Any, chain: _Chain, method: str) -> None:
        super().__init__()
        self._send = send
        self._chain = chain
        self._raw = ChunkWriter(chain.server, chain.socket, _stall_timeout(chain.server))
        self._method = method
        # Whether the answer has no body on the wire (HEAD, 204, 304), as hypercorn decides.
        self._suppressed = False
        self._chunked = False

    @property
    def last_answer(self) -> bool:
        server = self._chain.server
        return isinstance(server, ConnectionServer) and server.connection_state.last_answer

    def server_headers(self) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = self._chain.protocol.config.response_headers("h11")
        return headers

    def abort(self) -> None:
        sock = self._chain.socket
        if sock.fileno() >= 0:
            reset_socket(sock)

    @asynccontextmanager
    async def watching(self, on_gone: Callable[[], bool]) -> AsyncIterator[None]:
        self._on_gone = on_gone
        server = self._chain.server
        connection_server = server if isinstance(server, ConnectionServer) else None
        if connection_server is not None:
            # The earliest word of the client leaving: the loop's hangup watcher, or the
            # server's read task as it reads the EOF (before hypercorn's http.disconnect).
            connection_server.relay_started(self.client_left)
        try:
            yield
        finally:
            self._on_gone = None
            if connection_server is not None:
                connection_server.relay_ended()

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The head's bytes, made by h11 exactly as hypercorn's H11Protocol would make them,
        with the stream's state moved as if hypercorn had sent it."""
        stream, connection = self._chain.stream, self._chain.h11
        # Not hypercorn's stream.closed: a client that half-closed after its request closes
        # it, and the answer, all decided, is still written to the socket it reads (a client
        # that has gone fails the writes, quietly).
        if (
            stream.state is not ASGIHTTPState.REQUEST
            or connection.our_state is not h11.SEND_RESPONSE
        ):
            raise RuntimeError(f"a response head cannot be sent now ({connection.our_state})")
        head = connection.send(
            h11.Response(status_code=status, headers=headers, reason=reason_phrase(status))
        )
        assert head is not None  # a Response always has bytes; h11's type says "maybe"
        stream.response = {"type": "http.response.start", "status": status, "headers": headers}
        stream.state = ASGIHTTPState.RESPONSE
        self._suppressed = suppress_body(self._method, status)
        return head

    def chunked_writer(
        self, status: int, headers: list[tuple[bytes, bytes]]
    ) -> DirectWriter | None:
        if self._suppressed:
            return None  # a HEAD request's answer: h11 writes no body
        self._raw.hold(self._head(status, headers))
        self._chunked = True
        return self._raw

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> None:
        data = self._head(status, headers)
        if first and not self._suppressed:
            data += self._framed(first)
        await self._raw.write_raw(data)

    def _framed(self, chunk: bytes) -> bytes:
        framed = self._chain.h11.send(h11.Data(data=chunk))
        assert framed is not None
        return framed

    async def send(self, chunk: bytes) -> None:
        if chunk and not self._suppressed:
            await self._raw.write_raw(self._framed(chunk))

    async def end(self) -> None:
        # hypercorn's: h11's end of message (a chunked body's last chunk), written through the
        # connection server (bounded), then the stream's end and the connection's recycling.
        self.ended = True
        await self._send(cast(Any, {"type": "http.response.body", "body": b"", "more_body": False}))


class ASGIWire(_GoneWatch):
    """Any answer over ASGI ``send`` alone: the server frames it, and its connection server
    bounds its writes."""

    __slots__ = ("_http2", "_send", "_state")

    def __init__(self, send: Any, state: ConnectionState | None, *, http2: bool) -> None:
        super().__init__()
        self._send = send
        # The connection's state, on an HTTP/1.x connection of Sluice's connection server.
        self._state = None if http2 else state
        self._http2 = http2

    @property
    def last_answer(self) -> bool:
        # HTTP/2 streams share their connection, whose closing is the server's alone.
        return self._state is not None and self._state.last_answer

    def server_headers(self) -> list[tuple[bytes, bytes]]:
        return []  # the server adds its own

    def abort(self) -> None:
        abort_transport(self._send)

    @asynccontextmanager
    async def watching(self, on_gone: Callable[[], bool]) -> AsyncIterator[None]:
        self._on_gone = on_gone
        try:
            yield
        finally:
            self._on_gone = None

    def chunked_writer(
        self, status: int, headers: list[tuple[bytes, bytes]]
    ) -> DirectWriter | None:
        return None

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> None:
        if self._http2:
            # HTTP/2 forbids HTTP/1.1's framing and connection headers: its server frames.
            headers = [pair for pair in headers if pair[0].lower() not in _HTTP1_ONLY]
        start = {"type": "http.response.start", "status": status, "headers": headers}
        await self._send(cast(Any, start))
        if first:
            await self.send(first)

    async def send(self, chunk: bytes) -> None:
        message = {"type": "http.response.body", "body": chunk, "more_body": True}
        await self._send(cast(Any, message))

    async def end(self) -> None:
        self.ended = True
        await self._send(cast(Any, {"type": "http.response.body", "body": b"", "more_body": False}))


_HTTP1_ONLY = frozenset({b"transfer-encoding", b"connection"})


_CONNECTION_KEY = "sluice.connection"


class WebSocketConnection:
    """A WebSocket's client connection, as its handler and its relays (relay.ClientConnection)
    see it: drop it (a reader that stalls holds hypercorn's shielded write forever otherwise),
    and hear at once that the client has gone (before the handler's cancellation unwinds)."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._on_gone: list[Callable[[], None]] = []
        self._gone_at: float | None = None

    def abort(self) -> None:
        abort_transport(self._send)

    def gone_at(self) -> float | None:
        return self._gone_at

    def start_stream(self, status: int, headers: Any) -> DirectWriter | None:
        return None  # a WebSocket's generation is written as messages, by its session

    def on_client_gone(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once when the client disconnects; returns its removal."""
        self._on_gone.append(callback)
        return lambda: self._on_gone.remove(callback) if callback in self._on_gone else None

    def client_gone(self) -> None:
        if self._gone_at is None:
            self._gone_at = trio.current_time()
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()


class _Unattached(WebSocketConnection):
    """A scope served by another ASGI server (a test client): nothing to drop."""

    def __init__(self) -> None:
        super().__init__(None)

    def abort(self) -> None:
        pass


def websocket_connection(scope: Any) -> WebSocketConnection:
    """The :class:`WebSocketConnection` of a WebSocket's ASGI scope."""
    connection = scope.get(_CONNECTION_KEY)
    return connection if isinstance(connection, WebSocketConnection) else _Unattached()


class RelayWebsocketConnection(TrioASGIWebsocketConnection):
    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        connection = WebSocketConnection(send)
        cast(dict[str, Any], self.scope)[_CONNECTION_KEY] = connection

        async def receive_noting_disconnect() -> Any:
            event = await receive()
            if event["type"] == "websocket.disconnect":
                # Before quart-trio cancels the handler: the upstream's connection is shut
                # down in this step, as for HTTP.
                connection.client_gone()
            return event

        await super().__call__(receive_noting_disconnect, send)


class ServedState(Protocol):
    """What the server layer needs of the app's per-process state (api.state.SluiceState): the
    drain flag /readyz reports, the drain's start and the end of its grace, the upstream pools
    to close at shutdown, a failure (a model that would not load) that must stop the server,
    and the reload SIGHUP asks for."""

    draining: bool
    failed: trio.Event
    load_error: BaseException | None

    def begin_drain(self, grace_end: float) -> None:
        """The drain has begun; its grace ends at ``grace_end`` (trio's clock)."""
        ...

    def end_grace(self) -> int:
        """Stop every request still at work, telling its client; how many were."""
        ...

    async def aclose(self) -> None: ...

    async def reload_config(self) -> str: ...


class SluiceQuart(QuartTrio):
    asgi_http_class = RelayHTTPConnection
    asgi_websocket_class = RelayWebsocketConnection
    # The app's one way in (api/responder.py): the fast path hands it the requests it reads.
    responder: Responder | None = None

    @property
    def served_state(self) -> ServedState:
        state: ServedState = self.extensions["sluice"]
        return state


def connection_server_of(send: Any) -> ConnectionServer | None:
    """Sluice's connection server under hypercorn's ASGI ``send`` for an HTTP/1.1 request, or
    None (HTTP/2, a layout that differs)."""
    _, protocol, server = send_chain(send)
    if isinstance(server, ConnectionServer) and isinstance(protocol, H11Protocol):
        return server
    return None


def transport_socket(send: Any) -> Any:
    """The TCP socket under hypercorn's ASGI ``send``, or None where the chain differs.

    hypercorn offers no public way to drop a connection from the app, and its socket writes
    are shielded from cancellation, so a client that stops reading can hold a write forever."""
    _, _, server = send_chain(send)
    return client_socket(server)


def abort_transport(send: Any) -> None:
    """Reset the client's connection: the blocked write wakes with ClosedResourceError,
    hypercorn treats the connection as closed, and the kernel frees its buffers at once."""
    sock = transport_socket(send)
    if sock is None:
        log.warning("cannot drop a client's connection: hypercorn's layout changed")
        return
    if sock.fileno() >= 0:  # not closed already
        reset_socket(sock)
