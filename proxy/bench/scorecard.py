"""``python -m proxy.bench.scorecard``: docs/cancellation.md assembled from the JSON reports
of ``sluice bench --matrix --json`` (one per system), with a heat-map per system.

    python -m proxy.bench.scorecard REPORT.json [REPORT.json ...] --markdown docs/cancellation.md
        [--images docs/]

The systems appear in the order given. The "Reading" is written from the figures, never by
hand, so that a rerun cannot leave a claim the new figures contradict. Each heat-map is
``cancellation-<system>.png`` in ``--images``, drawn so that the same report gives the same
bytes (a rerun on unchanged data leaves git with nothing to show).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, TypedDict

from proxy.bench import (
    BenchError,
    _read,
    _write_text,
    load_pyplot,
    relative_link,
    upsert_section,
)
from proxy.bench.matrix import ENDPOINTS, LEAVES, PHASES, TRANSPORTS, markdown_report

__all__ = [
    "Summary",
    "document",
    "heatmap",
    "image_name",
    "kind",
    "load_report",
    "main",
    "reading",
    "summarise",
]

PROG: Final = "python -m proxy.bench.scorecard"
# The targets: cancel p99 for an upstream; decode steps after the client went for the
# local model (the step in flight when Sluice saw it go may finish).
TARGET_P99_MS: Final = 10.0
TARGET_STEPS: Final = 1
# The document's prose wraps here, as the hand-written docs do.
WIDTH: Final = 96
# A reading lists at most this many cells by name; the tables below it hold the rest.
LISTED_CELLS: Final = 10
# The versions that tell systems apart, in this order; the full list is in each section.
KEY_VERSIONS: Final = (
    "python",
    "sluice",
    "bench (sluice)",
    "trio",
    "httpx",
    "fastapi",
    "uvicorn",
    "starlette",
    "litellm",
    "torch",
    "transformers",
)
REQUIRED: Final = ("system", "commit", "versions", "measured_at", "repeat", "cells")
AXES: Final = {"phase": PHASES, "transport": TRANSPORTS, "endpoint": ENDPOINTS, "leave": LEAVES}
# What a transport's request is, for a reading that says what was never cancelled.
REQUEST: Final = {
    "sse": "a streamed request",
    "json": "a non-streamed request before its answer",
    "ws": "a WebSocket request",
}
GENERIC_TARGET: Final = (
    "sluice bench --matrix --target http://127.0.0.1:PORT --fake-port 9099 --repeat 5"
)

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


# --------------------------------------------------------------------------- reading reports


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


def _ran(report: Report) -> list[Cell]:
    """The cells whose trials ran: served, and the phase exists for the transport."""
    return [c for c in report["cells"] if c["served"] and c["applicable"]]


def _judged(report: Report) -> list[Cell]:
    return [c for c in _ran(report) if c.get("cancelled") is not None]


def _name(cell: Cell) -> str:
    return f"{cell['transport']} {cell['phase']} {cell['endpoint']} {cell['leave']}"


def _never_cancelled(report: Report) -> list[Cell]:
    # after_last counts completed answers: 0/N there is an answer cut short, not a cancel.
    return [c for c in _judged(report) if c["cancelled"] == 0 and c["phase"] != "after_last"]


def _partly_cancelled(report: Report) -> list[Cell]:
    return [
        c for c in _judged(report) if 0 < c["cancelled"] < c["n"] and c["phase"] != "after_last"
    ]


def _incomplete(report: Report) -> list[Cell]:
    return [c for c in _judged(report) if c["phase"] == "after_last" and c["cancelled"] < c["n"]]


def _steps(cell: Cell) -> int | None:
    steps = cell.get("steps_after_leave_max")
    return None if steps is None else int(steps)


def _over_target(report: Report) -> list[Cell]:
    if kind(report) == "local":
        return [c for c in _ran(report) if (_steps(c) or 0) > TARGET_STEPS]
    return [c for c in _ran(report) if (c.get("p99_ms") or 0.0) > TARGET_P99_MS]


def _worst(values: Iterable[float | int | None]) -> Any:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarise(report: Report) -> Summary:
    """The figures of the side-by-side table."""
    ran = _ran(report)
    judged = _judged(report)
    never = _never_cancelled(report)
    measured_active = [c for c in ran if c.get("active_streams_after") is not None]
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
            leave: _worst(_steps(c) for c in ran if c["leave"] == leave) for leave in LEAVES
        },
        over_target_cells=len(_over_target(report)),
        tokens_for_nobody=sum(int(c.get("tokens_for_nobody") or 0) for c in ran),
        next_served=sum(int(c.get("next_served") or 0) for c in judged),
        next_trials=sum(int(c["n"]) for c in judged),
        worst_fds_over_baseline=_worst(c.get("fds_over_baseline") for c in ran),
        active_streams_left_cells=(
            sum(1 for c in measured_active if c["active_streams_after"] > 0)
            if measured_active
            else None
        ),
    )


# --------------------------------------------------------------------------- the reading


def _and(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    present = set(values)
    return [v for v in order if v in present]


def _where(cells: Sequence[Cell]) -> str:
    """Cells in few words: phases that share the same endpoints and leaves read as one box,
    ``json connecting and head, chat, fin/rst/abort``; a set that is no box, cell by cell."""
    parts = []
    for transport in _ordered((c["transport"] for c in cells), TRANSPORTS):
        mine = [c for c in cells if c["transport"] == transport]
        pairs_of = {
            phase: frozenset((c["endpoint"], c["leave"]) for c in mine if c["phase"] == phase)
            for phase in _ordered((c["phase"] for c in mine), PHASES)
        }
        for pairs in dict.fromkeys(pairs_of.values()):
            phases = [p for p, same in pairs_of.items() if same == pairs]
            endpoints = _ordered((e for e, _ in pairs), ENDPOINTS)
            leaves = _ordered((leave for _, leave in pairs), LEAVES)
            if len(pairs) == len(endpoints) * len(leaves):
                parts.append(
                    f"{transport} {_and(phases)}, {'/'.join(endpoints)}, {'/'.join(leaves)}"
                )
            else:
                listed = sorted(pairs, key=lambda p: (ENDPOINTS.index(p[0]), LEAVES.index(p[1])))
                parts.append(
                    f"{transport} {_and(phases)}: " + ", ".join(f"{e} {lv}" for e, lv in listed)
                )
    return "; ".join(parts)


def _listed(cells: Sequence[Cell], text: Callable[[Cell], str]) -> str:
    shown = [f"{_name(c)} {text(c)}" for c in cells[:LISTED_CELLS]]
    if len(cells) > LISTED_CELLS:
        shown.append(f"and {len(cells) - LISTED_CELLS} more (see the tables)")
    return ", ".join(shown)


def _cells(count: int) -> str:
    return f"{count} cell" + ("" if count == 1 else "s")


def _out_of_n(cells: Sequence[Cell], k: str) -> str:
    sizes = {int(c["n"]) for c in cells}
    return f"{k}/{sizes.pop()}" if len(sizes) == 1 else f"{k}/N"


def _ms(value: float) -> str:
    return f"{value:.1f} ms"


def _steps_text(steps: int) -> str:
    return f"≤{steps} step" + ("" if steps == 1 else "s")


def _never_phrases(report: Report) -> list[str]:
    never = _never_cancelled(report)
    groups: list[tuple[str, list[Cell]]] = [
        (
            "a queued request (it reached the upstream after its client left)",
            [c for c in never if c["phase"] == "queued"],
        ),
    ]
    for transport in TRANSPORTS:
        mine = [c for c in never if c["transport"] == transport and c["phase"] != "queued"]
        groups.append((REQUEST[transport], mine))
    phrases = []
    for what, cells in groups:
        if cells:
            trials = sum(int(c["n"]) for c in cells)
            phrases.append(
                f"**never cancelled** {what}: {_where(cells)}: {_out_of_n(cells, '0')} in "
                f"{_cells(len(cells))} ({trials} of {trials} trials)"
            )
    return phrases


def _partial_phrases(report: Report) -> list[str]:
    phrases = []
    partly = _partly_cancelled(report)
    if partly:
        missed = sum(int(c["n"]) - int(c["cancelled"]) for c in partly)
        trials = sum(int(c["n"]) for c in partly)
        phrases.append(
            f"cancelled only some trials in {_cells(len(partly))}: "
            + _listed(partly, lambda c: f"{c['cancelled']}/{c['n']}")
            + f" ({missed} of {trials} trials not cancelled)"
        )
    incomplete = _incomplete(report)
    if incomplete:
        phrases.append(
            f"answers not completed after the last token in {_cells(len(incomplete))}: "
            + _listed(incomplete, lambda c: f"{c['cancelled']}/{c['n']}")
        )
    return phrases


def _latency_phrase(report: Report) -> str:
    over = sorted(_over_target(report), key=lambda c: -float(c["p99_ms"]))
    if not over:
        return ""
    leaves = _ordered((c["leave"] for c in over), LEAVES)
    which = f" (all {leaves[0]})" if len(leaves) == 1 else ""
    return f"cancel p99 over {TARGET_P99_MS:g} ms in {_cells(len(over))}{which}: " + _listed(
        over, lambda c: _ms(c["p99_ms"])
    )


def _steps_phrase(report: Report) -> str:
    over = sorted(_over_target(report), key=lambda c: -(_steps(c) or 0))
    if not over:
        return ""
    return (
        f"the model ran more than {TARGET_STEPS} decode step for the sequence after Sluice "
        f"saw the client go in {_cells(len(over))}: "
        + _listed(over, lambda c: _steps_text(_steps(c) or 0))
    )


def _beyond_in_flight(cell: Cell) -> int:
    """Tokens for nobody beyond the one per trial that was in flight when the client left."""
    return max(0, int(cell.get("tokens_for_nobody") or 0) - int(cell["n"]))


def _waste_phrases(report: Report) -> list[str]:
    phrases = []
    wasted = [c for c in _ran(report) if _beyond_in_flight(c)]
    if wasted:
        total = sum(_beyond_in_flight(c) for c in wasted)
        phrases.append(
            f"{total} tokens generated for nobody beyond the one in flight per trial, in "
            f"{_cells(len(wasted))}: "
            + _listed(wasted, lambda c: f"{c['tokens_for_nobody']} in {c['n']} trials")
        )
    failed = [c for c in _judged(report) if (c.get("next_served") or 0) < c["n"]]
    if failed:
        missed = sum(int(c["n"]) - int(c.get("next_served") or 0) for c in failed)
        trials = sum(int(c["n"]) for c in _judged(report))
        phrases.append(
            f"the next request not served after {missed} of {trials} trials: "
            + _listed(failed, lambda c: f"next {c.get('next_served') or 0}/{c['n']}")
        )
    return phrases


def _remarks(report: Report) -> list[str]:
    """What the bench saw inside the system that the targets do not judge: leftovers after a
    cell, and the cells it does not serve (never counted as failures)."""
    ran = _ran(report)
    remarks = []
    fds = [c for c in ran if c.get("fds_over_baseline") is not None]
    grown = [c for c in fds if c["fds_over_baseline"] > 0]
    if grown:
        remarks.append(
            f"its fd count over the baseline after {len(grown)} of {len(fds)} cells "
            f"(at most {max(c['fds_over_baseline'] for c in grown)} over)"
        )
    unsettled = [c for c in ran if c.get("trials_unsettled")]
    if unsettled:
        trials = sum(int(c["trials_unsettled"]) for c in unsettled)
        remarks.append(
            f"not back at rest (active streams 0, fds at the baseline) within 0.5 s of "
            f"{trials} trials, in {_cells(len(unsettled))}"
        )
    active = [c for c in ran if (c.get("active_streams_after") or 0) > 0]
    if active:
        remarks.append(
            f"`sluice_active_streams` not back to 0 after {_cells(len(active))}: "
            + _listed(active, lambda c: f"{c['active_streams_after']:g}")
        )
    unserved = _unserved(report)
    if unserved:
        remarks.append(f'"not served" (not counted): {unserved}')
    return remarks


def _unserved(report: Report) -> str:
    cells = report["cells"]
    served = {(c["transport"], c["endpoint"]) for c in cells if c["served"]}
    present = {(c["transport"], c["endpoint"]) for c in cells}
    transports = _ordered((t for t, _ in present), TRANSPORTS)
    endpoints = _ordered((e for _, e in present), ENDPOINTS)
    # Say "for every transport" once rather than once per transport.
    nowhere = [e for e in endpoints if not any((t, e) in served for t in transports)]
    parts = [f"{_and(nowhere)} on every transport"] if nowhere else []
    for transport in transports:
        missing = [e for e in endpoints if e not in nowhere and (transport, e) not in served]
        if missing and len(missing) + len(nowhere) == len(endpoints):
            parts.append(f"{transport} for every endpoint")
        elif missing:
            parts.append(f"{transport} {_and(missing)}")
    return "; ".join(parts)


def _worst_text(summary: Summary) -> str:
    """``at most 5.7 ms for fin, ...`` (local: decode steps), or "" where nothing was timed."""
    if summary["kind"] == "local":
        worst: dict[str, Any] = summary["worst_steps"]
        each = [f"{s} for {lv}" for lv, s in worst.items() if s is not None]
    else:
        worst = summary["worst_p99_ms"]
        each = [f"{_ms(p)} for {lv}" for lv, p in worst.items() if p is not None]
    return f"at most {', '.join(each)}" if each else ""


def reading(report: Report) -> list[str]:
    """Where the system falls short of the targets, a phrase per kind of shortfall; or that
    it met every target. Remarks that judge nothing come last."""
    summary = summarise(report)
    local = summary["kind"] == "local"
    shortfalls = [
        *_never_phrases(report),
        *_partial_phrases(report),
        _steps_phrase(report) if local else _latency_phrase(report),
        *_waste_phrases(report),
    ]
    shortfalls = [s for s in shortfalls if s]
    worst = _worst_text(summary)
    measure = "decode steps after Sluice saw the client go" if local else "cancel p99"
    if not summary["served_cells"]:
        phrases = ["no cell ran (it serves none of the endpoints and transports asked for)"]
    elif shortfalls:
        n = summary["n"]
        phrases = [
            f"{summary['cancelled_all']} of {summary['served_cells']} served cells {n}/{n}"
            + (f"; {measure} {worst}" if worst else ""),
            *shortfalls,
        ]
    else:
        n = summary["n"]
        bound = (
            f"the model stopped within {TARGET_STEPS} decode step of Sluice seeing the client go"
            if local
            else f"cancel p99 ≤ {TARGET_P99_MS:g} ms"
        )
        phrases = [
            f"met every target: all {summary['served_cells']} served cells {n}/{n} (queued: "
            f"{'never admitted' if local else 'never reached the upstream'}; after_last: "
            f"completed), {bound}"
            + (f" ({worst})" if worst else "")
            + ", no token for nobody beyond the one in flight, the next request served "
            "every time"
        ]
    return phrases + _remarks(report)


# --------------------------------------------------------------------------- the document

INTRO: Final = """\
What happens when a client leaves, measured: each cell is one way for a client to leave a
request (phase, transport, endpoint and how it leaves), tried N times, one trial at a time,
against a proxy in front of the fake upstream (`proxy/testing/fake_upstream.py`), which runs
inside the bench process and records when it saw each client's connection go. The bench is
`proxy/bench/matrix.py` (its docstring defines every axis and figure exactly).

