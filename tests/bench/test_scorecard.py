"""docs/cancellation.md from the matrix's JSON reports: the figures, the generated reading, the
document's sections and links, the heat-maps, and a clear exit on a bad report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.bench import scorecard
from proxy.bench.matrix import applicability

VERSIONS = {"python": "3.11.7", "sluice": "0.1.0", "trio": "0.35.0", "coredis": "6.9.0"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def cell(
    phase: str,
    transport: str,
    endpoint: str,
    leave: str,
    *,
    served: bool = True,
    cancelled: int | None = None,
    p99: float | None = None,
    tokens: int = 0,
    next_served: int | None = None,
    steps: int | None = None,
    local: bool = False,
    inside: bool = True,
) -> dict[str, Any]:
    """One cell as ``Cell.to_json`` writes it, N = 5; ``inside``: the bench measured Sluice's
    own view (active streams, fds)."""
    applicable, why = applicability(phase, transport, endpoint, target=False)
    ran = served and applicable
    timed = ran and not local and phase not in ("queued", "after_last")
    row: dict[str, Any] = {
        "phase": phase,
        "transport": transport,
        "endpoint": endpoint,
        "leave": leave,
        "n": 5,
        "served": served,
        "applicable": applicable,
        "note": "" if ran else ("not served" if not served else f"not applicable: {why}"),
        "cancelled": (5 if cancelled is None else cancelled) if ran else None,
        "p50_ms": None,
        "p99_ms": (1.0 if p99 is None else p99) if timed and cancelled != 0 else None,
        "max_ms": None,
        "tokens_for_nobody": tokens if ran else None,
        "next_served": (5 if next_served is None else next_served) if ran else None,
        "active_streams_after": 0.0 if ran and inside else None,
        "fds_over_baseline": 0 if ran and inside else None,
        "access_outcomes": None,
    }
    if local:
        row["steps_after_leave_max"] = (1 if steps is None else steps) if ran else None
    return row


def report(system: str, cells: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "system": system,
        "commit": extra.pop("commit", "16c9a64"),
        "versions": extra.pop("versions", VERSIONS),
        "measured_at": "2026-12-01T17:37:41+00:00",
        "machine": {"cpus": 2, "platform": "Linux"},
        "repeat": 5,
        "cells": cells,
        **extra,
    }


PHASES = ("queued", "connecting", "head", "mid_stream", "after_last")


def sluice() -> dict[str, Any]:
    """Every target met; WebSocket serves chat only."""
    cells = [
        cell(phase, transport, endpoint, leave, served=transport != "ws" or endpoint == "chat")
        for phase in PHASES
        for transport in ("sse", "json", "ws")
        for endpoint in ("chat", "messages")
        for leave in ("fin", "rst", "abort")
    ]
    return report("Sluice (lean)", cells, command="python -m proxy.bench --matrix --repeat 5")


def peer() -> dict[str, Any]:
    """Chat only; never cancels a non-streamed request before its answer; two slow aborts, a
    few tokens for nobody, one next request lost."""
    special: dict[tuple[str, str, str], dict[str, Any]] = {
        ("sse", "connecting", "abort"): {"p99": 12.5},
        ("sse", "head", "abort"): {"p99": 11.0},
        # 5 trials: one token each may be in flight; 3 more were made for nobody.
        ("sse", "mid_stream", "fin"): {"tokens": 8},
        ("json", "connecting", "fin"): {"cancelled": 0},
        ("json", "connecting", "rst"): {"cancelled": 0},
        ("json", "connecting", "abort"): {"cancelled": 0},
        ("json", "head", "fin"): {"cancelled": 0},
        ("json", "head", "rst"): {"cancelled": 0, "next_served": 4},
        ("json", "head", "abort"): {"cancelled": 0},
    }
    cells = [
        cell(
            phase,
            transport,
            endpoint,
            leave,
            served=endpoint == "chat" and transport != "ws",
            inside=False,
            **special.get((transport, phase, leave), {}) if endpoint == "chat" else {},
        )
        for phase in PHASES
        for transport in ("sse", "json", "ws")
        for endpoint in ("chat", "messages")
        for leave in ("fin", "rst", "abort")
    ]
    return report("FastAPI peer (shared/peers)", cells, commit="0ddba11", versions={"python": "3"})


def local(worst_steps: int = 3) -> dict[str, Any]:
    cells = [
        cell(
            phase,
            transport,
            "chat",
            leave,
            local=True,
            steps=worst_steps if (phase, transport, leave) == ("mid_stream", "sse", "rst") else 1,
        )
        for phase in ("queued", "head", "mid_stream")
        for transport in ("sse", "json")
        for leave in ("fin", "rst", "abort")
    ]
    return report("Sluice (local)", cells, kind="local")


# --------------------------------------------------------------------------- figures


def test_summary_counts_the_cells_and_trials_never_cancelled() -> None:
    summary = scorecard.summarise(peer())
    # chat over sse (5 phases) and json (4: no mid_stream), 3 leaves each.
    assert summary["served_cells"] == 27
    assert summary["never_cancelled_cells"] == 6
    assert summary["never_cancelled_trials"] == 30
    assert summary["cancelled_all"] == 21
    assert summary["worst_p99_ms"] == {"fin": 1.0, "rst": 1.0, "abort": 12.5}
    assert summary["over_target_cells"] == 2
    assert summary["tokens_for_nobody"] == 8
    assert (summary["next_served"], summary["next_trials"]) == (27 * 5 - 1, 27 * 5)
    # The bench cannot look inside another system.
    assert summary["worst_fds_over_baseline"] is None
    assert summary["active_streams_left_cells"] is None


def test_not_served_cells_are_no_failures() -> None:
    summary = scorecard.summarise(sluice())
    # 2 endpoints over sse (5 phases) and json (4), chat over ws (4: no head); 3 leaves each.
    assert summary["served_cells"] == (2 * 5 + 2 * 4 + 4) * 3
    assert summary["cancelled_all"] == summary["served_cells"]
    assert summary["never_cancelled_cells"] == 0
    assert summary["over_target_cells"] == 0
    assert summary["worst_fds_over_baseline"] == 0
    assert summary["active_streams_left_cells"] == 0
    phrases = scorecard.reading(sluice())
    assert phrases[0].startswith("met every target: all 66 served cells 5/5")
    assert '"not served" (not counted): ws messages' in phrases


def test_a_report_without_a_kind_is_an_upstream_one() -> None:
    assert "kind" not in sluice()
    assert scorecard.summarise(sluice())["kind"] == "upstream"


def test_local_cells_are_judged_by_decode_steps() -> None:
    summary = scorecard.summarise(local())
    assert summary["kind"] == "local"
    assert summary["worst_steps"] == {"fin": 1, "rst": 3, "abort": 1}
    assert summary["worst_p99_ms"] == {"fin": None, "rst": None, "abort": None}
    assert summary["over_target_cells"] == 1
    assert any("sse mid_stream chat rst ≤3 steps" in p for p in scorecard.reading(local()))
    clean = scorecard.reading(local(worst_steps=1))
    assert clean[0].startswith("met every target")
    assert "within 1 decode step of Sluice seeing the client go (at most 1 for fin" in clean[0]


# --------------------------------------------------------------------------- reading


def test_the_reading_names_each_shortfall_with_its_cells_and_counts() -> None:
    phrases = scorecard.reading(peer())
    text = "\n".join(phrases)
    assert "met every target" not in text
    assert (
        "**never cancelled** a non-streamed request before its answer: json connecting and "
        "head, chat, fin/rst/abort: 0/5 in 6 cells (30 of 30 trials)"
    ) in phrases
    assert (
        "cancel p99 over 10 ms in 2 cells (all abort): sse connecting chat abort 12.5 ms, "
        "sse head chat abort 11.0 ms"
    ) in phrases
    assert (
        "3 tokens generated for nobody beyond the one in flight per trial, in 1 cell: "
        "sse mid_stream chat fin 8 in 5 trials"
    ) in phrases
    assert (
        "the next request not served after 1 of 135 trials: json head chat rst next 4/5"
    ) in phrases
    assert '"not served" (not counted): messages on every transport; ws for every endpoint' in (
        phrases
    )


def test_cells_cancelled_only_sometimes_are_listed_with_their_counts() -> None:
    partial = sluice()
    for row in partial["cells"]:
        if (row["transport"], row["phase"], row["endpoint"], row["leave"]) == (
            "sse",
            "head",
            "chat",
            "fin",
        ):
            row["cancelled"] = 3
    phrases = scorecard.reading(partial)
    assert (
        "cancelled only some trials in 1 cell: sse head chat fin 3/5 (2 of 5 trials not cancelled)"
    ) in phrases


# --------------------------------------------------------------------------- document


def headings_of(markdown: str) -> list[str]:
    headings, fenced = [], False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            headings.append(line)
    return headings


def test_the_document_has_every_system_its_commit_versions_and_image() -> None:
    reports = [sluice(), peer(), local()]
    images = ["cancellation-sluice-lean.png", "img/peer.png", None]
    text = scorecard.document(reports, images)
    headings = headings_of(text)
    assert headings == [
        "# Cancellation scorecard",
        "## How to read a cell",
        "## Commands",
        "## Systems measured",
        "## Side by side",
        "## Reading",
        "## The scorecards",
        "### Sluice (lean)",
        "### FastAPI peer (shared/peers)",
        "### Sluice (local)",
    ]
    for commit in ("16c9a64", "0ddba11"):
        assert commit in text
    assert "python 3.11.7, sluice 0.1.0, trio 0.35.0" in text
    assert "coredis 6.9.0" in text  # the full list, in the system's own section
    assert "![Sluice (lean): the cancellation heat-map](cancellation-sluice-lean.png)" in text
    assert "(img/peer.png)" in text
    assert text.count("![") == 2
    assert "python -m proxy.bench --matrix --repeat 5" in text
    assert scorecard.GENERIC_TARGET in text
    # The systems in the order given, in every section.
    for section in text.split("\n## ")[3:]:
        assert section.index("Sluice (lean)") < section.index("FastAPI peer")


def test_side_by_side_has_a_row_per_system() -> None:
    text = scorecard.document([sluice(), peer(), local()])
    rows = text.split("## Side by side")[1].split("\n\n")[1].splitlines()[2:]
    assert rows[0].startswith("| Sluice (lean) | 66 | 66 | 0 | 1.0 ms | 1.0 ms | 1.0 ms | 0 |")
    assert rows[1].startswith(
        "| FastAPI peer (shared/peers) | 27 | 21 | 6 (30 trials) | 1.0 ms | 1.0 ms | 12.5 ms | 2 |"
    )
    assert rows[1].endswith("| 8 | 134/135 | — | — | — |")
    assert "| ≤1 step | ≤3 steps | ≤1 step | 1 |" in rows[2]


# --------------------------------------------------------------------------- command line


def test_a_missing_or_malformed_report_exits_naming_the_file(tmp_path: Path) -> None:
    out = tmp_path / "c.md"
    missing = tmp_path / "gone.json"
    with pytest.raises(SystemExit, match=r"gone\.json: No such file"):
        scorecard.main([str(missing), "--markdown", str(out)])
    broken = tmp_path / "broken.json"
    broken.write_text('{"system": ')
    with pytest.raises(SystemExit, match=r"broken\.json: not JSON"):
        scorecard.main([str(broken), "--markdown", str(out)])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"system": "x", "cells": []}))
    with pytest.raises(SystemExit, match=r"other\.json: not a matrix report \(no commit"):
        scorecard.main([str(other), "--markdown", str(out)])
    wrong = tmp_path / "wrong.json"
    wrong.write_text(
        json.dumps(report("x", [{**cell("head", "sse", "chat", "fin"), "leave": "x"}]))
    )
    with pytest.raises(SystemExit, match=r"wrong\.json: cell 0: leave 'x'"):
        scorecard.main([str(wrong), "--markdown", str(out)])
    assert not out.exists()


def test_image_names_are_slugs_of_the_system() -> None:
    assert scorecard.image_name("Sluice (lean)") == "cancellation-sluice-lean.png"
    assert scorecard.image_name("FastAPI peer (shared/peers)") == (
        "cancellation-fastapi-peer-shared-peers.png"
    )
    assert scorecard.image_name("LiteLLM 1.50!") == "cancellation-litellm-1-50.png"


def test_main_writes_the_document_and_links_each_image_relative_to_it(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    first, second = tmp_path / "lean.json", tmp_path / "peer.json"
    first.write_text(json.dumps(sluice()))
    second.write_text(json.dumps(peer()))
    out = tmp_path / "docs" / "cancellation.md"
    scorecard.main([str(first), str(second), "--markdown", str(out), "--images", str(tmp_path)])
    text = out.read_text()
    assert "](../cancellation-sluice-lean.png)" in text
    assert "](../cancellation-fastapi-peer-shared-peers.png)" in text
    assert (tmp_path / "cancellation-sluice-lean.png").read_bytes().startswith(PNG_SIGNATURE)


def test_the_heatmap_is_a_png_with_the_same_bytes_each_time(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for made in (peer(), local()):
        first, second = tmp_path / "a.png", tmp_path / "b.png"
        scorecard.heatmap(made, first)
        scorecard.heatmap(made, second)
        assert first.read_bytes().startswith(PNG_SIGNATURE)
        assert first.read_bytes() == second.read_bytes()


def test_the_benchmarks_page_gets_one_section_linking_the_document(tmp_path: Path) -> None:
    reports = tmp_path / "lean.json", tmp_path / "peer.json"
    reports[0].write_text(json.dumps(sluice()))
    reports[1].write_text(json.dumps(peer()))
    docs = tmp_path / "docs"
    benchmarks = docs / "benchmarks.md"
    docs.mkdir()
    benchmarks.write_text("# Benchmarks\n\nEarlier figures.\n")
    argv = [str(r) for r in reports]
    argv += ["--markdown", str(docs / "cancellation.md"), "--link-from", str(benchmarks)]
    scorecard.main(argv)
    scorecard.main(argv)  # a rerun replaces its section, never adds a second
    text = benchmarks.read_text()
    assert text.startswith("# Benchmarks\n\nEarlier figures.\n")
    assert text.count("## Cancellation scorecard") == 1
    assert "[cancellation.md](cancellation.md)" in text
    assert "- **Sluice (lean)** (commit" in text
    # The peer's shortfall is on its line, with the count.
    assert "6 never (30 trials)" in text


# --------------------------------------------------------------------------- traces


def traced(made: dict[str, Any], short: dict[tuple[str, str, str, str], str] = {}) -> Any:  # noqa: B006
    """``made`` with every ran cell's trace verdicts (as ``Cell.to_json`` writes them): 5/5,
    or 3/5 with ``short``'s reason in the cells it names."""
    for row in made["cells"]:
        if row["served"] and row["applicable"]:
            why = short.get((row["transport"], row["phase"], row["endpoint"], row["leave"]))
            row["trace"] = (
                {"traced": 3, "judged": 5, "failures": {why: 2}}
                if why
                else {"traced": 5, "judged": 5, "failures": {}}
            )
    return made


