"""A replica's capacity learned from its engine's gauges (proxy.protocol.capacity), sans-IO:
an engine simulated step by step, the scrape interval a number, no clock."""

from __future__ import annotations

import pytest

from proxy.protocol.capacity import (
    EDGE_HOLD,
    LEARNED_CEILING,
    START,
    Capacity,
    bounded,
    learn,
    start_capacity,
)

INTERVAL = 2.0


def engine_scrape(capacity: Capacity, slots: int, now: float) -> Capacity:
    """One scrape of an engine that runs ``slots`` at once, saturated by this process alone
    (it has ``limit`` requests in it; the rest wait in Sluice)."""
    sent = capacity.limit
    return learn(
        capacity,
        running=min(sent, slots),
        waiting=max(0, sent - slots),
        in_flight=sent,
        now=now,
    )


def test_it_starts_at_the_lowest_engine_default_within_the_bound() -> None:
    assert start_capacity(LEARNED_CEILING, 0, INTERVAL).limit == START
    assert start_capacity(16, 0, INTERVAL).limit == 16
    assert start_capacity(LEARNED_CEILING, 0, INTERVAL).step == 1
    assert start_capacity(LEARNED_CEILING, 8, INTERVAL).step == 8
    with pytest.raises(ValueError):
        start_capacity(0, 0, INTERVAL)


@pytest.mark.parametrize("slots", [1, 100, 256, 1024])
@pytest.mark.parametrize("allowed_waiting", [0, 16])
def test_a_saturated_engine_is_filled_and_its_queue_stays_within_the_step(
    slots: int, allowed_waiting: int
) -> None:
    capacity = start_capacity(LEARNED_CEILING, allowed_waiting, INTERVAL)
    most_waiting = 0
    for scrape in range(2000):
        if scrape:
            # Before the first scrape, an engine smaller than the start queues the rest, as
            # it did behind a fixed max_connections = 128; after it, one step at most.
            most_waiting = max(most_waiting, capacity.limit - slots)
        capacity = engine_scrape(capacity, slots, scrape * INTERVAL)
    # The limit ends at the engine's size, or one probe past it (the next scrape takes it
    # back); the engine never queued more than one step.
    assert capacity.limit in (slots, slots + capacity.step)
    assert capacity.edge == slots
    assert most_waiting <= max(1, allowed_waiting)


def test_growth_needs_a_scrape_that_proves_the_limit() -> None:
    capacity = start_capacity(LEARNED_CEILING, 16, INTERVAL)
    # This process does not fill it: no reason to grow.
    assert learn(capacity, running=200, waiting=0, in_flight=100, now=10.0) == capacity
    # Its requests are not all running yet (in flight, not in the engine's count).
    assert learn(capacity, running=100, waiting=0, in_flight=START, now=10.0) == capacity
    grown = learn(capacity, running=START, waiting=0, in_flight=START, now=10.0)
    assert grown.limit == START + 16 and grown.changed_at == 10.0
    # A scrape within one interval of the growth proves nothing yet.
    assert learn(grown, running=144, waiting=0, in_flight=144, now=11.0) == grown
    assert learn(grown, running=144, waiting=0, in_flight=144, now=12.0).limit == START + 32


def test_queueing_brings_the_limit_down_to_what_runs_never_up() -> None:
    capacity = start_capacity(LEARNED_CEILING, 0, INTERVAL)
    down = learn(capacity, running=90, waiting=5, in_flight=START, now=3.0)
    assert (down.limit, down.edge, down.queued_at) == (90, 90, 3.0)
    # Other clients fill an engine bigger than the limit: it queues, the limit stays.
    busy = learn(capacity, running=300, waiting=5, in_flight=10, now=3.0)
    assert busy.limit == START and busy.edge == 300
    # A queue with nothing running (an engine starting) says nothing.
    assert learn(capacity, running=0, waiting=5, in_flight=START, now=3.0) == capacity


def test_past_the_edge_it_probes_again_only_after_a_quiet_hold() -> None:
    capacity = start_capacity(LEARNED_CEILING, 4, INTERVAL)
    capacity = learn(capacity, running=100, waiting=3, in_flight=104, now=0.0)
    assert capacity.limit == 100
    full = {"running": 100, "waiting": 0, "in_flight": 100}
    assert learn(capacity, **full, now=EDGE_HOLD * INTERVAL - 1) == capacity
    assert learn(capacity, **full, now=EDGE_HOLD * INTERVAL).limit == 104


def test_the_bound_holds_and_a_reload_keeps_what_was_learned() -> None:
    capacity = start_capacity(130, 8, INTERVAL)
    capacity = learn(capacity, running=START, waiting=0, in_flight=START, now=0.0)
    assert capacity.limit == 130
    assert learn(capacity, running=130, waiting=0, in_flight=130, now=10.0) == capacity
    learned = learn(
        start_capacity(LEARNED_CEILING, 0, INTERVAL),
        running=90,
        waiting=2,
        in_flight=START,
        now=0.0,
    )
    assert bounded(learned, LEARNED_CEILING, 0, INTERVAL).limit == 90
    assert bounded(learned, 50, 0, INTERVAL).limit == 50
    assert bounded(learned, 50, 0, INTERVAL).edge == 90
