"""Spare upstream connections ([upstream] preconnect; KeepAlivePool.keep_spare).

A request that finds no idle connection would connect (and for https, handshake) on its way
to the first token; the pool keeps ``preconnect`` idle connections open ahead of demand. Tests
here run against the fake upstream, which counts the connections it accepts.
"""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import trio

from proxy.backends.upstream import pool as upstream_pool
from proxy.backends.upstream.pool import KeepAlivePool, Origin, UpstreamRequest
from proxy.config import ConfigError, config_from_mapping
from tests.support import DEADLINE, Fake, chat_body, poll_until, start_fake, start_proxy

CHAT = "/v1/chat/completions"


def get(origin: Origin) -> UpstreamRequest:
    host = f"{origin.host}:{origin.port}".encode()
    return UpstreamRequest(origin, b"GET", b"/health", [(b"host", host)], connect_timeout=5)


def origin_of(fake: Fake) -> Origin:
    return Origin.of(httpx.URL(fake.url))


async def test_the_pool_opens_its_spares_and_tops_them_up_as_requests_take_them(
    nursery: trio.Nursery, fake: Fake
) -> None:
    recorder = fake.upstream.recorder
    origin = origin_of(fake)
    with trio.fail_after(DEADLINE):
        pool = KeepAlivePool(max_keepalive=8, keepalive_expiry=60, spare=2)
        nursery.start_soon(pool.keep_spare, origin, 5.0)
        await recorder.wait_for(lambda r: r.connections_accepted == 2)
        await poll_until(lambda: len(pool.connections()) == 2)
        assert all(connection.is_idle() for connection in pool.connections())
        spares = set(pool.connections())
        # A request takes a spare: no connect on its way (the fake accepted none for it)...
        async with pool.stream(get(origin)) as response:
            assert response.status_code == 200
            async for _ in response.chunks():
                pass
            assert recorder.last().connection in (1, 2)
        # ...and the pool opens another to stand in for it: two idle again, beside the one
        # the request gave back.
        await recorder.wait_for(lambda r: r.connections_accepted == 3)
        await poll_until(lambda: len(pool.connections()) == 3)
        assert spares < set(pool.connections())
        # Not more than asked: with three idle (above two), nothing more is opened.
        await trio.sleep(0.1)
        assert recorder.connections_accepted == 3
        await pool.aclose()


async def test_spares_stay_within_max_keepalive(nursery: trio.Nursery, fake: Fake) -> None:
    with trio.fail_after(DEADLINE):
        pool = KeepAlivePool(max_keepalive=1, keepalive_expiry=60, spare=3)
        nursery.start_soon(pool.keep_spare, origin_of(fake), 5.0)
        await fake.upstream.recorder.wait_for(lambda r: r.connections_accepted == 1)
        await trio.sleep(0.1)
        assert fake.upstream.recorder.connections_accepted == 1
        assert len(pool.connections()) == 1
        await pool.aclose()


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port with nothing listening: every connect is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        yield probe.getsockname()[1]


async def test_a_failing_upstream_is_retried_with_backoff(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    attempts: list[float] = []
    real_connect = upstream_pool.connect

    async def connect(origin: Origin, **options: object) -> upstream_pool.Transport:
        attempts.append(trio.current_time())
        return await real_connect(origin, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(upstream_pool, "connect", connect)
    with refusing_port() as port:
        pool = KeepAlivePool(max_keepalive=8, keepalive_expiry=60, spare=2)
        nursery.start_soon(pool.keep_spare, Origin("http", "127.0.0.1", port), 5.0)
        await trio.sleep(100)
        # 1, 2, 4, 8, 16, 30, 30... seconds apart: not a busy loop against a down server.
        assert attempts == pytest.approx([0, 1, 3, 7, 15, 31, 61, 91], abs=0.01)
        assert [b - a for a, b in itertools.pairwise(attempts)][-2:] == pytest.approx([30, 30])
        await pool.aclose()
    assert pool.connections() == []


async def test_closing_the_pool_ends_the_spares_task_and_closes_the_spares(
    nursery: trio.Nursery, fake: Fake
) -> None:
    recorder = fake.upstream.recorder
    with trio.fail_after(DEADLINE):
        pool = KeepAlivePool(max_keepalive=8, keepalive_expiry=60, spare=2)
        done = trio.Event()

        async def run() -> None:
            await pool.keep_spare(origin_of(fake), 5.0)
            done.set()

        nursery.start_soon(run)
        await recorder.wait_for(lambda r: r.open_connections == 2)
        await pool.aclose()
        # At once, not at its next wake-up (an expiry away): the spares' task has returned.
        await done.wait()
        await recorder.wait_for(lambda r: r.open_connections == 0)
        assert pool.connections() == []


async def test_a_quiet_pool_lets_go_of_spares_past_their_expiry(
    nursery: trio.Nursery, fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = fake.upstream.recorder
    now = [1000.0]
    monkeypatch.setattr(upstream_pool, "monotonic", lambda: now[0])
    with trio.fail_after(DEADLINE):
        pool = KeepAlivePool(max_keepalive=8, keepalive_expiry=0.2, spare=1)
        nursery.start_soon(pool.keep_spare, origin_of(fake), 5.0)
        await recorder.wait_for(lambda r: r.connections_accepted == 1)
        await poll_until(lambda: len(pool.connections()) == 1)
        (first,) = pool.connections()
        # Past its expiry with no request to prune it: the pool's own wake-up (once per
        # expiry) closes it and opens a fresh spare.
        now[0] += 10
        await recorder.wait_for(lambda r: r.connections_accepted == 2)
        await poll_until(lambda: first.is_closed() and len(pool.connections()) == 1)
        assert pool.connections() != [first]
        await pool.aclose()


async def test_the_proxy_keeps_spares_by_default(nursery: trio.Nursery, fake: Fake) -> None:
    recorder = fake.upstream.recorder
    with trio.fail_after(DEADLINE):
        # tests.support turns preconnect off unless asked; the default (2) is asked for here.
        default = config_from_mapping(
            {"models": {"m": {"upstreams": ["http://h:1"]}}}, "t", env={}
        ).upstream.preconnect
        assert default == 2
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, upstream={"preconnect": default}
        )
        # Open before any request.
        await recorder.wait_for(lambda r: r.open_connections == 2)
        assert recorder.records == []
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body())
        assert response.status_code == 200
        # Served on a connection opened ahead of it.
        assert recorder.last().connection in (1, 2)


async def test_preconnect_is_checked_and_overridable() -> None:
    models = {"models": {"m": {"upstreams": ["http://h:1"]}}}
    with pytest.raises(ConfigError, match="'preconnect'"):
        config_from_mapping({**models, "upstream": {"preconnect": -1}}, "t", env={})
    config = config_from_mapping(models, "t", env={"SLUICE_UPSTREAM_PRECONNECT": "0"})
    assert config.upstream.preconnect == 0


@pytest.fixture
async def fake(nursery: trio.Nursery) -> Fake:
    return await start_fake(nursery, ttft=0, interval=0, tokens=3)
