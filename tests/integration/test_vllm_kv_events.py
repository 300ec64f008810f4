"""cache_aware against two real vLLM replicas publishing KV events (`make test-vllm`): a
conversation's next turn goes to the replica that holds its prefix, Sluice's index of that
replica agrees with the blocks vLLM reported, and vLLM's own prefix-cache hit counter rises
there.

Needs two vLLM servers started with ``--enable-prefix-caching --kv-events-config
'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT",
"replay_endpoint": "tcp://*:PORT2"}'``: their URLs in ``SLUICE_VLLM_KV_URLS`` and their
publishers in ``SLUICE_VLLM_KV_EVENTS`` (comma-separated, in the same order), as `make
test-vllm` (tests/integration/run_real_upstream.py) starts and names them. Without them it
skips, saying so: vLLM cannot run everywhere (it needs its CPU or GPU build and the model's
files)."""

from __future__ import annotations

import os

import httpx
import pytest
import trio

from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.routing import CacheAwareRouter
from proxy.protocol.kv_cache import block_keys
from proxy.protocol.replica_metrics import parse_replica_metrics
from tests.support import poll_until, start_proxy

pytestmark = pytest.mark.vllm

URLS = [u for u in os.environ.get("SLUICE_VLLM_KV_URLS", "").split(",") if u]
EVENTS = [e for e in os.environ.get("SLUICE_VLLM_KV_EVENTS", "").split(",") if e]
MODEL = os.environ.get("SLUICE_VLLM_MODEL", "smollm2")
# vLLM's default block size: the index names blocks in it.
BLOCK = 16
SYSTEM = "You are a careful assistant. " * 40  # a prefix of several blocks


def _skip_reason() -> str | None:
    if len(URLS) != 2 or len(EVENTS) != 2:
        return (
            "needs two vLLM replicas with KV events: SLUICE_VLLM_KV_URLS and "
            "SLUICE_VLLM_KV_EVENTS (two each, comma-separated); vLLM is not running here"
        )
    return None


async def _prefix_hits(client: httpx.AsyncClient, url: str) -> float:
    """vLLM's prefix-cache hits (tokens), as its /metrics says."""
    text = (await client.get(f"{url}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    parse_replica_metrics(text, MODEL)  # its load gauges are there too
    return total


@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
async def test_the_next_turn_goes_to_the_replica_holding_its_prefix(
    nursery: trio.Nursery,
) -> None:
    model = {
        "upstreams": URLS,
        "balance": "cache_aware",
        "kv_events_endpoints": EVENTS,
        "metrics_interval": 0.5,
    }
    with trio.fail_after(300):
        proxy = await start_proxy(nursery, {MODEL: model})
        backend = proxy.state.backends[MODEL]
        assert isinstance(backend, UpstreamBackend)
        router = backend.router
        assert isinstance(router, CacheAwareRouter)
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name a colour."},
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
            first = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
            assert first.status_code == 200, first.text
            # The replica that served it: the one whose index now holds the prompt's blocks.
            tokens = (
                await client.post(
                    f"{URLS[0]}/tokenize",
                    json={"model": MODEL, "messages": messages},
                )
            ).json()["tokens"]
            keys = block_keys(tokens, BLOCK)
            loads = [replica.load for replica in backend.replicas]
            indexes = [router.index_of(load) for load in loads]
            await poll_until(lambda: max(i.matched(keys) for i in indexes) == len(keys))
            holder = max(range(2), key=lambda i: indexes[i].matched(keys))
            assert indexes[1 - holder].matched(keys) < len(keys)
            hits_before = await _prefix_hits(client, URLS[holder])

            answer = first.json()["choices"][0]["message"]["content"]
            follow = [
                *messages,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And another?"},
            ]
            second = await client.post(
                f"{proxy.url}/v1/chat/completions", json={**body, "messages": follow}
            )
            assert second.status_code == 200, second.text
            registry = proxy.state.metrics.registry
            labels = {"model": MODEL, "balance": "cache_aware", "reason": "cache"}
            assert registry.get_sample_value("sluice_routing_decisions_total", labels) == 1
            # vLLM's own counter says the prefix was read from its cache, on that replica.
            assert await _prefix_hits(client, URLS[holder]) > hits_before
        nursery.cancel_scope.cancel()
