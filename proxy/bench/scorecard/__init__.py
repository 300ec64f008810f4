"""``python -m proxy.bench.scorecard``: docs/cancellation.md assembled from the JSON reports
of ``sluice bench --matrix --json`` (one per system), with a heat-map per system.

    python -m proxy.bench.scorecard REPORT.json [REPORT.json ...] --markdown docs/cancellation.md
        [--images docs/]

The systems appear in the order given. The "Reading" is written from the figures, never by
hand, so that a rerun cannot leave a claim the new figures contradict. Each heat-map is
``cancellation-<system>.png`` in ``--images``, drawn so that the same report gives the same
bytes (a rerun on unchanged data leaves git with nothing to show).
"""

# The entry, over modules by role: reports (a report read and checked, its figures), reading
# (the generated "Reading"), document (the document and its link section) and heatmap (a
# report's picture).

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.bench.procfs import read_text_or_none
from proxy.bench.report import relative_link, upsert_section, write_text
from proxy.bench.scorecard.document import (
    GENERIC_TARGET,
    HOW_TO_READ,
    INTRO,
    LINK_KEY,
    document,
    link_section,
)
from proxy.bench.scorecard.heatmap import heatmap, image_name, image_paths
from proxy.bench.scorecard.reading import reading
from proxy.bench.scorecard.reports import (
    PROG,
    TARGET_P99_MS,
    TARGET_STEPS,
    Summary,
    kind,
    load_report,
    summarise,
)
from proxy.bench.settings import BenchError

__all__ = [
    "GENERIC_TARGET",
    "HOW_TO_READ",
    "INTRO",
    "LINK_KEY",
    "PROG",
    "TARGET_P99_MS",
    "TARGET_STEPS",
    "Summary",
    "document",
    "heatmap",
    "image_name",
    "kind",
    "link_section",
    "load_report",
    "main",
    "reading",
    "summarise",
]


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
        paths = image_paths(reports, args.images)
        try:
            for report, path in zip(reports, paths, strict=True):
                heatmap(report, path)
                print(f"wrote {path}")
        except BenchError as exc:
            sys.exit(f"{PROG}: {exc}")
        links = [relative_link(path, args.markdown.parent) for path in paths]
    write_text(args.markdown, document(reports, links))
    print(f"wrote {args.markdown}")
    if args.link_from is not None:
        old = read_text_or_none(str(args.link_from)) or ""
        target = relative_link(args.markdown, args.link_from.parent)
        write_text(args.link_from, upsert_section(old, LINK_KEY, link_section(reports, target)))
        print(f"linked from {args.link_from}")
