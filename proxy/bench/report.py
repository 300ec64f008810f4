"""The bench's report: the table printed after a run, the JSON written with ``--json``, and
this load's section in docs/benchmarks.md (replaced in place by its key)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import trio

from proxy.bench.headings import unique_headings
from proxy.bench.settings import BENCH_BUDGET, BENCH_GUARD_PATTERN, BenchSettings
from proxy.bench.summary import ROUND_FIGURES, RunData, RunSummary, percentile
from proxy.bench.tracing_ab import TracingTally
from proxy.bench.tracing_ab import markdown_lines as tracing_lines

# (field, label, format). Formats: "d" integer, ".Nf" fixed.
FIGURES: Final[tuple[tuple[str, str, str], ...]] = (
    ("streams", "streams", "d"),
    ("completed", "completed (not dropping)", "d"),
    ("dropped", "dropped as planned", "d"),
    ("errors", "errors", "d"),
    ("wall_s", "wall time (s)", ".2f"),
    ("events", "events delivered", "d"),
    ("events_per_s", "events/s", ".0f"),
    ("connect_p50_ms", "connect p50 (ms)", ".2f"),
    ("connect_p99_ms", "connect p99 (ms)", ".2f"),
    ("ttft_p50_ms", "TTFT p50 (ms)", ".1f"),
    ("ttft_p99_ms", "TTFT p99 (ms)", ".1f"),
    ("gap_p50_ms", "inter-token gap p50 (ms)", ".2f"),
    ("gap_p99_ms", "inter-token gap p99 (ms)", ".2f"),
    ("cancel_p50_ms", "cancel propagation p50 (ms)", ".2f"),
    ("cancel_p99_ms", "cancel propagation p99 (ms)", ".2f"),
    ("cancel_max_ms", "cancel propagation max (ms)", ".2f"),
    ("cancel_unseen", "dropped, upstream never saw close", "d"),
    ("cancel_unmatched", "dropped, no upstream record", "d"),
    ("wasted_tokens_mean", "wasted tokens/dropped stream, mean", ".1f"),
    ("wasted_tokens_max", "wasted tokens/dropped stream, max", "d"),
    ("wasted_tokens_total", "tokens for nobody (all dropped streams)", "d"),
    ("proxy_cpu_s", "proxy CPU (s)", ".2f"),
    ("proxy_cpu_wait_s", "proxy waiting for a core (s)", ".2f"),
    ("proxy_cpu_us_per_event", "proxy CPU per event (µs)", ".0f"),
    ("proxy_cpu_us_per_request", "proxy CPU per request (µs)", ".0f"),
    ("proxy_peak_rss_mib", "proxy peak RSS (MiB)", ".1f"),
    ("proxy_rss_start_mib", "proxy RSS as the run began (MiB)", ".1f"),
    ("proxy_rss_growth_mib", "proxy RSS rise during the run (MiB)", ".1f"),
    ("upstream_peak_rss_mib", "fake upstream peak RSS (MiB)", ".1f"),
    ("upstream_cpu_us_per_event", "fake upstream CPU per event (µs)", ".1f"),
    ("client_cpu_us_per_event", "load generator CPU per event (µs)", ".1f"),
    ("slow_streams", "slow readers", "d"),
    ("slow_completed", "slow readers completed", "d"),
    ("slow_read_p50_s", "slow reader's read time p50 (s)", ".2f"),
    ("slow_read_max_s", "slow reader's read time max (s)", ".2f"),
    ("slow_upstream_held_min_s", "upstream held back by a slow reader, min (s)", ".2f"),
    ("slow_upstream_held_p50_s", "upstream held back by a slow reader, p50 (s)", ".2f"),
    ("slow_upstream_held_max_s", "upstream held back by a slow reader, max (s)", ".2f"),
    ("other_upstream_held_p99_s", "upstream held back, other streams, p99 (s)", ".2f"),
)
# Counts of the load itself: the same on both sides by construction, no ratio.
_NO_RATIO: Final = frozenset({"streams", "completed", "dropped", "slow_streams"})
# Rows of a load with slow readers only.
_SLOW_ROWS: Final = frozenset(
    name for name, _, _ in FIGURES if name.startswith(("slow_", "other_upstream"))
)
# Rows about dropped streams: nothing to say where none left as planned (a load without drops).
_DROP_ROWS: Final = frozenset(
    name for name, _, _ in FIGURES if name.startswith(("cancel_", "wasted_"))
)


def ratios(proxy: RunSummary, direct: RunSummary) -> dict[str, float | None]:
    """proxy / reference (direct or baseline) for every figure both sides measured (None
    where the reference is 0)."""
    out: dict[str, float | None] = {}
    for name, _, _ in FIGURES:
        if name in _NO_RATIO:
            continue
        a, b = getattr(proxy, name), getattr(direct, name)
        if a is None or b is None:
            continue
        out[name] = a / b if b else None
    return out


def round_ratios(
    rounds: Mapping[str, Sequence[Mapping[str, float | None]]],
) -> dict[str, dict[str, list[float]]]:
    """The proxy over every other mode, run by run: ``{"proxy/nginx": {"proxy_cpu_us_per_event":
    [r1, r2, r3]}}``. The i-th run of one mode is paired with the i-th of the proxy, which the
    alternating schedule runs beside it; a pair missing a figure is left out."""
    if "proxy" not in rounds:
        return {}
    out: dict[str, dict[str, list[float]]] = {}
    for ref, theirs in rounds.items():
        if ref == "proxy":
            continue
        by_figure = {}
        for name in ROUND_FIGURES:
            values = []
            for mine, other in zip(rounds["proxy"], theirs, strict=False):
                a, b = mine.get(name), other.get(name)
                if a is not None and b:
                    values.append(a / b)
            if values:
                by_figure[name] = values
        if by_figure:
            out[f"proxy/{ref}"] = by_figure
    return out


def round_lines(report: BenchReport, labels: Mapping[str, str] | None = None) -> list[str]:
    """One line per ratio and figure, where some mode ran more than once: each run's ratio,
    then their median (the figure that a machine's drift moves least)."""
    if not any(len(runs) > 1 for runs in report.rounds.values()):
        return []
    labels = labels or {}
    figures = {name: label for name, label, _ in FIGURES}
    lines = []
    for ratio, by_figure in round_ratios(report.rounds).items():
        shown: list[str] = []
        for name, values in by_figure.items():
            each = ", ".join(f"{value:.2f}x" for value in values)
            if each in shown:
                continue  # per request as per event: every system relayed the same events
            shown.append(each)
            figure = figures[name]
            median = percentile(values, 50)
            lines.append(
                f"{labels.get(ratio, ratio)}, {figure}, run by run: {each} (median {median:.2f}x)"
            )
    return lines


def _fmt(value: float | int | None, spec: str) -> str:
    if value is None:
        return "—"
    if spec == "d":
        return str(round(value))
    return format(value, spec)


def all_ratios(summaries: dict[str, RunSummary]) -> dict[str, dict[str, float | None]]:
    """``{"proxy/versus": ..., "proxy/envoy": ..., "proxy/direct": ..., "proxy/baseline": ...}``:
    the proxy over every other mode present, in the order of ``summaries`` (the columns')."""
    if "proxy" not in summaries:
        return {}
    return {
        f"proxy/{ref}": ratios(summaries["proxy"], summaries[ref])
        for ref in summaries
        if ref != "proxy"
    }


def table_rows(
    summaries: dict[str, RunSummary], labels: dict[str, str] | None = None
) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows; ``labels`` (see :func:`column_labels`) rename the columns
    of modes and ratios."""
    labels = labels or {}
    modes = list(summaries)
    rates = all_ratios(summaries)
    header = ["figure", *(labels.get(m, m) for m in modes), *(labels.get(r, r) for r in rates)]
    slow = any(summary.slow_streams for summary in summaries.values())
    dropped = any(summary.dropped for summary in summaries.values())
    rows = []
    for name, label, spec in FIGURES:
        if (name in _SLOW_ROWS and not slow) or (name in _DROP_ROWS and not dropped):
            continue
        values = [getattr(summaries[mode], name) for mode in modes]
        row = [label, *(_fmt(value, spec) for value in values)]
        for rate in rates.values():
            value = rate.get(name)
            row.append("—" if value is None else f"{value:.2f}x")
        rows.append(row)
    return header, rows


def format_table(summaries: dict[str, RunSummary], labels: dict[str, str] | None = None) -> str:
    header, rows = table_rows(summaries, labels)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _errors_line(summaries: dict[str, RunSummary], labels: dict[str, str] | None = None) -> str:
    """Every error by kind, per mode (its column's label); "" when there were none."""
    labels = labels or {}
    parts = []
    for mode, summary in summaries.items():
        if summary.error_kinds:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(summary.error_kinds.items()))
            parts.append(f"{labels.get(mode, mode)}: {kinds}")
    return "errors by kind — " + "; ".join(parts) if parts else ""


def column_labels(
    settings: BenchSettings, peers: Mapping[str, PeerFacts | None] | None = None
) -> dict[str, str]:
    """Column names for modes and ratios that say more than the mode: with
    ``--versus-transport``, ``proxy (lean)``, ``proxy (httpx)`` and ``lean/httpx`` (and
    ``lean/direct`` and so on for the first proxy's other ratios); with ``--transport`` alone,
    ``proxy (httpx)``; with ``--versus-tracing``, ``proxy (traced)``, ``proxy (untraced)`` and
    ``traced/untraced``. A peer the bench started (``peers``) is its system's title."""
    labels: dict[str, str] = {}
    for mode, facts in (peers or {}).items():
        if facts is not None:
            labels[mode] = facts.title
    a, b = settings.transport, settings.versus_transport
    if settings.versus_tracing:
        a, b = "traced", "untraced"
    if settings.versus_budget:
        a, b = "budgeted", "unbudgeted"
    if settings.versus_fast_path:
        a, b = "fast path", "framework"
    if settings.versus_guard:
        a, b = "guarded", "unguarded"
    if b is None:
        return labels | ({"proxy": f"proxy ({a})"} if a != "auto" else {})
    labels |= {"proxy": f"proxy ({a})", "versus": f"proxy ({b})", "proxy/versus": f"{a}/{b}"}
    for ref in ("direct", "baseline", *(mode for mode, _ in settings.peer_modes())):
        labels[f"proxy/{ref}"] = f"{a}/{ref}"
    return labels


def _title(report: BenchReport, relay: str = "proxy") -> str:
    """What the load is, in words; ``relay`` names Sluice ("proxy" in the markdown, whose
    columns say so, "Sluice" on the plots)."""
    settings = report.settings
    title = f"{settings.streams} streams"
    if settings.workers > 1:
        title += f", {relay} with {settings.workers} workers"
    if settings.pin:
        title += (
            f", {relay} on a core of its own"
            if settings.workers == 1
            else f", {relay} on its own cores"
        )
    if settings.slow:
        title += f", {settings.slow:.0%} slow readers"
    if settings.versus_transport is not None:
        title += f", transport {settings.transport} vs {settings.versus_transport}"
    elif settings.transport != "auto":
        title += f", {settings.transport} transport"
    if settings.versus_tracing:
        title += ", traced vs untraced"
    if settings.versus_budget:
        title += ", token budget vs none"
    if settings.versus_fast_path:
        title += ", fast path vs framework"
    if settings.versus_guard:
        title += ", one regex output guard vs none"
    if settings.upstream_habit != "none":
        title += ", upstream " + settings.habit_text()
    others = [mode for mode in report.summaries if mode not in ("proxy", "versus")]
    if "proxy" in report.summaries and others:
        listed = ", ".join(others[:-1]) + " and " + others[-1] if len(others) > 1 else others[0]
        title += f", {relay} vs {listed}"
    return title


def markdown_section(report: BenchReport, plots: Sequence[tuple[str, str]] = ()) -> str:
    """The section of one load; ``plots`` are (description, link relative to the file)."""
    settings = report.settings
    machine = report.machine
    ram = machine.get("ram_bytes")
    ram_text = f"{ram / 2**30:.1f} GiB RAM" if ram else "RAM unknown"
    labels = column_labels(settings, report.peers)
    header, rows = table_rows(report.summaries, labels)
    lines = [
        f"## {_title(report)}",
        "",
        f"- Machine: {machine.get('cores')} cores ({machine.get('cpu') or 'unknown CPU'}), "
        f"{ram_text}, {machine.get('system')}, Python {machine.get('python')}; "
        f"load average {machine.get('loadavg_1m')} as it began",
        f"- Date: {report.date}; commit: {report.commit or 'unknown'}",
        f"- Command: `{report.command}`",
        f"- Load: {settings.describe()}",
    ]
    if "baseline" in report.summaries:
        lines.append(
            "- baseline: the same load through the same proxy, run just before, with the slow "
            "readers reading at full speed"
        )
    if "versus" in report.summaries and settings.versus_tracing:
        lines.append(
            f"- {labels['proxy']}: Sluice with tracing on, every request sampled "
            "(`OTEL_TRACES_SAMPLER=always_on`), exporting OTLP/HTTP protobuf to a receiver in "
            f"a thread of the bench (its CPU is the load generator's); {labels['versus']}: a "
            "second Sluice process, identical but for no tracing endpoint, relaying to the same "
            "fake upstream and alternating with it run by run; traced/untraced is "
            f"{labels['proxy']} over {labels['versus']}"
        )
    elif "versus" in report.summaries and settings.versus_fast_path:
        lines.append(
            f"- {labels['proxy']}: Sluice as it serves, plain HTTP/1.1 requests to the "
            "completion endpoints on its fast path (`proxy/server/fast_path.py`); "
            f"{labels['versus']}: a second Sluice process with `[server] fast_path = false`, "
            "every request through the HTTP server and framework of record, relaying to the "
            "same fake upstream and "
            f"alternating with it run by run; fast path/framework is {labels['proxy']} over "
            f"{labels['versus']}"
        )
    elif "versus" in report.summaries and settings.versus_guard:
        lines.append(
            f'- {labels["proxy"]}: Sluice with one `[[guards]]` table, `use = "regex"` at '
            f"the output stage on every request (deny `{BENCH_GUARD_PATTERN}`, which no token "
            'matches; windows of 32 tokens, `release = "after"`: each window held until it '
            f"passed); {labels['versus']}: a second Sluice process without it, relaying to the "
            "same fake upstream and alternating with it run by run; guarded/unguarded is "
            f"{labels['proxy']} over {labels['versus']}"
        )
    elif "versus" in report.summaries and settings.versus_budget:
        lines.append(
            f"- {labels['proxy']}: Sluice whose key (which every request carries) has "
            f"`tokens_per_minute = {BENCH_BUDGET}`, too large to refuse anything: each request is "
            "metered (its reservation admitted in the window, its stream counted, settled when "
            f"it ends); {labels['versus']}: a second Sluice process, the same key without a "
            "budget, relaying to the same fake upstream and alternating with it run by run; "
            f"budgeted/unbudgeted is {labels['proxy']} over {labels['versus']}"
        )
    elif "versus" in report.summaries:
        a, b = settings.transport, settings.versus_transport
        lines.append(
            f"- {labels['versus']}: a second Sluice process, identical to {labels['proxy']} but "
            f'for `transport = "{b}"` in its `[upstream]`, relaying to the same fake upstream '
            f"and alternating with it run by run; {a}/{b} is {labels['proxy']} over "
            f"{labels['versus']}"
        )
    for mode, _ in settings.peer_modes():
        if mode not in report.summaries:
            continue
        facts = report.peers.get(mode)
        shown = labels.get(mode, mode)
        if facts is None:
            what = "a gateway already running (`--peer URL`)"
        else:
            version = f" (version {facts.version})" if facts.version else ""
            what = f"`{facts.package}`{version}, started by the bench ({facts.how})"
        lines.append(
            f"- {shown}: {what}, relaying to the same fake upstream, alternating with the "
            "proxy; its CPU and RSS rows are its process tree"
        )
    if report.cpus:
        where = "; ".join(
            f"{name.replace('_', ' ')} on CPU {','.join(map(str, cpus))}"
            for name, cpus in report.cpus.items()
        )
        lines.append(f"- Pinned (`--pin`): {where}")
    if report.env:
        env = " ".join(f"{k}={v}" for k, v in sorted(report.env.items()))
        lines.append(f"- Environment: `{env}`")
    if report.tracing is not None:
        rate = all_ratios(report.summaries).get("proxy/versus", {})
        lines += tracing_lines(
            report.tracing,
            rate.get("proxy_cpu_us_per_event"),
            _cpu_per_request_us(report.summaries["proxy"], report.summaries["versus"]),
        )
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    errors = _errors_line(report.summaries, labels)
    if errors:
        lines += ["", errors]
    rounds = round_lines(report, labels)
    if rounds:
        lines += ["", *(f"- {line}" for line in rounds)]
    if plots:
        lines.append("")
        lines += [f"![{alt}]({link})" for alt, link in plots]
    return "\n".join(lines) + "\n"


def _cpu_per_request_us(a: RunSummary, b: RunSummary) -> float | None:
    """How much more CPU ``a`` spent per request (stream) than ``b``, in µs."""
    if a.proxy_cpu_s is None or b.proxy_cpu_s is None or not a.streams or not b.streams:
        return None
    return (a.proxy_cpu_s / a.streams - b.proxy_cpu_s / b.streams) * 1e6


_MD_TITLE: Final = """# Benchmarks

Written by `python -m proxy.bench ... --markdown docs/benchmarks.md` (`make bench`). Each run
replaces its own section (same load settings), so re-running keeps this file current.
"""


def upsert_section(text: str, key: str, section: str) -> str:
    """Put ``section`` between markers named by ``key``: in place of the old one, or at the end.
    Its headings are made unique in the document, and may not name a tracker entry
    (:mod:`proxy.bench.headings`)."""
    begin, end = f"<!-- bench:begin {key} -->", f"<!-- bench:end {key} -->"
    if not text.strip():
        text = _MD_TITLE
    start = text.find(begin)
    stop = text.find(end, start) if start >= 0 else -1
    others = text[:start] + text[stop + len(end) :] if start >= 0 and stop >= 0 else text
    section = unique_headings(section, key, others)
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if start >= 0 and stop >= 0:
        rest = text[stop + len(end) :].lstrip("\n")
        # A blank line before whatever follows (another section, bench_local's), as appended.
        return text[:start] + block + ("\n" + rest if rest else "")
    return text.rstrip("\n") + "\n\n" + block


@dataclass(frozen=True)
class PeerFacts:
    """What a report says of a peer the bench started (from its ``PeerSpec``)."""

    title: str
    package: str
    how: str
    version: str = ""  # what the installed system reports (nginx: Debian's build)


@dataclass
class BenchReport:
    settings: BenchSettings
    summaries: dict[str, RunSummary]
    machine: dict[str, Any]
    command: str
    commit: str | None
    date: str
    env: dict[str, str]
    pids: dict[str, int]  # the children the bench started (gone once it returns)
    # The raw material, pooled per mode (in the JSON only its RSS samples: the rest is one
    # entry per stream and token).
    runs: dict[str, RunData] = field(default_factory=dict)
    # With --pin: the CPUs each process ran on ("load_generator" is this one).
    cpus: dict[str, list[int]] = field(default_factory=dict)
    # With --versus-tracing: the spans the traced proxy sent against its requests.
    tracing: TracingTally | None = None
    # Each peer's mode: what the bench started there (None: a peer given by URL).
    peers: dict[str, PeerFacts | None] = field(default_factory=dict)
    # Each mode's CPU figures run by run, in the order they ran (summary.round_figures).
    rounds: dict[str, list[dict[str, float | None]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "command": self.command,
            "date": self.date,
            "commit": self.commit,
            "machine": self.machine,
            "env": self.env,
            "settings": dataclasses.asdict(self.settings),
            "cpus": self.cpus,
            "runs": {mode: summary.to_json() for mode, summary in self.summaries.items()},
        }
        rates = all_ratios(self.summaries)
        if "proxy/direct" in rates:
            out["ratios"] = rates["proxy/direct"]
        if "proxy/baseline" in rates:
            out["ratios_baseline"] = rates["proxy/baseline"]
        peer_modes = [mode for mode, _ in self.settings.peer_modes()]
        if len(peer_modes) == 1 and f"proxy/{peer_modes[0]}" in rates:
            out["ratios_peer"] = rates[f"proxy/{peer_modes[0]}"]
        out["ratios_peers"] = {
            mode: rates[f"proxy/{mode}"] for mode in peer_modes if f"proxy/{mode}" in rates
        }
        out["peers"] = {
            mode: dataclasses.asdict(facts) if facts is not None else None
            for mode, facts in self.peers.items()
        }
        if "proxy/versus" in rates:
            out["ratios_versus"] = rates["proxy/versus"]
        out["rounds"] = self.rounds
        out["round_ratios"] = round_ratios(self.rounds)
        if self.tracing is not None:
            out["tracing"] = self.tracing.to_json()
        # What the columns are called in the table (the transports, with --versus-transport).
        out["labels"] = column_labels(self.settings, self.peers)
        # RSS over time, per mode and run: [seconds since the run began, bytes].
        out["rss_samples"] = {
            mode: [
                {
                    name: [[round(at, 3), size] for at, size in samples]
                    for name, samples in trace.items()
                }
                for trace in run.rss
            ]
            for mode, run in self.runs.items()
        }
        return out


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def relative_link(path: Path, base: Path) -> str:
    """``path`` as a markdown link from a file in ``base``."""
    return Path(os.path.relpath(path, base)).as_posix()


async def show_progress(label: str, counts: Callable[[], str], out: TextIO) -> None:
    """One line on ``out``, rewritten in place on a terminal, a line every 5 s in a log:
    the label, the seconds since the start, and what ``counts`` says. Runs until cancelled."""
    tty = out.isatty()
    started = time.monotonic()

    def show(final: bool = False) -> None:
        line = f"[{label}] {time.monotonic() - started:5.1f} s  {counts()}"
        end = "\n" if final or not tty else ""
        print("\r" + line if tty else line, end=end, file=out, flush=True)

    try:
        while True:
            await trio.sleep(0.25 if tty else 5.0)
            show()
    finally:
        # Cancelled once the run is over: the final count, so the log ends with the truth.
        show(final=True)
