"""``python -m proxy.bench.kv_routing``: routing on the replicas' KV caches (issue 57), the
balances side by side in one run: ``least_busy``, ``prefix_affinity``, ``cache_aware`` on the
replicas' KV events, and ``cache_aware`` without them (``cache_aware_approx``: what was
routed).

``--replicas`` fake upstreams (``proxy.testing.fake_upstream``), each a serving model with a
token-block prefix cache of ``--cache-blocks`` blocks of 16 tokens (by default 70% of what the
shared-prefix workload's distinct blocks need, over the replicas), its uncached prompt tokens
prefilled one prompt at a time at ``--prefill-us`` each (an engine's compute is shared), TTFT
``--ttft-base`` after that, and vLLM's KV events on a ZeroMQ socket. The fake's tokens are its
/tokenize's (a word is a token), which ``cache_aware`` asks it for.

Two workloads, after SGLang's and production-stack's benchmarks, scaled to this machine:

- **shared prefix**: ``--groups`` groups x ``--questions`` questions, a ``--system-tokens``
  system prompt per group and a ``--question-tokens`` question each, in a random order, sent
  open-loop at ``--rate`` requests a second;
- **multi-turn**: ``--users`` users x ``--rounds`` rounds behind one shared
  ``--mt-system-tokens`` system prompt, each round a new question after the last answer, the
  users' rounds one after another with ``--think`` seconds between.

Per balance: TTFT p50 and p90 as the clients saw them (through Sluice), the replicas' own
prefix-cache hit rate (blocks hit / queried, from their counters) beside an oracle's (one LRU
as large as all the replicas' together, fed the same prompts in order), throughput (requests
a second from the first sent to the last answered), and the spread: each replica's share of
the prefill work (uncached tokens) and the largest over the mean. Each balance runs against
the same fakes with a Sluice of its own, started for its run; every run's prompts are its own
(tagged), so none finds another's blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import trio

from proxy.bench.balance import replica_counters
from proxy.bench.children import free_port, git_commit, supervise, wait_ready
from proxy.bench.cli import bench_main, write_outputs
from proxy.bench.client import StreamResult, build_request, run_stream
from proxy.bench.procfs import machine_info
from proxy.bench.report import write_text
from proxy.bench.settings import BenchError
from proxy.bench.summary import percentile
from proxy.protocol.kv_cache import block_keys
from proxy.testing.fake_upstream import PrefixCache, prompt_tokens, token_text

BALANCES: Final = ("least_busy", "prefix_affinity", "cache_aware", "cache_aware_approx")
WORKLOADS: Final = ("shared_prefix", "multi_turn")
MODEL: Final = "fake-model"
# vLLM's default block size; the fakes' and cache_aware's.
BLOCK_TOKENS: Final = 16


@dataclass(frozen=True)
class KvRoutingSettings:
    replicas: int = 4
    groups: int = 16
    questions: int = 8
    system_tokens: int = 2000
    question_tokens: int = 128
    rate: float = 40.0
    users: int = 16
    rounds: int = 5
    mt_system_tokens: int = 1000
    mt_question_tokens: int = 64
    think: float = 0.5
    # Each fake: its answers, its running slots, its cache, its prefill.
    tokens: int = 32
    interval: float = 0.01
    max_running: int = 16
    ttft_base: float = 0.02
    prefill_us: float = 50.0
    # Blocks per replica; 0: cache_fraction of the shared-prefix workload's distinct blocks.
    cache_blocks: int = 0
    cache_fraction: float = 0.7
    kv_cache_weight: float = 4.0
    metrics_interval: float = 0.5
    seed: int = 1
    # Runs pooled per balance and workload, seeds seed .. seed + repeat - 1 (the shared-prefix
    # order): one run's p90 is a handful of requests.
    repeat: int = 1
    balances: tuple[str, ...] = BALANCES
    workloads: tuple[str, ...] = WORKLOADS

    def __post_init__(self) -> None:
        for name in ("replicas", "groups", "questions", "users", "rounds", "max_running", "repeat"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
        if not self.rate > 0 or not self.cache_fraction > 0:
            raise BenchError("--rate and --cache-fraction must be over 0")
        for chosen, known in ((self.balances, BALANCES), (self.workloads, WORKLOADS)):
            unknown = set(chosen) - set(known)
            if unknown:
                raise BenchError(f"unknown: {', '.join(sorted(unknown))}")

    def replica_blocks(self) -> int:
        """Each replica's cache, in blocks."""
        if self.cache_blocks:
            return self.cache_blocks
        system = self.groups * (self.system_tokens // BLOCK_TOKENS)
        # A question's blocks start within the system prompt's partial last block.
        per_question = (self.system_tokens + self.question_tokens) // BLOCK_TOKENS - (
            self.system_tokens // BLOCK_TOKENS
        )
        distinct = system + self.groups * self.questions * per_question
        return max(1, math.ceil(self.cache_fraction * distinct / self.replicas))

    def key(self) -> str:
        return (
            f"bench=kv_routing replicas={self.replicas} groups={self.groups} "
            f"questions={self.questions} users={self.users} rounds={self.rounds}"
            + (f" repeat={self.repeat}" if self.repeat > 1 else "")
        )

    def describe(self) -> str:
        return (
            f"{self.replicas} fake replicas, each a prefix cache of {self.replica_blocks()} "
            f"blocks of {BLOCK_TOKENS} tokens, uncached tokens prefilled one prompt at a time "
            f"at {self.prefill_us:g} us each, TTFT {self.ttft_base * 1000:g} ms after that, "
            f"{self.max_running} running (every balance's max_connections), {self.tokens} "
            f"tokens per answer at {self.interval * 1000:g} ms"
        )


