"""One fairness bench: the fake upstream and the Sluice processes (one FIFO and one fair for the
flood and deadline phases; two fair ones, preemption off and on, for the preemption phase)
started once, then every phase run through each of its pair in turn, alternating, measured
from the clients, from ``/proc``, from the fake's records and from Sluice's own metrics and
access lines."""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import trio

from proxy.bench.children import free_port, git_commit, supervise, wait_ready
from proxy.bench.client import http_get
from proxy.bench.fairness.load import (
    api_key,
    baseline_plan,
    flood_plan,
    idle_plan,
    preempt_plan,
    queued_deadline_plan,
    request_bytes,
    running_deadline_waves,
    send,
)
from proxy.bench.fairness.settings import (
    BATCH,
    KEYS,
    LONG,
    LONG_BANDS,
    POLICIES,
    PREEMPT_BANDS,
    PREEMPT_VARIANTS,
    FairnessSettings,
)
from proxy.bench.fairness.stats import Request
from proxy.bench.procfs import _raise_fd_limit, machine_info, process_cpu_seconds
from proxy.bench.report import show_progress, write_text
from proxy.bench.settings import BenchError

PHASES: Final = ("baseline", "flood", "deadline")
# The preemption phase, through PREEMPT_VARIANTS' processes rather than POLICIES'.
PREEMPT: Final = "preempt"
# How long the fake may take to be idle again after a phase (its last answers, the closes it
# has yet to notice), and how often it is asked.
SETTLE_SECONDS: Final = 15.0
SETTLE_POLL: Final = 0.05
# A short lead before a phase's first request, so that creating its tasks is not its load.
LEAD: Final = 0.1
_GAUGE: Final = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} (\S+)$", re.M)
_QUEUE_COUNT: Final = re.compile(r"^sluice_queue_wait_seconds_count\{([^}]*)\} (\S+)$", re.M)
_PAUSES: Final = re.compile(
    r"^sluice_(preemptions_total|pause_seconds_count|pause_seconds_sum)\{[^}]*\} (\S+)$", re.M
)


@dataclass
class Phase:
    """One phase through one policy's proxy: its requests, and what it cost the proxy."""

    name: str
    policy: str
    round: int
    requests: list[Request]
    seconds: float = 0.0
    proxy_cpu_s: float | None = None
    # What Sluice itself counted: requests that left its queue during the phase, by outcome
    # (its sluice_queue_wait_seconds histogram's counts).
    queue_outcomes: dict[str, float] = field(default_factory=dict)
    # The preemption phase: Sluice's sluice_preemptions_total and sluice_pause_seconds (count,
    # sum) over the phase, and each batch stream's access line (pauses, paused_s).
    pause_metrics: dict[str, float] = field(default_factory=dict)
    access_pauses: list[tuple[int, float]] = field(default_factory=list)

    @property
    def events(self) -> int:
        return sum(r.events for r in self.requests)

    @property
    def cpu_us_per_event(self) -> float | None:
        if self.proxy_cpu_s is None or not self.events:
            return None
        return self.proxy_cpu_s / self.events * 1e6


@dataclass
class Proxy:
    policy: str
    address: tuple[str, int]
    pid: int
    log: Path


def proxy_keys(policy: str) -> dict[str, int]:
    """The keys a process knows, each with its ``priority`` (band)."""
    if policy in PREEMPT_VARIANTS:
        return dict(PREEMPT_BANDS)
    if policy == LONG:
        return dict(LONG_BANDS)
    return dict.fromkeys(KEYS, 0)


