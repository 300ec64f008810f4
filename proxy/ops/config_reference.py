"""The configuration reference, written from the config dataclasses of :mod:`proxy.config`.

Every key of every table, with its TOML name, type, default, the ``SLUICE_*`` variable or flag
that overrides it, and the comment above its field in ``proxy/config.py``: that comment is the
key's documentation, kept in one place, beside the code that reads it. The loader's own tables
(its sections, its model kinds, ``[[keys]]``) say which tables there are, so a table the loader
reads cannot be missing here. ``sluice config-reference --output FILE`` writes the page; a test
fails when the committed one is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy import config as config_module
from proxy.config import (
    ENV_PREFIX,
    MODEL_KINDS,
    ClaimMapConfig,
    GuardConfig,
    JwtIssuerConfig,
    KeyConfig,
    UpstreamModel,
    UpstreamRequestConfig,
    load_config,
)

# Where the committed page lives, relative to the repository, and the command that writes it.
PAGE = "docs/configuration-reference.md"
COMMAND = f"sluice config-reference --output {PAGE}"

# The loader's own table of sections (`[server]`...): the ones that take SLUICE_* variables.
_SECTIONS: dict[str, type[Any]] = config_module._SECTIONS


class UndocumentedKey(ValueError):
    """A config field without a comment above it: the reference would have nothing to say."""


@dataclass(frozen=True)
class Key:
    """One key of a table, as the reference shows it."""

    name: str
    kind: str  # "string", "integer"... in TOML's words
    default: str  # as TOML would write it
    comment: str  # the comment above the field, as Markdown
    overrides: tuple[str, ...] = ()  # the SLUICE_* variable, a command-line flag


@dataclass(frozen=True)
class Table:
    heading: str
    intro: str
    keys: tuple[Key, ...]


def reference(source: str | None = None) -> str:
    """The reference page, as Markdown. ``source`` is ``proxy/config.py``'s text (by default
    read from the module itself)."""
    text = source if source is not None else inspect.getsource(config_module)
    parsed = _Source(text)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Written by `{COMMAND}` from proxy/config.py; edit the comments there. -->",
        "",
        *_intro(parsed),
    ]
    for table in tables(parsed):
        lines += ["", f"## {table.heading}", ""]
        if table.intro:
            lines += [table.intro, ""]
        lines += [_key_line(key) for key in table.keys]
    return "\n".join(lines) + "\n"


def write(path: Path) -> None:
    path.write_text(reference())


def tables(parsed: _Source) -> Iterator[Table]:
    """Every table the loader reads, in the order a config file usually has them."""
    flags = _command_line_flags()
    for name, cls in _SECTIONS.items():
        if name == "upstream":
            yield from _upstream_tables(parsed, cls)
            continue
        if name == "auth":
            yield from _auth_tables(parsed, cls)
            continue
        keys = tuple(
            _key(parsed, cls, f, (_env_name(name, f.name), *flags.get((name, f.name), ())))
            for f in dataclasses.fields(cls)
        )
        yield Table(f"`[{name}]`", parsed.docstring(cls), keys)
    yield from _model_tables(parsed)
    keys = tuple(_key(parsed, KeyConfig, f) for f in dataclasses.fields(KeyConfig))
    yield Table("`[[keys]]`", parsed.docstring(KeyConfig), keys)
    keys = tuple(_key(parsed, GuardConfig, f) for f in dataclasses.fields(GuardConfig))
    yield Table("`[[guards]]`", parsed.docstring(GuardConfig), keys)


def _auth_tables(parsed: _Source, cls: type[Any]) -> Iterator[Table]:
    """[auth], then its arrays of tables (set in the file only): [[auth.jwt]] and its maps."""
    keys = tuple(
        _key(parsed, cls, f, (_env_name("auth", f.name),))
        for f in dataclasses.fields(cls)
        if f.name != "jwt"
    )
    yield Table("`[auth]`", parsed.docstring(cls), keys)
    keys = tuple(
        _key(parsed, JwtIssuerConfig, f)
        for f in dataclasses.fields(JwtIssuerConfig)
        if f.name != "map"
    )
    yield Table("`[[auth.jwt]]`", parsed.docstring(JwtIssuerConfig), keys)
    keys = tuple(_key(parsed, ClaimMapConfig, f) for f in dataclasses.fields(ClaimMapConfig))
    yield Table("`[[auth.jwt.map]]`", parsed.docstring(ClaimMapConfig), keys)


def _upstream_tables(parsed: _Source, cls: type[Any]) -> Iterator[Table]:
    """``[upstream]`` in two parts: what a model's table may set for itself, and the rest."""
    per_request = {f.name for f in dataclasses.fields(UpstreamRequestConfig)}
    fields = dataclasses.fields(cls)
    request = tuple(
        _key(parsed, cls, f, (_env_name("upstream", f.name),))
        for f in fields
        if f.name in per_request
    )
    pools = tuple(
        _key(parsed, cls, f, (_env_name("upstream", f.name),))
        for f in fields
        if f.name not in per_request
    )
    yield Table(
        "`[upstream]`: each request",
        _join(
            parsed.docstring(UpstreamRequestConfig),
            "Each of these may also be set in a model's own table (below), for that model.",
        ),
        request,
    )
    yield Table("`[upstream]`: the replicas' pools and health", parsed.docstring(cls), pools)


