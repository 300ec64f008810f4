"""``sluice bench``: a reproducible load generator that measures what the proxy promises.

This module is its command line (``python -m proxy.bench``, ``sluice bench``): the flags, the
settings they make, and what a run prints and writes. The package docstring says what is
measured."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from proxy.bench.children import run_stoppable
from proxy.bench.peers import PEER_NAMES
from proxy.bench.plots import load_pyplot, write_plots
from proxy.bench.procfs import read_text_or_none
from proxy.bench.report import (
    _errors_line,
    column_labels,
    format_table,
    markdown_section,
    relative_link,
    round_lines,
    upsert_section,
    write_text,
)
from proxy.bench.run import run_bench
from proxy.bench.settings import (
    DEFAULT_HABIT_SECONDS,
    HABITS,
    TRANSPORTS,
    BenchError,
    BenchSettings,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchSettings()
    _add_load_arguments(parser.add_argument, d)
    _add_system_arguments(parser.add_argument, d)
    _add_output_arguments(parser.add_argument)


def _add_load_arguments(add: Callable[..., Any], d: BenchSettings) -> None:
    """The load: its streams, the fake's schedule, who leaves, who reads slowly, the buffers."""
    add("--streams", type=int, default=d.streams, help="concurrent streaming requests")
    add("--ramp", type=float, default=d.ramp, help="seconds over which streams start, evenly")
    add("--ttft", type=float, default=d.ttft, help="fake upstream: seconds to the first token")
    add("--interval", type=float, default=d.interval, help="fake upstream: seconds per token")
    add("--tokens", type=int, default=d.tokens, help="fake upstream: tokens per answer")
    add("--drop", type=float, default=d.drop, help="fraction of clients that leave mid-stream")
    add("--drop-at", type=int, default=d.drop_at, help="a leaving client closes after token K")
    add("--slow", type=float, default=d.slow, help="fraction of clients that read slowly")
    add("--slow-delay", type=float, default=d.slow_delay, help="a slow reader's sleep per read")
    add(
        "--slow-rcvbuf",
        type=int,
        default=d.slow_rcvbuf,
        help="SO_RCVBUF of slow readers' sockets, bytes (0: OS default)",
    )
    add(
        "--slow-mss",
        type=int,
        default=d.slow_mss,
        help="TCP_MAXSEG of slow readers' sockets, e.g. 1460 as on Ethernet (0: OS default)",
    )
    add(
        "--upstream-sndbuf",
        type=int,
        default=d.upstream_sndbuf,
        help="SO_SNDBUF of the fake upstream's sockets, bytes (0: OS default)",
    )
    add(
        "--proxy-rcvbuf",
        type=int,
        default=d.proxy_rcvbuf,
        help="the proxy's SO_RCVBUF towards the upstream, bytes (0: OS default)",
    )
    add(
        "--event-pad",
        type=int,
        default=d.event_pad,
        help="make every event this many bytes longer (via the model name)",
    )
    add("--seed", type=int, default=d.seed, help="seed of who leaves and who reads slowly")


