"""cache_aware's approximate half, sans-IO: a replica whose KV events are not known (it
publishes none, its subscriber is down, or its events were lost a short while ago) is judged by
the prompts this router sent it, and the routing reason says so (``cache_approx``)."""

from __future__ import annotations

import math

from proxy.backends.upstream.routing import PENDING_SECONDS, CacheAwareRouter, ReplicaLoad
from proxy.protocol.kv_cache import BlockStored, EventBatch, block_keys, fresh_load, token_key
from tests.protocol.test_kv_cache import stored

BS = 4
TTL = 60.0


def router(cache_weight: float = 1.0) -> CacheAwareRouter:
    return CacheAwareRouter(cache_weight=cache_weight, approx_ttl=TTL, approx_block_size=BS)


def replicas(count: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"http://r{i}") for i in range(count)]


def prompt(name: int, length: int = 40) -> list[int]:
    return [name * 1000 + i for i in range(length)]


def test_no_events_a_prefix_follows_what_was_routed() -> None:
    cache_aware, pool = router(), replicas(3)
    first = cache_aware.decide(pool, (), 0.0, token_key(prompt(1)))
    assert first.reason == "load" and first.cached_fraction == 0.0
    # The same system prompt with another question: the replica it went to, said so.
    again = cache_aware.decide(pool, (), 1.0, token_key([*prompt(1, 40), 7, 7, 7, 7]))
    assert again.replica is first.replica
    assert again.reason == "cache_approx" and again.cached_fraction == 10 / 11
    # Another prompt spreads by load (equal loads: the replica picked longest ago).
    other = cache_aware.decide(pool, (), 2.0, token_key(prompt(2)))
    assert other.replica is not first.replica and other.reason == "load"
    # A short prompt (no full block) is by load, and records nothing.
    assert cache_aware.decide(pool, (), 3.0, token_key([1, 2])).reason == "load"


def test_what_was_routed_is_forgotten_after_the_ttl() -> None:
    cache_aware, pool = router(), replicas(2)
    first = cache_aware.decide(pool, (), 0.0, token_key(prompt(1))).replica
    assert first is not None
    # Routed again within the ttl: the clock starts again from the last time.
    assert cache_aware.decide(pool, (), TTL - 1, token_key(prompt(1))).replica is first
    assert cache_aware.decide(pool, (), 2 * TTL - 2, token_key(prompt(1))).reason == (
        "cache_approx"
    )
    later = cache_aware.decide(pool, (), 3 * TTL, token_key(prompt(1)))
    assert later.reason == "load"
    assert len(cache_aware.routed_of(first)) == 0  # expired at the next choice


def test_the_bound_holds_for_a_guess_too() -> None:
    cache_aware, pool = router(), replicas(3)
    hot = cache_aware.decide(pool, (), 0.0, token_key(prompt(1))).replica
    assert hot is not None
    hot.in_flight = 9  # over 1.5 x the mean (3) + 1
    decision = cache_aware.decide(pool, (), 1.0, token_key(prompt(1)))
    assert decision.replica is not hot and decision.reason == "load"


def test_events_flowing_long_enough_are_trusted_alone() -> None:
    cache_aware, pool = router(cache_weight=100.0), replicas(2)
    a, b = pool
    tokens = prompt(1)
    # The router sent the prompt to a; a's events say it holds none of it (evicted), b's
    # that it holds all of it.
    cache_aware.routed_of(a).routed(block_keys(tokens, BS), 0.0)
    for replica, held in ((a, []), (b, tokens)):
        index = cache_aware.index_of(replica)
        index.complete_since = 0.0
        if held:
            index.apply(EventBatch(0.0, (stored(held),)))
    # Within the ttl of the subscription, a's guess counts: all of it, against b's all.
    early = cache_aware.decide(pool, (), 1.0, token_key(tokens))
    assert early.reason in ("cache", "cache_approx")
    # Past it, a's events alone: b holds the prompt.
    late = cache_aware.decide(pool, (), TTL + 1, token_key(tokens))
    assert (late.replica, late.reason, late.cached_fraction) == (b, "cache", 1.0)


