"""The backpressure contract, over real sockets: every buffer is bounded by configuration.

A client that reads slowly fills the per-request channel (at most ``channel_capacity`` events),
the producer blocks, the upstream read stops and TCP pushes back to the upstream; for the local
model, the inference thread itself blocks. A client that makes no progress for
``stall_timeout`` is cut off with its work cancelled; a slow client that keeps reading is not.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio

from tests.support import (
    DEADLINE,
    RawClient,
    chat_body,
    poll_until,
    producer_tasks,
    slowed,
    start_fake,
    start_local_proxy,
    start_proxy,
    wait_until_steady,
)

# At the server seam: each contract holds whichever server reads the request.
pytestmark = pytest.mark.usefixtures("each_server_path")

CHAT = "/v1/chat/completions"


async def test_slow_reader_applies_backpressure_then_is_cut_off(nursery: trio.Nursery) -> None:
    capacity = 4
    stall_timeout = 2.0
    with trio.fail_after(DEADLINE):
        # A fast, long stream with small socket buffers on both upstream legs, so that the
        # pause reaches the fake upstream after little data.
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=200_000, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": capacity, "stall_timeout": stall_timeout},
            upstream={"socket_rcvbuf": 4096},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096)
        await raw.read_until(b"data: ", count=3)
        stopped_reading = trio.current_time()
        # The client stops reading. The proxy's socket buffers fill, then the channel, then
        # the producer blocks, then the upstream read stops: the fake stops sending.
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        buffered: list[int] = []

        def sample_sent() -> int:
            buffered.append(relay.buffered())
            return int(fake.recorder.last().tokens_sent)

        sent = await wait_until_steady(sample_sent)  # the upstream is paused...
        assert sent[-1] < 200_000 // 4, sent  # ...long before the end of its stream
        assert max(buffered) <= capacity
        assert buffered[-1] == capacity  # the backlog is held in the bounded channel
        # After stall_timeout without progress the client is cut off and its upstream closed.
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        record = fake.recorder.last()
        assert record.outcome == "client_disconnected"
        await proxy.state.tracker.wait_idle()
        # hypercorn's send_all is shielded, so the relay frees the handler by resetting the
        # client's connection (asgi.abort_transport) when it detects the stall.
        assert trio.current_time() - stopped_reading < stall_timeout + 1 + 2
        assert proxy.state.tracker.stalled == 1
        assert proxy.state.metrics.registry.get_sample_value("sluice_stalled_clients_total") == 1
        assert producer_tasks() == []
        # The connection itself is dropped too, though this client never closed it:
        # draining what was buffered ends in EOF or reset.
        try:
            while await raw.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        await raw.stream.aclose()


async def test_a_slow_reader_that_keeps_reading_is_not_cut_off(nursery: trio.Nursery) -> None:
    """Stalled means no progress for stall_timeout, not slow: a client that reads a little at
    a time, for longer than stall_timeout in all, gets its whole answer."""
    # The reader makes progress every 20 ms: a limit of 1.5 s is not reached even when a
    # loaded machine pauses the whole process for a while. The answer (900 tokens, about
    # 170 KB, read at most 2 KiB at a time) takes some 84 reads, 20 ms apart: longer than it.
    stall_timeout = 1.5
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=900, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 2, "stall_timeout": stall_timeout},
            upstream={"socket_rcvbuf": 4096},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096, mss=1460)
        started = trio.current_time()
        fullest = reads = 0
        while b"data: [DONE]" not in raw.received:
            chunk = await raw.stream.receive_some(2048)
            assert chunk, "the proxy cut a client that was still reading"
            raw.received += chunk
            reads += 1
            fullest = max([fullest, *(relay.buffered() for relay in proxy.state.tracker.active)])
            await trio.sleep(0.02)
        assert reads * 0.02 > stall_timeout  # the reader's pauses alone outlast the limit
        assert trio.current_time() - started > stall_timeout  # longer than the limit in all
        assert fullest == 2  # and the proxy was held back by this reader all along
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.stalled == 0


@pytest.fixture
def small_proxy_sndbuf(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 KiB send buffer on the proxy's side of each client connection it answers, set as
    the writer takes the socket (both servers write through a ChunkWriter)."""
    from proxy.server.chunk_writer import ChunkWriter

    original_init = ChunkWriter.__init__

    def init(self: ChunkWriter, server: Any, sock: Any, stall_timeout: float) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        original_init(self, server, sock, stall_timeout)

    monkeypatch.setattr(ChunkWriter, "__init__", init)


async def test_a_client_that_stalls_after_the_last_token_is_cut_off(
    nursery: trio.Nursery, small_proxy_sndbuf: None
) -> None:
    # The producer's stall limit covers a full channel; once the producer is done (here the
    # whole rest of the stream fits in the channel), the body's own writes must be bounded
    # too, or the request (and the server's shutdown) waits on the client forever.
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3000)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 4000, "stall_timeout": 0.5},
        )
        raw = await RawClient.post(proxy, CHAT, chat_body(), rcvbuf=4096, mss=1460)
        try:
            await raw.read_until(b"data: ", count=2)  # then never reads again
            await poll_until(lambda: not producer_tasks())
            await poll_until(lambda: proxy.state.tracker.stalled == 1)
            await proxy.state.tracker.wait_idle()
        finally:
            await raw.stream.aclose()


async def test_slow_reader_blocks_the_model_itself(
    nursery: trio.Nursery, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.0)
    capacity = 4
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(
            nursery, loaded, relay={"channel_capacity": capacity, "stall_timeout": 2.0}
        )
        backend = proxy.state.local_backends["tiny"]
        raw = await RawClient.post(proxy, CHAT, chat_body("tiny"), rcvbuf=4096)
        await raw.read_until(b'"content":"', count=2)
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        # The model pauses (the thread waits in from_thread.run(send)), its output held in
        # the bounded channel, far from the 100k tokens it was asked for.
        steps = await wait_until_steady(lambda: loaded.model.steps)
        assert steps[-1] < 5_000, steps
        assert relay.buffered() == capacity
        assert backend.active_generations == 1
        # Past stall_timeout the client is cut off and the model released.
        await backend.admission.wait_free()
        assert backend.active_generations == 0
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.stalled == 1
        await raw.stream.aclose()
