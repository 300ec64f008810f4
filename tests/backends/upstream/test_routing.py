"""Replica choice: least in-flight first, ties to the replica picked longest ago."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.backends.upstream.routing import LeastBusyRouter, ReplicaLoad


def replicas(*loads: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"http://r{i}", in_flight) for i, in_flight in enumerate(loads)]


def test_no_replicas() -> None:
    assert LeastBusyRouter().choose([]) is None


def test_least_in_flight_wins_wherever_it_is() -> None:
    router = LeastBusyRouter()
    for loads, best in [((3, 1, 2), 1), ((0, 5, 5), 0), ((4, 4, 2), 2)]:
        pool = replicas(*loads)
        assert router.choose(pool) is pool[best]


def test_equal_loads_rotate() -> None:
    router = LeastBusyRouter()
    pool = replicas(0, 0, 0)
    assert [router.choose(pool) for _ in range(7)] == [*pool, *pool, pool[0]]


def test_tie_goes_to_the_one_picked_longest_ago() -> None:
    router = LeastBusyRouter()
    a, b, c = pool = replicas(0, 0, 0)
    assert [router.choose(pool) for _ in range(3)] == [a, b, c]
    a.in_flight = 1
    assert router.choose(pool) is b  # b and c tie; b was picked before c
    b.in_flight = 1
    assert router.choose(pool) is c
    c.in_flight = 1
    assert router.choose(pool) is a  # all tie again; a's pick is the oldest


def test_choose_records_the_pick_but_not_the_load() -> None:
    router = LeastBusyRouter()
    a, b = pool = replicas(2, 2)
    assert router.choose(pool) is a
    assert (a.in_flight, b.in_flight) == (2, 2)
    assert a.last_pick > b.last_pick == 0


def test_excluded_replicas_are_skipped_until_none_is_left() -> None:
    router = LeastBusyRouter()
    pool = replicas(5, 0, 1)
    tried: list[ReplicaLoad] = []
    while (replica := router.choose(pool, exclude=tried)) is not None:
        tried.append(replica)
    assert tried == [pool[1], pool[2], pool[0]]
    assert router.choose(pool, exclude=set(pool)) is None


def test_exclusion_is_by_identity_not_url() -> None:
    twin, other = ReplicaLoad("http://same"), ReplicaLoad("http://same", in_flight=1)
    assert LeastBusyRouter().choose([twin, other], exclude=[twin]) is other


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.data())
def test_choice_is_least_busy_among_allowed(loads: list[int], data: st.DataObject) -> None:
    pool = replicas(*loads)
    exclude = data.draw(st.lists(st.sampled_from(pool), unique_by=id))
    chosen = LeastBusyRouter().choose(pool, exclude)
    allowed = [replica for replica in pool if replica not in exclude]
    if not allowed:
        assert chosen is None
    else:
        assert chosen in allowed
        assert chosen.in_flight == min(replica.in_flight for replica in allowed)
