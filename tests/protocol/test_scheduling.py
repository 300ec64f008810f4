"""Who goes next (proxy/protocol/scheduling.py), sans-IO: the fair order between keys, the lift
of a key that returns, the bands, the starvation guard, FIFO, and the arithmetic of deadlines.
Times are numbers given to the queue: no clock, no sockets."""

from __future__ import annotations

import math
import random

import pytest

from proxy.protocol.request_priority import LEAST_URGENT_BAND, positive_seconds, request_band
from proxy.protocol.scheduling import (
    FairQueue,
    SchedulingSettings,
    Ticket,
    choose_preemption,
    expected_wait,
    preemption_due,
    vtc_bound,
)
from proxy.protocol.shared_counters import SharedCounters
from tests.protocol.test_scheduling_shared import Store, outgoing

FAIR = SchedulingSettings(policy="fair", w_in=1.0, w_out=2.0, starvation_seconds=60.0)


def ticket(tenant: str, *, band: int = 0, weight: float = 1.0, arrived: float = 0.0) -> Ticket:
    return Ticket(tenant, band, weight, input_tokens=10, arrived=arrived)


def take(queue: FairQueue, now: float = 0.0) -> Ticket:
    chosen = queue.next(now)
    assert chosen is not None
    queue.dispatched(chosen)
    return chosen


def test_the_tenant_served_least_goes_next_and_its_own_requests_in_order() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"a": 100.0, "b": 10.0})
    a1, a2, b1, b2 = ticket("a"), ticket("a"), ticket("b"), ticket("b")
    # b first (a tenant arriving behind another would be lifted to its counter).
    for each in (b1, b2, a1, a2):
        queue.add(each)
    # b has received less: its oldest first; each dispatch charges its input (10 tokens).
    order = [take(queue) for _ in range(4)]
    assert order[:2] == [b1, b2]
    assert order[2:] == [a1, a2]
    assert queue.size == 0


def test_output_as_it_streams_counts_twice_an_input_token_and_weight_divides() -> None:
    queue = FairQueue(FAIR)
    queue.charge("a", 1.0, input_tokens=10, output_tokens=5)
    queue.charge("b", 2.0, input_tokens=10, output_tokens=5)
    assert queue.counters == {"a": 20.0, "b": 10.0}


def test_a_key_that_returns_is_lifted_so_being_idle_is_not_banked() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"busy": 500.0, "idle": 0.0})
    queue.add(ticket("busy"))
    queue.add(ticket("idle"))
    # Lifted to the smallest counter among those waiting in its band: it does not take the
    # next 500 tokens' worth of turns.
    assert queue.counters["idle"] == 500.0
    # A key already ahead keeps its counter.
    queue.counters["ahead"] = 900.0
    queue.add(ticket("ahead"))
    assert queue.counters["ahead"] == 900.0


def test_a_key_lifted_to_a_flooders_counter_takes_the_next_slot() -> None:
    """Lifted to the flooder's counter, the returning key ties with it: the one actually
    served less goes first, not the flooder's older request (which would make an interactive
    key wait for a second slot to free)."""
    queue = FairQueue(FAIR)
    queue.charge("flood", 1.0, input_tokens=500)
    floods = [ticket("flood") for _ in range(3)]
    for each in floods:
        queue.add(each)
    chat = ticket("chat")
    queue.add(chat)
    assert queue.counters["chat"] == queue.counters["flood"]
    assert queue.ahead_of(chat) == 0
    assert take(queue) is chat
    assert [take(queue) for _ in range(3)] == floods


def test_with_nobody_waiting_a_returning_key_is_lifted_to_the_last_dispatched() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"a": 300.0})
    queue.add(ticket("a"))
    take(queue)  # a dispatched: its counter 300 + 10 (input)
    queue.add(ticket("new"))
    assert queue.counters["new"] == 310.0


def test_bands_are_served_strictly_in_order_and_fairly_within() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"batch": 0.0, "chat": 1000.0, "chat2": 2000.0})
    batch = ticket("batch", band=5)
    chat, chat2 = ticket("chat"), ticket("chat2")
    for each in (batch, chat, chat2):
        queue.add(each)
    assert [take(queue) for _ in range(3)] == [chat, chat2, batch]


