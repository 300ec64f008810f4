"""The lifetime matrix's guard cells: the lifetime contract holds with guards on every stage.

The same harness as tests/contracts/test_lifetime_matrix.py (its Rig, start_rig, drivers,
bounds and leave_and_check, imported, not copied), with the proxy it starts serving
``[[guards]]``: the rig's ``start_proxy`` is wrapped for the test so that every request of
every model meets a guard of each stage.

* **pass**: every phase x stage x backend (both upstream transports and the local model), SSE
  and JSON (a whole answer, held to its end; two fast cells, the rest ``slow``): the client
  leaves in its phase, and the guards' tasks go with the request: no task, socket, descriptor
  or body left, the upstream closed within the bound, the next request works.
  Stages are on together in each cell (request, prompt, output and after guards, each of its
  own ``stage``), and the cells are parametrized by which of the in-nursery stages holds the
  answer (``prompt`` alone, ``output`` alone).
* **refuse**: a prompt and an output guard that refuse (stage x backend): the refusal ends the
  request, the upstream is closed, and nothing is left behind either.
* **refuse in each phase** (:func:`refuse_in_phase`, a guard of this module): a verdict of each
  stage in every phase where one can come, on both transports and every backend: a request
  guard before the queue; a prompt guard while the upstream connects, while its head or first
  token is awaited, while the answer is held mid-stream, and after its last token (the test
  opens the guard's gate once the request is there); an output guard at the first window, a
  later one, and the last (a whole JSON answer is one window, checked at its end). The client
  gets the refusal, the upstream is let go, nothing is left behind, the next request works.
  The fast subset is five cells; the rest is ``slow``.
* **refuse while paused** (:func:`_paused_trial`): the trial, a stream of a less urgent band,
  is paused for an urgent one while its prompt guard decides, or while its output guard checks
  a later window (the client has text, and its keep-alive ``: paused`` passes the held
  window); the verdict comes while it waits to be continued, on both transports and the local
  model: the client gets the refusal (HTTP, or in-band), the trial leaves the queue and is
  never continued, its kept KV is let go, the urgent request runs on, nothing is left behind.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from proxy.guards import Prompt, Refusal, Window
from proxy.relay.state import Phase
from tests.contracts import test_lifetime_matrix as matrix
from tests.contracts.test_lifetime_matrix import receiver, traced  # noqa: F401 - its fixtures
from tests.support import DEADLINE, RawClient, poll_until

# A pattern no answer or prompt here holds: the guards read everything and pass it.
NEVER = r"\x00never"
HOLDING_STAGES = ("prompt", "output")


# What makes a guard refuse a cell's trial: the prompt guard, this word in the prompt; the
# output guard, the fake's sixth word (a warm-up answer has five, a trial's long stream more).
REFUSE_PROMPT = "refuse-me"
REFUSE_OUTPUT = r"\bover\b"


def guards_for(holding: str, refuse: bool = False) -> list[dict[str, Any]]:
    """A guard of each stage; ``holding`` the in-nursery stage that reads the answer (the other
    is left out), refusing a trial made to be refused when ``refuse``."""
    deny = [NEVER]
    if refuse:
        deny = [REFUSE_PROMPT if holding == "prompt" else REFUSE_OUTPUT]
    return [
        {"name": "at-request", "use": "regex", "stage": "request", "options": {"deny": [NEVER]}},
        {
            "name": f"at-{holding}",
            "use": "regex",
            "stage": holding,
            "window_tokens": 2,
            "overlap_tokens": 1,
            "hold_back_tokens": 2,
            "options": {"deny": deny},
        },
        {"name": "at-after", "use": "regex", "stage": "after", "options": {"deny": [NEVER]}},
    ]


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    holding, refuse = request.param
    monkeypatch.setattr(
        matrix,
        "start_proxy",
        functools.partial(matrix.start_proxy, guards=guards_for(holding, refuse)),
    )


# The json transport's fast cells (the rest of that column is slow, as in the matrix): a whole
# answer held by each stage, on the lean upstream and on the local model.
FAST_JSON_PASSES = {"output-pass-upstream-json-mid_stream", "prompt-pass-local-json-first_token"}


def _pass_cells() -> list[Any]:
    cells = []
    for case in matrix._matrix():
        phase, transport, backend = case.values
        for stage in HOLDING_STAGES:
            name = f"{stage}-pass-{backend}-{phase}"
            if transport == "json":
                name = f"{stage}-pass-{backend}-json-{phase}"
            # The paused phase holds its answer for a preemption: with a guard holding it too,
            # it is the slow part of the matrix. A whole (JSON) answer is held to its end.
            slow = phase is Phase.PAUSED or (transport == "json" and name not in FAST_JSON_PASSES)
            cells.append(
                pytest.param(
                    (stage, False),
                    phase,
                    transport,
                    backend,
                    marks=(pytest.mark.slow,) if slow else (),
                    id=name,
                )
            )
    return cells


@pytest.mark.parametrize(
    ("guarded", "phase", "transport", "backend"), _pass_cells(), indirect=["guarded"]
)
async def test_guards_pass_and_a_client_that_leaves_leaves_nothing_behind(
    guarded: None,
    phase: Phase,
    transport: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: matrix.Traced,  # noqa: F811 - the fixture imported above
) -> None:
    await matrix.leave_and_check(
        nursery, tiny_loaded_model, traced, "chat", phase, transport, backend
    )


def _refusal_cells() -> list[Any]:
    cells = []
    for stage in HOLDING_STAGES:
        for backend in matrix.BACKENDS:
            if stage == "output" and backend == "local":
                continue  # the tiny model's words are not the fake's: no answer to refuse
            cells.append(pytest.param((stage, True), backend, id=f"{stage}-refuse-{backend}"))
    return cells


@pytest.mark.parametrize(("guarded", "backend"), _refusal_cells(), indirect=["guarded"])
async def test_a_refusal_closes_the_upstream_and_leaves_nothing_behind(
    guarded: None,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: matrix.Traced,  # noqa: F811 - the fixture imported above
) -> None:
    with trio.fail_after(DEADLINE):
        rig = await matrix.start_rig(nursery, tiny_loaded_model, traced)
        if backend in matrix.UPSTREAM_BACKENDS:
            rig.upstream = backend
        options: dict[str, Any] = {"messages": [{"role": "user", "content": REFUSE_PROMPT}]}
        if backend != "local":
            options["fake"] = matrix.LONG_STREAM
        raw = await rig.post(backend, "sse", **options)
        await raw.read_until(b"guard_refused")
        await poll_until(lambda: not rig.proxy.state.tracker.active)
        if backend != "local":
            record = rig.fake.recorder.last()
            await rig.fake.recorder.wait_for(lambda _: record.outcome != "pending")
            # Cut at the verdict, far from the long stream's 1,000 tokens.
            assert record.tokens_sent < 50
        await raw.close()
        await matrix.assert_nothing_left(rig, set())
        await matrix.assert_traces_say_what_happened(rig, raw, "guard_refused")
        await matrix.assert_next_request_works(rig, backend, "sse")


# -- a refusal in each phase ----------------------------------------------------------------


class Trial:
    """What :func:`refuse_in_phase` does: nothing to a request before the cell arms it (the
    warm-up, the next request); once armed, it refuses where its ``at`` option says: ``"now"``,
    a window's index, the ``"final"`` window, or ``"gate"``: once the cell opens the gate (an
    output guard's windows before the ``from`` option's index pass). With ``only_first``, the
    first request it meets once armed is the trial, and every other passes (the paused
    phase's urgent request, sent while the trial waits for its verdict)."""

    armed = False
    gate: trio.Event | None = None
    only_first = False
    trial_id: str | None = None
    # Set once a call waits for the gate.
    at_gate = trio.Event()

    @classmethod
    def reset(cls) -> None:
        cls.armed, cls.gate, cls.only_first, cls.trial_id = False, None, False, None
        cls.at_gate = trio.Event()


async def refuse_in_phase(context: Prompt | Window) -> Refusal | None:
    if not Trial.armed:
        return None
    if Trial.only_first:
        if Trial.trial_id is None:
            Trial.trial_id = context.request_id
        if context.request_id != Trial.trial_id:
            return None
    at = context.options["at"]
    if at == "gate":
        if isinstance(context, Window) and context.index < context.options.get("from", 0):
            return None
        assert Trial.gate is not None
        Trial.at_gate.set()
        await Trial.gate.wait()
    elif isinstance(context, Window) and (
        not context.final if at == "final" else context.index != at
    ):
        return None
    return Refusal("refused in its phase", reason=f"at {at}")


REFUSER = f"{__name__}:refuse_in_phase"
# The prompt guard holds up to 16 events (a short answer whole, so that its last token can come
# before the verdict); the output guard's windows are 2 tokens, so that a long stream has a
# middle and a short one several windows.
HOLD = 16


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    """The proxy's one guard: :func:`refuse_in_phase` at a stage; the stage."""
    stage, at = request.param
    options: dict[str, Any] = {"at": at}
    if isinstance(at, tuple):  # ("gate", the first window that waits for it)
        options = {"at": at[0], "from": at[1]}
    table = {
        "name": f"refuse-{stage}",
        "use": REFUSER,
        "stage": stage,
        "window_tokens": 2,
        "overlap_tokens": 1,
        "hold_back_tokens": HOLD,
        "options": options,
    }
    monkeypatch.setattr(
        matrix, "start_proxy", functools.partial(matrix.start_proxy, guards=[table])
    )
    Trial.reset()
    yield stage
    Trial.reset()


# Where each stage's verdict can come, and how the guard is told to give it there.
REFUSAL_AT: dict[tuple[str, Phase], Any] = {
    ("request", Phase.QUEUED): "now",  # before the queue: nothing dispatched
    **{
        ("prompt", phase): "gate"
        for phase in (
            Phase.CONNECTING,
            Phase.HEAD,
            Phase.FIRST_TOKEN,
            Phase.MID_STREAM,
            Phase.AFTER_LAST,
        )
    },
    ("output", Phase.FIRST_TOKEN): 0,
    ("output", Phase.MID_STREAM): 2,
    ("output", Phase.AFTER_LAST): "final",
}
FAST_REFUSALS = {
    "request-upstream-sse-queued",
    "prompt-upstream-sse-head",
    "prompt-local-sse-first_token",
    "output-local-sse-first_token",
    "output-upstream-httpx-json-after_last",
}


def _refusal_in_phase_cells() -> list[Any]:
    cells = []
    for (stage, phase), at in REFUSAL_AT.items():
        for backend in matrix.BACKENDS:
            if (phase, backend) in matrix.NOT_APPLICABLE:
                continue
            for transport in matrix.TRANSPORTS:
                if stage == "output" and transport == "json" and phase != Phase.AFTER_LAST:
                    continue  # a whole answer is one window, checked once it is all there
                name = f"{stage}-{backend}-{transport}-{phase}"
                marks = () if name in FAST_REFUSALS else (pytest.mark.slow,)
                cells.append(
                    pytest.param((stage, at), phase, transport, backend, marks=marks, id=name)
                )
    return cells


async def _post_in_phase(
    rig: matrix.Rig, stage: str, phase: Phase, transport: str, backend: str
) -> RawClient:
    """The trial, sent and brought to ``phase``; the gate, if the guard waits on one, opened
    there."""
    Trial.armed = True
    Trial.gate = trio.Event()
    model = rig.model
    options: dict[str, Any] = {}
    parked_in: str | None = None
    if backend == "local":
        model.step_seconds = matrix.STEP
        if phase == Phase.FIRST_TOKEN:
            model.prefill_seconds = matrix.PREFILL
        options["max_tokens"] = 5 if phase == Phase.AFTER_LAST else matrix.LONG_ANSWER
    elif stage != "prompt":
        # The output guard decides on the answer itself: a long one but for the last window.
        options["fake"] = {} if phase == Phase.AFTER_LAST else matrix.LONG_STREAM
    elif phase == Phase.CONNECTING:
        options["model"] = rig.model_name("unreachable")
        parked_in = matrix.CONNECTING_IN[backend]
    elif phase == Phase.HEAD:
        options["fake"] = {"mode": "stall_headers"}
        parked_in = matrix.READING_HEAD_IN[backend]
    elif phase == Phase.FIRST_TOKEN:
        options["fake"] = {"ttft": 30}
        sse = transport == "sse"
        parked_in = "_relay_stream" if sse else matrix.READING_HEAD_IN[backend]
    elif phase == Phase.MID_STREAM:
        options["fake"] = matrix.LONG_STREAM
    prefills, steps = model.prefills, model.steps
    raw = await rig.post(backend, transport, **options)
    if stage != "prompt":
        return raw  # the request and output guards decide on their own
    if parked_in is not None:
        await matrix.wait_for_producer_in(parked_in)
    elif backend == "local" and phase == Phase.FIRST_TOKEN:
        await poll_until(lambda: model.prefills > prefills)
    elif backend == "local" and phase == Phase.MID_STREAM:
        await poll_until(lambda: model.steps >= steps + 4)
    elif backend == "local":  # after the last token: the worker is done, its answer held
        await poll_until(lambda: model.steps > steps and rig.local.active_generations == 0)
    else:
        await rig.fake.recorder.wait_for(lambda r: len(r.records) == rig.records + 1)
        record = rig.fake.recorder.last()
        if phase == Phase.MID_STREAM and transport == "sse":
            await poll_until(lambda: record.tokens_sent >= 3)
        elif phase == Phase.MID_STREAM:
            # A whole answer sends nothing before its end: three tokens in by the fake's
            # schedule, as the matrix's own driver has it.
            await trio.sleep_until(record.received_at + 3 * matrix.LONG_STREAM["interval"])
        else:
            await rig.fake.recorder.wait_for(lambda _: record.outcome == "completed")
    Trial.gate.set()
    return raw


@pytest.mark.parametrize(
    ("refusing", "phase", "transport", "backend"),
    _refusal_in_phase_cells(),
    indirect=["refusing"],
)
async def test_a_refusal_in_each_phase_lets_go_of_everything(
    refusing: str,
    phase: Phase,
    transport: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: matrix.Traced,  # noqa: F811 - the fixture imported above
) -> None:
    stage = refusing
    with matrix.unreachable_port() as (listener, _), trio.fail_after(DEADLINE):
        port = listener.getsockname()[1]
        rig = await matrix.start_rig_with_unreachable(nursery, tiny_loaded_model, traced, port)
        if backend in matrix.UPSTREAM_BACKENDS:
            rig.upstream = backend
        records = rig.records
        raw = await _post_in_phase(rig, stage, phase, transport, backend)
        await raw.read_until(b"guard_refused")
        await poll_until(lambda: not rig.proxy.state.tracker.active)
        Trial.armed = False
        reached = len(rig.fake.recorder.records) > records
        if backend == "local" or phase == Phase.CONNECTING or stage == "request":
            assert not reached  # nothing of it went to the fake
        else:
            record = rig.fake.recorder.last()
            await rig.fake.recorder.wait_for(lambda _: record.outcome != "pending")
            # Let go at the verdict, far from the long stream's 1,000 tokens.
            assert record.tokens_sent < 50, record
        await raw.close()
        await matrix.assert_nothing_left(rig, set())
        await matrix.assert_traces_say_what_happened(rig, raw, "guard_refused")
        await matrix.assert_next_request_works(rig, backend, transport)


# -- a refusal while paused -----------------------------------------------------------------

# The paused phase (a stream of a less urgent band paused for an urgent request, as the
# matrix's own paused cells do): the verdict comes while the trial waits to be continued. The
# prompt guard is still deciding (it held all of the answer so far: the refusal is the HTTP
# answer); the output guard passed the first two windows (the client has text, and hears
# ": paused"), and the third waits for the gate (the refusal is in-band).
PAUSED_REFUSAL_AT = {"prompt": "gate", "output": ("gate", 2)}
FAST_PAUSED_REFUSALS = {"output-upstream-paused"}


def _refusal_while_paused_cells() -> list[Any]:
    cells = []
    for stage, at in PAUSED_REFUSAL_AT.items():
        for backend in matrix.BACKENDS:
            name = f"{stage}-{backend}-paused"
            marks = () if name in FAST_PAUSED_REFUSALS else (pytest.mark.slow,)
            cells.append(pytest.param((stage, at), backend, marks=marks, id=name))
    return cells


async def _paused_trial(rig: matrix.Rig, stage: str, backend: str) -> tuple[RawClient, RawClient]:
    """The trial, under way and then paused for an urgent request that runs meanwhile; the
    guard's verdict on the trial not given yet. The trial and the urgent request."""
    Trial.armed, Trial.only_first, Trial.gate = True, True, trio.Event()
    model = rig.model
    steps = model.steps
    if backend == "local":
        model.step_seconds = matrix.STEP
        long_answer: dict[str, Any] = {"max_tokens": matrix.LONG_ANSWER}
    else:
        long_answer = {"fake": matrix.LONG_STREAM}
    raw = await rig.post(backend, "sse", priority=matrix.BATCH_BAND, **long_answer)
    # Its guard waits for the gate (the output guard's first windows passed, and went out).
    await Trial.at_gate.wait()
    if stage == "output":
        await raw.read_until(b"data: ", count=2)
    elif backend == "local":
        await poll_until(lambda: model.steps >= steps + 3)
    else:
        await rig.fake.recorder.wait_for(lambda r: len(r.records) == rig.records + 1)
        await poll_until(lambda: rig.fake.recorder.last().tokens_sent >= 3)
    trial_record = None if backend == "local" else rig.fake.recorder.last()
    # A band-0 request waits for the one slot, then pauses the trial and takes it.
    urgent = await rig.post(backend, "sse", **long_answer)
    await urgent.read_until(b"data: ")
    if backend == "local":
        await rig.local.admission.wait_queued(1)  # paused: waiting to be continued
        assert rig.local.engine.paused_kv_bytes > 0
    else:
        assert trial_record is not None
        await rig.fake.recorder.wait_for(lambda _: trial_record.outcome != "pending")
        assert trial_record.outcome == "client_disconnected", trial_record
        await poll_until(lambda: rig.upstream_waiting() == 1)
    if stage == "output":
        # Its windows held back, its keep-alive reaches it all the same.
        await raw.read_until(b": paused")
    return raw, urgent


@pytest.mark.parametrize(
    ("refusing", "backend"), _refusal_while_paused_cells(), indirect=["refusing"]
)
async def test_a_refusal_while_paused_lets_go_of_everything(
    refusing: str,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: matrix.Traced,  # noqa: F811 - the fixture imported above
) -> None:
    """The verdict comes while the trial is paused: the client gets the refusal, the trial
    leaves the queue at once and is never continued (no upstream request, its kept KV let go),
    the urgent request it was paused for runs on, and nothing is left behind."""
    stage = refusing
    with trio.fail_after(DEADLINE):
        rig = await matrix.start_rig(nursery, tiny_loaded_model, traced)
        if backend in matrix.UPSTREAM_BACKENDS:
            rig.upstream = backend
        raw, urgent = await _paused_trial(rig, stage, backend)
        records = len(rig.fake.recorder.records)
        assert Trial.gate is not None
        Trial.gate.set()
        await raw.read_until(b"guard_refused")
        # Before its head (prompt) the refusal is the HTTP answer, else an in-band error.
        status = b"400" if stage == "prompt" else b"200"
        assert raw.received.startswith(b"HTTP/1.1 " + status), raw.received[:200]
        await rig.proxy.state.tracker.wait_until(lambda tracker: len(tracker.active) == 1)
        assert rig.upstream_waiting() == 0
        assert rig.local.admission.waiting == 0
        await matrix.settle(
            lambda: rig.local.engine.paused_kv_bytes == 0,
            lambda: f"{rig.local.engine.paused_kv_bytes} bytes of paused KV kept",
        )
        # The urgent request runs on, and nothing of the trial was sent again.
        await urgent.read_until(b"data: ", count=3)
        assert len(rig.fake.recorder.records) == records
        Trial.armed = False
        if backend == "local":
            await urgent.ready_to_leave()
            steps = rig.model.steps
            closed_at = await urgent.close()
            await matrix.assert_local_stopped(rig, closed_at, matrix.STEP, steps)
        else:
            urgent_record = rig.fake.recorder.last()
            closed_at = await urgent.close()
            await matrix.assert_upstream_saw_close(rig, urgent_record, closed_at)
        await raw.close()
        await matrix.assert_nothing_left(rig, set())
        await matrix.assert_traces_say_what_happened(rig, raw, "guard_refused")
        await matrix.assert_next_request_works(rig, backend, "sse")
