"""A model's ``balance``: upstream_metrics (the replicas' own /metrics) and prefix_affinity
(rendezvous hashing of the prompt's prefix, bounded by load). Pure tests of the parsing, the
scores and the hashing first, then both balances end to end over fake replicas on loopback."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.routing import (
    WAITING_WEIGHT,
    AffinityRouter,
    MetricsRouter,
    ReplicaLoad,
    Scrape,
    metrics_score,
    overloaded,
    router_for,
)
from proxy.protocol.affinity import affinity_key, prompt_prefix, rendezvous_order
from proxy.protocol.api_request import parse_api_request
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.replica_metrics import MetricsParseError, ReplicaMetrics, parse_replica_metrics
from tests.support import DEADLINE, Fake, poll_until, start_fake, start_proxy

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="other"} 40.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
vllm:time_to_first_token_seconds_count{model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.1
"""


def test_vllm_metrics_sum_the_models_label_sets() -> None:
    assert parse_replica_metrics(VLLM, "m") == ReplicaMetrics(waiting=5, running=5, kv_usage=0.5)


def test_a_model_not_named_in_the_labels_takes_every_sample() -> None:
    # A server serving its one model under another name.
    assert parse_replica_metrics(VLLM, "renamed").running == 45


def test_older_vllm_gpu_cache_usage_and_llamacpp() -> None:
    old = (
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.9\n"
    )
    assert parse_replica_metrics(old) == ReplicaMetrics(waiting=0, running=1, kv_usage=0.9)
    llamacpp = (
        "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
        "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 7\n"
    )
    assert parse_replica_metrics(llamacpp, "m") == ReplicaMetrics(waiting=7, running=2)


@pytest.mark.parametrize("text", ["", "process_cpu_seconds_total 3\n", "<html>not</html>"])
def test_a_scrape_without_load_gauges_is_refused(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_replica_metrics(text, "m")


def test_metrics_score_formula_and_fallbacks() -> None:
    load = ReplicaLoad("http://a", in_flight=3)
    scrape = Scrape(ReplicaMetrics(waiting=2, running=5, kv_usage=0.5), at=10.0, started=7)
    # 4 x waiting + running + min(started since, in flight) + kv usage
    assert metrics_score(load, scrape, 11.0, 6.0) == (WAITING_WEIGHT * 2 + 5 + 3 + 0.5, True)
    # Stale, failed, never scraped: least_busy's in-flight count.
    assert metrics_score(load, scrape, 16.5, 6.0) == (3.0, False)
    assert metrics_score(load, Scrape(None, at=10.0), 11.0, 6.0) == (3.0, False)
    assert metrics_score(load, None, 11.0, 6.0) == (3.0, False)


def test_metrics_router_prefers_the_idle_replica_and_spreads_a_burst() -> None:
    router = MetricsRouter(interval=1.0)
    a, b = ReplicaLoad("http://a"), ReplicaLoad("http://b")
    router.observe(a, ReplicaMetrics(waiting=1, running=6), now=0.0)
    router.observe(b, ReplicaMetrics(waiting=0, running=2), now=0.0)
    picks = []
    for _ in range(12):
        decision = router.decide([a, b], now=0.5)
        assert decision.reason == "metrics"
        assert decision.replica is not None
        decision.replica.in_flight += 1  # as the backend does for the attempt
        picks.append(decision.replica.url)
    # b at 2 running takes the burst until its score meets a's 4 x 1 + 6, then they share.
    assert picks[:8] == ["http://b"] * 8
    assert set(picks[8:]) == {"http://a", "http://b"}
    # A new scrape resets the since-the-scrape count.
    router.observe(b, ReplicaMetrics(waiting=0, running=2), now=0.6)
    assert router.score(b, 0.6) == (2.0 + min(0, b.in_flight), True)


def test_metrics_router_falls_back_per_replica_and_keeps_health() -> None:
    router = MetricsRouter(interval=1.0)
    a, b = ReplicaLoad("http://a"), ReplicaLoad("http://b", in_flight=1)
    router.observe(a, ReplicaMetrics(waiting=50, running=50), now=0.0)
    router.observe(b, ReplicaMetrics(waiting=0, running=0), now=0.0)
    router.failed(b)
    # b's failed scrape: its in-flight count (1) against a's fresh 250.
    assert router.decide([a, b], now=0.1).replica is b
    assert router.decide([a, b], now=0.1).reason == "fallback"
    # Both stale (older than 3 intervals): least_busy.
    b.in_flight = 5
    assert router.decide([a, b], now=3.5) == router.decide([a, b], now=3.5)
    assert router.decide([a, b], now=3.5).replica is a
    # An ejected replica is never chosen, however idle its metrics; half-open: one probe.
    router.observe(b, ReplicaMetrics(waiting=0, running=0), now=10.0)
    for _ in range(3):
        router.failure(b, now=10.0)
    assert all(router.choose([a, b], now=11.0) is a for _ in range(5))
    probe = router.decide([a, b], now=10.0 + router.policy.ejection_seconds)
    assert probe.replica is b and probe.reason == "probe"


def chat(*messages: tuple[str, str], model: str = "m", **extra: Any) -> CompletionRequest:
    body = {"model": model, "messages": [{"role": r, "content": c} for r, c in messages], **extra}
    return parse_api_request(json.dumps(body).encode(), Endpoint.CHAT)


def test_affinity_key_is_the_canonical_prefix() -> None:
    system = ("system", "You are terse. " * 100)  # longer than the prefix
    first = chat(system, ("user", "hi"))
    grown = chat(system, ("user", "hi"), ("assistant", "hello"), ("user", "more"))
    # Same words in other JSON (spacing, key order): the same key.
    turns = [system, ("user", "hi")]
    raw = json.dumps(
        {"messages": [{"content": c, "role": r} for r, c in turns], "model": "m"}, indent=2
    ).encode()
    reformatted = parse_api_request(raw, Endpoint.CHAT)
    key = affinity_key(first, 1024)
    assert affinity_key(grown, 1024) == key
    assert affinity_key(reformatted, 1024) == key
    assert affinity_key(chat(("system", "other"), ("user", "hi")), 1024) != key
    assert len(prompt_prefix(first, 1024)) == 1024
    # A session header's value wins over the prompt.
    assert affinity_key(first, 1024, "s1") == affinity_key(chat(("user", "x")), 1024, "s1")
    assert affinity_key(first, 1024, "s1") != affinity_key(first, 1024, "s2")


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (Endpoint.COMPLETIONS, {"prompt": "Once upon"}, b"Once upon"),
        (Endpoint.RESPONSES, {"instructions": "Be brief", "input": "Hi"}, b"Be brief"),
        (
            Endpoint.MESSAGES,
            {"system": "Sys", "max_tokens": 5, "messages": [{"role": "user", "content": "Q"}]},
            b"Sys",
        ),
        (Endpoint.EMBEDDINGS, {"input": "embed me"}, b"embed me"),
    ],
)
def test_each_endpoints_prompt_prefix(
    endpoint: Endpoint, body: dict[str, Any], expected: bytes
) -> None:
    request = parse_api_request(json.dumps({"model": "m", **body}).encode(), endpoint)
    assert expected in prompt_prefix(request, 1024)
    assert affinity_key(request, 1024) == affinity_key(request, 1024)


