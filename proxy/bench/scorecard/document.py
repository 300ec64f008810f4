"""docs/cancellation.md assembled: its fixed prose (what the bench measures, how to read a
cell), the commands, the systems measured, the side-by-side table, every system's reading and
its scorecard tables (the matrix's own), and the short section another document links it by."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any, Final

from proxy.bench.matrix.cells import LEAVES
from proxy.bench.matrix.report import markdown_report
from proxy.bench.scorecard.reading import ms_text, reading, steps_text, worst_text
from proxy.bench.scorecard.reports import PROG, Report, Summary, kind, summarise

# The document's prose wraps here, as the hand-written docs do.
WIDTH: Final = 96
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
    "envoy",
    "nginx",
    "vllm-router",
    "sglang-router",
    "portkey",
    "torch",
    "transformers",
)
GENERIC_TARGET: Final = (
    "sluice bench --matrix --target http://127.0.0.1:PORT --fake-port 9099 --repeat 5"
)


INTRO: Final = """\
What happens when a client leaves, measured: each cell is one way for a client to leave a
request (phase, transport, endpoint and how it leaves), tried N times, one trial at a time,
against a proxy in front of the fake upstream (`proxy/testing/fake_upstream/`), which runs
inside the bench process and records when it saw each client's connection go. The bench is
`proxy/bench/matrix/` (its `__init__.py`'s docstring defines every axis and figure exactly).

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
- **trace k/N** (the Sluice the bench starts, which exports its spans over OTLP to a receiver
  in the bench): trials whose own trace (each request sends a `traceparent` of its own) says
  what happened, as `proxy/testing/trace_check.py` judges it: every span ended, the outcome
  the trial's access line gave (a client that left: `cancelled(<phase>)`, with `client
  disconnected` then `upstream closed`, local: `generation stopped`; after the last token:
  `completed`); shown only when not N/N.
- **n/a**: the phase does not exist for that transport (a non-streamed answer has no
  mid-stream; a WebSocket request has no response head; a target's admission queue cannot be
  produced from outside). **not served**: the system has no such endpoint or transport (its
  reading says why); such cells are never counted as failures. Where a system never cancels
  a phase, its reading says so and names its own project's tracker entry for it, or "not
  reported upstream".
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
`accept_delay`: on loopback the kernel completes the TCP handshake and takes the request at
once, so Sluice's access line calls this phase `head`), `head` (the fake never sends its head),
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
always served, and (Sluice) every trial's trace saying what happened; for a local report, ≤ 1
decode step instead of the p99.

Heat-maps: a row per transport and phase, a column per endpoint and leave; the colour is the
cancelled fraction (red 0, green 1), the text the p99 in ms (local: `≤k st`, steps; no p99:
k/N), bold in a red frame when over the target; a dashed purple frame (and `tr k/N`): a trial
whose trace did not say what happened; grey: not served; hatched: n/a."""


SIDE_BY_SIDE_KEY: Final = """\
N/N: served cells whose every trial was cancelled (queued: never reached the upstream;
after_last: completed). Worst: the highest cancel p99 among a leave's cells (local: the most
decode steps after Sluice saw the client go). Over target: cells over 10 ms p99 (local: over 1
step). Next served: trials after which the next request was served, of all trials. Fds and
active streams: Sluice's own view, which the bench has only of the Sluice it starts (— for any
other system). Trace: trials whose own trace, as Sluice exported it, says what happened (ended
spans with the access line's outcome, and a departure's events), of all trials; only the Sluice
the bench starts exports its spans to it (— for any other system), and a row is short of the
target (bold) unless k = N."""


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
        "# Sluice's three systems (N = 5), then this file; make bench runs it:",
        "make scorecard",
        "# the other systems (N = 3), each installed, pinned, under .peers/NAME when missing, "
        "then this file:",
        "make scorecard-field",
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
        return "—" if steps is None else steps_text(steps)
    p99 = summary["worst_p99_ms"][leave]
    return "—" if p99 is None else ms_text(p99)


def _dash(value: int | None) -> str:
    return "—" if value is None else str(value)


def _traced(summary: Summary) -> str:
    """``k/N`` of the trials' traces; bold when short of N; — where none was judged."""
    traced, trials = summary["traced"], summary["trace_trials"]
    if traced is None or trials is None:
        return "—"
    return f"{traced}/{trials}" if traced == trials else f"**{traced}/{trials}**"


def _side_by_side(reports: Sequence[Report]) -> str:
    lines = [
        "## Side by side",
        "",
        "| system | served cells | N/N | never cancelled (0/N) | worst fin | worst rst | "
        "worst abort | over target | tokens for nobody | next served | worst fds over "
        "baseline | cells with active streams left | trace |",
        "|---" * 13 + "|",
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
            f"{_dash(s['active_streams_left_cells'])} | {_traced(s)} |"
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
        worst = worst_text(summary)
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
        if summary["traced"] is not None:
            line += f"; trace {summary['traced']}/{summary['trace_trials']} trials"
        lines.append(line + ".")
    return "\n".join(lines)