def test_a_subscriber_down_or_events_lost_fall_back_to_the_guess() -> None:
    cache_aware, pool = router(cache_weight=100.0), replicas(2)
    a, _ = pool
    tokens = prompt(1)
    cache_aware.routed_of(a).routed(block_keys(tokens, BS), 500.0)
    index = cache_aware.index_of(a)
    index.complete_since = None  # its subscription failed (the index was emptied)
    decision = cache_aware.decide(pool, (), 501.0, token_key(tokens))
    assert (decision.replica, decision.reason) == (a, "cache_approx")
    # Events lost at 500 (a gap not replayed): the guess counts until 500 + ttl.
    index.complete_since = 500.0
    assert cache_aware.decide(pool, (), 502.0, token_key(tokens)).reason == "cache_approx"
    # An engine that restarted with no event missed: its (empty) index is exact.
    index.complete_since = -math.inf
    later = 502.0 + PENDING_SECONDS + 1
    assert cache_aware.decide(pool, (), later, token_key(tokens)).reason == "load"


def test_with_complete_events_what_was_just_routed_is_pending() -> None:
    """A prompt's blocks are stored (and published) only once prefilled: until then, or for
    PENDING_SECONDS, a request with the same prefix follows it rather than caching it twice."""
    cache_aware, pool = router(cache_weight=100.0), replicas(3)
    for replica in pool:
        cache_aware.index_of(replica).complete_since = -math.inf
    tokens = prompt(1)
    first = cache_aware.decide(pool, (), 0.0, token_key(tokens))
    assert first.reason == "load"
    again = cache_aware.decide(pool, (), 1.0, token_key([*tokens, 9, 9, 9, 9]))
    assert (again.replica, again.reason) == (first.replica, "cache_approx")
    # Past the window without events telling of it (evicted at once, or never stored): load.
    late = cache_aware.decide(pool, (), 1.0 + PENDING_SECONDS + 0.1, token_key(tokens))
    assert late.reason == "load"


def test_events_in_another_block_size_are_weighed_in_tokens() -> None:
    cache_aware, pool = router(cache_weight=100.0), replicas(2)
    a, b = pool
    tokens = prompt(1, 48)
    # a's guess: 12 blocks of 4 (48 tokens). b's events: 2 blocks of 16 (32 tokens).
    cache_aware.routed_of(a).routed(block_keys(tokens, BS), 0.0)
    index = cache_aware.index_of(b)
    index.complete_since = 0.0
    hashes = tuple(bytes([i]) * 32 for i in range(2))
    index.apply(EventBatch(0.0, (BlockStored(hashes, None, tuple(tokens[:32]), 16),)))
    decision = cache_aware.decide(pool, (), 1.0, token_key(tokens))
    assert (decision.replica, decision.reason) == (a, "cache_approx")


def test_the_load_is_this_process_in_flight_now_plus_the_others_scraped() -> None:
    # Five of ours ran at the scrape; three have ended since: a stale count would say 5.
    assert fresh_load(in_flight=2, ours_at_scrape=5, running=5, waiting=0) == 2
    # One of ours then, three of another instance's running and one waiting (x4 in all).
    assert fresh_load(in_flight=2, ours_at_scrape=1, running=4, waiting=1) == 2 + 4 + 3


def test_with_complete_events_a_prefix_stored_elsewhere_beats_one_still_prefilled() -> None:
    """A prefix just sent to one replica (its prefill in progress) and held stored by another:
    a request with it goes to the one that has it now, not behind that prefill."""
    cache_aware, pool = router(cache_weight=100.0), replicas(3)
    a, b, _ = pool
    for replica in pool:
        cache_aware.index_of(replica).complete_since = -math.inf
    tokens = prompt(1)
    cache_aware.routed_of(a).routed(block_keys(tokens, BS), 0.0)
    a.in_flight = 1
    hashes = tuple(bytes([i]) * 32 for i in range(10))
    cache_aware.index_of(b).apply(EventBatch(0.0, (BlockStored(hashes, None, tuple(tokens), BS),)))
    b.in_flight = 2
    decision = cache_aware.decide(pool, (), 1.0, token_key([*tokens, 9, 9, 9, 9]))
    assert (decision.replica, decision.reason, decision.cached_fraction) == (b, "cache", 10 / 11)
