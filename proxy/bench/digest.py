"""``python -m proxy.bench.digest REPORT.json ...``: one table across several loads, from the
``--json`` reports the load bench wrote (each load a run of its own, every system in it
alternating with Sluice in front of the same fake upstream).

* **Beside the floor**: each system's CPU per short request (a load of answers of at most
  ``SHORT_TOKENS`` tokens: what such a request costs is the request) or per relayed event (any
  other load), one column per load, with its ratio to the trio floor (``--peer trio-floor``)
  measured in the same load. ``--markdown FILE`` writes this table as its own section.
* **Against another Sluice** (``--peer sluice@REF`` in the loads): this tree's Sluice over
  REF's and the median of the ratios, against ``--limit``; ``--check`` makes a median over it
  the exit status. From one report of a load, its runs' ratios (the i-th run of each, side by
  side in the alternating schedule); from several reports of the same load (``make
  bench-ab`` runs each load three times), each report's pooled ratio: every bench run starts
  its own processes, and on this machine a process can run some percent slower or faster than
  another of the same code for its whole life, which runs within one bench cannot average out.

Only CPU figures: on a machine whose speed drifts within the hour, the ratio of two relays'
CPU measured in one run is what holds."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from proxy.bench.procfs import read_text_or_none
from proxy.bench.report import upsert_section, write_text
from proxy.bench.settings import BenchError
from proxy.bench.summary import percentile

# Answers this short or shorter make a load of short requests (its figure: CPU per request).
SHORT_TOKENS: Final = 5
FLOOR: Final = "trio-floor"
SLUICE_PEER: Final = "sluice-"  # the mode of ``--peer sluice@REF`` starts so
DEFAULT_LIMIT: Final = 1.10
SECTION_KEY: Final = "bench=cpu-beside-the-floor"


@dataclass(frozen=True)
class Load:
    """One load's report, as its ``--json`` holds it."""

    path: str
    report: Mapping[str, Any]

    @property
    def settings(self) -> Mapping[str, Any]:
        settings: Mapping[str, Any] = self.report["settings"]
        return settings

    @property
    def short(self) -> bool:
        return int(self.settings["tokens"]) <= SHORT_TOKENS

    @property
    def figure(self) -> str:
        """The figure this load is about (a field of the report's runs)."""
        return "proxy_cpu_us_per_request" if self.short else "proxy_cpu_us_per_event"

    @property
    def title(self) -> str:
        s = self.settings
        if self.short:
            return f"CPU per short request ({s['streams']} x {s['tokens']} tokens)"
        return f"CPU per event, {s['streams']} streams x {s['tokens']} tokens"

    def value(self, mode: str) -> float | None:
        run = self.report["runs"].get(mode)
        value = run.get(self.figure) if run else None
        return float(value) if value is not None else None

    def errors(self, mode: str) -> int:
        run = self.report["runs"].get(mode)
        return int(run.get("errors") or 0) if run else 0

    def label(self, mode: str) -> str:
        if mode == "proxy":
            return "Sluice"
        labels: Mapping[str, str] = self.report.get("labels", {})
        return labels.get(mode, mode)


def read_loads(paths: Sequence[str]) -> list[Load]:
    loads = []
    for path in paths:
        text = read_text_or_none(path)
        if text is None:
            raise BenchError(f"{path}: no such report (the load bench writes it with --json)")
        try:
            report = json.loads(text)
        except ValueError:
            report = None
        if not (
            isinstance(report, dict)
            and "tokens" in report.get("settings", {})
            and "proxy" in report.get("runs", {})
        ):
            raise BenchError(f"{path}: not a load bench report with Sluice in it")
        loads.append(Load(path, report))
    return loads


def _cpu(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} µs"


def _same_load(load: Load) -> str:
    return json.dumps(load.settings, sort_keys=True)


def group_loads(loads: Sequence[Load]) -> list[list[Load]]:
    """The reports of each load (the same settings), in the order the loads first come."""
    groups: dict[str, list[Load]] = {}
    for load in loads:
        groups.setdefault(_same_load(load), []).append(load)
    return list(groups.values())


def _median_value(group: Sequence[Load], mode: str) -> float | None:
    return percentile([v for load in group if (v := load.value(mode)) is not None], 50)


def floor_table(loads: Sequence[Load]) -> tuple[list[str], list[list[str]]]:
    """Rows: Sluice, the floor, then every other system in the order the loads name them;
    a column per load (several reports of one load: the median of their figures): the
    figure, and "Nx floor" where the floor ran in that load."""
    modes: list[str] = ["proxy", FLOOR]
    names: dict[str, str] = {}
    for load in loads:
        modes += [mode for mode in load.report["runs"] if mode not in modes]
        for mode in load.report["runs"]:
            names.setdefault(mode, load.label(mode))
    groups = group_loads(loads)
    header = ["system", *(group[0].title for group in groups)]
    rows = []
    for mode in modes:
        if mode not in names or mode == "direct":
            continue
        row = [names[mode]]
        for group in groups:
            value, floor = _median_value(group, mode), _median_value(group, FLOOR)
            if value is None:
                row.append("—")
                continue
            cell = _cpu(value)
            if floor and mode != FLOOR:
                cell += f" ({value / floor:.2f}x floor)"
            errors = sum(load.errors(mode) for load in group)
            if errors:
                cell += f", {errors} errors"
            row.append(cell)
        rows.append(row)
    return header, rows


