"""cache_aware's sans-IO part: vLLM's KV-event wire format decoded, the per-replica block
index built from token ids and parent links (never vLLM's hashes), the sequence check, and the
score that weighs cached tokens against load."""

from __future__ import annotations

import msgpack
import pytest

from proxy.protocol.kv_cache import (
    TOKENS_PER_WEIGHT,
    AllBlocksCleared,
    BlockIndex,
    BlockRemoved,
    BlockStored,
    EventBatch,
    RoutedIndex,
    SequenceCheck,
    block_keys,
    cache_aware_pick,
    events_complete,
    key_tokens,
    token_key,
)
from proxy.protocol.kv_events import KvEventsError, decode_batch, decode_frames
from proxy.testing.kv_events import (
    all_cleared,
    block_removed,
    block_stored,
    payload,
    vllm_hashes,
)

BS = 4
PROMPT = list(range(100, 112))  # three blocks of four
SEED = b"NONE_HASH seeded from os.urandom"


def stored(tokens: list[int], *, parent: bytes | None = None, seed: bytes = SEED) -> BlockStored:
    hashes = vllm_hashes(tokens, BS, seed)
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, medium="GPU")


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> EventBatch:
    return EventBatch(0.0, events)


# ------------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("maps", [False, True], ids=["arrays (vLLM <= 0.10)", "maps (later)"])
def test_decode_a_vllm_batch(maps: bool) -> None:
    hashes = vllm_hashes(PROMPT, BS, SEED)
    raw = payload(
        [
            block_stored(hashes, None, PROMPT, BS, maps=maps),
            block_removed(hashes[2:], maps=maps),
            all_cleared(maps=maps),
        ]
    )
    decoded = decode_batch(raw)
    first = decoded.events[0]
    assert isinstance(first, BlockStored)
    assert first.block_hashes == tuple(hashes)
    assert first.parent_block_hash is None
    assert (first.token_ids, first.block_size, first.medium) == (tuple(PROMPT), BS, "GPU")
    assert decoded.events[1] == BlockRemoved(tuple(hashes[2:]), "GPU")
    assert decoded.events[2] == AllBlocksCleared()


def test_decode_older_and_newer_fields_int_hashes_and_unknown_tags() -> None:
    # vLLM 0.9: no medium; int hashes (builtin hash); a data-parallel rank on the batch.
    old = msgpack.packb([1.5, [["BlockStored", [7, 8], 6, list(range(8)), 4, None]], 2])
    decoded = decode_batch(old)
    assert decoded.data_parallel_rank == 2
    assert decoded.events == (BlockStored((7, 8), 6, tuple(range(8)), 4, None, None),)
    # A map-encoded batch, newer fields, and an event type this module does not know.
    new = msgpack.packb(
        {
            "ts": 1.0,
            "events": [
                {"type": "SomethingNew", "x": 1},
                block_stored([b"h"], None, [1, 2, 3, 4], 4, maps=True, lora_name="ad", group_idx=1),
            ],
        },
        use_bin_type=True,
    )
    (event,) = decode_batch(new).events
    assert isinstance(event, BlockStored)
    assert (event.lora_name, event.group_idx) == ("ad", 1)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never used in msgpack
        msgpack.packb("a string"),
        msgpack.packb([1.0, "not a list"]),
        msgpack.packb([1.0, [["BlockStored", [b"h"]]]]),  # too few fields
        msgpack.packb([1.0, [["BlockStored", ["str hash"], None, [1], 1, None, None]]]),
        msgpack.packb([1.0, [["BlockStored", [b"h"], None, [True], 1, None, None]]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
        msgpack.packb([1.0, [42]]),
    ],
)
def test_malformed_payloads_are_refused(raw: bytes) -> None:
    with pytest.raises(KvEventsError):
        decode_batch(raw)


def test_frames() -> None:
    assert decode_frames([b"", (5).to_bytes(8, "big"), b"x"]) == (5, b"x")
    with pytest.raises(KvEventsError):
        decode_frames([b"", b"x"])
    with pytest.raises(KvEventsError):
        decode_frames([b"", b"1234", b"x"])


# ------------------------------------------------------------------------------- the index


def test_a_prompt_matches_the_leading_blocks_a_replica_stored() -> None:
    index = BlockIndex(max_blocks=100)
    first = stored(PROMPT[:8])
    index.apply(batch(first))
    assert index.block_size == BS and len(index) == 2
    keys = block_keys(PROMPT, BS)
    assert len(keys) == 3
    assert index.matched(keys) == 2
    # The third block, stored later as the second's child, named through its parent's hash.
    parent = first.block_hashes[-1]
    third = BlockStored((b"third",), parent, tuple(PROMPT[8:]), BS)
    assert index.apply(batch(third)).stored == 1
    assert index.matched(keys) == 3
    # Another prompt sharing only the first block.
    other = [*PROMPT[:4], 1, 2, 3, 4]
    assert index.matched(block_keys(other, BS)) == 1
    # A partial last block has no key: vLLM caches full blocks only.
    assert len(block_keys([*PROMPT, 1, 2], BS)) == 3


