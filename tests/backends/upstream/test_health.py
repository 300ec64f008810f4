"""Replica health and hedging: ejection, half-open recovery, active checks, 503 when none is
healthy, and a hedged request whose loser's connection is closed."""

from __future__ import annotations

import socket

import httpx
import trio

from proxy.backends.upstream.routing import HealthPolicy, LeastBusyRouter, ReplicaLoad
from tests.support import (
    DEADLINE,
    chat_body,
    poll_until,
    read_request_head,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"


def test_consecutive_failures_eject_then_a_probe_brings_back() -> None:
    router = LeastBusyRouter(HealthPolicy(failure_threshold=2, ejection_seconds=10))
    a, b = ReplicaLoad("a"), ReplicaLoad("b")
    router.failure(a, now=0)
    assert router.choose([a, b], now=0) is not None and not a.ejected(0)
    router.failure(a, now=1)
    assert a.ejected(1)
    assert {router.choose([a, b], now=2) for _ in range(3)} == {b}
    assert router.choose([a], now=2) is None  # only an ejected replica: nothing to try
    assert router.next_recovery([a, b], now=2) == 9
    # Ejection over: one probe at a time goes to the half-open replica.
    assert router.choose([a], now=11) is a and a.probing
    assert router.choose([a], now=11) is None
    router.failure(a, now=11.5)  # the probe failed: ejected again at once
    assert a.ejected(12) and not a.probing
    assert router.choose([a], now=22) is a
    router.success(a)
    assert a.healthy() and a.consecutive_failures == 0 and not a.probing


def test_a_half_open_replica_gets_one_probe_then_waits_for_its_verdict() -> None:
    router = LeastBusyRouter(HealthPolicy(failure_threshold=1, ejection_seconds=1))
    a, b = ReplicaLoad("a"), ReplicaLoad("b")
    router.failure(a, now=0)
    assert router.choose([a, b], now=0.5) is b  # still ejected
    assert router.choose([a, b], now=5) is a  # the probe, even though b is healthy
    assert router.choose([a, b], now=5) is b  # one probe at a time
    router.release_probe(a)  # the probe's client left: no verdict, another may probe
    assert not a.probing
    assert router.choose([a, b], now=5) is a


async def test_ejection_and_recovery(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        flaky = await start_fake(nursery, mode="status", status=500, ttft=0)
        steady = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(
            nursery,
            {"m": [flaky.url, steady.url]},
            # Long enough for the three requests that find it ejected, however slow the
            # machine: the test waits for the ejection's end rather than sleeping past it.
            upstream={"failure_threshold": 2, "ejection_seconds": 1.5},
        )
        (load,) = [r.load for r in proxy.state.replicas.values() if r.url == flaky.url]
        for _ in range(2):  # each fails on the flaky replica, then succeeds on the other
            response = await client.post(proxy.url + CHAT, json=chat_body("m"))
            assert response.status_code == 200
        assert len(flaky.recorder.records) == 2
        assert load.ejected(trio.current_time())
        for _ in range(3):  # ejected: not even tried
            assert (await client.post(proxy.url + CHAT, json=chat_body("m"))).status_code == 200
        assert load.ejected(trio.current_time()), "the three took longer than the ejection"
        assert len(flaky.recorder.records) == 2
        flaky.upstream.settings.mode = "ok"  # it recovers...
        # ...and once the ejection is over, a probe finds out.
        await poll_until(lambda: not load.ejected(trio.current_time()), interval=0.05)
        for _ in range(4):
            assert (await client.post(proxy.url + CHAT, json=chat_body("m"))).status_code == 200
        assert len(flaky.recorder.records) >= 4  # back in rotation


async def test_no_healthy_replica_is_503(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        broken = await start_fake(nursery, mode="status", status=500, ttft=0)
        proxy = await start_proxy(
            nursery,
            {"m": [broken.url]},
            upstream={"failure_threshold": 1, "ejection_seconds": 30},
        )
        assert (await client.post(proxy.url + CHAT, json=chat_body("m"))).status_code == 502
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_upstream"
        assert 25 <= int(response.headers["retry-after"]) <= 30
        assert len(broken.recorder.records) == 1


async def test_active_health_checks(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        late_port = probe.getsockname()[1]
    with trio.fail_after(DEADLINE):
        steady = await start_fake(nursery, ttft=0, interval=0, tokens=1)
        proxy = await start_proxy(
            nursery,
            {"m": [f"http://127.0.0.1:{late_port}", steady.url]},
            upstream={
                "health_check_path": "/health",
                "health_check_interval": 0.05,
                "failure_threshold": 1,
                # Long: only a successful active check may bring it back, not a probe.
                "ejection_seconds": 30,
            },
        )
        late = proxy.state.replicas[f"http://127.0.0.1:{late_port}"].load
        # Nothing listens there yet: the checks eject it before any client is hurt.
        await poll_until(lambda: late.ejected(trio.current_time()))
        assert (await client.post(proxy.url + CHAT, json=chat_body("m"))).status_code == 200
        # It comes up: the next successful check brings it back.
        await start_fake_on(nursery, late_port)
        await poll_until(late.healthy)


async def start_fake_on(nursery: trio.Nursery, port: int) -> None:
    from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

    await nursery.start(FakeUpstream(FakeSettings()).serve, "127.0.0.1", port)


async def test_hedged_first_token_closes_the_loser(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        slow = await start_fake(nursery, ttft=10, interval=0.01, tokens=3)
        fast = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
        proxy = await start_proxy(
            nursery, {"m": {"upstreams": [slow.url, fast.url], "hedge_after": 0.2}}
        )
        started = trio.current_time()
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 200
        assert stream_text(sse_payloads(response.text)) == "The quick brown "
        assert trio.current_time() - started < 2  # not the slow replica's 10 s
        # The slow replica got the request first, then saw its connection closed as soon as
        # the hedge won.
        await slow.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        loser = slow.recorder.last()
        winner = fast.recorder.last()
        assert winner.first_token_at is not None
        assert loser.disconnected_at - winner.first_token_at < 0.05
        assert loser.received_at < winner.received_at
        await proxy.state.tracker.wait_idle()
        assert proxy.state.replicas[slow.url].pool_connections() == []
        # A replica that answers within hedge_after is never hedged.
        response = await client.post(proxy.url + CHAT, json=chat_body("m", fake={"ttft": 0.01}))
        assert response.status_code == 200
        assert len(slow.recorder.records) + len(fast.recorder.records) == 3


async def test_a_stream_that_started_within_hedge_after_is_never_hedged(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """However long it streams: the hedge is for a first token that does not come."""
    with trio.fail_after(DEADLINE):
        # The first token comes in 0.01 s; hedge_after leaves a loaded machine a second to
        # relay it, and the stream goes on past it (26 tokens 0.05 s apart).
        hedge_after = 1.0
        fakes = [await start_fake(nursery, ttft=0.01, interval=0.05, tokens=26) for _ in range(2)]
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url for fake in fakes], "hedge_after": hedge_after}},
        )
        started = trio.current_time()
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 200
        # It streamed well past hedge_after.
        assert trio.current_time() - started > hedge_after + 0.2
        assert sse_payloads(response.text)[-1] == "[DONE]"
        await proxy.state.tracker.wait_idle()
    assert sum(len(fake.recorder.records) for fake in fakes) == 1


async def serve_health_requiring(
    authorization: str, seen: list[str | None], task_status: trio.TaskStatus[int]
) -> None:
    """A hosted API's health endpoint: 200 with the right key, 401 without it."""

    async def handle(stream: trio.SocketStream) -> None:
        received = await read_request_head(stream)
        if received is None:
            return
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (
                line.decode().partition(":") for line in received.split(b"\r\n")[1:] if line
            )
        }
        seen.append(headers.get("authorization"))
        ok = headers.get("authorization") == authorization
        status = b"200 OK" if ok else b"401 Unauthorized"
        await stream.send_all(
            b"HTTP/1.1 %b\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % status
        )
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def test_health_checks_send_the_upstream_key(nursery: trio.Nursery) -> None:
    seen: list[str | None] = []
    with trio.fail_after(DEADLINE):
        port = await nursery.start(serve_health_requiring, "Bearer sk-upstream", seen)
        proxy = await start_proxy(
            nursery,
            {"hosted": {"upstreams": [f"http://127.0.0.1:{port}"], "api_key_env": "HOSTED_KEY"}},
            env={"HOSTED_KEY": "sk-upstream"},
            upstream={
                "health_check_path": "/health",
                # Also each check's time to answer: one failure ejects, so a loaded machine
                # must not make a check late.
                "health_check_interval": 0.5,
                "failure_threshold": 1,
            },
        )
        await poll_until(lambda: len(seen) >= 2)  # the key on every check, not the first alone
        assert set(seen) == {"Bearer sk-upstream"}
        assert proxy.state.replicas[f"http://127.0.0.1:{port}"].load.healthy()
