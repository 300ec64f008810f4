"""The fairness bench (proxy/bench/fairness/): its pure figures (backlogs, service differences,
the bound, the checks, the preemption phase's, the long run's minute by minute), its plans and
configs, and one tiny run of each command (the phases, and --long) against real
subprocesses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import trio

from proxy.bench import cli as bench_cli
from proxy.bench.fairness import cli as fairness_cli
from proxy.bench.fairness import load, long_report, minutes, report, run, stats
from proxy.bench.fairness.long_run import LongRun
from proxy.bench.fairness.settings import IDLE_SPACING, LONG, URGENT_LEAD, FairnessSettings
from proxy.bench.fairness.stats import Request
from proxy.bench.settings import BenchError
from proxy.config import load_config
from proxy.protocol.scheduling import SchedulingSettings, vtc_bound
from proxy.testing.fake_upstream import token_text


def req(key: str, **fields: Any) -> Request:
    """A request of ``key`` with what its client and the fake saw."""
    request = Request(key=key, kind="t", tag=f"t-{key}", at=0.0, tokens=10, ttft=0.0, interval=0.0)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


# --------------------------------------------------------------------------- intervals


def test_union_merges_overlaps_and_drops_empty_intervals() -> None:
    assert stats.union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert stats.union([]) == []


def test_intersect_keeps_only_the_overlap() -> None:
    a = [(0.0, 2.0), (3.0, 6.0)]
    b = [(1.0, 4.0), (5.0, 7.0)]
    assert stats.intersect(a, b) == [(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)]
    assert stats.intersect(a, []) == []


def test_a_key_is_backlogged_from_its_send_to_the_upstream_or_its_refusal() -> None:
    requests = [
        req("A", sent=0.0, upstream_received=2.0, ended_at=5.0),
        req("A", sent=1.0, upstream_received=3.0, ended_at=6.0),
        req("A", sent=10.0, upstream_received=None, ended_at=10.5),  # refused
        req("A", sent=None, ended_at=None),  # never sent
        req("B", sent=0.0, upstream_received=9.0, ended_at=9.5),
    ]
    assert stats.backlogged(requests, "A") == [(0.0, 3.0), (10.0, 10.5)]
    assert stats.total_seconds(stats.backlogged(requests, "A")) == pytest.approx(3.5)


# --------------------------------------------------------------------------- service


def test_service_is_input_at_the_upstream_and_output_as_it_arrives_weighted() -> None:
    requests = [
        req("A", input_tokens=10, upstream_received=1.0, arrivals=[(2.0, 3), (1.5, 1)]),
        req("B", input_tokens=4, upstream_received=None, arrivals=[]),
    ]
    events = stats.service_events(requests, 1.0, 2.0, {"A": 2.0})
    # Divided by A's weight 2, in time order; B never reached the upstream: nothing.
    assert events == {"A": [(1.0, 5.0), (1.5, 1.0), (2.0, 3.0)], "B": []}


def test_the_largest_difference_is_the_range_of_the_running_difference_in_a_window() -> None:
    f = [(1.0, 10.0), (2.0, 10.0), (6.0, 100.0)]
    g = [(3.0, 25.0)]
    # D before t: 0 until 1, 10, 20 from 2, -5 from 3, 95 from 6.
    assert stats.max_service_difference(f, g, [(0.0, 5.0)]) == 25.0  # 20 - (-5)
    assert stats.max_service_difference(f, g, [(2.5, 4.0)]) == 25.0  # 20 at 2.5, -5 after 3
    assert stats.max_service_difference(f, g, [(3.5, 5.0)]) == 0.0  # nothing served in it
    assert stats.max_service_difference(f, g, [(0.0, 5.0), (5.0, 7.0)]) == 100.0
    # An event at a window's end is outside it: [t1, t2).
    assert stats.max_service_difference(f, g, [(0.0, 1.0)]) == 0.0
    assert stats.max_service_difference([], [], [(0.0, 1.0)]) == 0.0


def test_tokens_in_counts_only_arrivals_inside_the_windows() -> None:
    arrivals = [(0.5, 1), (1.0, 2), (2.5, 4), (3.0, 8), (9.0, 16)]
    assert stats.tokens_in(arrivals, [(1.0, 3.0), (8.0, 10.0)]) == 2 + 4 + 16
    assert stats.tokens_in(arrivals, []) == 0


def test_pairs_backlogged_together_against_the_bound() -> None:
    # A and B both wait from 0 to 2; meanwhile A's running answer streams 100 tokens.
    a_running = req("A", sent=-5.0, upstream_received=-4.0, arrivals=[(1.0, 100)])
    a_waiting = req("A", sent=0.0, upstream_received=3.0, input_tokens=8)
    b = req("B", sent=0.0, upstream_received=2.0, input_tokens=8, arrivals=[(2.5, 5)])
    c = req("C", sent=10.0, upstream_received=10.1)
    pairs = stats.pair_figures(
        [a_running, a_waiting, b, c],
        ("A", "B", "C"),
        w_in=1.0,
        w_out=2.0,
        weights={"A": 1.0, "B": 1.0, "C": 1.0},
        bound=150.0,
    )
    by = {p.keys: p for p in pairs}
    assert by["A", "B"].seconds == pytest.approx(2.0)
    assert by["A", "B"].max_difference == pytest.approx(200.0)  # 100 output tokens x w_out
    assert not by["A", "B"].within
    assert by["A", "C"].seconds == 0.0 and by["A", "C"].max_difference == 0.0
    assert by["A", "C"].within
    assert stats.batch_tokens(4, 300) == 1200


def test_key_figures_ttft_backlog_and_tokens_served_meanwhile() -> None:
    requests = [
        req("B", sent=0.0, first_token=0.1, upstream_received=0.05, ended_at=0.2,
            status=200, done=True, tokens_seen=2, arrivals=[(0.1, 1), (0.2, 1)]),
        req("B", sent=1.0, first_token=1.5, upstream_received=1.45, ended_at=1.6,
            status=200, done=True, tokens_seen=2, arrivals=[(1.5, 2)]),
        req("B", sent=1.2, upstream_received=None, ended_at=1.3, status=503,
            error_code="deadline_unmeetable"),
    ]  # fmt: skip
    figures = stats.key_figures(requests, "B")
    assert (figures.requests, figures.ok, figures.tokens) == (3, 2, 4)
    assert figures.ttft_p50_s == pytest.approx(0.3)
    assert figures.ttft_p99_s == pytest.approx(0.496)
    assert figures.backlogged_s == pytest.approx(0.05 + 0.45)
    assert figures.tokens_backlogged == 0  # nothing of B's arrived while B waited
    assert stats.throughput(requests) == pytest.approx(4 / 1.6)
    assert stats.throughput([]) is None


def test_what_went_first_while_a_key_waited_and_the_least_wait_possible() -> None:
    requests = [
        # A's two running answers end at 1.0 and 1.5; a third of A's is dispatched at 1.0.
        req("A", sent=0.0, upstream_received=0.0, upstream_finished=1.0),
        req("A", sent=0.0, upstream_received=0.0, upstream_finished=1.5),
        req("A", sent=0.2, upstream_received=1.0, upstream_closed=2.0),
        # B waits from 0.5 to 1.5: A's third went first, at 1.0.
        req("B", sent=0.5, upstream_received=1.5, upstream_finished=1.6),
        # B's second found a slot free.
        req("B", sent=3.0, upstream_received=3.001, upstream_finished=3.1),
        # B's third waited; an A dispatched as it was being sent reached the upstream 2 ms
        # after the send: dispatched before B's was queued, not counted.
        req("A", sent=3.5, upstream_received=4.002, upstream_finished=5.0),
        req("B", sent=4.0, upstream_received=5.0, upstream_finished=5.1),
    ]
    assert stats.dispatched_while_waiting(requests, "B", "A") == 1
    assert stats.dispatched_while_waiting(requests, "A", "B") == 0
    # B's first could have had the slot freed at 1.0 (0.5 after its send); its second waited
    # for nothing.
    assert stats.least_waits(requests, "B") == pytest.approx([0.5, 0.0, 1.0])
    figures = stats.key_figures(requests, "B", "A")
    assert figures.passed_by == 1
    assert figures.wait_p50_s == pytest.approx(1.0)
    assert figures.least_wait_p50_s == pytest.approx(0.5)


def test_a_keys_running_time_is_the_median_from_arrival_to_last_byte() -> None:
    requests = [
        req("A", upstream_received=0.0, upstream_finished=1.0),
        req("A", upstream_received=0.0, upstream_finished=3.0),
        req("A", upstream_received=0.0, upstream_finished=None),  # cancelled
        req("B", upstream_received=0.0, upstream_finished=9.0),
    ]
    assert stats.running_seconds(requests, "A") == pytest.approx(2.0)
    assert stats.running_seconds(requests, "C") is None


# --------------------------------------------------------------------------- checks


def test_the_ttft_target_is_one_and_a_half_slot_turns_over_the_baseline() -> None:
    check = stats.TtftCheck("B", flood_p99_s=0.35, baseline_p99_s=0.06, a_duration_s=0.8, slots=4)
    assert check.limit_s == pytest.approx(1.5 * 0.8 / 4 + 0.06)
    assert check.passed
    assert not stats.TtftCheck("B", 0.37, 0.06, 0.8, 4).passed
    assert stats.TtftCheck("B", 0.36, 0.06, 0.8, 4).passed  # at the limit exactly
    for missing in (
        stats.TtftCheck("B", None, 0.06, 0.8, 4),
        stats.TtftCheck("B", 0.1, None, 0.8, 4),
        stats.TtftCheck("B", 0.1, 0.06, None, 4),
    ):
        assert not missing.passed  # a figure that could not be measured passes nothing


def test_fair_may_cost_five_percent_more_cpu_per_event() -> None:
    assert stats.cpu_ratio(105.0, 100.0) == pytest.approx(1.05)
    assert stats.cpu_passed(stats.cpu_ratio(105.0, 100.0))
    assert not stats.cpu_passed(stats.cpu_ratio(105.1, 100.0))
    assert stats.cpu_ratio(None, 100.0) is None and stats.cpu_ratio(1.0, 0.0) is None
    assert not stats.cpu_passed(None)


def _deadlined(**fields: Any) -> Request:
    return req("B", read_timeout=0.5, sent=10.0, **fields)


def test_deadline_outcomes_late_starts_and_the_close_after_the_deadline() -> None:
    requests = [
        _deadlined(status=200, done=True, upstream_received=10.1, ended_at=10.3),
        _deadlined(status=503, error_code="deadline_unmeetable", ended_at=10.01),
        _deadlined(status=503, error_code="deadline_unmeetable", ended_at=10.5),
        # its deadline passed while it waited: answered, never started
        _deadlined(status=504, error_code="deadline_exceeded", ended_at=10.5),
        # cancelled before its first byte (504), and after its head (in-band)
        _deadlined(status=504, error_code="deadline_exceeded", upstream_received=10.2,
                   upstream_closed=10.503, ended_at=10.504),
        req("C", deadline=1.0, sent=20.0, status=200, error_code="deadline_exceeded",
            upstream_received=20.001, upstream_closed=21.002, ended_at=21.003),
    ]  # fmt: skip
    figures = stats.deadline_figures(requests)
    assert (figures.requests, figures.served, figures.refused) == (6, 1, 2)
    assert figures.refused_at_once == 1
    assert (figures.cancelled, figures.cancelled_in_band) == (2, 1)
    assert figures.other == {}
    assert (figures.reached_upstream, figures.started_late) == (3, 0)
    assert figures.least_margin_s == pytest.approx(0.3)
    assert figures.close_after_deadline_s == pytest.approx([0.002, 0.003])
    assert figures.close_p99_s is not None and figures.close_p99_s < stats.CANCEL_TARGET_S
    # Refused after its wait, but as 504 rather than 503 deadline_unmeetable: a failure.
    assert figures.expired_queued == 1 and not figures.passed
    assert stats.deadline_figures([r for r in requests if stats.outcome(r) != "expired"]).passed


@pytest.mark.parametrize(
    "bad",
    [
        # the upstream got it after its client had stopped waiting
        {"status": 200, "done": True, "upstream_received": 10.6, "ended_at": 11.0},
        # refused with another code
        {"status": 503, "error_code": "queue_timeout", "ended_at": 10.5},
        # cancelled, and the upstream never saw its connection go
        {"status": 504, "error_code": "deadline_exceeded", "upstream_received": 10.1},
        # the upstream saw it go, too late
        {
            "status": 504,
            "error_code": "deadline_exceeded",
            "upstream_received": 10.1,
            "upstream_closed": 10.52,
        },
    ],
)
def test_each_broken_deadline_promise_fails_the_check(bad: dict[str, Any]) -> None:
    assert not stats.deadline_figures([_deadlined(**bad)]).passed


def test_outcome_names_what_became_of_a_request() -> None:
    assert stats.outcome(req("B", error="timeout")) == "timeout"
    assert stats.outcome(req("B", status=200, done=True)) == "served"
    cut = {"status": 504, "error_code": "deadline_exceeded"}
    assert stats.outcome(req("B", **cut, upstream_received=1.0)) == "cancelled"
    assert stats.outcome(req("B", **cut)) == "expired"
    assert stats.outcome(req("B", status=200, done=False)) == "HTTP 200"
    assert stats.outcome(req("B", status=429, error_code="queue_full")) == "HTTP 429 queue_full"


# --------------------------------------------------------------------------- preemption


def test_a_streams_text_is_its_content_deltas_and_its_pauses_are_counted() -> None:
    def chunk(delta: dict[str, Any]) -> bytes:
        event = {"choices": [{"index": 0, "delta": delta}]}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    body = (
        chunk({"role": "assistant", "content": ""})
        + chunk({"content": "The "})
        + b": paused\n\n"
        + b": paused\n\n"
        + chunk({"content": "fox "})
        + chunk({})
        + b'data: {"usage": {"completion_tokens": 2}, "choices": []}\n\n'
        + b"data: [DONE]\n\n"
    )
    assert stats.stream_text(body) == ("The fox ", 2)
    assert stats.stream_text(b"") == ("", 0)
    assert stats.stream_text(b"data: {not json\n\n") == ("", 0)


def test_batch_figures_check_every_stream_whole_and_time_the_batch() -> None:
    whole = {"status": 200, "done": True, "text": "a b "}
    rounds = [
        [
            req("batch", sent=0.0, ended_at=5.0, paused_comments=1, **whole),
            req("batch", sent=0.1, ended_at=6.0, **whole),
        ],
        [
            req("batch", sent=10.0, ended_at=14.0, **whole),
            req("batch", sent=10.0, ended_at=13.0, **whole),
        ],
    ]
    figures = stats.batch_figures(rounds, "a b ")
    assert (figures.streams, figures.whole, figures.paused_seen) == (4, 4, 1)
    assert figures.makespan_s == pytest.approx((6.0 + 4.0) / 2)
    assert figures.mean_s == pytest.approx((5.0 + 5.9 + 4.0 + 3.0) / 4)
    assert figures.passed
    # A stream cut short, or whose text differs from the uninterrupted answer, fails it.
    rounds[1][0].text = "a "
    assert stats.batch_figures(rounds, "a b ").whole == 3
    assert not stats.batch_figures(rounds, "a b ").passed
    assert not stats.batch_figures([], "a b ").passed
    assert stats.makespan([]) is None


def test_the_preemption_target_is_preempt_after_plus_twice_the_idle_p99() -> None:
    check = stats.PreemptCheck(p99_s=0.6, idle_p99_s=0.06, preempt_after=0.5)
    assert check.limit_s == pytest.approx(0.62)
    assert check.passed
    assert not stats.PreemptCheck(0.63, 0.06, 0.5).passed
    assert not stats.PreemptCheck(None, 0.06, 0.5).passed
    assert not stats.PreemptCheck(0.1, None, 0.5).passed
    assert stats.PreemptCheck(0.1, None, 0.5).limit_s is None


def test_within_one_band_the_same_target_names_its_key() -> None:
    check = stats.PreemptCheck(p99_s=0.61, idle_p99_s=0.055, preempt_after=0.5, key="B")
    assert check.key == "B" and check.limit_s == pytest.approx(0.61)
    assert check.passed
    assert not stats.PreemptCheck(0.611, 0.055, 0.5, "B").passed


def test_fair_with_preemption_keeps_at_least_095_of_fifos_throughput() -> None:
    assert stats.ThroughputCheck(fair=950.0, fifo=1000.0).ratio == pytest.approx(0.95)
    assert stats.ThroughputCheck(950.0, 1000.0).passed  # at the floor exactly
    assert not stats.ThroughputCheck(949.0, 1000.0).passed
    assert stats.ThroughputCheck(1100.0, 1000.0).passed
    for missing in (
        stats.ThroughputCheck(None, 1000.0),
        stats.ThroughputCheck(1000.0, None),
        stats.ThroughputCheck(1000.0, 0.0),
    ):
        assert missing.ratio is None and not missing.passed


def test_readers_of_the_pauses_sluice_counted_and_logged() -> None:
    metrics = (
        'sluice_preemptions_total{band="5",model="m"} 3.0\n'
        'sluice_preemptions_created{band="5",model="m"} 1.7e9\n'
        'sluice_pause_seconds_count{band="5",model="m"} 2.0\n'
        'sluice_pause_seconds_sum{band="5",model="m"} 0.25\n'
        'sluice_pause_seconds_bucket{band="5",le="0.1",model="m"} 1.0\n'
    )
    assert run.pause_metrics(metrics) == {
        "preemptions_total": 3.0,
        "pause_seconds_count": 2.0,
        "pause_seconds_sum": 0.25,
    }
    assert set(run.pause_metrics("").values()) == {0.0}
    log = "\n".join(
        [
            "INFO starting",
            json.dumps({"key": "batch", "pauses": 2, "paused_s": 0.5}),
            json.dumps({"key": "urgent", "pauses": 0, "paused_s": 0.0}),
            "{not json",
            json.dumps({"key": "batch", "pauses": 0, "paused_s": 0.0}),
        ]
    )
    assert run.access_pauses(log, "batch") == [(2, 0.5), (0, 0.0)]


def test_the_preemption_plans_hold_every_slot_then_send_the_interactive_requests() -> None:
    settings = FairnessSettings(
        slots=3, batch_seconds=4.0, batch_tokens=200, urgent_rate=2.0, short_tokens=5
    )
    assert settings.batch_interval == pytest.approx(0.02)
    assert settings.urgent_requests == 5  # (4 - 0.5 - 1) s at 2/s
    plan = load.preempt_plan(settings, "p")
    batch = [r for r in plan if r.kind == "batch"]
    urgent = [r for r in plan if r.kind == "urgent"]
    assert len(batch) == 3 and all(r.keep_text and r.at == 0.0 for r in batch)
    assert {(r.key, r.tokens, r.interval) for r in batch} == {("batch", 200, 0.02)}
    assert [r.at for r in urgent] == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.5])
    # Each arrives while the batch holds the slots, whether or not it is paused.
    assert all(URGENT_LEAD <= r.at < settings.batch_seconds - 1.0 for r in urgent)
    assert {(r.key, r.tokens, r.keep_text) for r in urgent} == {("urgent", 5, False)}
    idle = load.idle_plan(settings, "p")
    assert [r.at for r in idle] == pytest.approx([i * IDLE_SPACING for i in range(5)])
    assert {r.kind for r in idle} == {"idle"}
    assert len({r.tag for r in [*plan, *idle]}) == len(plan) + len(idle)
    for bad in ({"batch_seconds": 1.5}, {"max_preemptions": 0}, {"preempt_after": 0.0}):
        with pytest.raises(BenchError):
            FairnessSettings(**bad)


def test_the_preemption_processes_differ_only_in_preempt_after(tmp_path: Path) -> None:
    settings = FairnessSettings(slots=3, preempt_after=0.4, max_preemptions=3)
    configs = {}
    for variant in ("preempt-off", "preempt-on"):
        path = tmp_path / f"{variant}.toml"
        text = run.proxy_config(8081, "http://127.0.0.1:9", variant, settings)
        path.write_text(text)
        configs[variant] = load_config(path)
        assert configs[variant].scheduling.policy == "fair"
        assert configs[variant].scheduling.max_preemptions == 3
        assert configs[variant].upstream.max_connections == 3
        assert {k.name: k.priority for k in configs[variant].keys} == {"urgent": 0, "batch": 5}
    assert configs["preempt-off"].scheduling.preempt_after == 0.0
    assert configs["preempt-on"].scheduling.preempt_after == 0.4
    off = run.proxy_config(1, "http://x", "preempt-off", settings)
    on = run.proxy_config(1, "http://x", "preempt-on", settings)
    assert [a for a, b in zip(off.splitlines(), on.splitlines(), strict=True) if a != b] == [
        "preempt_after = 0.0"
    ]


def test_a_paused_request_counts_every_record_the_fake_has_of_it() -> None:
    request = req("batch", tag="b1")
    records = [
        {"id": 0, "body": {"user": "b1"}, "received_at_mono": 1.0, "outcome": "completed"},
        {"id": 1, "body": {"user": "b1"}, "received_at_mono": 3.0, "outcome": "completed"},
    ]
    for _ in range(2):  # read again while others are pending: counted once each
        assert run.match_records([request], records) == 0
    assert request.upstream_records == 2
    assert request.upstream_received == 3.0


# --------------------------------------------------------------------------- plans, configs


def test_settings_are_checked_and_keyed() -> None:
    for bad in ({"slots": 0}, {"rate": 0.0}, {"interval": -1.0}, {"flood_seconds": float("inf")}):
        with pytest.raises(BenchError):
            FairnessSettings(**bad)
    d = FairnessSettings()
    assert d.flood_rate == 8.0
    assert d.offered_load > 1  # the default load saturates the slots
    assert d.key().startswith("bench=fairness slots=4 ")
    assert FairnessSettings(repeat=1).key() != d.key()
    # A fair process that preempts is another bench: its own section.
    assert d.fair_preempt_after is None and "preempt" not in d.key()
    within = FairnessSettings(fair_preempt_after=0.5).key()
    assert within == d.key() + " fair_preempt_after=0.5"
    for bad_after in (0.0, -1.0, float("inf")):
        with pytest.raises(BenchError):
            FairnessSettings(fair_preempt_after=bad_after)


def test_the_flood_is_eight_times_b_and_c_who_alternate() -> None:
    settings = FairnessSettings(rate=2.0, flood_seconds=3.0)
    plan = load.flood_plan(settings, "x")
    count = {key: sum(r.key == key for r in plan) for key in "ABC"}
    assert count == {"A": 48, "B": 6, "C": 6}
    assert [r.at for r in plan] == sorted(r.at for r in plan)
    b = [r.at for r in plan if r.key == "B"]
    c = [r.at for r in plan if r.key == "C"]
    assert b[:2] == [0.0, 0.5] and c[:2] == [0.25, 0.75]
    assert {r.tokens for r in plan if r.key == "A"} == {settings.flood_tokens}
    assert len({r.tag for r in plan}) == len(plan)
    assert {r.key for r in load.baseline_plan(settings, "y")} == {"B", "C"}


def test_deadline_plans_queue_behind_a_backlog_then_run_in_waves() -> None:
    settings = FairnessSettings(slots=3, deadline_requests=7, running_requests=7)
    queued = load.queued_deadline_plan(settings, "q")
    assert sum(r.key == "A" and r.read_timeout is None for r in queued) == 9
    timed = [r for r in queued if r.read_timeout is not None]
    assert len(timed) == 7 and {r.key for r in timed} == {"B"}
    waves = load.running_deadline_waves(settings, "w")
    assert [len(w) for w in waves] == [3, 3, 1]
    every = [r for w in waves for r in w]
    first_byte = [r for r in every if r.read_timeout is not None]
    assert all(r.ttft > r.read_timeout for r in first_byte if r.read_timeout is not None)
    mid_stream = [r for r in every if r.deadline is not None]
    assert all(r.tokens * r.interval > r.deadline for r in mid_stream if r.deadline is not None)


def test_a_request_carries_its_key_and_its_deadlines_in_headers() -> None:
    settings = FairnessSettings()
    request = Request("B", "t", "tag-1", 0.0, 5, 0.05, 0.01, read_timeout=0.25, deadline=2.0)
    data = load.request_bytes(settings, request, ("127.0.0.1", 8080))
    head, body = data.split(b"\r\n\r\n", 1)
    assert b"\r\nAuthorization: Bearer sk-fairness-b" in head
    assert b"\r\nx-stainless-read-timeout: 0.25" in head
    assert b"\r\nx-sluice-deadline: 2" in head
    sent = json.loads(body)
    assert sent["user"] == "tag-1" and sent["fake"] == {"ttft": 0.05, "interval": 0.01, "tokens": 5}
    assert request.input_tokens > 0


def test_the_proxies_config_loads_with_the_slots_the_keys_and_the_policy(tmp_path: Path) -> None:
    settings = FairnessSettings(slots=3)
    for policy in ("fifo", "fair"):
        path = tmp_path / f"{policy}.toml"
        path.write_text(run.proxy_config(8081, "http://127.0.0.1:9", policy, settings))
        config = load_config(path)
        assert config.scheduling.policy == policy
        assert config.upstream.max_connections == 3
        assert [k.name for k in config.keys] == ["A", "B", "C"]
        assert all(k.weight == 1.0 for k in config.keys)
    assert "--max-running" in run.fake_argv(9, settings)


def test_only_the_fair_process_preempts_and_only_with_fair_preempt_after(tmp_path: Path) -> None:
    settings = FairnessSettings(slots=3, fair_preempt_after=0.5, max_preemptions=2)
    configs = {}
    for policy in ("fifo", "fair"):
        path = tmp_path / f"{policy}.toml"
        path.write_text(run.proxy_config(8081, "http://127.0.0.1:9", policy, settings))
        configs[policy] = load_config(path).scheduling
        assert {k.priority for k in load_config(path).keys} == {0}  # one band
    assert configs["fifo"].preempt_after == 0.0
    fair = configs["fair"]
    # preempt_after alone: everything else Sluice's default, not the preemption phase's.
    assert fair.policy == "fair" and fair.preempt_after == 0.5
    assert fair.max_preemptions == SchedulingSettings().max_preemptions
    assert fair.preempt_within_band
    plain = run.proxy_config(1, "http://x", "fair", FairnessSettings(slots=3))
    within = run.proxy_config(1, "http://x", "fair", settings)
    assert set(within.splitlines()) - set(plain.splitlines()) == {"preempt_after = 0.5"}
    assert run.proxy_config(1, "http://x", "fifo", settings) == run.proxy_config(
        1, "http://x", "fifo", FairnessSettings(slots=3)
    )


def test_phases_alternate_and_reverse_each_round() -> None:
    assert run.schedule(2) == [
        (0, "baseline", "fifo"), (0, "baseline", "fair"),
        (0, "flood", "fifo"), (0, "flood", "fair"),
        (0, "deadline", "fifo"), (0, "deadline", "fair"),
        (0, "preempt", "preempt-off"), (0, "preempt", "preempt-on"),
        (1, "baseline", "fair"), (1, "baseline", "fifo"),
        (1, "flood", "fair"), (1, "flood", "fifo"),
        (1, "deadline", "fair"), (1, "deadline", "fifo"),
        (1, "preempt", "preempt-on"), (1, "preempt", "preempt-off"),
    ]  # fmt: skip


def test_readers_of_what_the_fake_and_the_proxy_say() -> None:
    busy = (
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        'vllm:num_requests_waiting{model_name="m"} 0.0\n'
    )
    idle = busy.replace('running{model_name="m"} 1.0', 'running{model_name="m"} 0.0')
    assert not run.fake_idle(busy) and run.fake_idle(idle) and not run.fake_idle("")
    metrics = (
        'sluice_queue_wait_seconds_count{band="0",key="A",model="m",outcome="admitted"} 3.0\n'
        'sluice_queue_wait_seconds_count{band="0",key="B",model="m",outcome="admitted"} 2.0\n'
        'sluice_queue_wait_seconds_count{band="0",key="B",model="m",outcome="deadline"} 1.0\n'
    )
    assert run.queue_outcomes(metrics) == {"admitted": 5.0, "deadline": 1.0}
    assert load.error_code(b'{"error": {"code": "deadline_unmeetable"}}') == "deadline_unmeetable"
    assert load.error_code(b"data: [DONE]") is None
    requests = [req("A", tag="t1"), req("B", tag="t2")]
    records = [
        {"id": 0, "body": {"user": "t1"}, "received_at_mono": 1.0, "outcome": "completed"},
        {"id": 1, "body": {"user": "t2"}, "received_at_mono": 2.0, "outcome": "pending"},
        {"id": 2, "body": None, "outcome": "completed"},
    ]
    assert run.match_records(requests, records) == 1
    assert [r.upstream_received for r in requests] == [1.0, 2.0]


def test_the_bound_is_vtc_bound_of_the_loads_longest_input_and_a_full_batch() -> None:
    bound = report.Bound(w_in=1.0, w_out=2.0, longest_input=20, batch_tokens=1200)
    assert bound.value == vtc_bound(1.0, 20, 2.0, 1200) == 4800


def _served_phase(name: str, policy: str, round_: int, ttfts: dict[str, float]) -> run.Phase:
    """A phase whose every request, one per key in ``ttfts``, was served: sent at 0, its
    first token after its TTFT, 100 tokens, ended at 10 s."""
    requests = [
        req(key, tag=f"{name}-{policy}-{round_}-{key}", sent=0.0, first_token=ttft, ended_at=10.0,
            status=200, done=True, tokens_seen=100, upstream_received=0.0, upstream_records=1)
        for key, ttft in ttfts.items()
    ]  # fmt: skip
    return run.Phase(name, policy, round_, requests)


def test_the_one_band_figures_per_system_and_their_checks() -> None:
    settings = FairnessSettings(fair_preempt_after=0.5, repeat=1)
    idle = {"B": 0.05, "C": 0.06}
    fair_flood = _served_phase("flood", "fair", 0, {"A": 2.0, "B": 0.55, "C": 0.7})
    fair_flood.requests[0].upstream_records = 3  # A's stream paused twice
    fair_flood.pause_metrics = {"preemptions_total": 2.0}
    fair_flood.requests[0].ended_at = 10.4  # 300 tokens over 10.4 s against 10 s
    phases = [
        _served_phase("baseline", "fifo", 0, idle),
        _served_phase("baseline", "fair", 0, idle),
        _served_phase("flood", "fifo", 0, {"A": 2.0, "B": 3.0, "C": 3.1}),
        fair_flood,
    ]
    result = report.make_report(run.FairnessRun(settings, phases))
    fifo, fair = result.policies["fifo"], result.policies["fair"]
    assert result.within_band
    # The same bound for both systems, each with its own idle p99.
    assert [c.key for c in fair.band_checks] == ["B", "C"]
    assert [c.limit_s for c in fair.band_checks] == pytest.approx([0.6, 0.62])
    assert [c.passed for c in fair.band_checks] == [True, False]
    assert [c.passed for c in fifo.band_checks] == [False, False]
    assert (fair.pauses, fair.continuations, fifo.pauses, fifo.continuations) == (2, 2, 0, 0)
    assert result.throughput_check.ratio == pytest.approx(10.0 / 10.4)
    assert result.throughput_check.passed
    assert result.throughput_rounds() == pytest.approx([10.0 / 10.4])
    lines = report.check_lines(result)
    assert any(
        line.startswith("One band, fair, preempt_after 0.5 s, key B: TTFT p99 550 ms")
        and "= 600 ms: **pass** (FIFO: 3000 ms)" in line
        for line in lines
    ), lines
    assert any("key C" in line and "**FAIL**" in line for line in lines if "One band" in line)
    assert any(line.startswith("Throughput under the flood") and "0.962" in line for line in lines)
    text = report.markdown(result)
    assert "FIFO vs fair with preemption within one band (preempt_after 0.5 s), 4 slots" in text
    assert "| one band (every key in band 0) | FIFO | fair, preempt_after 0.5 s |" in text
    assert "| B: bound, preempt_after + 2 x idle p99 (ms); p99 within it | 600; **over** |" in text
    assert "`preempt_after = 0.5`" in text
    saved = result.to_json()
    assert saved["within_band"]["throughput_passed"] is True
    assert [c["passed"] for c in saved["policies"]["fair"]["band_checks"]] == [True, False]
    # Without --fair-preempt-after: none of it.
    plain = report.make_report(run.FairnessRun(FairnessSettings(repeat=1), phases))
    assert not plain.within_band and plain.policies["fair"].band_checks == []
    assert plain.to_json()["within_band"] is None
    assert not any("One band" in line for line in report.check_lines(plain))
    assert "one band" not in report.markdown(plain)


def test_the_main_bench_hands_fairness_to_its_own_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(fairness_cli, "run_stoppable", lambda fn, args, command: seen.append(args))
    bench_cli.main(["--fairness", "--slots", "2", "--quiet"], prog="sluice bench")
    assert seen[0].slots == 2 and seen[0].quiet
    assert fairness_cli.wants_fairness(["--x", "--fairness"])
    assert not fairness_cli.wants_fairness(["--streams", "5"])


# --------------------------------------------------------------------------- end to end


def alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


TINY = [
    "--fairness", "--slots", "2", "--rate", "4", "--flood-seconds", "1",
    "--baseline-seconds", "0.5", "--flood-tokens", "30", "--short-tokens", "4",
    "--interval", "0.005", "--ttft", "0.02", "--deadline-requests", "6",
    "--running-requests", "2", "--repeat", "1", "--timeout", "30", "--quiet",
    "--batch-seconds", "2.5", "--batch-tokens", "100", "--urgent-rate", "2",
    "--preempt-after", "0.3", "--fair-preempt-after", "0.1",
]  # fmt: skip


async def test_a_tiny_fairness_run_against_real_subprocesses(tmp_path: Path) -> None:
    markdown = tmp_path / "benchmarks.md"
    argv = [*TINY, "--markdown", str(markdown), "--json", str(tmp_path / "fair.json")]
    parser = fairness_cli.argparse.ArgumentParser()
    fairness_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    with trio.fail_after(90):
        result = await fairness_cli.run_from_args(args, "test")
    fifo, fair = result.policies["fifo"], result.policies["fair"]
    for figures in (fifo, fair):
        assert figures.errors == {}
        assert {k: f.ok for k, f in figures.flood.items()} == {"A": 32, "B": 4, "C": 4}
        assert figures.cpu_us_per_event is not None and figures.cpu_us_per_event > 0
        assert figures.throughput is not None and figures.throughput > 0
        deadline = figures.deadline
        assert deadline.requests == 8
        ends = deadline.served + deadline.refused + deadline.cancelled + deadline.expired_queued
        assert ends == 8 and deadline.other == {}
        assert deadline.started_late == 0 and deadline.close_unseen == 0
        assert deadline.cancelled >= 2 and deadline.cancelled_in_band >= 1
    # The running ones, each cancelled at its deadline, and seen to go upstream.
    running = [
        r for p in result.run.phases for r in p.requests if r.kind in ("first-byte", "mid-stream")
    ]
    assert len(running) == 4
    assert {stats.outcome(r) for r in running} == {"cancelled"}
    assert all(r.upstream_closed is not None for r in running)
    # The flood held B and C back under FIFO only.
    for key in ("B", "C"):
        fifo_p99, fair_p99 = fifo.flood[key].ttft_p99_s, fair.flood[key].ttft_p99_s
        assert fifo_p99 is not None and fair_p99 is not None and fair_p99 < fifo_p99
    assert result.bound.value == vtc_bound(1.0, result.bound.longest_input, 2.0, 2 * 30)
    # Within the one band: only the fair process paused A's streams (B and C wait longer than
    # its preempt_after for a slot), each pause continued once upstream; both systems have
    # the figures the criterion reads.
    assert result.within_band
    assert fifo.pauses == fifo.continuations == 0
    assert fair.pauses >= 1 and fair.continuations == fair.pauses
    for figures in (fifo, fair):
        assert [c.key for c in figures.band_checks] == ["B", "C"]
        assert all(c.limit_s is not None and c.p99_s is not None for c in figures.band_checks)
    assert result.throughput_check.ratio is not None
    # Preemption: the interactive requests got a slot preempt_after in, the batch kept
    # every slot from them without it, and every batch stream ended with its whole text.
    off, on = result.preemption["preempt-off"], result.preemption["preempt-on"]
    for variant in (off, on):
        assert variant.errors == {}
        assert (variant.urgent.ok, variant.idle.ok) == (2, 2)
        assert variant.batch.streams == 2 and variant.batch.passed
    assert result.preempt_check is not None and result.preempt_check.passed, result.preempt_check
    assert on.preemptions >= 2 and on.continuations == on.preemptions == on.access_pauses
    assert on.pauses_resumed == on.preemptions and on.batch.paused_seen >= 1
    assert result.pauses_passed
    on_p99, off_p99 = on.urgent.ttft_p99_s, off.urgent.ttft_p99_s
    assert on_p99 is not None and off_p99 is not None and off_p99 > 2 * on_p99
    paused = [r for p in result.run.phases for r in p.requests if r.paused_comments]
    assert all(r.text == "".join(token_text(i) for i in range(100)) for r in paused)
    for pid in result.run.pids.values():
        assert not alive(pid), "a child outlived the bench"
    text = markdown.read_text()
    assert "<!-- bench:begin bench=fairness slots=2 " in text
    assert " fair_preempt_after=0.1 -->" in text
    assert "## Fair share under a flood: FIFO vs fair with preemption within one band" in text
    assert "One band, fair, preempt_after 0.1 s, key B" in text
    assert "Throughput under the flood, fair, preempt_after 0.1 s / FIFO" in text
    assert "TTFT target, fair, key B" in text and "VTC bound, fair, A vs B" in text
    assert "| preemption (fair) | off | on |" in text
    assert "Preemption, interactive TTFT p99" in text
    saved = json.loads((tmp_path / "fair.json").read_text())
    assert set(saved["policies"]) == {"fifo", "fair"}
    assert set(saved["preemption"]) == {"preempt-off", "preempt-on"}
    assert saved["preempt_check"]["passed"] is True
    assert saved["within_band"]["preempt_after"] == 0.1


def test_make_bench_runs_the_fairness_bench_into_the_benchmarks_doc() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "-m proxy.bench --fairness --markdown docs/benchmarks.md" in recipe


def test_make_bench_runs_the_one_band_preemption_comparison() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    words = " ".join(recipe.replace("\\\n", " ").split())
    assert (
        "-m proxy.bench --fairness --flood-tokens 800 --flood-factor 3 "
        "--fair-preempt-after 0.5 --markdown docs/benchmarks.md"
    ) in words


def test_make_bench_runs_the_long_fairness_bench_for_ten_minutes() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert "-m proxy.bench --fairness --long 10 --markdown docs/benchmarks.md" in recipe


# --------------------------------------------------------------------------- the long run


def test_buckets_are_minutes_from_the_start_the_last_one_shorter_when_it_must_be() -> None:
    assert minutes.bucket_edges(180.0, 60.0) == [0.0, 60.0, 120.0, 180.0]
    assert minutes.bucket_edges(150.0, 60.0) == [0.0, 60.0, 120.0, 150.0]
    # 0.1 minute in floating point is a hair over 6 s: no bucket of that hair.
    assert minutes.bucket_edges(0.1 * 60, 2.0) == [0.0, 2.0, 4.0, 0.1 * 60]
    assert minutes.bucket_edges(30.0, 60.0) == [0.0, 30.0]
    with pytest.raises(ValueError):
        minutes.bucket_edges(0.0, 60.0)
    edges = [0.0, 60.0, 120.0, 150.0]
    assert [minutes.bucket_of(t, edges) for t in (0.0, 59.9, 60.0, 149.9)] == [0, 0, 1, 2]
    assert minutes.bucket_of(-0.1, edges) is None and minutes.bucket_of(150.0, edges) is None


def _served(key: str, sent: float, ttft: float, ended: float, **fields: Any) -> Request:
    return req(
        key,
        sent=sent,
        first_token=sent + ttft,
        ended_at=ended,
        status=200,
        done=True,
        tokens_seen=10,
        **fields,
    )


def test_each_request_counts_in_the_bucket_it_was_sent_in_and_the_one_it_ended_in() -> None:
    origin = 1000.0
    requests = [
        # B's first: sent in bucket 0, ended in bucket 1.
        _served("B", 1009.0, 0.5, 1011.0, upstream_received=1009.4),
        _served("B", 1001.0, 0.1, 1001.2, upstream_received=1001.05),
        _served("B", 1015.0, 0.2, 1015.3),
        # A's, ended after the load's end: in no bucket's throughput.
        _served("A", 1019.0, 0.3, 1021.0),
        # C's, refused: in its bucket's sent, not its served or completed.
        req("C", sent=1002.0, ended_at=1002.01, status=503, error_code="queue_full"),
    ]
    samples = [
        minutes.Sample(0, 1000.0, cpu_s=5.0, rss_bytes=100, preemptions=0.0, loadavg_1m=1.0),
        minutes.Sample(1, 1010.5, cpu_s=6.0, rss_bytes=200, preemptions=2.0, loadavg_1m=1.5),
        minutes.Sample(2, 1020.0, cpu_s=None, rss_bytes=300, preemptions=3.0, loadavg_1m=2.0),
    ]
    edges = [0.0, 10.0, 20.0]
    first, second = minutes.buckets(
        requests, samples, origin=origin, edges=edges, keys=("A", "B", "C")
    )
    assert (first.keys["B"].sent, first.keys["B"].served) == (2, 2)
    assert first.keys["B"].ttft_p50_s == pytest.approx(0.3)
    assert first.keys["B"].ttft_p99_s == pytest.approx(0.496)
    assert first.keys["B"].wait_p99_s == pytest.approx(0.05 + 0.35 * 0.99)
    assert (first.keys["C"].sent, first.keys["C"].served, first.keys["C"].ttft_p99_s) == (
        1,
        0,
        None,
    )
    assert first.keys["A"] == minutes.KeyBucket(0, 0, None, None, None)
    assert first.completed == {"A": 0, "B": 1, "C": 0}
    assert second.completed == {"A": 0, "B": 2, "C": 0}
    assert (second.keys["A"].sent, second.keys["B"].sent) == (1, 1)
    assert (first.tokens, second.tokens, second.tokens_per_s) == (10, 20, 2.0)
    # What the samples at its two edges say.
    assert (first.cpu_s, first.sampled_s, first.preemptions) == (1.0, 10.5, 2.0)
    assert first.cpu_share == pytest.approx(1.0 / 10.5)
    assert first.cpu_ms_per_request == pytest.approx(1000.0)
    assert (first.rss_bytes, first.loadavg_1m) == (200, 1.5)
    assert second.cpu_s is None and second.cpu_share is None  # unread at its end
    assert second.preemptions == 1.0
    assert minutes.ended_after(requests, origin, 20.0) == 1
    assert minutes.not_served(requests) == {"C": {"HTTP 503 queue_full": 1}}
    # A sample missing at an edge leaves its buckets' differences unknown, nothing else.
    alone = minutes.buckets(requests, samples[1:], origin=origin, edges=edges, keys=("B",))
    assert alone[0].cpu_s is None and alone[0].rss_bytes == 200


def test_flat_means_the_last_buckets_p99_within_one_and_a_half_times_the_firsts() -> None:
    check = minutes.FlatCheck("B", first_p99_s=0.4, last_p99_s=0.6)
    assert check.ratio == pytest.approx(1.5) and check.passed  # at the limit exactly
    assert not minutes.FlatCheck("B", 0.4, 0.61).passed
    assert minutes.FlatCheck("B", 0.4, 0.1).passed  # faster at the end is flat enough
    for unmeasured in (minutes.FlatCheck("B", None, 0.1), minutes.FlatCheck("B", 0.1, None)):
        assert unmeasured.ratio is None and not unmeasured.passed
    assert minutes.FlatCheck("B", 0.0, 0.0).ratio is None

    def bucket(index: int, p99: float | None) -> minutes.Bucket:
        key = minutes.KeyBucket(1, 1, p99, p99, None)
        return minutes.Bucket(index, index * 60.0, index * 60.0 + 60, {"B": key}, {}, 0)

    figures = [bucket(0, 0.5), bucket(1, 5.0), bucket(2, 0.7)]
    # Only the first and the last are compared: a bad minute between is in the table.
    assert minutes.flat_checks(figures, ["B"]) == [minutes.FlatCheck("B", 0.5, 0.7)]
    assert minutes.flat_checks(figures[:1], ["B"]) == [minutes.FlatCheck("B", None, None)]


def test_the_long_figures_pass_only_flat_and_with_every_request_served() -> None:
    requests = [_served(key, 1.0 + 10 * i, 0.1, 1.5 + 10 * i) for key in "BC" for i in range(3)]
    kwargs: dict[str, Any] = {"origin": 0.0, "edges": [0.0, 10.0, 20.0, 30.0]}
    figures = minutes.long_figures(requests, [], keys="ABC", interactive="BC", **kwargs)
    assert [c.ratio for c in figures.checks] == pytest.approx([1.0, 1.0])
    assert figures.passed and figures.drained == 0
    requests.append(req("A", sent=25.0, error="timeout"))
    figures = minutes.long_figures(requests, [], keys="ABC", interactive="BC", **kwargs)
    assert figures.errors == {"A": {"timeout": 1}} and not figures.passed
    assert minutes.loadavg("1.52 1.10 0.90 2/300 1234\n") == 1.52
    assert minutes.loadavg("") is None and minutes.loadavg("x") is None


def test_long_settings_are_checked_and_keyed_apart() -> None:
    settings = FairnessSettings(long_minutes=10)
    assert settings.long_seconds == 600.0 and settings.long_flood_outstanding == 8
    assert settings.key().startswith("bench=fairness-long minutes=10 slots=4 ")
    assert "preempt_after=0.5" in settings.key() and "bucket=" not in settings.key()
    assert FairnessSettings(long_minutes=0.1, bucket_seconds=2).key().endswith(" bucket=2")
    assert FairnessSettings().key() == FairnessSettings(bucket_seconds=2).key()
    assert "for 10 minutes" in settings.describe_long()
    assert FairnessSettings().long_seconds == 0.0
    for bad in (
        {"long_minutes": 1.0},  # one bucket: nothing to compare its first with
        {"long_minutes": 0.0},
        {"long_minutes": float("inf")},
        {"long_minutes": 1.0, "bucket_seconds": 0.0},
    ):
        with pytest.raises(BenchError):
            FairnessSettings(**bad)


def test_the_long_runs_sluice_is_fair_with_preemption_and_the_default_otherwise(
    tmp_path: Path,
) -> None:
    settings = FairnessSettings(long_minutes=10, slots=3, max_preemptions=5)
    path = tmp_path / "long.toml"
    path.write_text(run.proxy_config(8081, "http://127.0.0.1:9", LONG, settings))
    config = load_config(path)
    assert config.scheduling.policy == "fair" and config.scheduling.preempt_after == 0.5
    # The phases' --max-preemptions is not the long run's: Sluice's default.
    assert config.scheduling.max_preemptions == SchedulingSettings().max_preemptions
    assert config.upstream.max_connections == 3
    assert {k.name: k.priority for k in config.keys} == {"A": 5, "B": 5, "C": 0}


def test_the_long_plan_is_b_and_c_for_the_whole_run_and_a_loops_bounded() -> None:
    settings = FairnessSettings(long_minutes=2.5, rate=2.0)
    plan = load.long_interactive_plan(settings, "long")
    assert sum(r.key == "B" for r in plan) == sum(r.key == "C" for r in plan) == 300
    assert max(r.at for r in plan) < settings.long_seconds
    assert len({r.tag for r in plan}) == len(plan)
    # One request per answer's duration (0.8 s), and one more.
    assert load.flood_cap(settings, 150.0) == 189


async def test_a_closed_loop_sends_the_next_as_one_ends_until_its_time_is_up(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    # Answers of exactly 1 s (0.5 s to the first token, 128 tokens of 2**-8 s).
    settings = FairnessSettings(flood_tokens=128, interval=2**-8, ttft=0.5)
    address = ("127.0.0.1", 9)
    starts: list[float] = []

    async def answer(address: Any, data: bytes, request: Request, *, start_at: float) -> None:
        starts.append(trio.current_time())
        await trio.sleep(1.0)
        request.status, request.done, request.arrivals = 200, True, [(0.0, 1)]

    monkeypatch.setattr(load, "send", answer)
    out: list[Request] = []
    t0 = trio.current_time()
    await load.closed_loop(settings, address, "w", start_at=t0, until=t0 + 3.5, out=out)
    assert [s - t0 for s in starts] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert [r.at for r in out] == pytest.approx([0.0, 1.0, 2.0, 3.0])
    assert {r.key for r in out} == {"A"} and all(r.arrivals == [] for r in out)

    # Refused at once: a pause as long as an answer after each, never a spin.
    async def refuse(address: Any, data: bytes, request: Request, *, start_at: float) -> None:
        starts.append(trio.current_time())
        request.status = 429

    monkeypatch.setattr(load, "send", refuse)
    out.clear()
    starts.clear()
    t0 = trio.current_time()
    await load.closed_loop(settings, address, "w", start_at=t0, until=t0 + 3.5, out=out)
    assert [s - t0 for s in starts] == pytest.approx([0.0, 1.0, 2.0, 3.0])

    # Answered faster than the answers planned: the count is bounded too.
    async def instant(address: Any, data: bytes, request: Request, *, start_at: float) -> None:
        request.status, request.done = 200, True

    monkeypatch.setattr(load, "send", instant)
    out.clear()
    t0 = trio.current_time()
    await load.closed_loop(settings, address, "w", start_at=t0, until=t0 + 100, out=out)
    assert len(out) == load.flood_cap(settings, 100.0) == 101


def _long_run(samples: list[minutes.Sample], requests: list[Request]) -> LongRun:
    settings = FairnessSettings(long_minutes=2.5)
    return LongRun(
        settings,
        requests,
        samples,
        origin=0.0,
        edges=minutes.bucket_edges(settings.long_seconds, settings.bucket_seconds),
        machine={"cores": 2, "cpu": "Test CPU", "loadavg_1m": 0.5},
        command="python -m proxy.bench --fairness --long 2.5",
        commit="abc1234",
        date="2026-12-06 00:00 UTC",
        seconds=160.0,
    )


def test_the_long_section_is_a_table_per_minute_and_the_verdicts() -> None:
    requests = [
        _served(key, sent, ttft, sent + 1.0)
        for key, ttft in (("A", 2.0), ("B", 0.2), ("C", 0.1))
        for sent in (10.0, 70.0, 130.0)
    ]
    requests.append(_served("B", 140.0, 0.4, 141.0))  # the last minute's p99 rises
    samples = [
        minutes.Sample(i, at, cpu_s=i * 6.0, rss_bytes=(50 + i) * 2**20, preemptions=i * 2.0)
        for i, at in enumerate((0.0, 60.0, 120.0, 150.0))
    ]
    result = long_report.make_long_report(_long_run(samples, requests))
    text = long_report.long_markdown(result)
    assert text.startswith("## Fair share for 2.5 minutes: TTFT minute by minute, 4 slots")
    assert "- Machine: 2 cores (Test CPU)" in text
    lines = text.splitlines()
    ttft_head = next(line for line in lines if line.startswith("| minute | A (band 5)"))
    assert "B (band 5): TTFT p50 / p99 (ms)" in ttft_head and "C (band 0)" in ttft_head
    assert "| 1 | 2000 / 2000 | 200 / 200 | 100 / 100 | n/a | n/a |" in lines
    assert "| 3 (30 s) | 2000 / 2000 | 300 / 398 | 100 / 100 | n/a | n/a |" in lines
    assert "| 1 | 3 (1 / 1 / 1) | 0 | 2 | 10.0 | 2000.00 | 51.0 | n/a | 1 / 1, 1 / 1 |" in lines
    assert "| 3 (30 s) | 4 (1 / 2 / 1) | 1 | 2 | 20.0 | 1500.00 | 53.0 | n/a | 2 / 2, 1 / 1 |" in (
        lines
    )
    checks = long_report.long_check_lines(result)
    assert checks[0] == (
        "Flat, B (band 5): TTFT p99 in the last minute 398 ms <= 1.5 x 200 ms in the first "
        "(ratio 1.99): **FAIL**"
    )
    assert checks[1].startswith("Flat, C (band 0)") and checks[1].endswith("**pass**")
    assert checks[2] == "Every request served as planned (not served: none): **pass**"
    assert not fairness_cli.all_passed(result)
    saved = json.loads(json.dumps(result.to_json()))
    assert [b["completed_total"] for b in saved["buckets"]] == [3, 3, 4]
    assert saved["checks"][0]["passed"] is False and saved["passed"] is False
    assert saved["settings"]["long_minutes"] == 2.5 and saved["bands"]["C"] == 0


def test_the_long_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = fairness_cli.argparse.ArgumentParser()
    fairness_cli.add_arguments(parser)
    args = parser.parse_args(["--fairness", "--long", "10"])
    settings = fairness_cli.settings_from_args(args)
    assert settings.long_minutes == 10.0 and settings.bucket_seconds == 60.0
    args = parser.parse_args(["--fairness", "--long", "0.1", "--bucket-seconds", "2"])
    assert fairness_cli.settings_from_args(args).bucket_seconds == 2.0
    assert fairness_cli.settings_from_args(parser.parse_args(["--fairness"])).long_minutes is None
    parser.print_help()
    shown = capsys.readouterr().out
    assert "--long MINUTES" in shown and "--bucket-seconds" not in shown  # for tests only


LONG_TINY = [
    "--fairness", "--long", "0.1", "--bucket-seconds", "2", "--slots", "2", "--rate", "4",
    "--flood-tokens", "30", "--short-tokens", "4", "--interval", "0.005", "--ttft", "0.02",
    "--preempt-after", "0.3", "--timeout", "20", "--quiet",
]  # fmt: skip


async def test_a_tiny_long_run_against_real_subprocesses(tmp_path: Path) -> None:
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text("# Benchmarks\n")
    argv = [*LONG_TINY, "--markdown", str(markdown), "--json", str(tmp_path / "long.json")]
    parser = fairness_cli.argparse.ArgumentParser()
    fairness_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    with trio.fail_after(40):
        result = await fairness_cli.run_from_args(args, "test")
    assert isinstance(result, long_report.LongReport)
    figures = result.figures
    assert figures.errors == {}
    # Three buckets of 2 s, each with B's and C's 8 requests (4/s; one sent late may fall in
    # the next), all served, and A's flood throughout (4 outstanding requests of 0.17 s on
    # two slots: several a second).
    assert len(figures.buckets) == 3
    for key in ("B", "C"):
        sent = [bucket.keys[key].sent for bucket in figures.buckets]
        assert sum(sent) == 24 and min(sent) >= 6, (key, sent)  # 8 each, as planned
        assert [bucket.keys[key].served for bucket in figures.buckets] == sent
    for bucket in figures.buckets:
        assert bucket.keys["A"].sent >= 4 and bucket.completed["A"] >= 4
        assert bucket.cpu_share is not None and bucket.cpu_share > 0
        assert bucket.rss_bytes is not None and bucket.preemptions is not None
    assert len(result.run.samples) == 4
    assert [c.key for c in figures.checks] == ["B", "C"]
    assert all(c.ratio is not None for c in figures.checks)
    for pid in result.run.pids.values():
        assert not alive(pid), "a child outlived the bench"
    text = markdown.read_text()
    assert "<!-- bench:begin bench=fairness-long minutes=0.1 slots=2 " in text
    assert "## Fair share for 0.1 minutes: TTFT per bucket of 2 s, 2 slots" in text
    assert "Flat, C (band 0): TTFT p99 in the last bucket of 2 s" in text
    saved = json.loads((tmp_path / "long.json").read_text())
    assert saved["bench"] == "fairness-long" and len(saved["buckets"]) == 3
