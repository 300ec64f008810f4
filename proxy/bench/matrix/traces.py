"""The trials' traces: the environment that points the Sluice this bench starts at the bench's
own OTLP receiver (:mod:`proxy.testing.otlp_receiver`), and, once the run is over, each trial
judged by :func:`proxy.testing.trace_check.judge` against the outcome of its own access line
(found by the trace id its ``traceparent`` named), after checking that this outcome is the one
the trial expected: a client that left before the end is ``cancelled(<phase>)``, one that
left after the last token ``completed``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import trio

from proxy.bench.matrix.cells import Cell, Trial
from proxy.relay.state import Phase
from proxy.testing.otlp_receiver import KIND_SERVER, Receiver
from proxy.testing.trace_check import judge


def tracing_env(receiver_url: str) -> dict[str, str]:
    """Only the standard variables: the way an operator turns Sluice's tracing on."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver_url}/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }


def unexpected(phase: Phase, outcome: str) -> str | None:
    """Why ``outcome`` (an access line's) is not what a trial of ``phase`` expected, or None.
    Only whether the client left is expected, not the phase the line names: Sluice names the
    phase it was in (an accepted but unread connection is ``head`` on loopback; a Responses
    stream's first events come before the first token)."""
    if phase == Phase.AFTER_LAST:
        return None if outcome == "completed" else f"access line says {outcome}, not completed"
    if outcome.startswith("cancelled("):
        return None
    return f"access line says {outcome}, not cancelled(...)"


def verdict(
    trial: Trial, phase: Phase, outcomes: Mapping[str, str], receiver: Receiver, *, local: bool
) -> str | None:
    """None when the trial's trace says what its access line says, and that is what the trial
    expected; otherwise why not."""
    outcome = outcomes.get(trial.trace_id)
    if outcome is None:
        return "no access line names its trace"
    spans = receiver.of_trace(trial.trace_id)
    return unexpected(phase, outcome) or judge(spans, outcome, local=local)


def _exported(receiver: Receiver, trace_ids: Iterable[str]) -> bool:
    """Whether every trace's SERVER span has arrived (it ends last, so it is exported last)."""
    with receiver.lock:
        servers = {span.trace_id for span in receiver.spans if span.kind == KIND_SERVER}
    return all(trace_id in servers for trace_id in trace_ids)


async def judge_cells(
    cells: Iterable[Cell],
    outcomes: Mapping[str, str],
    receiver: Receiver,
    *,
    local: bool,
    patience: float,
) -> None:
    """Record every trial's verdict, once its spans have arrived or ``patience`` is spent
    (one wait for the whole run, not one per trial)."""
    judged = [(cell, trial) for cell in cells for trial in cell.trials if trial.trace_id]
    with trio.move_on_after(patience):
        while not _exported(receiver, (trial.trace_id for _, trial in judged)):  # noqa: ASYNC110
            await trio.sleep(0.05)
    for cell, trial in judged:
        failure = verdict(trial, cell.phase, outcomes, receiver, local=local)
        trial.traced = failure is None
        trial.trace_failure = failure or ""
