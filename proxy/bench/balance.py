"""``python -m proxy.bench --replicas 4 --instances 2 --sessions K``: the three balances on a
conversation workload, in one run.

``--replicas`` fake upstreams, each a serving model (``proxy.testing.fake_upstream``): a
bounded number of requests running at once (the rest wait, as in vLLM's queue), and an LRU
prefix cache of prompt blocks, so a prompt whose beginning that replica saw recently has a
short TTFT (``--ttft-hit``) and one it did not a long one (``--ttft-miss``, by the uncached
fraction). ``--instances`` Sluice processes per balance, each in front of all the replicas,
as several instances behind a load balancer: a session's turns alternate between instances,
so only what every instance computes alike (rendezvous hashing, the replicas' own metrics)
keeps a conversation together.

``K`` sessions, started evenly over ``--ramp`` seconds, each sending ``--turns`` turns one
after another: its own document as the first message (``--doc-bytes``), then each turn the
previous answer and a new question, so every turn's prompt starts with the previous turn's.
Each run tags its documents, so no run finds another run's blocks cached.

Reported per balance: TTFT p50 and p99 as the clients saw them (through the proxy), the
prefix cache's hit rate (blocks hit / blocks queried, from the replicas' own
``vllm:prefix_cache_*`` counters, the run's difference), and how the requests spread over the
replicas. Runs alternate with ``--repeat`` (A B C, then C B A) and pool their samples.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import trio
from prometheus_client.parser import text_string_to_metric_families

from proxy.bench.children import free_port, git_commit, supervise, wait_ready
from proxy.bench.cli import bench_main, write_outputs
from proxy.bench.client import StreamResult, build_request, http_get, run_stream
from proxy.bench.procfs import machine_info
from proxy.bench.report import write_text
from proxy.bench.settings import BenchError
from proxy.bench.summary import percentile

BALANCES: Final = ("least_busy", "upstream_metrics", "prefix_affinity")
_WORDS: Final = ("tide", "lamp", "keeper", "rock", "gull", "storm", "harbour", "rope", "lens")


@dataclass(frozen=True)
class BalanceSettings:
    replicas: int = 4
    instances: int = 2
    sessions: int = 48
    turns: int = 5
    ramp: float = 4.0
    think: float = 0.3
    doc_bytes: int = 1536
    ttft_hit: float = 0.03
    ttft_miss: float = 0.5
    interval: float = 0.01
    tokens: int = 16
    max_running: int = 8
    # Prompt blocks each replica's cache holds: a bit more than its share of the sessions'
    # prompts (48 x ~9 blocks over 4), far from everyone's.
    cache_blocks: int = 128
    block_bytes: int = 256
    metrics_interval: float = 0.5
    repeat: int = 2
    seed: int = 1
    model: str = "fake-model"
    balances: tuple[str, ...] = BALANCES

    def __post_init__(self) -> None:
        for name in ("replicas", "instances", "sessions", "turns", "repeat", "max_running"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
        unknown = set(self.balances) - set(BALANCES)
        if unknown:
            raise BenchError(f"unknown balance(s): {', '.join(sorted(unknown))}")

    def key(self) -> str:
        """The markers' key, in the main bench's ``name=value`` form (its doc tests read every
        section's key so)."""
        return (
            f"bench=balance replicas={self.replicas} instances={self.instances} "
            f"sessions={self.sessions} turns={self.turns}"
        )

    def describe(self) -> str:
        return (
            f"{self.sessions} sessions x {self.turns} turns, {self.instances} Sluice instances "
            f"per balance in front of {self.replicas} fake replicas (each: {self.max_running} "
            f"running, an LRU of {self.cache_blocks} blocks of {self.block_bytes} B, TTFT "
            f"{self.ttft_hit * 1000:g} ms cached to {self.ttft_miss * 1000:g} ms uncached)"
        )


# --------------------------------------------------------------------------- the workload


def session_document(run_tag: str, session: int, size: int, seed: int) -> str:
    rng = random.Random(f"{seed}-{session}")
    words = [f"[{run_tag} session {session}]"]
    while sum(len(w) + 1 for w in words) < size:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:size]