def test_the_starvation_guard_serves_a_long_waiting_request_before_every_band() -> None:
    queue = FairQueue(FAIR)
    old = ticket("batch", band=9, arrived=0.0)
    queue.add(old)
    urgent = [ticket("chat", arrived=50.0 + i) for i in range(3)]
    for each in urgent:
        queue.add(each)
    assert queue.next(now=59.0) is urgent[0]  # not yet: the band goes first
    assert queue.next(now=60.0) is old  # waited 60 s: before every band


def test_fifo_is_arrival_order_whatever_the_keys_and_bands() -> None:
    queue = FairQueue(SchedulingSettings(policy="fifo"))
    queue.counters.update({"a": 1e9})
    tickets = [ticket("a"), ticket("b", band=3), ticket("a", band=-1), ticket("c")]
    for each in tickets:
        queue.add(each)
    assert [take(queue) for _ in range(4)] == tickets


def test_only_eligible_tickets_are_chosen() -> None:
    """A slot free on one replica goes to the first request that replica can serve."""
    queue = FairQueue(FAIR)
    queue.counters.update({"a": 0.0, "b": 50.0})
    a, b = ticket("a"), ticket("b")
    queue.add(a)
    queue.add(b)
    assert queue.next(0.0, lambda t: t.tenant == "b") is b
    assert queue.next(0.0, lambda t: False) is None


def test_a_removed_ticket_is_no_longer_waiting_and_an_empty_tenant_not_backlogged() -> None:
    queue = FairQueue(FAIR)
    a = ticket("a")
    queue.add(a)
    queue.remove(a)
    queue.remove(a)  # twice: harmless
    assert queue.size == 0 and queue.next(0.0) is None
    assert list(queue.waiting()) == []


def test_ahead_of_counts_more_urgent_bands_smaller_counters_and_older_own() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"low": 0.0, "high": 100.0})
    urgent = ticket("x", band=-1)
    low1, low2 = ticket("low"), ticket("low")
    high1, high2 = ticket("high"), ticket("high")
    for each in (urgent, low1, low2, high1, high2):
        queue.add(each)
    assert queue.ahead_of(urgent) == 0
    assert queue.ahead_of(low2) == 2  # the urgent one, and its own older one
    assert queue.ahead_of(high2) == 1 + 2 + 1
    fifo = FairQueue(SchedulingSettings(policy="fifo"))
    tickets = [ticket("a"), ticket("b"), ticket("c")]
    for each in tickets:
        fifo.add(each)
    assert fifo.ahead_of(tickets[2]) == 2


@pytest.mark.parametrize(
    ("ahead", "free", "slots", "hold", "expected"),
    [
        (0, 1, 4, 2.0, 0.0),  # a slot is free for it
        (3, 4, 4, 2.0, 0.0),
        (0, 0, 4, 2.0, 0.5),  # the next of 4 slots to free, each held 2 s
        (7, 0, 4, 2.0, 4.0),  # 8 dispatches, 4 at a time
        (5, 0, 0, 1.0, 6.0),  # no slot known: one at a time
    ],
)
def test_the_wait_expected_before_a_slot(
    ahead: int, free: int, slots: int, hold: float, expected: float
) -> None:
    assert expected_wait(ahead, free, slots, hold) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("600", 600.0),
        (" 2.5 ", 2.5),
        ("0", None),
        ("-3", None),
        ("NOT_GIVEN", None),
        ("nan", None),
        ("inf", None),
        ("", None),
        (None, None),
    ],
)
def test_deadline_headers_are_positive_finite_seconds_or_nothing(
    value: str | None, seconds: float | None
) -> None:
    assert positive_seconds(value) == seconds


def test_a_request_may_make_itself_less_urgent_never_more() -> None:
    assert request_band(0, None, None) == 0
    assert request_band(0, 5) == 5
    assert request_band(3, 1) == 3  # more urgent than its key: its key's
    assert request_band(0, "7", 2) == 7  # the header's and the body's: the less urgent
    assert request_band(0, "soon", True, 1.5) == 0  # not integers: nothing asked
    assert request_band(0, 10**9) == LEAST_URGENT_BAND
    assert request_band(200, 500) == 200


