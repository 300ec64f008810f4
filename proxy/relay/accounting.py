"""What a relayed request is reported with when it ends: the access line and the metrics.

A :class:`RelayAccount` is kept by the relay while the response goes out (once per write,
not per event) and read once at close, by the tracker (metrics) and the access record.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

import trio

from proxy.ops.metrics import GAP_BUCKETS
from proxy.relay.state import Phase

# Upper bounds of the write-gap buckets (Metrics.token_gaps); the last count is +Inf.
GAP_BOUNDS = tuple(float(bound) for bound in GAP_BUCKETS)


class RelayAccount:
    """One request's accounting: where it was when it ended, its timings, what it wrote.

    Of a streamed (200, text/event-stream) response: when the relay started, the time to its
    first write, the gaps between writes (counts per bucket of GAP_BOUNDS), and the SSE data
    events written. Of a cancelled one: how long its work took to stop, and what was produced
    for the client but never handed to its socket."""

    __slots__ = (
        "_last_write",
        "_now",
        "cancel_seconds",
        "events_out",
        "gap_counts",
        "gone_at",
        "phase",
        "started_at",
        "ttft",
        "undelivered",
    )

    def __init__(self) -> None:
        # Where the request was when it ended; producers advance it (a plain attribute: no
        # cost on the hot path), the relay sets MID_STREAM and AFTER_LAST.
        self.phase = Phase.QUEUED
        self._now: Callable[[], float] = trio.current_time
        self.started_at = 0.0
        self.ttft: float | None = None
        self.gap_counts = [0] * (len(GAP_BOUNDS) + 1)
        self.events_out = 0
        self._last_write: float | None = None
        # When the client was seen to leave (RelayBody.client_disconnected).
        self.gone_at: float | None = None
        # Filled in for a cancelled request: disconnect -> work gone, and what was produced
        # for the client but never handed to its socket.
        self.cancel_seconds: float | None = None
        self.undelivered = 0

    def start(self) -> None:
        """The relay starts (RelayBody.__aenter__): the clock every write is timed with."""
        # trio.current_time() without its run-context lookup (a third of its cost) per write.
        self._now = trio.lowlevel.current_clock().current_time
        self.started_at = self._now()

    def wrote(self, chunk: bytes) -> None:
        """Per write, not per event (a coalesced burst is one write, one gap): a clock read,
        a bisect on a 13-tuple and a byte scan in C; the metrics take it in at close."""
        now = self._now()
        last = self._last_write
        self._last_write = now
        if last is None:
            self.ttft = now - self.started_at
            if self.phase is not Phase.AFTER_LAST:
                self.phase = Phase.MID_STREAM
        else:
            self.gap_counts[bisect_left(GAP_BOUNDS, now - last)] += 1
        # Events start at the chunk's start or right after a newline, and a JSON payload
        # holds no raw newline: this counts data lines, never token text. [DONE] ends the
        # last write of a stream.
        self.events_out += (
            chunk.count(b"\ndata:") + chunk.startswith(b"data:") - chunk.endswith(b"[DONE]\n\n")
        )

    def handed(self) -> None:
        """A chunk of a body that is not SSE events went out: it is mid-stream too."""
        if self.phase is not Phase.AFTER_LAST:
            self.phase = Phase.MID_STREAM

    @property
    def gap_sum(self) -> float:
        """The sum of the gaps between writes: from the first write to the last."""
        if self.ttft is None or self._last_write is None:
            return 0.0
        return self._last_write - (self.started_at + self.ttft)
