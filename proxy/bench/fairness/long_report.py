"""The long run's report: its figures bucket by bucket, the flatness checks, its section in
docs/benchmarks.md (also what it prints) and its JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from proxy.bench.fairness.long_run import LongRun
from proxy.bench.fairness.minutes import Bucket, LongFigures, long_figures
from proxy.bench.fairness.settings import FLOODER, INTERACTIVE, KEYS, LONG_BANDS, MINUTE


@dataclass
class LongReport:
    run: LongRun
    figures: LongFigures

    def to_json(self) -> dict[str, Any]:
        run, figures = self.run, self.figures
        return {
            "bench": "fairness-long",
            "command": run.command,
            "date": run.date,
            "commit": run.commit,
            "machine": run.machine,
            "settings": asdict(run.settings),
            "bands": LONG_BANDS,
            "seconds": run.seconds,
            "edges_s": run.edges,
            "buckets": [
                asdict(b)
                | {
                    "completed_total": b.completed_total,
                    "tokens_per_s": b.tokens_per_s,
                    "cpu_share": b.cpu_share,
                    "cpu_ms_per_request": b.cpu_ms_per_request,
                }
                for b in figures.buckets
            ],
            "checks": [asdict(c) | {"ratio": c.ratio, "passed": c.passed} for c in figures.checks],
            "drained": figures.drained,
            "errors": figures.errors,
            "passed": figures.passed,
            "samples": [asdict(s) for s in run.samples],
        }


def make_long_report(run: LongRun) -> LongReport:
    figures = long_figures(
        run.requests,
        run.samples,
        origin=run.origin,
        edges=run.edges,
        keys=KEYS,
        interactive=INTERACTIVE,
    )
    return LongReport(run, figures)


# --------------------------------------------------------------------------- text


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _verdict(ok: bool) -> str:
    return "**pass**" if ok else "**FAIL**"


def _unit(bucket_seconds: float) -> str:
    return "minute" if bucket_seconds == MINUTE else f"bucket of {bucket_seconds:g} s"


def _label(bucket: Bucket, bucket_seconds: float) -> str:
    """Its number from 1, and its length when it is shorter than the others (the last)."""
    short = bucket.seconds < bucket_seconds - 1e-6
    return f"{bucket.index + 1}" + (f" ({bucket.seconds:.0f} s)" if short else "")


def _band(key: str) -> str:
    return f"{key} (band {LONG_BANDS[key]})"


def ttft_table(report: LongReport) -> list[str]:
    """Minute x key: TTFT p50 / p99 of the requests sent in it, and the interactive keys'
    wait in Sluice's queue."""
    bucket_seconds = report.run.settings.bucket_seconds
    head = [f"{_band(key)}: TTFT p50 / p99 (ms)" for key in KEYS]
    head += [f"{key}: wait in Sluice's queue p99 (ms)" for key in INTERACTIVE]
    rows = [
        f"| {_unit(bucket_seconds)} | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for bucket in report.figures.buckets:
        cells = [
            f"{_ms(bucket.keys[key].ttft_p50_s)} / {_ms(bucket.keys[key].ttft_p99_s)}"
            for key in KEYS
        ]
        cells += [_ms(bucket.keys[key].wait_p99_s) for key in INTERACTIVE]
        rows.append(f"| {_label(bucket, bucket_seconds)} | " + " | ".join(cells) + " |")
    return rows


def throughput_table(report: LongReport) -> list[str]:
    """Minute by minute: what was completed, and what it cost the proxy and the machine."""
    bucket_seconds = report.run.settings.bucket_seconds
    keys = " / ".join(KEYS)
    rows = [
        f"| {_unit(bucket_seconds)} | requests completed ({keys}) | tokens/s | pauses | "
        "proxy CPU (% of a core) | proxy CPU per request completed (ms) | proxy RSS (MiB) | "
        "load average (1 min, at its end) | B, C: served / sent |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in report.figures.buckets:
        completed = " / ".join(str(b.completed.get(key, 0)) for key in KEYS)
        share = None if b.cpu_share is None else b.cpu_share * 100
        rss = None if b.rss_bytes is None else b.rss_bytes / 2**20
        served = ", ".join(f"{b.keys[key].served} / {b.keys[key].sent}" for key in INTERACTIVE)
        rows.append(
            f"| {_label(b, bucket_seconds)} | {b.completed_total} ({completed}) | "
            f"{_num(b.tokens_per_s, ',.0f')} | {_num(b.preemptions, '.0f')} | "
            f"{_num(share, '.1f')} | {_num(b.cpu_ms_per_request, '.2f')} | "
            f"{_num(rss, '.1f')} | {_num(b.loadavg_1m, '.2f')} | {served} |"
        )
    return rows


def _errors(errors: dict[str, dict[str, int]]) -> str:
    parts = [
        f"{key}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        for key, kinds in sorted(errors.items())
    ]
    return "; ".join(parts) or "none"


def long_check_lines(report: LongReport) -> list[str]:
    figures = report.figures
    unit = _unit(report.run.settings.bucket_seconds)
    lines = [
        f"Flat, {_band(c.key)}: TTFT p99 in the last {unit} {_ms(c.last_p99_s)} ms <= "
        f"{c.slack:g} x {_ms(c.first_p99_s)} ms in the first (ratio {_num(c.ratio, '.2f')}): "
        + _verdict(c.passed)
        for c in figures.checks
    ]
    lines.append(
        f"Every request served as planned (not served: {_errors(figures.errors)}): "
        + _verdict(not figures.errors)
    )
    return lines


def long_markdown(report: LongReport) -> str:
    run, settings = report.run, report.run.settings
    machine = run.machine
    unit = _unit(settings.bucket_seconds)
    lines = [
        f"## Fair share for {settings.long_minutes:g} minutes: TTFT "
        + ("minute by minute" if unit == "minute" else f"per {unit}")
        + f", {settings.slots} slots, with preemption",
        "",
        f"- Machine: {machine.get('cores')} cores ({machine.get('cpu') or 'unknown CPU'}), "
        f"{machine.get('system')}, Python {machine.get('python')}; load average "
        f"{machine.get('loadavg_1m')} as it began (at the end of each {unit}: the second "
        "table)",
        f"- Date: {run.date}; commit: {run.commit or 'unknown'}; the whole run took "
        f"{run.seconds:.0f} s",
        f"- Command: `{run.command}`",
        f"- Load: {settings.describe_long()}",
        f"- System: one fake upstream (`--max-running {settings.slots}`) and ONE Sluice in "
        f"front of it: `max_connections = {settings.slots}`, keys "
        + ", ".join(f"{key} (`priority = {LONG_BANDS[key]}`)" for key in KEYS)
        + ' of weight 1; `[scheduling] policy = "fair"`, '
        f"`preempt_after = {settings.preempt_after:g}`, every other setting Sluice's default",
        f"- A request's TTFT and wait are in the {unit} it was sent in; requests completed "
        f"and their tokens in the {unit} they ended in ({report.figures.drained} served after "
        f"the load's end are in none); {FLOODER}'s TTFT includes its wait behind its own "
        "backlog",
        "",
        *ttft_table(report),
        "",
        *throughput_table(report),
        "",
        *(f"- {line}" for line in long_check_lines(report)),
    ]
    return "\n".join(lines) + "\n"