def _add_system_arguments(add: Callable[..., Any], d: BenchSettings) -> None:
    """What the load runs at: the proxy, the systems compared with it, how often, how long."""
    add("--direct", action="store_true", help="also run the same load straight at the upstream")
    add(
        "--baseline",
        action="store_true",
        help="also run the same load through the proxy with the slow readers reading fast",
    )
    add("--repeat", type=int, default=d.repeat, help="runs per mode, alternating, pooled")
    add("--grace", type=float, default=d.grace, help="seconds to wait for upstream to see closes")
    add("--timeout", type=float, default=d.timeout, help="seconds a run may take after its ramp")
    add("--target", help="an already running proxy (http://host:port) instead of starting one")
    add("--upstream", help="an already running fake upstream (http://host:port)")
    add("--proxy-pid", type=int, help="with --target: its PID, for CPU and RSS figures")
    add(
        "--peer",
        action="append",
        default=[],
        metavar="NAME_OR_URL",
        help="also run the load through another gateway, alternating with the proxy; repeat "
        f"it to run several side by side. A name ({', '.join(PEER_NAMES)}; auto is fastapi) "
        "is installed under .peers/ when missing and started in front of the same fake; "
        "sluice@REF is another Sluice with the proxy's config, from the tree of git revision "
        "REF (extracted under .peers/) or from the checkout at path REF; a URL (anything "
        "with ://) is one already running (with --upstream, the fake it relays to)",
    )
    add(
        "--peer-pid",
        type=int,
        action="append",
        default=[],
        help="with --peer URL: its PID, for CPU and RSS figures (one per URL, in order)",
    )
    add("--model", default=d.model, help="model name to request")
    add(
        "--workers",
        type=int,
        default=d.workers,
        help="worker processes of the proxy the bench starts (its CPU and RSS: all of them)",
    )
    add(
        "--pin",
        action="store_true",
        help="give the proxy (and peer) CPUs of their own, the load generator and the fake "
        "upstream the others (Linux; needs workers + 1 CPUs)",
    )
    add(
        "--transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="the proxy's [upstream] transport (auto: lean here, the upstream being plain "
        "http:// with no proxy)",
    )
    add(
        "--versus-transport",
        choices=("lean", "httpx"),
        help="also run the load through a second proxy, the same but for this transport, "
        "alternating; ratios are --transport over it (an auto --transport is the other one)",
    )
    add(
        "--versus-tracing",
        action="store_true",
        help="the proxy traced (every request, OTLP/HTTP to a receiver in the bench) and a "
        "second one untraced take the load alternately; ratios are traced over untraced",
    )
    add(
        "--versus-budget",
        action="store_true",
        help="the proxy's key with a token budget too large to refuse anything (every request "
        "metered) and a second proxy, the same key without one, take the load alternately; "
        "ratios are budgeted over unbudgeted",
    )
    add(
        "--versus-fast-path",
        action="store_true",
        help="the proxy as it serves (plain requests on its fast path) and a second one with "
        "[server] fast_path = false (every request through the HTTP server and framework of "
        "record) take the load alternately; ratios are fast path over framework",
    )
    add(
        "--versus-guard",
        action="store_true",
        help="the proxy with one regex output guard on every request and a second one without "
        "take the load alternately; ratios are guarded over unguarded",
    )
    add(
        "--upstream-habit",
        choices=HABITS,
        default=d.upstream_habit,
        help="how the fake upstream ends kept-alive connections, as real servers do",
    )
    add(
        "--upstream-habit-seconds",
        type=float,
        metavar="S",
        help=f"the seconds of keepalive-timeout or late-close (default {DEFAULT_HABIT_SECONDS:g})",
    )


def _add_output_arguments(add: Callable[..., Any]) -> None:
    add("--json", type=Path, help="write every figure as JSON here")
    add("--markdown", type=Path, help="write (or replace) this load's section in this file")
    add(
        "--plots",
        type=Path,
        metavar="DIR",
        help="write PNG plots here (default with --markdown: next to the markdown file)",
    )
    add("--no-plots", action="store_true", help="no plots, even with --markdown")
    add("--quiet", action="store_true", help="no progress line on stderr")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(
        streams=args.streams,
        ramp=args.ramp,
        ttft=args.ttft,
        interval=args.interval,
        tokens=args.tokens,
        drop=args.drop,
        drop_at=args.drop_at,
        slow=args.slow,
        slow_delay=args.slow_delay,
        slow_rcvbuf=args.slow_rcvbuf,
        slow_mss=args.slow_mss,
        upstream_sndbuf=args.upstream_sndbuf,
        proxy_rcvbuf=args.proxy_rcvbuf,
        event_pad=args.event_pad,
        seed=args.seed,
        direct=args.direct,
        baseline=args.baseline,
        repeat=args.repeat,
        grace=args.grace,
        timeout=args.timeout,
        target=args.target,
        upstream=args.upstream,
        proxy_pid=args.proxy_pid,
        peers=tuple(args.peer),
        peer_pids=tuple(args.peer_pid),
        model=args.model,
        workers=args.workers,
        pin=args.pin,
        transport=args.transport,
        versus_transport=args.versus_transport,
        versus_tracing=args.versus_tracing,
        versus_budget=args.versus_budget,
        versus_fast_path=args.versus_fast_path,
        versus_guard=args.versus_guard,
        upstream_habit=args.upstream_habit,
        upstream_habit_seconds=args.upstream_habit_seconds,
        progress=not args.quiet,
    )


