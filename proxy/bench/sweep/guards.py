"""The sweep's own guard: one that awaits before it answers, so that a cut can land while a
guard of the request is at work (a regex answers in the step that called it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio

from proxy.guards import Refusal


def waiting(options: Mapping[str, Any]) -> Callable[[Any], Awaitable[Refusal | None]]:
    """A factory (``use = "proxy.bench.sweep.guards:waiting"``): a guard for any stage that
    sleeps ``seconds`` (default 0.003), then passes, or refuses with ``refuse = true``."""
    seconds = float(options.get("seconds", 0.003))
    refuse = bool(options.get("refuse", False))

    async def guard(_context: Any) -> Refusal | None:
        await trio.sleep(seconds)
        return Refusal("refused by the sweep's guard", reason="sweep") if refuse else None

    return guard
