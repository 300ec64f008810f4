"""The docs name only metrics and labels that exist: every ``sluice_*`` metric a page mentions is
one :class:`~proxy.ops.metrics.Metrics` declares (or one of the series Prometheus derives from
it: ``_total``, ``_bucket``, ``_count``, ``_sum``), and every label written in its braces is one
of its labels."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.backends.upstream.replica import routing_counter
from proxy.ops.metrics import Metrics, MetricSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"
# A metric's name, and the braces that may follow it: {model, band} or {band="10"}.
MENTION = re.compile(r"\b(sluice_[a-z0-9_]+)(\{[^}]*\})?")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def declared() -> dict[str, tuple[str, ...]]:
    specs = {}
    for value in vars(Metrics).values():
        if isinstance(value, MetricSpec):
            specs[value.name] = value.labels
    # The one counter a backend adds to the app's registry itself.
    routing = routing_counter(Metrics())
    specs[routing._name] = tuple(routing._labelnames)
    return specs


def resolve(name: str, specs: dict[str, tuple[str, ...]]) -> str | None:
    if name in specs:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in specs:
            return name[: -len(suffix)]
    return None


def test_every_metric_and_label_the_docs_name_exists() -> None:
    specs = declared()
    assert "sluice_preemptions" in specs  # the reader found the declarations
    unknown: list[str] = []
    checked = 0
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for match in MENTION.finditer(text):
            name, braces = match.group(1), match.group(2)
            base = resolve(name, specs)
            if base is None:
                # A prefix written as a family ("sluice_limits_*") or a name in prose that
                # is not a metric (a logger's, a Redis key's) is not a metric mention.
                if text[match.end(1) : match.end(1) + 1] in ("*", "."):
                    continue
                unknown.append(f"{page.name}: {name}")
                continue
            checked += 1
            if braces:
                for label in re.findall(r"([a-z_]+)\s*(?:=|,|})", braces + "}"):
                    if label not in specs[base] and label != "le":
                        unknown.append(f"{page.name}: {name}{braces} ({label})")
    assert checked > 20
    assert not unknown, unknown
