"""The matrix's JSON reports read for the scorecard: a report checked (a clear exit naming the
file when it is not one), the cells that count (ran, judged, short of a target), and the
figures of the side-by-side table."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, TypedDict

from proxy.bench.matrix.cells import ENDPOINTS, LEAVES, PHASES, TRANSPORTS
from proxy.relay.state import Phase

PROG: Final = "python -m proxy.bench.scorecard"
# The targets: cancel p99 for an upstream; decode steps after the client went for the
# local model (the step in flight when Sluice saw it go may finish).
TARGET_P99_MS: Final = 10.0
TARGET_STEPS: Final = 1
REQUIRED: Final = ("system", "commit", "versions", "measured_at", "repeat", "cells")
AXES: Final = {"phase": PHASES, "transport": TRANSPORTS, "endpoint": ENDPOINTS, "leave": LEAVES}

Cell = dict[str, Any]
Report = dict[str, Any]


class Summary(TypedDict):
    system: str
    commit: str
    kind: str
    n: int
    served_cells: int
    cancelled_all: int
    never_cancelled_cells: int
    never_cancelled_trials: int
    # Per leave; None where no cell of that leave has the figure.
    worst_p99_ms: dict[str, float | None]
    worst_steps: dict[str, int | None]
    over_target_cells: int
    tokens_for_nobody: int
    next_served: int
    next_trials: int
    # None where the bench could not look inside the system (any system but its own Sluice).
    worst_fds_over_baseline: int | None
    active_streams_left_cells: int | None
    # Trials whose trace said what happened, of the trials judged; None where no trace was
    # judged (a peer, a target, a report from before the traces).
    traced: int | None
    trace_trials: int | None


def load_report(path: Path) -> Report:
    """The report in ``path``; SystemExit naming the file if it is absent or not a report."""

    def fail(why: str) -> SystemExit:
        return SystemExit(f"{PROG}: {path}: {why}")

    try:
        report = json.loads(path.read_text())
    except OSError as exc:
        raise fail(exc.strerror or str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise fail(f"not JSON ({exc})") from None
    if not isinstance(report, dict):
        raise fail("not a matrix report (expected a JSON object)")
    missing = [key for key in REQUIRED if key not in report]
    if missing:
        raise fail(f"not a matrix report (no {', '.join(missing)})")
    if not isinstance(report["cells"], list) or not isinstance(report["versions"], dict):
        raise fail("not a matrix report (cells must be a list, versions an object)")
    for number, cell in enumerate(report["cells"]):
        wrong = _wrong_cell(cell)
        if wrong:
            raise fail(f"cell {number}: {wrong}")
    return report


def _wrong_cell(cell: object) -> str:
    if not isinstance(cell, dict):
        return "not an object"
    for axis, allowed in AXES.items():
        if cell.get(axis) not in allowed:
            return f"{axis} {cell.get(axis)!r} is not one of {', '.join(allowed)}"
    for key in ("n", "served", "applicable"):
        if key not in cell:
            return f"no {key}"
    return ""


def kind(report: Report) -> str:
    """``upstream`` (a proxy in front of the fake) or ``local`` (Sluice's own model); a
    report that names no kind is an upstream one."""
    return str(report.get("kind") or "upstream")


def ran_cells(report: Report) -> list[Cell]:
    """The cells whose trials ran: served, and the phase exists for the transport."""
    return [c for c in report["cells"] if c["served"] and c["applicable"]]


def judged_cells(report: Report) -> list[Cell]:
    return [c for c in ran_cells(report) if c.get("cancelled") is not None]


def cell_name(cell: Cell) -> str:
    return f"{cell['transport']} {cell['phase']} {cell['endpoint']} {cell['leave']}"


def never_cancelled(report: Report) -> list[Cell]:
    # after_last counts completed answers: 0/N there is an answer cut short, not a cancel.
    return [
        c for c in judged_cells(report) if c["cancelled"] == 0 and c["phase"] != Phase.AFTER_LAST
    ]


def partly_cancelled(report: Report) -> list[Cell]:
    return [
        c
        for c in judged_cells(report)
        if 0 < c["cancelled"] < c["n"] and c["phase"] != Phase.AFTER_LAST
    ]


def incomplete_answers(report: Report) -> list[Cell]:
    return [
        c
        for c in judged_cells(report)
        if c["phase"] == Phase.AFTER_LAST and c["cancelled"] < c["n"]
    ]


def steps_after_leave(cell: Cell) -> int | None:
    steps = cell.get("steps_after_leave_max")
    return None if steps is None else int(steps)


def over_target(report: Report) -> list[Cell]:
    if kind(report) == "local":
        return [c for c in ran_cells(report) if (steps_after_leave(c) or 0) > TARGET_STEPS]
    return [c for c in ran_cells(report) if (c.get("p99_ms") or 0.0) > TARGET_P99_MS]


def trace_counts(cell: Cell) -> tuple[int, int] | None:
    """(trials whose trace said what happened, trials judged) of a cell, or None where its
    traces were not judged (the field is absent from the reports of other systems, and from
    those written before it)."""
    trace = cell.get("trace")
    if not isinstance(trace, dict):
        return None
    return int(trace.get("traced") or 0), int(trace.get("judged") or 0)


def trace_short(report: Report) -> list[Cell]:
    """The cells with a trial whose trace did not say what happened."""
    return [c for c in ran_cells(report) if (counts := trace_counts(c)) and counts[0] < counts[1]]


def _worst(values: Iterable[float | int | None]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarise(report: Report) -> Summary:
    """The figures of the side-by-side table."""
    ran = ran_cells(report)
    judged = judged_cells(report)
    never = never_cancelled(report)
    measured_active = [c for c in ran if c.get("active_streams_after") is not None]
    traces = [counts for c in ran if (counts := trace_counts(c)) is not None]
    return Summary(
        system=str(report["system"]),
        commit=str(report["commit"]),
        kind=kind(report),
        n=int(report["repeat"]),
        served_cells=len(ran),
        cancelled_all=sum(1 for c in judged if c["cancelled"] == c["n"]),
        never_cancelled_cells=len(never),
        never_cancelled_trials=sum(int(c["n"]) for c in never),
        worst_p99_ms={
            leave: _worst(c.get("p99_ms") for c in ran if c["leave"] == leave) for leave in LEAVES
        },
        worst_steps={
            leave: _worst(steps_after_leave(c) for c in ran if c["leave"] == leave)
            for leave in LEAVES
        },
        over_target_cells=len(over_target(report)),
        tokens_for_nobody=sum(int(c.get("tokens_for_nobody") or 0) for c in ran),
        next_served=sum(int(c.get("next_served") or 0) for c in judged),
        next_trials=sum(int(c["n"]) for c in judged),
        worst_fds_over_baseline=_worst(c.get("fds_over_baseline") for c in ran),
        active_streams_left_cells=(
            sum(1 for c in measured_active if c["active_streams_after"] > 0)
            if measured_active
            else None
        ),
        traced=sum(k for k, _ in traces) if traces else None,
        trace_trials=sum(n for _, n in traces) if traces else None,
    )