def test_two_backlogged_tenants_stay_within_the_vtc_bound() -> None:
    """A simulation of one server with a batch of M tokens at a time: two tenants always
    backlogged, requests of random lengths; fair service stays within VTC's bound at every
    moment, where FIFO, with one tenant arriving 8x as often, does not."""
    rng = random.Random(7)
    longest_input, batch_tokens = 200, 64
    bound = vtc_bound(1.0, longest_input, 2.0, batch_tokens)
    for policy, within in (("fair", True), ("fifo", False)):
        queue = FairQueue(SchedulingSettings(policy=policy, starvation_seconds=0))
        served = {"a": 0.0, "b": 0.0}
        worst = 0.0
        for step in range(400):
            # a sends 8 requests for each of b's: both stay backlogged.
            for tenant in ["a"] * 8 + ["b"]:
                queue.add(Ticket(tenant, input_tokens=rng.randint(1, longest_input), arrived=step))
            chosen = queue.next(float(step))
            assert chosen is not None
            queue.dispatched(chosen)
            output = batch_tokens
            queue.charge(chosen.tenant, 1.0, output_tokens=output)
            served[chosen.tenant] += chosen.input_tokens + 2.0 * output
            worst = max(worst, abs(served["a"] - served["b"]))
        assert (worst <= bound) is within, (policy, worst, bound)
    assert math.isfinite(bound)


def test_shared_counters_send_each_keys_service_so_far_and_take_the_stores_totals() -> None:
    queue = FairQueue(FAIR)
    shared = SharedCounters(queue)
    store = Store({"a": 1000.0})  # another instance served a
    queue.charge("b", 1.0, input_tokens=30)
    sync = outgoing(shared)
    assert (sync.sent, sync.answered, sync.floors) == ({"b": 30.0}, {}, {})
    store.take(sync)
    queue.charge("b", 1.0, input_tokens=5)  # meanwhile, here
    shared.incoming(store.totals)
    assert queue.counters == {"a": 1000.0, "b": 35.0}
    assert shared.answered == {"b": 30.0}
    # The next sync sends b's service so far, with what the store answered for.
    assert shared.outgoing() == {"b": 35.0}
    # A sync that never reached the store: the next one carries its service, grown.
    queue.charge("b", 1.0, input_tokens=1)
    assert shared.outgoing() == {"b": 36.0}
    store.take(outgoing(shared))
    assert store.totals == {"a": 1000.0, "b": 36.0}


def simulate_instances(
    demands: list[list[str]], *, period: int | None, steps: int = 600, seed: int = 3
) -> tuple[dict[str, float], float]:
    """Instances in front of one upstream, each dispatching one request a step from its own
    queue; ``demands[i]`` is what arrives at instance i each step; the counters shared every
    ``period`` steps (None: never). The service each key got, and the largest difference
    between a and b at any step."""
    rng = random.Random(seed)
    instances = [FairQueue(SchedulingSettings(starvation_seconds=0)) for _ in demands]
    sharing = [SharedCounters(queue) for queue in instances]
    store = Store()
    served = {"a": 0.0, "b": 0.0}
    worst = 0.0
    for step in range(steps):
        for queue, demand in zip(instances, demands, strict=True):
            for tenant in demand:
                queue.add(Ticket(tenant, input_tokens=rng.randint(1, LONGEST_INPUT)))
            chosen = queue.next(float(step))
            assert chosen is not None
            queue.dispatched(chosen)
            queue.charge(chosen.tenant, 1.0, output_tokens=OUTPUT)
            served[chosen.tenant] += chosen.input_tokens + 2.0 * OUTPUT
        if period is not None and step % period == 0:
            for counters in sharing:
                counters.incoming(store.take(outgoing(counters)))
        worst = max(worst, abs(served["a"] - served["b"]))
    return served, worst


LONGEST_INPUT, OUTPUT = 100, 32


