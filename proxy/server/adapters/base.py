"""What every adapter is: a library's supported range and the internals it relies on."""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger("sluice.adapters")


class StartupError(Exception):
    """A dependency lacks an internal Sluice cannot do without: the server does not start."""


@dataclass(frozen=True)
class Internal:
    """One attribute of a library, by dotted path (``module.Class.attribute``). ``feature``:
    what falls back (to the library's public path) when it is missing; None: required."""

    path: str
    feature: str | None = None
    # A further condition than the path resolving (a parameter a method must take).
    check: Callable[[], bool] | None = None
    # For a method Sluice overrides or calls: the parameters it must take, by name.
    parameters: tuple[str, ...] = ()

    def present(self) -> bool:
        if not resolve(self.path) or (self.check is not None and not self.check()):
            return False
        if not self.parameters:
            return True
        target = lookup(self.path)
        if not callable(target):
            return False
        try:
            taken = inspect.signature(target).parameters
        except (TypeError, ValueError):
            return False
        return all(name in taken for name in self.parameters)


@dataclass
class AdapterReport:
    distribution: str
    installed: str | None
    in_range: bool
    missing: list[Internal] = field(default_factory=list)
    fatal: list[str] = field(default_factory=list)
    fallbacks: dict[str, list[str]] = field(default_factory=dict)


def release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.18.0" -> (0, 18, 0); "1.0rc1" -> (1, 0)."""
    numbers = []
    for part in text.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() != len(part):
            break
    return tuple(numbers)


_MISSING = object()


def lookup(path: str) -> object:
    """What the dotted ``path`` names (the longest importable module prefix, then attributes
    that the last class in the path defines itself, not inherits), or ``_MISSING``."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            owner = target
            target = getattr(target, name, _MISSING)
            if target is _MISSING:
                return _MISSING
        # An override must be the class's own: an inherited one is the base's, and a
        # subclass of ours overriding it would silently never run.
        if isinstance(owner, type) and parts[split:] and parts[-1] not in vars(owner):
            return _MISSING
        return target
    return _MISSING


def resolve(path: str) -> bool:
    """Whether the dotted ``path`` names something."""
    return lookup(path) is not _MISSING


class Adapter:
    def __init__(
        self,
        distribution: str,
        floor: str,
        below: str,
        internals: list[Internal],
        fallbacks: dict[str, str],
    ) -> None:
        self.distribution = distribution
        # The range pyproject.toml declares (tests/server/test_adapters.py checks they agree).
        self.floor = floor
        self.below = below
        self.internals = internals
        # feature -> what happens without it (the line logged at start-up).
        self.fallback_text = fallbacks
        self._report: AdapterReport | None = None

    @property
    def specifier(self) -> str:
        return f">={self.floor},<{self.below}" if self.below else f">={self.floor}"

    def reset(self) -> None:
        self._report = None

    def check(self) -> AdapterReport:
        if self._report is not None:
            return self._report
        try:
            installed: str | None = version(self.distribution)
        except PackageNotFoundError:
            installed = None
        in_range = installed is not None and release(self.floor) <= release(installed)
        if in_range and self.below:
            assert installed is not None
            in_range = release(installed) < release(self.below)
        report = AdapterReport(self.distribution, installed, in_range)
        if not in_range:
            log.warning(
                "%s %s is outside the range Sluice is tested with (%s); its internals are "
                "checked one by one",
                self.distribution,
                installed or "(not installed)",
                self.specifier,
            )
        for internal in self.internals:
            if internal.present():
                continue
            report.missing.append(internal)
            if internal.feature is None:
                report.fatal.append(
                    f"{self.distribution} {installed}: {internal.path} is missing, and Sluice "
                    f"cannot run without it (supported: {self.distribution}{self.specifier})"
                )
            else:
                report.fallbacks.setdefault(internal.feature, []).append(internal.path)
        for feature, paths in report.fallbacks.items():
            log.warning(
                "%s %s: %s missing; %s",
                self.distribution,
                installed,
                ", ".join(paths),
                self.fallback_text[feature],
            )
        self._report = report
        return report

    def usable(self, feature: str) -> bool:
        return feature not in self.check().fallbacks
