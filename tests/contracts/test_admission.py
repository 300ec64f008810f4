"""The admission contract: concurrency is bounded at every level, and excess waits in a bounded
queue with a deadline, then gets ``429`` or ``503`` with ``Retry-After`` and an error in the
API's shape; never an unbounded pile-up.

- An upstream replica: a request waits for the replica's connection slot in a queue of
  ``max_queue``, gets 429 ``queue_full`` at once past it and 503 ``queue_timeout`` after
  ``queue_timeout``, over either transport; a queued client that leaves frees its place at
  once; and none of it counts against the replica.
- A local model: the same, for its slots.
- A client key: its requests per minute and its concurrent streams, each with its own window,
  a refusal costing the upstream nothing, and a stream's hold released when its client leaves.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.api.test_auth import OTHER_SECRET, bearer, error_of, key_table
from tests.ops.test_metrics import scrape, value
from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    Fake,
    RawClient,
    chat_body,
    only_replica,
    poll_until,
    slowed,
    sse_payloads,
    start_fake,
    start_local_proxy,
    start_proxy,
)

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
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
            # The model by its name, never the replica by its address (a 10.x in production).
            assert full.json()["error"]["message"].startswith("model 'm' is busy"), full.text
            assert fake.url.split("//")[1] not in full.text and "127.0.0.1" not in full.text
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
        assert waits.labels("m", "queue_full", "-", "0")._sum.get() == 0.0
        assert waits.labels("m", "queue_timeout", "-", "0")._sum.get() >= 0.5


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
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


async def test_admission_queue_full_is_429_and_deadline_is_503(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.02)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=1, max_queue=1, queue_timeout=0.5)
        backend = proxy.state.local_backends["tiny"]
        running = await RawClient.post(proxy, CHAT, chat_body("tiny"))
        await running.read_until(b'"content":"')
        queued = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=2))
        await backend.admission.wait_queued(1)
        response = await client.post(proxy.url + CHAT, json=chat_body("tiny", max_tokens=2))
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1
        # The queued one waits past queue_timeout: 503, with Retry-After.
        await queued.read_until(b"\r\n\r\n")
        assert queued.received.startswith(b"HTTP/1.1 503")
        assert b"retry-after" in queued.received.lower()
        await queued.read_until(b"queue_timeout")
        await queued.close()
        await running.close()


async def test_a_client_leaving_the_queue_frees_its_place_at_once(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.02)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=1, max_queue=1, queue_timeout=30)
        backend = proxy.state.local_backends["tiny"]
        running = await RawClient.post(proxy, CHAT, chat_body("tiny"))
        await running.read_until(b'"content":"')
        queued = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=2))
        await backend.admission.wait_queued(1)
        await queued.close()
        await backend.admission.wait_queued(0)
        # Its place is free: a new request is queued (not refused), and is served once the
        # running one leaves.
        async with trio.open_nursery() as requests:
            requests.start_soon(
                lambda: client.post(proxy.url + CHAT, json=chat_body("tiny", max_tokens=2))
            )
            await backend.admission.wait_queued(1)
            await running.close()
        assert backend.admission.waiting == 0


async def test_requests_per_minute_gives_429_with_retry_after(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[
                key_table(requests_per_minute=2),
                key_table(OTHER_SECRET, "bob", requests_per_minute=2),
            ],
        )
        url = proxy.url + CHAT
        for _ in range(2):
            ok = await client.post(url, json=chat_body(stream=False), headers=bearer())
            assert ok.status_code == 200
        refused = await client.post(url, json=chat_body(), headers=bearer())
        assert refused.status_code == 429
        error = error_of(refused)
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        # Both admissions happened within the last few seconds, so the window frees up in a
        # little under 60 s; the header says so, in whole seconds.
        assert 50 <= int(refused.headers["retry-after"]) <= 60
        assert len(fake.recorder.records) == 2  # the refusal never reached the upstream
        # Another key has its own window.
        other = await client.post(url, json=chat_body(), headers=bearer(OTHER_SECRET))
        assert other.status_code == 200
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_requests_total", model="fake-model", status="429") == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_one_stream_key_can_ask_back_to_back(
    nursery: trio.Nursery, client: httpx.AsyncClient, stream: bool
) -> None:
    """An agent with a one-stream key that sends its next request as soon as the last answer
    ended is never refused: the hold is released before the client can see the answer end."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=3)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, keys=[key_table(max_concurrent_streams=1)]
        )
        for _ in range(30):
            answer = await client.post(
                proxy.url + CHAT, json=chat_body(stream=stream), headers=bearer()
            )
            assert answer.status_code == 200, answer.text
            assert proxy.state.keys.streams("alice") == 0


async def test_a_one_stream_key_can_ask_back_to_back_on_a_raw_connection(
    nursery: trio.Nursery,
) -> None:
    """The same, checked the moment a stream's last chunk arrives."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=3)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, keys=[key_table(max_concurrent_streams=1)]
        )
        for _ in range(10):
            raw = await RawClient.post(proxy, CHAT, chat_body(), headers=bearer())
            await raw.read_until(b"0\r\n\r\n")
            assert proxy.state.keys.streams("alice") == 0
            await raw.stream.aclose()


async def test_concurrent_streams_are_held_until_the_client_leaves(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.0, interval=0.05, tokens=10_000)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table(max_concurrent_streams=1), key_table(OTHER_SECRET, "bob")],
        )
        url = proxy.url + CHAT
        async with client.stream("POST", url, json=chat_body(), headers=bearer()) as first:
            assert first.status_code == 200
            lines = first.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            assert proxy.state.keys.streams("alice") == 1
            second = await client.post(url, json=chat_body(), headers=bearer())
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            error = error_of(second)
            assert (error["type"], error["code"]) == (
                "rate_limit_error",
                "concurrency_limit_exceeded",
            )
            # Another key is not limited by alice's stream.
            async with client.stream(
                "POST", url, json=chat_body(), headers=bearer(OTHER_SECRET)
            ) as bob:
                assert bob.status_code == 200
        # Leaving the block closed both connections mid-stream: the relays end, and with
        # alice's relay its hold on her concurrency.
        await proxy.state.tracker.wait_idle()
        assert proxy.state.keys.streams("alice") == 0
        # ... and the upstream sees alice's first stream go (closed by the proxy, not by it).
        await fake.recorder.wait_for(lambda r: r.records[0].disconnected_at is not None)
        third = await client.post(url, json=chat_body(fake={"tokens": 3}), headers=bearer())
        assert third.status_code == 200
        assert sse_payloads(third.text)[-1] == "[DONE]"
        # A finished request released its hold too.
        assert proxy.state.keys.streams("alice") == 0