def turn_body(
    model: str, document: str, turn: int, tag: str, tokens: int, interval: float
) -> bytes:
    """Turn ``turn`` (0-based) of a session: its document, then every earlier answer and
    question; the fake's answer length and pace pinned (its TTFT is the cache's)."""
    messages = [
        {"role": "system", "content": "You answer questions about the document."},
        {"role": "user", "content": document},
    ]
    for earlier in range(turn):
        messages.append({"role": "assistant", "content": f"Answer {earlier}: " + "ok " * 40})
        messages.append({"role": "user", "content": f"Question {earlier + 1}: and then?"})
    body = {
        "model": model,
        "stream": True,
        "messages": messages,
        "user": tag,
        "fake": {"tokens": tokens, "interval": interval},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def cache_counters(text: str) -> tuple[float, float]:
    """(blocks queried, blocks hit) in a replica's /metrics."""
    queries = hits = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prefix_cache_queries_total":
                queries += sample.value
            elif sample.name == "vllm:prefix_cache_hits_total":
                hits += sample.value
    return queries, hits


@dataclass
class BalanceRun:
    """One balance's run (or several, pooled)."""

    balance: str
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    requests: int = 0
    queried: float = 0.0
    hit: float = 0.0
    per_replica: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def merge(self, other: BalanceRun) -> None:
        self.ttfts += other.ttfts
        self.errors += other.errors
        self.requests += other.requests
        self.queried += other.queried
        self.hit += other.hit
        if not self.per_replica:
            self.per_replica = [0.0] * len(other.per_replica)
        self.per_replica = [a + b for a, b in zip(self.per_replica, other.per_replica, strict=True)]
        self.seconds += other.seconds

    def summary(self) -> dict[str, Any]:
        p50, p99 = percentile(self.ttfts, 50), percentile(self.ttfts, 99)
        total = sum(self.per_replica) or 1.0
        return {
            "balance": self.balance,
            "requests": self.requests,
            "errors": self.errors,
            "ttft_p50_ms": None if p50 is None else p50 * 1000,
            "ttft_p99_ms": None if p99 is None else p99 * 1000,
            "cache_hit_rate": self.hit / self.queried if self.queried else None,
            "replica_share": [count / total for count in self.per_replica],
            "seconds": self.seconds,
        }


def schedule(balances: Sequence[str], repeat: int) -> list[str]:
    """A B C, then C B A, ...: none always first on a cold machine."""
    order: list[str] = []
    for rep in range(repeat):
        order += list(balances) if rep % 2 == 0 else list(reversed(balances))
    return order


async def replica_counters(replicas: Sequence[tuple[str, int]]) -> list[tuple[float, float]]:
    """Each replica's (blocks queried, blocks hit), from its /metrics."""
    out = []
    for address in replicas:
        status, body = await http_get(address, "/metrics")
        if status != 200:
            raise BenchError(f"fake replica {address} answered {status} to /metrics")
        out.append(cache_counters(body.decode()))
    return out


async def run_sessions(
    settings: BalanceSettings,
    balance: str,
    instances: Sequence[tuple[str, int]],
    replicas: Sequence[tuple[str, int]],
    run_tag: str,
) -> BalanceRun:
    """Every session of one run against ``instances``; the figures of that run."""
    before = await replica_counters(replicas)
    run = BalanceRun(balance)
    results: list[StreamResult] = []
    started = trio.current_time()
    gap = settings.ramp / settings.sessions

    async def session(index: int) -> None:
        document = session_document(run_tag, index, settings.doc_bytes, settings.seed)
        await trio.sleep_until(started + index * gap)
        for turn in range(settings.turns):
            address = instances[(index + turn) % len(instances)]
            tag = f"{run_tag}-{index}-{turn}"
            body = turn_body(
                settings.model, document, turn, tag, settings.tokens, settings.interval
            )
            request = build_request(address[0], address[1], "/v1/chat/completions", body)
            result = StreamResult(len(results), tag, "normal")
            results.append(result)
            await run_stream(address, request, result, start_at=0.0, drop_at=0, slow_delay=0.0)
            await trio.sleep(settings.think)

    async with trio.open_nursery() as nursery:
        for index in range(settings.sessions):
            nursery.start_soon(session, index)
    run.seconds = trio.current_time() - started
    after = await replica_counters(replicas)
    for result in results:
        run.requests += 1
        ok = result.status == 200 and result.done and result.error is None
        if ok and result.first_token is not None and result.sent is not None:
            run.ttfts.append(result.first_token - result.sent)
        else:
            run.errors += 1
    run.per_replica = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    run.queried = sum(run.per_replica)
    run.hit = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return run


# --------------------------------------------------------------------------- processes


def proxy_config(
    port: int, upstreams: Sequence[str], balance: str, settings: BalanceSettings
) -> str:
    return (
        "# Written by proxy.bench (balance) for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        'proxy = "none"\n'
        f"balance = {json.dumps(balance)}\n"
        f"metrics_interval = {settings.metrics_interval}\n\n"
        f"[models.{json.dumps(settings.model)}]\n"
        f"upstreams = {json.dumps(list(upstreams))}\n"
    )


def fake_argv(port: int, settings: BalanceSettings) -> list[str]:
    return [
        sys.executable,
        "-m",
        "proxy.testing.fake_upstream",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        settings.model,
        "--tokens",
        str(settings.tokens),
        "--interval",
        str(settings.interval),
        "--max-running",
        str(settings.max_running),
        "--prefix-cache-size",
        str(settings.cache_blocks),
        "--prefix-block-bytes",
        str(settings.block_bytes),
        "--ttft-hit",
        str(settings.ttft_hit),
        "--ttft-miss",
        str(settings.ttft_miss),
    ]


@dataclass
class BalanceReport:
    settings: BalanceSettings
    runs: dict[str, BalanceRun]
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    commit: str | None = None
    date: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "results": [self.runs[b].summary() for b in self.settings.balances],
            "command": self.command,
            "machine": self.machine,
            "commit": self.commit,
            "date": self.date,
        }


