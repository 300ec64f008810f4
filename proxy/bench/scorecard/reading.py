"""The "Reading" of a report, written from its figures and never by hand: where the system
falls short of the targets, a phrase per kind of shortfall (cells named in few words), or that
it met every target; then the remarks that judge nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from proxy.bench.matrix.cells import ENDPOINTS, LEAVES, PHASES, TRANSPORTS
from proxy.bench.scorecard.reports import (
    TARGET_P99_MS,
    TARGET_STEPS,
    Cell,
    Report,
    Summary,
    cell_name,
    incomplete_answers,
    judged_cells,
    never_cancelled,
    over_target,
    partly_cancelled,
    ran_cells,
    steps_after_leave,
    summarise,
    trace_counts,
    trace_short,
)
from proxy.relay.state import Phase

# A reading lists at most this many cells by name; the tables below it hold the rest.
LISTED_CELLS: Final = 10
# And at most this many of the reasons a judge gave for a trace.
LISTED_REASONS: Final = 3
# What a transport's request is, for a reading that says what was never cancelled.
REQUEST: Final = {
    "sse": "a streamed request",
    "json": "a non-streamed request before its answer",
    "ws": "a WebSocket request",
}


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
    shown = [f"{cell_name(c)} {text(c)}" for c in cells[:LISTED_CELLS]]
    if len(cells) > LISTED_CELLS:
        shown.append(f"and {len(cells) - LISTED_CELLS} more (see the tables)")
    return ", ".join(shown)


def _cells(count: int) -> str:
    return f"{count} cell" + ("" if count == 1 else "s")


def _out_of_n(cells: Sequence[Cell], k: str) -> str:
    sizes = {int(c["n"]) for c in cells}
    return f"{k}/{sizes.pop()}" if len(sizes) == 1 else f"{k}/N"


def ms_text(value: float) -> str:
    return f"{value:.1f} ms"


def steps_text(steps: int) -> str:
    return f"≤{steps} step" + ("" if steps == 1 else "s")


def _never_phrases(report: Report) -> list[str]:
    never = never_cancelled(report)
    groups: list[tuple[str, list[Cell]]] = [
        (
            "a queued request (it reached the upstream after its client left)",
            [c for c in never if c["phase"] == Phase.QUEUED],
        ),
    ]
    for transport in TRANSPORTS:
        mine = [c for c in never if c["transport"] == transport and c["phase"] != Phase.QUEUED]
        groups.append((REQUEST[transport], mine))
    phrases = []
    for what, cells in groups:
        if cells:
            trials = sum(int(c["n"]) for c in cells)
            phrases.append(
                f"**never cancelled** {what}: {_where(cells)}: {_out_of_n(cells, '0')} in "
                f"{_cells(len(cells))} ({trials} of {trials} trials)" + _tracked(report, cells)
            )
    return phrases


def _tracked(report: Report, cells: Sequence[Cell]) -> str:
    """Where the system's own project tracks not cancelling these cells' phases, for another
    system's report (one that says where it looked: its ``trackers``)."""
    trackers = report.get("trackers")
    if trackers is None:
        return ""
    phases = _ordered((str(c["phase"]) for c in cells), [p.value for p in PHASES])
    refs = {phase: trackers.get(phase) or "not reported upstream" for phase in phases}
    if len(set(refs.values())) == 1:
        return f"; its tracker: {next(iter(refs.values()))}"
    return "; its tracker: " + ", ".join(f"{phase} {ref}" for phase, ref in refs.items())


def _partial_phrases(report: Report) -> list[str]:
    phrases = []
    partly = partly_cancelled(report)
    if partly:
        missed = sum(int(c["n"]) - int(c["cancelled"]) for c in partly)
        trials = sum(int(c["n"]) for c in partly)
        phrases.append(
            f"cancelled only some trials in {_cells(len(partly))}: "
            + _listed(partly, lambda c: f"{c['cancelled']}/{c['n']}")
            + f" ({missed} of {trials} trials not cancelled)"
        )
    incomplete = incomplete_answers(report)
    if incomplete:
        phrases.append(
            f"answers not completed after the last token in {_cells(len(incomplete))}: "
            + _listed(incomplete, lambda c: f"{c['cancelled']}/{c['n']}")
        )
    return phrases


