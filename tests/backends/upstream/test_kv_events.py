"""A replica's KV-event subscriber against a fake vLLM publisher on real ZeroMQ sockets
(127.0.0.1, random ports): batches applied to the replica's index, a gap replayed or the index
dropped (logged and counted), a publisher that restarted, a malformed message restarting the
subscription after a backoff (under virtual time), and cancellation leaving no socket."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import trio
import trio.testing
import zmq

from proxy.backends.upstream import kv_events
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.backends.upstream.kv_events import (
    BACKOFF_MAX,
    HEALTHY_SECONDS,
    GapOutcome,
    KvEventSubscriber,
    MetricsObserver,
    Publisher,
    backoff_seconds,
    publisher_of,
)
from proxy.backends.upstream.routing import CacheAwareRouter
from proxy.backends.upstream.tokenize import Tokenizer, tokenize_body
from proxy.ops.metrics import Metrics
from proxy.protocol.api_request import parse_api_request
from proxy.protocol.kv_cache import Applied, BlockIndex, block_keys
from proxy.protocol.kv_events import KvEventsError
from proxy.protocol.openai import CompletionRequest, Endpoint
from proxy.protocol.prompt_memory import Recalled
from proxy.testing.kv_events import (
    FakeVllmPublisher,
    all_cleared,
    block_removed,
    block_stored,
    serving,
    vllm_hashes,
)
from tests.support import DEADLINE, poll_until, start_fake, start_proxy

BS = 4
SEED = b"seed"


class Recorder:
    def __init__(self) -> None:
        self.batches = 0
        self.gaps: list[GapOutcome] = []
        self.restarts = 0

    def batch(self, applied: Applied, indexed: int) -> None:
        self.batches += 1

    def gap(self, outcome: GapOutcome) -> None:
        self.gaps.append(outcome)

    def restart(self) -> None:
        self.restarts += 1


def prompt(n_blocks: int, first: int = 1000) -> list[int]:
    return list(range(first, first + n_blocks * BS))


def chain(tokens: list[int], *, start: int = 0, parent: bytes | None = None) -> object:
    """BlockStored for the blocks of ``tokens`` from block ``start`` (vLLM's hashes)."""
    hashes = vllm_hashes(tokens, BS, SEED)
    return block_stored(hashes[start:], parent, tokens[start * BS :], BS)


@pytest.fixture
async def publisher() -> AsyncIterator[FakeVllmPublisher]:
    async with serving() as fake:
        yield fake


async def subscribe(
    nursery: trio.Nursery, publisher: FakeVllmPublisher, *, replay: bool = True
) -> tuple[BlockIndex, Recorder]:
    index, recorder = BlockIndex(1000), Recorder()
    where = Publisher(publisher.endpoint, publisher.replay_endpoint if replay else "")
    subscriber = KvEventSubscriber("test replica", where, index, recorder)
    await nursery.start(subscriber.run)
    await publisher.subscribed()
    return index, recorder


async def test_batches_build_the_replicas_index(
    nursery: trio.Nursery, publisher: FakeVllmPublisher
) -> None:
    with trio.fail_after(DEADLINE):
        index, recorder = await subscribe(nursery, publisher)
        tokens = prompt(3)
        publisher.publish([chain(tokens[:8])])
        await poll_until(lambda: len(index) == 2)
        assert index.matched(block_keys(tokens, BS)) == 2
        # The third block, a child of the second, in a map-encoded (newer vLLM) event.
        hashes = vllm_hashes(tokens, BS, SEED)
        event = block_stored(hashes[2:], hashes[1], tokens[8:], BS, maps=True)
        publisher.publish([event])
        await poll_until(lambda: index.matched(block_keys(tokens, BS)) == 3)
        publisher.publish([block_removed(hashes[1:])])
        await poll_until(lambda: len(index) == 1)
        publisher.publish([all_cleared()])
        await poll_until(lambda: len(index) == 0)
        assert recorder.batches == 4 and recorder.gaps == []


async def test_a_gap_is_replayed(
    nursery: trio.Nursery, publisher: FakeVllmPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        index, recorder = await subscribe(nursery, publisher)
        a, b, c = prompt(1, 0), prompt(1, 100), prompt(1, 200)
        publisher.publish([chain(a)])
        await poll_until(lambda: recorder.batches == 1)
        # Two batches lost on the way (the SUB socket's queue overflowed, a reconnect...).
        publisher.publish([chain(b)], send=False)
        publisher.publish([chain(c)], send=False)
        publisher.publish([chain(prompt(1, 300))])
        await poll_until(lambda: recorder.batches == 4)
        assert recorder.gaps == ["replayed"]
        assert publisher.replays == [1]
        for tokens in (a, b, c):
            assert index.matched(block_keys(tokens, BS)) == 1
        assert "replayed the missed batches" in caplog.text


@pytest.mark.parametrize("replay", [False, True], ids=["no replay endpoint", "buffer too short"])
async def test_a_gap_that_cannot_be_replayed_empties_the_index(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture, replay: bool
) -> None:
    async with serving(buffer=1) as publisher:
        with trio.fail_after(DEADLINE):
            index, recorder = await subscribe(nursery, publisher, replay=replay)
            publisher.publish([chain(prompt(2, 0))])
            await poll_until(lambda: len(index) == 2)
            # The first subscription: complete from the start.
            assert index.complete_since == -math.inf
            publisher.publish([chain(prompt(1, 100))], send=False)
            publisher.publish([chain(prompt(1, 200))], send=False)
            publisher.publish([chain(prompt(1, 300))])
            await poll_until(lambda: recorder.gaps == ["dropped"])
            # Emptied, then the batch after the gap applied: only its block is known.
            assert len(index) == 1
            assert index.matched(block_keys(prompt(1, 300), BS)) == 1
            assert "index emptied until new blocks arrive" in caplog.text
            # Complete again only from the loss on: the router adds what was routed there.
            assert index.complete_since is not None and index.complete_since > 0
            nursery.cancel_scope.cancel()


async def test_a_publisher_that_restarted_empties_the_index(
    nursery: trio.Nursery, publisher: FakeVllmPublisher
) -> None:
    with trio.fail_after(DEADLINE):
        index, recorder = await subscribe(nursery, publisher)
        for first in (0, 100, 200):
            publisher.publish([chain(prompt(1, first))])
        await poll_until(lambda: len(index) == 3)
        publisher.restart()
        publisher.publish([chain(prompt(1, 500))])
        await poll_until(lambda: recorder.gaps == ["restart"])
        assert len(index) == 1
        # From its batch 0: no event of the new engine missed, the index is exact.
        assert index.complete_since == -math.inf


async def test_a_malformed_message_restarts_the_subscription(
    nursery: trio.Nursery, publisher: FakeVllmPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        index, recorder = await subscribe(nursery, publisher)
        publisher.publish([chain(prompt(2))])
        await poll_until(lambda: len(index) == 2)
        publisher.pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
        await poll_until(lambda: recorder.restarts == 1)
        assert len(index) == 0
        assert index.complete_since is None  # until the new subscription is up
        assert "subscribing again in 0.1s" in caplog.text
        # The new subscription joins, and events flow again.
        await publisher.subscribed()
        # Subscribed again: complete only from now on.
        assert index.complete_since is not None and index.complete_since > 0
        publisher.publish([chain(prompt(1, 50))])
        await poll_until(lambda: len(index) == 1)


def test_backoff_doubles_to_its_cap() -> None:
    assert [backoff_seconds(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.8]
    assert backoff_seconds(30) == BACKOFF_MAX


async def test_failures_back_off_and_a_healthy_spell_resets_it(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    starts: list[float] = []
    # Fails at once 4 times, then after a healthy spell, then at once again.
    lives = itertools.chain([0, 0, 0, 0, HEALTHY_SECONDS + 1], itertools.repeat(0))

    async def session(self: KvEventSubscriber, task_status: object = None) -> None:
        starts.append(trio.current_time())
        await trio.sleep(next(lives))
        raise KvEventsError("malformed")

    monkeypatch.setattr(KvEventSubscriber, "subscribe", session)
    recorder = Recorder()
    subscriber = KvEventSubscriber("r", Publisher("tcp://127.0.0.1:1"), BlockIndex(10), recorder)
    with trio.move_on_after(200):
        await subscriber.run()
    waits = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    # 0.1, 0.2, 0.4, 0.8, then the healthy session's own life plus 0.1 (reset), then 0.2.
    assert waits[:6] == [0.1, 0.2, 0.4, 0.8, round(HEALTHY_SECONDS + 1 + 0.1, 3), 0.2]
    assert recorder.restarts >= 6


async def test_cancelling_the_subscriber_leaves_no_socket(publisher: FakeVllmPublisher) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    index = BlockIndex(10)
    subscriber = KvEventSubscriber("r", Publisher(publisher.endpoint), index, context=context)
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(subscriber.run)
            await publisher.subscribed()
            publisher.publish([chain(prompt(1))])
            await poll_until(lambda: len(index) == 1)
            # Waiting on the socket's FD now: cancelled there.
            nursery.cancel_scope.cancel()
        # term() returns only once every socket of the context is closed.
        await trio.to_thread.run_sync(context.term, abandon_on_cancel=True)


async def test_metrics_observer_counts(nursery: trio.Nursery, publisher: FakeVllmPublisher) -> None:
    metrics = Metrics()
    index = BlockIndex(2)
    observer = MetricsObserver(metrics, "m", "http://r")
    subscriber = KvEventSubscriber("r", Publisher(publisher.endpoint), index, observer)
    with trio.fail_after(DEADLINE):
        await nursery.start(subscriber.run)
        await publisher.subscribed()
        publisher.publish([chain(prompt(3))])
        publisher.publish([block_stored([b"o"], b"unknown", prompt(1), BS)])
        publisher.publish([chain(prompt(1, 9))], send=False)
        publisher.publish([chain(prompt(1, 99))])
        sample = metrics.registry.get_sample_value

        def value(name: str, **labels: str) -> float:
            return sample(name, {"model": "m", "replica": "http://r", **labels}) or 0.0

        await poll_until(lambda: value("sluice_kv_event_batches_total") == 3)
        assert value("sluice_kv_blocks_total", change="stored") == 4
        assert value("sluice_kv_blocks_total", change="evicted") == 1
        assert value("sluice_kv_blocks_total", change="skipped") == 1
        assert value("sluice_kv_event_gaps_total", outcome="dropped") == 1
        assert value("sluice_kv_indexed_blocks") == 1


def test_publisher_of_a_replica() -> None:
    assert publisher_of("http://10.0.0.5:8000", 5557, 5558) == Publisher(
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"
    )
    assert publisher_of("http://[::1]:8000", 5557, 0) == Publisher("tcp://[::1]:5557")
    assert publisher_of("http://a:8000", 0, 5558, "tcp://b:6000") == Publisher(
        "tcp://b:6000", "tcp://b:5558"
    )
    assert publisher_of("http://a:8000", 0, 0, "ipc:///run/kv") == Publisher("ipc:///run/kv")


def test_the_module_logs_under_sluice() -> None:
    assert kv_events.log is logging.getLogger("sluice.upstream")


# ----------------------------------------------------------------------------- end to end


async def test_requests_go_to_the_replica_holding_the_longest_prefix(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Three fake replicas, each with a fake vLLM publisher: replica 2 holds two thirds of the
    prompt, replica 1 one third, replica 0 none. Through the real upstream path (the proxy,
    its /tokenize call, the subscribers, the router), every request goes to replica 2."""
    async with contextlib.AsyncExitStack() as stack:
        publishers = [await stack.enter_async_context(serving()) for _ in range(3)]
        with trio.fail_after(DEADLINE):
            fakes = [
                await start_fake(nursery, ttft=0.002, interval=0.001, tokens=2) for _ in range(3)
            ]
            model = {
                "upstreams": [f.url for f in fakes],
                "balance": "cache_aware",
                "kv_events_endpoints": [p.endpoint for p in publishers],
                "metrics_interval": 0.5,
                # A /tokenize later than this routes by load: never, however loaded the machine.
                "kv_tokenize_timeout": 5,
                # The prompt here is 49 tokens: its 32 cached tokens weighed as 6.4 requests
                # (a scrape may still count the request before as running).
                "kv_cache_weight": 200.0,
                # What was just routed counts too until its events come (these publishers send
                # none): in blocks of 64 it holds none of the 49-token prompt, so the events
                # alone decide here.
                "kv_block_size": 64,
            }
            proxy, backend, router = await subscribed_proxy(nursery, model, publishers)

            system = " ".join(f"word{i}" for i in range(48))
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
            answer = await client.post(
                f"{fakes[0].url}/tokenize", json={"model": "fake-model", "messages": messages}
            )
            tokens = answer.json()["tokens"]
            assert len(tokens) == 49  # 12 blocks of 4, and one token over
            hashes = vllm_hashes(tokens, BS, SEED)
            publishers[2].publish([block_stored(hashes[:8], None, tokens[:32], BS)])
            publishers[1].publish([block_stored(hashes[:4], None, tokens[:16], BS)])
            indexes = [router.index_of(r.load) for r in backend.replicas]
            await poll_until(lambda: [len(i) for i in indexes] == [0, 4, 8])

            body = {"model": "fake-model", "messages": messages, "stream": True}
            for _ in range(6):
                response = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
                assert response.status_code == 200
            served = [len(f.recorder.records) for f in fakes]
            # Replica 2 served the six; the /tokenize calls went to the least busy.
            chats = [
                sum(1 for r in f.recorder.records if r.path.endswith("/chat/completions"))
                for f in fakes
            ]
            assert chats == [0, 0, 6], served

            registry = proxy.state.metrics.registry
            labels = {"model": "fake-model", "balance": "cache_aware", "reason": "cache"}
            assert registry.get_sample_value("sluice_routing_decisions_total", labels) == 6
            fraction = registry.get_sample_value(
                "sluice_route_cached_fraction_bucket", {"model": "fake-model", "le": "0.75"}
            )
            assert fraction == 6  # 8 of 12 blocks

            # A prompt no replica holds: by load, and it spreads.
            other = {**body, "messages": [{"role": "user", "content": "something else"}]}
            for _ in range(3):
                response = await client.post(f"{proxy.url}/v1/chat/completions", json=other)
                assert response.status_code == 200
            labels["reason"] = "load"
            assert registry.get_sample_value("sluice_routing_decisions_total", labels) == 3
            nursery.cancel_scope.cancel()


class HeldTokenizer:
    """The backend's tokenizer, but every /tokenize after the first never answers."""

    def __init__(self, real: Tokenizer) -> None:
        self.real = real
        self.asked = 0
        self.cancelled = 0

    def recall(self, request: CompletionRequest) -> Recalled | None:
        return self.real.recall(request)

    async def tokens(self, request: CompletionRequest) -> Sequence[int] | None:
        self.asked += 1
        if self.asked == 1:
            return await self.real.tokens(request)
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled += 1


async def subscribed_proxy(
    nursery: trio.Nursery, model: dict[str, Any], publishers: Sequence[Any]
) -> tuple[Any, UpstreamBackend, CacheAwareRouter]:
    """A proxy serving ``model`` (``cache_aware``), once every publisher has its subscriber."""
    proxy = await start_proxy(nursery, {"fake-model": model})
    for publisher in publishers:
        await publisher.subscribed()
    backend = proxy.state.backends["fake-model"]
    assert isinstance(backend, UpstreamBackend)
    router = backend.router
    assert isinstance(router, CacheAwareRouter)
    return proxy, backend, router


async def two_replicas_routed_by_cache(
    nursery: trio.Nursery,
) -> tuple[list[Any], Any, UpstreamBackend]:
    """Two fake replicas (publishing no events) behind a proxy routing by ``cache_aware``,
    blocks of 4 tokens, the cache weighed far over load; once its tokenizer is known."""
    fakes = [await start_fake(nursery, ttft=0.002, interval=0.001, tokens=2) for _ in range(2)]
    model = {
        "upstreams": [f.url for f in fakes],
        "balance": "cache_aware",
        "kv_block_size": 4,
        "kv_cache_weight": 200.0,
        # A /tokenize later than this routes by load: never, however loaded the machine.
        "kv_tokenize_timeout": 5,
    }
    proxy = await start_proxy(nursery, {"fake-model": model})
    backend = proxy.state.backends["fake-model"]
    assert isinstance(backend, UpstreamBackend)
    await poll_until(lambda: backend.tokenizer is not None)
    return fakes, proxy, backend


async def test_a_conversations_next_turn_is_routed_without_waiting_for_its_tokens(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Its first turn waits for /tokenize; each later turn is routed at once by the tokens of
    the turn before (which begin its own), to the replica holding the conversation, while its
    own tokens are asked beside it, and that ask ends with the request."""
    with trio.fail_after(DEADLINE):
        fakes, proxy, backend = await two_replicas_routed_by_cache(nursery)
        assert backend.tokenizer is not None
        held = HeldTokenizer(backend.tokenizer)
        backend.tokenizer = held
        messages = [{"role": "system", "content": " ".join(f"word{i}" for i in range(40))}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"question {turn}"})
            body = {"model": "fake-model", "messages": messages, "stream": True}
            response = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
            assert response.status_code == 200
            messages.append({"role": "assistant", "content": "The quick"})
        chats = [
            sum(1 for r in f.recorder.records if r.path.endswith("/chat/completions"))
            for f in fakes
        ]
        assert sorted(chats) == [0, 3]
        assert (held.asked, held.cancelled) == (3, 2)
        registry = proxy.state.metrics.registry
        labels = {"model": "fake-model", "balance": "cache_aware", "reason": "cache_approx"}
        assert registry.get_sample_value("sluice_routing_decisions_total", labels) == 2

        # A failure of the request itself comes out as itself beside the ask.
        messages.append({"role": "user", "content": "question 3"})
        failing = {**body, "messages": messages, "fake": {"mode": "status", "status": 400}}
        response = await client.post(f"{proxy.url}/v1/chat/completions", json=failing)
        assert response.status_code == 400
        assert (held.asked, held.cancelled) == (4, 3)
        nursery.cancel_scope.cancel()


def test_what_is_asked_of_tokenize() -> None:
    chat = parse(
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "temperature": 0.3,
        },
    )
    assert tokenize_body(chat, "served") == {
        "model": "served",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    completion = parse("/v1/completions", {"model": "m", "prompt": "once upon"})
    assert tokenize_body(completion, "m") == {"model": "m", "prompt": "once upon"}
    # A prompt of token ids is its own answer; a batch of prompts, or no prompt, none.
    assert tokenize_body(parse("/v1/completions", {"model": "m", "prompt": [5, 6]}), "m") == [5, 6]
    assert (
        tokenize_body(parse("/v1/completions", {"model": "m", "prompt": ["a", "b"]}), "m") is None
    )
    embeddings = parse("/v1/embeddings", {"model": "m", "input": "x"})
    assert tokenize_body(embeddings, "m") is None


def parse(path: str, body: dict[str, object]) -> CompletionRequest:
    endpoint = {
        "/v1/chat/completions": Endpoint.CHAT,
        "/v1/completions": Endpoint.COMPLETIONS,
        "/v1/embeddings": Endpoint.EMBEDDINGS,
    }[path]
    return parse_api_request(json.dumps(body).encode(), endpoint)


async def test_off_nothing_subscribes_and_no_index_exists(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery)
        proxy = await start_proxy(nursery, {"fake-model": {"upstreams": [fake.url]}})
        backend = proxy.state.backends["fake-model"]
        assert isinstance(backend, UpstreamBackend)
        assert not isinstance(backend.router, CacheAwareRouter)
        assert backend.tokenizer is None
        # Its watch returns at once: no task, no socket.
        await backend.watch_replicas()
        nursery.cancel_scope.cancel()


async def test_without_events_a_prompt_follows_what_was_routed(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Two fake replicas that publish no events (llama.cpp, vLLM without the flag): a chat's
    later turns go where its first went, by the approximate index, and say so."""
    with trio.fail_after(DEADLINE):
        fakes, proxy, _ = await two_replicas_routed_by_cache(nursery)
        system = " ".join(f"word{i}" for i in range(40))
        for turn in range(4):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {turn}"},
            ]
            body = {"model": "fake-model", "messages": messages, "stream": True}
            response = await client.post(f"{proxy.url}/v1/chat/completions", json=body)
            assert response.status_code == 200
        chats = [
            sum(1 for r in f.recorder.records if r.path.endswith("/chat/completions"))
            for f in fakes
        ]
        assert sorted(chats) == [0, 4]
        registry = proxy.state.metrics.registry
        labels = {"model": "fake-model", "balance": "cache_aware", "reason": "cache_approx"}
        assert registry.get_sample_value("sluice_routing_decisions_total", labels) == 3
        nursery.cancel_scope.cancel()


async def test_each_replica_replays_from_its_own_replay_endpoint(nursery: trio.Nursery) -> None:
    """Two replicas on one host, each publisher with its own replay socket on a port of its
    own (one kv_events_replay_port cannot name both): a gap in either's events is fetched
    from that replica's replay endpoint, through the proxy's own subscribers."""
    async with contextlib.AsyncExitStack() as stack:
        publishers = [await stack.enter_async_context(serving()) for _ in range(2)]
        with trio.fail_after(DEADLINE):
            fakes = [await start_fake(nursery) for _ in range(2)]
            model = {
                "upstreams": [f.url for f in fakes],
                "balance": "cache_aware",
                "kv_events_endpoints": [p.endpoint for p in publishers],
                "kv_events_replay_endpoints": [p.replay_endpoint for p in publishers],
            }
            proxy, backend, router = await subscribed_proxy(nursery, model, publishers)
            registry = proxy.state.metrics.registry
            for publisher, replica in zip(publishers, backend.replicas, strict=True):
                index = router.index_of(replica.load)
                a, b, c = prompt(1, 0), prompt(1, 100), prompt(1, 200)
                publisher.publish([chain(a)])
                await poll_until(lambda index=index: len(index) == 1)
                # Two batches lost on the way.
                publisher.publish([chain(b)], send=False)
                publisher.publish([chain(c)], send=False)
                publisher.publish([chain(prompt(1, 300))])
                await poll_until(lambda index=index: len(index) == 4)
                assert publisher.replays == [1]
                for tokens in (a, b, c):
                    assert index.matched(block_keys(tokens, BS)) == 1
                labels = {"model": "fake-model", "replica": replica.url, "outcome": "replayed"}
                assert registry.get_sample_value("sluice_kv_event_gaps_total", labels) == 1
            nursery.cancel_scope.cancel()
