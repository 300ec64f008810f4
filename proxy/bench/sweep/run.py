"""The sweep of one scenario on one server path: a counting run, then one run per checkpoint
with the client leaving right after it, each checked against the invariants.

Each run is a fresh request through the same Sluice, so that whatever a run leaves behind (a
slot, a connection: the rig allows one of each) makes the next one fail; after the last, one
more request is read to its end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import trio
import trio.testing

from proxy.bench.sweep.answers import (
    answered,
    ended_in_band,
    split_head,
    tokens_received,
    whole,
)
from proxy.bench.sweep.checkpoints import Step
from proxy.bench.sweep.client import Request, SweepClient
from proxy.bench.sweep.extras import RedisChecks, Unavailable, redis_server, tiny_local_models
from proxy.bench.sweep.rig import Rig, start_rig
from proxy.bench.sweep.scenarios import Scenario
from proxy.ops.logs import ACCESS_LOGGER
from proxy.protocol.token_usage import estimate_input_tokens
from proxy.relay.state import Phase
from proxy.testing.fake_upstream import FakeSettings

# One run's bound: its request, its answer, its access line.
RUN_SECONDS = 10.0
# After the client left, the scheduler batches (trio's rounds: an I/O poll, then every task
# that is ready) within which the request's upstream connection is let go (closed, or idle in
# the pool) and the fake has seen it, and its local sequence has left the batch. The departure
# is read in the first round (the hangup watcher, or the server's read task); under the
# framework the read task's http.disconnect has quart-trio cancel the request in the next; the
# producer shuts the upstream down as it unwinds; the fake reads the close in the round after
# (measured: at most 3 rounds on the fast path, 5 under the framework, cut at the head's read).
# Steps are counted too (every task of Sluice's, other requests' work included) and reported.
RELEASE_BATCHES = 5
# Over httpx the producer's unwinding goes through httpcore's own cancellation handling (its
# connection closed under a shield, the pool's bookkeeping after it): measured, at most 7
# rounds under the framework, cut in httpcore's read or write.
RELEASE_BATCHES_HTTPX = 8
# A WebSocket's close frame: the HTTP server reads it, answers it and ends the stream, and only
# then hands the app its disconnect, through the app's queue: measured,
# up to 9 rounds (from the cut to every relay of the request ended).
RELEASE_BATCHES_CLOSE_FRAME = 12
# A local model's sequence: gone from the batch within the engine's forward pass in flight at
# the cut and one more (the engine reads a cancellation between two steps).
LOCAL_RELEASE_STEPS = 2
# The ``deadline`` ending: every request carries ``X-Sluice-Deadline: DEADLINE_SECONDS``, every
# other timer of the rig is set to LONG_SECONDS, and at the cut the clock (a MockClock that
# runs at the real rate) jumps DEADLINE_JUMP ahead: the request's deadline, and only it, has
# passed at that step.
# Quart's own request-body timer (60 s) stays out of the way: the jump is shorter.
DEADLINE_SECONDS = 30.0
DEADLINE_JUMP = 31.0
LONG_SECONDS = 1_000_000.0
# What a request cut by its deadline ends with: past it while queued, the queue's refusal;
# at work, the 504 (or in-band error) of the deadline.
DEADLINE_OUTCOMES = ("deadline_exceeded", "deadline_unmeetable")
CANCELLED = tuple(f"cancelled({phase})" for phase in Phase)
_ids = count()


@dataclass
class Run:
    """One run: the step it was cut at (None: not cut), what it counted and what it broke."""

    cut_at: int | None
    steps: int = 0
    place: str = ""
    outcome: str = ""
    released_after: int | None = None
    released_batches: int | None = None
    # A local model's: its decode steps between the cut and the sequence's leaving the batch.
    released_engine_steps: int | None = None
    failures: list[str] = field(default_factory=list)
    # Where each of its steps parked (the counting run keeps them for the report).
    places: list[str] = field(default_factory=list)

    @property
    def cut(self) -> bool:
        return bool(self.place)


@dataclass
class Sweep:
    """One scenario on one server path, with one way of leaving."""

    scenario: str
    server: str
    leave: str
    counted: int = 0
    runs: list[Run] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""
    # What its uncut runs end with (the access line's outcome).
    ending: str = ""
    # The counting run's places, step by step.
    places: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Run]:
        return [run for run in self.runs if run.failures]

    @property
    def distinct(self) -> set[str]:
        return {run.place for run in self.runs if run.cut}


def sample(total: int, every: int, edge: int = 3) -> list[int]:
    """The steps a short sweep cuts at: the first and last ``edge`` and every ``every``-th."""
    if every <= 1:
        return list(range(1, total + 1))
    chosen = set(range(1, min(edge, total) + 1)) | set(range(max(1, total - edge + 1), total + 1))
    chosen |= set(range(every, total + 1, every))
    return sorted(chosen)


async def sweep_scenario(
    scenario: Scenario,
    *,
    fast_path: bool,
    leave: str = "close",
    every: int = 1,
    local_models: dict[str, Any] | None = None,
    cuts: Iterable[int] | None = None,
    fail_fast: bool = False,
) -> Sweep:
    """Count, then cut at every step (or the sample ``every`` picks, or ``cuts``); with
    ``fail_fast``, stop at the first run that fails."""
    server = "fast path" if fast_path else "framework"
    result = Sweep(scenario.name, server, leave)
    with contextlib.ExitStack() as needs:
        try:
            redis = needs.enter_context(redis_server()) if scenario.redis else None
            if scenario.local and local_models is None:
                local_models = tiny_local_models()
        except Unavailable as exc:
            result.skipped = str(exc)
            return result
        return await _sweep(
            result, scenario, fast_path, leave, every, local_models, cuts, fail_fast, redis
        )


async def _sweep(
    result: Sweep,
    scenario: Scenario,
    fast_path: bool,
    leave: str,
    every: int,
    local_models: dict[str, Any] | None,
    cuts: Iterable[int] | None,
    fail_fast: bool,
    redis: Any,
) -> Sweep:
    began = time.perf_counter()
    config = scenario.configured()
    if redis is not None:
        config["limits"] = {"backend": "redis", "url": redis.url, **config.get("limits", {})}
    config["server"] = {**config.get("server", {}), "fast_path": fast_path}
    if leave == "deadline":
        config = with_long_timers(config)
        if not isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
            raise RuntimeError("the deadline ending jumps the clock: run under a MockClock")
    async with trio.open_nursery() as nursery:
        rig = await start_rig(
            nursery, config, fake=FakeSettings(**scenario.fake), local_models=local_models
        )
        if redis is not None:
            # Held in this nursery, from before the baseline to the end of the sweep.
            rig.redis = RedisChecks(redis.url)
            await nursery.start(rig.redis.run)
        access = logging.getLogger(ACCESS_LOGGER)
        saved = access.level, access.propagate
        access.addHandler(rig.lines)
        access.setLevel(logging.INFO)
        access.propagate = False
        rig.counter.install()
        try:
            warm = await one_run(rig, scenario, None, "close", nursery, check=False)
            # What an uncut run ends with: the scenario's, or (a failing upstream's error
            # code) what the warm-up's ended with, which must then not be a cancellation.
            ending = result.ending = scenario.ending or warm.outcome
            if ending.startswith("cancelled") or not ending:
                warm.failures.append(f"the warm-up ended {ending or 'with no access line'}")
            if warm.failures:
                result.runs.append(warm)
                return result
            await rig.quiet()
            await rig.take_baseline()
            counting = await one_run(rig, scenario, None, leave, nursery, ending=ending)
            result.counted = counting.steps
            result.places = counting.places
            result.runs.append(counting)
            for k in sample(counting.steps, every) if cuts is None else cuts:
                result.runs.append(await one_run(rig, scenario, k, leave, nursery, ending=ending))
                if fail_fast and result.runs[-1].failures:
                    return result
            result.runs.append(await one_run(rig, scenario, None, leave, nursery, ending=ending))
        finally:
            rig.counter.uninstall()
            access.removeHandler(rig.lines)
            access.setLevel(saved[0])
            access.propagate = saved[1]
            result.seconds = time.perf_counter() - began
            nursery.cancel_scope.cancel()
    return result


def with_long_timers(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with every timer a jump of the clock could fire set past it, so that the
    request's deadline is the only one that passes."""
    upstream = {
        name: LONG_SECONDS
        for name in (
            "connect_timeout",
            "first_token_timeout",
            "idle_timeout",
            "total_timeout",
            "queue_timeout",
            "keepalive_expiry",
            "health_check_interval",
            "models_refresh_interval",
        )
    }
    return {
        **config,
        "server": {**config.get("server", {}), "keep_alive_timeout": LONG_SECONDS},
        "relay": {**config.get("relay", {}), "stall_timeout": LONG_SECONDS},
        "upstream": {**config.get("upstream", {}), **upstream},
    }