def test_the_same_tokens_under_another_hash_seed_match_too() -> None:
    # Two replicas seed their hashes differently; the index never uses them to match.
    a, b = BlockIndex(10), BlockIndex(10)
    a.apply(batch(stored(PROMPT, seed=b"one")))
    b.apply(batch(stored(PROMPT, seed=b"two")))
    keys = block_keys(PROMPT, BS)
    assert a.matched(keys) == b.matched(keys) == 3


def test_removed_cleared_and_a_block_size_change() -> None:
    index = BlockIndex(10)
    event = stored(PROMPT)
    index.apply(batch(event))
    keys = block_keys(PROMPT, BS)
    # vLLM evicts from the end of a chain: the prompt then matches up to the gap.
    applied = index.apply(batch(BlockRemoved(event.block_hashes[1:2], "GPU")))
    assert applied.removed == 1
    assert index.matched(keys) == 1
    # Another tier's removal is not ours.
    index.apply(batch(BlockRemoved(event.block_hashes[:1], "CPU")))
    assert index.matched(keys) == 1
    assert index.apply(batch(AllBlocksCleared())).cleared
    assert len(index) == 0 and index.matched(keys) == 0
    # An engine restarted with 8-token blocks: what was indexed under 4 is gone.
    index.apply(batch(stored(PROMPT)))
    wide = BlockStored((b"w",), None, tuple(PROMPT[:8]), 8)
    index.apply(batch(wide))
    assert (index.block_size, len(index)) == (8, 1)
    assert index.matched(block_keys(PROMPT, 8)) == 1


def test_blocks_that_no_plain_prompt_hits_are_skipped() -> None:
    index = BlockIndex(10)
    tokens = tuple(PROMPT[:4])
    for event in (
        BlockStored((b"l",), None, tokens, BS, lora_id=3),
        BlockStored((b"n",), None, tokens, BS, lora_name="adapter"),
        BlockStored((b"c",), None, tokens, BS, medium="CPU"),
        BlockStored((b"g",), None, tokens, BS, group_idx=1),
        BlockStored((b"x",), None, tokens, BS, extra_keys=(("image-hash",),)),
        BlockStored((b"short",), None, tokens[:3], BS),  # token count != blocks x size
    ):
        assert index.apply(batch(event)).skipped == 1
    assert len(index) == 0
    # A parent never seen (stored before this process subscribed): no name for its children.
    orphan = BlockStored((b"o1", b"o2"), b"unknown parent", tuple(PROMPT[:8]), BS)
    assert index.apply(batch(orphan)).skipped == 2
    assert index.unlinked == 2
    # Extra keys all None (vLLM sends one entry per block) are plain blocks.
    plain = BlockStored((b"p",), None, tokens, BS, extra_keys=(None,))
    assert index.apply(batch(plain)).stored == 1


def test_the_index_is_capped_oldest_first() -> None:
    index = BlockIndex(max_blocks=4)
    first = stored(PROMPT)  # 3 blocks
    index.apply(batch(first))
    other = [7] * 12
    applied = index.apply(batch(stored(other)))
    assert len(index) == 4
    assert applied.evicted == 2 and index.evicted == 2
    # The oldest two (the prompt's first blocks) went: it matches nothing now.
    assert index.matched(block_keys(PROMPT, BS)) == 0
    assert index.matched(block_keys(other, BS)) == 3
    with pytest.raises(ValueError):
        BlockIndex(0)


def test_a_block_stored_twice_is_counted_once_per_hash() -> None:
    index = BlockIndex(10)
    event = stored(PROMPT[:4])
    index.apply(batch(event, event))
    assert len(index) == 1
    index.apply(batch(BlockRemoved(event.block_hashes, None)))
    assert len(index) == 0 and index.matched(block_keys(PROMPT, BS)) == 0


def test_token_keys_round_trip() -> None:
    assert list(key_tokens(token_key(PROMPT))) == PROMPT
    assert list(key_tokens(b"")) == [] and list(key_tokens(b"abc")) == []
    with pytest.raises(OverflowError):
        token_key([-1])


# ------------------------------------------------------------------------------- sequence


def test_sequence_numbers() -> None:
    check = SequenceCheck()
    assert check.see(41) == "first"
    check.accept(41)
    assert check.see(42) == "next"
    check.accept(42)
    assert check.see(45) == "gap"
    assert check.see(42) == "restart"
    assert check.see(0) == "restart"


# ------------------------------------------------------------------------------- approximate