# --------------------------------------------------------------------------- the workloads


def words(tag: str, count: int) -> str:
    """``count`` distinct words (tokens, to the fake), each naming ``tag``."""
    return " ".join(f"{tag}w{i}" for i in range(count))


def answer_text(tokens: int) -> str:
    """What the fake answers (its tokens are fixed), for a conversation's next round."""
    return "".join(token_text(i) for i in range(tokens)).strip()


def shared_prefix_prompts(settings: KvRoutingSettings, tag: str) -> list[list[dict[str, str]]]:
    """Every group's questions, shuffled (the same order for every run)."""
    pairs = [(g, q) for g in range(settings.groups) for q in range(settings.questions)]
    random.Random(settings.seed).shuffle(pairs)
    return [
        [
            {"role": "system", "content": words(f"{tag}g{g}", settings.system_tokens)},
            {"role": "user", "content": words(f"{tag}g{g}q{q}", settings.question_tokens)},
        ]
        for g, q in pairs
    ]


def multi_turn_prompt(
    settings: KvRoutingSettings, tag: str, user: int, round_: int
) -> list[dict[str, str]]:
    """User ``user``'s round ``round_`` (0-based): the shared system prompt, each earlier
    question and answer, the new question."""
    messages = [{"role": "system", "content": words(f"{tag}s", settings.mt_system_tokens)}]
    for earlier in range(round_ + 1):
        if earlier:
            messages.append({"role": "assistant", "content": answer_text(settings.tokens)})
        question = words(f"{tag}u{user}r{earlier}", settings.mt_question_tokens)
        messages.append({"role": "user", "content": question})
    return messages


def oracle_hit_rate(prompts: Sequence[list[dict[str, str]]], blocks: int) -> float:
    """The hit rate of one LRU of ``blocks`` fed ``prompts`` in order."""
    cache = PrefixCache(blocks)
    for messages in prompts:
        names = block_keys(prompt_tokens({"messages": messages}) or [], BLOCK_TOKENS)
        cache.match(names)
        cache.store(names)
    return cache.hits / cache.queries if cache.queries else 0.0


