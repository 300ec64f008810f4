"""Sphinx's configuration for Sluice's docs site (``make docs``; ``make test`` builds it too).

Markdown through MyST-Parser, the theme Sphinx ships (alabaster): nothing is fetched at build
time. Strict: ``make docs`` passes ``-W --keep-going -n``, so a broken link, a missing anchor
or a page left out of every toctree fails the build.
"""

from __future__ import annotations

project = "Sluice"
author = "Sluice's authors"
copyright = "Sluice's authors"
release = "0.1.0"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
# The bench's JSON reports and images live beside the pages; only the pages are sources.
exclude_patterns: list[str] = []

# "[text](page.md#a-heading)" between pages: anchors for headings down to ###, checked.
myst_heading_anchors = 3
# Links with these schemes are external; a path to a source file (`proxy/config.py`) is
# written as code, not as a link, since the site has no copy of the sources to link to.
myst_url_schemes = ["http", "https", "mailto"]
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "Sluice"
html_theme_options = {
    "description": "An LLM streaming proxy whose requests live exactly as long as their clients",
    "page_width": "1180px",
    "sidebar_width": "240px",
}
html_static_path: list[str] = []
# The pages' sources are Markdown in the repository; the site need not copy them.
html_copy_source = False
html_show_sourcelink = False
