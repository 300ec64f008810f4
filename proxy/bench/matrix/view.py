"""What the bench reads inside the system under test, between trials: Sluice's /metrics (its
active streams, and the local model's counters), the outcomes of its access lines, and the
process's open file descriptors against their baseline."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Final

import trio

from proxy.bench.client import http_get
from proxy.bench.matrix.cells import OBSERVE_TIMEOUT, Cell
from proxy.bench.matrix.systems import Context

# Sluice's local-model series the local trials read, by the name they are read as.
_LOCAL_SERIES: Final = {
    "sluice_local_steps_after_cancel_count": "cancels",
    "sluice_local_steps_after_cancel_sum": "steps_after_cancel",
    "sluice_local_tokens_for_nobody_total": "tokens_for_nobody",
    "sluice_local_generated_tokens_total": "generated",
    "sluice_local_prefill_seconds_count": "prefills",
}


async def read_local_counters(ctx: Context) -> dict[str, float]:
    """The local model's counters now, from Sluice's /metrics (summed over other labels)."""
    try:
        status, body = await http_get(ctx.address, "/metrics")
    except (OSError, ValueError):
        return {}
    return (
        local_counters(body.decode(errors="replace"), ctx.settings.model) if status == 200 else {}
    )


def local_counters(exposition: str, model: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        if f'model="{model}"' not in labels:
            continue
        key = _LOCAL_SERIES.get(name)
        if name == "sluice_queue_wait_seconds_count" and 'outcome="cancelled"' in labels:
            key = "queue_cancelled"
        if key is not None:
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


async def local_counters_when(
    ctx: Context, predicate: Callable[[dict[str, float]], bool], seconds: float
) -> dict[str, float]:
    """The counters once ``predicate`` holds for them, or as they are after ``seconds``."""
    counters = await read_local_counters(ctx)
    with trio.move_on_after(seconds):
        while not predicate(counters):
            await trio.sleep(0.01)
            counters = await read_local_counters(ctx)
    return counters


async def settled(ctx: Context, seconds: float) -> bool | None:
    """Whether the system under test is back at rest within ``seconds``: no active stream
    (Sluice's gauge; a peer has none to read) and its fds at the baseline. None: nothing to
    read (a --target system)."""
    return (await _settle(ctx, seconds))[0]


async def _settle(ctx: Context, seconds: float) -> tuple[bool | None, float | None, int | None]:
    """(settled, active streams, fds over the baseline), as last read within ``seconds``."""
    if ctx.pid is None:
        return None, None, None
    active, over = await _at_rest(ctx)
    with trio.move_on_after(seconds):
        while not (active in (0, None) and (over is None or over <= 0)):
            await trio.sleep(0.02)
            active, over = await _at_rest(ctx)
        return True, active, over
    return False, active, over


async def _at_rest(ctx: Context) -> tuple[float | None, int | None]:
    assert ctx.pid is not None
    # The fds first: the gauge's own request holds one of them for a moment.
    fds = fd_count(ctx.pid)
    active = await _active_streams(ctx.address)
    return active, None if fds is None or ctx.fd_baseline is None else fds - ctx.fd_baseline


async def sluice_view(ctx: Context, cell: Cell) -> None:
    """The system's own view after a cell: active streams, and fds over the baseline."""
    if ctx.pid is None:
        return
    _, cell.active_streams_after, cell.fds_over_baseline = await _settle(ctx, OBSERVE_TIMEOUT)
    cell.access_outcomes = access_outcomes(ctx)


def access_outcomes(ctx: Context) -> dict[str, int] | None:
    """Count the outcomes of the access lines written since the last call (and note, in
    ``ctx.trace_outcomes``, the outcome of each that names its trace)."""
    if ctx.log is None:
        return None
    try:
        with open(ctx.log, "rb") as log:
            log.seek(ctx.log_offset)
            text = log.read()
    except OSError:
        return None
    ctx.log_offset += len(text)
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith(b"{"):
            continue
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            # The API's own lines: not /metrics, /healthz (the matrix polls them).
            api = isinstance(fields, dict) and str(fields.get("path", "")).startswith("/v1/")
            if api and "outcome" in fields:
                outcome = str(fields["outcome"])
                counts[outcome] = counts.get(outcome, 0) + 1
                if fields.get("trace_id"):
                    ctx.trace_outcomes[str(fields["trace_id"])] = outcome
    return counts


async def _active_streams(address: tuple[str, int]) -> float | None:
    try:
        status, body = await http_get(address, "/metrics")
    except (OSError, ValueError):
        return None
    if status != 200:
        return None
    total = None
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("sluice_active_streams"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