def _latency_phrase(report: Report) -> str:
    over = sorted(over_target(report), key=lambda c: -float(c["p99_ms"]))
    if not over:
        return ""
    leaves = _ordered((c["leave"] for c in over), LEAVES)
    which = f" (all {leaves[0]})" if len(leaves) == 1 else ""
    return f"cancel p99 over {TARGET_P99_MS:g} ms in {_cells(len(over))}{which}: " + _listed(
        over, lambda c: ms_text(c["p99_ms"])
    )


def _steps_phrase(report: Report) -> str:
    over = sorted(over_target(report), key=lambda c: -(steps_after_leave(c) or 0))
    if not over:
        return ""
    return (
        f"the model ran more than {TARGET_STEPS} decode step for the sequence after Sluice "
        f"saw the client go in {_cells(len(over))}: "
        + _listed(over, lambda c: steps_text(steps_after_leave(c) or 0))
    )


def _beyond_in_flight(cell: Cell) -> int:
    """Tokens for nobody beyond the one per trial that was in flight when the client left."""
    return max(0, int(cell.get("tokens_for_nobody") or 0) - int(cell["n"]))


def _waste_phrases(report: Report) -> list[str]:
    phrases = []
    wasted = [c for c in ran_cells(report) if _beyond_in_flight(c)]
    if wasted:
        total = sum(_beyond_in_flight(c) for c in wasted)
        phrases.append(
            f"{total} tokens generated for nobody beyond the one in flight per trial, in "
            f"{_cells(len(wasted))}: "
            + _listed(wasted, lambda c: f"{c['tokens_for_nobody']} in {c['n']} trials")
        )
    failed = [c for c in judged_cells(report) if (c.get("next_served") or 0) < c["n"]]
    if failed:
        missed = sum(int(c["n"]) - int(c.get("next_served") or 0) for c in failed)
        trials = sum(int(c["n"]) for c in judged_cells(report))
        phrases.append(
            f"the next request not served after {missed} of {trials} trials: "
            + _listed(failed, lambda c: f"next {c.get('next_served') or 0}/{c['n']}")
        )
    return phrases


def _trace_text(cell: Cell) -> str:
    traced, judged = trace_counts(cell) or (0, 0)
    return f"trace {traced}/{judged}"


def _trace_phrase(report: Report) -> str:
    """The cells where a trial's trace did not say what happened, and the judge's reasons."""
    short = trace_short(report)
    if not short:
        return ""
    counts = [trace_counts(c) or (0, 0) for c in short]
    missed = sum(n - k for k, n in counts)
    trials = sum(n for _, n in (trace_counts(c) or (0, 0) for c in ran_cells(report)))
    reasons: dict[str, int] = {}
    for cell in short:
        for reason, count in (cell["trace"].get("failures") or {}).items():
            reasons[reason] = reasons.get(reason, 0) + int(count)
    common = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))[:LISTED_REASONS]
    why = "; ".join(f"{reason} ({count})" for reason, count in common)
    return (
        f"the trace did not say what happened in {missed} of {trials} trials, in "
        f"{_cells(len(short))}: " + _listed(short, _trace_text) + (f" (why: {why})" if why else "")
    )


def _remarks(report: Report) -> list[str]:
    """What the bench saw inside the system that the targets do not judge: leftovers after a
    cell, and the cells it does not serve (never counted as failures)."""
    ran = ran_cells(report)
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
        why = "; ".join(
            f"{what}: {reason}" for what, reason in report.get("not_served", {}).items()
        )
        remarks.append(
            f'"not served" (not counted): {unserved}' + (f" (why: {why})" if why else "")
        )
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


def worst_text(summary: Summary) -> str:
    """``at most 5.7 ms for fin, ...`` (local: decode steps), or "" where nothing was timed."""
    if summary["kind"] == "local":
        worst: dict[str, Any] = summary["worst_steps"]
        each = [f"{s} for {lv}" for lv, s in worst.items() if s is not None]
    else:
        worst = summary["worst_p99_ms"]
        each = [f"{ms_text(p)} for {lv}" for lv, p in worst.items() if p is not None]
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
        _trace_phrase(report),
    ]
    shortfalls = [s for s in shortfalls if s]
    worst = worst_text(summary)
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
            + (
                ""
                if summary["traced"] is None
                else f", every trial's trace saying what happened ({summary['traced']}/"
                f"{summary['trace_trials']})"
            )
        ]
    return phrases + _remarks(report)