@dataclass(frozen=True)
class Versus:
    """This tree's Sluice over another one in one load: from one report, its runs' ratios
    (run by run); from several reports of the same load, each report's pooled ratio (each
    bench run with processes of its own)."""

    loads: list[Load]
    mode: str

    @property
    def load(self) -> Load:
        return self.loads[0]

    @property
    def rounds(self) -> list[float]:
        if len(self.loads) == 1:
            by_figure = self.load.report.get("round_ratios", {}).get(f"proxy/{self.mode}", {})
            return [float(r) for r in by_figure.get(self.load.figure, [])]
        pooled = [(load.value("proxy"), load.value(self.mode)) for load in self.loads]
        return [mine / theirs for mine, theirs in pooled if mine is not None and theirs]

    @property
    def median(self) -> float | None:
        return percentile(self.rounds, 50)

    def value(self, mode: str) -> float | None:
        """The figure's median over the reports."""
        return percentile([v for load in self.loads if (v := load.value(mode)) is not None], 50)


def versus_sluice(loads: Sequence[Load]) -> list[Versus]:
    """Every load with another Sluice in it, its reports grouped by their settings."""
    groups: dict[tuple[str, str], list[Load]] = {}
    for load in loads:
        for mode in load.report["runs"]:
            if mode.startswith(SLUICE_PEER):
                groups.setdefault((_same_load(load), mode), []).append(load)
    return [Versus(group, mode) for (_, mode), group in groups.items()]


def versus_table(
    versus: Sequence[Versus], limit: float
) -> tuple[list[str], list[list[str]], list[Versus]]:
    """The table, and the comparisons whose median is over ``limit`` (or unknown)."""
    header = ["load", "Sluice", "the other", "ratios", "median", f"≤ {limit:.2f}x"]
    rows, over = [], []
    for v in versus:
        mine, theirs = v.value("proxy"), v.value(v.mode)
        median = v.median
        ok = median is not None and median <= limit
        if not ok:
            over.append(v)
        each = "run by run" if len(v.loads) == 1 else f"one per bench run, {len(v.loads)} runs"
        rows.append(
            [
                v.load.title,
                _cpu(mine) if mine is not None else "—",
                f"{v.load.label(v.mode)}: {_cpu(theirs)}" if theirs is not None else "—",
                (", ".join(f"{r:.2f}x" for r in v.rounds) or "—") + f" ({each})",
                f"{median:.2f}x" if median is not None else "—",
                "yes" if ok else "no",
            ]
        )
    return header, rows, over


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(line.rstrip() for line in lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def floor_section(loads: Sequence[Load]) -> str:
    header, rows = floor_table(loads)
    lines = [
        "## CPU per request and per event, beside the floor",
        "",
        "What each relay's processes spent (user + system CPU) per short request and per "
        "relayed event, each load one run of the bench with every system alternating with "
        "Sluice in front of the same fake upstream. The floor is a bare trio relay on raw "
        "sockets, one task per connection, with no contracts at all "
        "(`proxy/bench/peers/trio_floor.py`, `--peer trio-floor`): what trio itself costs. "
        '"x floor" is over the floor in the same load; a system with no figure did not run '
        "that load. Written by `python -m proxy.bench.digest` from the loads' `--json` "
        "reports (`make bench`).",
        "",
        *markdown_table(header, rows),
        "",
    ]
    for load in loads:
        r = load.report
        lines.append(
            f"- {load.title}: `{r.get('command', '')}`; {r.get('date', '')}, commit "
            f"{r.get('commit') or 'unknown'}"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.bench.digest", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("reports", nargs="+", help="load bench reports (--json)")
    parser.add_argument("--markdown", type=Path, help="write the floor table's section here")
    parser.add_argument(
        "--limit",
        type=float,
        default=DEFAULT_LIMIT,
        help="the most this Sluice may cost over another (sluice@REF), median of its runs",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a median is over --limit (or unknown)"
    )
    args = parser.parse_args(argv)
    try:
        loads = read_loads(args.reports)
    except BenchError as error:
        print(f"sluice bench digest: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(text_table(*floor_table(loads)))
    versus = versus_sluice(loads)
    over: list[Versus] = []
    if versus:
        header, rows, over = versus_table(versus, args.limit)
        print()
        print("This Sluice over the other, CPU, each run beside the other's:")
        print(text_table(header, rows))
    if args.markdown is not None:
        old = read_text_or_none(str(args.markdown)) or ""
        write_text(args.markdown, upsert_section(old, SECTION_KEY, floor_section(loads)))
    if args.check:
        if not versus:
            print("sluice bench digest: --check: no --peer sluice@REF in these reports")
            raise SystemExit(1)
        if over:
            print(f"over {args.limit:.2f}x (or unknown): " + ", ".join(v.load.title for v in over))
            raise SystemExit(1)


if __name__ == "__main__":
    main()
