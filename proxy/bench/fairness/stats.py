"""The fairness bench's figures, made of what the clients and the fake saw: pure functions, no
I/O (each tested alone).

A request (:class:`Request`) carries its plan (its key, its answer's schedule, its deadlines),
what its client saw (``time.monotonic()``: when it was sent, its first token, each read's
tokens, its status and error code) and what the fake upstream recorded of it (when it arrived
there, its first token, when its connection closed). Every other figure is made from those:

* a key is *backlogged* while one of its requests waits in Sluice's queue: from its client's
  send to the fake's receipt of it (or to its refusal);
* a key's *service* is the scheduler's own measure: each request's input tokens (as Sluice
  estimates them) times ``w_in`` when it reaches the upstream, and each output token times
  ``w_out`` as its client receives it, divided by the key's weight;
* for two keys backlogged together over an interval, the service difference is what one
  received there minus what the other did; its largest size over every sub-interval of every
  interval where both were backlogged is what fair scheduling bounds (``vtc_bound``).
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Final

from proxy.bench.summary import percentile

# The target under A's flood: B's and C's TTFT p99 at most this many times A's request
# duration over the slots, plus their TTFT p99 with no flood.
TTFT_SLACK: Final = 1.5
# Fair may cost at most this much more proxy CPU per event than FIFO.
CPU_LIMIT: Final = 1.05
# Fair with preemption must complete at least this share of FIFO's throughput under the flood:
# a pause costs the stream's continuation a prefill upstream, and its slot an answer's start.
THROUGHPUT_FLOOR: Final = 0.95
# A request cancelled at its deadline while running: its upstream connection closed within
# this many seconds of the deadline, p99.
CANCEL_TARGET_S: Final = 0.010

Interval = tuple[float, float]


@dataclass(eq=False)
class Request:
    """One request of the load: its plan, what its client saw, what the fake recorded."""

    key: str
    kind: str
    tag: str
    at: float  # seconds after its phase began, when its client sends it
    tokens: int
    ttft: float
    interval: float
    input_tokens: int = 0  # as Sluice estimates them (what its scheduler charges)
    read_timeout: float | None = None  # x-stainless-read-timeout: the first byte's deadline
    deadline: float | None = None  # x-sluice-deadline: the whole answer's
    # What the client saw (time.monotonic()).
    sent: float | None = None
    status: int | None = None
    first_token: float | None = None
    ended_at: float | None = None
    events: int = 0
    tokens_seen: int = 0
    done: bool = False
    # (time, output tokens that read completed), one entry per read that completed any.
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    error_code: str | None = None  # a JSON error's code, or an in-band error event's
    error: str | None = None  # a socket or protocol failure, or "timeout"
    # What the fake saw (time.monotonic()); None: it never saw the request.
    upstream_received: float | None = None
    upstream_first_token: float | None = None
    upstream_finished: float | None = None
    upstream_closed: float | None = None  # the proxy's connection went before the answer's end
    upstream_queued_s: float | None = None  # waited in the fake's own queue (max_running)
    # The preemption phase's batch streams keep their answer's text, and count the ': paused'
    # comments their client was sent.
    keep_text: bool = False
    text: str = ""
    paused_comments: int = 0
    # How many requests the fake received for it: more than one when it was paused and
    # continued (the fields above are the last one's).
    upstream_records: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and not self.error_code

    @property
    def ttft_s(self) -> float | None:
        if self.sent is None or self.first_token is None:
            return None
        return self.first_token - self.sent

    @property
    def client_deadline(self) -> float | None:
        """When its client stops waiting: the earlier of its two deadlines after its send."""
        limits = [s for s in (self.read_timeout, self.deadline) if s is not None]
        if self.sent is None or not limits:
            return None
        return self.sent + min(limits)

    @property
    def left_queue(self) -> float | None:
        """When it stopped waiting in Sluice's queue: the fake got it, or it was answered
        (refused) without ever reaching the fake."""
        if self.upstream_received is not None:
            return self.upstream_received
        return self.ended_at

    def take_record(self, record: Mapping[str, Any]) -> None:
        """What the fake recorded of this request (its ``/_fake/requests`` entry)."""
        self.upstream_received = record.get("received_at_mono")
        self.upstream_first_token = record.get("first_token_at_mono")
        self.upstream_finished = record.get("finished_at_mono")
        self.upstream_closed = record.get("disconnected_at_mono")
        self.upstream_queued_s = record.get("queued_seconds")


# --------------------------------------------------------------------------- intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time (empty ones dropped)."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Where two sorted, disjoint interval lists overlap."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def backlogged(requests: Iterable[Request], key: str) -> list[Interval]:
    """When ``key`` had a request waiting in Sluice's queue."""
    spans = []
    for request in requests:
        left = request.left_queue
        if request.key == key and request.sent is not None and left is not None:
            spans.append((request.sent, left))
    return union(spans)