def test_rendezvous_is_stable_spread_and_moves_only_a_leavers_keys() -> None:
    names = ["http://a", "http://b", "http://c", "http://d"]
    keys = [affinity_key(chat(("user", f"conversation {i}")), 1024) for i in range(400)]
    owners = [names[rendezvous_order(key, names)[0]] for key in keys]
    assert owners == [names[rendezvous_order(key, names)[0]] for key in keys]
    assert all(60 <= count <= 140 for count in Counter(owners).values()), Counter(owners)
    without_c = [n for n in names if n != "http://c"]
    moved = [
        (before, without_c[rendezvous_order(key, without_c)[0]])
        for key, before in zip(keys, owners, strict=True)
    ]
    # Only c's keys move, and they move to the key's second choice.
    assert all(before == after for before, after in moved if before != "http://c")


def test_overload_bound() -> None:
    assert not overloaded(0, [0, 0], 1.5)
    assert not overloaded(1, [1, 0], 1.5)  # the +1: one request is no overload
    assert not overloaded(4, [4, 0], 1.5)
    assert overloaded(5, [5, 0], 1.5)
    assert not overloaded(10, [10, 2], 1.5)
    assert overloaded(11, [11, 2], 1.5)
    assert not overloaded(100, [100], 1.5)  # one replica: nowhere else to go


def test_affinity_router_hits_overflows_and_retries_on_the_next_choice() -> None:
    router = AffinityRouter(max_load=1.5)
    pool = [ReplicaLoad(f"http://r{i}") for i in range(3)]
    key = affinity_key(chat(("user", "pinned")), 1024)
    owner = router.decide(pool, key=key)
    assert owner.reason == "affinity_hit" and owner.replica is not None
    assert all(router.choose(pool, key=key) is owner.replica for _ in range(5))
    # A retry excludes the one tried: the key's next replica, the same every time.
    second = router.choose(pool, [owner.replica], key=key)
    assert second is not owner.replica
    assert router.choose(pool, [owner.replica], key=key) is second
    owner.replica.in_flight = 6  # mean 2: 6 > 1.5 x 2 + 1
    spill = router.decide(pool, key=key)
    assert spill.reason == "affinity_overflow" and spill.replica is not owner.replica
    # No key: least_busy.
    assert router.decide(pool).reason == "least_busy"