def proxy_config(port: int, upstream: str, policy: str, settings: FairnessSettings) -> str:
    """A Sluice in front of the fake: its replica's concurrency the fake's, and a queue deep
    and patient enough that FIFO's backlog is served rather than refused (the comparison is
    of the order, not of the limits); the three keys, each weight 1. ``policy`` is also one of
    PREEMPT_VARIANTS: fair, the batch and interactive keys in their bands, and preempt_after
    the bench's (on) or 0 (off), all else the same; or LONG: fair, LONG_BANDS, the bench's
    preempt_after, every other [scheduling] setting Sluice's default. The fair process of the
    FIFO/fair comparison also sets ``preempt_after`` when the bench has ``fair_preempt_after``
    (its keys all in band 0: a pause it makes is within the band)."""
    keys = "".join(
        "[[keys]]\n"
        f'name = "{key}"\n'
        f'sha256 = "{hashlib.sha256(api_key(key).encode()).hexdigest()}"\n'
        + (f"priority = {band}\n" if band else "")
        + "\n"
        for key, band in proxy_keys(policy).items()
    )
    scheduling = f"policy = {json.dumps(policy)}\n"
    if policy in PREEMPT_VARIANTS:
        after = settings.preempt_after if policy == "preempt-on" else 0.0
        scheduling = (
            'policy = "fair"\n'
            f"preempt_after = {after!r}\n"
            f"max_preemptions = {settings.max_preemptions}\n"
        )
    elif policy == LONG:
        scheduling = f'policy = "fair"\npreempt_after = {settings.preempt_after!r}\n'
    elif policy == "fair" and settings.fair_preempt_after is not None:
        scheduling += f"preempt_after = {settings.fair_preempt_after!r}\n"
    return keys + (
        "# Written by proxy.bench (fairness) for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        f"max_connections = {settings.slots}\n"
        "max_queue = 4096\n"
        "queue_timeout = 600.0\n"
        'proxy = "none"\n\n'
        "[scheduling]\n"
        f"{scheduling}\n"
        f"[models.{json.dumps(settings.model)}]\n"
        f"upstreams = [{json.dumps(upstream)}]\n"
    )


def fake_argv(port: int, settings: FairnessSettings) -> list[str]:
    return [
        sys.executable, "-m", "proxy.cli", "fake-upstream", "--host", "127.0.0.1",
        "--port", str(port), "--model", settings.model, "--ttft", str(settings.ttft),
        "--interval", str(settings.interval), "--tokens", str(settings.short_tokens),
        "--max-running", str(settings.slots),
    ]  # fmt: skip


def schedule(repeat: int) -> list[tuple[int, str, str]]:
    """(round, phase, process) in the order they run: each phase through both policies, FIFO
    first in even rounds and fair first in odd ones; then the preemption phase through both
    of its processes, preemption off first in even rounds and on first in odd ones."""
    out = []
    for round_ in range(repeat):
        flip = round_ % 2 == 1
        order = tuple(reversed(POLICIES)) if flip else POLICIES
        out += [(round_, phase, policy) for phase in PHASES for policy in order]
        variants = tuple(reversed(PREEMPT_VARIANTS)) if flip else PREEMPT_VARIANTS
        out += [(round_, PREEMPT, variant) for variant in variants]
    return out


# --------------------------------------------------------------------------- the fake


def fake_idle(metrics: str) -> bool:
    """Whether the fake's /metrics says nothing runs and nothing waits."""
    gauges = {name: float(value) for name, value in _GAUGE.findall(metrics)}
    return gauges.get("running", 1.0) == 0 and gauges.get("waiting", 1.0) == 0


async def settle(fake: tuple[str, int]) -> None:
    """Until the fake is idle (bounded: a fake that never is fails the bench)."""
    with trio.move_on_after(SETTLE_SECONDS):
        while True:
            status, body = await http_get(fake, "/metrics")
            if status == 200 and fake_idle(body.decode()):
                return
            await trio.sleep(SETTLE_POLL)
    raise BenchError(f"the fake upstream was still busy {SETTLE_SECONDS:g} s after a phase")


async def _records(fake: tuple[str, int], since: int) -> tuple[list[dict[str, Any]], int]:
    status, body = await http_get(fake, f"/_fake/requests?since={since}")
    if status != 200:
        raise BenchError(f"fake upstream answered {status} to /_fake/requests")
    records = json.loads(body)
    cursor = max((int(r["id"]) + 1 for r in records), default=since)
    return records, cursor


def match_records(requests: Sequence[Request], records: Sequence[dict[str, Any]]) -> int:
    """Give each request the fake's record of it (by its tag, the body's ``user``); the
    number of records still pending. A request paused and continued has several: it keeps
    the last one's times, and their count."""
    by_tag = {r.tag: r for r in requests}
    for each in requests:
        each.upstream_records = 0
    pending = 0
    for record in records:
        body = record.get("body")
        tag = body.get("user") if isinstance(body, dict) else None
        request = by_tag.get(tag) if isinstance(tag, str) else None
        if request is not None:
            request.take_record(record)
            request.upstream_records += 1
            pending += record.get("outcome") == "pending"
    return pending


