"""quart-trio, with one change: a relayed response decides its status after its body starts.

Quart sends ``http.response.start`` (status and headers) before it enters the response body.
A relay only knows its status once the producer has reached the upstream: whether the stream
started (200), the upstream refused (502), or timed out (504). So for a :class:`RelayBody`, the
body is entered first (starting its producer and waiting for the head), then the head is sent;
the head is ready the moment the upstream's first event is, so this costs the client no latency.
The body's chunks then go out through chunk_writer where it applies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

import trio

from proxy.relay.body import RelayBody
from proxy.server import chunk_writer
from proxy.server.adapters.hypercorn_adapter import (
    ASGIReceiveCallable,
    ASGISendCallable,
    H11Protocol,
)
from proxy.server.adapters.quart_adapter import ASGIHTTPConnection, encode_headers
from proxy.server.adapters.quart_trio_adapter import (
    QuartTrio,
    TrioASGIHTTPConnection,
    TrioASGIWebsocketConnection,
)
from proxy.server.connection_server import (
    ConnectionServer,
    client_socket,
    reset_socket,
    send_chain,
)
from proxy.server.fast_path import HotRoutes

log = logging.getLogger("sluice.asgi")


class RelayHTTPConnection(TrioASGIHTTPConnection):
    disconnected_at: float | None = None
    relay_body: RelayBody | None = None
    # Set as the response's last message is sent: from then on an http.disconnect is
    # hypercorn closing the stream behind that message, not the client leaving.
    response_complete = False

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, receive: ASGIReceiveCallable
    ) -> None:
        # As quart-trio's, plus a timestamp (the start of cancel propagation, for metrics) and
        # the relay's disconnect hook.
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        if self.response_complete or (self.relay_body is not None and self.relay_body.complete):
            # hypercorn sends http.disconnect from inside the last send, then (Connection:
            # close, HTTP/1.0) shuts the socket down, or (keep-alive) arms its idle timer.
            # Cancelling here cancelled that work at its first checkpoint: connections were
            # never closed, nor timed out when idle. The response's task ends the request
            # itself once its send returns.
            return
        self.disconnected_at = trio.current_time()
        if self.relay_body is not None:
            # Before the cancellation: the upstream connection is shut down in this step, not
            # when the producer's task gets its turn to unwind (a saturated scheduler's turn).
            self.relay_body.client_disconnected()
        nursery.cancel_scope.cancel()

    async def _send_response(self, send: ASGISendCallable, response: Any) -> None:
        body = getattr(response, "response", None)
        if not isinstance(body, RelayBody):

            async def send_noting_the_end(message: Any) -> None:
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    self.response_complete = True
                await send(message)

            await super()._send_response(send_noting_the_end, response)
            return
        body.disconnected_at = lambda: self.disconnected_at
        body.abort_connection = lambda: abort_transport(send)
        self.relay_body = body
        server = connection_server_of(send)
        if server is not None:
            # The earliest word of the client leaving: the loop's hangup watcher, or hypercorn's
            # read task as it reads the EOF.
            server.relay_started(body.client_disconnected)
        try:
            await self._send_relayed(send, response, body)
        finally:
            # The body refers back to this connection (disconnected_at) and to hypercorn's
            # (abort_connection): without these, every finished relay would wait for the
            # cyclic garbage collector to be freed.
            self.relay_body = None
            body.start_stream = None
            if server is not None:
                server.relay_ended()

    async def _send_relayed(self, send: ASGISendCallable, response: Any, body: RelayBody) -> None:
        def head_headers() -> list[tuple[bytes, bytes]]:
            response.status_code = body.status
            for name, value in body.headers.items():
                response.headers[name] = value
            return encode_headers(response.headers)

        stall_timeout = body.stall_timeout
        tried = False

        def start_stream() -> chunk_writer.ChunkWriter | None:
            # In the producer's task, as it decides a streamed 200 head (RelayBody.set_head):
            # the head waits in the writer for the first event, and both leave in one write.
            nonlocal tried
            tried = True
            return chunk_writer.start_response(send, body.status, head_headers(), stall_timeout)

        body.start_stream = start_stream
        async with body:
            writer = body.writer
            if writer is None:
                headers = head_headers()
                if not tried:
                    writer = chunk_writer.start_response(send, body.status, headers, stall_timeout)
                if writer is None:
                    status = body.status
                    start = {"type": "http.response.start", "status": status, "headers": headers}
                    await body.guard().write(send, cast(Any, start))
                    writer = chunk_writer.attach(send, headers, stall_timeout)
            if writer is not None:
                await body.write_through(writer)
            else:
                # hypercorn's writes (a non-streamed answer, HTTP/2, HTTP/1.0): shielded and
                # without a deadline, so the body's guard bounds each one.
                guard = body.guard()
                async for chunk in body:
                    message = {"type": "http.response.body", "body": chunk, "more_body": True}
                    await guard.write(send, cast(Any, message))
        if body.client_gone:
            return  # nobody to end the response for; the disconnect cancels the request
        self.response_complete = True
        await send(cast(Any, {"type": "http.response.body", "body": b"", "more_body": False}))


_CONNECTION_KEY = "sluice.connection"


class ClientConnection:
    """What a WebSocket handler may do to its client's connection that ASGI offers no way to:
    drop it (a reader that stalls holds hypercorn's shielded write forever otherwise), and
    hear at once that the client has gone (before the handler's cancellation unwinds)."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._on_gone: list[Callable[[], None]] = []

    def abort(self) -> None:
        abort_transport(self._send)

    def on_client_gone(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once when the client disconnects; returns its removal."""
        self._on_gone.append(callback)
        return lambda: self._on_gone.remove(callback) if callback in self._on_gone else None

    def client_gone(self) -> None:
        callbacks, self._on_gone = self._on_gone, []
        for callback in callbacks:
            callback()


class _Unattached(ClientConnection):
    """A scope served by another ASGI server (a test client): nothing to drop."""

    def __init__(self) -> None:
        super().__init__(None)

    def abort(self) -> None:
        pass


def client_connection(scope: Any) -> ClientConnection:
    """The :class:`ClientConnection` of a WebSocket's ASGI scope."""
    connection = scope.get(_CONNECTION_KEY)
    return connection if isinstance(connection, ClientConnection) else _Unattached()


class RelayWebsocketConnection(TrioASGIWebsocketConnection):
    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        connection = ClientConnection(send)
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
    drain flag /readyz reports, the upstream pools to close at shutdown, a failure (a model
    that would not load) that must stop the server, and the reload SIGHUP asks for."""

    draining: bool
    failed: trio.Event
    load_error: BaseException | None

    async def aclose(self) -> None: ...

    async def reload_config(self) -> str: ...


class SluiceQuart(QuartTrio):
    asgi_http_class = RelayHTTPConnection
    asgi_websocket_class = RelayWebsocketConnection
    # The routes the fast path serves itself (api/fast_routes.py); None: hypercorn and Quart
    # serve every request.
    hot_routes: HotRoutes | None = None

    @property
    def served_state(self) -> ServedState:
        state: ServedState = self.extensions["sluice"]
        return state


def connection_server_of(send: Any) -> ConnectionServer | None:
    """Sluice's connection server under hypercorn's ASGI ``send`` for an HTTP/1.1 request, or
    None (HTTP/2, a layout that differs). HTTP/2 is left out on purpose: its streams share
    one connection, and its server keeps one disconnect hook (one relay's), so a second
    stream would take the first one's hook (and socket watch) with it when it ended."""
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
        log.warning("cannot drop a stalled client's connection: hypercorn's layout changed")
        return
    if sock.fileno() >= 0:  # not closed already
        reset_socket(sock)