def test_router_for_each_balance() -> None:
    assert type(router_for("least_busy")).balance == "least_busy"
    assert isinstance(router_for("upstream_metrics", metrics_interval=0.5), MetricsRouter)
    assert isinstance(router_for("prefix_affinity"), AffinityRouter)
    with pytest.raises(ValueError):
        router_for("random")


# ----------------------------------------------------------------------------- end to end


def replica_of(fakes: list[Fake], content: str) -> list[int]:
    """Which fake served each request whose first message is ``content``, in order."""
    served = []
    for i, fake in enumerate(fakes):
        for record in fake.recorder.records:
            body = record.body or {}
            messages = body.get("messages") or [{}]
            if messages[0].get("content") == content:
                served.append((record.received_at, i))
    return [i for _, i in sorted(served)]


async def post(client: httpx.AsyncClient, url: str, content: str, **fake: Any) -> None:
    body: dict[str, Any] = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": content}],
        "stream": True,
    }
    if fake:
        body["fake"] = fake
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


def backend_of(proxy: Any) -> UpstreamBackend:
    backend = proxy.state.backends["fake-model"]
    assert isinstance(backend, UpstreamBackend)
    return backend


def decisions(proxy: Any, balance: str, reason: str) -> float:
    labels = {"model": "fake-model", "balance": balance, "reason": reason}
    value = proxy.state.metrics.registry.get_sample_value("sluice_routing_decisions_total", labels)
    return value or 0.0


BUSY = (
    'vllm:num_requests_running{model_name="fake-model"} 8\n'
    'vllm:num_requests_waiting{model_name="fake-model"} 6\n'
)