def queue_outcomes(metrics: str) -> dict[str, float]:
    """Sluice's sluice_queue_wait_seconds counts, summed by outcome."""
    out: dict[str, float] = {}
    for labels, value in _QUEUE_COUNT.findall(metrics):
        found = re.search(r'outcome="([^"]*)"', labels)
        if found:
            out[found[1]] = out.get(found[1], 0.0) + float(value)
    return out


def pause_metrics(metrics: str) -> dict[str, float]:
    """Sluice's sluice_preemptions_total and sluice_pause_seconds count and sum, summed over
    their labels (absent: none yet)."""
    out = dict.fromkeys(("preemptions_total", "pause_seconds_count", "pause_seconds_sum"), 0.0)
    for name, value in _PAUSES.findall(metrics):
        out[name] += float(value)
    return out


def access_pauses(log: str, key: str) -> list[tuple[int, float]]:
    """(pauses, paused_s) of each of ``key``'s access lines in a Sluice process's output."""
    out = []
    for line in log.splitlines():
        if not line.startswith("{"):
            continue
        try:
            fields = json.loads(line)
        except ValueError:
            continue
        if isinstance(fields, dict) and fields.get("key") == key and "pauses" in fields:
            out.append((int(fields["pauses"]), float(fields["paused_s"])))
    return out


# --------------------------------------------------------------------------- one phase


class Bench:
    """The systems, started; runs one phase at a time and keeps the fake's cursor."""

    def __init__(
        self, settings: FairnessSettings, fake: tuple[str, int], proxies: dict[str, Proxy]
    ) -> None:
        self.settings = settings
        self.fake = fake
        self.proxies = proxies
        self.cursor = 0

    async def phase(self, name: str, policy: str, round_: int) -> Phase:
        settings, proxy = self.settings, self.proxies[policy]
        label = f"r{round_}-{name}-{policy}"
        metrics = (await http_get(proxy.address, "/metrics"))[1].decode()
        before, paused_before = queue_outcomes(metrics), pause_metrics(metrics)
        log_offset = (await trio.Path(proxy.log).stat()).st_size
        cpu0 = process_cpu_seconds(proxy.pid)
        started = time.monotonic()
        if name == "baseline":
            requests = baseline_plan(settings, label)
            await self.run(proxy, requests, label)
        elif name == "flood":
            requests = flood_plan(settings, label)
            await self.run(proxy, requests, label)
        elif name == PREEMPT:
            requests = idle_plan(settings, label)
            await self.run(proxy, requests, label + "-idle")
            await settle(self.fake)
            loaded = preempt_plan(settings, label)
            await self.run(proxy, loaded, label)
            requests += loaded
        else:
            requests = queued_deadline_plan(settings, label)
            await self.run(proxy, requests, label + "-queued")
            for n, wave in enumerate(running_deadline_waves(settings, label)):
                await settle(self.fake)
                await self.run(proxy, wave, f"{label}-running{n}")
                requests += wave
        seconds = time.monotonic() - started
        cpu1 = process_cpu_seconds(proxy.pid)
        await settle(self.fake)
        metrics = (await http_get(proxy.address, "/metrics"))[1].decode()
        after, paused_after = queue_outcomes(metrics), pause_metrics(metrics)
        await self.collect(requests)
        async with await trio.open_file(proxy.log, "rb") as log:
            await log.seek(log_offset)
            written = (await log.read()).decode(errors="replace")
        return Phase(
            name,
            policy,
            round_,
            requests,
            seconds=seconds,
            proxy_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            queue_outcomes={k: v - before.get(k, 0.0) for k, v in after.items()},
            pause_metrics={k: v - paused_before[k] for k, v in paused_after.items()},
            access_pauses=access_pauses(written, BATCH) if name == PREEMPT else [],
        )

    async def run(self, proxy: Proxy, requests: list[Request], label: str) -> None:
        """Each request at its time (from a short lead on), all cut at the phase's timeout."""
        t0 = trio.current_time() + LEAD
        data = [request_bytes(self.settings, r, proxy.address) for r in requests]
        last = max((r.at for r in requests), default=0.0)
        async with trio.open_nursery() as nursery:
            if self.settings.progress:
                nursery.start_soon(show_progress, label, _progress_counts(requests), sys.stderr)
            with trio.move_on_at(t0 + last + self.settings.timeout):
                async with trio.open_nursery() as clients:
                    for request, raw in zip(requests, data, strict=True):
                        start = partial(send, start_at=t0 + request.at)
                        clients.start_soon(start, proxy.address, raw, request)
            nursery.cancel_scope.cancel()

    async def collect(self, requests: list[Request]) -> None:
        """The fake's records of the phase's requests, once none is pending (bounded: what
        is pending then stays so in the figures)."""
        since = self.cursor
        with trio.move_on_after(SETTLE_SECONDS):
            while True:
                records, self.cursor = await _records(self.fake, since)
                if not match_records(requests, records):
                    return
                await trio.sleep(SETTLE_POLL)


