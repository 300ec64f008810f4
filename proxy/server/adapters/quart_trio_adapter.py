"""quart-trio: the connection classes Sluice subclasses, and how the app names them.

``asgi.RelayHTTPConnection`` extends ``TrioASGIHTTPConnection.handle_messages(nursery,
request, receive)`` (the disconnect hook and timestamp); ``asgi.RelayWebsocketConnection``
wraps ``TrioASGIWebsocketConnection.__call__``. The app installs both through
``QuartTrio.asgi_http_class`` and ``asgi_websocket_class``. All required: without them the
disconnect hook and the WebSocket's connection handle would silently be gone.
"""

from __future__ import annotations

from proxy.server.adapters.base import Adapter, Internal, StartupError

try:
    from quart_trio import QuartTrio
    from quart_trio.asgi import TrioASGIHTTPConnection, TrioASGIWebsocketConnection
except ImportError as error:  # pragma: no cover - exercised by a version that moved a module
    raise StartupError(f"quart-trio: {error} (Sluice supports quart-trio>=0.11,<0.13)") from None

__all__ = ["QUART_TRIO", "QuartTrio", "TrioASGIHTTPConnection", "TrioASGIWebsocketConnection"]

QUART_TRIO = Adapter(
    "quart-trio",
    floor="0.11",
    below="0.13",
    internals=[
        Internal(
            "quart_trio.asgi.TrioASGIHTTPConnection.handle_messages",
            parameters=("nursery", "request", "receive"),
        ),
        Internal(
            "quart_trio.asgi.TrioASGIWebsocketConnection.__call__", parameters=("receive", "send")
        ),
        Internal("quart_trio.QuartTrio.asgi_http_class"),
        Internal("quart_trio.QuartTrio.asgi_websocket_class"),
    ],
    fallbacks={},
)
