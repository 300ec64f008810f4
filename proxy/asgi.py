"""quart-trio, with one change: a relayed response decides its status after its body starts.

Quart sends ``http.response.start`` (status and headers) before it enters the response body.
A relay only knows its status once the producer has reached the upstream: whether the stream
started (200), the upstream refused (502), or timed out (504). So for a :class:`RelayBody`, the
body is entered first (starting its producer and waiting for the head), then the head is sent.
hypercorn writes nothing to the socket before the first body event anyway, so this costs the
client no latency.
"""

from __future__ import annotations

from typing import Any, cast

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable
from quart.asgi import ASGIHTTPConnection
from quart.utils import encode_headers
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection

from .relay import RelayBody


class RelayHTTPConnection(TrioASGIHTTPConnection):
    disconnected_at: float | None = None

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Any, receive: ASGIReceiveCallable
    ) -> None:
        # As quart-trio's, plus a timestamp: the start of cancel propagation, for metrics.
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        self.disconnected_at = trio.current_time()
        nursery.cancel_scope.cancel()

    async def _send_response(self, send: ASGISendCallable, response: Any) -> None:
        body = getattr(response, "response", None)
        if not isinstance(body, RelayBody):
            await super()._send_response(send, response)
            return
        body.disconnected_at = lambda: self.disconnected_at
        async with body:
            response.status_code = body.status
            for name, value in body.headers.items():
                response.headers[name] = value
            await send(
                cast(
                    Any,
                    {
                        "type": "http.response.start",
                        "status": body.status,
                        "headers": encode_headers(response.headers),
                    },
                )
            )
            async for chunk in body:
                await send(
                    cast(Any, {"type": "http.response.body", "body": chunk, "more_body": True})
                )
        await send(cast(Any, {"type": "http.response.body", "body": b"", "more_body": False}))


class SluiceQuart(QuartTrio):
    asgi_http_class = RelayHTTPConnection