# --------------------------------------------------------------------------- one run


@dataclass
class KvRun:
    """One balance on one workload."""

    balance: str
    workload: str
    ttfts: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    queried: list[float] = field(default_factory=list)
    hit: list[float] = field(default_factory=list)
    oracle: float | None = None
    # Runs pooled into this one.
    pooled: int = 1

    def pool(self, other: KvRun) -> None:
        """``other``'s requests added to this run's (the same balance and workload, another
        seed): TTFTs and counters pooled, the oracle averaged."""
        count = self.pooled
        self.ttfts += other.ttfts
        self.requests += other.requests
        self.errors += other.errors
        self.seconds += other.seconds
        self.queried = [a + b for a, b in zip(self.queried, other.queried, strict=True)]
        self.hit = [a + b for a, b in zip(self.hit, other.hit, strict=True)]
        if self.oracle is not None and other.oracle is not None:
            self.oracle = (self.oracle * count + other.oracle) / (count + 1)
        self.pooled += 1

    def summary(self) -> dict[str, Any]:
        p50, p90 = percentile(self.ttfts, 50), percentile(self.ttfts, 90)
        prefill = [q - h for q, h in zip(self.queried, self.hit, strict=True)]
        total = sum(prefill)
        mean = total / len(prefill) if prefill else 0.0
        queried = sum(self.queried)
        done = self.requests - self.errors
        return {
            "balance": self.balance,
            "workload": self.workload,
            "requests": self.requests,
            "errors": self.errors,
            "ttft_p50_ms": None if p50 is None else p50 * 1000,
            "ttft_p90_ms": None if p90 is None else p90 * 1000,
            "hit_rate": sum(self.hit) / queried if queried else None,
            "oracle_hit_rate": self.oracle,
            "throughput_rps": done / self.seconds if self.seconds else None,
            "prefill_share": [p / total if total else 0.0 for p in prefill],
            "prefill_max_over_mean": max(prefill) / mean if mean else None,
        }


async def send(
    address: tuple[str, int], messages: list[dict[str, str]], results: list[StreamResult]
) -> None:
    body = json.dumps({"model": MODEL, "stream": True, "messages": messages}).encode()
    request = build_request(address[0], address[1], "/v1/chat/completions", body)
    result = StreamResult(len(results), str(len(results)), "normal")
    results.append(result)
    await run_stream(address, request, result, start_at=0.0, drop_at=0, slow_delay=0.0)


async def run_workload(
    settings: KvRoutingSettings,
    workload: str,
    balance: str,
    proxy: tuple[str, int],
    replicas: Sequence[tuple[str, int]],
    tag: str,
) -> KvRun:
    """One workload through the Sluice at ``proxy``; its figures."""
    before = await replica_counters(replicas)
    run = KvRun(balance, workload)
    results: list[StreamResult] = []
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        if workload == "shared_prefix":
            prompts = shared_prefix_prompts(settings, tag)
            for i, messages in enumerate(prompts):
                await trio.sleep_until(started + i / settings.rate)
                nursery.start_soon(send, proxy, messages, results)
        else:
            prompts = [
                multi_turn_prompt(settings, tag, user, round_)
                for round_ in range(settings.rounds)
                for user in range(settings.users)
            ]

            async def user(index: int) -> None:
                await trio.sleep(index * settings.think / settings.users)
                for round_ in range(settings.rounds):
                    await send(proxy, multi_turn_prompt(settings, tag, index, round_), results)
                    await trio.sleep(settings.think)

            for index in range(settings.users):
                nursery.start_soon(user, index)
    after = await replica_counters(replicas)
    ends = [r.ended_at for r in results if r.ended_at is not None]
    sent = [r.sent for r in results if r.sent is not None]
    run.seconds = max(ends) - min(sent) if ends and sent else 0.0
    for result in results:
        run.requests += 1
        ok = result.status == 200 and result.done and result.error is None
        if ok and result.first_token is not None and result.sent is not None:
            run.ttfts.append(result.first_token - result.sent)
        else:
            run.errors += 1
    run.queried = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    run.hit = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    run.oracle = oracle_hit_rate(prompts, settings.replica_blocks() * settings.replicas)
    return run


