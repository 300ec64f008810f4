"""An attacker's WebSocket clients leave no relay behind: ``sluice_active_streams`` and the
relay tracker are back at 0 once they have gone, whatever they did and however they left.

The clients speak WebSocket by hand (wsproto over a raw socket), so each decides exactly when
it reads, when it stops reading, and how it leaves: a FIN, a reset, a close frame, or staying
connected until the stall guard drops it. The randomized replay mixes malformed messages, ones
over the size limit (closed with 1009, before or during a generation), floods, non-readers,
cancels, abrupt exits and bad keys; each seed is fixed, so a failure replays as it happened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Message, TextMessage
from wsproto.events import Request as WSRequest
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from proxy.relay.stall import StallGuard
from tests.support import Proxy, start_fake, start_proxy

KEY = "ws-attack-key"
LIMIT = 64 * 1024  # max_body_bytes, and so the largest WebSocket message
STALL = 1.0
# At rest after a round: the last client has gone, and a stalled one is dropped within STALL.
REST_DEADLINE = STALL + 5


def chat(**extra: Any) -> str:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **extra}
    return json.dumps(body)


class RawWebSocket:
    """A client connection to ``/v1/ws`` that reads only when told to."""

    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self.stream = stream
        self.ws = ws
        self.closed = False  # the server closed (a close frame, or the socket)

    @classmethod
    async def open(cls, proxy: Proxy, key: str = KEY, *, small: bool = False) -> RawWebSocket:
        sock = trio.socket.socket()
        if small:
            # A reader that stops fills these at once: the server's writes then block.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        stream = trio.SocketStream(sock)
        try:
            await sock.connect(proxy.host_port)
            return cls(stream, await handshake(stream, proxy, key))
        except BaseException:
            sock.close()
            raise

    async def send(self, *texts: str) -> None:
        try:
            data = b"".join(self.ws.send(TextMessage(data=text)) for text in texts)
        except LocalProtocolError:
            return  # closing: a real client sends nothing more either
        await self.stream.send_all(data)

    async def read(self, seconds: float) -> list[str]:
        """What the server sends within ``seconds`` (less, if it closes)."""
        received: list[str] = []
        with trio.move_on_after(seconds):
            while not self.closed:
                data = await self.stream.receive_some(65536)
                if not data:
                    self.closed = True
                    break
                try:
                    self.ws.receive_data(data)
                    for event in self.ws.events():
                        if isinstance(event, Message) and isinstance(event.data, str):
                            received.append(event.data)
                        elif isinstance(event, CloseConnection):
                            self.closed = True
                except (LocalProtocolError, RemoteProtocolError):
                    self.closed = True
        return received

    async def leave(self, how: str, rng: random.Random) -> None:
        sock = self.stream.socket
        if how == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "close frame":
            with trio.move_on_after(0.2):
                with contextlib.suppress(LocalProtocolError, trio.BrokenResourceError):
                    await self.stream.send_all(self.ws.send(CloseConnection(code=1000)))
        elif how == "linger":
            await trio.sleep(rng.uniform(0, 2 * STALL))  # connected, reading nothing
        sock.close()


async def handshake(stream: trio.SocketStream, proxy: Proxy, key: str) -> WSConnection:
    ws = WSConnection(ConnectionType.CLIENT)
    host, port = proxy.host_port
    headers = [(b"authorization", f"Bearer {key}".encode())]
    await stream.send_all(
        ws.send(WSRequest(host=f"{host}:{port}", target="/v1/ws", extra_headers=headers))
    )
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("refused before the handshake")
        ws.receive_data(data)
        if any(isinstance(event, AcceptConnection) for event in ws.events()):
            return ws


# -- the clients -------------------------------------------------------------------------------


async def malformed(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy)
    bad = [
        "{not json",
        "[]",
        '{"model": "nope", "messages": []}',
        "x" * 300,
        '{"model": "fake-model", "messages": [], "max_tokens": ' + "9" * 5000 + "}",
        "[" * 10_000,
        '{"type": "cancel"}',
    ]
    rng.shuffle(bad)
    for text in bad[: rng.randint(1, len(bad))]:
        await ws.send(text)
        if rng.random() < 0.7:
            await ws.read(0.05)
    return ws


async def huge(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy)
    with trio.move_on_after(1):
        await ws.send("x" * (LIMIT + rng.randint(1, 4 * LIMIT)))
    if rng.random() < 0.5:
        await ws.read(0.3)  # the 1009
    return ws


async def huge_during(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    """Over the limit while a generation runs: hypercorn closes with 1009 without telling the
    app, whose generation goes on writing into a socket that drops what it is given."""
    ws = await RawWebSocket.open(proxy)
    await ws.send(chat(max_tokens=rng.choice([5, 200, 5000])))
    await ws.read(rng.uniform(0, 0.2))
    with trio.move_on_after(1):
        await ws.send("x" * (LIMIT + 1))
    await ws.send(chat())  # after the close: never delivered
    await ws.read(rng.uniform(0, 0.3))
    return ws


async def flood(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy)
    await ws.send(chat(max_tokens=rng.choice([3, 100, 5000])))
    with trio.move_on_after(1):
        await ws.send(*[chat() for _ in range(rng.randint(5, 500))])
    await ws.read(rng.uniform(0, 0.5))
    return ws


async def flood_unread(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    """A generation, then a flood of requests, reading nothing: the server's writes (tokens,
    request_in_progress replies) block, and it must go on reading all the same."""
    ws = await RawWebSocket.open(proxy, small=True)
    await ws.send(chat(max_tokens=5000))
    await flood_until_refused(ws, rng.uniform(0.2, 1.5))
    return ws


async def non_reader(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy, small=True)
    await ws.send(chat(max_tokens=5000))
    await trio.sleep(rng.uniform(0, 1.5))
    return ws


async def cancels(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    """Cancels mid-stream, and cancels racing the end of a short generation."""
    ws = await RawWebSocket.open(proxy)
    for _ in range(rng.randint(1, 4)):
        await ws.send(chat(max_tokens=rng.choice([1, 2, 500])))
        await ws.read(rng.choice([0, 0.005, 0.02, 0.1]))
        await ws.send('{"type": "cancel"}')
    await ws.read(rng.uniform(0, 0.2))
    return ws


async def abrupt(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy)
    await ws.send(chat(max_tokens=500))
    await trio.sleep(rng.uniform(0, 0.1))
    return ws


async def bad_key(proxy: Proxy, rng: random.Random) -> RawWebSocket:
    ws = await RawWebSocket.open(proxy, "wrong-key", small=rng.random() < 0.5)
    if rng.random() < 0.5:
        with trio.move_on_after(0.5):
            await ws.send(*[chat() for _ in range(rng.randint(1, 300))])
    if rng.random() < 0.5:
        await ws.read(0.2)
    return ws


CLIENTS: list[Callable[[Proxy, random.Random], Awaitable[RawWebSocket]]] = [
    malformed,
    huge,
    huge_during,
    flood,
    flood_unread,
    non_reader,
    cancels,
    abrupt,
    bad_key,
]
ENDINGS = ["close", "reset", "close frame", "linger"]


async def flood_until_refused(ws: RawWebSocket, seconds: float) -> None:
    """Send requests without reading, until the server stops taking them (its reading has
    stopped: everything it reads waits behind a write) or ``seconds`` have passed."""
    batch = [chat() for _ in range(200)]
    with trio.move_on_after(seconds):
        while True:
            with trio.move_on_after(0.3) as refused:
                try:
                    await ws.send(*batch)
                except trio.BrokenResourceError:
                    return  # dropped by the stall guard
            if refused.cancelled_caught:
                return


async def run_client(
    proxy: Proxy, kind: Callable[[Proxy, random.Random], Awaitable[RawWebSocket]], seed: int
) -> None:
    rng = random.Random(seed)
    ws: RawWebSocket | None = None
    try:
        with trio.move_on_after(4):
            ws = await kind(proxy, rng)
            await ws.leave(rng.choice(ENDINGS), rng)
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server dropped it (a stall, a 1009): that is one way to leave
    finally:
        if ws is not None:
            ws.stream.socket.close()


def gauge(proxy: Proxy) -> float | None:
    return proxy.state.metrics.registry.get_sample_value("sluice_active_streams")


async def at_rest(proxy: Proxy) -> None:
    tracker = proxy.state.tracker
    with trio.move_on_after(REST_DEADLINE):
        await tracker.wait_idle()
    assert not tracker.active, [repr(body) for body in tracker.active]
    assert gauge(proxy) == 0


async def attack_proxy(nursery: trio.Nursery, stall_timeout: float = STALL) -> Proxy:
    fake = await start_fake(nursery, ttft=0.005, interval=0.002, tokens=5000)
    return await start_proxy(
        nursery,
        {"fake-model": [fake.url]},
        keys=[{"name": "k", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}],
        server={"max_body_bytes": LIMIT},
        relay={"stall_timeout": stall_timeout},
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_attack_sequences_leave_no_active_stream(
    nursery: trio.Nursery, seed: int
) -> None:
    rng = random.Random(seed)
    with trio.fail_after(40):
        proxy = await attack_proxy(nursery)
        for _ in range(2):
            async with trio.open_nursery() as clients:
                for _ in range(rng.randint(2, 6)):
                    clients.start_soon(
                        run_client, proxy, rng.choice(CLIENTS), rng.randrange(1 << 30)
                    )
                    await trio.sleep(rng.uniform(0, 0.1))
            await at_rest(proxy)
        assert proxy.state.tracker.started > 0


@pytest.mark.parametrize("ending", ["close", "reset", "linger"])
async def test_a_flood_from_a_client_that_reads_nothing_ends_its_generation(
    nursery: trio.Nursery, ending: str
) -> None:
    """The interleaving that leaked a count: a generation's token write and the reading loop's
    request_in_progress reply both wait on a client that floods without reading, and the
    loop, which alone drains the app's inbound queue, is in its write. The connection fails
    (the client leaves, or the stall guard drops it): hypercorn's write, under its send lock,
    waits to queue the disconnect in that full queue; the generation waited on the lock, and
    its relay stayed open for as long as the process ran.

    Stall timeout 30 s, the default: a client that leaves is done with at once; one that
    stays is dropped by the stall guard ("linger", with a stall timeout of 1 s)."""
    stall_timeout = STALL if ending == "linger" else 30.0
    with trio.fail_after(20):
        proxy = await attack_proxy(nursery, stall_timeout)
        ws = await RawWebSocket.open(proxy, small=True)
        try:
            await ws.send(chat(max_tokens=5000))
            with trio.fail_after(5):
                await proxy.state.tracker.wait_until(lambda tracker: bool(tracker.active))
            await flood_until_refused(ws, 3.0)
            if ending != "linger":
                await ws.leave(ending, random.Random(0))
            # Leaked, the generation would stay active for as long as the process ran: the
            # fail_after above ends the wait (no shorter bound of its own, which a loaded
            # machine could overrun).
            await proxy.state.tracker.wait_idle()
            assert not proxy.state.tracker.active
            assert gauge(proxy) == 0
        finally:
            ws.stream.socket.close()


async def test_overlapping_writes_are_each_bounded_by_the_stall_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two writes through one guard (a generation's token and a reply to another message):
    the first to end must not take the other's deadline with it."""
    stalls: list[float] = []
    release_first = trio.Event()
    guard = StallGuard(1.0, lambda: stalls.append(trio.current_time()))

    async def first() -> None:
        await release_first.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(guard.watch)
        nursery.start_soon(guard.write, first)
        nursery.start_soon(guard.write, trio.sleep_forever)  # a client that never reads
        await trio.sleep(0.5)
        release_first.set()  # the client took one of them, then nothing more
        await trio.sleep(5)
        assert stalls == [pytest.approx(1.5)]
        nursery.cancel_scope.cancel()
