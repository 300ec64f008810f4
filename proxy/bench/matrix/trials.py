"""A trial: one client leaving one cell's way, once. The fake is steered for the cell's phase
through its server-wide settings, the client leaves once the trigger is reached, and what the
fake recorded (or, for a local model, Sluice's own counters) says whether the proxy let the
request go, how fast, and what it still made for nobody; then a probe asks whether the system
still serves."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal

import httpx
import trio

from proxy.bench.matrix.cells import (
    INTERVAL,
    LOCAL_SLOTS,
    LONG,
    MID_TOKENS,
    OBSERVE_TIMEOUT,
    PATHS,
    SETTLE,
    TRIAL_SETTLE_TIMEOUT,
    TRIGGER_TIMEOUT,
    Cell,
    Trial,
)
from proxy.bench.matrix.client import PROBE, Client
from proxy.bench.matrix.systems import Context
from proxy.bench.matrix.view import local_counters_when, read_local_counters, settled
from proxy.bench.settings import BenchError
from proxy.relay.state import Phase
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream, RequestRecord


def fake_settings(base: FakeSettings, phase: Phase | Literal["probe"]) -> FakeSettings:
    """The fake's behaviour for a trial in ``phase``."""
    quick = {"ttft": 0.0, "interval": 0.0, "tokens": 3, "mode": "ok", "accept_delay": 0.0}
    plans: dict[str, dict[str, Any]] = {
        Phase.QUEUED: {"ttft": 0.0, "interval": INTERVAL, "tokens": 100_000},
        Phase.CONNECTING: {"accept_delay": LONG},
        Phase.HEAD: {"mode": "stall_headers"},
        Phase.FIRST_TOKEN: {"ttft": LONG},
        Phase.MID_STREAM: {"ttft": 0.0, "interval": INTERVAL, "tokens": 100_000},
        Phase.AFTER_LAST: {},
        PROBE: {},
    }
    return dataclasses.replace(base, **{**quick, **plans[phase]})


def _new_records(fake: FakeUpstream, since: int) -> list[RequestRecord]:
    return [r for r in fake.recorder.records[since:] if r.method == "POST"]


async def _wait(fake: FakeUpstream, predicate: Callable[[], object], seconds: float) -> bool:
    with trio.move_on_after(seconds):
        await fake.recorder.wait_for(lambda _: predicate())
        return True
    return False


def _tokens_for_nobody(record: RequestRecord, sent_at_leave: dict[int, int]) -> int:
    """Tokens the fake sent after the client left (one in flight in the proxy may count)."""
    return max(0, record.tokens_sent - sent_at_leave.get(record.id, 0))


async def post_status(ctx: Context, endpoint: str) -> int | None:
    """The status of a plain streamed request to the proxy now (None: no answer)."""
    ctx.fake.settings = fake_settings(ctx.fake.settings, PROBE)
    url = f"http://{ctx.address[0]}:{ctx.address[1]}{PATHS[endpoint]}"
    body = ctx.body(endpoint, PROBE, stream=True)
    headers = {"Authorization": f"Bearer {ctx.settings.api_key}", **dict(ctx.headers)}
    with trio.move_on_after(TRIGGER_TIMEOUT):
        try:
            async with httpx.AsyncClient(timeout=TRIGGER_TIMEOUT, trust_env=False) as client:
                response = await client.post(url, json=body, headers=headers)
                return response.status_code if response.content else None
        except httpx.HTTPError:
            return None
    return None


async def probe(ctx: Context, endpoint: str) -> bool:
    """Whether the proxy serves a plain request now."""
    return await post_status(ctx, endpoint) == 200


# Statuses that mean the proxy has no such endpoint: its cells read "not served".
NOT_SERVED: Final = frozenset({404, 405, 501})