def total_seconds(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


# --------------------------------------------------------------------------- service


def service_events(
    requests: Iterable[Request], w_in: float, w_out: float, weights: Mapping[str, float]
) -> dict[str, list[tuple[float, float]]]:
    """Each key's service as (time, amount): input at the upstream's receipt, output as it
    reached the client, weighted as the scheduler weighs them."""
    out: dict[str, list[tuple[float, float]]] = {}
    for request in requests:
        weight = weights.get(request.key, 1.0)
        events = out.setdefault(request.key, [])
        if request.upstream_received is not None and request.input_tokens:
            events.append((request.upstream_received, w_in * request.input_tokens / weight))
        events += [(at, w_out * count / weight) for at, count in request.arrivals]
    for events in out.values():
        events.sort()
    return out


def max_service_difference(
    f: Sequence[tuple[float, float]],
    g: Sequence[tuple[float, float]],
    windows: Sequence[Interval],
) -> float:
    """The largest ``|W_f(t1, t2) - W_g(t1, t2)|`` over every ``[t1, t2)`` inside one of
    ``windows``, ``W(t1, t2)`` being the service with a time in ``[t1, t2)``. With ``D(t)`` the
    service difference before ``t``, that is the range of ``D`` over each window."""
    merged = sorted([*f, *((at, -amount) for at, amount in g)])
    times = [at for at, _ in merged]
    # before[i]: D just before event i, i.e. the sum of the first i events.
    before = [0.0, *accumulate(amount for _, amount in merged)]
    largest = 0.0
    for start, end in windows:
        first, last = bisect_left(times, start), bisect_left(times, end)
        values = before[first : last + 1]
        largest = max(largest, max(values) - min(values))
    return largest


def tokens_in(arrivals: Iterable[tuple[float, int]], windows: Sequence[Interval]) -> int:
    """Output tokens that arrived inside ``windows`` (sorted, disjoint)."""
    starts = [start for start, _ in windows]
    total = 0
    for at, count in arrivals:
        i = bisect_right(starts, at) - 1  # the last window starting at or before it
        if i >= 0 and at < windows[i][1]:
            total += count
    return total


@dataclass(frozen=True)
class PairFigure:
    """Two keys backlogged together: for how long, and their largest service difference."""

    keys: tuple[str, str]
    seconds: float
    max_difference: float
    bound: float

    @property
    def within(self) -> bool:
        return self.max_difference <= self.bound


def pair_figures(
    requests: Sequence[Request],
    keys: Sequence[str],
    *,
    w_in: float,
    w_out: float,
    weights: Mapping[str, float],
    bound: float,
) -> list[PairFigure]:
    """Every pair of ``keys``: the time both were backlogged, and the largest service
    difference over it (0 where they never were)."""
    events = service_events(requests, w_in, w_out, weights)
    windows = {key: backlogged(requests, key) for key in keys}
    out = []
    for i, f in enumerate(keys):
        for g in keys[i + 1 :]:
            both = intersect(windows[f], windows[g])
            difference = max_service_difference(events.get(f, []), events.get(g, []), both)
            out.append(PairFigure((f, g), total_seconds(both), difference, bound))
    return out


def batch_tokens(slots: int, longest_answer: int) -> int:
    """``M``, the most tokens one batch of this upstream holds: every slot running the
    longest answer of the load (the fake holds nothing else: no KV to share, no preemption)."""
    return slots * longest_answer


# --------------------------------------------------------------------------- per key


@dataclass(frozen=True)
class KeyFigures:
    key: str
    requests: int
    ok: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens: int
    backlogged_s: float
    tokens_backlogged: int
    # Its wait in Sluice's queue (send to the upstream's receipt), and the least wait any
    # order that preempts nothing could give it (next_slot_end).
    wait_p50_s: float | None = None
    wait_p99_s: float | None = None
    least_wait_p50_s: float | None = None
    least_wait_p99_s: float | None = None
    # Requests of another key (the flooder's) that reached the upstream while one of this
    # key's waited: slots given to them first.
    passed_by: int = 0


def key_figures(requests: Sequence[Request], key: str, passed_by: str = "") -> KeyFigures:
    """``key``'s figures in a phase's ``requests``; ``passed_by``: the key whose requests
    going first while one of ``key``'s waited are counted."""
    mine = [r for r in requests if r.key == key]
    ttfts = [t for t in (r.ttft_s for r in mine) if t is not None]
    windows = backlogged(mine, key)
    waits = [
        r.upstream_received - r.sent
        for r in mine
        if r.sent is not None and r.upstream_received is not None
    ]
    least = least_waits(requests, key)
    return KeyFigures(
        key=key,
        requests=len(mine),
        ok=sum(r.ok for r in mine),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tokens=sum(r.tokens_seen for r in mine),
        backlogged_s=total_seconds(windows),
        tokens_backlogged=sum(tokens_in(r.arrivals, windows) for r in mine),
        wait_p50_s=percentile(waits, 50),
        wait_p99_s=percentile(waits, 99),
        least_wait_p50_s=percentile(least, 50),
        least_wait_p99_s=percentile(least, 99),
        passed_by=dispatched_while_waiting(requests, key, passed_by) if passed_by else 0,
    )


# A request that reached the upstream this soon after its send found a slot free. Also how
# long after a send a request of another key may reach the upstream and still have been
# dispatched before this one was queued: the send to Sluice's queue (parsing, the key) and
# a dispatch to the fake's receipt (a pooled connection's write) take about a millisecond
# each here.
SLOT_FREE_S: Final = 0.005


def dispatched_while_waiting(requests: Sequence[Request], key: str, other: str) -> int:
    """How many of ``other``'s requests reached the upstream while one of ``key``'s waited
    for it (each counted once per request of ``key`` it went before), those within
    SLOT_FREE_S of its send excepted (dispatched, as likely as not, before it was queued)."""
    starts = sorted(
        r.upstream_received for r in requests if r.key == other and r.upstream_received is not None
    )
    total = 0
    for r in requests:
        left = r.left_queue
        if r.key == key and r.sent is not None and left is not None:
            after = bisect_right(starts, r.sent + SLOT_FREE_S)
            total += max(0, bisect_left(starts, left) - after)
    return total


def least_waits(requests: Sequence[Request], key: str) -> list[float]:
    """For each of ``key``'s requests that reached the upstream: 0 when it found a slot free
    (it got there within SLOT_FREE_S), else the time from its send to the first end of any
    answer upstream after it, when a slot next freed: no order that preempts nothing could
    have started it sooner."""
    ends = sorted(
        end for r in requests if (end := r.upstream_finished or r.upstream_closed) is not None
    )
    out = []
    for r in requests:
        if r.key != key or r.sent is None or r.upstream_received is None:
            continue
        if r.upstream_received - r.sent <= SLOT_FREE_S:
            out.append(0.0)
            continue
        i = bisect_right(ends, r.sent)
        if i < len(ends):
            out.append(min(ends[i], r.upstream_received) - r.sent)
    return out


def throughput(requests: Sequence[Request]) -> float | None:
    """Output tokens per second over the phase: every token, from the first send to the last
    answer's end."""
    sent = [r.sent for r in requests if r.sent is not None]
    ended = [r.ended_at for r in requests if r.ended_at is not None]
    if not sent or not ended or max(ended) <= min(sent):
        return None
    return sum(r.tokens_seen for r in requests) / (max(ended) - min(sent))


def running_seconds(requests: Iterable[Request], key: str) -> float | None:
    """The median time ``key``'s finished answers ran upstream (arrival to last byte)."""
    spans = [
        r.upstream_finished - r.upstream_received
        for r in requests
        if r.key == key and r.upstream_finished is not None and r.upstream_received is not None
    ]
    return percentile(spans, 50)


# --------------------------------------------------------------------------- the checks


@dataclass(frozen=True)
class TtftCheck:
    """Under A's flood, a key's TTFT p99 against ``1.5 x (A's duration / S)`` plus its TTFT
    p99 with no flood."""

    key: str
    flood_p99_s: float | None
    baseline_p99_s: float | None
    a_duration_s: float | None
    slots: int

    @property
    def limit_s(self) -> float | None:
        if self.baseline_p99_s is None or self.a_duration_s is None:
            return None
        return TTFT_SLACK * self.a_duration_s / self.slots + self.baseline_p99_s

    @property
    def passed(self) -> bool:
        limit = self.limit_s
        return limit is not None and self.flood_p99_s is not None and self.flood_p99_s <= limit


def cpu_ratio(fair: float | None, fifo: float | None) -> float | None:
    """Fair's proxy CPU per event over FIFO's."""
    if fair is None or fifo is None or fifo <= 0:
        return None
    return fair / fifo


def cpu_passed(ratio: float | None) -> bool:
    return ratio is not None and ratio <= CPU_LIMIT


@dataclass(frozen=True)
class DeadlineFigures:
    """The deadline phase: what was refused, what started late, and how soon a request
    cancelled at its deadline while running had its upstream connection closed."""

    requests: int
    served: int
    refused: int  # 503 deadline_unmeetable
    refused_at_once: int  # of those, answered within REFUSED_AT_ONCE_S of the send
    cancelled: int  # 504 deadline_exceeded, or deadline_exceeded in-band after the head
    cancelled_in_band: int
    # Never reached the upstream, yet answered 504 deadline_exceeded (its deadline passed
    # while it waited in the queue) rather than refused with 503 deadline_unmeetable.
    expired_queued: int
    other: dict[str, int]  # any other outcome, by kind
    reached_upstream: int
    started_late: int  # the fake received it after its client's deadline
    least_margin_s: float | None  # the smallest (deadline - upstream receipt) of those started
    close_after_deadline_s: list[float]  # deadline -> the fake saw the connection close
    close_unseen: int  # cancelled, yet the fake never saw its connection close

    @property
    def close_p50_s(self) -> float | None:
        return percentile(self.close_after_deadline_s, 50)

    @property
    def close_p99_s(self) -> float | None:
        return percentile(self.close_after_deadline_s, 99)

    @property
    def passed(self) -> bool:
        p99 = self.close_p99_s
        return (
            self.started_late == 0
            and self.expired_queued == 0
            and not self.other
            and self.close_unseen == 0
            and (p99 is None or p99 <= CANCEL_TARGET_S)
        )


# A refusal this soon after the send was decided on arrival, not after a wait in the queue.
REFUSED_AT_ONCE_S: Final = 0.05


def outcome(request: Request) -> str:
    """What became of a deadline-bearing request: served, refused, cancelled (while running),
    expired (while queued), or otherwise."""
    if request.error is not None:
        return request.error
    if request.status == 503 and request.error_code == "deadline_unmeetable":
        return "refused"
    if request.error_code == "deadline_exceeded" and request.status in (200, 504):
        return "cancelled" if request.upstream_received is not None else "expired"
    if request.ok:
        return "served"
    return f"HTTP {request.status} {request.error_code or ''}".strip()


def deadline_figures(requests: Sequence[Request]) -> DeadlineFigures:
    outcomes = [outcome(r) for r in requests]
    other: dict[str, int] = {}
    for kind in outcomes:
        if kind not in ("served", "refused", "cancelled", "expired"):
            other[kind] = other.get(kind, 0) + 1
    margins, closes = [], []
    late = unseen = 0
    for request, kind in zip(requests, outcomes, strict=True):
        deadline = request.client_deadline
        if deadline is None:
            continue
        if request.upstream_received is not None:
            margins.append(deadline - request.upstream_received)
            late += request.upstream_received > deadline
        if kind == "cancelled":
            if request.upstream_closed is None:
                unseen += 1
            else:
                closes.append(request.upstream_closed - deadline)
    refused = [r for r, kind in zip(requests, outcomes, strict=True) if kind == "refused"]
    return DeadlineFigures(
        requests=len(requests),
        served=outcomes.count("served"),
        refused=len(refused),
        refused_at_once=sum(
            r.ended_at is not None
            and r.sent is not None
            and r.ended_at - r.sent <= REFUSED_AT_ONCE_S
            for r in refused
        ),
        cancelled=outcomes.count("cancelled"),
        cancelled_in_band=sum(
            kind == "cancelled" and r.status == 200
            for r, kind in zip(requests, outcomes, strict=True)
        ),
        expired_queued=outcomes.count("expired"),
        other=other,
        reached_upstream=sum(r.upstream_received is not None for r in requests),
        started_late=late,
        least_margin_s=min(margins) if margins else None,
        close_after_deadline_s=sorted(closes),
        close_unseen=unseen,
    )


# --------------------------------------------------------------------------- preemption

_PAUSED = b": paused"


def stream_text(body: bytes) -> tuple[str, int]:
    """A chat stream's text (its content deltas, in order) and its ``: paused`` comments."""
    text = []
    paused = 0
    for block in body.split(b"\n\n"):
        if block.startswith(_PAUSED):
            paused += 1
        if not block.startswith(b"data:"):
            continue
        data = block[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            continue
        for choice in event.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if isinstance(content, str):
                text.append(content)
    return "".join(text), paused


@dataclass(frozen=True)
class BatchFigures:
    """The batch streams of one variant, pooled over rounds."""

    streams: int
    whole: int  # completed with the text an uninterrupted answer has
    paused_seen: int  # of those, paused (their client saw ': paused')
    makespan_s: float | None  # first send to last end, the mean over rounds
    mean_s: float | None  # send to end, the mean over every stream

    @property
    def passed(self) -> bool:
        return self.streams > 0 and self.whole == self.streams


def makespan(requests: Sequence[Request]) -> float | None:
    """From the first one's send to the last one's end."""
    sent = [r.sent for r in requests if r.sent is not None]
    ended = [r.ended_at for r in requests if r.ended_at is not None]
    if not sent or not ended:
        return None
    return max(ended) - min(sent)


def batch_figures(rounds: Sequence[Sequence[Request]], expected: str) -> BatchFigures:
    """``rounds``: each round's batch streams; ``expected``: an uninterrupted answer's text."""
    every = [r for requests in rounds for r in requests]
    spans = [m for m in (makespan(requests) for requests in rounds) if m is not None]
    durations = [
        r.ended_at - r.sent for r in every if r.sent is not None and r.ended_at is not None
    ]
    return BatchFigures(
        streams=len(every),
        whole=sum(r.ok and r.text == expected for r in every),
        paused_seen=sum(r.paused_comments > 0 for r in every),
        makespan_s=sum(spans) / len(spans) if spans else None,
        mean_s=sum(durations) / len(durations) if durations else None,
    )


@dataclass(frozen=True)
class PreemptCheck:
    """With preemption, an interactive key's TTFT p99 while another holds every slot, against
    ``preempt_after`` plus twice its TTFT p99 on an idle upstream: its wait for the pause, then
    an answer as if alone (twice: the pause and the slot's hand-over cost about a TTFT of their
    own). The holder is a less urgent band's (the preemption phase) or, within one band, a
    flooding key's (``key`` names the interactive one there)."""

    p99_s: float | None
    idle_p99_s: float | None
    preempt_after: float
    key: str = ""

    @property
    def limit_s(self) -> float | None:
        if self.idle_p99_s is None:
            return None
        return self.preempt_after + 2 * self.idle_p99_s

    @property
    def passed(self) -> bool:
        limit = self.limit_s
        return limit is not None and self.p99_s is not None and self.p99_s <= limit


@dataclass(frozen=True)
class ThroughputCheck:
    """Under the flood, fair with preemption's throughput over FIFO's, at least
    ``THROUGHPUT_FLOOR``."""

    fair: float | None
    fifo: float | None

    @property
    def ratio(self) -> float | None:
        if self.fair is None or self.fifo is None or self.fifo <= 0:
            return None
        return self.fair / self.fifo

    @property
    def passed(self) -> bool:
        ratio = self.ratio
        return ratio is not None and ratio >= THROUGHPUT_FLOOR
