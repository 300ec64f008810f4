"""One adapter per library whose internals Sluice relies on: hypercorn, quart, quart-trio, trio,
httpcore.

Each adapter module names the installed version range it supports and every private internal
it uses (a dotted path), with what depends on it: a *required* internal has no fallback (the
server refuses to start, with one line that says which is missing), any other belongs to a
*feature* that falls back to the library's own public path when one of its internals is missing
(logged once at start-up). :func:`check_all` runs at start-up, before the server binds; the
modules that use an internal ask :func:`usable` for its feature.
"""

from __future__ import annotations

from proxy.server.adapters.base import Adapter, AdapterReport, StartupError
from proxy.server.adapters.httpcore_adapter import HTTPCORE
from proxy.server.adapters.hypercorn_adapter import HYPERCORN
from proxy.server.adapters.quart_adapter import QUART
from proxy.server.adapters.quart_trio_adapter import QUART_TRIO
from proxy.server.adapters.trio_adapter import TRIO

ADAPTERS: tuple[Adapter, ...] = (HYPERCORN, QUART, QUART_TRIO, TRIO, HTTPCORE)

__all__ = ["ADAPTERS", "AdapterReport", "StartupError", "check_all", "usable"]


def check_all() -> list[AdapterReport]:
    """Check every adapter (once per process; again after :func:`reset`): log one line per
    problem, raise :class:`StartupError` if a required internal is missing."""
    reports = [adapter.check() for adapter in ADAPTERS]
    missing = [line for report in reports for line in report.fatal]
    if missing:
        raise StartupError("; ".join(missing))
    return reports


def usable(feature: str) -> bool:
    """Whether every internal of ``feature`` was found (checking now if not yet checked)."""
    return all(adapter.usable(feature) for adapter in ADAPTERS)


def reset() -> None:
    """Forget the results (tests that monkeypatch an internal away, then check again)."""
    for adapter in ADAPTERS:
        adapter.reset()