def _model_tables(parsed: _Source) -> Iterator[Table]:
    inherited = {f.name for f in dataclasses.fields(UpstreamRequestConfig)}
    for backend, kind in MODEL_KINDS.items():
        own = [f for f in dataclasses.fields(kind) if f.name != "name"]
        intro = _join(parsed.docstring(config_module.ModelBase), parsed.docstring(kind))
        if kind is UpstreamModel:
            own = [f for f in own if f.name not in inherited]
            listed = ", ".join(f"`{name}`" for name in sorted(inherited))
            intro = _join(
                intro,
                "Besides the keys below, the table may set any key of the per-request part of "
                f"`[upstream]` for this model, which has `[upstream]`'s value otherwise: {listed}.",
            )
        intro = _join(intro, "A model's table has no environment variables.")
        default = " (a table without `backend`)" if kind is UpstreamModel else ""
        heading = f'`[models.<name>]` with `backend = "{backend}"`{default}'
        yield Table(heading, intro, tuple(_key(parsed, kind, f) for f in own))


def _intro(parsed: _Source) -> list[str]:
    sections = ", ".join(f"`[{name}]`" for name in _SECTIONS)
    return [
        parsed.module_docstring,
        "",
        "A value may be overridden for one run without editing the file, for the tables "
        f"{sections}: the environment variable `{ENV_PREFIX}<TABLE>_<KEY>` (in capitals, such "
        f"as `{_env_name('relay', 'stall_timeout')}`), read as the key's type (a boolean from "
        "`true`/`false`, `1`/`0`, `yes`/`no` or `on`/`off`; an array of strings from "
        "comma-separated items), then the flags of `sluice serve` named below. A `SLUICE_*` "
        "variable that names no key is an error too. Models and keys are set in the file only.",
        "",
        "Defaults are written as TOML would write them. Every table below is optional; a model "
        "table (`[models.<name>]`) is needed to serve anything.",
    ]


def _key(
    parsed: _Source, cls: type[Any], f: dataclasses.Field[Any], overrides: tuple[str, ...] = ()
) -> Key:
    hint = typing.get_type_hints(cls)[f.name]
    return Key(
        name=f.name,
        kind=_kind(hint),
        default=_toml(_default(f)),
        comment=parsed.comment(cls, f.name),
        overrides=overrides,
    )


def _key_line(key: Key) -> str:
    facts = [key.kind, f"default `{key.default}`"]
    if key.default.isdigit() and int(key.default) >= 1024 and key.name.endswith("bytes"):
        facts[-1] += f" ({_size(int(key.default))})"
    facts += [f"`{override}`" for override in key.overrides]
    return f"- **`{key.name}`** ({', '.join(facts)}): {key.comment}"


