"""A run of the matrix: the fake and the system under test started side by side (and, for the
Sluice this bench starts, an OTLP receiver its spans go to), every cell's trials one at a time
(each cell then read from inside the system), every trial's trace judged once the cells are
done, and the report assembled in the JSON's shape."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from proxy.bench.children import git_commit
from proxy.bench.matrix.cells import (
    PATHS,
    TRACE_EXPORT_TIMEOUT,
    Cell,
    MatrixSettings,
    applicability,
)
from proxy.bench.matrix.report import progress_line
from proxy.bench.matrix.systems import Context, serves_websocket, stack_versions, start_system
from proxy.bench.matrix.trials import (
    NOT_SERVED,
    post_status,
    run_local_trial,
    run_trial,
    without_gc_pauses,
)
from proxy.bench.matrix.view import access_outcomes, fd_count, sluice_view
from proxy.bench.peers import ensure_installed, peer_version, spec
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

if TYPE_CHECKING:
    from proxy.testing.otlp_receiver import Receiver


async def run_matrix(settings: MatrixSettings, out: Any = None) -> dict[str, Any]:
    """Run every cell; return the report (the JSON's shape)."""
    out = out if out is not None else sys.stderr
    if settings.peer:
        # Before anything starts (installing takes minutes, once): a system that is missing
        # and cannot be installed is one line, not a half-run matrix.
        await trio.to_thread.run_sync(ensure_installed, settings.peer)
    base = FakeSettings(close_after_response=True)
    fake = FakeUpstream(base)
    cells: list[Cell] = []
    # Configs and logs of the children; removed once they have stopped.
    with (
        tempfile.TemporaryDirectory(prefix="sluice-matrix-") as tmp,
        _receiver(settings, out) as receiver,
    ):
        system, not_served = await _run_cells(settings, fake, cells, Path(tmp), out, receiver)
    return await _report(system, settings, cells, not_served)


@contextlib.contextmanager
def _receiver(settings: MatrixSettings, out: Any) -> Iterator[Receiver | None]:
    """The receiver the Sluice this bench starts exports its spans to; None for another
    system, or where the bench cannot decode OTLP (then no trial is judged by its trace)."""
    if not settings.traced:
        yield None
        return
    try:
        # Imported here: opentelemetry-proto is not among the bench's own dependencies.
        from proxy.testing.otlp_receiver import otlp_receiver
    except ImportError as exc:
        print(f"no trace verdicts: {exc.name} is not installed", file=out)
        yield None
        return
    with otlp_receiver() as receiver:
        yield receiver


async def _run_cells(
    settings: MatrixSettings,
    fake: FakeUpstream,
    cells: list[Cell],
    workdir: Path,
    out: Any,
    receiver: Receiver | None,
) -> tuple[str, dict[str, str]]:
    async with trio.open_nursery() as nursery:
        fake_port = await nursery.start(fake.serve, "127.0.0.1", settings.fake_port)
        fake_url = f"http://127.0.0.1:{fake_port}"
        env = None
        if receiver is not None:
            from proxy.bench.matrix.traces import tracing_env

            env = tracing_env(receiver.url)
        system = await start_system(nursery, settings, fake_url, workdir, out, env)
        ws_served = await serves_websocket(system.address, settings.api_key)
        ctx = Context(
            settings,
            fake,
            system.address,
            ws_served=ws_served,
            pid=system.pid,
            headers=system.headers,
        )
        known = spec(settings.peer).not_served if settings.peer else {}
        for endpoint in settings.endpoints:
            status = await post_status(ctx, endpoint)
            # A system may refuse what it lacks with another status (Portkey's 500 for
            # /v1/messages): its spec's word stands.
            ctx.served[endpoint] = status not in NOT_SERVED and endpoint not in known
            if not ctx.served[endpoint]:
                ctx.not_served[endpoint] = known.get(endpoint) or (
                    f"HTTP {status} to {PATHS[endpoint]}"
                )
        if not ws_served and "ws" in settings.transports:
            ctx.not_served["ws"] = known.get("ws") or "no WebSocket upgrade at /v1/ws"
        # Let the warm-up's access lines and sockets settle before the baselines.
        await trio.sleep(0.2)
        ctx.fd_baseline = fd_count(system.pid) if system.pid is not None else None
        if not settings.outside:
            ctx.log = system.log
            access_outcomes(ctx)  # start after the warm-up's lines
        for phase in settings.phases:
            for transport in settings.transports:
                for endpoint in settings.endpoints:
                    for leave in settings.leaves:
                        cell = Cell(phase, transport, endpoint, leave, settings.repeat)
                        cells.append(cell)
                        await _run_cell(ctx, cell)
                        print(progress_line(cell), file=out)
        if receiver is not None:
            await _judge_traces(ctx, cells, receiver, out)
        nursery.cancel_scope.cancel()
    return system.name, ctx.not_served


async def _run_cell(ctx: Context, cell: Cell) -> None:
    """The cell's trials, or why it has none (not served, not applicable)."""
    settings = ctx.settings
    applicable, why = applicability(
        cell.phase, cell.transport, cell.endpoint, settings.outside, ctx.local
    )
    if not ctx.served[cell.endpoint]:
        cell.served, cell.note = False, f"not served: {ctx.not_served[cell.endpoint]}"
    elif cell.transport == "ws" and not ctx.ws_served:
        cell.served, cell.note = False, f"not served: {ctx.not_served['ws']}"
    elif cell.transport == "ws" and cell.endpoint != "chat":
        cell.served, cell.note = False, "not served: /v1/ws carries chat requests only"
    elif not applicable:
        cell.applicable, cell.note = False, f"not applicable: {why}"
    else:
        trial = run_local_trial if settings.local else run_trial
        for _ in range(settings.repeat):
            cell.trials.append(await without_gc_pauses(trial, ctx, cell))
        await sluice_view(ctx, cell)


async def _judge_traces(ctx: Context, cells: list[Cell], receiver: Receiver, out: Any) -> None:
    """Every trial's trace judged, while Sluice still runs (its last spans are exported by
    the batch processor, not at its exit)."""
    from proxy.bench.matrix.traces import judge_cells

    access_outcomes(ctx)  # the lines written after the last cell was read
    await judge_cells(
        cells, ctx.trace_outcomes, receiver, local=ctx.local, patience=TRACE_EXPORT_TIMEOUT
    )
    judged = [t for c in cells for t in c.trials if t.traced is not None]
    traced = sum(1 for t in judged if t.traced)
    print(f"traces: {traced} of {len(judged)} trials said what happened", file=out)


async def _report(
    system: str, settings: MatrixSettings, cells: list[Cell], not_served: dict[str, str]
) -> dict[str, Any]:
    versions = stack_versions(sluice=not settings.outside)
    extra: dict[str, Any] = {}
    if settings.peer:
        peer = spec(settings.peer)
        version = await trio.to_thread.run_sync(peer_version, peer.name)
        versions = {peer.name: version, **versions}
        # Where its own project tracks a phase it never cancels ("not reported upstream"
        # where none was found).
        extra = {"peer": peer.name, "how": peer.how, "trackers": dict(peer.trackers)}
    return {
        "system": system,
        "kind": settings.kind,
        "command": settings.command,
        "commit": await git_commit(),
        # Sluice's stack when the system is the Sluice this bench started; else the bench's own.
        "versions": versions,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "repeat": settings.repeat,
        "cells": [cell.to_json() for cell in cells],
        # Why each endpoint (or "ws") it does not serve is not served.
        "not_served": not_served,
        **extra,
    }