# --------------------------------------------------------------------------- processes


def model_table(
    balance: str, upstreams: Sequence[str], events: Sequence[str], settings: KvRoutingSettings
) -> dict[str, Any]:
    """The model's settings for ``balance`` (``cache_aware_approx``: cache_aware, no events)."""
    table: dict[str, Any] = {
        "upstreams": list(upstreams),
        "balance": "cache_aware" if balance.startswith("cache_aware") else balance,
        "metrics_interval": settings.metrics_interval,
        # The same bound for every balance, the fakes' running slots: unset, cache_aware
        # (which scrapes) learns that capacity and holds the excess in Sluice's queue, while
        # least_busy and prefix_affinity (which do not) default to 128 and let it queue in the
        # engine, so the balances would not be compared on equal footing.
        "max_connections": settings.max_running,
    }
    if balance.startswith("cache_aware"):
        table["kv_cache_weight"] = settings.kv_cache_weight
        table["kv_block_size"] = BLOCK_TOKENS
        table["kv_approx_max_blocks"] = settings.replica_blocks()
        if balance == "cache_aware":
            table["kv_events_endpoints"] = list(events)
    return table


def proxy_config(port: int, table: dict[str, Any]) -> str:
    lines = [
        "# Written by proxy.bench.kv_routing for one run.",
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "graceful_timeout = 1.0",
        "",
        "[upstream]",
        'proxy = "none"',
        "",
        f"[models.{json.dumps(MODEL)}]",
    ]
    lines += [f"{name} = {json.dumps(value)}" for name, value in table.items()]
    return "\n".join(lines) + "\n"


def fake_argv(port: int, events_port: int, settings: KvRoutingSettings) -> list[str]:
    return [
        *(sys.executable, "-m", "proxy.testing.fake_upstream", "--host", "127.0.0.1"),
        *("--port", str(port), "--model", MODEL, "--ttft", "0.002"),
        *("--tokens", str(settings.tokens), "--interval", str(settings.interval)),
        *("--max-running", str(settings.max_running)),
        *("--prefix-cache-size", str(settings.replica_blocks())),
        *("--prefix-block-tokens", str(BLOCK_TOKENS), "--ttft-hit", str(settings.ttft_base)),
        *("--prefill-token-seconds", str(settings.prefill_us / 1e6)),
        *("--kv-events-port", str(events_port)),
    ]


@dataclass
class KvRoutingReport:
    settings: KvRoutingSettings
    runs: list[KvRun]
    command: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    commit: str | None = None
    date: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "results": [run.summary() for run in self.runs],
            "command": self.command,
            "machine": self.machine,
            "commit": self.commit,
            "date": self.date,
        }


async def run_kv_routing_bench(
    settings: KvRoutingSettings, *, command: str = ""
) -> KvRoutingReport:
    machine = machine_info()
    runs: list[KvRun] = []
    with tempfile.TemporaryDirectory(prefix="sluice-kv-routing-") as tmp:
        workdir = Path(tmp)
        async with trio.open_nursery() as nursery:
            replicas = [("127.0.0.1", free_port("127.0.0.1")) for _ in range(settings.replicas)]
            events = [free_port("127.0.0.1") for _ in replicas]
            for i, (address, port) in enumerate(zip(replicas, events, strict=True)):
                argv = fake_argv(address[1], port, settings)
                await nursery.start(supervise, f"fake replica {i}", argv, workdir / f"r{i}.log")
            for i, address in enumerate(replicas):
                await wait_ready(f"fake replica {i}", address, "/health", workdir / f"r{i}.log")
            urls = [f"http://{host}:{port}" for host, port in replicas]
            endpoints = [f"tcp://127.0.0.1:{port}" for port in events]
            pooled: dict[tuple[str, str], KvRun] = {}
            for repeat in range(settings.repeat):
                seeded = dataclasses.replace(settings, seed=settings.seed + repeat)
                for workload in settings.workloads:
                    for balance in settings.balances:
                        table = model_table(balance, urls, endpoints, seeded)
                        run = await _one_run(
                            seeded, workload, balance, table, replicas, workdir, repeat
                        )
                        print(f"  {workload} {balance}: {_line(run.summary())}", flush=True)
                        if (workload, balance) in pooled:
                            pooled[workload, balance].pool(run)
                        else:
                            pooled[workload, balance] = run
                            runs.append(run)
            nursery.cancel_scope.cancel()
    return KvRoutingReport(
        settings,
        runs,
        command=command,
        machine=machine,
        commit=await git_commit(),
        date=time.strftime("%Y-%m-%d"),
    )