def test_the_routed_index_forgets_a_prompts_tail_first() -> None:
    routed = RoutedIndex(max_blocks=3, ttl=60.0, block_size=BS)
    first, second = block_keys(PROMPT[:8], BS), block_keys(list(range(8)), BS)
    routed.routed(first, 0.0)
    routed.routed(second, 1.0)
    # Over 3 blocks: the first prompt's tail went, its head stays (as vLLM frees and evicts).
    assert (routed.matched(first, 1.0), routed.matched(second, 1.0)) == (1, 2)
    assert (len(routed), routed.evicted) == (3, 1)
    # A prompt longer than the whole index keeps its head.
    long = block_keys(list(range(500, 540)), BS)
    routed.routed(long, 2.0)
    assert routed.matched(long, 2.0) == 3 and routed.matched(first, 2.0) == 0


def test_the_routed_index_forgets_after_its_ttl() -> None:
    routed = RoutedIndex(max_blocks=100, ttl=10.0, block_size=BS)
    keys = block_keys(PROMPT, BS)
    routed.routed(keys[:2], 0.0)
    routed.routed(keys, 5.0)  # the first two used again at 5, the third first used
    assert routed.matched(keys, 15.0) == 3
    assert routed.matched(keys, 15.1) == 0
    routed.expire(15.1)
    assert len(routed) == 0
    with pytest.raises(ValueError):
        RoutedIndex(max_blocks=1, ttl=0.0, block_size=BS)


def test_events_are_complete_once_they_flowed_for_the_ttl() -> None:
    index = BlockIndex(10)
    assert not events_complete(None, 100.0, 10.0)
    assert not events_complete(index, 100.0, 10.0)  # no subscription
    index.complete_since = 95.0
    assert not events_complete(index, 100.0, 10.0)
    assert events_complete(index, 105.0, 10.0)


# ------------------------------------------------------------------------------- the score


def test_the_longest_cached_prefix_wins_at_equal_load() -> None:
    pick = cache_aware_pick([1, 1, 1], [0, 2000, 500], cache_weight=1.0, max_load=1.5)
    assert (pick.index, pick.reason, pick.cached_tokens) == (1, "cache", 2000)


def test_cache_is_weighed_against_load() -> None:
    # 2,000 cached tokens at weight 1 are worth 2 requests of load: worth 3 more, not 1 more.
    loads, cached = [4, 1], [2000, 0]
    assert cache_aware_pick(loads, cached, cache_weight=1.0, max_load=10).index == 1
    assert cache_aware_pick([2, 1], cached, cache_weight=1.0, max_load=10).index == 0
    # Weight 0: load alone.
    assert cache_aware_pick([2, 1], cached, cache_weight=0.0, max_load=10).index == 1
    assert TOKENS_PER_WEIGHT == 1000


def test_a_replica_over_the_bound_is_never_chosen_for_its_cache() -> None:
    # A hot prefix: its replica holds 9 while the others hold 1. The bound (1.5 x mean + 1 =
    # 6.5) credits it nothing, however much it caches; the least loaded takes the request.
    pick = cache_aware_pick([9, 1, 2], [100_000, 0, 0], cache_weight=1.0, max_load=1.5)
    assert (pick.index, pick.reason, pick.cached_tokens) == (1, "load", 0)


def test_no_cache_anywhere_is_load_alone_ties_to_the_first() -> None:
    assert cache_aware_pick([3, 1, 1], [0, 0, 0], cache_weight=5, max_load=1.5).index == 1
    pick = cache_aware_pick([0, 0], [0, 0], cache_weight=1, max_load=1.5)
    assert (pick.index, pick.reason) == (0, "load")
    with pytest.raises(ValueError):
        cache_aware_pick([], [], cache_weight=1, max_load=1.5)


def test_a_pending_prefix_is_followed_only_where_none_holds_it_stored() -> None:
    # Replica 0 was just sent the prefix (its prefill not known done); replica 1 holds it
    # stored; replica 2 nothing. Stored wins over pending, at a little more load.
    loads, cached, pending = [1, 2, 0], [0, 2000, 0], [2000, 0, 0]
    pick = cache_aware_pick(loads, cached, cache_weight=4, max_load=10, pending_tokens=pending)
    assert (pick.index, pick.reason, pick.cached_tokens) == (1, "cache", 2000)
    # Nobody holds it stored: follow the prefill in progress rather than prefill it twice.
    pick = cache_aware_pick(loads, [0, 0, 0], cache_weight=4, max_load=10, pending_tokens=pending)
    assert (pick.index, pick.cached_tokens) == (0, 2000)
    # More pending than stored anywhere (a longer prompt sent on): the pending part counts.
    pick = cache_aware_pick(
        [1, 1, 1], [0, 1000, 0], cache_weight=4, max_load=10, pending_tokens=[3000, 0, 0]
    )
    assert (pick.index, pick.cached_tokens) == (0, 3000)
    # The stored copy over the bound does not count: the pending one is followed.
    pick = cache_aware_pick(
        [1, 9, 0], [0, 2000, 0], cache_weight=4, max_load=1.5, pending_tokens=[2000, 0, 0]
    )
    assert (pick.index, pick.cached_tokens) == (0, 2000)
    with pytest.raises(ValueError):
        cache_aware_pick([1], [0], cache_weight=1, max_load=1.5, pending_tokens=[])
