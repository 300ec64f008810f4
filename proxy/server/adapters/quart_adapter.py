"""quart: the internals of its ASGI connection that Sluice overrides, and the response body
base class the relay extends.

``asgi.RelayHTTPConnection`` overrides ``ASGIHTTPConnection._send_response`` (a relay decides
its status after its body starts) and calls ``ASGIHTTPConnection.handle_messages``. If either
were renamed, the override would silently never run: the error status and the disconnect hook
would be lost. So both are required.
"""

from __future__ import annotations

from proxy.server.adapters.base import Adapter, Internal, StartupError

try:
    from quart.asgi import ASGIHTTPConnection
    from quart.utils import encode_headers
    from quart.wrappers.response import ResponseBody
except ImportError as error:  # pragma: no cover - exercised by a version that moved a module
    raise StartupError(f"quart: {error} (Sluice supports quart>=0.19.9,<0.23)") from None

__all__ = ["QUART", "ASGIHTTPConnection", "ResponseBody", "encode_headers"]

QUART = Adapter(
    "quart",
    floor="0.19.9",
    below="0.23",
    internals=[
        Internal("quart.asgi.ASGIHTTPConnection._send_response", parameters=("send", "response")),
        Internal(
            "quart.asgi.ASGIHTTPConnection.handle_messages", parameters=("request", "receive")
        ),
        Internal("quart.utils.encode_headers"),
        Internal("quart.wrappers.response.ResponseBody"),
    ],
    fallbacks={},
)
