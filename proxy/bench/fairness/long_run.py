"""The long run (``--long MINUTES``): one fake upstream and ONE Sluice in front of it, fair with
preemption (``LONG_BANDS``, ``preempt_after`` the bench's, every other ``[scheduling]``
setting Sluice's default), and the flood's mix for minutes: A's closed-loop flood in the batch
band, B's and C's short requests at a steady rate in A's band and in a more urgent one. At
each bucket's edge (a minute) the proxy's CPU time and RSS, Sluice's pauses and the machine's
load average are read; the figures are made from them and from the clients' records by
:mod:`proxy.bench.fairness.minutes`."""

from __future__ import annotations

import datetime
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from proxy.bench.children import git_commit
from proxy.bench.client import ProtocolError, http_get
from proxy.bench.fairness.load import (
    closed_loop,
    long_interactive_plan,
    request_bytes,
    send,
)
from proxy.bench.fairness.minutes import Sample, bucket_edges, loadavg
from proxy.bench.fairness.run import (
    LEAD,
    Bench,
    Proxy,
    pause_metrics,
    settle,
    start_fake,
    start_proxy,
    warm_up,
)
from proxy.bench.fairness.settings import LONG, FairnessSettings
from proxy.bench.fairness.stats import Request
from proxy.bench.procfs import (
    _raise_fd_limit,
    machine_info,
    process_cpu_seconds,
    process_rss,
    read_text_or_none,
)
from proxy.bench.report import show_progress


@dataclass
class LongRun:
    """The long run's requests and samples, and where its buckets lie."""

    settings: FairnessSettings
    requests: list[Request]
    samples: list[Sample]
    origin: float  # the load's start, time.monotonic()
    edges: list[float]  # the buckets' bounds, seconds from the origin
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    commit: str | None = None
    date: str = ""
    seconds: float = 0.0
    pids: dict[str, int] = field(default_factory=dict)  # the children (gone once it returns)


async def run_long_bench(settings: FairnessSettings, *, command: str = "") -> LongRun:
    machine = machine_info()
    _raise_fd_limit(4096)
    started = time.monotonic()
    pids: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-fairness-long-") as tmp:
        workdir = Path(tmp)
        async with trio.open_nursery() as nursery:
            fake, pids["fake_upstream"] = await start_fake(nursery, workdir, settings)
            upstream = f"http://{fake[0]}:{fake[1]}"
            proxy = await start_proxy(nursery, workdir, LONG, upstream, settings)
            pids[f"proxy_{LONG}"] = proxy.pid
            bench = Bench(settings, fake, {LONG: proxy})
            await warm_up(bench, LONG)
            requests, samples, origin, edges = await _load(bench, proxy)
            await settle(fake)
            await bench.collect(requests)
            nursery.cancel_scope.cancel()
    return LongRun(
        settings,
        requests,
        samples,
        origin,
        edges,
        machine=machine,
        command=command,
        commit=await git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        seconds=time.monotonic() - started,
        pids=pids,
    )


async def _load(
    bench: Bench, proxy: Proxy
) -> tuple[list[Request], list[Sample], float, list[float]]:
    """The load, from a short lead on, for ``long_seconds``; what is still running
    ``timeout`` seconds after its end is cut (and counted so)."""
    settings = bench.settings
    seconds = settings.long_seconds
    edges = bucket_edges(seconds, settings.bucket_seconds)
    interactive = long_interactive_plan(settings, LONG)
    data = [request_bytes(settings, r, proxy.address) for r in interactive]
    flood: list[Request] = []
    samples: list[Sample] = []
    t0 = trio.current_time() + LEAD
    # The clients stamp time.monotonic(); trio's clock has an offset of its own.
    origin = time.monotonic() + (t0 - trio.current_time())
    async with trio.open_nursery() as nursery:
        if settings.progress:
            counts = _progress_counts(flood, interactive, samples, len(edges))
            nursery.start_soon(show_progress, LONG, counts, sys.stderr)
        with trio.move_on_at(t0 + seconds + settings.timeout):
            async with trio.open_nursery() as clients:
                clients.start_soon(_sample_edges, proxy, [t0 + e for e in edges], samples)
                for request, raw in zip(interactive, data, strict=True):
                    start = partial(send, start_at=t0 + request.at)
                    clients.start_soon(start, proxy.address, raw, request)
                for worker in range(settings.long_flood_outstanding):
                    loop = partial(closed_loop, start_at=t0, until=t0 + seconds, out=flood)
                    clients.start_soon(loop, settings, proxy.address, f"{LONG}-A{worker}")
        nursery.cancel_scope.cancel()
    return [*flood, *interactive], samples, origin, edges


async def _sample_edges(proxy: Proxy, at: Sequence[float], out: list[Sample]) -> None:
    """A sample at each edge (trio clock), each appended as taken."""
    for edge, when in enumerate(at):
        await trio.sleep_until(when)
        out.append(await _sample(proxy, edge))


async def _sample(proxy: Proxy, edge: int) -> Sample:
    at = time.monotonic()
    cpu, rss = process_cpu_seconds(proxy.pid), process_rss(proxy.pid)
    preemptions = None
    try:
        status, body = await http_get(proxy.address, "/metrics")
    except (OSError, ProtocolError):
        pass  # unread: the bucket's pauses are n/a
    else:
        if status == 200:
            preemptions = pause_metrics(body.decode())["preemptions_total"]
    load = loadavg(read_text_or_none("/proc/loadavg") or "")
    return Sample(edge, at, cpu, rss, preemptions, load)


def _progress_counts(
    flood: list[Request], interactive: list[Request], samples: list[Sample], edges: int
) -> Callable[[], str]:
    def counts() -> str:
        sent = sum(r.sent is not None for r in interactive)
        ended = sum(r.ended_at is not None for r in interactive)
        bucket = min(max(len(samples), 1), edges - 1)
        return (
            f"bucket {bucket}/{edges - 1}  A sent {len(flood)}  B and C sent "
            f"{sent}/{len(interactive)}, ended {ended}"
        )

    return counts
