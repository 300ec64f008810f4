"""``sluice bench --matrix``: a reduced cancellation scorecard against Sluice (a real ``sluice
serve`` in front of the fake upstream), its JSON's shape, and the pure parts."""

from __future__ import annotations

import io
import json
import sys

import pytest
import trio

from proxy.bench import matrix
from proxy.bench.matrix import Cell, MatrixSettings, applicability, run_matrix, wants_matrix
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
}


async def test_a_reduced_matrix_against_sluice_cancels_every_trial() -> None:
    settings = MatrixSettings(
        phases=("first_token", "mid_stream"),
        transports=("sse", "ws"),
        endpoints=("chat",),
        leaves=("fin",),
        repeat=2,
    )
    with trio.fail_after(60):
        report = await run_matrix(settings, out=io.StringIO())
    json.dumps(report)  # the report is JSON as it stands
    assert {"system", "commit", "versions", "cells"} <= set(report)
    assert report["system"] == "sluice (lean)"
    cells = report["cells"]
    assert [(c["phase"], c["transport"]) for c in cells] == [
        ("first_token", "sse"),
        ("first_token", "ws"),
        ("mid_stream", "sse"),
        ("mid_stream", "ws"),
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
        assert cell["fds_over_baseline"] is not None and cell["fds_over_baseline"] <= 0, cell
        # Its access lines: each trial a client that left, each probe completed.
        outcomes = dict(cell["access_outcomes"])
        assert outcomes.pop("completed") == 2, cell
        ((outcome, count),) = outcomes.items()
        assert outcome.startswith("cancelled") and count == 2, cell
    text = matrix.markdown_report(report)
    assert "| first_token | 2/2" in text


def test_cells_a_transport_cannot_reach_are_not_applicable() -> None:
    assert applicability("queued", "sse", "chat", target=True)[0] is False
    assert applicability("queued", "sse", "chat", target=False)[0] is True
    assert applicability("mid_stream", "json", "chat", target=False)[0] is False
    assert applicability("head", "ws", "chat", target=False)[0] is False
    row = Cell("head", "ws", "completions", "fin", 3, served=False, note="not served").to_json()
    assert row["cancelled"] is None and row["served"] is False
    assert "not served" in matrix._cell_text(row)


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
