"""The clock: one task that writes every due token of every stream, on each stream's schedule
(token ``i`` at ``start + i * interval``). A stream's own task only handles what can block.

This is where the fake's speed comes from (the package docstring says why it matters): a token
is one precomputed ``bytes`` object and one non-blocking ``os.write``, and a wake-up of the
clock sends the due tokens of all streams at once.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
from typing import Final

import trio

from proxy.testing.fake_upstream.recorder import Recorder, RequestRecord
from proxy.testing.fake_upstream.wire import Frames

# Tokens due within this window go out in one wake-up of the ticker: at most this late, and
# ~25 tokens per wake-up instead of one task switch each at 1000 streams x 50 tokens/s.
TICK: Final = 0.0005


class Job:
    """Tokens ``[0, stop)`` of one stream, on its schedule, handed to the ticker."""

    __slots__ = (
        "done",
        "fd",
        "frames",
        "i",
        "interval",
        "pending",
        "record",
        "recorder",
        "start",
        "stop",
        "stream",
        "withdrawn",
    )

    def __init__(
        self,
        stream: trio.abc.Stream,
        fd: int,
        record: RequestRecord,
        recorder: Recorder,
        frames: Frames,
        start: float,
        interval: float,
        stop: int,
    ) -> None:
        self.stream = stream
        # -1: not a socket the ticker may write to (TLS); every token goes through `stream`.
        self.fd = fd
        self.record = record
        self.recorder = recorder
        self.frames = frames
        self.start = start
        self.interval = interval
        self.stop = stop
        self.i = 0
        # Bytes the ticker could not write without blocking: the stream's own task sends them.
        self.pending = b""
        self.withdrawn = False
        self.done = trio.Event()

    def due(self) -> float:
        return self.start + self.i * self.interval

    def sent(self) -> None:
        self.i += 1
        self.recorder._token_sent(self.record)


class Ticker:
    """One task that writes every due token of every stream, so a token costs one write.

    A stream's own task would cost two scheduler round trips per token (its sleep and the
    checkpoint after ``send_all``); at 50,000 tokens/s that alone saturates a core. The ticker
    writes with a non-blocking ``os.write`` on the socket and hands a job back to its task
    for anything that could block (a full send buffer: backpressure) or fail (the task's
    ``send_all`` then raises ``BrokenResourceError`` as usual) or must be encrypted (TLS).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Job]] = []
        self._seq = itertools.count()
        self._lot = trio.lowlevel.ParkingLot()
        self._wake_at = -math.inf

    async def send_tokens(self, job: Job) -> None:
        """Send the job's tokens on schedule; return when all are sent."""
        try:
            while job.i < job.stop:
                job.done = trio.Event()
                self._push(job)
                await job.done.wait()
                if job.pending:
                    data, job.pending = job.pending, b""
                    await job.stream.send_all(data)
                    job.sent()
        finally:
            # The socket closes after this returns; the ticker must never write to its fd.
            job.withdrawn = True

    def _push(self, job: Job) -> None:
        due = job.due()
        heapq.heappush(self._heap, (due, next(self._seq), job))
        if due < self._wake_at and self._lot:
            self._lot.unpark_all()

    async def run(self) -> None:
        """Serve jobs until cancelled."""
        while True:
            self._flush(trio.current_time())
            self._wake_at = self._heap[0][0] if self._heap else math.inf
            with trio.move_on_at(self._wake_at + TICK):
                await self._lot.park()
            self._wake_at = -math.inf

    def _flush(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            job = heapq.heappop(heap)[2]
            if job.withdrawn:
                continue
            data = job.frames.token(job.i)
            fd = job.fd
            if fd < 0:
                # TLS: the bytes need encrypting, and only the stream's own task may do that.
                written = 0
            else:
                try:
                    written = os.write(fd, data)
                except OSError:
                    # A full buffer (BlockingIOError) or a dead peer: either way the job's task
                    # takes over, and meets the error, if any, through trio's own send path.
                    written = 0
            if written == len(data):
                job.sent()
                if job.i < job.stop:
                    heapq.heappush(heap, (job.due(), next(self._seq), job))
                    continue
            else:
                job.pending = data[written:]
            job.done.set()
