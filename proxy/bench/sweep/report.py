"""The sweep's report, docs/cancellation-sweep.md: per scenario and server path, what was
counted and cut, and a heat strip of where in the request's life the checkpoints sit. Pure:
it reads :class:`~proxy.bench.sweep.run.Sweep` results and writes text."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from proxy.bench.sweep.run import Run, Sweep
from proxy.relay.state import Phase

# One letter per phase the access line named for a run cut there, and for the others.
LETTERS = {
    Phase.QUEUED.value: "Q",
    Phase.CONNECTING.value: "C",
    Phase.HEAD.value: "H",
    Phase.FIRST_TOKEN.value: "F",
    Phase.MID_STREAM.value: "M",
    Phase.PAUSED.value: "P",
    Phase.AFTER_LAST.value: "A",
}
# Runs whose deadline passed at the cut, by what they ended with.
DEADLINE_LETTERS = {"deadline_exceeded": "D", "deadline_unmeetable": "U"}
COMPLETED = "="
NO_LINE = "."
FAILED = "X"
STRIP_WIDTH = 64
LEGEND = (
    "Heat strip: one column per checkpoint in the order the request reaches them (wider "
    f"sweeps: {STRIP_WIDTH} columns, each the most common letter of its checkpoints, {FAILED} "
    "first), by what the access line of the run cut there said: "
    + ", ".join(f"`{letter}` cancelled({phase})" for phase, letter in LETTERS.items())
    + ", "
    + ", ".join(
        f"`{letter}` {outcome} (its deadline passed)"
        for outcome, letter in DEADLINE_LETTERS.items()
    )
    + f", `{COMPLETED}` the scenario's own ending (completed, or the error a failing upstream "
    "ends it with: the client left after the whole answer was handed over), "
    f"`{NO_LINE}` no line (it left before its request was read), `{FAILED}` a failed run."
)


def letter(run: Run) -> str:
    if run.failures:
        return FAILED
    outcome = run.outcome
    if not outcome:
        return NO_LINE
    if outcome in DEADLINE_LETTERS:
        return DEADLINE_LETTERS[outcome]
    if not outcome.startswith("cancelled("):
        return COMPLETED
    return LETTERS.get(outcome.removeprefix("cancelled(").rstrip(")"), "?")


def heat_strip(runs: Sequence[Run], width: int = STRIP_WIDTH) -> str:
    letters = [letter(run) for run in sorted(runs, key=lambda r: r.cut_at or 0)]
    if len(letters) <= width:
        return "".join(letters)
    strip = []
    for column in range(width):
        bucket = letters[column * len(letters) // width : (column + 1) * len(letters) // width]
        strip.append(FAILED if FAILED in bucket else Counter(bucket).most_common(1)[0][0])
    return "".join(strip)


def cut_runs(sweep: Sweep) -> list[Run]:
    return [run for run in sweep.runs if run.cut_at is not None]


def summary_row(sweep: Sweep) -> str:
    if sweep.skipped:
        cells = [sweep.scenario, sweep.server, sweep.leave, f"skipped: {sweep.skipped}"]
        return "| " + " | ".join(cells + [""] * 6) + " |"
    cuts = cut_runs(sweep)
    steps = [run.released_after for run in cuts if run.released_after is not None]
    batches = [run.released_batches for run in cuts if run.released_batches is not None]
    engine = [r.released_engine_steps for r in cuts if r.released_engine_steps is not None]
    released = f"{max(batches, default=0)} ({max(steps, default=0)})"
    if engine:
        released += f"; {max(engine)} engine steps"
    return (
        f"| {sweep.scenario} | {sweep.server} | {sweep.leave} | {sweep.counted} | "
        f"{len(sweep.runs)} | {len(sweep.distinct)} | {len(sweep.failures)} | "
        f"{released} | {sweep.seconds:.1f} | "
        f"`{heat_strip(cuts)}` |"
    )


# Failed runs listed per sweep; the others are counted.
LISTED = 4


def failure_lines(sweep: Sweep) -> list[str]:
    lines = []
    for run in sweep.failures[:LISTED]:
        where = f"cut at step {run.cut_at}, {run.place}" if run.cut_at else "not cut"
        lines.append(f"- {sweep.scenario} ({sweep.server}, {sweep.leave}), {where}:")
        lines.extend(f"  - {failure}" for failure in run.failures)
    if len(sweep.failures) > LISTED:
        more = len(sweep.failures) - LISTED
        lines.append(f"- {sweep.scenario} ({sweep.server}, {sweep.leave}): {more} more failed runs")
    return lines


def places_section(sweeps: Sequence[Sweep]) -> list[str]:
    """Every distinct cut point, with the scenarios and paths it was reached in."""
    seen: dict[str, set[str]] = {}
    for sweep in sweeps:
        for place in sweep.distinct:
            seen.setdefault(place, set()).add(f"{sweep.scenario} ({sweep.server})")
    lines = ["| cut point (where the request's task was parked) | reached in |", "|---|---|"]
    for place in sorted(seen):
        lines.append(f"| `{place}` | {', '.join(sorted(seen[place]))} |")
    return lines


def markdown(sweeps: Sequence[Sweep], *, heading: str, preamble: str) -> str:
    total_runs = sum(len(s.runs) for s in sweeps)
    failures = sum(len(s.failures) for s in sweeps)
    places = set().union(*(s.distinct for s in sweeps)) if sweeps else set()
    lines = [
        f"# {heading}",
        "",
        preamble,
        "",
        f"{len(sweeps)} sweeps, {total_runs} runs, {len(places)} distinct cut points in code, "
        f"{failures} failed runs, {sum(s.seconds for s in sweeps):.0f} s.",
        "",
        "| scenario | server | leave | checkpoints | runs | distinct cut points | failures "
        "| released within, rounds (steps) | seconds | heat strip |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(summary_row(sweep) for sweep in sweeps),
        "",
        LEGEND,
        "",
    ]
    failed = [line for sweep in sweeps for line in failure_lines(sweep)]
    lines += ["## Failures", "", *(failed or ["None."]), ""]
    lines += ["## Cut points", "", *places_section(sweeps), ""]
    return "\n".join(lines)