async def _one_run(
    settings: KvRoutingSettings,
    workload: str,
    balance: str,
    table: dict[str, Any],
    replicas: Sequence[tuple[str, int]],
    workdir: Path,
    repeat: int = 0,
) -> KvRun:
    """A Sluice of its own for one run, stopped after it."""
    stem = f"{workload}-{balance}-{repeat}"
    address = ("127.0.0.1", free_port("127.0.0.1"))
    config = workdir / f"{stem}.toml"
    write_text(config, proxy_config(address[1], table))
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    async with trio.open_nursery() as nursery:
        await nursery.start(supervise, f"proxy {stem}", argv, workdir / f"{stem}.log")
        await wait_ready(f"proxy {stem}", address, "/healthz", workdir / f"{stem}.log")
        # Its subscribers connected and its first scrape done.
        await trio.sleep(max(0.5, 2 * settings.metrics_interval))
        run = await run_workload(settings, workload, balance, address, replicas, stem)
        nursery.cancel_scope.cancel()
    return run


# --------------------------------------------------------------------------- reporting


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _line(s: dict[str, Any]) -> str:
    return (
        f"TTFT p50 {_ms(s['ttft_p50_ms'])} ms, p90 {_ms(s['ttft_p90_ms'])} ms, hits "
        f"{_pct(s['hit_rate'])} (oracle {_pct(s['oracle_hit_rate'])}), errors {s['errors']}"
    )