async def test_upstream_metrics_routes_to_the_idle_replica_then_falls_back(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        busy = await start_fake(nursery, ttft=0.005, interval=0.001, tokens=2, metrics_text=BUSY)
        idle = await start_fake(nursery, ttft=0.005, interval=0.001, tokens=2)
        fakes = [busy, idle]
        model = {
            "upstreams": [busy.url, idle.url],
            "balance": "upstream_metrics",
            # Each scrape has the interval to answer and is stale after three: a loaded machine
            # must not turn a scrape into a failure (least_busy) while the six go.
            "metrics_interval": 0.5,
        }
        proxy = await start_proxy(nursery, {"fake-model": model})
        backend = backend_of(proxy)
        router = backend.router
        assert isinstance(router, MetricsRouter)
        loads = [replica.load for replica in backend.replicas]
        await poll_until(lambda: all(router.scrape_of(load).metrics for load in loads))
        assert router.scrape_of(loads[0]).metrics == ReplicaMetrics(waiting=6, running=8)
        for _ in range(6):
            await post(client, proxy.url, "which one?")
        assert replica_of(fakes, "which one?") == [1] * 6
        assert decisions(proxy, "upstream_metrics", "metrics") == 6

        # The busy replica's scrape fails: least_busy for it (0 in flight), so it gets work.
        busy.upstream.settings.metrics_status = 500
        await poll_until(lambda: router.scrape_of(loads[0]).metrics is None)
        for _ in range(6):
            await post(client, proxy.url, "after the failure")
        assert 0 in replica_of(fakes, "after the failure")
        assert decisions(proxy, "upstream_metrics", "fallback") >= 1


async def test_prefix_affinity_pins_conversations_spreads_them_and_overflows(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fakes = [await start_fake(nursery, ttft=0.002, interval=0.001, tokens=2) for _ in range(2)]
        model = {"upstreams": [f.url for f in fakes], "balance": "prefix_affinity"}
        proxy = await start_proxy(nursery, {"fake-model": model})

        # Three prefixes, 8 requests each: each prefix >= 90% on one replica (here: all).
        for _ in range(8):
            for prefix in ("alpha", "beta", "gamma"):
                await post(client, proxy.url, f"{prefix} conversation")
        for prefix in ("alpha", "beta", "gamma"):
            served = Counter(replica_of(fakes, f"{prefix} conversation"))
            assert served.most_common(1)[0][1] >= 0.9 * 8, served
        assert decisions(proxy, "prefix_affinity", "affinity_hit") == 24

        # Different conversations spread over both replicas.
        owners = set()
        for i in range(16):
            await post(client, proxy.url, f"session {i}")
            owners.update(replica_of(fakes, f"session {i}"))
        assert owners == {0, 1}

        # Overloaded: five in flight on alpha's replica, none on the other: the next spills.
        (home,) = set(replica_of(fakes, "alpha conversation"))
        async with trio.open_nursery() as held:
            for _ in range(5):
                held.start_soon(partial_post, client, proxy.url)
            await poll_until(lambda: len(replica_of(fakes, "alpha conversation")) == 8 + 5)
            assert replica_of(fakes, "alpha conversation")[-5:] == [home] * 5
            await post(client, proxy.url, "alpha conversation")
            assert replica_of(fakes, "alpha conversation")[-1] == 1 - home
            assert decisions(proxy, "prefix_affinity", "affinity_overflow") == 1
            held.cancel_scope.cancel()


async def partial_post(client: httpx.AsyncClient, url: str) -> None:
    """alpha's conversation, held on its replica (a long first token) until cancelled."""
    await post(client, url, "alpha conversation", ttft=30)


async def test_a_session_header_pins_a_conversation_whatever_its_prompt(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fakes = [await start_fake(nursery, ttft=0.002, interval=0.001, tokens=2) for _ in range(3)]
        model = {
            "upstreams": [f.url for f in fakes],
            "balance": "prefix_affinity",
            "affinity_header": "X-Session-ID",
        }
        proxy = await start_proxy(nursery, {"fake-model": model})
        homes = {}
        for session in ("s-1", "s-2", "s-3", "s-4", "s-5", "s-6"):
            for turn in range(4):
                content = f"{session} turn {turn}"
                body = {"model": "fake-model", "messages": [{"role": "user", "content": content}]}
                response = await client.post(
                    f"{proxy.url}/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": session},  # header names are case-insensitive
                )
                assert response.status_code == 200, response.text
                homes.setdefault(session, set()).update(replica_of(fakes, content))
        # Each session's turns (different prompts) went to one replica; sessions spread.
        assert all(len(replicas) == 1 for replicas in homes.values()), homes
        assert len(set().union(*homes.values())) >= 2, homes
        # Without the header, the prompt's prefix decides, as before.
        await post(client, proxy.url, "no session here")
        assert len(replica_of(fakes, "no session here")) == 1


async def scraped_again(scrape: Scrape) -> None:
    """Until the replica's next good scrape (the router updates its ``Scrape`` in place)."""
    at = scrape.at
    await poll_until(lambda: scrape.at > at)


def waiting_at(count: int) -> str:
    return (
        'vllm:num_requests_running{model_name="fake-model"} 8\n'
        f'vllm:num_requests_waiting{{model_name="fake-model"}} {count}\n'
    )


async def test_a_replica_whose_own_queue_is_over_the_threshold_has_no_room(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """With upstream_metrics, Sluice holds requests while the engine's scraped queue is over
    max_upstream_waiting (its queue is first come, first served; Sluice's is fair), and sends
    them once a scrape says it has come down."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(
            nursery, ttft=0.005, interval=0.001, tokens=2, metrics_text=waiting_at(3)
        )
        model = {
            "upstreams": [fake.url],
            "balance": "upstream_metrics",
            # A scrape that fails (no answer within the interval) pokes the room, and the held
            # request would go: long enough that a loaded machine's scrape still answers.
            "metrics_interval": 0.4,
            "max_upstream_waiting": 3,
        }
        proxy = await start_proxy(nursery, {"fake-model": model})
        backend = backend_of(proxy)
        router = backend.router
        assert isinstance(router, MetricsRouter)
        (load,) = [replica.load for replica in backend.replicas]
        await poll_until(lambda: router.scrape_of(load).metrics is not None)
        await post(client, proxy.url, "at the threshold")  # 3 waiting: still room
        assert len(fake.recorder.records) == 1

        fake.upstream.settings.metrics_text = waiting_at(4)
        await poll_until(lambda: router.waiting(load, trio.current_time()) == 4)
        async with trio.open_nursery() as inner:
            inner.start_soon(post, client, proxy.url, "over it")
            await poll_until(lambda: backend.admission.waiting == 1)
            # Another scrape, which pokes the room, and every task done with that poke: still
            # over, still held.
            await scraped_again(router.scrape_of(load))
            await trio.testing.wait_all_tasks_blocked()
            assert len(fake.recorder.records) == 1
            fake.upstream.settings.metrics_text = waiting_at(0)
        assert len(fake.recorder.records) == 2
        assert backend.admission.waiting == 0
