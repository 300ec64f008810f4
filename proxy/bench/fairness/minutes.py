"""The long run's figures (``--long``), bucket by bucket (a minute each): pure functions over
what the clients recorded (:class:`~proxy.bench.fairness.stats.Request`) and what was sampled
at each bucket's edge (:class:`Sample`), no I/O.

Every time here is ``time.monotonic()``; ``origin`` is the load's start on that clock, and
``edges`` are the buckets' bounds as offsets from it (``bucket_edges``). A request belongs to
the bucket it was *sent* in for its TTFT and its wait in Sluice's queue (what its client
asked for then), and to the bucket it *ended* in for what was completed (what the upstream
delivered then); one that ended after the load's end is in no bucket's throughput (the
backlog draining, counted apart).

The criterion, "flat from the first minute to the last": each interactive key's TTFT p99 in
the last bucket at most ``FLAT_SLACK`` times its p99 in the first.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from proxy.bench.fairness.stats import Request, outcome
from proxy.bench.summary import percentile

FLAT_SLACK: Final = 1.5
# A run whose length is a whole number of buckets, computed in floating point (0.1 minute is
# 6.000000000000001 s), must not get a last bucket of a femtosecond.
_EDGE_EPSILON: Final = 1e-6


def bucket_edges(seconds: float, bucket: float) -> list[float]:
    """The buckets' bounds over a load of ``seconds``: 0, ``bucket``, 2 x ``bucket``, ... and
    ``seconds`` (the last bucket shorter when ``bucket`` does not divide it)."""
    if seconds <= 0 or bucket <= 0:
        raise ValueError("a load and its buckets last more than 0 s")
    count = max(1, math.ceil(seconds / bucket - _EDGE_EPSILON))
    return [i * bucket for i in range(count)] + [seconds]


def bucket_of(offset: float, edges: Sequence[float]) -> int | None:
    """The bucket ``[edges[i], edges[i + 1])`` holding ``offset``; None outside them all."""
    if not edges or offset < edges[0] or offset >= edges[-1]:
        return None
    return bisect_right(edges, offset) - 1


@dataclass(frozen=True)
class Sample:
    """What was read at bucket edge ``edge`` (its index in ``edges``), at ``at``: the proxy's
    CPU seconds and RSS (its process tree's), Sluice's ``sluice_preemptions_total``, and the
    machine's 1-minute load average. None: it could not be read."""

    edge: int
    at: float
    cpu_s: float | None = None
    rss_bytes: int | None = None
    preemptions: float | None = None
    loadavg_1m: float | None = None


@dataclass(frozen=True)
class KeyBucket:
    """One key's requests sent in one bucket."""

    sent: int
    served: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    wait_p99_s: float | None  # send to the upstream's receipt: its wait in Sluice's queue


@dataclass(frozen=True)
class Bucket:
    index: int
    start_s: float  # offsets from the load's start
    end_s: float
    keys: dict[str, KeyBucket]
    completed: dict[str, int]  # requests served that ended in it, by key
    tokens: int  # their output tokens
    # Differences over the bucket of what was sampled at its two edges (None: unread), and
    # what was read at its end.
    cpu_s: float | None = None
    sampled_s: float | None = None  # the time between those two samples
    preemptions: float | None = None
    rss_bytes: int | None = None
    loadavg_1m: float | None = None

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def completed_total(self) -> int:
        return sum(self.completed.values())

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def cpu_share(self) -> float | None:
        """The proxy's CPU over the bucket, as a fraction of one core."""
        if self.cpu_s is None or not self.sampled_s:
            return None
        return self.cpu_s / self.sampled_s

    @property
    def cpu_ms_per_request(self) -> float | None:
        if self.cpu_s is None or not self.completed_total:
            return None
        return self.cpu_s / self.completed_total * 1000


def _key_bucket(requests: Sequence[Request]) -> KeyBucket:
    ttfts = [t for t in (r.ttft_s for r in requests) if t is not None]
    waits = [
        r.upstream_received - r.sent
        for r in requests
        if r.sent is not None and r.upstream_received is not None
    ]
    return KeyBucket(
        sent=len(requests),
        served=sum(r.ok for r in requests),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        wait_p99_s=percentile(waits, 99),
    )


def _change(start: Sample | None, end: Sample | None, name: str) -> float | None:
    """What ``name`` of the samples grew by from ``start`` to ``end`` (None: one is unread)."""
    if start is None or end is None:
        return None
    a, b = getattr(start, name), getattr(end, name)
    return None if a is None or b is None else float(b - a)


def buckets(
    requests: Iterable[Request],
    samples: Iterable[Sample],
    *,
    origin: float,
    edges: Sequence[float],
    keys: Sequence[str],
) -> list[Bucket]:
    """Every bucket's figures, each of ``keys`` in each (with no requests when it sent none)."""
    count = len(edges) - 1
    by_send: list[dict[str, list[Request]]] = [{key: [] for key in keys} for _ in range(count)]
    completed: list[dict[str, int]] = [dict.fromkeys(keys, 0) for _ in range(count)]
    tokens = [0] * count
    for request in requests:
        if request.sent is not None:
            i = bucket_of(request.sent - origin, edges)
            if i is not None and request.key in by_send[i]:
                by_send[i][request.key].append(request)
        if request.ok and request.ended_at is not None:
            i = bucket_of(request.ended_at - origin, edges)
            if i is not None:
                completed[i][request.key] = completed[i].get(request.key, 0) + 1
                tokens[i] += request.tokens_seen
    at_edge = {s.edge: s for s in samples}
    out = []
    for i in range(count):
        start, end = at_edge.get(i), at_edge.get(i + 1)
        out.append(
            Bucket(
                index=i,
                start_s=edges[i],
                end_s=edges[i + 1],
                keys={key: _key_bucket(by_send[i][key]) for key in keys},
                completed=completed[i],
                tokens=tokens[i],
                cpu_s=_change(start, end, "cpu_s"),
                sampled_s=_change(start, end, "at"),
                preemptions=_change(start, end, "preemptions"),
                rss_bytes=end.rss_bytes if end else None,
                loadavg_1m=end.loadavg_1m if end else None,
            )
        )
    return out


def ended_after(requests: Iterable[Request], origin: float, end_s: float) -> int:
    """Requests served that ended after the load's end (the backlog draining)."""
    return sum(r.ok and r.ended_at is not None and r.ended_at - origin >= end_s for r in requests)


def not_served(requests: Iterable[Request]) -> dict[str, dict[str, int]]:
    """Requests that did not end as planned, by key, then by what became of them."""
    out: dict[str, dict[str, int]] = {}
    for request in requests:
        kind = outcome(request)
        if kind != "served":
            mine = out.setdefault(request.key, {})
            mine[kind] = mine.get(kind, 0) + 1
    return out


@dataclass(frozen=True)
class FlatCheck:
    """A key's TTFT p99 in the last bucket against ``slack`` times its p99 in the first."""

    key: str
    first_p99_s: float | None
    last_p99_s: float | None
    slack: float = FLAT_SLACK

    @property
    def ratio(self) -> float | None:
        if self.first_p99_s is None or self.last_p99_s is None or self.first_p99_s <= 0:
            return None
        return self.last_p99_s / self.first_p99_s

    @property
    def passed(self) -> bool:
        ratio = self.ratio
        return ratio is not None and ratio <= self.slack


def flat_checks(
    figures: Sequence[Bucket], keys: Sequence[str], slack: float = FLAT_SLACK
) -> list[FlatCheck]:
    """For each of ``keys``, the first bucket's TTFT p99 against the last's (a run of one
    bucket compares nothing: no figure, no pass)."""
    if len(figures) < 2:
        return [FlatCheck(key, None, None, slack) for key in keys]
    first, last = figures[0], figures[-1]
    return [
        FlatCheck(key, first.keys[key].ttft_p99_s, last.keys[key].ttft_p99_s, slack) for key in keys
    ]


@dataclass
class LongFigures:
    """What the long run's report says: its buckets, the checks, and what went astray."""

    buckets: list[Bucket]
    checks: list[FlatCheck]
    drained: int  # served after the load's end
    errors: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks) and not self.errors


def long_figures(
    requests: Sequence[Request],
    samples: Sequence[Sample],
    *,
    origin: float,
    edges: Sequence[float],
    keys: Sequence[str],
    interactive: Sequence[str],
) -> LongFigures:
    figures = buckets(requests, samples, origin=origin, edges=edges, keys=keys)
    return LongFigures(
        buckets=figures,
        checks=flat_checks(figures, interactive),
        drained=ended_after(requests, origin, edges[-1]),
        errors=not_served(requests),
    )


def loadavg(text: str) -> float | None:
    """The 1-minute load average in ``/proc/loadavg``'s text."""
    try:
        return float(text.split()[0])
    except (IndexError, ValueError):
        return None
