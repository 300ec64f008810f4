"""Per-key limits shared through a real Redis (``[limits] backend = "redis"``).

Each test starts its own ``redis-server`` (Debian's package, which ``make test`` installs when it
may) on a free loopback port, without persistence, and kills it at the end; without the binary
these tests skip, saying so. The multi-worker tests run a real ``sluice serve --workers 2``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxy.api.auth import KeyRing
from proxy.api.limits import RedisLimits
from proxy.config import KeyConfig, LimitsConfig
from proxy.protocol.errors import ApiError
from tests.api.test_auth import bearer, key_table
from tests.contracts.test_drain import start_sluice, stop
from tests.ops.test_metrics import scrape, value
from tests.support import DEADLINE, chat_body, sse_payloads, start_fake, start_proxy

CHAT = "/v1/chat/completions"
REDIS_SERVER = shutil.which("redis-server")

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (`make redis` installs Debian's package when root)",
)


class RedisServer:
    """A throwaway redis-server on 127.0.0.1: stopped, frozen and started again at will."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert REDIS_SERVER is not None
        self.process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert self.process.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                os.kill(self.process.pid, signal.SIGCONT)
                self.process.kill()
            self.process.wait()
            self.process = None

    def freeze(self) -> None:
        """Up but silent (SIGSTOP): connections open, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)


def limits(server: RedisServer, **settings: Any) -> dict[str, Any]:
    """A generous per-call timeout: with on_error = "deny", a call that a loaded machine makes
    slow would be a 503. The tests of the timeout itself pass their own."""
    return {"backend": "redis", "url": server.url, "timeout": 2.0, **settings}


def store(server: RedisServer, **settings: Any) -> RedisLimits:
    return RedisLimits(LimitsConfig(**limits(server, **settings)))


def key(**settings: int) -> KeyConfig:
    return KeyConfig(name="alice", sha256="0" * 64, **settings)


async def refused(store: RedisLimits, key: KeyConfig) -> ApiError:
    with pytest.raises(ApiError) as caught:
        await store.acquire(key)
    return caught.value


# -- the store itself -------------------------------------------------------------------------


async def test_the_window_is_exact_and_a_refusal_says_when_the_oldest_leaves(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        limited = store(redis_server)
        alice = key(requests_per_minute=3)
        for _ in range(3):
            assert await limited.acquire(alice) is None  # no slot to hold
        error = await refused(limited, alice)
        assert (error.status, error.code) == (429, "rate_limit_exceeded")
        # All three were admitted within the last few seconds (a loaded machine may take a few):
        # the first leaves in a little under 60 s.
        assert 55 <= int(error.headers["Retry-After"]) <= 60
        assert error.headers["x-ratelimit-limit-requests"] == "3"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.headers["x-ratelimit-reset-requests"].endswith("s")
        # Another key has its own window; another prefix (deployment) its own keys.
        assert await limited.acquire(KeyConfig(name="bob", sha256="1" * 64)) is None
        assert await store(redis_server, key_prefix="other:").acquire(alice) is None


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_a_requests_per_minute_429_says_the_limit_as_openai_does(
    nursery: trio.Nursery, request: pytest.FixtureRequest, backend: str
) -> None:
    """Over HTTP, from either store: the refusal carries OpenAI's request-window headers, as
    the token budget's carries the token ones, and a browser script may read them."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=1)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(requests_per_minute=2)],
            limits=(
                limits(request.getfixturevalue("redis_server"))
                if backend == "redis"
                else {"backend": "memory"}
            ),
            server={"cors_origins": ["https://app.example"]},
        )
        headers = {**bearer(), "Origin": "https://app.example"}
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            statuses = [
                (await client.post(proxy.url + CHAT, json=chat_body(), headers=headers))
                for _ in range(3)
            ]
    assert [response.status_code for response in statuses] == [200, 200, 429]
    refusal = statuses[-1]
    assert refusal.json()["error"]["code"] == "rate_limit_exceeded"
    assert refusal.headers["x-ratelimit-limit-requests"] == "2"
    assert refusal.headers["x-ratelimit-remaining-requests"] == "0"
    # Both admitted within the last few seconds (a loaded machine may take a few): the first
    # leaves the window in a little under a minute.
    reset = refusal.headers["x-ratelimit-reset-requests"]
    assert re.fullmatch(r"\d+(\.\d+)?s|1m0s", reset), reset  # as "6m0s", "1.5s" are written
    assert 55 <= (60 if reset == "1m0s" else float(reset[:-1])) <= 60, reset
    assert 55 <= int(refusal.headers["Retry-After"]) <= 60
    exposed = refusal.headers["access-control-expose-headers"].lower()
    assert "x-ratelimit-reset-requests" in exposed


