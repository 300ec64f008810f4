"""The headings of a bench document (``docs/benchmarks.md``): each says what its section
measures, once.

Two sections whose loads differ only in a setting the title leaves out (the repeats, the ramp)
would get one title twice; a docs site cannot link to either, and a reader cannot tell them
apart. A section's headings are therefore made unique against the rest of the document, by the
words of the settings that tell its load from the other's. A heading never names a tracker
entry ("issue N"): the number means nothing to a reader of the results.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from proxy.bench.settings import key_words

_HEADING = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_BEGIN = re.compile(r"^<!-- bench:begin (.*) -->$")
_END = re.compile(r"^<!-- bench:end (.*) -->$")
_ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+|(?<![\w&])#\d+\b", re.IGNORECASE)


class HeadingError(ValueError):
    """A heading the bench must not write."""


def _heading_lines(text: str) -> Iterator[tuple[int, re.Match[str], str | None]]:
    """Each heading line outside code blocks: its index, its match, and the key of the bench
    block it is in (None outside every block)."""
    fenced = False
    block: str | None = None
    for index, line in enumerate(text.split("\n")):
        if _FENCE.match(line):
            fenced = not fenced
        elif fenced:
            continue
        elif begin := _BEGIN.match(line):
            block = begin.group(1)
        elif _END.match(line):
            block = None
        elif heading := _HEADING.match(line):
            yield index, heading, block


def headings(text: str) -> Iterator[tuple[str, str | None]]:
    """Each heading's text outside code blocks, with the key of the bench block it is in."""
    for _, match, block in _heading_lines(text):
        yield match.group(2), block


def _norm(heading: str) -> str:
    return " ".join(heading.lower().split())


def check_no_issue_numbers(section: str) -> None:
    for heading, _ in headings(section):
        if _ISSUE_NUMBER.search(heading):
            raise HeadingError(
                f"a bench heading names a tracker entry: {heading!r}; say what the load is"
            )


def unique_headings(section: str, key: str, others: str) -> str:
    """``section`` (the block of ``key``) with each heading that ``others`` (the rest of the
    document) already has made unique by what tells ``key``'s load from the other's."""
    check_no_issue_numbers(section)
    taken = {_norm(heading): block for heading, block in headings(others)}
    lines = section.split("\n")
    for index, match, _ in list(_heading_lines(section)):
        title = match.group(2)
        if _norm(title) not in taken:
            continue
        words = key_words(key, taken[_norm(title)])
        candidate = f"{title} ({', '.join(words)})" if words else title
        count = 2
        while _norm(candidate) in taken:
            candidate = f"{title} ({', '.join([*words, str(count)])})"
            count += 1
        lines[index] = f"{match.group(1)} {candidate}"
        taken[_norm(candidate)] = key
    return "\n".join(lines)