def jump_past_the_deadline() -> None:
    """The ``deadline`` ending's cut: synchronous, inside the run loop, like a departure."""
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    clock.jump(DEADLINE_JUMP)


async def one_run(
    rig: Rig,
    scenario: Scenario,
    cut_at: int | None,
    leave: str,
    nursery: trio.Nursery,
    *,
    check: bool = True,
    ending: str = "completed",
) -> Run:
    run = Run(cut_at)
    request_id = f"sweep-{next(_ids)}"
    deadline = leave == "deadline"
    client = SweepClient("close" if deadline else leave)
    records = len(rig.fake.recorder.records)

    bound = trio.CancelScope()

    steps_at_cut: list[int] = []

    def cut(step: Step) -> None:
        steps_at_cut.append(rig.engine_steps())
        if deadline:
            jump_past_the_deadline()
            # The run's own bound is on the same clock: it keeps its length.
            bound.deadline += DEADLINE_JUMP
        else:
            client.leave()

    request = scenario.request(request_id, deadline=DEADLINE_SECONDS if deadline else None)
    charged = budget_used(rig)
    served = fair_share_served(rig)
    first_line = len(rig.lines.lines)
    received = b""
    after = None
    if scenario.around is not None:
        after = await scenario.around(rig, nursery)
    # A WebSocket's message gets an id of Sluice's own: every request at the fake is its.
    mine = None if scenario.endpoint == "ws" else request_id
    released, steps_at_release = rig.release_check(
        mine, others=scenario.around is not None, relays=leave == "close-frame"
    )
    armed = rig.counter.arm(cut_at, cut, released)
    try:
        bound.deadline = trio.current_time() + RUN_SECONDS
        with bound as scope:
            await client.send(*rig.address, request)
            await client.read_until(whole)
            await rig.state.tracker.wait_idle()
            if after is not None:
                await after()
        # Done (or gone): the connection goes too, as an SDK's would once it has its answer.
        received = bytes(client.received)
        client.close()
        if scope.cancelled_caught:
            run.failures.append(f"not done within {RUN_SECONDS}s")
        problems = await rig.settled() if check else []
    finally:
        client.close()
        rig.counter.disarm()
    run.steps = armed.count
    run.places = [step.place for step in armed.steps]
    if armed.cut is not None:
        run.place = armed.cut.place
        run.released_after = armed.released_at
        run.released_batches = armed.released_batches
        at_release = steps_at_release()
        if at_release is not None and steps_at_cut:
            run.released_engine_steps = at_release - steps_at_cut[0]
    run.failures.extend(problems)
    # A WebSocket's messages get ids of Sluice's own: its lines are those of the run.
    lines = rig.lines.lines[first_line:] if scenario.endpoint == "ws" else rig.lines.of(request_id)
    if not check:
        run.outcome = lines[0]["outcome"] if lines else ""
        return run
    if deadline:
        run.failures.extend(check_deadline(scenario, ending, run, lines, received))
    else:
        run.failures.extend(check_line(scenario, ending, run, lines, client, received))
    if lines:
        run.failures.extend(check_tokens(scenario, ending, lines[0], client, received))
        run.failures.extend(check_budget(rig, lines[0], charged))
        if scenario.around is None and scenario.stream and not scenario.hedged:
            # (Beside another request, the counters hold its service too. A whole answer cut
            # before it came is charged at its reservation, an estimate; a hedge's losing
            # attempt is service received too: neither is the line's count of made.)
            attempts = [
                r
                for r in rig.fake.recorder.records[records:]
                if scenario.endpoint == "ws" or r.headers.get("x-request-id") == request_id
            ]
            run.failures.extend(
                check_fair_share(rig, request, lines[0], served, max(1, len(attempts)))
            )
    batches = RELEASE_BATCHES_HTTPX if scenario.transport == "httpx" else RELEASE_BATCHES
    if leave == "close-frame":
        batches = RELEASE_BATCHES_CLOSE_FRAME
    run.failures.extend(check_upstream(rig, run, records, batches))
    if armed.cut is None and not answered(scenario.endpoint, scenario.stream, received):
        run.failures.append("not cut, and the answer did not come whole")
    return run


