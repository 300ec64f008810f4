"""A report's heat-map: a row per transport and phase, a column per endpoint and leave, the
colour the cancelled fraction and the text the cell's clock (see HOW_TO_READ), a cell framed
when over its target or when a trial's trace did not say what happened, drawn so that the same
report gives the same bytes (a rerun on unchanged data leaves git nothing to show)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from proxy.bench.matrix.cells import ENDPOINTS, LEAVES, PHASES, TRANSPORTS
from proxy.bench.plots import load_pyplot
from proxy.bench.scorecard.reports import (
    TARGET_P99_MS,
    TARGET_STEPS,
    Cell,
    Report,
    kind,
    steps_after_leave,
    trace_counts,
)

CANCELLED_COLOURS: Final = ("#d7301f", "#fee08b", "#91cf60")
NOT_SERVED: Final = "#bdbdbd"
NOT_APPLICABLE_HATCH: Final = "#a6a6a6"
OVER_TARGET: Final = "#b00000"
TRACE_SHORT: Final = "#6a3d9a"
DPI: Final = 100


def image_name(system: str) -> str:
    """``cancellation-<slug>.png``: the slug is the name in lowercase ``[a-z0-9-]``."""
    slug = re.sub(r"[^a-z0-9]+", "-", system.lower()).strip("-") or "system"
    return f"cancellation-{slug}.png"


def _cell_label(cell: Cell, local: bool) -> tuple[str, bool]:
    """(text, over the target) for a cell whose trials ran."""
    steps = steps_after_leave(cell)
    if local and steps is not None:
        text, over = f"≤{steps} st", steps > TARGET_STEPS
    elif cell.get("p99_ms") is not None:
        text, over = f"{cell['p99_ms']:.1f}", cell["p99_ms"] > TARGET_P99_MS
    else:
        text, over = f"{cell.get('cancelled')}/{cell['n']}", False
    if cell.get("tokens_for_nobody"):
        text += f"\n{cell['tokens_for_nobody']} tok"
    traced, judged = trace_counts(cell) or (0, 0)
    if traced < judged:
        text += f"\ntr {traced}/{judged}"
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
                if cell is not None:
                    _draw_cell(ax, patches, (i, j), cell, local, grid)
        image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=1, aspect="auto", zorder=0)
        _axes_labels(ax, rows, columns)
        fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02, label="cancelled / N")
        _legend(fig, patches, local, traced=any(trace_counts(c) for c in cells))
        what = "decode steps after the client went" if local else "cancel p99 in ms"
        fig.suptitle(
            f"{report['system']} · commit {report['commit']} · N = {report['repeat']}\n"
            f"colour: cancelled / N; text: {what}"
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        plt.close(fig)


def _draw_cell(
    ax: Any,
    patches: Any,
    at: tuple[int, int],
    cell: Cell,
    local: bool,
    grid: list[list[float]],
) -> None:
    """Cell ``at`` (row, column): grey when not served, hatched when not applicable, else its
    cancelled fraction into ``grid`` and its label over it, framed when over the target."""
    i, j = at
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
        traced, judged = trace_counts(cell) or (0, 0)
        if traced < judged:
            ax.add_patch(
                patches.Rectangle(
                    (j - 0.38, i - 0.38),
                    0.76,
                    0.76,
                    fill=False,
                    edgecolor=TRACE_SHORT,
                    linestyle="--",
                    lw=1.4,
                )
            )


def _legend(fig: Any, patches: Any, local: bool, *, traced: bool) -> None:
    handles = [
        patches.Patch(facecolor=NOT_SERVED, label="not served"),
        patches.Patch(facecolor="white", edgecolor=NOT_APPLICABLE_HATCH, hatch="///", label="n/a"),
        patches.Patch(
            fill=False,
            edgecolor=OVER_TARGET,
            lw=1.6,
            label=f"over {TARGET_STEPS} step" if local else f"p99 over {TARGET_P99_MS:g} ms",
        ),
    ]
    if traced:
        # Only a report with trace verdicts: the others' pictures stay byte for byte.
        handles.append(
            patches.Patch(
                fill=False,
                edgecolor=TRACE_SHORT,
                linestyle="--",
                lw=1.4,
                label="trace short of N",
            )
        )
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)


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


def image_paths(reports: Sequence[Report], folder: Path) -> list[Path]:
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
