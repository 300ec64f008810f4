"""``sluice bench --fairness`` (``python -m proxy.bench --fairness``): its flags, and what a run
prints and writes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.bench.children import run_stoppable
from proxy.bench.fairness.long_report import (
    LongReport,
    long_check_lines,
    long_markdown,
    make_long_report,
)
from proxy.bench.fairness.long_run import run_long_bench
from proxy.bench.fairness.report import FairnessReport, check_lines, make_report, markdown
from proxy.bench.fairness.run import run_fairness_bench
from proxy.bench.fairness.settings import FairnessSettings
from proxy.bench.procfs import read_text_or_none
from proxy.bench.report import upsert_section, write_text
from proxy.bench.settings import BenchError

FLAG = "--fairness"
DESCRIPTION = (
    "The fairness bench: one key floods a saturated upstream while two others send short "
    "requests, through Sluice with [scheduling] policy fifo and fair, alternating; then a "
    "batch key holds every slot while an interactive key's requests arrive, through fair "
    "Sluice with preemption off and on. With --long MINUTES instead: the flood's mix for that "
    "long through one fair Sluice with preemption, its TTFT minute by minute."
)


def wants_fairness(argv: Sequence[str]) -> bool:
    """Whether a ``python -m proxy.bench`` command line asks for this bench."""
    return FLAG in argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = FairnessSettings()
    add = parser.add_argument
    add(FLAG, action="store_true", required=True, help="run this bench")
    add(
        "--slots",
        type=int,
        default=d.slots,
        help="the fake's max_running, Sluice's max_connections",
    )
    add("--rate", type=float, default=d.rate, help="B's requests per second, and C's")
    add("--flood-factor", type=float, default=d.flood_factor, help="A's rate over B's")
    add("--flood-seconds", type=float, default=d.flood_seconds, help="a flood phase's arrivals")
    add("--baseline-seconds", type=float, default=d.baseline_seconds, help="B and C alone")
    add("--ttft", type=float, default=d.ttft, help="the fake's seconds to the first token")
    add("--interval", type=float, default=d.interval, help="the fake's seconds per token")
    add("--flood-tokens", type=int, default=d.flood_tokens, help="tokens of A's answers")
    add("--short-tokens", type=int, default=d.short_tokens, help="tokens of B's and C's answers")
    add(
        "--deadline-requests",
        type=int,
        default=d.deadline_requests,
        help="B's requests with an SDK read timeout, sent behind A's backlog",
    )
    add(
        "--running-requests",
        type=int,
        default=d.running_requests,
        help="C's requests that pass their deadline while running",
    )
    add(
        "--preempt-after",
        type=float,
        default=d.preempt_after,
        help="[scheduling] preempt_after of the process that preempts (seconds)",
    )
    add(
        "--fair-preempt-after",
        type=float,
        metavar="SECONDS",
        help="[scheduling] preempt_after of the fair process of the FIFO/fair comparison "
        "(every key in band 0: preemption within one band); unset, it never preempts",
    )
    add(
        "--max-preemptions",
        type=int,
        default=d.max_preemptions,
        help="[scheduling] max_preemptions of both preemption phase processes",
    )
    add(
        "--batch-seconds",
        type=float,
        default=d.batch_seconds,
        help="a batch stream's time upstream, uninterrupted (one per slot)",
    )
    add("--batch-tokens", type=int, default=d.batch_tokens, help="tokens of a batch stream")
    add(
        "--urgent-rate",
        type=float,
        default=d.urgent_rate,
        help="the interactive key's requests per second while the batch runs",
    )
    add("--repeat", type=int, default=d.repeat, help="rounds of every phase (order reversed)")
    add("--timeout", type=float, default=d.timeout, help="seconds a phase may run past its load")
    add(
        "--long",
        type=float,
        metavar="MINUTES",
        help="instead of the phases: A's flood beside B (A's band) and C (a more urgent one) "
        "for MINUTES through one fair Sluice with preemption; TTFT per minute, flat or not",
    )
    # The long run's bucket, a minute; shorter only for a test that runs it in seconds.
    add("--bucket-seconds", type=float, default=d.bucket_seconds, help=argparse.SUPPRESS)
    add("--json", type=Path, help="write every figure as JSON here")
    add("--markdown", type=Path, help="write (or replace) this bench's section in this file")
    add("--check", action="store_true", help="exit 1 when a check fails")
    add("--quiet", action="store_true", help="no progress lines on stderr")


def settings_from_args(args: argparse.Namespace) -> FairnessSettings:
    return FairnessSettings(
        slots=args.slots,
        rate=args.rate,
        flood_factor=args.flood_factor,
        flood_seconds=args.flood_seconds,
        baseline_seconds=args.baseline_seconds,
        ttft=args.ttft,
        interval=args.interval,
        flood_tokens=args.flood_tokens,
        short_tokens=args.short_tokens,
        deadline_requests=args.deadline_requests,
        running_requests=args.running_requests,
        preempt_after=args.preempt_after,
        fair_preempt_after=args.fair_preempt_after,
        max_preemptions=args.max_preemptions,
        batch_seconds=args.batch_seconds,
        batch_tokens=args.batch_tokens,
        urgent_rate=args.urgent_rate,
        repeat=args.repeat,
        timeout=args.timeout,
        progress=not args.quiet,
        long_minutes=args.long,
        bucket_seconds=args.bucket_seconds,
    )


def all_passed(report: FairnessReport | LongReport) -> bool:
    lines = long_check_lines(report) if isinstance(report, LongReport) else check_lines(report)
    return not any("**FAIL**" in line for line in lines)


async def run_from_args(args: argparse.Namespace, command: str) -> FairnessReport | LongReport:
    settings = settings_from_args(args)
    report: FairnessReport | LongReport
    if settings.long_minutes is not None:
        report = make_long_report(await run_long_bench(settings, command=command))
        section = long_markdown(report)
    else:
        report = make_report(await run_fairness_bench(settings, command=command))
        section = markdown(report)
    print(section)
    # Small local files, written once at the end.
    if args.json is not None:
        write_text(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    if args.markdown is not None:
        old = read_text_or_none(str(args.markdown)) or ""
        write_text(args.markdown, upsert_section(old, settings.key(), section))
    return report


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench", command: str = ""
) -> None:
    """The command; ``command``: how it was invoked, for the report (the load bench's
    ``main``, which hands ``--fairness`` over, says)."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        report = run_stoppable(run_from_args, args, command)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        sys.exit(130)
    if args.check and not all_passed(report):
        raise SystemExit(1)