async def run_balance_bench(settings: BalanceSettings, *, command: str = "") -> BalanceReport:
    machine = machine_info()
    runs = {balance: BalanceRun(balance) for balance in settings.balances}
    with tempfile.TemporaryDirectory(prefix="sluice-balance-") as tmp:
        workdir = Path(tmp)
        async with trio.open_nursery() as nursery:
            replicas = [("127.0.0.1", free_port("127.0.0.1")) for _ in range(settings.replicas)]
            for i, address in enumerate(replicas):
                log = workdir / f"replica-{i}.log"
                argv = fake_argv(address[1], settings)
                await nursery.start(supervise, f"fake replica {i}", argv, log)
            for i, address in enumerate(replicas):
                log = workdir / f"replica-{i}.log"
                await wait_ready(f"fake replica {i}", address, "/health", log)
            urls = [f"http://{host}:{port}" for host, port in replicas]
            proxies: dict[str, list[tuple[str, int]]] = {}
            for balance in settings.balances:
                proxies[balance] = []
                for i in range(settings.instances):
                    address = ("127.0.0.1", free_port("127.0.0.1"))
                    stem = f"{balance}-{i}"
                    config = workdir / f"{stem}.toml"
                    write_text(config, proxy_config(address[1], urls, balance, settings))
                    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
                    log = workdir / f"{stem}.log"
                    await nursery.start(supervise, f"proxy {stem}", argv, log)
                    proxies[balance].append(address)
            for balance, addresses in proxies.items():
                for i, address in enumerate(addresses):
                    await wait_ready(
                        f"proxy {balance}-{i}", address, "/healthz", workdir / f"{balance}-{i}.log"
                    )
            for number, balance in enumerate(schedule(settings.balances, settings.repeat)):
                run = await run_sessions(
                    settings, balance, proxies[balance], replicas, f"run{number}"
                )
                runs[balance].merge(run)
            nursery.cancel_scope.cancel()
    return BalanceReport(
        settings,
        runs,
        command=command,
        machine=machine,
        commit=await git_commit(),
        date=time.strftime("%Y-%m-%d"),
    )