def _env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section}_{key}".upper()


def _command_line_flags() -> dict[tuple[str, str], tuple[str, ...]]:
    """``load_config``'s own overrides (``host``, ``port``, ``workers``): keys of [server],
    given as ``sluice serve --host`` and so on."""
    server = {f.name for f in dataclasses.fields(_SECTIONS["server"])}
    parameters = inspect.signature(load_config).parameters
    return {("server", name): (f"--{name}",) for name in parameters if name in server}


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise UndocumentedKey(f"'{f.name}' has no default")  # every key is optional


def _kind(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "string: " + " or ".join(json.dumps(arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return "array of strings"
    if typing.get_origin(hint) is Mapping:
        return "table"  # [[guards]]'s options, handed to the guard as they are
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names[hint]


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return repr(value)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n:,} bytes"


def _join(*parts: str) -> str:
    return " ".join(part for part in parts if part)


class _Source:
    """``proxy/config.py`` read as source: each class's docstring, and the comment lines just
    above each field of a class, joined into one paragraph of Markdown."""

    def __init__(self, text: str) -> None:
        tree = ast.parse(text)
        lines = text.splitlines()
        self.module_docstring = _markdown(ast.get_docstring(tree) or "")
        self._docstrings: dict[str, str] = {}
        self._comments: dict[tuple[str, str], str] = {}
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            self._docstrings[node.name] = _markdown(ast.get_docstring(node) or "")
            for statement in node.body:
                if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                    comment = _comment_above(lines, statement.lineno)
                    self._comments[(node.name, statement.target.id)] = comment

    def docstring(self, cls: type[Any]) -> str:
        return self._docstrings.get(cls.__name__, "")

    def comment(self, cls: type[Any], name: str) -> str:
        """The comment of ``name`` where it is declared: ``cls`` or the class it inherits it
        from."""
        for owner in cls.__mro__:
            if (owner.__name__, name) in self._comments:
                comment = self._comments[(owner.__name__, name)]
                if not comment:
                    raise UndocumentedKey(
                        f"'{name}' in {owner.__name__} (proxy/config.py) has no comment above "
                        "it: say in one or two lines what the key is for"
                    )
                return comment
        raise UndocumentedKey(f"'{name}' of {cls.__name__} is not declared in proxy/config.py")


def _comment_above(lines: list[str], lineno: int) -> str:
    """The run of ``#`` lines right above line ``lineno`` (1-based), as one paragraph."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].lstrip().startswith("#"):
        found.append(lines[index].lstrip()[1:].strip())
        index -= 1
    return _markdown(" ".join(reversed(found)))


# Outside code spans: a quoted value ("least_busy"), a source file, a TOML table's name
# (`[server]`, `[[keys]]`, `[models.<name>]`) or a name with an underscore (a key, an
# environment variable) becomes code; what is left is escaped where Markdown would read it as
# markup.
_CODE_SPAN = re.compile(r"(`[^`]*`)")
_AS_CODE = re.compile(
    r'"[^"\s]*"'
    r"|\b[a-z_]+(?:/[a-z_]+)+\.py\b"
    r"|\[\[?[a-z_]+(?:\.<?[a-z_]+>?)?\]\]?"
    r"|\b[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b"
)
_MARKUP = re.compile(r"([\\*_<>\[\]])")


def _markdown(text: str) -> str:
    """Paragraphs (a docstring's, or one comment's) as Markdown, ``literal`` as `code`."""
    paragraphs = re.split(r"\n\s*\n", text.replace("``", "`"))
    return "\n\n".join(_markdown_line(" ".join(p.split())) for p in paragraphs if p.strip())


def _markdown_line(text: str) -> str:
    out = []
    for part in _CODE_SPAN.split(text):
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
            continue
        last = 0
        for match in _AS_CODE.finditer(part):
            out.append(_MARKUP.sub(r"\\\1", part[last : match.start()]))
            out.append(f"`{match.group()}`")
            last = match.end()
        out.append(_MARKUP.sub(r"\\\1", part[last:]))
    return "".join(out)