def check_line(
    scenario: Scenario,
    ending: str,
    run: Run,
    lines: list[dict[str, Any]],
    client: SweepClient,
    got: bytes,
) -> list[str]:
    """The access line: one, whose outcome is the scenario's ending or names the phase it was
    cancelled in, and says what the client saw."""
    if len(lines) > 1:
        return [f"{len(lines)} access lines for one request"]
    if not lines:
        # A client that left before its request was read has no line, and nothing else; nor
        # has a WebSocket whose client left before it sent its message (its handshake is no
        # request of its own).
        unsent = scenario.endpoint == "ws" and not client.message_sent
        return [] if client.left and (not got or unsent) else ["no access line"]
    outcome = run.outcome = lines[0]["outcome"]
    if outcome != ending and outcome not in CANCELLED:
        return [f"outcome {outcome!r}: neither {ending} nor a phase it was cancelled in"]
    if outcome != ending and not client.left:
        return [f"{outcome} for a client that never left"]
    got_all = answered(scenario.endpoint, scenario.stream, got)
    if client.reads_on and client.left and got_all != (outcome == ending):
        # The client read on to the end: whatever Sluice sent, it has.
        return [f"{outcome}, and the client got {'all' if got_all else 'part'} of it"]
    return []


def check_deadline(
    scenario: Scenario, ending: str, run: Run, lines: list[dict[str, Any]], got: bytes
) -> list[str]:
    """A request whose deadline passed at the cut: one access line, the scenario's ending (it
    passed once the answer was made) or the deadline's error; and the client, which stayed,
    told either way: the whole answer, or the error as its status or in-band."""
    if len(lines) != 1:
        return [f"{len(lines)} access lines for one request"]
    outcome = run.outcome = lines[0]["outcome"]
    if outcome != ending and outcome not in DEADLINE_OUTCOMES:
        return [f"outcome {outcome!r}: neither {ending} nor the deadline's error"]
    if not answered(scenario.endpoint, scenario.stream, got):
        return [f"{outcome}, and the client was not told: its answer did not come whole"]
    told = split_head(got)[0] != 200 or ended_in_band(got)
    if outcome in DEADLINE_OUTCOMES and not told:
        return [f"{outcome}, yet the client got a whole answer and no error"]
    return []


