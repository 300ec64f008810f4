"""The connection state both servers move (proxy/protocol/connection_state.py), sans-IO: its
count of requests, its head deadline, and when an answer is the connection's last."""

from __future__ import annotations

from math import inf

import pytest

from proxy.protocol.connection_state import ConnectionState


def test_a_new_connection_waits_for_its_first_head_until_the_keep_alive_timeout() -> None:
    state = ConnectionState(keep_alive_timeout=5.0, max_requests=100, now=10.0)
    assert state.head_deadline == 15.0
    assert state.requests == 0
    assert not state.last_answer


def test_a_whole_head_disarms_the_deadline_and_counts() -> None:
    state = ConnectionState(5.0, 100, now=0.0)
    state.request_received(client_keeps_alive=True)
    assert (state.requests, state.head_deadline) == (1, inf)
    assert not state.last_answer
    # Written: it waits for the next head from now on, for the whole timeout.
    state.waiting(now=42.0)
    assert state.head_deadline == 47.0


def test_the_deadline_is_not_restarted_by_anything_but_an_answer() -> None:
    """A head begun on one server and finished on the other keeps the deadline it began with:
    nothing but a written answer moves it (a hand-off does not)."""
    state = ConnectionState(5.0, 100, now=0.0)
    before = state.head_deadline
    state.drain()
    assert state.head_deadline == before


@pytest.mark.parametrize(
    ("keeps_alive", "requests", "drain", "last"),
    [
        (True, 1, False, False),
        (False, 1, False, True),  # the client asked to close
        (True, 3, False, True),  # keep_alive_max_requests
        (True, 1, True, True),  # the drain
    ],
)
def test_an_answer_is_the_connections_last_for_any_of_three_reasons(
    keeps_alive: bool, requests: int, drain: bool, last: bool
) -> None:
    state = ConnectionState(5.0, max_requests=3, now=0.0)
    for _ in range(requests - 1):
        state.request_received(client_keeps_alive=True)
    state.request_received(client_keeps_alive=keeps_alive)
    if drain:
        state.drain()
    assert state.last_answer is last
    assert state.draining is drain


def test_a_drain_that_begins_while_an_answer_is_made_makes_it_the_last() -> None:
    state = ConnectionState(5.0, 100, now=0.0)
    state.request_received(client_keeps_alive=True)
    assert not state.last_answer
    state.drain()  # the upstream is still deciding the head
    assert state.last_answer