def format_table(report: KvRoutingReport, workload: str) -> str:
    rows = [
        "| balance | requests | errors | TTFT p50 (ms) | TTFT p90 (ms) | p90 / prefix_affinity "
        "| hit rate | oracle | req/s | prefill work per replica | max / mean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    # The same run's prefix_affinity: the bar the issue sets is a ratio to it.
    reference = next(
        (
            run.summary()["ttft_p90_ms"]
            for run in report.runs
            if run.workload == workload and run.balance == "prefix_affinity"
        ),
        None,
    )
    for run in report.runs:
        if run.workload != workload:
            continue
        s = run.summary()
        share = " / ".join(f"{x:.0%}" for x in s["prefill_share"])
        spread = s["prefill_max_over_mean"]
        rps = s["throughput_rps"]
        p90 = s["ttft_p90_ms"]
        ratio = "n/a" if p90 is None or not reference else f"{p90 / reference:.2f}x"
        rows.append(
            f"| `{run.balance}` | {s['requests']} | {s['errors']} | {_ms(s['ttft_p50_ms'])} | "
            f"{_ms(s['ttft_p90_ms'])} | {ratio} | {_pct(s['hit_rate'])} | "
            f"{_pct(s['oracle_hit_rate'])} | "
            f"{'n/a' if rps is None else f'{rps:.1f}'} | {share} | "
            f"{'n/a' if spread is None else f'{spread:.2f}'} |"
        )
    return "\n".join(rows)


def kv_routing_markdown(report: KvRoutingReport) -> str:
    s, machine = report.settings, report.machine
    lines = [
        f"## KV-cache routing: least_busy vs prefix_affinity vs cache_aware "
        f"({s.replicas} replicas)",
        "",
        f"{s.describe()}. One Sluice per balance, started for its run; `cache_aware_approx` "
        "is `cache_aware` with no KV events (judged by what it routed). Hit rate: the "
        "replicas' own counters (blocks hit / queried); oracle: one LRU as large as all the "
        "replicas' caches, fed the same prompts in order. Prefill work: each replica's "
        "uncached blocks; max / mean: the hottest replica over the mean.",
        "",
    ]
    titles = {
        "shared_prefix": (
            f"**Shared prefix**: {s.groups} groups x {s.questions} questions, a "
            f"{s.system_tokens}-token system prompt per group, {s.question_tokens}-token "
            f"questions, shuffled, {s.rate:g} requests/s."
        ),
        "multi_turn": (
            f"**Multi-turn**: {s.users} users x {s.rounds} rounds behind one "
            f"{s.mt_system_tokens}-token system prompt, {s.mt_question_tokens}-token "
            f"questions, each round after the last answer and {s.think:g} s."
        ),
    }
    for workload in s.workloads:
        lines += [titles[workload], "", format_table(report, workload), ""]
    if s.repeat > 1:
        lines.append(
            f"Each row pools {s.repeat} runs (seeds {s.seed} to {s.seed + s.repeat - 1}: "
            "the shared-prefix order), the balances alternating within each; the oracle is "
            "their mean."
        )
        lines.append("")
    lines.append(
        "TTFT here is wall-clock on a shared machine: read the hit rates and the spread "
        "first, and compare TTFT only within one run."
    )
    lines.append("")
    lines.append(
        f"`{report.command}` on {report.date}, commit {report.commit or 'unknown'}; "
        f"{machine.get('cores')} cores ({machine.get('cpu')}), load average "
        f"{machine.get('loadavg_1m')} at the start."
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = KvRoutingSettings()
    add = parser.add_argument
    for name in (
        "replicas",
        "groups",
        "questions",
        "system_tokens",
        "question_tokens",
        "users",
        "rounds",
        "mt_system_tokens",
        "mt_question_tokens",
        "tokens",
        "max_running",
        "cache_blocks",
        "seed",
        "repeat",
    ):
        add(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    for name in (
        "rate",
        "think",
        "interval",
        "ttft_base",
        "prefill_us",
        "cache_fraction",
        "kv_cache_weight",
        "metrics_interval",
    ):
        add(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    add("--balance", action="append", choices=BALANCES, help="only these (repeatable)")
    add("--workload", action="append", choices=WORKLOADS, help="only these (repeatable)")
    add("--json", type=Path, help="write the figures as JSON here")
    add("--markdown", type=Path, help="write (or replace) this bench's section in this file")


def settings_from_args(args: argparse.Namespace) -> KvRoutingSettings:
    values = {
        name: getattr(args, name)
        for name in KvRoutingSettings.__dataclass_fields__
        if name not in ("balances", "workloads")
    }
    return KvRoutingSettings(
        **values,
        balances=tuple(args.balance) if args.balance else BALANCES,
        workloads=tuple(args.workload) if args.workload else WORKLOADS,
    )


async def run_from_args(args: argparse.Namespace, command: str) -> KvRoutingReport:
    settings = settings_from_args(args)
    print(f"sluice bench (kv routing): {settings.describe()}", flush=True)
    report = await run_kv_routing_bench(settings, command=command)
    for workload in settings.workloads:
        print(f"{workload}:\n{format_table(report, workload)}")
    write_outputs(args, settings.key(), report.to_json(), kv_routing_markdown(report))
    return report


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench.kv_routing") -> None:
    bench_main((__doc__ or "").splitlines()[0], add_arguments, run_from_args, argv, prog)


if __name__ == "__main__":
    main()
