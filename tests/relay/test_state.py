"""The relay's lifecycle table (proxy.relay.state): which event moves which side where."""

from __future__ import annotations

import pytest

from proxy.relay.state import (
    CLIENT_TRANSITIONS,
    PRODUCER_TRANSITIONS,
    LifecycleError,
    Phase,
    RelayEvent,
    RelayState,
    step,
)

HEAD_PENDING, SENDING, DONE = RelayState.HEAD_PENDING, RelayState.SENDING, RelayState.DONE
READING, ABANDONED, GONE = RelayState.READING, RelayState.ABANDONED, RelayState.GONE


def test_the_phases_are_the_bench_names_in_order() -> None:
    assert [phase.value for phase in Phase] == [
        "queued",
        "connecting",
        "head",
        "first_token",
        "mid_stream",
        "paused",
        "after_last",
    ]
    assert f"cancelled({Phase.FIRST_TOKEN})" == "cancelled(first_token)"


def test_a_producer_decides_one_head_then_finishes() -> None:
    assert step(HEAD_PENDING, READING, RelayEvent.HEAD) == (SENDING, READING)
    assert step(SENDING, READING, RelayEvent.FINISHED) == (DONE, READING)
    with pytest.raises(LifecycleError, match="already decided"):
        step(SENDING, READING, RelayEvent.HEAD)
    with pytest.raises(LifecycleError):
        step(DONE, READING, RelayEvent.FINISHED)


def test_a_client_that_leaves_while_the_producer_works_is_gone() -> None:
    for producer in (HEAD_PENDING, SENDING):
        assert step(producer, READING, RelayEvent.LEFT) == (producer, GONE)
        # Abandoned by the consumer first: the disconnect still shuts the producer's work down.
        assert step(producer, ABANDONED, RelayEvent.LEFT) == (producer, GONE)
    # The producer may still finish (it was already past its last checkpoint): it stays gone.
    assert step(SENDING, GONE, RelayEvent.FINISHED) == (DONE, GONE)


def test_late_and_repeated_reports_change_nothing() -> None:
    assert step(DONE, READING, RelayEvent.LEFT) == (DONE, READING)
    assert step(SENDING, GONE, RelayEvent.LEFT) == (SENDING, GONE)
    assert step(SENDING, ABANDONED, RelayEvent.ABANDON) == (SENDING, ABANDONED)
    assert step(SENDING, GONE, RelayEvent.ABANDON) == (SENDING, GONE)


def test_every_state_has_its_row() -> None:
    assert set(PRODUCER_TRANSITIONS) == {HEAD_PENDING, SENDING, DONE}
    assert set(CLIENT_TRANSITIONS) == {READING, ABANDONED, GONE}
