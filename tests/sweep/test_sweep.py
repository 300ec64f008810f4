"""The cancellation sweep (proxy/bench/sweep/), its ``make test`` part: a few scenarios cut at
every checkpoint on both server paths, and a planted leak that the sweep must catch and name.

The whole sweep (every scenario, both ways of leaving) is ``make sweep``, which writes
docs/cancellation-sweep.md; it takes about a minute and a half on 2 cores. Here: the scenarios
whose every run must pass, a second or so each, and the sweep's own parts without sockets.
"""

from __future__ import annotations

import inspect
import shutil
from typing import Any

import pytest
import trio
import trio.testing

from proxy.backends.upstream.pool import PlainTransport
from proxy.bench.sweep import SCENARIOS, sample, sweep_scenario
from proxy.bench.sweep.answers import answered, tokens_received
from proxy.bench.sweep.extras import LOCAL_STEP_SECONDS
from proxy.bench.sweep.report import heat_strip, markdown
from proxy.bench.sweep.run import DEADLINE_JUMP, Run, Sweep
from tests.support import slowed

SERVER_PATHS = [pytest.param(True, id="fast_path"), pytest.param(False, id="hypercorn")]
# Every checkpoint of the chat's two, every third (and the first and last three) of the
# others, on both paths.
CLEAN = {
    "chat-stream": 1,
    "chat-whole": 1,
    "budgeted": 3,
    "messages-stream": 3,
    "retried-answered": 3,
    "chat-stream@httpx": 3,
}
DEADLINE = 60


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("name", CLEAN)
async def test_every_checkpoint_leaves_nothing_behind(name: str, fast_path: bool) -> None:
    with trio.fail_after(DEADLINE):
        sweep = await sweep_scenario(
            SCENARIOS[name], fast_path=fast_path, leave="close", every=CLEAN[name]
        )
    assert sweep.counted >= 8, sweep.counted  # a request has many checkpoints, not a few
    cut = [run for run in sweep.runs if run.cut]
    # A run may take a step or two fewer than the counting run did: those are not cut.
    assert len(cut) >= len(sample(sweep.counted, CLEAN[name])) - 2
    assert not sweep.failures, [(r.cut_at, r.place, r.failures) for r in sweep.failures]
    # Cut early the client's request was never answered; cut late, it had it all.
    outcomes = {run.outcome for run in cut}
    assert any(outcome.startswith("cancelled(") for outcome in outcomes), outcomes
    assert len(sweep.distinct) >= 3


# The scenarios that need more than the fake: the tiny local model, an urgent request that
# pauses the swept stream, a redis-server counting the key's limits.
NEEDING = {"local-stream": 2, "preempted": 2, "redis-limited": 3}


@pytest.mark.parametrize("leave", ["close", "close-frame"])
async def test_a_websocket_left_at_every_checkpoint_leaves_nothing_behind(leave: str) -> None:
    """A WebSocket's client drops its TCP connection, or sends a close frame, at each step."""
    with trio.fail_after(DEADLINE):
        sweep = await sweep_scenario(SCENARIOS["websocket"], fast_path=True, leave=leave, every=2)
    assert not sweep.failures, [(r.cut_at, r.place, r.failures) for r in sweep.failures]
    outcomes = {run.outcome for run in sweep.runs if run.cut}
    # Before its message, no request; then cut on its way (where exactly depends on when the
    # server reads a close frame: later, under load), and mid-stream.
    assert {"", "cancelled(mid_stream)"} <= outcomes, outcomes
    assert len({o for o in outcomes if o.startswith("cancelled(")}) >= 2, outcomes


# Runs alone (timing): the local sequence must leave the batch within 2 engine steps of 2 ms
# of the cut (the sweep's check), a bound in real time that a loaded loop can miss; and the
# runs wait for redis-server's answers and for the rig to settle by the wall clock (2 s each).
@pytest.mark.timing
@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("name", NEEDING)
async def test_every_checkpoint_of_the_local_model_a_pause_and_redis_leaves_nothing_behind(
    name: str, fast_path: bool, tiny_loaded_model: Any
) -> None:
    if SCENARIOS[name].redis and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`make redis` installs Debian's package)")
    local = {"tiny": slowed(tiny_loaded_model, LOCAL_STEP_SECONDS)}
    with trio.fail_after(DEADLINE):
        sweep = await sweep_scenario(
            SCENARIOS[name],
            fast_path=fast_path,
            leave="close",
            every=NEEDING[name],
            local_models=local if SCENARIOS[name].local else None,
        )
    assert not sweep.skipped, sweep.skipped
    assert not sweep.failures, [(r.cut_at, r.place, r.failures) for r in sweep.failures]
    outcomes = {run.outcome for run in sweep.runs if run.cut}
    assert any(outcome.startswith("cancelled(") for outcome in outcomes), outcomes
    if name == "preempted" and fast_path:
        # It left while paused, somewhere (a dozen steps of the fast path's 45 are paused; the
        # framework's own steps make the paused ones a few of 70, which a sample may miss).
        assert "cancelled(paused)" in outcomes, outcomes
    if SCENARIOS[name].local:
        engine = [r.released_engine_steps for r in sweep.runs if r.cut]
        assert any(steps is not None for steps in engine), engine