async def run_trial(ctx: Context, cell: Cell) -> Trial:
    fake = ctx.fake
    fake.settings = fake_settings(fake.settings, cell.phase)
    since = len(fake.recorder.records)
    held_before = len(fake.recorder.closed_while_held)
    trial = Trial(cancelled=False)
    async with trio.open_nursery() as nursery:
        holder: Client | None = None
        if cell.phase == Phase.QUEUED:
            holder = ctx.client(cell.endpoint, "sse", Phase.QUEUED)
            await holder.start(nursery, "fin")
            if not await _wait(fake, lambda: _new_records(fake, since), TRIGGER_TIMEOUT):
                raise BenchError("the queued cell's holder never reached the fake")
            since = len(fake.recorder.records)
        client = ctx.client(cell.endpoint, cell.transport, cell.phase)
        trial.trace_id = client.trace_id
        await client.start(nursery, cell.leave)

        def records() -> list[RequestRecord]:
            return _new_records(fake, since)

        triggers: dict[Phase, Callable[[], object]] = {
            Phase.CONNECTING: lambda: fake.recorder.held_connections > 0,
            Phase.HEAD: records,
            Phase.FIRST_TOKEN: records,
            Phase.MID_STREAM: lambda: (
                any(r.tokens_sent >= MID_TOKENS for r in records()) and client.received
            ),
        }
        reached = True
        if cell.phase == Phase.QUEUED:
            await trio.sleep(SETTLE * 5)
        elif cell.phase == Phase.AFTER_LAST:
            # The client's own event: the recorder's changes do not wake a wait on it.
            with trio.move_on_after(TRIGGER_TIMEOUT) as waited:
                await client.done.wait()
            reached = not waited.cancelled_caught
        else:
            reached = await _wait(fake, triggers[cell.phase], TRIGGER_TIMEOUT)
        if not reached:
            cell.note = cell.note or f"trigger not reached ({client.failed or 'no answer'})"
        elif cell.phase in (Phase.HEAD, Phase.FIRST_TOKEN):
            await trio.sleep(SETTLE)
        left = await client.leave(cell.leave)
        # The fake runs in this process: what it had sent when the client left, exactly.
        sent_at_leave = {r.id: r.tokens_sent for r in records()}
        if cell.phase == Phase.QUEUED:
            await trio.sleep(SETTLE * 5)
            assert holder is not None
            await holder.leave("fin")
            await trio.sleep(SETTLE * 5)
            trial.cancelled = not records()
        elif cell.phase == Phase.CONNECTING:
            seen = lambda: len(fake.recorder.closed_while_held) > held_before  # noqa: E731
            if await _wait(fake, seen, OBSERVE_TIMEOUT):
                trial.cancelled = True
                trial.latency = fake.recorder.closed_while_held[held_before] - left
        elif cell.phase == Phase.AFTER_LAST:
            await trio.sleep(SETTLE)
            trial.cancelled = any(r.outcome == "completed" for r in records())
        else:
            ended = lambda: any(r.outcome != "pending" for r in records())  # noqa: E731
            await _wait(fake, ended, OBSERVE_TIMEOUT)
            for record in records():
                if record.outcome == "client_disconnected":
                    trial.cancelled = True
                    assert record.disconnected_at_mono is not None
                    trial.latency = record.disconnected_at_mono - left
                    trial.tokens_for_nobody = _tokens_for_nobody(record, sent_at_leave)
                elif record.outcome == "pending":
                    trial.tokens_for_nobody = _tokens_for_nobody(record, sent_at_leave)
        await client.close()
        if holder is not None:
            await holder.close()
        nursery.cancel_scope.cancel()
    # The fake closes every connection that was still held or pending (a proxy that never
    # cancels keeps its upstream request, the fake's work for nobody, until the probe's steer).
    trial.next_served = await probe(ctx, cell.endpoint)
    trial.settled = await settled(ctx, TRIAL_SETTLE_TIMEOUT)
    return trial