This file is written by `python -m proxy.bench.scorecard` from the bench's JSON reports
(`make scorecard`): rerun it rather than editing the file, or the next run undoes the edit."""

HOW_TO_READ: Final = """\
## How to read a cell

- **k/N**: trials in which the upstream saw the proxy's connection go (the request was
  cancelled upstream). `queued`: the request never reached the upstream once the admission
  slot freed. `after_last`: the answer was complete and nothing was left running.
- **p99**: cancel latency, from the client's `close()` (or `shutdown()`, or abort) to the
  fake's record of the close, both `time.monotonic()`. None for `queued` and `after_last`.
- **tok**: tokens generated after the client left, summed over the N trials (one per trial
  can be the token in flight, and is not counted against the target); shown only when not 0.
- **next k/N**: shown only when the proxy failed to serve the next request.
- **n/a**: the phase does not exist for that transport (a non-streamed answer has no
  mid-stream; a WebSocket request has no response head; a target's admission queue cannot be
  produced from outside). **not served**: the system has no such endpoint or transport; such
  cells are never counted as failures.
- **≤k steps** (a `local` report: Sluice's own model, no upstream): the cell is the worker
  thread stopping, counted in the forward passes (decode steps, prefill chunks) the model ran
  for the sequence after Sluice saw the client go, read from Sluice's
  `sluice_local_steps_after_cancel`; the target is ≤ 1 (the step in flight). Local cells have
  no p99: the time for Sluice to see the client go is the upstream cells' (the same relay).
  k/N there: the model let the sequence go (`queued`: it never started generating).
- **Sluice's own view**: after every trial, the bench waits up to 0.5 s for
  `sluice_active_streams` 0 and the fd count at its baseline (a peer's fds only); after each
  cell up to 2 s, and reports what it then reads.

Phases: `queued` (Sluice with `[upstream] max_connections = 1`, the slot held by a long
stream), `connecting` (the fake holds the accepted connection without reading it,
`accept_delay`: on loopback the kernel completes the TCP handshake at once, so Sluice's own
access line calls this phase `awaiting_headers`), `head` (the fake never sends its head),
`first_token` (TTFT 30 s), `mid_stream` (a token every 20 ms; the client leaves after the 3rd),
`after_last`. The local model's phases: `queued` (both of its 2 slots held by long streams),
`head` (non-streamed: the answer is being generated while the client waits for its head),
`first_token` (a prompt of ~250 tokens being prefilled), `mid_stream` (after the 4th event);
`connecting` does not exist there, nor `head` for a streamed answer (its head goes out on
admission). Leaves: `fin` (`shutdown(SHUT_WR)`: a `close()` with unread bytes would be an RST),
`rst` (`SO_LINGER` 0 then `close()`), `abort` (the response closed before its end, as the
OpenAI SDK's `close()` or a timeout does, through httpcore, the connection layer its httpx runs
on; the clock starts when that socket closes; over WebSocket a close frame).

Targets: every served cell N/N, cancel p99 ≤ 10 ms, 0 tokens for nobody, the next request
always served; for a local report, ≤ 1 decode step instead of the p99.

Heat-maps: a row per transport and phase, a column per endpoint and leave; the colour is the
cancelled fraction (red 0, green 1), the text the p99 in ms (local: `≤k st`, steps; no p99:
k/N), bold in a red frame when over the target; grey: not served; hatched: n/a."""


SIDE_BY_SIDE_KEY: Final = """\
N/N: served cells whose every trial was cancelled (queued: never reached the upstream;
after_last: completed). Worst: the highest cancel p99 among a leave's cells (local: the most
decode steps after Sluice saw the client go). Over target: cells over 10 ms p99 (local: over 1
step). Next served: trials after which the next request was served, of all trials. Fds and
active streams: Sluice's own view, which the bench has only of the Sluice it starts (— for any
other system)."""


def _key_versions(versions: dict[str, Any]) -> str:
    keys = [k for k in KEY_VERSIONS if k in versions] or list(versions)[:3]
    return ", ".join(f"{k} {versions[k]}" for k in keys)


def _commands(reports: Sequence[Report]) -> str:
    lines = ["## Commands", "", "```"]
    for report in reports:
        if report.get("command"):
            lines += [f"# {report['system']}", str(report["command"])]
    lines += [
        '# any OpenAI-compatible proxy on loopback whose model "fake-model" goes to '
        "http://127.0.0.1:9099:",
        GENERIC_TARGET,
        "# every system above (LiteLLM where installed), then this file; make bench runs it:",
        "make scorecard",
        "# install LiteLLM's proxy (pinned) into .litellm-venv, measure it and the FastAPI "
        "peer, then this file:",
        "make scorecard-peers",
        "# this file and its heat-maps, from reports at hand:",
        f"{PROG} REPORT.json [REPORT.json ...] --markdown docs/cancellation.md --images docs/",
        "```",
    ]
    return "\n".join(lines)


def _systems(reports: Sequence[Report]) -> str:
    lines = [
        "## Systems measured",
        "",
        "| system | kind | commit | measured | N | machine | versions |",
        "|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        cpus = (report.get("machine") or {}).get("cpus")
        machine = f"{cpus} CPUs" if cpus else "—"
        lines.append(
            f"| {report['system']} | {kind(report)} | {report['commit']} | "
            f"{report['measured_at']} | {report['repeat']} | {machine} | "
            f"{_key_versions(report['versions'])} |"
        )
    lines += ["", "Every version of each system is listed in its section below."]
    return "\n".join(lines)


def _worst_cell(summary: Summary, leave: str) -> str:
    if summary["kind"] == "local":
        steps = summary["worst_steps"][leave]
        return "—" if steps is None else _steps_text(steps)
    p99 = summary["worst_p99_ms"][leave]
    return "—" if p99 is None else _ms(p99)


def _dash(value: int | None) -> str:
    return "—" if value is None else str(value)


def _side_by_side(reports: Sequence[Report]) -> str:
    lines = [
        "## Side by side",
        "",
        "| system | served cells | N/N | never cancelled (0/N) | worst fin | worst rst | "
        "worst abort | over target | tokens for nobody | next served | worst fds over "
        "baseline | cells with active streams left |",
        "|---" * 12 + "|",
    ]
    for report in reports:
        s = summarise(report)
        never = str(s["never_cancelled_cells"])
        if s["never_cancelled_cells"]:
            never += f" ({s['never_cancelled_trials']} trials)"
        worst = [_worst_cell(s, leave) for leave in LEAVES]
        lines.append(
            f"| {s['system']} | {s['served_cells']} | {s['cancelled_all']} | {never} | "
            + " | ".join(worst)
            + f" | {s['over_target_cells']} | {s['tokens_for_nobody']} | "
            f"{s['next_served']}/{s['next_trials']} | {_dash(s['worst_fds_over_baseline'])} | "
            f"{_dash(s['active_streams_left_cells'])} |"
        )
    lines += ["", SIDE_BY_SIDE_KEY]
    return "\n".join(lines)


def _bullet(text: str, indent: str) -> str:
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=f"{indent}- ",
        subsequent_indent=f"{indent}  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _reading(reports: Sequence[Report]) -> str:
    lines = ["## Reading", ""]
    for report in reports:
        head = f"**{report['system']}** (commit {report['commit']}, N = {report['repeat']})"
        phrases = reading(report)
        if len(phrases) == 1:
            lines.append(_bullet(f"{head}: {phrases[0]}.", ""))
        else:
            lines.append(_bullet(f"{head}:", ""))
            lines += [_bullet(f"{phrase}.", "  ") for phrase in phrases]
    return "\n".join(lines)


def _with_level(markdown: str, level: int) -> str:
    """``markdown`` with its headings moved so that the highest becomes ``level``."""
    found = [len(m.group(1)) for m in re.finditer(r"^(#+) ", markdown, re.MULTILINE)]
    if not found:
        return markdown
    shift = level - min(found)
    return re.sub(
        r"^(#+) ", lambda m: "#" * (len(m.group(1)) + shift) + " ", markdown, flags=re.MULTILINE
    )


def _section(report: Report, image: str | None) -> str:
    tables = _with_level(markdown_report(report).rstrip("\n"), 3)
    if image is None:
        return tables
    head, _, rest = tables.partition("\n")
    picture = f"![{report['system']}: the cancellation heat-map]({image})"
    return f"{head}\n\n{picture}\n{rest}"


def document(reports: Sequence[Report], image_paths: Sequence[str | None] = ()) -> str:
    """docs/cancellation.md for ``reports``, in their order; ``image_paths``: each report's
    heat-map, relative to the document (none, or one per report, None for no image)."""
    images = list(image_paths) or [None] * len(reports)
    if len(images) != len(reports):
        raise ValueError(f"{len(images)} image paths for {len(reports)} reports")
    parts = [
        "# Cancellation scorecard",
        INTRO,
        HOW_TO_READ,
        _commands(reports),
        _systems(reports),
        _side_by_side(reports),
        _reading(reports),
        "## The scorecards",
        *(_section(report, image) for report, image in zip(reports, images, strict=True)),
    ]
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- the heat-map

CANCELLED_COLOURS: Final = ("#d7301f", "#fee08b", "#91cf60")
NOT_SERVED: Final = "#bdbdbd"
NOT_APPLICABLE_HATCH: Final = "#a6a6a6"
OVER_TARGET: Final = "#b00000"
DPI: Final = 100


def image_name(system: str) -> str:
    """``cancellation-<slug>.png``: the slug is the name in lowercase ``[a-z0-9-]``."""
    slug = re.sub(r"[^a-z0-9]+", "-", system.lower()).strip("-") or "system"
    return f"cancellation-{slug}.png"


def _cell_label(cell: Cell, local: bool) -> tuple[str, bool]:
    """(text, over the target) for a cell whose trials ran."""
    steps = _steps(cell)
    if local and steps is not None:
        text, over = f"≤{steps} st", steps > TARGET_STEPS
    elif cell.get("p99_ms") is not None:
        text, over = f"{cell['p99_ms']:.1f}", cell["p99_ms"] > TARGET_P99_MS
    else:
        text, over = f"{cell.get('cancelled')}/{cell['n']}", False
    if cell.get("tokens_for_nobody"):
        text += f"\n{cell['tokens_for_nobody']} tok"
    return text, over


def heatmap(report: Report, path: Path) -> None:
    """The report as one picture (see HOW_TO_READ), written to ``path`` as PNG; the same
    report gives the same bytes."""
    plt = load_pyplot(without="leave out --images")
    matplotlib = importlib.import_module("matplotlib")
    patches = importlib.import_module("matplotlib.patches")
    colors = importlib.import_module("matplotlib.colors")
    cells = report["cells"]
    rows = [
        (t, p)
        for t in TRANSPORTS
        for p in PHASES
        if any((c["transport"], c["phase"]) == (t, p) for c in cells)
    ]
    columns = [
        (e, lv)
        for e in ENDPOINTS
        for lv in LEAVES
        if any((c["endpoint"], c["leave"]) == (e, lv) for c in cells)
    ]
    at = {(c["transport"], c["phase"], c["endpoint"], c["leave"]): c for c in cells}
    local = kind(report) == "local"
    grid = [[float("nan")] * len(columns) for _ in rows]
    cmap = colors.LinearSegmentedColormap.from_list("cancelled", CANCELLED_COLOURS).with_extremes(
        bad="white"
    )
    with matplotlib.rc_context({"hatch.linewidth": 0.6, "font.size": 8}):
        fig, ax = plt.subplots(
            figsize=(2.8 + 0.62 * len(columns), 1.9 + 0.3 * len(rows)), layout="constrained"
        )
        for i, (transport, phase) in enumerate(rows):
            for j, (endpoint, leave) in enumerate(columns):
                cell = at.get((transport, phase, endpoint, leave))
                if cell is None:
                    continue
                corner = (j - 0.5, i - 0.5)
                if not cell["served"]:
                    ax.add_patch(patches.Rectangle(corner, 1, 1, facecolor=NOT_SERVED, lw=0))
                elif not cell["applicable"]:
                    ax.add_patch(
                        patches.Rectangle(
                            corner,
                            1,
                            1,
                            facecolor="white",
                            edgecolor=NOT_APPLICABLE_HATCH,
                            hatch="///",
                            lw=0,
                        )
                    )
                elif cell.get("cancelled") is not None:
                    grid[i][j] = cell["cancelled"] / cell["n"]
                    text, over = _cell_label(cell, local)
                    ax.text(
                        j,
                        i,
                        text,
                        ha="center",
                        va="center",
                        fontsize=7,
                        fontweight="bold" if over else "normal",
                        color=OVER_TARGET if over else "black",
                    )
                    if over:
                        ax.add_patch(
                            patches.Rectangle(
                                (j - 0.45, i - 0.45),
                                0.9,
                                0.9,
                                fill=False,
                                edgecolor=OVER_TARGET,
                                lw=1.6,
                            )
                        )
        image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", zorder=0)
        _axes_labels(ax, rows, columns)
        fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="cancelled / N")
        fig.legend(
            handles=[
                patches.Patch(facecolor=NOT_SERVED, label="not served"),
                patches.Patch(
                    facecolor="white", edgecolor=NOT_APPLICABLE_HATCH, hatch="///", label="n/a"
                ),
                patches.Patch(
                    fill=False,
                    edgecolor=OVER_TARGET,
                    lw=1.6,
                    label=f"over {TARGET_STEPS} step"
                    if local
                    else f"p99 over {TARGET_P99_MS:g} ms",
                ),
            ],
            loc="outside lower center",
            ncol=3,
            frameon=False,
        )
        what = "decode steps after the client went" if local else "cancel p99 in ms"
        fig.suptitle(
            f"{report['system']} · commit {report['commit']} · N = {report['repeat']}\n"
            f"colour: cancelled / N; text: {what}"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        plt.close(fig)


def _axes_labels(
    ax: Any, rows: Sequence[tuple[str, str]], columns: Sequence[tuple[str, str]]
) -> None:
    ax.set_yticks(range(len(rows)), [f"{t}  {p}" for t, p in rows])
    ax.set_xticks(range(len(columns)), [leave for _, leave in columns])
    ax.tick_params(length=0)
    ax.set_xlim(-0.5, len(columns) - 0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    for side in ax.spines.values():
        side.set_visible(False)
    # White gaps between transports and between endpoints, the two groupings of the axes.
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="white", lw=3)
    starts = [j for j in range(len(columns)) if j == 0 or columns[j][0] != columns[j - 1][0]]
    for j in starts[1:]:
        ax.axvline(j - 0.5, color="white", lw=3)
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(columns)
        ax.text(
            (start + end - 1) / 2,
            -0.7,
            columns[start][0],
            ha="center",
            va="bottom",
            fontweight="bold",
            clip_on=False,
        )


# --------------------------------------------------------------------------- command line


def _image_paths(reports: Sequence[Report], folder: Path) -> list[Path]:
    """One file per report; a name two systems would share gets a number."""
    taken: set[str] = set()
    paths = []
    for report in reports:
        name = image_name(str(report["system"]))
        stem, number = name.removesuffix(".png"), 2
        while name in taken:
            name, number = f"{stem}-{number}.png", number + 1
        taken.add(name)
        paths.append(folder / name)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="docs/cancellation.md from bench --matrix JSON reports"
    )
    parser.add_argument("reports", nargs="+", type=Path, help="JSON reports of bench --matrix")
    parser.add_argument("--markdown", type=Path, required=True, help="the document to write")
    parser.add_argument("--images", type=Path, help="write a heat-map per system here")
    parser.add_argument(
        "--link-from",
        type=Path,
        metavar="MARKDOWN",
        help="also put a section linking the document, a line per system, in this file "
        "(make bench: docs/benchmarks.md)",
    )
    args = parser.parse_args(argv)
    reports = [load_report(path) for path in args.reports]
    links: list[str | None] = [None] * len(reports)
    if args.images is not None:
        paths = _image_paths(reports, args.images)
        try:
            for report, path in zip(reports, paths, strict=True):
                heatmap(report, path)
                print(f"wrote {path}")
        except BenchError as exc:
            sys.exit(f"{PROG}: {exc}")
        links = [relative_link(path, args.markdown.parent) for path in paths]
    _write_text(args.markdown, document(reports, links))
    print(f"wrote {args.markdown}")
    if args.link_from is not None:
        old = _read(str(args.link_from)) or ""
        target = relative_link(args.markdown, args.link_from.parent)
        _write_text(args.link_from, upsert_section(old, LINK_KEY, link_section(reports, target)))
        print(f"linked from {args.link_from}")


# The section's key in the linking document (its markers: upsert_section's), in the
# name=value form of docs/benchmarks.md's keys.
LINK_KEY: Final = "bench=cancellation"


def link_section(reports: Sequence[Report], target: str) -> str:
    """A short section for another document: where the scorecard is, and a line per system."""
    lines = [
        "## Cancellation scorecard",
        "",
        f"What happens when a client leaves, in every phase, transport, endpoint and way of "
        f"leaving, measured against Sluice and its peers: [{target}]({target}), written by "
        "`make scorecard` (which `make bench` runs).",
        "",
    ]
    for report in reports:
        summary = summarise(report)
        worst = _worst_text(summary)
        line = (
            f"- **{summary['system']}** (commit {summary['commit']}, N = {summary['n']}): "
            f"{summary['cancelled_all']} of {summary['served_cells']} served cells cancelled "
            f"N of N"
        )
        if summary["never_cancelled_cells"]:
            line += (
                f", {summary['never_cancelled_cells']} never "
                f"({summary['never_cancelled_trials']} trials)"
            )
        if worst:
            clock = "decode steps after the leave" if summary["kind"] == "local" else "cancel p99"
            line += f"; {clock} {worst}"
        lines.append(line + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