def test_two_instances_sharing_counters_stay_within_the_bound_plus_staleness() -> None:
    """Both keys waiting on both instances (a floods the first, b the second): ordering by the
    shared counters, the two instances together keep a and b within VTC's bound plus the
    staleness, what one instance serves in two share periods (an instance may read the store
    just before the other's sync, then order by it for a period), and one dispatch."""
    period = 5
    per_dispatch = LONGEST_INPUT + 2.0 * OUTPUT
    bound = vtc_bound(1.0, LONGEST_INPUT, 2.0, OUTPUT) + (2 * period + 1) * per_dispatch
    demands = [["a"] * 8 + ["b"], ["b"] * 8 + ["a"]]
    _, worst = simulate_instances(demands, period=period)
    assert worst <= bound, (worst, bound)


def test_a_key_flooding_one_instance_is_behind_on_the_other() -> None:
    """a floods the first instance; the second has both. Without sharing, the second splits
    its service between them as if a had had none, and a gets three times what b gets;
    sharing, the second sees a ahead and serves b: over the run they get the same, within a
    few percent (not a bound: the first instance serves a whatever happens, so a lead a gets
    by chance is made up for only on average)."""
    demands = [["a"] * 8, ["a", "b", "b"]]
    alone, _ = simulate_instances(demands, period=None)
    shared, _ = simulate_instances(demands, period=5)
    assert alone["a"] / alone["b"] > 2.5, alone
    assert abs(shared["a"] / shared["b"] - 1) < 0.05, shared


# -- preemption ---------------------------------------------------------------------------

PREEMPTING = SchedulingSettings(preempt_after=2.0, max_preemptions=2)


def running(tenant: str, band: int, seq: int, preemptions: int = 0) -> Ticket:
    return Ticket(tenant, band, seq=seq, preemptions=preemptions)


def test_preemption_is_due_preempt_after_the_arrival_and_only_when_on() -> None:
    waiting = Ticket("chat", arrived=10.0)
    assert preemption_due(PREEMPTING, waiting) == 12.0
    assert preemption_due(SchedulingSettings(), waiting) is None  # off by default
    fifo = SchedulingSettings(policy="fifo", preempt_after=2.0)
    assert preemption_due(fifo, waiting) is None  # FIFO knows no bands
    # A paused request waits its turn at the head of its band: it never preempts.
    assert preemption_due(PREEMPTING, Ticket("batch", resumed=True)) is None


def test_the_least_urgent_band_is_paused_and_in_it_the_key_served_most() -> None:
    waiting = Ticket("chat", band=0)
    a, b, c = running("a", 5, 1), running("b", 5, 2), running("c", 3, 3)
    counters = {"a": 500.0, "b": 100.0, "c": 900.0}
    assert choose_preemption(PREEMPTING, waiting, [a, b, c], counters) is a
    # On equal counters, the youngest (the least work to redo).
    counters["b"] = 500.0
    assert choose_preemption(PREEMPTING, waiting, [a, b, c], counters) is b


def test_never_within_a_band_nor_a_more_urgent_one_nor_past_max_preemptions() -> None:
    counters: dict[str, float] = {}
    same = running("a", 2, 1)
    assert choose_preemption(PREEMPTING, Ticket("chat", band=2), [same], counters) is None
    assert choose_preemption(PREEMPTING, Ticket("chat", band=3), [same], counters) is None
    worn = running("a", 5, 1, preemptions=2)
    assert choose_preemption(PREEMPTING, Ticket("chat", band=0), [worn], counters) is None
    fresh = running("b", 4, 2, preemptions=1)
    assert choose_preemption(PREEMPTING, Ticket("chat"), [worn, fresh], counters) is fresh


def test_a_paused_request_goes_before_the_rest_of_its_band() -> None:
    queue = FairQueue(FAIR)
    queue.counters.update({"batch": 1000.0, "other": 0.0})
    other = ticket("other", band=5)
    queue.add(other)
    paused = Ticket("batch", band=5, resumed=True, seq=0)
    queue.add(paused)
    urgent = ticket("chat", band=0)
    queue.add(urgent)
    # A more urgent band first; then the paused request, though its key is served most.
    assert [take(queue) for _ in range(3)] == [urgent, paused, other]
    # It kept its place in arrival order (given once).
    assert paused.seq == 0