def command_line(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> str:
    if argv is not None:
        return shlex.join([*shlex.split(prog), *argv])
    program = Path(sys.argv[0]).name
    if program in ("bench.py", "__main__.py"):
        program = "python -m proxy.bench"
    return " ".join([program, shlex.join(sys.argv[1:])]).strip()


def plots_dir(args: argparse.Namespace) -> Path | None:
    """Where plots go: ``--plots``, else next to ``--markdown``; None with ``--no-plots``."""
    if getattr(args, "no_plots", False):
        return None
    plots: Path | None = getattr(args, "plots", None)
    if plots is not None:
        return plots
    markdown: Path | None = getattr(args, "markdown", None)
    return markdown.parent if markdown is not None else None


async def run_from_args(args: argparse.Namespace) -> None:
    plots = plots_dir(args)
    try:
        settings = settings_from_args(args)
        if plots is not None:
            load_pyplot()  # no matplotlib: say so now, not after minutes of load
        command = getattr(args, "bench_command", None) or command_line()
        report = await run_bench(settings, command=command)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"sluice bench: {settings.describe()}")
    labels = column_labels(settings, report.peers)
    print(format_table(report.summaries, labels))
    errors = _errors_line(report.summaries, labels)
    if errors:
        print(errors)
    for line in round_lines(report, labels):
        print(line)
    # Small local files, written once at the end: a blocking write is fine here.
    if args.json is not None:
        write_text(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    # After the figures are out: a plot that fails must not take them along.
    written = write_plots(report, plots) if plots is not None else []
    for _, path in written:
        print(f"plot: {path}")
    if args.markdown is not None:
        base = args.markdown.parent
        links = [(alt, relative_link(path, base)) for alt, path in written]
        old = read_text_or_none(str(args.markdown)) or ""
        section = markdown_section(report, links)
        write_text(args.markdown, upsert_section(old, settings.key(), section))


# What --help says of the command's three other benches (each has its own --help).
OTHER_BENCHES = """\
the same command runs three other benches, each with its own --help:
  {prog} --matrix
      the cancellation scorecard: a client leaves in every phase of a request
      (queued, connecting, head, first token, mid-stream, after the last), over
      SSE, JSON and WebSocket, for every endpoint; each cell says whether the
      upstream saw the client go, how fast (p50/p99), how many tokens were
      generated for nobody, and whether the trace says what happened (make
      scorecard writes docs/cancellation.md)
  {prog} --replicas N --instances M --sessions S
      the balance bench: least_busy, upstream_metrics and prefix_affinity in
      front of N fake replicas with a prefix cache (TTFT, cache-hit rate)
  {prog} --fairness
      the fairness bench: one key floods a saturated upstream while two others
      send short requests, through Sluice with policy fifo and with fair,
      alternating; TTFT per key, service differences against the VTC bound,
      CPU per event, and requests whose SDK deadline is shorter than the queue
"""


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> None:
    if "--fairness" in (sys.argv[1:] if argv is None else argv):
        # A bench of its own (proxy/bench/fairness/), loaded only when asked for.
        from proxy.bench.fairness import main as fairness_main

        fairness_main(argv, prog, command_line(argv, prog))
        return
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(__doc__ or "").splitlines()[0],
        epilog=OTHER_BENCHES.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.bench_command = command_line(argv, prog)
    try:
        run_stoppable(run_from_args, args)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        sys.exit(130)


def write_outputs(
    args: argparse.Namespace, key: str, figures: dict[str, Any], markdown: str
) -> None:
    """A bench's ``--json`` (its figures) and ``--markdown`` (its section, by ``key``)."""
    if args.json is not None:
        write_text(args.json, json.dumps(figures, indent=2) + "\n")
    if args.markdown is not None:
        old = read_text_or_none(str(args.markdown)) or ""
        write_text(args.markdown, upsert_section(old, key, markdown))


def bench_main(
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run_from_args: Callable[[argparse.Namespace, str], Any],
    argv: Sequence[str] | None,
    prog: str,
) -> None:
    """A bench's own ``main``: its arguments, then ``run_from_args`` under
    :func:`run_stoppable`; a BenchError is one line and status 1, Ctrl-C status 130."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = command_line(sys.argv[1:] if argv is None else argv, prog)
    try:
        run_stoppable(run_from_args, args, command)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        sys.exit(130)
