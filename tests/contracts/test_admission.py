"""The upstream queue is bounded like the local model's, over either transport: a request
waits for a replica's connection slot in a queue of max_queue, gets 429 queue_full at once past
it and 503 queue_timeout after queue_timeout, both with Retry-After; a queued client that leaves
frees its place at once; and none of it counts against the replica."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    RawClient,
    chat_body,
    only_replica,
    poll_until,
    start_fake,
    start_proxy,
)

pytestmark = pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)

CHAT = "/v1/chat/completions"


async def test_the_upstream_queue_is_bounded_in_size_and_time(
    nursery: trio.Nursery, transport: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=100_000)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            upstream={"max_connections": 1, "max_queue": 1, "queue_timeout": 0.5},
        )
        backend = proxy.state.backends["m"]
        replica = only_replica(proxy)
        async with (
            httpx.AsyncClient(timeout=10, trust_env=False) as client,
            client.stream("POST", proxy.url + CHAT, json=chat_body("m")) as holder,
        ):
            assert holder.status_code == 200
            results: dict[str, httpx.Response] = {}

            async def queued() -> None:
                results["queued"] = await client.post(
                    proxy.url + CHAT, json=chat_body("m", stream=False)
                )

            nursery.start_soon(queued)
            await poll_until(lambda: backend.queued == 1)
            asked = trio.current_time()
            full = await client.post(proxy.url + CHAT, json=chat_body("m", stream=False))
            assert trio.current_time() - asked < 1.0
            assert full.status_code == 429
            assert full.json()["error"]["code"] == "queue_full"
            assert int(full.headers["Retry-After"]) >= 1
            await poll_until(lambda: "queued" in results)
            timed_out = results["queued"]
            assert timed_out.status_code == 503
            assert timed_out.json()["error"]["code"] == "queue_timeout"
            assert int(timed_out.headers["Retry-After"]) >= 1
            assert trio.current_time() - asked < 0.5 + 1.0
        await proxy.state.tracker.wait_idle()
        assert replica.load.healthy()  # the proxy's queue is not the replica's fault
        assert backend.queued == 0
        waits = proxy.state.metrics.queue_wait
        assert waits.labels("m", "queue_full")._sum.get() == 0.0
        assert waits.labels("m", "queue_timeout")._sum.get() >= 0.5


async def test_a_queued_client_that_leaves_frees_its_place(
    nursery: trio.Nursery, transport: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=100_000)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            upstream={"max_connections": 1, "max_queue": 1, "queue_timeout": 30},
        )
        backend = proxy.state.backends["m"]
        holder = await RawClient.post(proxy, CHAT, chat_body("m"))
        await holder.read_until(b"data: ")
        waiting = await RawClient.post(proxy, CHAT, chat_body("m"))
        await poll_until(lambda: backend.queued == 1)
        await waiting.close()
        await poll_until(lambda: backend.queued == 0)  # at once, not after queue_timeout
        # Its place is free: the next one queues instead of being refused.
        again = await RawClient.post(proxy, CHAT, chat_body("m"))
        await poll_until(lambda: backend.queued == 1)
        await holder.close()
        await again.read_until(b"data: ")  # admitted when the slot freed
        await again.close()
        await proxy.state.tracker.wait_idle()
