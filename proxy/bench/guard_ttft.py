"""What a ``prompt`` guard adds to the time to first token, measured through a real proxy.

A prompt guard runs beside the upstream request, from its dispatch, and the answer is held
until it passes. So a guard that takes L seconds beside an upstream whose first token takes T
should add about max(0, L - T) to the client's TTFT, not L. This bench starts the fake
upstream and one Sluice process serving two models in front of it, one with a prompt guard
(:func:`waits_as_asked`, which takes as long as the request's prompt asks) and one without,
and for each (T, L) sends requests to both, alternating, one at a time, each on a new
connection. The figure is the median TTFT of the guarded model less that of the unguarded one
at the same T: what the guard added, beside max(0, L - T) and L.

``python -m proxy.bench.guard_ttft [--markdown docs/benchmarks.md]``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import trio

from proxy.bench.children import free_port, git_commit, run_stoppable, supervise, wait_ready
from proxy.bench.client import StreamResult, build_request, chat_body, classify, run_stream
from proxy.bench.procfs import machine_info
from proxy.bench.report import upsert_section
from proxy.guards import Prompt

GUARDED: Final = "guarded"
UNGUARDED: Final = "unguarded"
# The upstream's first token (T) and the guard's time (L), seconds: L below, at and past T.
FIRST_TOKENS: Final = (0.2, 0.5)
GUARD_TIMES: Final = (0.0, 0.1, 0.3, 0.5, 0.8)
# The answer after its first token: short, so that a request is its TTFT.
TOKENS: Final = 5
INTERVAL: Final = 0.01
SECTION_KEY: Final = "guard-ttft"
_ASKED: Final = re.compile(r"guard-wait=([0-9.]+)")


async def waits_as_asked(prompt: Prompt) -> None:
    """The bench's prompt guard: it takes the seconds its prompt names (``guard-wait=L``),
    as a policy service or a moderation model would, and passes."""
    asked = _ASKED.search(prompt.text)
    if asked is not None:
        await trio.sleep(float(asked[1]))


def proxy_config(port: int, upstream: str) -> str:
    """One proxy, two models in front of the same upstream: the guarded one's every request
    meets :func:`waits_as_asked` at the prompt stage; the unguarded one's meets nothing."""
    return (
        "# Written by proxy.bench.guard_ttft for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        'proxy = "none"\n\n'
        f"[models.{GUARDED}]\n"
        f"upstreams = [{json.dumps(upstream)}]\n\n"
        f"[models.{UNGUARDED}]\n"
        f"upstreams = [{json.dumps(upstream)}]\n\n"
        "[[guards]]\n"
        'name = "waits"\n'
        'use = "proxy.bench.guard_ttft:waits_as_asked"\n'
        'stage = "prompt"\n'
        f"models = [{json.dumps(GUARDED)}]\n"
        "timeout = 10.0\n"
    )


@dataclass(frozen=True)
class Cell:
    """One (T, L): the median TTFTs, seconds, of each model, over ``requests`` each."""

    first_token: float
    guard: float
    guarded: float
    unguarded: float
    requests: int

    @property
    def added(self) -> float:
        return self.guarded - self.unguarded

    @property
    def expected(self) -> float:
        return max(0.0, self.guard - self.first_token)


async def _ttft(address: tuple[str, int], model: str, first_token: float, guard: float) -> float:
    tag = f"guard-wait={guard:g}"
    body = chat_body(model, tag, first_token, INTERVAL, TOKENS)
    request = build_request(*address, "/v1/chat/completions", body)
    result = StreamResult(0, tag, "normal")
    await run_stream(address, request, result, start_at=0.0, drop_at=0, slow_delay=0.0)
    failure = classify(result)
    if failure is not None or result.first_token is None or result.sent is None:
        raise RuntimeError(f"{model} (T={first_token:g}, L={guard:g}): {failure}")
    return result.first_token - result.sent


