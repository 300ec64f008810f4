"""Each replica's capacity learned from its engine's gauges (max_connections unset, the
engine's /metrics scraped): a fake upstream that runs 256 at once is filled by a burst of
1,000, and its own queue never grows past max_upstream_waiting. Under virtual time
(autojump_clock): every wait of the fake, the scrapes and the streams are the trio clock's.

The step-by-step rule is tested alone in tests/protocol/test_capacity.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from proxy.backends.upstream.backend import UpstreamBackend
from proxy.protocol.capacity import LEARNED_CEILING, START
from tests.support import start_fake, start_proxy

ENGINE = 256
BURST = 1000
ALLOWED_WAITING = 16


def backend_of(proxy: Any) -> UpstreamBackend:
    backend = proxy.state.backends["fake-model"]
    assert isinstance(backend, UpstreamBackend)
    return backend


async def test_a_burst_fills_an_engine_of_256_without_queueing_in_it(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    fake = await start_fake(nursery, ttft=1.0, interval=0.5, tokens=4, max_running=ENGINE)
    model = {
        "upstreams": [fake.url],
        "balance": "upstream_metrics",
        "metrics_interval": 0.25,
        "max_upstream_waiting": ALLOWED_WAITING,
        "max_queue": BURST,
        "queue_timeout": 600.0,
        "total_timeout": 600.0,
    }
    proxy = await start_proxy(nursery, {"fake-model": model})
    backend = backend_of(proxy)
    (replica,) = backend.replicas
    room = replica.room
    assert room.learning is not None and room.learning.upper == LEARNED_CEILING
    assert room.capacity == START

    serving = fake.upstream.serving
    peaks = {"running": 0, "waiting": 0}

    async def watch() -> None:
        while True:
            peaks["running"] = max(peaks["running"], serving.running)
            peaks["waiting"] = max(peaks["waiting"], serving.waiting)
            await trio.sleep(0.01)

    statuses: list[int] = []
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    with trio.fail_after(600):
        async with (
            httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client,
            trio.open_nursery() as inner,
        ):
            inner.start_soon(watch)

            async def one() -> None:
                async with client.stream(
                    "POST", f"{proxy.url}/v1/chat/completions", json=body
                ) as response:
                    async for _ in response.aiter_raw():
                        pass
                    statuses.append(response.status_code)

            async with trio.open_nursery() as burst:
                for _ in range(BURST):
                    burst.start_soon(one)
            inner.cancel_scope.cancel()

    assert statuses.count(200) == BURST, sorted(set(statuses))
    # Kept full: the engine ran all it could, and learned where it queues.
    assert peaks["running"] == ENGINE
    assert room.learning.edge == ENGINE
    assert room.capacity == ENGINE
    # Its own queue never past what max_upstream_waiting allows.
    assert peaks["waiting"] <= ALLOWED_WAITING
    counted = proxy.state.metrics.registry.get_sample_value(
        "sluice_upstream_capacity", {"model": "fake-model", "replica": replica.url}
    )
    assert counted == ENGINE


@pytest.mark.parametrize("balance", ["least_busy", "prefix_affinity"])
async def test_without_the_engines_gauges_the_default_holds(
    nursery: trio.Nursery, balance: str
) -> None:
    fake = await start_fake(nursery)
    proxy = await start_proxy(
        nursery, {"fake-model": {"upstreams": [fake.url], "balance": balance}}
    )
    (replica,) = backend_of(proxy).replicas
    assert replica.room.learning is None and replica.room.capacity == START


async def test_a_set_max_connections_is_the_upper_bound(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery)
    model = {"upstreams": [fake.url], "balance": "upstream_metrics", "max_connections": 300}
    proxy = await start_proxy(nursery, {"fake-model": model})
    (replica,) = backend_of(proxy).replicas
    learning = replica.room.learning
    assert learning is not None and (learning.limit, learning.upper) == (300, 300)