async def run_local_trial(ctx: Context, cell: Cell) -> Trial:
    """One trial against Sluice serving a local model: the cell is the engine thread letting
    the sequence go, read from Sluice's own counters (trials run one at a time, so a counter's
    change over a trial is that trial's)."""
    trial = Trial(cancelled=False)
    async with trio.open_nursery() as nursery:
        holders: list[Client] = []
        if cell.phase == Phase.QUEUED:
            for _ in range(LOCAL_SLOTS):
                holder = ctx.client("chat", "sse", Phase.QUEUED)
                await holder.start(nursery, "fin")
                holders.append(holder)
            generating = lambda: all(h.events > MID_TOKENS for h in holders)  # noqa: E731
            if not await _until(generating, TRIGGER_TIMEOUT):
                raise BenchError("the queued cell's holders never started generating")
        before = await read_local_counters(ctx)
        client = ctx.client("chat", cell.transport, cell.phase)
        trial.trace_id = client.trace_id
        await client.start(nursery, cell.leave)
        reached = True
        if cell.phase == Phase.QUEUED:
            await trio.sleep(SETTLE * 5)
        elif cell.phase == Phase.AFTER_LAST:
            reached = await _until(client.done.is_set, TRIGGER_TIMEOUT)
        elif cell.phase == Phase.FIRST_TOKEN:
            reached = await _until(client.head.is_set, TRIGGER_TIMEOUT)
            await trio.sleep(SETTLE)
        elif cell.phase == Phase.HEAD:
            # Non-streamed: the answer is being generated while the client waits for its head.
            under_way = _grew("generated", before, by=MID_TOKENS)
            reached = under_way(await local_counters_when(ctx, under_way, TRIGGER_TIMEOUT))
        else:
            reached = await _until(lambda: client.events > MID_TOKENS, TRIGGER_TIMEOUT)
        if not reached:
            cell.note = cell.note or f"trigger not reached ({client.failed or 'no answer'})"
        await client.leave(cell.leave)
        if cell.phase == Phase.QUEUED:
            await trio.sleep(SETTLE * 5)
            for holder in holders:
                await holder.leave("fin")
            gone = _grew("queue_cancelled", before)
            after = await local_counters_when(ctx, gone, OBSERVE_TIMEOUT)
            # It left the queue as cancelled, and no prompt was prefilled after the trial began.
            trial.cancelled = gone(after) and after.get("prefills") == before.get("prefills")
        elif cell.phase == Phase.AFTER_LAST:
            trial.cancelled = client.done.is_set()
        else:
            seen = _grew("cancels", before)
            after = await local_counters_when(ctx, seen, OBSERVE_TIMEOUT)
            if seen(after):
                trial.cancelled = True
                trial.steps_after_leave = round(
                    after.get("steps_after_cancel", 0) - before.get("steps_after_cancel", 0)
                )
                trial.tokens_for_nobody = round(
                    after.get("tokens_for_nobody", 0) - before.get("tokens_for_nobody", 0)
                )
        await client.close()
        for holder in holders:
            await holder.close()
        nursery.cancel_scope.cancel()
    trial.next_served = await probe(ctx, "chat")
    trial.settled = await settled(ctx, TRIAL_SETTLE_TIMEOUT)
    return trial


async def without_gc_pauses(
    trial: Callable[[Context, Cell], Awaitable[Trial]], ctx: Context, cell: Cell
) -> Trial:
    """One trial with this process's garbage collector held off: the fake's clock runs in
    this process, and a collection between a client's close and the fake's record of the
    proxy's close (tens of milliseconds with the fake's records) would be counted against the
    proxy. The collection runs between trials instead."""
    gc.collect()
    gc.disable()
    try:
        return await trial(ctx, cell)
    finally:
        gc.enable()


def _grew(
    key: str, before: dict[str, float], by: float = 0.0
) -> Callable[[dict[str, float]], bool]:
    """Whether counters read later show ``key`` more than ``by`` over ``before``."""

    def grew(counters: dict[str, float]) -> bool:
        return counters.get(key, 0.0) - before.get(key, 0.0) > by

    return grew


async def _until(predicate: Callable[[], object], seconds: float) -> bool:
    """Poll a predicate over the clients' own state (their counters wake no one)."""
    with trio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)
        return True
    return False
