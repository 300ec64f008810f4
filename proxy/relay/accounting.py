"""What a relayed request is reported with when it ends: the access line and the metrics.

A :class:`RelayAccount` is kept by the relay while the response goes out (once per write,
not per event) and read once at close, by the tracker (metrics) and the access record.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Callable, Sequence

import trio

from proxy.ops.metrics import GAP_BUCKETS
from proxy.relay.state import Phase

# Upper bounds of the write-gap buckets (Metrics.token_gaps); the last count is +Inf.
GAP_BOUNDS = tuple(float(bound) for bound in GAP_BUCKETS)
# What a traced request keeps of its body at most (see RelayAccount.kept); past it, nothing.
MAX_KEPT_BYTES = 8 * 1024 * 1024


class RelayAccount:
    """One request's accounting: where it was when it ended, its timings, what it wrote.

    Of a streamed (200, text/event-stream) response: when the relay started, the time to its
    first write, the gaps between writes (counts per bucket of GAP_BOUNDS), the SSE data
    events written, and its first and last three writes (where every shape puts the answer's id,
    model, finish reason and usage: the trace reads them at close). Of a cancelled one: how
    long its work took to stop, and what was produced for the client but never handed to its
    socket."""

    __slots__ = (
        "_kept_bytes",
        "_last_write",
        "_now",
        "before_last",
        "cancel_seconds",
        "events_out",
        "first",
        "gap_counts",
        "gone_at",
        "kept",
        "last",
        "opening",
        "phase",
        "started_at",
        "third_last",
        "ttft",
        "undelivered",
        "unsent",
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
        # The chunks themselves (at most the channel's capacity), for their tokens' count.
        self.unsent: Sequence[bytes] = ()
        self.first = self.third_last = self.before_last = self.last = b""
        # What a write holds when it holds a token, for the endpoint's stream (see
        # protocol.sse.FIRST_TOKEN); None: every write does.
        self.opening: re.Pattern[bytes] | None = None
        # Every write, for a traced request's trace to read at close: a whole (non-streamed)
        # answer, or a stream whose text is captured. None: not kept (the common case).
        self.kept: list[bytes] | None = None
        self._kept_bytes = 0

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
        if last is not None:
            self._last_write = now
            self.gap_counts[bisect_left(GAP_BOUNDS, now - last)] += 1
        else:
            if not self.first:
                self.first = chunk
            opening = self.opening
            # Until the first token, a write of the answer's opening only (a chat role delta,
            # Responses' response.created) is no first token: the time to it is not a TTFT,
            # nor has the stream reached its middle.
            if opening is None or opening.search(chunk) is not None:
                self._last_write = now
                self.ttft = now - self.started_at
                if self.phase is not Phase.AFTER_LAST:
                    self.phase = Phase.MID_STREAM
        self.third_last = self.before_last
        self.before_last = self.last
        self.last = chunk
        if self.kept is not None:
            self.keep(chunk)
        # Events start at the chunk's start or right after a newline, and a JSON payload
        # holds no raw newline: this counts data lines, never token text. [DONE] ends the
        # last write of a stream.
        self.events_out += (
            chunk.count(b"\ndata:") + chunk.startswith(b"data:") - chunk.endswith(b"[DONE]\n\n")
        )

    def handed(self, chunk: bytes) -> None:
        """A chunk of a body that is not SSE events went out: it is mid-stream too."""
        if self.phase is not Phase.AFTER_LAST:
            self.phase = Phase.MID_STREAM
        if self.kept is not None:
            self.keep(chunk)

    def keep(self, chunk: bytes) -> None:
        """Keep ``chunk`` for the trace, within MAX_KEPT_BYTES (past it, none of the body: a
        part of a JSON body says nothing)."""
        kept = self.kept
        assert kept is not None
        self._kept_bytes += len(chunk)
        if self._kept_bytes > MAX_KEPT_BYTES:
            self.kept = None
            return
        kept.append(chunk)

    @property
    def gap_sum(self) -> float:
        """The sum of the gaps between writes: from the first write to the last."""
        if self.ttft is None or self._last_write is None:
            return 0.0
        return self._last_write - (self.started_at + self.ttft)
