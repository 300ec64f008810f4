"""The matrix's trace verdicts, without sockets: the traceparent each client sends, the outcome
a trial expects of its access line, each trial judged from spans a receiver holds, and a cell's
verdicts in its JSON row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import trio

from proxy.bench.matrix import Cell, Client, MatrixSettings, Trial
from proxy.bench.matrix.client import _http_request
from proxy.bench.matrix.systems import Context
from proxy.bench.matrix.traces import judge_cells, tracing_env, unexpected, verdict
from proxy.bench.matrix.view import access_outcomes
from proxy.relay.state import Phase
from proxy.testing.fake_upstream import FakeUpstream
from proxy.testing.otlp_receiver import KIND_CLIENT, KIND_SERVER, Receiver, Span

TRACE = "0af7651916cd43dd8448eb211c80319c"


def span(name: str, kind: int, span_id: str, parent: str, outcome: str) -> Span:
    return Span(
        name=name,
        kind=kind,
        trace_id=TRACE,
        span_id=span_id,
        parent_span_id=parent,
        trace_state="",
        attributes={"sluice.outcome": outcome},
        events={},
        event_times={},
        status=0,
        start=1,
        end=2,
        service="sluice",
    )


def completed_trace() -> list[Span]:
    return [
        span("POST /v1/chat/completions", KIND_SERVER, "a" * 16, "", "completed"),
        span("chat fake-model", KIND_CLIENT, "b" * 16, "a" * 16, "completed"),
    ]


def test_every_client_names_a_trace_of_its_own_sampled() -> None:
    first, second = (Client(("127.0.0.1", 1), "chat", "m", "sse") for _ in range(2))
    assert first.trace_id != second.trace_id
    assert re.fullmatch(f"00-{first.trace_id}-[0-9a-f]{{16}}-01", first.traceparent)
    request = _http_request(("127.0.0.1", 1), "/v1/chat/completions", {}, "k", first.traceparent)
    assert f"traceparent: {first.traceparent}\r\n".encode() in request


def test_sluice_is_pointed_at_the_receiver_by_the_standard_variables_only() -> None:
    assert tracing_env("http://127.0.0.1:4318") == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }


def test_a_trial_expects_a_cancel_before_the_end_and_a_completion_after_it() -> None:
    assert unexpected(Phase.MID_STREAM, "cancelled(mid_stream)") is None
    # Sluice names the phase it was in, which the cell's need not be.
    assert unexpected(Phase.CONNECTING, "cancelled(head)") is None
    assert unexpected(Phase.HEAD, "completed") == "access line says completed, not cancelled(...)"
    assert unexpected(Phase.AFTER_LAST, "completed") is None
    assert unexpected(Phase.AFTER_LAST, "cancelled(mid_stream)") is not None


def test_a_trial_is_judged_by_its_own_access_line_and_its_own_spans() -> None:
    receiver = Receiver("http://unused")
    receiver.spans.extend(completed_trace())
    trial = Trial(cancelled=True, trace_id=TRACE)
    assert verdict(trial, Phase.AFTER_LAST, {TRACE: "completed"}, receiver, local=False) is None
    assert verdict(trial, Phase.AFTER_LAST, {}, receiver, local=False) == (
        "no access line names its trace"
    )
    # The line's outcome is what the trial expected; the spans say otherwise.
    said = verdict(trial, Phase.MID_STREAM, {TRACE: "cancelled(mid_stream)"}, receiver, local=False)
    assert said is not None and "not 'cancelled(mid_stream)'" in said
    stranger = Trial(cancelled=True, trace_id="f" * 32)
    assert verdict(stranger, Phase.AFTER_LAST, {"f" * 32: "completed"}, receiver, local=False) == (
        "0 server spans"
    )


async def test_the_cells_are_judged_once_their_spans_are_in_or_the_wait_is_spent() -> None:
    receiver = Receiver("http://unused")
    receiver.spans.extend(completed_trace())
    cell = Cell(Phase.AFTER_LAST, "sse", "chat", "fin", 2)
    cell.trials = [Trial(True, trace_id=TRACE), Trial(True, trace_id="e" * 32)]
    outcomes = {TRACE: "completed", "e" * 32: "completed"}
    with trio.fail_after(2):
        await judge_cells([cell], outcomes, receiver, local=False, patience=0.1)
    assert [t.traced for t in cell.trials] == [True, False]
    assert cell.to_json()["trace"] == {
        "traced": 1,
        "judged": 2,
        "failures": {"0 server spans": 1},
    }


def test_a_cell_of_trials_no_trace_judged_has_no_verdicts() -> None:
    cell = Cell(Phase.MID_STREAM, "sse", "chat", "fin", 1, trials=[Trial(True)])
    assert cell.to_json()["trace"] is None


def test_the_access_lines_give_each_traced_request_its_outcome(tmp_path: Path) -> None:
    lines = [
        {"path": "/v1/chat/completions", "outcome": "completed", "trace_id": TRACE},
        {"path": "/v1/ws", "outcome": "cancelled(mid_stream)", "trace_id": None},
        # Not the API's: the matrix's own polling.
        {"path": "/metrics", "outcome": "completed", "trace_id": "d" * 32},
    ]
    log = tmp_path / "sluice.log"
    log.write_text("starting\n" + "".join(json.dumps(line) + "\n" for line in lines))
    ctx = Context(MatrixSettings(), FakeUpstream(), ("127.0.0.1", 1), ws_served=True, log=log)
    assert access_outcomes(ctx) == {"completed": 1, "cancelled(mid_stream)": 1}
    assert ctx.trace_outcomes == {TRACE: "completed"}
