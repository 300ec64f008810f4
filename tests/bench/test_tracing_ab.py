"""``--versus-tracing``: its settings, its schedule, the receiver's count and the report's lines."""

from __future__ import annotations

import argparse
import time

import pytest

from proxy import bench
from proxy.bench import BenchError, BenchSettings, RunData, StreamResult, summarize, tracing_ab
from proxy.bench import cli as bench_cli
from proxy.bench import run as bench_run
from proxy.ops import tracing
from proxy.testing.otlp_receiver import KIND_CLIENT, KIND_SERVER, Receiver, Span


def test_versus_tracing_settings_name_the_load_and_refuse_a_second_versus() -> None:
    plain = BenchSettings()
    traced = BenchSettings(versus_tracing=True, repeat=3)
    assert traced.key() == BenchSettings(repeat=3).key() + " tracing=1"
    assert traced.slug() == "100-streams-traced-vs-untraced-3-repeats"
    assert "traced (OTLP/HTTP" in traced.describe() and "vs untraced" in traced.describe()
    assert "tracing" not in plain.describe()
    with pytest.raises(BenchError, match="one at a time"):
        BenchSettings(versus_tracing=True, versus_transport="httpx")
    with pytest.raises(BenchError, match="not --target"):
        BenchSettings(versus_tracing=True, target="http://127.0.0.1:9")
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--versus-tracing", "--repeat", "3"])
    assert bench_cli.settings_from_args(args) == traced


def test_traced_and_untraced_runs_alternate() -> None:
    settings = BenchSettings(versus_tracing=True, repeat=3)
    assert bench_run._schedule(settings) == [
        "proxy",
        "versus",
        "versus",
        "proxy",
        "proxy",
        "versus",
    ]
    labels = bench.column_labels(settings)
    assert (labels["proxy"], labels["versus"]) == ("proxy (traced)", "proxy (untraced)")
    assert labels["proxy/versus"] == "traced/untraced"


def test_the_traced_env_samples_every_request_and_the_untraced_none() -> None:
    config = tracing.TracingConfig()
    outside = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}
    traced = tracing.settings_from(config, outside | tracing_ab.traced_env("http://127.0.0.1:9"))
    assert traced is not None
    assert (traced.endpoint, traced.protocol) == ("http://127.0.0.1:9/v1/traces", "http/protobuf")
    assert traced.sampler == "always_on"
    # Whatever the bench's own environment says, the untraced proxy has no endpoint.
    assert tracing.settings_from(config, outside | tracing_ab.untraced_env()) is None


def span(path: str, kind: int = KIND_SERVER) -> Span:
    return Span(
        "POST " + path, kind, "t", "s", "", "", {"url.path": path}, {}, {}, 0, 0, 0, "sluice"
    )


async def test_the_tally_counts_chat_server_spans_and_waits_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    receiver = Receiver("http://127.0.0.1:9")
    receiver.spans += [span("/v1/chat/completions"), span("/healthz")]
    receiver.spans += [span("/v1/chat/completions", KIND_CLIENT)]
    tally = tracing_ab.TracingTally()
    await tally.settle(receiver, 1)
    assert (tally.requests, tally.spans, tally.all_spans, tally.runs) == (1, 1, 3, [(1, 1)])
    assert tally.complete
    # A span that never comes: the wait is bounded, and the count says so.
    monkeypatch.setattr(tracing_ab, "SETTLE_TIMEOUT", 0.01)
    await tally.settle(receiver, 2)
    assert (tally.requests, tally.spans, tally.runs[-1]) == (3, 1, (2, 0))
    assert not tally.complete
    lines = tracing_ab.markdown_lines(tally, 1.3)
    assert "got 1 SERVER spans for the 3 chat requests" in lines[0]
    assert "NOT every request was traced" in lines[0] and "at the end: not read" in lines[0]
    assert lines[1] == "- Proxy CPU per event, traced/untraced: 1.30x (target <= 1.25x: NOT met)"