@pytest.mark.parametrize("name", ["chat-stream", "guard-output", "guard-prompt-refuses"])
async def test_a_client_that_reads_on_after_its_fin_gets_what_was_counted_sent(name: str) -> None:
    """``fin``: the client shuts its side and reads on, so sent + for nobody = made exactly;
    with guards too, whose held tokens (and a refusal's) are for nobody."""
    with trio.fail_after(DEADLINE):
        sweep = await sweep_scenario(SCENARIOS[name], fast_path=True, leave="fin")
    assert not sweep.failures, [(r.cut_at, r.place, r.failures) for r in sweep.failures]


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
async def test_a_deadline_that_passes_at_every_checkpoint_tells_the_client(
    fast_path: bool, mock_clock: trio.testing.MockClock
) -> None:
    """The request's own deadline passes at each step (the clock jumps past it there): the
    client, which stays, gets the answer or the deadline's error, and nothing is left."""
    mock_clock.rate = 1.0  # real time, but a clock that can jump
    with trio.fail_after(DEADLINE + 100 * DEADLINE_JUMP):
        sweep = await sweep_scenario(
            SCENARIOS["chat-stream"], fast_path=fast_path, leave="deadline"
        )
    assert not sweep.failures, [(r.cut_at, r.place, r.failures) for r in sweep.failures]
    outcomes = {run.outcome for run in sweep.runs if run.cut}
    # Past it at work, past it while queued, and past it once the answer was whole.
    assert {"deadline_exceeded", "deadline_unmeetable", "completed"} <= outcomes, outcomes


# -- the planted leak -----------------------------------------------------------------------

_read = PlainTransport.read


async def _leaky_read(self: PlainTransport) -> bytes:
    """The upstream read, with a bug: cancelled there, it leaves a task behind, outside the
    request's nursery (a system task: nothing of the request or the server will end it)."""
    try:
        return await _read(self)
    except trio.Cancelled:
        trio.lowlevel.spawn_system_task(trio.sleep_forever, name="planted leak")
        raise


LEAK_LINE = inspect.getsourcelines(_leaky_read)[1] + 6


async def test_a_planted_leak_is_caught_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PlainTransport, "read", _leaky_read)
    with trio.fail_after(DEADLINE):
        sweep = await sweep_scenario(
            SCENARIOS["chat-stream"], fast_path=True, leave="close", fail_fast=True
        )
    assert sweep.failures, "the leak went unseen"
    cut = [run for run in sweep.runs if run.cut]
    first = cut[-1]  # it stopped there
    assert first.failures and all(not run.failures for run in cut[:-1])
    # The run that failed names the task left behind and the line that spawned it. Its client
    # left before or while the request waited in that read (a cut at the connect leaves the
    # request to be cancelled at the read that follows).
    named = f"planted leak spawned at tests/sweep/test_sweep.py:{LEAK_LINE} _leaky_read"
    assert any(named in failure for failure in first.failures), first.failures
    assert first.place.startswith("proxy/backends/upstream/pool.py:"), first.place
    # The leaked tasks end with the test's run (trio cancels system tasks when main returns).


# -- the parts, without sockets -------------------------------------------------------------


def test_the_short_sample_keeps_both_ends() -> None:
    assert sample(5, 1) == [1, 2, 3, 4, 5]
    assert sample(20, 5) == [1, 2, 3, 5, 10, 15, 18, 19, 20]


def test_tokens_are_counted_from_what_the_client_got() -> None:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    event = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    body = role + event * 2 + b"data: [DONE]\n\n"
    framed = head + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    assert tokens_received("chat", True, framed) == 2
    assert answered("chat", True, framed)
    cut = framed[: len(head) + 40]
    assert tokens_received("chat", True, cut) == 0
    assert not answered("chat", True, cut)


def test_the_report_marks_each_checkpoint() -> None:
    runs = [
        Run(1, place="a.py:1 f", outcome=""),
        Run(2, place="a.py:2 f", outcome="cancelled(queued)"),
        Run(3, place="a.py:3 f", outcome="cancelled(mid_stream)"),
        Run(4, place="a.py:3 f", outcome="completed", failures=["tasks left: x"]),
        Run(5, place="a.py:4 f", outcome="completed"),
    ]
    assert heat_strip(runs) == ".QMX="
    wide = heat_strip(runs * 40, width=10)
    assert len(wide) == 10 and "X" in wide  # a bucket holding a failure shows it
    sweep = Sweep("chat-stream", "fast path", "close", counted=5, runs=runs)
    text: Any = markdown([sweep], heading="Sweep", preamble="")
    assert "| chat-stream | fast path | close | 5 | 5 | 4 | 1 | 0 (0) |" in text
    assert "tasks left: x" in text
