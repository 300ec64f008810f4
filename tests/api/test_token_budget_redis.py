"""Per-key token budgets shared through a real Redis: the store's reservation and settlement
(once, on the server's clock, an expired reservation charged in full), on_error, and the issue's
"done when": ``sluice serve --workers 2`` against an upstream whose answers carry no usage
block. Each test starts its own ``redis-server`` (tests/api/test_limits_redis.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxy.api.limits import RedisLease, RedisLimits
from proxy.config import KeyConfig
from proxy.protocol.errors import ApiError
from tests.api.test_auth import OTHER_SECRET, bearer, key_table
from tests.api.test_limits_redis import (
    REDIS_SERVER,
    RedisServer,
    limits,
    store,
    worker_pid,
)
from tests.support import DEADLINE, chat_body, start_fake, start_proxy, start_sluice, stop

CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (`make redis` installs Debian's package when root)",
)


def budget_key(**settings: Any) -> KeyConfig:
    return KeyConfig(name="alice", sha256="0" * 64, **settings)


async def charged(limited: RedisLimits, name: str = "alice") -> tuple[int, int]:
    """The key's window totals in Redis: (minute, day)."""
    client = await limited._connected()
    tokens = f"{limited.limits.key_prefix}{{{name}}}:tokens"
    minute, day = await client.hmget(tokens, ["=tpm", "=tpd"])
    return int(minute or 0), int(day or 0)


async def lapsed(limited: RedisLimits, lease: RedisLease) -> bool:
    """Whether ``lease``'s reservation has expired, on the Redis server's clock (the one the
    scripts judge by)."""
    assert lease.budget is not None
    client = await limited._connected()
    expiry = await client.zscore(lease.budget[3], lease.id)
    assert expiry is not None
    return float(expiry) < (await client.time()).timestamp()


async def acquired(limited: RedisLimits, key: KeyConfig, reservation: int) -> RedisLease:
    lease = await limited.acquire(key, reservation)
    assert lease is not None and lease.budget is not None
    return lease


