"""A bench document's headings: each once, none naming a tracker entry, whichever writer
wrote the section (the loads' upsert, the local model's own writer) and however often."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from proxy.bench import local
from proxy.bench.headings import HeadingError, headings, unique_headings
from proxy.bench.report import upsert_section
from proxy.bench.settings import BenchSettings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_two_loads_with_one_title_get_two_headings_and_keep_them_on_reruns() -> None:
    two = BenchSettings(streams=100, versus_tracing=True, repeat=2).key()
    three = BenchSettings(streams=100, versus_tracing=True, repeat=3).key()
    section = "## 100 streams, traced vs untraced\n\nfigures\n"
    text = upsert_section("", two, section)
    text = upsert_section(text, three, section)
    titles = [title for title, _ in headings(text)]
    assert titles.count("100 streams, traced vs untraced") == 1
    assert "100 streams, traced vs untraced (3 repeats)" in titles
    # Each rerun finds its own block and the same heading: the document does not move.
    assert upsert_section(text, three, section) == text
    assert upsert_section(text, two, section) == text


def test_a_heading_that_names_an_issue_is_refused() -> None:
    for title in ("Per-request cost (issue 33)", "Issue #12: pools", "the fix of #7"):
        with pytest.raises(HeadingError, match="tracker entry"):
            upsert_section("", "k=1", f"## {title}\n")
    # A number that is no tracker entry is a figure, and stays.
    assert "## 1500 streams, 3 tokens\n" in upsert_section("", "k=1", "## 1500 streams, 3 tokens\n")


def test_comment_lines_in_code_blocks_are_no_headings() -> None:
    text = "# Benchmarks\n\n```\n# Sluice (lean)\npython -m proxy.bench\n```\n"
    assert [title for title, _ in headings(text)] == ["Benchmarks"]
    section = "## Sluice (lean)\n```\n# Benchmarks\n```\n"
    assert unique_headings(section, "k=1", text) == section


def test_the_local_models_writer_keeps_its_heading_unique_too(tmp_path: Path) -> None:
    path = tmp_path / "benchmarks.md"
    title = "Local model: one stream vs `model.generate`, a chat's turns, many streams in one batch"
    path.write_text(f"# Benchmarks\n\n## {title}\n\nA note that took the title by hand.\n")
    local.write_markdown(path, f"{local.SECTION_MARK}\n## {title}\n\nfigures\n")
    titles = [heading for heading, _ in headings(path.read_text())]
    assert len(titles) == len(set(titles)) == 3


@pytest.mark.parametrize("name", ["benchmarks.md", "cancellation.md"])
def test_the_committed_documents_have_each_heading_once_and_no_issue_numbers(name: str) -> None:
    titles = [title for title, _ in headings((DOCS / name).read_text())]
    repeated = [title for title, count in Counter(titles).items() if count > 1]
    assert titles and repeated == []
    for title in titles:
        unique_headings(f"## {title}\n", "k=1", "")  # raises on a tracker entry