async def measure(
    workdir: Path,
    first_tokens: Sequence[float] = FIRST_TOKENS,
    guard_times: Sequence[float] = GUARD_TIMES,
    requests: int = 10,
) -> list[Cell]:
    """Start the fake upstream and the proxy, and measure every (T, L)."""
    cells = []
    async with trio.open_nursery() as nursery:
        upstream = ("127.0.0.1", free_port("127.0.0.1"))
        log = workdir / "fake-upstream.log"
        argv = [sys.executable, "-m", "proxy.cli", "fake-upstream", "--host", upstream[0]]
        argv += ["--port", str(upstream[1])]
        await nursery.start(supervise, "fake upstream", argv, log)
        await wait_ready("fake upstream", upstream, "/health", log)
        address = ("127.0.0.1", free_port("127.0.0.1"))
        config = workdir / "proxy.toml"
        config.write_text(proxy_config(address[1], f"http://{upstream[0]}:{upstream[1]}"))
        log = workdir / "proxy.log"
        argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
        await nursery.start(supervise, "proxy", argv, log)
        await wait_ready("proxy", address, "/healthz", log)
        # A warm-up of each model: the first request's imports and connections not measured.
        for model in (GUARDED, UNGUARDED):
            await _ttft(address, model, 0.0, 0.0)
        for first_token in first_tokens:
            for guard in guard_times:
                times: dict[str, list[float]] = {GUARDED: [], UNGUARDED: []}
                for index in range(requests):
                    # Alternating, the first of each pair in turn: a drift of the machine's
                    # load meets both models alike.
                    order = (GUARDED, UNGUARDED) if index % 2 == 0 else (UNGUARDED, GUARDED)
                    for model in order:
                        times[model].append(await _ttft(address, model, first_token, guard))
                cells.append(
                    Cell(
                        first_token,
                        guard,
                        statistics.median(times[GUARDED]),
                        statistics.median(times[UNGUARDED]),
                        requests,
                    )
                )
        nursery.cancel_scope.cancel()
    return cells


def table(cells: Sequence[Cell]) -> list[str]:
    lines = [
        "| upstream first token T (ms) | guard L (ms) | TTFT unguarded (ms) "
        "| TTFT guarded (ms) | added (ms) | max(0, L - T) (ms) | L (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        lines.append(
            f"| {cell.first_token * 1000:.0f} | {cell.guard * 1000:.0f} "
            f"| {cell.unguarded * 1000:.1f} | {cell.guarded * 1000:.1f} "
            f"| {cell.added * 1000:.1f} | {cell.expected * 1000:.0f} | {cell.guard * 1000:.0f} |"
        )
    return lines


def section(cells: Sequence[Cell], command: str, commit: str | None) -> str:
    info = machine_info()
    worst = max(abs(cell.added - cell.expected) for cell in cells)
    requests = cells[0].requests if cells else 0
    return "\n".join(
        [
            "## A prompt guard beside the upstream: what it adds to the time to first token",
            "",
            f"- Machine: {info['cores']} cores ({info['cpu']}), Python {info['python']}; "
            f"load average {info['loadavg_1m']:.1f} as it began",
            f"- Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; commit: {commit or 'unknown'}",
            f"- Command: `{command}`",
            "- Load: one Sluice process with two models in front of the fake upstream, one with "
            "a `prompt` guard that takes L seconds and passes, one without; for each (T, L), "
            f"{requests} requests to each model, alternating, one at a time, each on a new "
            f"connection; {TOKENS} tokens after the first, {INTERVAL * 1000:.0f} ms apart. "
            "TTFT is the client's, from its request written to its first token; each figure "
            "a median. Added: guarded less unguarded.",
            "",
            *table(cells),
            "",
            f"- Added is within {worst * 1000:.1f} ms of max(0, L - T) in every cell. The guard "
            "runs beside the upstream from the request's dispatch: only what it takes past the "
            "upstream's first token is waited for, not L.",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proxy.bench.guard_ttft", description=__doc__)
    parser.add_argument("--requests", type=int, default=10, help="per model and (T, L)")
    parser.add_argument("--markdown", type=Path, help="write/replace its section in this file")
    args = parser.parse_args(argv)
    command = "python -m proxy.bench.guard_ttft " + " ".join(argv or sys.argv[1:])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-guard-ttft-") as workdir:
        cells = run_stoppable(measure, Path(workdir), FIRST_TOKENS, GUARD_TIMES, args.requests)
        commit = run_stoppable(git_commit)
    print("\n".join(table(cells)))
    print(f"({time.monotonic() - started:.0f} s)")
    if args.markdown is not None:
        path: Path = args.markdown
        text = path.read_text() if path.exists() else ""
        path.write_text(upsert_section(text, SECTION_KEY, section(cells, command.strip(), commit)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
