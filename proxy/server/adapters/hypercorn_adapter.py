"""hypercorn: every name Sluice imports from it, and every internal it relies on.

The server layer imports hypercorn through this module only. The internals, and what falls
back without them:

* ``connection_server``: Sluice's per-connection server (the read loop that hears a client go
  at once, the hangup watcher's socket, the stall limit on hypercorn's writes, the close of
  RFC 9112 9.6, the keep-alive timer on the connection's one head deadline and without round
  trips, the set of live connections drained and dropped together). Without it: hypercorn's
  own connection server; disconnects are seen a scheduler turn later, hypercorn's writes have
  no stall limit, a connection closed with unread input sends an RST, and a client stuck
  unread at shutdown holds the process until it reads.
* ``h11_wire``: writing an answer on an HTTP/1.1 connection straight to its socket, with the
  head and every frame made by hypercorn's h11 connection and the stream's state moved as
  hypercorn moves it. Without it: every answer through ASGI ``send`` (correct, slower).
* ``closing_reads``: hypercorn's HTTP/1.1 protocol reads with a connection of ours (set in
  ``H11Protocol.__init__``) that reads nothing a client sends after a request that closes the
  connection. Without it: such bytes get hypercorn's 400 in place of the answer in progress.
* ``ws_buffer``: the WebSocket message buffer that stops keeping a message once it is over the
  size limit (``ws_buffer.py``). Without it: hypercorn's, which keeps all of a too-big message
  while the client goes on sending it (measured: 8 messages of 64 MiB, +510 MB).
* required: serving on our sockets (``worker_serve``), the HTTP/1.1 framing check (the
  request-smuggling refusal), and the chain from ASGI ``send`` to the socket (dropping a
  stalled client). Without any of these Sluice does not start.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.server.adapters.base import Adapter, Internal, StartupError

try:
    import hypercorn.protocol as hypercorn_protocol
    import hypercorn.protocol.ws_stream as hypercorn_ws_stream
    import hypercorn.trio.run as hypercorn_trio_run
    from hypercorn.app_wrappers import ASGIWrapper
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.config import Sockets
    from hypercorn.events import Closed, Event, RawData, Updated
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    from hypercorn.trio.run import worker_serve
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
    from hypercorn.utils import suppress_body
except ImportError as error:  # pragma: no cover - exercised by a version that moved a module
    raise StartupError(f"hypercorn: {error} (Sluice supports hypercorn>=0.17,<0.19)") from None

__all__ = [
    "HYPERCORN",
    "MAX_RECV",
    "ASGIHTTPState",
    "ASGIReceiveCallable",
    "ASGISendCallable",
    "ASGIWrapper",
    "Closed",
    "Event",
    "H11Protocol",
    "HTTPStream",
    "HypercornConfig",
    "RawData",
    "Sockets",
    "TCPServer",
    "Updated",
    "hypercorn_protocol",
    "hypercorn_trio_run",
    "hypercorn_ws_stream",
    "suppress_body",
    "worker_serve",
]


def _sets_in_init(owner: type, attribute: str) -> Callable[[], bool]:
    """A check that ``owner.__init__`` assigns ``self.<attribute>`` (an instance attribute,
    which the class itself does not have)."""

    def check() -> bool:
        code = getattr(getattr(owner, "__init__", None), "__code__", None)
        return code is not None and attribute in code.co_names

    return check


HYPERCORN = Adapter(
    "hypercorn",
    floor="0.17",
    below="0.19",
    internals=[
        Internal("hypercorn.trio.run.worker_serve"),
        Internal("hypercorn.config.Config.websocket_max_message_size"),
        Internal("hypercorn.config.Config.keep_alive_max_requests"),
        # The request-smuggling refusal replaces H11Protocol where ProtocolWrapper finds it.
        Internal("hypercorn.protocol.H11Protocol"),
        Internal("hypercorn.protocol.h11.H11Protocol._create_stream", parameters=("request",)),
        Internal("hypercorn.protocol.h11.H11Protocol._send_h11_event", parameters=("event",)),
        # ASGI send -> HTTPStream.app_send -> H11Protocol.stream_send -> TCPServer.protocol_send:
        # the way from the app to a client's socket (connection_server.send_chain).
        Internal("hypercorn.protocol.http_stream.HTTPStream.app_send"),
        Internal("hypercorn.protocol.ws_stream.WSStream.app_send"),
        Internal("hypercorn.protocol.h11.H11Protocol.stream_send"),
        Internal("hypercorn.trio.tcp_server.TCPServer.protocol_send"),
        # The app hypercorn hands each connection's server, which carries the seam to it.
        Internal("hypercorn.app_wrappers.ASGIWrapper.__call__"),
        Internal("hypercorn.trio.run.TCPServer", "connection_server"),
        Internal("hypercorn.trio.tcp_server.TCPServer._read_data", "connection_server"),
        Internal("hypercorn.trio.tcp_server.TCPServer._close", "connection_server"),
        Internal("hypercorn.trio.tcp_server.TCPServer._idle_timeout", "connection_server"),
        Internal("hypercorn.trio.tcp_server.TCPServer._initiate_server_close", "connection_server"),
        Internal("hypercorn.trio.task_group.TaskGroup.spawn", "connection_server"),
        Internal("hypercorn.protocol.http_stream.ASGIHTTPState.REQUEST", "h11_wire"),
        Internal("hypercorn.protocol.http_stream.ASGIHTTPState.RESPONSE", "h11_wire"),
        Internal("hypercorn.config.Config.response_headers", "h11_wire"),
        Internal("hypercorn.utils.suppress_body", "h11_wire"),
        Internal(
            "hypercorn.protocol.h11.H11Protocol.__init__",
            "closing_reads",
            check=_sets_in_init(H11Protocol, "connection"),
        ),
        Internal("hypercorn.protocol.ws_stream.WebsocketBuffer.extend", "ws_buffer"),
        Internal("hypercorn.protocol.ws_stream.WebsocketBuffer.clear", "ws_buffer"),
        Internal("hypercorn.protocol.ws_stream.FrameTooLargeError", "ws_buffer"),
    ],
    fallbacks={
        "connection_server": "using hypercorn's own connection server: a client's disconnect "
        "is seen a scheduler turn later, no hangup watcher, hypercorn's writes have no stall "
        "limit, a connection closed with unread input loses the end of its answer (RST), and "
        "connections stuck in a write at the graceful deadline are not dropped",
        "h11_wire": "every answer goes through hypercorn's ASGI send (slower)",
        "closing_reads": "bytes a client sends after a request that closes the connection "
        "get hypercorn's 400 in place of the answer in progress",
        "ws_buffer": "a WebSocket message over the size limit is refused (1009), but the rest "
        "of it is buffered while the client goes on sending it",
    },
)
