"""``proxy.bench``: the pure parts on crafted inputs, child supervision, and one tiny real run."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from proxy import bench
from proxy.bench import (
    BenchError,
    BenchSettings,
    Dechunker,
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
    percentile,
    ratios,
    summarize,
    upsert_section,
)

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


# --------------------------------------------------------------------------- HTTP parsing


def test_dechunker_reassembles_any_split() -> None:
    body = chunked(SSE)
    for pieces in splits(body):
        dechunker = Dechunker()
        out = b"".join(dechunker.feed(piece) for piece in pieces)
        assert out == SSE
        assert dechunker.done


def test_dechunker_ignores_bytes_after_the_end_and_refuses_garbage() -> None:
    dechunker = Dechunker()
    assert dechunker.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 junk") == b"abc"
    assert dechunker.done
    with pytest.raises(ProtocolError):
        Dechunker().feed(b"zz\r\nabc\r\n")
    with pytest.raises(ProtocolError):
        Dechunker().feed(b"3\r\nabcXY")


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


def test_upsert_section_replaces_its_own_block_only() -> None:
    text = upsert_section("", "k=1", "## one\n")
    assert text.startswith("# Benchmarks")
    text = upsert_section(text + "\nNotes kept.\n", "k=2", "## two\n")
    text = upsert_section(text, "k=1", "## one, again\n")
    assert "## one, again" in text
    assert "## one\n" not in text
    assert text.index("## one, again") < text.index("Notes kept.") < text.index("## two")
    assert upsert_section(text, "k=2", "## two\n") == text


def test_proc_parsers() -> None:
    # A command name with spaces and parentheses must not shift the fields.
    stat = "42 (my (odd) proc) S 1 42 42 0 -1 4194304 10 0 0 0 150 50 0 0 20 0 1 0 1 0 0"
    assert parse_cpu_seconds(stat, 100) == pytest.approx(2.0)
    assert parse_vm_hwm("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t1 kB\n") == 2048 * 1024
    assert parse_vm_hwm("Name:\tx\n") is None
    assert parse_meminfo_total("MemTotal:       1024 kB\nMemFree: 1 kB\n") == 1024 * 1024
    assert bench.parse_schedstat_wait("123456 2500000000 17\n") == pytest.approx(2.5)
    cpu = bench.process_cpu_seconds(os.getpid())
    assert cpu is not None and cpu > 0


# --------------------------------------------------------------------------- children


async def test_a_child_that_exits_fails_the_bench_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with trio.fail_after(10), pytest.RaisesGroup(bench.ChildExited) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(bench._supervise, "proxy", argv, tmp_path / "log")
            await trio.sleep_forever()
    message = str(caught.value.exceptions[0])
    assert "status 3" in message
    assert "no such model" in message


async def test_cancelling_the_bench_stops_its_children(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            process = await nursery.start(bench._supervise, "fake", argv, tmp_path / "log")
            nursery.cancel_scope.cancel()
    assert process.returncode is not None


# --------------------------------------------------------------------------- end to end


def alive(pid: int) -> bool:
    # Reaped children leave no /proc entry (a zombie would: the bench waits for each child).
    return os.path.exists(f"/proc/{pid}")


async def test_tiny_bench_against_real_subprocesses() -> None:
    settings = BenchSettings(
        streams=5,
        ramp=0.05,
        ttft=0.02,
        interval=0.01,
        tokens=5,
        drop=0.4,
        drop_at=2,
        direct=True,
        grace=2.0,
        timeout=10.0,
        progress=False,
    )
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
