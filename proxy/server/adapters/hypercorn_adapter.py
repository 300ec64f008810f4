"""hypercorn: every name Sluice imports from it, and every internal it relies on.

The server layer imports hypercorn through this module only. The internals, and what falls
back without them:

* ``connection_server``: Sluice's per-connection server (the read loop that hears a client go
  at once, the hangup watcher's socket, the keep-alive timer without round trips, the set of
  live connections dropped at the graceful deadline). Without it: hypercorn's own connection
  server; disconnects are seen a scheduler turn later, and a client stuck unread at shutdown
  holds the process until it reads.
* ``chunk_writer``: writing a stream's chunks straight to the socket. Without it: every chunk
  through ASGI ``send`` (correct, slower; the stall limit is the relay's guard).
* ``request_count``: telling hypercorn's HTTP/1.1 protocol how many requests the fast path
  served on a connection before handing it over (``ProtocolWrapper.protocol``,
  ``H11Protocol.keep_alive_requests``, both set in their ``__init__``). Without it: hypercorn
  counts that connection's requests from 0, so ``keep_alive_max_requests`` allows more on it.
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
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.config import Sockets
    from hypercorn.events import Closed, Event, RawData, Updated
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
    from hypercorn.trio.run import worker_serve
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
    from hypercorn.utils import build_and_validate_headers, wrap_app
except ImportError as error:  # pragma: no cover - exercised by a version that moved a module
    raise StartupError(f"hypercorn: {error} (Sluice supports hypercorn>=0.17,<0.19)") from None

__all__ = [
    "HYPERCORN",
    "MAX_RECV",
    "ASGIHTTPState",
    "ASGIReceiveCallable",
    "ASGISendCallable",
    "Closed",
    "Event",
    "H11Protocol",
    "HTTPStream",
    "HypercornConfig",
    "RawData",
    "Sockets",
    "TCPServer",
    "Updated",
    "build_and_validate_headers",
    "hypercorn_protocol",
    "hypercorn_trio_run",
    "hypercorn_ws_stream",
    "worker_serve",
    "wrap_app",
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
        Internal("hypercorn.trio.run.TCPServer", "connection_server"),
        Internal("hypercorn.trio.tcp_server.TCPServer._read_data", "connection_server"),
        Internal("hypercorn.trio.task_group.TaskGroup.spawn", "connection_server"),
        Internal("hypercorn.protocol.http_stream.ASGIHTTPState.REQUEST", "chunk_writer"),
        Internal("hypercorn.protocol.http_stream.ASGIHTTPState.RESPONSE", "chunk_writer"),
        Internal("hypercorn.config.Config.response_headers", "chunk_writer"),
        Internal("hypercorn.utils.build_and_validate_headers", "chunk_writer"),
        Internal(
            "hypercorn.protocol.ProtocolWrapper.__init__",
            "request_count",
            check=_sets_in_init(hypercorn_protocol.ProtocolWrapper, "protocol"),
        ),
        Internal(
            "hypercorn.protocol.h11.H11Protocol.__init__",
            "request_count",
            check=_sets_in_init(H11Protocol, "keep_alive_requests"),
        ),
        Internal("hypercorn.protocol.ws_stream.WebsocketBuffer.extend", "ws_buffer"),
        Internal("hypercorn.protocol.ws_stream.WebsocketBuffer.clear", "ws_buffer"),
        Internal("hypercorn.protocol.ws_stream.FrameTooLargeError", "ws_buffer"),
    ],
    fallbacks={
        "connection_server": "using hypercorn's own connection server: a client's disconnect "
        "is seen a scheduler turn later, no hangup watcher, and connections stuck in a write "
        "at the graceful deadline are not dropped",
        "chunk_writer": "streamed chunks go through hypercorn's ASGI send (slower)",
        "request_count": "after the fast path hands a connection to hypercorn, hypercorn "
        "counts its requests from 0 (keep_alive_max_requests then allows more on it)",
        "ws_buffer": "a WebSocket message over the size limit is refused (1009), but the rest "
        "of it is buffered while the client goes on sending it",
    },
)
