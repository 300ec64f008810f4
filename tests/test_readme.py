"""The README is read to the end by a newcomer: it stays short, and every page it sends them to
exists (the docs site's own build checks the links between pages; the README is not in it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Past this the README is a manual again, and what it holds belongs in docs/.
MAX_LINES = 300


def test_the_readme_stays_short() -> None:
    lines = README.read_text().splitlines()
    assert 0 < len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_every_relative_link_and_image_of_the_readme_exists() -> None:
    targets = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [t.split("#", 1)[0] for t in targets if "://" not in t and not t.startswith("#")]
    assert "docs/chat-page.png" in local and "docs/configuration-reference.md" in local
    missing = [target for target in local if not (ROOT / target).exists()]
    assert missing == []
