"""The lifetime matrix's guard cells: the lifetime contract holds with guards on every stage.

The same harness as tests/contracts/test_lifetime_matrix.py (its Rig, start_rig, drivers,
bounds and leave_and_check, imported, not copied), with the proxy it starts serving
``[[guards]]``: the rig's ``start_proxy`` is wrapped for the test so that every request of
every model meets a guard of each stage.

* **pass**: every phase x stage x backend (both upstream transports and the local model), SSE:
  the client leaves in its phase, and the guards' tasks go with the request: no task, socket,
  descriptor or body left, the upstream closed within the bound, the next request works.
  Stages are on together in each cell (request, prompt, output and after guards, each of its
  own ``stage``), and the cells are parametrized by which of the in-nursery stages holds the
  answer (``prompt`` alone, ``output`` alone).
* **refuse**: a prompt and an output guard that refuse (stage x backend): the refusal ends the
  request, the upstream is closed, and nothing is left behind either.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import trio

from proxy.relay.state import Phase
from tests.contracts import test_lifetime_matrix as matrix
from tests.contracts.test_lifetime_matrix import receiver, traced  # noqa: F401 - its fixtures
from tests.support import DEADLINE, poll_until

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


def _pass_cells() -> list[Any]:
    cells = []
    for case in matrix._matrix():
        phase, transport, backend = case.values
        if transport != "sse":
            continue
        for stage in HOLDING_STAGES:
            # The paused phase holds its answer for a preemption: with a guard holding it too,
            # it is the slow part of the matrix.
            marks = (pytest.mark.slow,) if phase is Phase.PAUSED else ()
            cells.append(
                pytest.param(
                    (stage, False),
                    phase,
                    backend,
                    marks=marks,
                    id=f"{stage}-pass-{backend}-{phase}",
                )
            )
    return cells


@pytest.mark.parametrize(("guarded", "phase", "backend"), _pass_cells(), indirect=["guarded"])
async def test_guards_pass_and_a_client_that_leaves_leaves_nothing_behind(
    guarded: None,
    phase: Phase,
    backend: str,
    nursery: trio.Nursery,
    tiny_loaded_model: Any,
    traced: matrix.Traced,  # noqa: F811 - the fixture imported above
) -> None:
    await matrix.leave_and_check(nursery, tiny_loaded_model, traced, "chat", phase, "sse", backend)


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
