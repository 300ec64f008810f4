"""The trio floor (proxy/bench/peers/trio_floor.py): its chunked framing (pure), and on real
sockets (localhost, port 0, a ``fail_after`` on each): a streamed answer relayed read by read
and ended (in front of an upstream in lockstep with the client); in front of the fake upstream,
keep-alive on both sides, an upstream that closes after every answer, a client that leaves; an
upstream that is down."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from proxy.bench.client import ResponseParser
from proxy.bench.peers import trio_floor
from proxy.bench.peers.trio_floor import Chunked, Sized
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream
from tests.support import LOCKSTEP_WORDS, serve_in_lockstep

CHUNKED = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\nx-trailer: 1\r\n\r\n"


def test_chunked_finds_the_end_however_the_bytes_are_split() -> None:
    tail = b"NEXT"
    whole = CHUNKED + tail
    for cut in range(1, len(whole)):
        for second_cut in (cut, min(cut + 3, len(whole))):
            parts = [whole[:cut], whole[cut:second_cut], whole[second_cut:]]
            body, seen, end = Chunked(), 0, -1
            for part in parts:
                end = body.feed(part)
                if end >= 0:
                    # The end is found in the part that holds it, at the byte after it.
                    assert seen + end == len(CHUNKED), (cut, second_cut)
                    break
                seen += len(part)
            assert end >= 0, (cut, second_cut)


def test_chunked_without_trailers_and_a_chunk_split_in_its_data() -> None:
    body = Chunked()
    assert body.feed(b"a\r\n0123") == -1
    assert body.feed(b"456789\r") == -1
    assert body.feed(b"\n0\r\n") == -1
    assert body.feed(b"\r\n") == 2


def test_a_size_line_that_never_ends_is_refused() -> None:
    with pytest.raises(ValueError, match="size line"):
        Chunked().feed(b"f" * (trio_floor.MAX_HEAD + 2))


def test_sized_bodies_end_after_their_length() -> None:
    body = Sized(5)
    assert body.feed(b"abc") == -1
    assert body.feed(b"deXX") == 2
    assert Sized(0).feed(b"") == 0


@asynccontextmanager
async def floor_in_front_of(fake: FakeUpstream) -> AsyncIterator[tuple[str, int]]:
    """The fake and the floor in front of it, both on free ports, for one test."""
    async with trio.open_nursery() as nursery:
        fake_port = await nursery.start(fake.serve)
        port = await nursery.start(trio_floor.serve, "127.0.0.1", 0, ("127.0.0.1", fake_port))
        yield ("127.0.0.1", port)
        nursery.cancel_scope.cancel()


def chat(tag: str, *, close: bool = False, stream: bool = True) -> bytes:
    body = json.dumps(
        {
            "model": "fake-model",
            "stream": stream,
            "user": tag,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: floor\r\n"
    head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


async def read_answer(
    sock: trio.socket.SocketType, on_tokens: Callable[[ResponseParser, int], None] | None = None
) -> ResponseParser:
    """One whole response, as the bench's client reads it; ``on_tokens(parser, count)`` after
    each read that brought tokens (``count`` of them)."""
    parser = ResponseParser()
    while not parser.complete:
        data = await sock.recv(65536)
        assert data, "the floor closed before the answer ended"
        if (count := parser.feed(data)) and on_tokens is not None:
            on_tokens(parser, count)
    return parser


async def connect(address: tuple[str, int]) -> trio.socket.SocketType:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    await sock.connect(address)
    return sock


async def test_a_streamed_answer_goes_out_as_it_comes_and_ends() -> None:
    """In lockstep: the upstream sends each token once the client has read the one before, so
    a floor that held a read back (buffered to the end, or to the next read) would never
    finish. Not gaps between arrival times, which a loaded machine squeezes together."""
    read = [trio.Event() for _ in LOCKSTEP_WORDS]
    per_read: list[int] = []

    def on_tokens(parser: ResponseParser, count: int) -> None:
        per_read.append(count)
        for event in read[: parser.events.content]:
            event.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            upstream = await nursery.start(serve_in_lockstep, read)
            port = await nursery.start(trio_floor.serve, "127.0.0.1", 0, ("127.0.0.1", upstream))
            with await connect(("127.0.0.1", port)) as sock:
                await sock.send(chat("one", close=True))
                parser = await read_answer(sock, on_tokens)
                # After the answer's end the floor closes, as the client asked.
                assert await sock.recv(100) == b""
            nursery.cancel_scope.cancel()
    assert parser.status == 200
    assert parser.events.done and parser.events.content == len(LOCKSTEP_WORDS)
    # One token per read, each relayed as it came.
    assert per_read == [1] * len(LOCKSTEP_WORDS)


async def test_keep_alive_on_both_sides() -> None:
    fake = FakeUpstream(FakeSettings(ttft=0.01, interval=0.005, tokens=3))
    with trio.fail_after(20):
        async with floor_in_front_of(fake) as address:
            with await connect(address) as sock:
                for tag in ("a", "b", "c"):
                    await sock.send(chat(tag, stream=tag != "b"))
                    parser = await read_answer(sock)
                    assert parser.status == 200
    records = [r for r in fake.recorder.records if r.path == "/v1/chat/completions"]
    assert [r.outcome for r in records] == ["completed"] * 3
    # Three requests on one client connection went over one upstream connection.
    assert len({r.connection for r in records}) == 1
    assert fake.recorder.connections_accepted == 1


async def test_an_upstream_that_closes_after_each_answer_costs_no_request() -> None:
    fake = FakeUpstream(
        FakeSettings(ttft=0.01, interval=0.005, tokens=3, close_after_response=True)
    )
    with trio.fail_after(20):
        async with floor_in_front_of(fake) as address:
            with await connect(address) as sock:
                for tag in ("a", "b", "c", "d"):
                    await sock.send(chat(tag))
                    parser = await read_answer(sock)
                    assert parser.status == 200
                    assert parser.events.done
                    # The fake's close reaches the floor's pool before the next request.
                    await trio.sleep(0.02)
    records = [r for r in fake.recorder.records if r.path == "/v1/chat/completions"]
    assert [r.outcome for r in records] == ["completed"] * 4
    assert len({r.connection for r in records}) == 4


async def test_a_client_that_leaves_closes_its_upstream_connection() -> None:
    fake = FakeUpstream(FakeSettings(ttft=0.01, interval=0.02, tokens=200))
    with trio.fail_after(20):
        async with floor_in_front_of(fake) as address:
            with await connect(address) as sock:
                await sock.send(chat("leaver"))
                parser = ResponseParser()
                while parser.events.content < 3:
                    parser.feed(await sock.recv(65536))
            record = fake.recorder.last("/v1/chat/completions")
            # Noticed at the next write that fails: a few events later, not the whole answer.
            await fake.recorder.wait_for(lambda r: record.outcome != "pending")
            assert record.outcome == "client_disconnected"
            assert record.tokens_sent < 20
            # The next client gets a fresh upstream connection, not the abandoned one.
            with await connect(address) as sock:
                await sock.send(chat("next", stream=False, close=True))
                assert (await read_answer(sock)).status == 200
    assert fake.recorder.last("/v1/chat/completions").connection != record.connection


async def test_an_upstream_that_is_down_is_a_502() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        down = unused.getsockname()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(trio_floor.serve, "127.0.0.1", 0, down)
            with await connect(("127.0.0.1", port)) as sock:
                await sock.send(chat("x"))
                parser = ResponseParser()
                while not parser.complete:
                    data = await sock.recv(65536)
                    assert data
                    parser.feed(data)
            nursery.cancel_scope.cancel()
    assert parser.status == 502
