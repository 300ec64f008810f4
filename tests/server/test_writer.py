"""The one writer (proxy/server/writer.py) over real sockets, on both servers: what every answer
gets wherever it is written.

Each test runs twice: with the fast path (its own wire) and without it (hypercorn's, written by
Sluice through h11). The fast path's and the chunk writer's own tests cover the bytes on the
wire; these cover the contracts of the writer that the two servers share.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import trio

from proxy.server.chunk_writer import ChunkWriter
from tests.support import DEADLINE, OPEN_RAW_CLIENTS, RawClient, connect_client, start_proxy

CHAT = "/v1/chat/completions"
STALL = 0.5

pytestmark = pytest.mark.parametrize("fast_path", [True, False], ids=["fast-path", "hypercorn"])


@pytest.fixture
def small_proxy_sndbuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 KiB send buffer on the proxy's side of each client connection it answers, so that
    a client that stops reading fills it after a few KiB instead of autotuned megabytes."""
    original_init = ChunkWriter.__init__

    def init(self: ChunkWriter, server: Any, sock: Any, stall_timeout: float) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        original_init(self, server, sock, stall_timeout)

    monkeypatch.setattr(ChunkWriter, "__init__", init)


async def test_a_plain_answer_the_client_never_takes_is_dropped_at_the_stall_limit(
    nursery: trio.Nursery, fast_path: bool, small_proxy_sndbuf: None
) -> None:
    """A refusal (a plain answer, no relay) as big as the model name the client invented: the
    client never reads it. Its writes have the relay's stall limit, on both servers, as a
    stream's do: the connection is dropped, not held (hypercorn's own write has no deadline,
    and held such a connection, and the server's shutdown, for as long as the client
    wished)."""
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"fake-model": ["http://127.0.0.1:9"]},
            server={"fast_path": fast_path},
            relay={"stall_timeout": STALL},
        )
        model = "m" * 300_000
        payload = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        raw = RawClient(await connect_client(proxy, rcvbuf=4096, mss=1460))
        OPEN_RAW_CLIENTS.append(raw)
        host, port = proxy.host_port
        await raw.stream.send_all(
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode()
        )
        # Takes nothing for the stall limit and more.
        await trio.sleep(STALL + 1.5)
        received = b""
        with trio.move_on_after(2) as waited:
            try:
                while data := await raw.stream.receive_some(65536):
                    received += data
            except trio.BrokenResourceError:
                pass  # the reset
        assert not waited.cancelled_caught, "the connection was held, not dropped"
        # Dropped: the answer never arrived whole.
        assert received.startswith(b"HTTP/1.1 404") or received == b""
        assert len(received) < len(model)