def test_the_export_threads_cpu_is_read_apart_from_the_event_loops() -> None:
    import os
    import threading

    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    before = tracing_ab.side_threads_cpu_seconds(os.getpid())
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            now = tracing_ab.side_threads_cpu_seconds(os.getpid())
            if now is not None and before is not None and now - before >= 0.05:
                break
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join()
    assert now is not None and before is not None and now - before >= 0.05
    tally = tracing_ab.TracingTally()
    tally.add_threads(0.01, 1000)
    tally.add_threads(0.01, 1000)
    line = tracing_ab.markdown_lines(tally, 1.1)[1]
    assert "10.0 µs per event was in threads other than the event loop's" in line


def test_dropped_spans_are_read_from_the_metrics_text() -> None:
    text = "# TYPE sluice_trace_spans_dropped_total counter\nsluice_trace_spans_dropped_total 3.0\n"
    assert tracing_ab.parse_dropped(text) == 3.0
    assert tracing_ab.parse_dropped("sluice_requests_total 1.0\n") is None
    tally = tracing_ab.TracingTally(requests=2, spans=2, dropped=3.0)
    assert not tally.complete  # a dropped span is a request not fully traced


def test_each_repeat_gets_its_own_cpu_ratio() -> None:
    tally = tracing_ab.TracingTally()
    traced = [RunData("proxy", results(50), {}, 1.0, 0.1, proxy_cpu_s=cpu) for cpu in (0.3, 0.2)]
    untraced = [RunData("versus", results(50), {}, 1.0, 0.1, proxy_cpu_s=0.25)] * 2
    untraced.append(RunData("versus", results(50), {}, 1.0, 0.1))  # an unpaired run: none
    tally.pair_ratios(traced, untraced)
    assert tally.repeat_ratios == pytest.approx([1.2, 0.8])
    line = tracing_ab.markdown_lines(tally, 1.0)[1]
    assert line.endswith("(target <= 1.25x: met); repeat by repeat: 1.20x, 0.80x")


def results(events: int, count: int = 4) -> list[StreamResult]:
    return [
        StreamResult(
            index=i,
            tag=f"t{i}",
            role="normal",
            started=100.0,
            connected=100.001,
            sent=100.002,
            first_token=100.05,
            gaps=[0.02],
            status=200,
            events=events,
            done=True,
            complete=True,
            ended=True,
        )
        for i in range(count)
    ]


def test_the_section_says_what_was_traced_and_the_cpu_ratio_against_the_target() -> None:
    settings = BenchSettings(versus_tracing=True, repeat=3)
    runs = {
        "proxy": RunData("proxy", results(50), {}, 1.0, 0.1, proxy_cpu_s=0.024),
        "versus": RunData("versus", results(50), {}, 1.0, 0.1, proxy_cpu_s=0.02),
    }
    report = bench.BenchReport(
        settings=settings,
        summaries={mode: summarize(run) for mode, run in runs.items()},
        machine={},
        command="test",
        commit=None,
        date="today",
        env={},
        pids={},
        runs=runs,
        tracing=tracing_ab.TracingTally(requests=13, spans=13, dropped=0.0),
    )
    section = bench.markdown_section(report)
    assert section.startswith("## 100 streams, traced vs untraced\n")
    assert "every request was traced;" in section
    # 4 streams a side: 4 ms of CPU more in all, 1000 µs a request.
    assert (
        "- Proxy CPU per event, traced/untraced: 1.20x (target <= 1.25x: met); "
        "+1000 µs of proxy CPU per request" in section
    )
    assert "| figure | proxy (traced) | proxy (untraced) | traced/untraced |" in section
    assert "| proxy CPU per event (µs) | 120 | 100 | 1.20x |" in section
    out = report.to_json()
    assert out["tracing"]["complete"] and out["tracing"]["requests"] == 13
    assert out["ratios_versus"]["proxy_cpu_us_per_event"] == pytest.approx(1.2)
