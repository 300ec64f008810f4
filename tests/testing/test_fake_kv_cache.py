"""The fake upstream's token-block prefix cache, as the KV-routing bench uses it: TTFT from the
uncached tokens (one prefill at a time), blocks evicted tail first, and vLLM's KV events of it
on a real ZeroMQ socket, which Sluice's own subscriber turns into an index that agrees with
the fake's /tokenize."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from proxy.backends.upstream.kv_events import KvEventSubscriber, Publisher
from proxy.protocol.kv_cache import BlockIndex, block_keys
from proxy.testing.fake_upstream import FakeSettings, PrefixCache
from proxy.testing.fake_upstream.behaviours import Invalid, kv_events
from tests.support import DEADLINE, poll_until, start_fake

BS = 4


def chat(words: int, first: int = 0) -> dict[str, object]:
    text = " ".join(f"w{i}" for i in range(first, first + words))
    return {"model": "fake-model", "messages": [{"role": "user", "content": text}]}


def test_blocks_are_used_tail_first_so_a_shared_head_outlives_them() -> None:
    cache = PrefixCache(capacity=4)
    head = [b"h1", b"h2"]
    assert cache.match([*head, b"a3"]) == 0
    assert cache.store([*head, b"a3"]) == ([0, 1, 2], [])
    assert cache.store([*head, b"b3"]) == ([2], [])
    # Over 4: the least recently used go, a prompt's tail before its head.
    assert cache.store([b"c1"]) == ([0], [b"a3"])
    assert cache.match([*head, b"b3"]) == 3
    assert (cache.queries, cache.hits) == (6, 3)


def test_the_events_of_a_store() -> None:
    names = [b"n0", b"n1", b"n2", b"n3"]
    tokens = list(range(16))
    stored_first, stored_last, removed = kv_events(names, tokens, BS, [0, 2, 3], [b"old"])
    assert stored_first == ["BlockStored", [b"n0"], None, [0, 1, 2, 3], BS, None, "GPU"]
    assert stored_last[1:4] == [[b"n2", b"n3"], b"n1", list(range(8, 16))]
    assert removed == ["BlockRemoved", [b"old"], "GPU"]


# A fake with a prefix cache of 8 blocks, 10 ms of prefill a token not found there, one token
# of answer.
CACHED: dict[str, Any] = {
    "tokens": 1,
    "interval": 0.001,
    "prefix_cache_size": 8,
    "prefix_block_tokens": BS,
    "prefill_token_seconds": 0.01,
    "ttft_hit": 0.0,
}


def test_events_need_token_blocks() -> None:
    with pytest.raises(Invalid, match="prefix_block_tokens"):
        FakeSettings(kv_events_port=0)


async def test_ttft_follows_the_uncached_tokens_and_events_build_sluices_index(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        # 30 ms a token not cached, so that a prompt prefilled (0.6 s) and one found whole in
        # the cache (none) are told apart with room for a loaded machine's pauses.
        fake = await start_fake(
            nursery, **(CACHED | {"prefill_token_seconds": 0.03}), kv_events_port=0
        )
        upstream = fake.upstream
        index = BlockIndex(100)
        subscriber = KvEventSubscriber(
            "fake", Publisher(upstream.kv_events_endpoint, upstream.kv_replay_endpoint), index
        )
        await nursery.start(subscriber.run)
        publisher = upstream.serving.publisher
        assert publisher is not None
        await poll_until(lambda: publisher.subscribers == 1)

        async with httpx.AsyncClient(base_url=fake.url, timeout=5) as client:
            tokens = (await client.post("/tokenize", json=chat(20))).json()["tokens"]
            times = []
            for body in (chat(20), chat(20)):
                started = trio.current_time()
                answer = await client.post("/v1/chat/completions", json=body)
                assert answer.status_code == 200
                times.append(trio.current_time() - started)
            # 20 tokens prefilled at 30 ms each, then none.
            assert times[0] >= 0.6 > 0.3 > times[1], times
            await poll_until(lambda: index.matched(block_keys(tokens, BS)) == 5)

            # Another prompt of 4 blocks: the cache holds 8, so the first prompt's tail goes,
            # and its events say so.
            await client.post("/v1/chat/completions", json=chat(16, first=100))
            await poll_until(lambda: len(index) == 8)
            assert index.matched(block_keys(tokens, BS)) == 4
            records = [r for r in upstream.recorder.records if r.path == "/v1/chat/completions"]
            assert [(r.prefix_blocks, r.prefix_hit_blocks) for r in records] == [
                (5, 0),
                (5, 5),
                (4, 0),
            ]
            metrics = (await client.get("/metrics")).text
            assert 'vllm:prefix_cache_queries_total{model_name="fake-model"} 14.0' in metrics
            assert 'vllm:prefix_cache_hits_total{model_name="fake-model"} 5.0' in metrics
        nursery.cancel_scope.cancel()


async def test_a_prompt_sent_during_its_prefixs_prefill_hits_what_that_prefill_stores(
    nursery: trio.Nursery,
) -> None:
    # vLLM looks a waiting request's prefix up when it schedules it, after the prefill before
    # it stored its blocks: the second of two identical prompts sent at once prefills nothing.
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, **CACHED)
        async with httpx.AsyncClient(base_url=fake.url, timeout=5) as client:

            async def ask() -> None:
                answer = await client.post("/v1/chat/completions", json=chat(20))
                assert answer.status_code == 200

            async with trio.open_nursery() as both:
                both.start_soon(ask)
                both.start_soon(ask)
        records = [r for r in fake.upstream.recorder.records if r.path == "/v1/chat/completions"]
        assert sorted((r.prefix_blocks, r.prefix_hit_blocks) for r in records) == [(5, 0), (5, 5)]
        nursery.cancel_scope.cancel()
