"""RelayBody.set_head starting a streamed response in the producer's task (start_stream).

The server's writer attaches the body to its client connection, whose ``start_stream`` makes
the response head and returns a writer holding it; set_head calls it for a streamed 200 so that
the producer's first offer, in the same scheduler step, writes the head and the first event
together. Here the connection and the writer are recording stand-ins: what matters is who
called what, when, and in which order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import trio
import trio.testing

from proxy.relay.body import (
    JSON_CONTENT_TYPE,
    SSE_CONTENT_TYPE,
    DirectWriter,
    RelayBody,
    RelaySink,
)

EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


class RecordingWriter:
    """A DirectWriter that takes everything at once and remembers it, with the task that
    wrote (the producer's, for a direct write)."""

    def __init__(self) -> None:
        self.direct: list[tuple[bytes, str]] = []
        self.written: list[bytes] = []

    def write_nowait(self, chunk: bytes) -> bool | None:
        self.direct.append((chunk, trio.lowlevel.current_task().name))
        return True

    async def write(self, chunk: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if chunk:
            self.written.append(chunk)

    async def wait_for_room(self) -> None:
        await trio.lowlevel.checkpoint()


class Connection:
    """A client connection (relay.ClientConnection) whose start_stream is ``start``."""

    def __init__(self, start: Callable[[], DirectWriter | None]) -> None:
        self._start = start
        self.heads: list[tuple[int, Mapping[str, str]]] = []

    def gone_at(self) -> float | None:
        return None

    def abort(self) -> None:
        pass

    def start_stream(self, status: int, headers: Mapping[str, str]) -> DirectWriter | None:
        self.heads.append((status, headers))
        return self._start()


def body_for(produce: object, *, streaming: bool = True) -> RelayBody:
    return RelayBody(
        produce,  # type: ignore[arg-type]
        streaming=streaming,
        channel_capacity=4,
        stall_timeout=10,
        description="t",
    )


async def test_a_streamed_head_is_started_by_the_producer_and_its_first_event_written_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    writer = RecordingWriter()
    calls: list[tuple[int, str, str]] = []
    first_offer: list[bool] = []

    async def produce(sink: RelaySink) -> None:
        sink.begin(200, SSE_CONTENT_TYPE, {"X-Upstream": "a"})
        # Synchronously, inside begin: the head was started before the first offer.
        assert len(calls) == 1
        first_offer.append(sink.offer(EVENT))
        await trio.sleep(1)
        await sink.send(EVENT)

    body = body_for(produce)

    def start_stream() -> RecordingWriter:
        # Called with the head decided, in the producer's task.
        calls.append((body.status, body.headers["Content-Type"], trio.lowlevel.current_task().name))
        return writer

    connection = Connection(start_stream)
    body.attach(connection)
    async with body:
        # By the time the body's task sees the head, the first event is already out.
        assert body.writer is writer
        assert [chunk for chunk, _ in writer.direct] == [EVENT]
        assert body.buffered() == 0
        await body.write_through(writer)
    assert first_offer == [True]
    ((status, content_type, task),) = calls
    assert (status, content_type) == (200, SSE_CONTENT_TYPE)
    # The head it was given is the body's own.
    assert connection.heads == [(200, body.headers)]
    assert task.startswith("relay producer")
    assert writer.direct[0][1].startswith("relay producer")
    # The second event, a second later: written directly too (the body idled on an empty
    # channel), or through the body; either way exactly once, after the first.
    assert [chunk for chunk, _ in writer.direct] + writer.written == [EVENT, EVENT]
    # Accounted like any write: the first event is the time to first token.
    assert body.account.ttft is not None and body.account.events_out == 2


async def test_no_stream_is_started_for_errors_whole_bodies_or_non_streaming_requests(
    autojump_clock: trio.abc.Clock,
) -> None:
    cases = [
        (True, 502, JSON_CONTENT_TYPE),  # an error before the first token
        (True, 200, JSON_CONTENT_TYPE),  # not an event stream
        (True, 429, SSE_CONTENT_TYPE),  # an event stream, but not a 200
        (False, 200, SSE_CONTENT_TYPE),  # the client did not ask for a stream
    ]
    for streaming, status, content_type in cases:
        calls: list[int] = []

        async def produce(sink: RelaySink, status: int = status, kind: str = content_type) -> None:
            sink.begin(status, kind)
            assert sink.offer(b"{}")

        body = body_for(produce, streaming=streaming)

        def start_stream(calls: list[int] = calls) -> None:
            calls.append(1)

        body.attach(Connection(start_stream))
        async with body:
            chunks = [chunk async for chunk in body]
        assert calls == [], (streaming, status, content_type)
        assert body.writer is None
        assert chunks == [b"{}"]  # through the channel, as always


async def test_a_declined_start_leaves_the_first_event_to_the_channel(
    autojump_clock: trio.abc.Clock,
) -> None:
    # start_stream returns None where the server frames bodies itself (HTTP/2...): the
    # body's task then sends the head itself, and the first event must wait for it.
    calls: list[int] = []

    async def produce(sink: RelaySink) -> None:
        sink.begin(200, SSE_CONTENT_TYPE)
        assert sink.offer(EVENT)

    body = body_for(produce)

    def start_stream() -> None:
        calls.append(1)

    body.attach(Connection(start_stream))
    async with body:
        assert body.writer is None
        assert body.buffered() == 1  # queued, not written
        chunks = [chunk async for chunk in body]
    assert calls == [1]
    assert chunks == [EVENT]