def check_tokens(
    scenario: Scenario, ending: str, line: dict[str, Any], client: SweepClient, got: bytes
) -> list[str]:
    """Tokens sent + tokens for nobody = tokens made (the made: Sluice's own count, the
    access line's output). A client that closed its socket lost what came after its close:
    the sent are then at least what it received."""
    made = line.get("output_tokens")
    nobody = line.get("for_nobody_tokens")
    if made is None or nobody is None:
        return []
    sent = tokens_received(scenario.endpoint, scenario.stream, got)
    if line["outcome"] == ending:
        # A completed answer went whole to its client; a refusal (a guard's) may have kept
        # tokens from it, which are then for nobody.
        if nobody and ending == "completed":
            return [f"{ending}, yet {nobody} token(s) for nobody"]
        if client.reads_on or not client.left:
            if sent + nobody != made:
                return [f"{ending}: {sent} token(s) sent + {nobody} for nobody != {made} made"]
            return []
        if sent + nobody > made:
            return [f"{ending}: {sent} token(s) received + {nobody} for nobody > {made} made"]
        return []
    if line["outcome"] in DEADLINE_OUTCOMES and not made:
        # Cut by its deadline before a first token: what went to nobody is the prompt the
        # upstream read (none, if it was cut before the upstream had it).
        if nobody not in (0, line.get("input_tokens") or 0):
            return [f"{line['outcome']} before a token: {nobody} for nobody, not the prompt"]
        return [] if sent == 0 else [f"{line['outcome']}, yet {sent} token(s) arrived"]
    if not scenario.stream:
        if sent:
            return [f"{line['outcome']}, yet a whole answer arrived"]
        # Whether it came from the upstream or not (its charged reservation), none of it went
        # to a client.
        return [] if nobody == made else [f"a whole answer cut: {nobody} for nobody of {made}"]
    if client.reads_on or not client.left:
        # It read on to the end (a FIN, or a deadline that cut a client that stayed).
        if sent + nobody != made:
            return [f"sent {sent} + for nobody {nobody} != made {made}"]
    elif sent + nobody > made:
        return [f"received {sent} + for nobody {nobody} > made {made}"]
    return []


