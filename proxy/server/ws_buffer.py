"""A WebSocket message buffer that stops keeping a message once it is over the size limit.

hypercorn's ``WebsocketBuffer`` writes each piece of a message before it checks the size, and
is not cleared when the check fails: the connection is sent a close (1009), but the client
goes on sending the message (it has not read the close yet), and every later piece is decoded
and kept. Measured on hypercorn 0.18: 8 clients each sending one 64 MiB message grew the
server by 510 MB, which the allocator never gave back. This buffer checks before it keeps a
piece, lets go of what it had kept at the first piece over the limit, and keeps nothing more of
that message; the rest is still read (and decoded by wsproto) until the client closes, at no
cost in memory.

A text message is kept as a list of the pieces wsproto decoded (``str``, one byte a character
for ASCII), joined once when the message is whole: a ``StringIO`` of the same text can take
four bytes a character.
"""

from __future__ import annotations

import logging
from typing import Any

from proxy.server import adapters
from proxy.server.adapters.hypercorn_adapter import hypercorn_ws_stream

log = logging.getLogger("sluice.server")


class BoundedWebsocketBuffer:
    """hypercorn's ``WebsocketBuffer``, bounded: see the module's docstring."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self.text: bool | None = None
        self.pieces: list[Any] = []
        # Over the limit: nothing more of this message is kept.
        self.overflowed = False

    def extend(self, event: Any) -> None:
        data = event.data
        if self.overflowed or self.length + len(data) > self.max_length:
            self.overflowed = True
            self.pieces = []
            raise hypercorn_ws_stream.FrameTooLargeError()
        if self.text is None:
            self.text = isinstance(data, str)
        self.pieces.append(data)
        self.length += len(data)

    def clear(self) -> None:
        self.pieces = []
        self.length = 0
        self.text = None
        self.overflowed = False

    def to_message(self) -> dict[str, Any]:
        if self.text:
            return {"type": "websocket.receive", "bytes": None, "text": "".join(self.pieces)}
        return {"type": "websocket.receive", "bytes": b"".join(self.pieces), "text": None}


def install() -> None:
    if not adapters.usable("ws_buffer"):
        return  # logged by the adapter's start-up check
    if getattr(hypercorn_ws_stream, "WebsocketBuffer", None) is BoundedWebsocketBuffer:
        return
    setattr(hypercorn_ws_stream, "WebsocketBuffer", BoundedWebsocketBuffer)  # noqa: B010
