"""One mode's raw material (every client's result, the fake's records, the costs read from
``/proc``) pooled over repeats, and the figures made of it: percentiles of connect, TTFT, gaps
and cancel propagation, wasted tokens, CPU per event, RSS."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from proxy.bench.client import StreamResult, classify
from proxy.bench.procfs import RssTrace
from proxy.bench.settings import Mode


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default).

    None for no values: a figure that could not be measured must not print as 0.
    """
    data = sorted(values)
    if not data:
        return None
    position = (len(data) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class RssStats:
    """One process's RSS over a run, from its samples, in bytes."""

    start: int
    peak: int
    end: int
    samples: int

    @property
    def growth(self) -> int:
        """How far above its level at the start the process went: what the run cost."""
        return self.peak - self.start


def rss_stats(samples: Sequence[tuple[float, int]]) -> RssStats | None:
    """First, largest and last of (time, bytes) samples in time order; None for none."""
    if not samples:
        return None
    sizes = [size for _, size in samples]
    return RssStats(start=sizes[0], peak=max(sizes), end=sizes[-1], samples=len(sizes))


def pooled_rss(traces: Sequence[RssTrace], process: str) -> RssStats | None:
    """Over repeats: the lowest start, the highest peak, the last end; the samples summed."""
    stats = [s for s in (rss_stats(trace.get(process, [])) for trace in traces) if s]
    if not stats:
        return None
    return RssStats(
        start=min(s.start for s in stats),
        peak=max(s.peak for s in stats),
        end=stats[-1].end,
        samples=sum(s.samples for s in stats),
    )


@dataclass
class RunData:
    """The raw material of one mode: every client's result and the upstream's records."""

    mode: Mode
    results: list[StreamResult]
    records: dict[str, dict[str, Any]]  # the fake's record per tag; empty: no fake to ask
    wall_s: float
    client_cpu_s: float
    proxy_cpu_s: float | None = None
    proxy_cpu_wait_s: float | None = None
    proxy_peak_rss: int | None = None
    upstream_cpu_s: float | None = None
    records_known: bool = True  # False: no fake upstream to match with (a --target alone)
    rss: list[RssTrace] = field(default_factory=list)  # one trace per pooled run
    # The upstream's seconds per token, to tell a fake held back by backpressure from one on
    # schedule; None: unknown (not ours, or pooled over different settings).
    interval: float | None = None


def merge_runs(runs: Sequence[RunData]) -> RunData:
    """Pool the repeats of one mode: percentiles over all streams, costs summed."""

    def total(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v for v in values if v)

    first = runs[0]
    records: dict[str, dict[str, Any]] = {}
    for run in runs:
        records.update(run.records)
    peaks = [run.proxy_peak_rss for run in runs if run.proxy_peak_rss is not None]
    return RunData(
        mode=first.mode,
        results=[result for run in runs for result in run.results],
        records=records,
        wall_s=sum(run.wall_s for run in runs),
        client_cpu_s=sum(run.client_cpu_s for run in runs),
        proxy_cpu_s=total([run.proxy_cpu_s for run in runs]),
        proxy_cpu_wait_s=total([run.proxy_cpu_wait_s for run in runs]),
        proxy_peak_rss=max(peaks) if peaks else None,
        upstream_cpu_s=total([run.upstream_cpu_s for run in runs]),
        records_known=all(run.records_known for run in runs),
        rss=[trace for run in runs for trace in run.rss],
        interval=first.interval if all(r.interval == first.interval for r in runs) else None,
    )


@dataclass
class RunSummary:
    """The figures of one mode. None: not measured here (not 0)."""

    streams: int
    completed: int  # non-dropping clients that got [DONE]
    dropped: int  # dropping clients that left as planned
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    events: int  # data events delivered to clients (tokens, role, finish, [DONE])
    tokens: int  # token events delivered
    events_per_s: float | None
    connect_p50_ms: float | None
    connect_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    cancel_p50_ms: float | None
    cancel_p99_ms: float | None
    cancel_max_ms: float | None
    cancel_unseen: int | None  # dropped, yet the upstream never saw its connection close
    cancel_unmatched: int | None  # dropped, and no upstream record of the request at all
    wasted_tokens_mean: float | None  # upstream tokens_sent - tokens the client received
    wasted_tokens_max: int | None
    wasted_tokens_total: int | None
    proxy_cpu_s: float | None
    proxy_cpu_wait_s: float | None  # runnable, waiting for a core: contention, not cost
    proxy_cpu_us_per_event: float | None
    # Everything the relay spent over the requests it relayed: a short request's cost.
    proxy_cpu_us_per_request: float | None
    proxy_peak_rss_mib: float | None
    upstream_cpu_us_per_event: float | None
    client_cpu_us_per_event: float | None
    # From the RSS samples: the proxy's RSS as the run began and how far it rose above that;
    # the fake's highest.
    proxy_rss_start_mib: float | None = None
    proxy_rss_growth_mib: float | None = None
    upstream_peak_rss_mib: float | None = None
    # Slow readers (None where the load has none).
    slow_streams: int | None = None
    slow_completed: int | None = None  # got [DONE], no error
    slow_read_p50_s: float | None = None  # request written to [DONE]
    slow_read_max_s: float | None = None
    # How much later than its own schedule the upstream finished a slow reader's answer:
    # ~0 when everything was buffered somewhere on the way, seconds when a full socket held
    # the upstream back (backpressure reached it).
    slow_upstream_held_min_s: float | None = None
    slow_upstream_held_p50_s: float | None = None
    slow_upstream_held_max_s: float | None = None
    # The same for every other stream that completed: what "on schedule" looks like here.
    other_upstream_held_p99_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _per_event_us(cpu_s: float | None, events: int) -> float | None:
    return None if cpu_s is None or not events else cpu_s * 1e6 / events


# The figures kept run by run as well as pooled: what alternating runs compare pair by pair.
ROUND_FIGURES: Final = ("proxy_cpu_us_per_event", "proxy_cpu_us_per_request")


def round_figures(run: RunData) -> dict[str, float | None]:
    """One run's CPU per event and per request (before pooling: one of its repeats)."""
    events = sum(result.events for result in run.results)
    return {
        "proxy_cpu_us_per_event": _per_event_us(run.proxy_cpu_s, events),
        "proxy_cpu_us_per_request": _per_event_us(run.proxy_cpu_s, len(run.results)),
    }


@dataclass
class Samples:
    """Every measured value of one run, before percentiles: what summaries and plots share.

    Latencies are seconds. ``cancels`` and ``wasted`` cover the dropped streams whose upstream
    record was found; ``held`` the slow readers whose upstream record says when it finished.
    """

    connects: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    cancels: list[float] = field(default_factory=list)
    wasted: list[int] = field(default_factory=list)
    slow_reads: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    other_held: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    dropped: int = 0
    unseen: int = 0
    unmatched: int = 0
    slow: int = 0
    slow_completed: int = 0


def upstream_held(record: dict[str, Any], interval: float) -> float | None:
    """Seconds the upstream finished an answer after its own schedule (first token, then one
    every ``interval``); None when the record lacks the times."""
    first, finished = record.get("first_token_at_mono"), record.get("finished_at_mono")
    tokens = int(record.get("tokens_sent", 0))
    if first is None or finished is None or tokens < 1:
        return None
    return float(finished) - float(first) - (tokens - 1) * interval


def collect_samples(run: RunData) -> Samples:
    out = Samples()
    for result in run.results:
        kind = classify(result)
        if kind is not None:
            out.kinds[kind] += 1
        if result.role == "slow":
            out.slow += 1
        if result.started is not None and result.connected is not None:
            out.connects.append(result.connected - result.started)
        if result.sent is not None and result.first_token is not None:
            out.ttfts.append(result.first_token - result.sent)
        out.gaps.extend(result.gaps)
        if kind is not None:
            continue
        record = run.records.get(result.tag)
        if result.role != "drop":
            out.completed += 1
            slow = result.role == "slow"
            if slow:
                out.slow_completed += 1
                if result.sent is not None and result.ended_at is not None:
                    out.slow_reads.append(result.ended_at - result.sent)
            if record is not None and run.interval is not None:
                held = upstream_held(record, run.interval)
                if held is not None:
                    (out.held if slow else out.other_held).append(held)
            continue
        out.dropped += 1
        assert result.closed_at is not None  # classify() said it left as planned
        if record is None:
            out.unmatched += 1
            continue
        seen = record.get("disconnected_at_mono")
        if seen is None:
            out.unseen += 1
        else:
            out.cancels.append(float(seen) - result.closed_at)
        out.wasted.append(int(record.get("tokens_sent", 0)) - result.content)
    return out


def _mib(size: int | None) -> float | None:
    return None if size is None else size / 2**20


def summarize(run: RunData) -> RunSummary:
    results = run.results
    samples = collect_samples(run)
    cancels, wasted, kinds = samples.cancels, samples.wasted, samples.kinds
    events = sum(result.events for result in results)
    known = run.records_known
    proxy_rss = pooled_rss(run.rss, "proxy")
    upstream_rss = pooled_rss(run.rss, "fake_upstream")
    slow = samples.slow or None
    return RunSummary(
        streams=len(results),
        completed=samples.completed,
        dropped=samples.dropped,
        errors=sum(kinds.values()),
        error_kinds=dict(kinds),
        wall_s=run.wall_s,
        events=events,
        tokens=sum(result.content for result in results),
        events_per_s=events / run.wall_s if run.wall_s > 0 else None,
        connect_p50_ms=_ms(percentile(samples.connects, 50)),
        connect_p99_ms=_ms(percentile(samples.connects, 99)),
        ttft_p50_ms=_ms(percentile(samples.ttfts, 50)),
        ttft_p99_ms=_ms(percentile(samples.ttfts, 99)),
        gap_p50_ms=_ms(percentile(samples.gaps, 50)),
        gap_p99_ms=_ms(percentile(samples.gaps, 99)),
        cancel_p50_ms=_ms(percentile(cancels, 50)),
        cancel_p99_ms=_ms(percentile(cancels, 99)),
        cancel_max_ms=_ms(max(cancels)) if cancels else None,
        cancel_unseen=samples.unseen if known else None,
        cancel_unmatched=samples.unmatched if known else None,
        wasted_tokens_mean=_mean(wasted),
        wasted_tokens_max=max(wasted) if wasted else None,
        wasted_tokens_total=sum(wasted) if wasted else None,
        proxy_cpu_s=run.proxy_cpu_s,
        proxy_cpu_wait_s=run.proxy_cpu_wait_s,
        proxy_cpu_us_per_event=_per_event_us(run.proxy_cpu_s, events),
        proxy_cpu_us_per_request=_per_event_us(run.proxy_cpu_s, len(results)),
        proxy_peak_rss_mib=_mib(run.proxy_peak_rss),
        upstream_cpu_us_per_event=_per_event_us(run.upstream_cpu_s, events),
        client_cpu_us_per_event=_per_event_us(run.client_cpu_s, events),
        proxy_rss_start_mib=_mib(proxy_rss.start) if proxy_rss else None,
        proxy_rss_growth_mib=_mib(proxy_rss.growth) if proxy_rss else None,
        upstream_peak_rss_mib=_mib(upstream_rss.peak) if upstream_rss else None,
        slow_streams=slow,
        slow_completed=samples.slow_completed if slow else None,
        slow_read_p50_s=percentile(samples.slow_reads, 50),
        slow_read_max_s=max(samples.slow_reads) if samples.slow_reads else None,
        slow_upstream_held_min_s=min(samples.held) if samples.held else None,
        slow_upstream_held_p50_s=percentile(samples.held, 50),
        slow_upstream_held_max_s=max(samples.held) if samples.held else None,
        other_upstream_held_p99_s=percentile(samples.other_held, 99),
    )
