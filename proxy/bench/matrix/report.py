"""The matrix's text: a line per cell as it finishes, and the markdown tables of a report (one
per transport and leave; phases down, endpoints across), which the scorecard also embeds."""

from __future__ import annotations

from typing import Any

from proxy.bench.matrix.cells import ENDPOINTS, LEAVES, PHASES, TRANSPORTS, Cell


def progress_line(cell: Cell) -> str:
    row = cell.to_json()
    name = f"{cell.phase:<11} {cell.transport:<4} {cell.endpoint:<11} {cell.leave:<5}"
    if not (cell.served and cell.applicable):
        return f"{name} {cell.note}"
    if row["steps_after_leave_max"] is not None:
        clock = f"steps after the leave ≤{row['steps_after_leave_max']}"
    else:
        clock = f"p99 {row['p99_ms']} ms"
    return (
        f"{name} cancelled {row['cancelled']}/{cell.n}  {clock}  "
        f"tokens for nobody {row['tokens_for_nobody']}  next served {row['next_served']}/{cell.n}"
    )


def cell_text(row: dict[str, Any]) -> str:
    if not row["served"]:
        return "not served"
    if not row["applicable"]:
        return "n/a"
    text = f"{row['cancelled']}/{row['n']}"
    if row["p99_ms"] is not None:
        text += f" · p99 {row['p99_ms']:.1f} ms"
    steps = row.get("steps_after_leave_max")
    if steps is not None:
        text += f" · ≤{steps} step{'s' if steps != 1 else ''}"
    if row["tokens_for_nobody"]:
        text += f" · {row['tokens_for_nobody']} tok"
    if row["next_served"] != row["n"]:
        text += f" · next {row['next_served']}/{row['n']}"
    trace = row.get("trace")
    if trace and trace["traced"] != trace["judged"]:
        text += f" · trace {trace['traced']}/{trace['judged']}"
    return text


def markdown_report(report: dict[str, Any]) -> str:
    """One table per transport and leave: phases down, endpoints across."""
    cells = report["cells"]
    lines = [
        f"### {report['system']}",
        "",
        f"Commit {report['commit']}, measured {report['measured_at']}, N = {report['repeat']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        "",
        (
            "Each cell: cancelled/N (the model let the sequence go; queued: never admitted; "
            "after_last: completed) · forward passes it still took part in after Sluice saw "
            "the client go (at most) · tokens generated for nobody · next request served "
            "(shown only when not N/N)."
            if report.get("kind") == "local"
            else "Each cell: cancelled/N (the upstream saw the client go; queued: never reached "
            "it; after_last: completed) · cancel p99 · tokens generated for nobody · next "
            "request served (shown only when not N/N)."
        )
        + (
            " Trace k/N: trials whose own trace says what happened (shown only when not N/N)."
            if any(c.get("trace") for c in cells)
            else ""
        ),
        "",
    ]
    groups = sorted({(c["transport"], c["leave"]) for c in cells}, key=_group_order)
    for transport, leave in groups:
        rows = [c for c in cells if c["transport"] == transport and c["leave"] == leave]
        endpoints = [e for e in ENDPOINTS if any(r["endpoint"] == e for r in rows)]
        phases = [p for p in PHASES if any(r["phase"] == p for r in rows)]
        lines += [f"**{transport}, leave by {leave}**", ""]
        lines.append("| phase | " + " | ".join(endpoints) + " |")
        lines.append("|---" * (len(endpoints) + 1) + "|")
        for phase in phases:
            texts = []
            for endpoint in endpoints:
                match = [r for r in rows if r["phase"] == phase and r["endpoint"] == endpoint]
                texts.append(cell_text(match[0]) if match else "")
            lines.append(f"| {phase} | " + " | ".join(texts) + " |")
        lines.append("")
    return "\n".join(lines)


def _group_order(group: tuple[str, str]) -> tuple[int, int]:
    return TRANSPORTS.index(group[0]), LEAVES.index(group[1])
