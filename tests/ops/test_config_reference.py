"""The configuration reference is written from ``proxy/config.py``: every key of every table the
loader reads, with the comment above its field, and the committed page is the one it writes."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from proxy import config as config_module
from proxy.cli import main
from proxy.config import (
    MODEL_KINDS,
    ClaimMapConfig,
    JwtIssuerConfig,
    KeyConfig,
    UpstreamRequestConfig,
    config_from_mapping,
)
from proxy.ops.config_reference import COMMAND, PAGE, UndocumentedKey, _markdown, reference

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = config_module._SECTIONS


def test_the_committed_page_is_the_one_the_config_writes() -> None:
    committed = (ROOT / PAGE).read_text()
    assert committed == reference(), (
        f"{PAGE} is stale: proxy/config.py changed. Regenerate it with `{COMMAND}` "
        "(from the repository's root) and commit it"
    )


def section_of(page: str, heading: str) -> str:
    start = page.index(f"\n## {heading}")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)]


# Keys of a section that are arrays of tables, set in the file only: [[auth.jwt]].
FILE_ONLY = {("auth", "jwt")}


def test_every_key_of_every_table_is_in_its_section_with_its_comment() -> None:
    page = reference()
    source = inspect.getsource(config_module)
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if (name, f.name) in FILE_ONLY:
                continue
            assert f"- **`{f.name}`** (" in page
            assert f"`SLUICE_{name.upper()}_{f.name.upper()}`" in page
    # The arrays of tables inside a section, each a table of its own on the page.
    issuers = section_of(page, "`[[auth.jwt]]`")
    for f in dataclasses.fields(JwtIssuerConfig):
        assert f.name == "map" or f"- **`{f.name}`** (" in issuers
    maps = section_of(page, "`[[auth.jwt.map]]`")
    for f in dataclasses.fields(ClaimMapConfig):
        assert f"- **`{f.name}`** (" in maps
    keys = section_of(page, "`[[keys]]`")
    for f in dataclasses.fields(KeyConfig):
        assert f"- **`{f.name}`** (" in keys
    inherited = {f.name for f in dataclasses.fields(UpstreamRequestConfig)}
    for backend, kind in MODEL_KINDS.items():
        table = section_of(page, f'`[models.<name>]` with `backend = "{backend}"`')
        for f in dataclasses.fields(kind):
            if f.name == "name":
                assert "- **`name`**" not in table  # the table's own name, not a key
            elif f.name in inherited:
                assert f"`{f.name}`" in table  # listed as taken from [upstream]
            else:
                assert f"- **`{f.name}`** (" in table
    # A field's comment comes through, word for word.
    assert "a slow reader blocks the producer instead of growing it" in source
    assert "a slow reader blocks the producer instead of growing it" in page


def test_the_command_line_flags_are_the_loaders_own() -> None:
    server = section_of(reference(), "`[server]`")
    for flag in ("--host", "--port", "--workers"):
        assert f"`{flag}`" in server
    assert "`--backlog`" not in server


def test_every_environment_variable_it_names_is_one_the_loader_reads() -> None:
    names = re.findall(r"`(SLUICE_[A-Z0-9_]+)`", reference())
    named = {name for name in names if "<" not in name}
    fields = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert len(named) == fields - len(FILE_ONLY)
    for name in sorted(named):
        section = next(
            s
            for s in sorted(SECTIONS, key=len, reverse=True)
            if name.startswith(f"SLUICE_{s.upper()}_")
        )
        key = name.removeprefix(f"SLUICE_{section.upper()}_").lower()
        default = getattr(SECTIONS[section](), key)
        text = ",".join(default) if isinstance(default, tuple) else str(default)
        config = config_from_mapping({}, env={name: text})
        assert getattr(getattr(config, section), key) == default


def test_a_field_without_a_comment_is_refused_by_name() -> None:
    source = inspect.getsource(config_module)
    bare = re.sub(r"\n    # [^\n]*\n    stall_timeout:", "\n    stall_timeout:", source)
    assert bare != source
    with pytest.raises(UndocumentedKey, match="'stall_timeout' in RelayConfig"):
        reference(bare)


def test_comments_become_markdown_that_keeps_every_character() -> None:
    text = _markdown('With balance = "least_busy" in [upstream] or [models.<name>]: HTTP(S)_PROXY')
    assert text == (
        'With balance = `"least_busy"` in `[upstream]` or `[models.<name>]`: HTTP(S)\\_PROXY'
    )
    assert _markdown("2 * 3 < 4, see proxy/server/fast_path.py") == (
        "2 \\* 3 \\< 4, see `proxy/server/fast_path.py`"
    )
    assert _markdown("``literal`` stays code\n\nA second paragraph") == (
        "`literal` stays code\n\nA second paragraph"
    )


def test_sluice_config_reference_prints_or_writes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == reference()
    out = tmp_path / "reference.md"
    assert main(["config-reference", "--output", str(out)]) == 0
    assert out.read_text() == reference()