def _progress_counts(requests: list[Request]) -> Callable[[], str]:
    def counts() -> str:
        sent = sum(r.sent is not None for r in requests)
        ended = sum(r.ended_at is not None for r in requests)
        return f"sent {sent}/{len(requests)}  ended {ended}"

    return counts


# --------------------------------------------------------------------------- the bench


@dataclass
class FairnessRun:
    """Every phase of one bench, in the order they ran, and what the report says of it."""

    settings: FairnessSettings
    phases: list[Phase]
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    commit: str | None = None
    date: str = ""
    seconds: float = 0.0
    pids: dict[str, int] = field(default_factory=dict)  # the children (gone once it returns)


async def run_fairness_bench(settings: FairnessSettings, *, command: str = "") -> FairnessRun:
    machine = machine_info()
    _raise_fd_limit(4096)
    started = time.monotonic()
    phases: list[Phase] = []
    pids: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-fairness-") as tmp:
        workdir = Path(tmp)
        async with trio.open_nursery() as nursery:
            fake, pids["fake_upstream"] = await start_fake(nursery, workdir, settings)
            proxies = {}
            for policy in (*POLICIES, *PREEMPT_VARIANTS):
                proxies[policy] = await start_proxy(
                    nursery, workdir, policy, f"http://{fake[0]}:{fake[1]}", settings
                )
                pids[f"proxy_{policy}"] = proxies[policy].pid
            bench = Bench(settings, fake, proxies)
            for policy in proxies:
                # One unmeasured request each: first-request costs are no phase's.
                await warm_up(bench, policy)
            for round_, name, policy in schedule(settings.repeat):
                phases.append(await bench.phase(name, policy, round_))
            nursery.cancel_scope.cancel()
    return FairnessRun(
        settings,
        phases,
        machine=machine,
        command=command,
        commit=await git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        seconds=time.monotonic() - started,
        pids=pids,
    )


async def start_fake(
    nursery: trio.Nursery, workdir: Path, settings: FairnessSettings
) -> tuple[tuple[str, int], int]:
    """The fake upstream, ready: its address and its pid."""
    fake = ("127.0.0.1", free_port("127.0.0.1"))
    log = workdir / "fake-upstream.log"
    process = await nursery.start(supervise, "fake upstream", fake_argv(fake[1], settings), log)
    await wait_ready("fake upstream", fake, "/health", log)
    return fake, process.pid


async def warm_up(bench: Bench, policy: str) -> None:
    settings = bench.settings
    warm = [
        Request(key, "warm-up", f"warm-{policy}-{key}", 0.0, 3, settings.ttft, settings.interval)
        for key in proxy_keys(policy)
    ]
    await bench.run(bench.proxies[policy], warm, f"warm-up {policy}")
    failed = [r for r in warm if not r.ok]
    if failed:
        r = failed[0]
        raise BenchError(
            f"warm-up request through the {policy} proxy failed: HTTP {r.status} "
            f"{r.error_code or r.error or ''}".rstrip()
        )
    await settle(bench.fake)
    await bench.collect(warm)


async def start_proxy(
    nursery: trio.Nursery,
    workdir: Path,
    policy: str,
    upstream: str,
    settings: FairnessSettings,
) -> Proxy:
    address = ("127.0.0.1", free_port("127.0.0.1"))
    config = workdir / f"proxy-{policy}.toml"
    write_text(config, proxy_config(address[1], upstream, policy, settings))
    log = workdir / f"proxy-{policy}.log"
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    process = await nursery.start(supervise, f"proxy ({policy})", argv, log)
    await wait_ready(f"proxy ({policy})", address, "/healthz", log)
    return Proxy(policy, address, process.pid, log)