def budget_used(rig: Rig) -> int:
    """The budgeted key's tokens charged in its minute's window now."""
    states = getattr(rig.state.keys, "_states", {})
    state = states.get("budgeted")
    if state is None or state.budget is None or state.budget.minute is None:
        return 0
    return int(state.budget.minute.used)


def check_budget(rig: Rig, line: dict[str, Any], before: int) -> list[str]:
    """The budget was charged what the request used (input + output), no more, no less."""
    if line.get("key") != "budgeted":
        return []
    used = budget_used(rig) - before
    charge = (line.get("input_tokens") or 0) + (line.get("output_tokens") or 0)
    return [] if used == charge else [f"budget charged {used}, the line says {charge}"]


def fair_share_served(rig: Rig) -> float:
    """The service the fair scheduler's counters hold, every tenant of every model."""
    dispatchers = {
        id(admission.dispatcher): admission.dispatcher
        for backend in rig.state.backends.values()
        if (admission := getattr(backend, "admission", None)) is not None
    }
    return sum(sum(d.queue.served.values()) for d in dispatchers.values())


def check_fair_share(
    rig: Rig, request: Request, line: dict[str, Any], before: float, attempts: int
) -> list[str]:
    """The fair-share counter charged what the request used: its input (the scheduler's
    estimate) at each dispatch (a retry is dispatched again: ``attempts``, those the upstream
    got), and every output token made, weighted; nothing if it never left the queue."""
    settings = rig.state.config.scheduling
    charged = fair_share_served(rig) - before
    outcome = line["outcome"]
    made = line.get("output_tokens") or 0
    one = settings.w_in * estimate_input_tokens(request.body)
    used = one * attempts + settings.w_out * made
    if outcome in ("cancelled(queued)", "deadline_unmeetable"):
        allowed = {0.0}  # never dispatched
    elif not made:
        # Cut (or refused) before a token: dispatched, its input charged (once an attempt,
        # the last of which may not have reached the upstream yet), or not yet.
        allowed = {0.0, *(one * n for n in range(1, attempts + 2))}
    else:
        allowed = {used}
    if not any(abs(charged - value) < 1e-6 for value in allowed):
        expected = " or ".join(f"{value:g}" for value in sorted(allowed))
        return [f"fair share charged {charged:g}, the request used {expected} ({outcome})"]
    return []


def check_upstream(rig: Rig, run: Run, records: int, bound: int = RELEASE_BATCHES) -> list[str]:
    """Every request the fake got in this run ended (none pending), and once the client left
    (or the deadline passed), the upstream was let go within ``bound`` scheduler batches."""
    found = []
    for record in rig.fake.recorder.records[records:]:
        if record.outcome == "pending":
            found.append(f"the fake's request {record.id} is still pending")
    if run.cut and run.released_engine_steps is not None:
        # A local sequence leaves the batch at a decode step's end: the step in flight at the
        # cut, and at most one more (the contract: within one decode step).
        if run.released_engine_steps > LOCAL_RELEASE_STEPS:
            found.append(
                f"the local sequence left the batch {run.released_engine_steps} engine "
                "steps after the cut"
            )
        return found
    if run.cut and (run.released_batches is None or run.released_batches > bound):
        found.append(
            f"upstream still in use {run.released_batches} scheduler batches "
            f"({run.released_after} steps) after the cut"
        )
    return found
