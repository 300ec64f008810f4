"""A WebSocket message over the size limit costs the server no more than the limit: a real
``sluice serve`` process, its RSS read from /proc, while authenticated clients each send one
message many times the limit (hypercorn's own buffer kept all of each: see
proxy/server/ws_buffer.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from proxy.server.ws_buffer import BoundedWebsocketBuffer
from tests.support import rss_mb, start_sluice, stop

KEY = "ws-memory-key"
LIMIT = 1024 * 1024
CLIENTS = 8
MESSAGE = 16 * LIMIT


class Piece:
    def __init__(self, data: str | bytes) -> None:
        self.data = data


def test_the_buffer_keeps_nothing_of_a_message_over_the_limit() -> None:
    from proxy.server.adapters.hypercorn_adapter import hypercorn_ws_stream

    buffer = BoundedWebsocketBuffer(10)
    buffer.extend(Piece("hello "))
    with pytest.raises(hypercorn_ws_stream.FrameTooLargeError):
        buffer.extend(Piece("world!"))
    assert buffer.pieces == []
    # The rest of that message is refused without being kept, however small the piece.
    with pytest.raises(hypercorn_ws_stream.FrameTooLargeError):
        buffer.extend(Piece("x"))
    assert buffer.pieces == []
    buffer.clear()
    buffer.extend(Piece(b"ab"))
    buffer.extend(Piece(b"cd"))
    assert buffer.to_message() == {"type": "websocket.receive", "bytes": b"abcd", "text": None}
    buffer.clear()
    buffer.extend(Piece("é"))
    assert buffer.to_message()["text"] == "é"


async def test_huge_messages_from_authenticated_clients_stay_within_the_limit(
    tmp_path: Path,
) -> None:
    config = tmp_path / "ws.toml"
    config.write_text(
        f"[server]\nport = 0\nmax_body_bytes = {LIMIT}\n"
        f'[[keys]]\nname = "k"\nsha256 = "{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
        '[models.m]\nupstreams = ["http://127.0.0.1:9"]\n'
    )
    with trio.fail_after(120):
        process, url = await start_sluice(config)
        try:
            await trio.sleep(0.5)
            before = peak = rss_mb(process.pid)
            payload = "x" * MESSAGE
            codes: list[int] = []

            async def send_one() -> None:
                async with open_websocket_url(
                    url.replace("http://", "ws://") + "/v1/ws",
                    extra_headers=[("Authorization", f"Bearer {KEY}")],
                ) as ws:
                    try:
                        await ws.send_message(payload)
                        await ws.get_message()
                    except ConnectionClosed as closed:
                        assert closed.reason is not None
                        codes.append(closed.reason.code)
                    # trio-websocket leaves its TCP stream open after the server's close.
                    await ws._stream.aclose()

            async with trio.open_nursery() as nursery:
                for _ in range(CLIENTS):
                    nursery.start_soon(send_one)
                while len(codes) < CLIENTS:
                    peak = max(peak, rss_mb(process.pid))
                    await trio.sleep(0.02)
            assert codes == [1009] * CLIENTS
            # Each connection holds at most the limit at once (8 MiB in all here); hypercorn's
            # buffer held every message whole (8 x 16 MiB, and more while decoding).
            assert peak - before < 40, (before, peak)
        finally:
            await stop(process)