async def test_both_limits_are_checked_before_either_is_charged(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        limited = store(redis_server)
        alice = key(requests_per_minute=2, max_concurrent_streams=1)
        lease = await limited.acquire(alice)
        assert lease is not None
        for _ in range(3):
            error = await refused(limited, alice)
            assert (error.code, error.headers["Retry-After"]) == ("concurrency_limit_exceeded", "1")
        await lease.release()
        # The three refusals cost no requests per minute: one more is admitted.
        second = await limited.acquire(alice)
        assert second is not None
        await second.release()
        assert (await refused(limited, alice)).code == "rate_limit_exceeded"


async def test_a_lease_lives_while_renewed_and_expires_when_not(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        # Renewed every third of a lease: only a stall of two thirds (0.67 s) could expire it
        # while renewed, well past what a loaded machine stalls.
        lease_seconds = 1.0
        limited = store(redis_server, lease_seconds=lease_seconds)
        alice = key(max_concurrent_streams=1)
        lease = await limited.acquire(alice)
        assert lease is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lease.keep_renewed)
            await trio.sleep(1.2 * lease_seconds)  # longer than a lease: alive by its renewals
            assert (await refused(limited, alice)).code == "concurrency_limit_exceeded"
            nursery.cancel_scope.cancel()
        stopped = trio.current_time()
        # Not renewed any more (as if its holder had crashed): it expires and frees the slot.
        # Waited for rather than slept on; a lease that never expired fails at the deadline.
        while True:
            try:
                again = await limited.acquire(alice)
            except ApiError as error:
                assert error.code == "concurrency_limit_exceeded"
                await trio.sleep(0.05)
            else:
                break
        assert again is not None
        await again.release()
        # Within about a lease of its last renewal (the margin: what a loaded machine may take).
        assert trio.current_time() - stopped < lease_seconds + 2.0


async def test_an_admission_whose_answer_is_lost_gives_back_what_it_took(
    redis_server: RedisServer,
) -> None:
    """The admit script ran in Redis, but its caller was cancelled (its client left) before the
    answer came: the stream slot and the token reservation it took are given back at once,
    not held until the lease expires."""
    with trio.fail_after(DEADLINE):
        limited = store(redis_server)
        alice = key(max_concurrent_streams=1, tokens_per_minute=1_000)
        ran = trio.Event()
        await limited._connected()
        admit = limited._admit

        async def admit_then_lose_the_answer(**kwargs: Any) -> Any:
            await admit(**kwargs)
            ran.set()
            await trio.sleep_forever()

        limited._admit = admit_then_lose_the_answer
        async with trio.open_nursery() as nursery:
            nursery.start_soon(limited.acquire, alice, 100)
            await ran.wait()
            nursery.cancel_scope.cancel()
        limited._admit = admit
        client = await limited._connected()
        for kind in ("streams", "pending"):
            assert await client.zcard(f"sluice:{{{alice.name}}}:{kind}") == 0, kind
        # The slot is free for the next request.
        lease = await limited.acquire(alice, 100)
        assert lease is not None
        await lease.release()


async def test_keyring_uses_the_store_only_for_redis() -> None:
    assert KeyRing([]).shared is None
    assert KeyRing([], LimitsConfig(backend="redis")).shared is not None


# -- several workers --------------------------------------------------------------------------


def worker_config(tmp_path: Path, server: RedisServer, extra: str, **key: int) -> Path:
    config = tmp_path / "workers.toml"
    limits_table = "".join(f"{name} = {value}\n" for name, value in key.items())
    config.write_text(
        "[server]\nport = 0\n"
        "[fake_upstream]\nenabled = true\nttft = 0\ninterval = 0.05\ntokens = 3\n"
        '[models.fake-model]\nupstreams = ["fake:"]\n'
        f'[limits]\nbackend = "redis"\nurl = "{server.url}"\ntimeout = 0.5\n{extra}'
        f'[[keys]]\nname = "alice"\nsha256 = "{key_table()["sha256"]}"\n{limits_table}'
    )
    return config


async def worker_pid(client: httpx.AsyncClient, url: str) -> int:
    pid = (await client.get(url + "/healthz")).json()["pid"]
    assert isinstance(pid, int)
    return pid


async def test_two_workers_share_one_requests_per_minute(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    config = worker_config(tmp_path, redis_server, "", requests_per_minute=10)
    with trio.fail_after(60):
        process, url = await start_sluice(config, "--workers", "2")
        try:
            statuses: list[int] = []
            pids: set[int] = set()
            # At least 30, and on until both workers have answered: the kernel picks the worker
            # of each fresh connection, and may favour one for a while.
            while len(statuses) < 30 or (len(pids) < 2 and len(statuses) < 300):
                # A fresh connection each time; /healthz on it first says which worker it is.
                async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                    pids.add(await worker_pid(client, url))
                    response = await client.post(
                        url + CHAT, json=chat_body(stream=False), headers=bearer()
                    )
                    statuses.append(response.status_code)
            assert len(pids) == 2, "the kernel sent every connection to one worker"
            assert statuses.count(200) == 10
            assert statuses.count(429) == len(statuses) - 10
            assert statuses[:10] == [200] * 10
        finally:
            await stop(process)


async def test_two_workers_share_concurrency_and_a_killed_workers_slot_expires(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    lease_seconds = 1.5
    config = worker_config(
        tmp_path, redis_server, f"lease_seconds = {lease_seconds}\n", max_concurrent_streams=2
    )
    long_stream = chat_body(fake={"tokens": 10_000})
    with trio.fail_after(60):
        process, url = await start_sluice(config, "--workers", "2")
        # The supervisor takes a worker that dies in its first 5 s for one that cannot start
        # (and stops them all); after that, it restarts it.
        killable_at = trio.current_time() + 5.5
        try:
            holders: list[int] = []
            async with trio.open_nursery() as nursery:

                async def hold(ready: trio.Event) -> None:
                    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
                        holders.append(await worker_pid(client, url))
                        # The same keep-alive connection: the same worker.
                        async with client.stream(
                            "POST", url + CHAT, json=long_stream, headers=bearer()
                        ) as response:
                            assert response.status_code == 200
                            ready.set()
                            try:
                                async for _ in response.aiter_bytes():
                                    pass
                            except httpx.HTTPError:
                                pass  # its worker was killed

                for _ in range(2):
                    ready = trio.Event()
                    nursery.start_soon(hold, ready)
                    await ready.wait()
                # Both slots are taken, whichever worker a third request reaches.
                refusers: set[int] = set()
                for _ in range(300):
                    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                        refusers.add(await worker_pid(client, url))
                        third = await client.post(url + CHAT, json=chat_body(), headers=bearer())
                        assert third.status_code == 429
                        assert third.json()["error"]["code"] == "concurrency_limit_exceeded"
                    if len(refusers) == 2:
                        break
                assert len(refusers) == 2, "the kernel sent every connection to one worker"

                # SIGKILL the first stream's worker: nothing releases its slot but the expiry.
                await trio.sleep_until(killable_at)
                os.kill(holders[0], signal.SIGKILL)
                killed_at = trio.current_time()
                freed_after = None
                async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                    while freed_after is None:
                        response = await client.post(
                            url + CHAT,
                            json=chat_body(stream=False),
                            headers={**bearer(), "Connection": "close"},
                        )
                        if response.status_code == 200:
                            freed_after = trio.current_time() - killed_at
                        else:
                            assert response.status_code == 429
                            await trio.sleep(0.1)
                # Renewed every 0.5 s, so the dead worker's lease had 1.0-1.5 s left.
                assert 0.7 < freed_after < lease_seconds + 1.0
                nursery.cancel_scope.cancel()
        finally:
            await stop(process)


# -- Redis stopped or frozen mid-run -----------------------------------------------------------


@pytest.mark.parametrize("failure", ["stopped", "frozen"])
@pytest.mark.parametrize("on_error", ["deny", "allow"])
async def test_redis_failing_mid_run_gets_on_error_in_bounded_time(
    nursery: trio.Nursery, redis_server: RedisServer, on_error: str, failure: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=3)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(requests_per_minute=100, max_concurrent_streams=5)],
            limits=limits(redis_server, on_error=on_error, timeout=0.25),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            ok = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            assert sse_payloads(ok.text)[-1] == "[DONE]"
            if failure == "stopped":
                redis_server.stop()
            else:
                redis_server.freeze()
            for _ in range(3):
                started = trio.current_time()
                response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
                # Bounded by [limits] timeout (0.25 s), not by Redis.
                assert trio.current_time() - started < 1.0
                if on_error == "deny":
                    assert response.status_code == 503
                    assert response.headers["retry-after"] == "1"
                    error = response.json()["error"]
                    assert (error["type"], error["code"]) == ("server_error", "limits_unavailable")
                else:
                    assert response.status_code == 200
                    assert sse_payloads(response.text)[-1] == "[DONE]"
            samples = await scrape(client, proxy)
            outcome = "denied" if on_error == "deny" else "allowed"
            assert value(samples, "sluice_limits_errors_total", operation="admit") == 3
            assert (
                value(samples, "sluice_limits_errors_total", operation="admit", outcome=outcome)
                == 3
            )
            # Redis back: counted again.
            redis_server.stop()
            redis_server.start()
            again = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            assert again.status_code == 200


async def test_a_stream_admitted_before_redis_stops_runs_on_and_its_release_is_counted(
    nursery: trio.Nursery, redis_server: RedisServer
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.05, tokens=20)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(max_concurrent_streams=1)],
            limits=limits(redis_server, lease_seconds=0.3),
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            async with client.stream(
                "POST", proxy.url + CHAT, json=chat_body(), headers=bearer()
            ) as response:
                assert response.status_code == 200
                text = ""
                async for chunk in response.aiter_text():
                    if not text:
                        redis_server.stop()
                    text += chunk
            # The stream was not cut: renewals and the release failed, and were counted.
            assert sse_payloads(text)[-1] == "[DONE]"
            samples = await scrape(client, proxy)
            assert value(samples, "sluice_limits_errors_total", operation="renew") >= 1
            assert value(samples, "sluice_limits_errors_total", operation="release") == 1