async def test_a_reservation_is_charged_then_settled_exactly_once(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        limited = store(redis_server)
        alice = budget_key(tokens_per_minute=100, tokens_per_day=1000)
        lease = await acquired(limited, alice, 120)  # admitted: the window had room
        assert await charged(limited) == (120, 120)
        with pytest.raises(ApiError) as refused:
            await limited.acquire(alice, 1)
        error = refused.value
        assert (error.status, error.code) == (429, "token_limit_exceeded")
        assert error.headers["x-ratelimit-limit-tokens"] == "100"
        assert error.headers["x-ratelimit-remaining-tokens"] == "0"
        # Admitted within the last few seconds (a loaded machine may take a few).
        assert 55 <= int(error.headers["Retry-After"]) <= 60
        await lease.settle(30)
        assert await charged(limited) == (30, 30)
        # Settled again (a retried call, or a second settle): nothing changes.
        await limited.settle(lease, 0)
        await lease.settle(0)
        assert await charged(limited) == (30, 30)
        second = await acquired(limited, alice, 10)
        await second.settle(5)
        assert await charged(limited) == (35, 35)


async def test_a_reservation_whose_worker_died_expires_and_stays_charged_in_full(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        # Renewed every third of a lease: only a stall of two thirds (0.67 s) could expire the
        # renewed one, well past what a loaded machine stalls.
        limited = store(redis_server, lease_seconds=1.0)
        alice = budget_key(tokens_per_minute=100)
        renewed = await acquired(limited, alice, 40)
        dead = await acquired(limited, alice, 50)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(renewed.keep_renewed)
            # Until the dead one's lease has expired, by the clock the scripts go by.
            while True:
                if await lapsed(limited, dead):
                    break
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        await dead.settle(1)  # too late: it stays at 50
        await renewed.settle(10)  # renewed all along: it settles
        assert await charged(limited) == (60, 0)


async def test_every_limit_is_checked_before_any_is_charged(redis_server: RedisServer) -> None:
    with trio.fail_after(DEADLINE):
        limited = store(redis_server)
        alice = budget_key(tokens_per_minute=100, max_concurrent_streams=1)
        lease = await acquired(limited, alice, 10)
        with pytest.raises(ApiError) as refused:
            await limited.acquire(alice, 50)
        assert refused.value.code == "concurrency_limit_exceeded"
        assert await charged(limited) == (10, 0)
        await lease.settle(10)
        await lease.release()


@pytest.mark.parametrize("on_error", ["deny", "allow"])
async def test_redis_down_gets_the_same_on_error(
    nursery: trio.Nursery, redis_server: RedisServer, on_error: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=3)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(tokens_per_minute=1000)],
            limits=limits(redis_server, on_error=on_error),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            ok = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            assert ok.status_code == 200
            redis_server.stop()
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
        if on_error == "deny":
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "limits_unavailable"
        else:
            assert response.status_code == 200


# -- the "done when": two workers, one Redis, no usage blocks --------------------------


def done_when_config(tmp_path: Path, server: RedisServer, upstream: str) -> Path:
    config = tmp_path / "budget.toml"
    config.write_text(
        "[server]\nport = 0\n"
        f'[models.fake-model]\nupstreams = ["{upstream}"]\n'
        f'[limits]\nbackend = "redis"\nurl = "{server.url}"\ntimeout = 0.5\n'
        f'[[keys]]\nname = "alice"\nsha256 = "{key_table()["sha256"]}"\n'
        "tokens_per_minute = 100\n"
        f'[[keys]]\nname = "bob"\nsha256 = "{key_table(OTHER_SECRET)["sha256"]}"\n'
        "tokens_per_minute = 100\n"
    )
    return config


@asynccontextmanager
async def on_worker(url: str, pid: int) -> AsyncIterator[httpx.AsyncClient]:
    """A client whose keep-alive connection is served by the worker ``pid``."""
    for _ in range(300):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            if await worker_pid(client, url) == pid:
                yield client
                return
    raise AssertionError(f"no connection reached worker {pid}")


async def test_done_when_two_workers_share_a_budget_against_an_upstream_without_usage(
    nursery: trio.Nursery, tmp_path: Path, redis_server: RedisServer
) -> None:
    fake = await start_fake(nursery, ttft=0.0, interval=0.005, tokens=30, usage=False)
    config = done_when_config(tmp_path, redis_server, fake.url)
    with trio.fail_after(90):
        process, url = await start_sluice(config, "--workers", "2")
        try:
            pids: set[int] = set()
            for _ in range(300):
                async with httpx.AsyncClient(timeout=10, trust_env=False) as probe:
                    pids.add(await worker_pid(probe, url))
                if len(pids) == 2:
                    break
            assert len(pids) == 2, "the kernel sent every connection to one worker"
            workers = sorted(pids)

            # Non-streamed 30-token answers, each on the other worker than the one before.
            statuses: list[int] = []
            refusal: httpx.Response | None = None
            for attempt in range(6):
                async with on_worker(url, workers[attempt % 2]) as client:
                    response = await client.post(
                        url + CHAT, json=chat_body(stream=False), headers=bearer()
                    )
                statuses.append(response.status_code)
                if response.status_code == 429:
                    refusal = response
                    break
            assert refusal is not None and statuses.index(429) in (3, 4), statuses
            assert refusal.json()["error"]["code"] == "token_limit_exceeded"
            assert 1 <= int(refusal.headers["retry-after"]) <= 60
            assert refusal.headers["x-ratelimit-limit-tokens"] == "100"

            # Streams the client leaves after about 40 tokens, alternating workers likewise.
            tries: list[int] = []
            long_stream = chat_body(fake={"tokens": 5000, "interval": 0.01})
            for attempt in range(6):
                async with (
                    on_worker(url, workers[attempt % 2]) as client,
                    client.stream(
                        "POST", url + CHAT, json=long_stream, headers=bearer(OTHER_SECRET)
                    ) as response,
                ):
                    tries.append(response.status_code)
                    if response.status_code != 200:
                        break
                    seen = 0
                    async for chunk in response.aiter_bytes():
                        seen += chunk.count(b"data:")
                        if seen >= 40:
                            break
                # The worker settles as the relay closes: let it, before the next try.
                await trio.sleep(0.3)
            assert 429 in tries and tries.index(429) <= 3, tries
        finally:
            await stop(process)