SHORT = {
    ("sse", "mid_stream", "chat", "fin"): "no 'upstream closed' event",
    ("ws", "mid_stream", "chat", "rst"): "span 'POST' did not end",
}


def test_the_trace_column_counts_trials_for_sluice_and_a_dash_for_others() -> None:
    assert scorecard.summarise(traced(sluice()))["traced"] == 330
    short = scorecard.summarise(traced(sluice(), SHORT))
    assert (short["traced"], short["trace_trials"]) == (326, 330)
    # A report without the field (a peer's, one written before it): no figure.
    assert scorecard.summarise(peer())["traced"] is None
    text = scorecard.document([traced(sluice()), traced(sluice(), SHORT), peer()])
    side = text.split("## Side by side")[1].split("\n\n")[1].splitlines()
    assert side[0].endswith("| cells with active streams left | trace |")
    assert side[2].endswith("| 0 | 0 | 330/330 |")
    # Short of N: not a clean mark.
    assert side[3].endswith("| 0 | 0 | **326/330** |")
    assert side[4].endswith("| — | — | — |")
    assert "Trace: trials whose own trace" in text


def test_the_reading_meets_every_target_only_with_every_trace_right() -> None:
    (whole,) = [p for p in scorecard.reading(traced(sluice())) if p.startswith("met")]
    assert "every trial's trace saying what happened (330/330)" in whole
    phrases = scorecard.reading(traced(sluice(), SHORT))
    assert not any(p.startswith("met every target") for p in phrases)
    (phrase,) = [p for p in phrases if "trace did not say" in p]
    assert phrase.startswith("the trace did not say what happened in 4 of 330 trials, in 2 cells")
    assert "sse mid_stream chat fin trace 3/5" in phrase
    assert "(why: no 'upstream closed' event (2); span 'POST' did not end (2))" in phrase
    # Without verdicts, the reading says nothing of traces.
    assert not any("trace" in p for p in scorecard.reading(sluice()))


def test_a_scorecard_cell_shows_its_trace_only_when_short() -> None:
    from proxy.bench.matrix.report import cell_text

    row = cell("mid_stream", "sse", "chat", "fin")
    assert cell_text({**row, "trace": {"traced": 5, "judged": 5, "failures": {}}}) == (
        "5/5 · p99 1.0 ms"
    )
    short = {"traced": 4, "judged": 5, "failures": {"x": 1}}
    assert cell_text({**row, "trace": short}).endswith(" · trace 4/5")
    assert cell_text(row) == "5/5 · p99 1.0 ms"


def test_a_heatmap_with_traces_frames_the_short_cells_and_is_stable(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    whole, short = tmp_path / "whole.png", tmp_path / "short.png"
    scorecard.heatmap(traced(sluice()), whole)
    scorecard.heatmap(traced(sluice(), SHORT), short)
    again = tmp_path / "again.png"
    scorecard.heatmap(traced(sluice(), SHORT), again)
    assert short.read_bytes().startswith(PNG_SIGNATURE)
    assert short.read_bytes() == again.read_bytes()
    assert short.read_bytes() != whole.read_bytes()