# --------------------------------------------------------------------------- reporting


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def format_balance_table(report: BalanceReport) -> str:
    rows = [
        "| balance | requests | errors | TTFT p50 (ms) | TTFT p99 (ms) | cache hit rate | "
        "blocks per replica |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for balance in report.settings.balances:
        s = report.runs[balance].summary()
        rate = s["cache_hit_rate"]
        share = " / ".join(f"{x:.0%}" for x in s["replica_share"])
        rows.append(
            f"| `{balance}` | {s['requests']} | {s['errors']} | {_ms(s['ttft_p50_ms'])} | "
            f"{_ms(s['ttft_p99_ms'])} | {'n/a' if rate is None else f'{rate:.0%}'} | {share} |"
        )
    return "\n".join(rows)


def balance_markdown(report: BalanceReport) -> str:
    settings = report.settings
    machine = report.machine
    return "\n".join(
        [
            f"## Balance: least_busy vs upstream_metrics vs prefix_affinity "
            f"({settings.replicas} replicas, {settings.instances} instances, "
            f"{settings.sessions} sessions x {settings.turns} turns)",
            "",
            f"{settings.describe()}. Each session's turns alternate between the instances; "
            "every turn's prompt starts with the previous one's. Hit rate: the replicas' own "
            "prefix-cache counters (blocks hit / blocks queried); blocks per replica: where "
            "the prompts went.",
            "",
            format_balance_table(report),
            "",
            f"`{report.command}` on {report.date}, commit {report.commit or 'unknown'}; "
            f"{machine.get('cores')} cores ({machine.get('cpu')}), load average "
            f"{machine.get('loadavg_1m')} at the start.",
        ]
    )


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BalanceSettings()
    add = parser.add_argument
    add("--replicas", type=int, default=d.replicas, help="fake upstream replicas")
    add("--instances", type=int, default=d.instances, help="Sluice processes per balance")
    add("--sessions", type=int, default=d.sessions, help="conversations")
    add("--turns", type=int, default=d.turns, help="turns per conversation")
    add("--ramp", type=float, default=d.ramp, help="seconds over which sessions start")
    add("--think", type=float, default=d.think, help="seconds between a session's turns")
    add("--doc-bytes", type=int, default=d.doc_bytes, help="each session's first message")
    add("--ttft-hit", type=float, default=d.ttft_hit, help="replica TTFT, prompt cached")
    add("--ttft-miss", type=float, default=d.ttft_miss, help="replica TTFT, prompt uncached")
    add("--interval", type=float, default=d.interval, help="seconds per token")
    add("--tokens", type=int, default=d.tokens, help="tokens per answer")
    add("--max-running", type=int, default=d.max_running, help="running requests per replica")
    add("--cache-blocks", type=int, default=d.cache_blocks, help="prefix-cache LRU per replica")
    add("--block-bytes", type=int, default=d.block_bytes, help="bytes per cached block")
    add("--metrics-interval", type=float, default=d.metrics_interval, help="upstream_metrics")
    add("--repeat", type=int, default=d.repeat, help="runs per balance, alternating, pooled")
    add("--seed", type=int, default=d.seed, help="seed of the documents")
    add("--balance", action="append", choices=BALANCES, help="only these (repeatable)")
    add("--json", type=Path, help="write the figures as JSON here")
    add("--markdown", type=Path, help="write (or replace) this load's section in this file")


def settings_from_args(args: argparse.Namespace) -> BalanceSettings:
    return BalanceSettings(
        replicas=args.replicas,
        instances=args.instances,
        sessions=args.sessions,
        turns=args.turns,
        ramp=args.ramp,
        think=args.think,
        doc_bytes=args.doc_bytes,
        ttft_hit=args.ttft_hit,
        ttft_miss=args.ttft_miss,
        interval=args.interval,
        tokens=args.tokens,
        max_running=args.max_running,
        cache_blocks=args.cache_blocks,
        block_bytes=args.block_bytes,
        metrics_interval=args.metrics_interval,
        repeat=args.repeat,
        seed=args.seed,
        balances=tuple(args.balance) if args.balance else BALANCES,
    )


async def run_from_args(args: argparse.Namespace, command: str) -> BalanceReport:
    settings = settings_from_args(args)
    report = await run_balance_bench(settings, command=command)
    print(f"sluice bench (balance): {settings.describe()}")
    print(format_balance_table(report))
    write_outputs(args, settings.key(), report.to_json(), balance_markdown(report))
    return report


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> None:
    bench_main((__doc__ or "").splitlines()[0], add_arguments, run_from_args, argv, prog)


def wants_balance(argv: Sequence[str]) -> bool:
    """Whether a ``python -m proxy.bench`` command line asks for this bench."""
    return any(a.split("=")[0] in ("--sessions", "--replicas", "--instances") for a in argv)
