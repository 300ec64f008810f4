"""A fake vLLM KV-event publisher, for the tests and the fake upstream's prefix cache (the
KV-routing bench): real ZeroMQ sockets, frames and payloads as vLLM's ``ZmqEventPublisher``
sends them (``vllm/distributed/kv_events.py``).

- each batch: ``[topic, seq (8 bytes big-endian, from 0), msgpack payload]`` on a PUB-like
  socket (an XPUB here: it also tells the test when a subscriber has joined, so nothing is
  published into the void while the subscription is still on its way);
- the payload: ``[ts, events]``, each event ``[tag, *fields]`` (vLLM up to 0.10, msgspec's
  ``array_like``) or ``{"type": tag, ...}`` (later releases), block hashes as bytes (sha256);
- replay: a ROUTER socket; a request ``[identity, b"", start]`` is answered with every buffered
  batch from ``start`` on as ``[identity, b"", seq, payload]``, then ``[identity, b"", -1, b""]``.

The encoding is written here from vLLM's structs, not taken from the code under test.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgpack
import trio
import zmq

from proxy.zmq_trio import close, receive


def vllm_hashes(tokens: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """Block hashes as vLLM names them: a chain of sha256 from a random seed (NONE_HASH), so
    that no other process could compute them."""
    hashes, parent = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        parent = hashlib.sha256(parent + repr(tuple(block)).encode()).digest()
        hashes.append(parent)
    return hashes


def block_stored(
    hashes: Sequence[bytes],
    parent: bytes | None,
    tokens: Sequence[int],
    block_size: int,
    *,
    maps: bool = False,
    **extra: Any,
) -> Any:
    """A BlockStored event as msgspec encodes it (lora_id and medium: None and "GPU")."""
    fields: dict[str, Any] = {
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }
    if maps:
        return {"type": "BlockStored", **fields}
    return ["BlockStored", *fields.values()]


def block_removed(hashes: Sequence[bytes], *, maps: bool = False) -> Any:
    if maps:
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}
    return ["BlockRemoved", list(hashes), "GPU"]


def all_cleared(*, maps: bool = False) -> Any:
    return {"type": "AllBlocksCleared"} if maps else ["AllBlocksCleared"]


def payload(events: Sequence[Any]) -> bytes:
    packed: bytes = msgpack.packb([time.time(), list(events)], use_bin_type=True)
    return packed


class FakeVllmPublisher:
    """One replica's publisher: :meth:`publish` a batch of raw events (the helpers above);
    :meth:`serve_replay` answers replay requests from the last ``buffer`` batches. Bound on
    ``host``, at ``port`` and ``replay_port`` (0: a free one each)."""

    def __init__(
        self,
        *,
        buffer: int = 10_000,
        topic: bytes = b"",
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int = 0,
    ) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub: zmq.Socket[bytes] = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = _bind(self.pub, host, port)
        self.endpoint = f"tcp://{host}:{port}"
        self.router: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        replay_port = _bind(self.router, host, replay_port)
        self.replay_endpoint = f"tcp://{host}:{replay_port}"
        self.replay_port = replay_port
        self.port = port
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.replays: list[int] = []
        # Subscribers joined and not gone, as count_subscribers saw them.
        self.subscribers = 0

    async def subscribed(self) -> None:
        """Until a subscriber has joined (XPUB hands its subscription message up; b"\\x00"
        is one leaving)."""
        while (await receive(self.pub))[0][:1] != b"\x01":
            pass

    def publish(self, events: Sequence[Any], *, send: bool = True) -> int:
        """Publish one batch (``send=False``: number and buffer it, but never send it: a
        batch lost on the way); its sequence number."""
        seq, body = self.seq, payload(events)
        self.seq += 1
        self.buffer.append((seq, body))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
        return seq

    def restart(self) -> None:
        """The engine started again: numbers from 0, nothing buffered."""
        self.seq = 0
        self.buffer.clear()

    async def serve_replay(self) -> None:
        while True:
            frames = await receive(self.router)
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replays.append(start)
            for seq, body in self.buffer:
                if seq >= start:
                    self.router.send_multipart([identity, b"", seq.to_bytes(8, "big"), body])
            end = (-1).to_bytes(8, "big", signed=True)
            self.router.send_multipart([identity, b"", end, b""])

    async def count_subscribers(self) -> None:
        """Read what subscribers send the XPUB socket (so that it never queues up) into
        :attr:`subscribers`, for a publisher that no test awaits (the fake upstream's)."""
        while True:
            message = (await receive(self.pub))[0][:1]
            self.subscribers += {b"\x01": 1, b"\x00": -1}.get(message, 0)

    def close(self) -> None:
        close(self.pub)
        close(self.router)


def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> int:
    if not port:
        return socket.bind_to_random_port(f"tcp://{host}")
    socket.bind(f"tcp://{host}:{port}")
    return port


@contextlib.asynccontextmanager
async def serving(*, buffer: int = 10_000) -> AsyncIterator[FakeVllmPublisher]:
    """A publisher answering replay requests until the block ends, then closed."""
    publisher = FakeVllmPublisher(buffer=buffer)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher.serve_replay)
            yield publisher
            nursery.cancel_scope.cancel()
    finally:
        publisher.close()
