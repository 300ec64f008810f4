"""The sharing contract, end to end over real sockets: when the upstream is saturated, requests
wait in Sluice's queue, which is fair between keys, serves bands in order, never starts a request
that cannot meet its deadline, and cancels one that passes it as it cancels for a client that
left.

Every test here runs a fake upstream whose own concurrency (``max_running``) equals Sluice's
``max_connections`` for it, so that a request past it waits in Sluice's queue, and talks to
Sluice on 127.0.0.1 as its users do: the OpenAI and Anthropic SDKs (with a ``timeout=``, which
they send as ``x-stainless-read-timeout``), plain HTTP and the WebSocket. Real sockets, real
time: each test takes a few seconds at most. The scheduler's order itself (the counters, the
lifting rule, the guard, the arithmetic) is tested under virtual time in
tests/protocol/test_scheduling.py and tests/relay/test_admission.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio
from trio_websocket import open_websocket_url

from proxy.api.auth import hash_key
from proxy.backends.upstream.backend import UpstreamBackend
from proxy.ops.logs import ACCESS_LOGGER
from proxy.relay.admission import Scheduling
from tests.api.test_reload import serve_file
from tests.api.test_websocket import answer, receive, ws_url
from tests.ops.test_metrics import scrape, value
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    RawClient,
    access_lines,
    chat_body,
    poll_until,
    slowed,
    sse_payloads,
    start_fake,
    start_local_proxy,
    start_proxy,
)

CHAT = "/v1/chat/completions"
# Named so that a refusal naming it is told apart from one naming anything else.
MODEL = "shared-model"
MESSAGES: Any = [{"role": "user", "content": "hello"}]
# A stream that holds its slot until its client leaves.
ENDLESS = {"ttft": 0, "interval": 0.01, "tokens": 100_000}
SECRETS = {
    "alice": "sk-sched-alice-0123456789",
    "bob": "sk-sched-bob-0123456789",
    "urgent": "sk-sched-urgent-0123456789",
    "batch": "sk-sched-batch-0123456789",
}


def key(name: str, **settings: Any) -> dict[str, Any]:
    return {"name": name, "sha256": hash_key(SECRETS[name]), **settings}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def said(text: str) -> Any:
    """A conversation whose one message names its request, for the fake's records."""
    return [{"role": "user", "content": text}]


def arrival_order(fake: Fake) -> list[str]:
    """What each request the fake received said, in the order it arrived there."""
    return [record.body["messages"][0]["content"] for record in fake.recorder.records]


async def one_slot_replica(
    nursery: trio.Nursery,
    *,
    keys: list[dict[str, Any]] | None = None,
    scheduling: dict[str, Any] | None = None,
    **model: Any,
) -> tuple[Fake, Proxy]:
    """A fake that runs one request at a time, and a Sluice that knows it (``max_connections =
    1``): every request past the first waits in Sluice's queue."""
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=3, max_running=1)
    proxy = await start_proxy(
        nursery,
        {MODEL: {"upstreams": [fake.url], "max_connections": 1, **model}},
        keys=keys,
        scheduling=scheduling or {},
    )
    return fake, proxy


async def hold_the_slot(proxy: Proxy, name: str | None = None, *, model: str = MODEL) -> RawClient:
    """A stream that holds the replica's one slot (until :meth:`RawClient.close`)."""
    holder = await RawClient.post(
        proxy,
        CHAT,
        chat_body(model, messages=said("holder"), fake=ENDLESS),
        headers=bearer(name) if name is not None else None,
    )
    await holder.read_until(b"data: ")
    return holder


async def streams_on(scheduling: Scheduling, tokens: int = 5) -> None:
    """Until the requests running have put out ``tokens`` more: what they are charged for
    at the next dispatch. A key that arrives is lifted to the least served backlogged key's
    counter (being idle is not banked), level with a key whose stream holds the slot; that
    stream's tokens from then on are what put it behind."""

    def output() -> int:
        return sum(running.progress() for running in scheduling.upstream._running.values())

    start = output()
    await poll_until(lambda: output() >= start + tokens)


async def queued(proxy: Proxy, count: int) -> None:
    """Until exactly ``count`` of the model's requests wait in Sluice's queue."""
    backend = proxy.state.backends[MODEL]
    assert isinstance(backend, UpstreamBackend)
    await backend.admission.wait_queued(count)


def queue_left(proxy: Proxy, outcome: str) -> int:
    """How many of the model's requests (no key, band 0) left Sluice's queue so (admitted:
    dispatched)."""
    return int(queue_metric(proxy, "count", outcome))


def queue_seconds(proxy: Proxy, outcome: str) -> float:
    """The seconds they waited, all together."""
    return queue_metric(proxy, "sum", outcome)


def queue_metric(proxy: Proxy, suffix: str, outcome: str) -> float:
    labels = {"model": MODEL, "outcome": outcome, "key": "-", "band": "0"}
    found = proxy.state.metrics.registry.get_sample_value(
        f"sluice_queue_wait_seconds_{suffix}", labels
    )
    return found or 0.0


def assert_hides_the_replica(response: Any, fake: Fake) -> None:
    """A refusal names the model, never the replica's address."""
    port = f":{fake.url.rsplit(':', 1)[1]}"
    assert port not in response.text, response.text
    for name, header in response.headers.items():
        assert port not in header, (name, header)
    assert f"'{MODEL}'" in response.text


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        yield caplog


# ---------------------------------------------------------------------------- deadlines


async def test_an_sdk_timeout_shorter_than_the_queue_is_refused_at_once_and_never_sent(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        holder = await hold_the_slot(proxy)
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=0.5
        ) as client:
            with pytest.raises(openai.InternalServerError) as raised:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        await holder.close()
        await proxy.state.tracker.wait_idle()
    # Refused at once (0 s in the queue), not left to wait for a slot it could not use: the
    # wait ahead (one slot, held 1 s as far as Sluice knows yet) is longer than the SDK's 0.5 s.
    assert queue_left(proxy, "deadline") == 1
    assert queue_seconds(proxy, "deadline") == 0.0
    error = raised.value
    assert (error.status_code, error.type) == (503, "server_error")
    assert error.code == "deadline_unmeetable"
    assert isinstance(error.body, dict) and f"'{MODEL}'" in error.body["message"]
    assert error.response.json() == {"error": error.body}
    assert int(error.response.headers["retry-after"]) >= 1
    # Worth a retry once the queue has moved on: the SDK is told so, and waits Retry-After.
    assert error.response.headers["x-should-retry"] == "true"
    # It never reached the upstream: the fake saw the holder alone.
    assert arrival_order(fake) == ["holder"]


async def test_the_sdk_retries_an_unmeetable_request_after_retry_after(
    nursery: trio.Nursery,
) -> None:
    """What the SDK does with the refusal when it may retry: it waits Retry-After, and its
    retry, sent once the slot is free, is served."""
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        holder = await hold_the_slot(proxy)

        async def free_the_slot_once_refused() -> None:
            await poll_until(lambda: queue_left(proxy, "deadline") == 1)
            await holder.close()

        nursery.start_soon(free_the_slot_once_refused)
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=1, timeout=0.5
        ) as client:
            asked = trio.current_time()
            whole = await client.chat.completions.create(model=MODEL, messages=said("retried"))
            took = trio.current_time() - asked
        await proxy.state.tracker.wait_idle()
    assert whole.choices[0].message.content == "The quick brown "
    assert arrival_order(fake) == ["holder", "retried"]
    assert queue_left(proxy, "deadline") == queue_left(proxy, "admitted") - 1 == 1
    # After the refusal's Retry-After (1 s), not at once.
    assert took >= 1.0


async def test_a_queued_request_whose_deadline_comes_is_refused_then_and_never_sent(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """Its wait looked short enough when it arrived (a slot is held 1 s, as far as Sluice
    knows yet), but the slot is held longer: at its deadline it leaves the queue with the
    queue's refusal, never started, rather than a 504 for a request that never ran."""
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        holder = await hold_the_slot(proxy)
        sent = trio.current_time()
        response = await client.post(
            proxy.url + CHAT,
            json=chat_body(MODEL, stream=False),
            headers={"x-stainless-read-timeout": "1.5"},
        )
        answered = trio.current_time()
        await holder.close()
        await proxy.state.tracker.wait_idle()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "deadline_unmeetable"
    assert int(response.headers["retry-after"]) >= 1
    assert 1.5 <= answered - sent < 1.5 + 0.5
    assert arrival_order(fake) == ["holder"]
    assert queue_left(proxy, "deadline") == 1


async def test_a_deadline_passed_before_the_first_byte_is_a_504_and_the_upstream_closed(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        sent = trio.current_time()
        response = await client.post(
            proxy.url + CHAT,
            json=chat_body(MODEL, fake={"ttft": 10}),
            headers={"x-sluice-deadline": "0.5"},
        )
        answered = trio.current_time()
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
        await proxy.state.tracker.wait_idle()
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    record = fake.recorder.last()
    # It was running (sent upstream, no token yet) when its deadline came: the upstream
    # connection was closed then, as for a client that left.
    assert record.first_token_at is None
    assert record.outcome == "client_disconnected"
    assert record.disconnected_at is not None
    assert 0.5 <= record.disconnected_at - sent < 0.5 + 0.5
    assert answered - sent < 0.5 + 0.5


async def test_a_deadline_passed_mid_stream_is_an_in_band_error_and_the_upstream_closed(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        pieces: list[str] = []
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=10
        ) as client:
            sent = trio.current_time()
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                stream=True,
                extra_headers={"x-sluice-deadline": "0.5"},
                extra_body={"fake": {"ttft": 0, "interval": 0.02, "tokens": 10_000}},
            )
            with pytest.raises(openai.APIError) as raised:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
            ended = trio.current_time()
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
        await proxy.state.tracker.wait_idle()
    assert len(pieces) > 3  # it streamed before its deadline
    # The SDK raises the in-band error event: the stream's end says why.
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["code"] == "deadline_exceeded"
    record = fake.recorder.last()
    assert record.outcome == "client_disconnected"
    assert record.disconnected_at is not None
    assert 0.5 <= record.disconnected_at - sent < 0.5 + 0.5
    assert ended - sent < 0.5 + 0.5


async def test_a_keys_longest_request_counts_its_wait_in_the_queue(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """``max_request_seconds`` bounds a request from its arrival: one that waited 0.5 s for
    the slot has 1 s left to stream, then ends with the in-band error."""
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(
            nursery, keys=[key("alice"), key("bob", max_request_seconds=1.5)]
        )
        holder = await hold_the_slot(proxy, "alice")
        answered: list[httpx.Response] = []

        async def talk() -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, fake={"ttft": 0, "interval": 0.02, "tokens": 10_000}),
                headers=bearer("bob"),
            )
            answered.append(response)

        sent = trio.current_time()
        async with trio.open_nursery() as inner:
            inner.start_soon(talk)
            await queued(proxy, 1)
            await trio.sleep_until(sent + 0.5)
            await holder.close()
        ended = trio.current_time()
        await proxy.state.tracker.wait_idle()
    (response,) = answered
    assert response.status_code == 200
    payloads = sse_payloads(response.text)
    assert len(payloads) > 3
    assert json.loads(payloads[-1])["error"]["code"] == "deadline_exceeded"
    record = fake.recorder.last()
    assert record.body is not None and record.body["messages"] == chat_body()["messages"]
    assert record.received_at - sent >= 0.5
    assert record.disconnected_at is not None
    assert 1.5 <= record.disconnected_at - sent < 1.5 + 0.5
    assert ended - sent < 1.5 + 0.5


# ---------------------------------------------------------------------------- the order


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        # Fair: bob has been served less than alice (whose stream held the slot all along),
        # so his one request goes before her backlog.
        ("fair", ["bob", "alice 1", "alice 2", "alice 3"]),
        # FIFO, the A/B's baseline: arrival order, bob behind all of alice's.
        ("fifo", ["alice 1", "alice 2", "alice 3", "bob"]),
    ],
)
async def test_a_key_that_floods_does_not_make_another_wait_behind_it(
    nursery: trio.Nursery, client: httpx.AsyncClient, policy: str, order: list[str]
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(
            nursery, keys=[key("alice"), key("bob")], scheduling={"policy": policy}
        )
        holder = await hold_the_slot(proxy, "alice")
        answers: dict[str, int] = {}

        async def ask(name: str, text: str) -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(text)),
                headers=bearer(name),
            )
            answers[text] = response.status_code

        for number in (1, 2, 3):
            nursery.start_soon(ask, "alice", f"alice {number}")
            await queued(proxy, number)
        nursery.start_soon(ask, "bob", "bob")
        await queued(proxy, 4)
        # Alice's stream goes on a while (its tokens counted to her), then its client leaves.
        await streams_on(proxy.state.scheduling)
        await holder.close()
        await poll_until(lambda: len(answers) == 4)
        await proxy.state.tracker.wait_idle()
    assert answers == dict.fromkeys(order, 200)
    assert arrival_order(fake) == ["holder", *order]


@pytest.mark.parametrize("upstream_priority", [False, True])
async def test_a_more_urgent_band_goes_first_and_the_priority_field_reaches_only_who_takes_it(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    access: pytest.LogCaptureFixture,
    upstream_priority: bool,
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(
            nursery,
            keys=[key("urgent", priority=0), key("batch", priority=5)],
            upstream_priority=upstream_priority,
        )
        holder = await hold_the_slot(proxy, "batch")
        answers: dict[str, httpx.Response] = {}

        async def ask(name: str, **extra: Any) -> None:
            answers[name] = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(name), **extra),
                headers=bearer(name),
            )

        # The batch key's request, queued first, asks to be more urgent than its key: it is
        # kept in its key's band (not refused). The urgent key's asks to be less urgent than
        # its key, which it may: band 3, still before 5.
        nursery.start_soon(partial(ask, "batch", priority=0))
        await queued(proxy, 1)
        nursery.start_soon(partial(ask, "urgent", priority=3))
        await queued(proxy, 2)
        await holder.close()
        await poll_until(lambda: len(answers) == 2)
        await proxy.state.tracker.wait_idle()
    assert {name: response.status_code for name, response in answers.items()} == {
        "batch": 200,
        "urgent": 200,
    }
    assert arrival_order(fake) == ["holder", "urgent", "batch"]
    forwarded = {
        record.body["messages"][0]["content"]: record.body.get("priority")
        for record in fake.recorder.records
    }
    if upstream_priority:
        # vLLM with --scheduling-policy priority: each request goes with its band.
        assert forwarded == {"holder": 5, "urgent": 3, "batch": 5}
    else:
        # vLLM's default policy refuses a non-zero priority: never forwarded.
        assert forwarded == {"holder": None, "urgent": None, "batch": None}
    bands = sorted((line["key"], line["band"]) for line in access_lines(access))
    assert bands == [("batch", 5), ("batch", 5), ("urgent", 3)]


async def test_a_less_urgent_band_waits_only_until_the_starvation_guard(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(
            nursery,
            keys=[key("urgent", priority=0), key("batch", priority=5)],
            scheduling={"starvation_seconds": 0.3},
        )
        holder = await hold_the_slot(proxy, "urgent")
        answers: dict[str, int] = {}

        async def ask(name: str) -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(name)),
                headers=bearer(name),
            )
            answers[name] = response.status_code

        nursery.start_soon(ask, "batch")
        await queued(proxy, 1)
        await trio.sleep(0.3)
        nursery.start_soon(ask, "urgent")
        await queued(proxy, 2)
        await holder.close()
        await poll_until(lambda: len(answers) == 2)
        await proxy.state.tracker.wait_idle()
    assert answers == {"batch": 200, "urgent": 200}
    # The batch request had waited past the guard: it goes before the more urgent band.
    assert arrival_order(fake) == ["holder", "batch", "urgent"]


async def test_models_on_one_replica_share_its_slots_and_one_fair_order(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(
            nursery, ttft=0, interval=0.01, tokens=3, max_running=1, models=["a", "b"]
        )
        proxy = await start_proxy(
            nursery,
            {name: {"upstreams": [fake.url], "max_connections": 1} for name in ("a", "b")},
            keys=[key("alice"), key("bob")],
        )
        holder = await hold_the_slot(proxy, "alice", model="a")
        answers: dict[str, int] = {}

        async def ask(model: str, name: str, text: str) -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(model, stream=False, messages=said(text)),
                headers=bearer(name),
            )
            answers[text] = response.status_code

        nursery.start_soon(ask, "a", "alice", "alice on a")
        await poll_until(lambda: proxy.state.scheduling.upstream.queue.size == 1)
        # Model b's request waits for the replica's one slot too, and in the same order.
        nursery.start_soon(ask, "b", "bob", "bob on b")
        await poll_until(lambda: proxy.state.scheduling.upstream.queue.size == 2)
        assert len(fake.recorder.records) == 1
        await streams_on(proxy.state.scheduling)
        await holder.close()
        await poll_until(lambda: len(answers) == 2)
        await proxy.state.tracker.wait_idle()
    assert answers == {"alice on a": 200, "bob on b": 200}
    assert arrival_order(fake) == ["holder", "bob on b", "alice on a"]


async def test_a_hedge_that_gets_no_slot_does_not_end_the_running_attempt(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """A hedge is a second chance, not the request: when it cannot get a slot (here it waits
    past queue_timeout behind a stream that holds the other replica), the attempt already
    running goes on and answers."""
    with trio.fail_after(DEADLINE):
        fakes = [
            await start_fake(nursery, ttft=0, interval=0.01, tokens=2, max_running=1)
            for _ in range(2)
        ]
        proxy = await start_proxy(
            nursery,
            {
                MODEL: {
                    "upstreams": [fake.url for fake in fakes],
                    "max_connections": 1,
                    "hedge_after": 0.2,
                    "queue_timeout": 0.3,
                }
            },
        )
        holder = await hold_the_slot(proxy)
        response = await client.post(
            proxy.url + CHAT,
            json=chat_body(MODEL, stream=False, messages=said("slow"), fake={"ttft": 1.0}),
        )
        await holder.close()
        await proxy.state.tracker.wait_idle()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "The quick "
    assert sorted(arrival_order(fake) for fake in fakes) == [["holder"], ["slow"]]
    assert queue_left(proxy, "queue_timeout") == 1  # the hedge, which never started


# ---------------------------------------------------------------------------- refusals


async def test_every_queue_refusal_names_the_model_never_the_replica(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery, max_queue=1, queue_timeout=0.5)
        holder = await hold_the_slot(proxy)
        url = proxy.url + CHAT
        unmeetable = await client.post(
            url, json=chat_body(MODEL, stream=False), headers={"x-sluice-deadline": "0.2"}
        )
        refusals: dict[str, httpx.Response] = {}

        async def wait_past_queue_timeout() -> None:
            refusals["timed_out"] = await client.post(url, json=chat_body(MODEL, stream=False))

        nursery.start_soon(wait_past_queue_timeout)
        await queued(proxy, 1)
        full = await client.post(url, json=chat_body(MODEL, stream=False))
        await poll_until(lambda: "timed_out" in refusals)
        await holder.close()
        await proxy.state.tracker.wait_idle()
    timed_out = refusals["timed_out"]
    assert [
        (response.status_code, response.json()["error"]["code"])
        for response in (unmeetable, full, timed_out)
    ] == [(503, "deadline_unmeetable"), (429, "queue_full"), (503, "queue_timeout")]
    for response in (unmeetable, full, timed_out):
        assert int(response.headers["retry-after"]) >= 1
        assert_hides_the_replica(response, fake)
    assert arrival_order(fake) == ["holder"]


async def test_the_messages_endpoint_refuses_in_anthropics_shape(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        holder = await hold_the_slot(proxy)
        async with anthropic.AsyncAnthropic(
            base_url=proxy.url, api_key="unused", max_retries=0, timeout=0.5
        ) as client:
            with pytest.raises(anthropic.InternalServerError) as raised:
                await client.messages.create(model=MODEL, max_tokens=16, messages=MESSAGES)
        await holder.close()
        await proxy.state.tracker.wait_idle()
    error = raised.value
    assert error.status_code == 503
    body = error.response.json()
    assert body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": body["error"]["message"]},
    }
    assert "cannot start this request before its client's read timeout" in body["error"]["message"]
    assert int(error.response.headers["retry-after"]) >= 1
    assert_hides_the_replica(error.response, fake)
    assert arrival_order(fake) == ["holder"]


# ---------------------------------------------------------------------------- what is seen


async def test_a_queued_requests_band_wait_and_deadline_are_logged_and_measured(
    nursery: trio.Nursery, client: httpx.AsyncClient, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery, keys=[key("alice"), key("bob")])
        holder = await hold_the_slot(proxy, "alice")
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(
                await client.post(
                    proxy.url + CHAT,
                    json=chat_body(MODEL, stream=False),
                    headers={
                        **bearer("bob"),
                        "x-sluice-priority": "2",
                        # The earlier of the two is its deadline.
                        "x-stainless-read-timeout": "3",
                        "x-sluice-deadline": "5",
                    },
                )
            )

        nursery.start_soon(ask)
        await queued(proxy, 1)
        await trio.sleep(0.3)
        await holder.close()
        await poll_until(lambda: answers)
        await proxy.state.tracker.wait_idle()
        samples = await scrape(client, proxy)
    assert answers[0].status_code == 200
    assert len(fake.recorder.records) == 2
    (line,) = [line for line in access_lines(access) if line["key"] == "bob"]
    assert (line["status"], line["band"], line["deadline_s"]) == (200, 2, 3.0)
    assert 0.3 <= line["queue_wait_s"] < 3
    (holders,) = [line for line in access_lines(access) if line["key"] == "alice"]
    assert (holders["band"], holders["queue_wait_s"], holders["deadline_s"]) == (0, 0.0, None)
    waited = {"model": MODEL, "outcome": "admitted", "key": "bob", "band": "2"}
    assert value(samples, "sluice_queue_wait_seconds_count", **waited) == 1
    assert value(samples, "sluice_queue_wait_seconds_sum", **waited) >= 0.3
    assert value(samples, "sluice_dispatches_total", model=MODEL, band="2") == 1
    assert value(samples, "sluice_dispatches_total", model=MODEL, band="0") == 1
    for name in ("alice", "bob"):
        assert value(samples, "sluice_key_service", key=name, backend="upstream") > 0


# ---------------------------------------------------------------------------- WebSocket


async def test_a_websocket_request_waits_in_the_same_queue_in_the_fair_order(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery, keys=[key("alice"), key("bob")])
        holder = await hold_the_slot(proxy, "alice")
        answers: dict[str, int] = {}

        async def ask(text: str) -> None:
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(text)),
                headers=bearer("alice"),
            )
            answers[text] = response.status_code

        for number in (1, 2):
            nursery.start_soon(ask, f"alice {number}")
            await queued(proxy, number)
        auth = [(name.encode(), value.encode()) for name, value in bearer("bob").items()]
        async with open_websocket_url(ws_url(proxy), extra_headers=auth) as ws:
            await ws.send_message(json.dumps({"model": MODEL, "messages": said("bob on ws")}))
            await queued(proxy, 3)
            await streams_on(proxy.state.scheduling)
            await holder.close()
            text, final = await answer(ws)
        await poll_until(lambda: len(answers) == 2)
        await proxy.state.tracker.wait_idle()
    assert (text, final["type"]) == ("The quick brown ", "done")
    assert answers == {"alice 1": 200, "alice 2": 200}
    assert arrival_order(fake) == ["holder", "bob on ws", "alice 1", "alice 2"]


async def test_a_websocket_request_that_cannot_start_in_time_is_refused_and_the_socket_lives(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await one_slot_replica(nursery)
        holder = await hold_the_slot(proxy)
        # The handshake's headers are every message's.
        async with open_websocket_url(
            ws_url(proxy), extra_headers=[(b"x-sluice-deadline", b"0.2")]
        ) as ws:
            await ws.send_message(json.dumps({"model": MODEL, "messages": said("refused")}))
            refused = await receive(ws)
            await holder.close()
            await proxy.state.tracker.wait_idle()
            await ws.send_message(json.dumps({"model": MODEL, "messages": said("served")}))
            text, final = await answer(ws)
    assert (refused["type"], refused["status"]) == ("error", 503)
    assert refused["error"]["code"] == "deadline_unmeetable"
    assert f"'{MODEL}'" in refused["error"]["message"]
    assert (text, final["type"]) == ("The quick brown ", "done")
    assert arrival_order(fake) == ["holder", "served"]


# ---------------------------------------------------------------------------- reload


def one_slot_toml(upstream: str, queue_timeout: float, max_connections: int = 1) -> str:
    keys = "".join(
        f'[[keys]]\nname = "{name}"\nsha256 = "{hash_key(SECRETS[name])}"\n'
        for name in ("alice", "bob")
    )
    return (
        f"[server]\nport = 0\n[upstream]\npreconnect = 0\n[models.{MODEL}]\n"
        f'upstreams = ["{upstream}"]\nmax_connections = {max_connections}\n'
        f"queue_timeout = {queue_timeout}\n" + keys
    )


async def test_the_queue_its_slots_and_the_keys_counters_outlive_a_reload(
    nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=3, max_running=1)
    path = tmp_path / "sluice.toml"
    path.write_text(one_slot_toml(fake.url, 30))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        holder_body = chat_body(MODEL, messages=said("holder"), fake=ENDLESS)
        answers: dict[str, int] = {}

        async def ask(name: str, text: str) -> None:
            response = await client.post(
                url + CHAT,
                json=chat_body(MODEL, stream=False, messages=said(text)),
                headers=bearer(name),
            )
            answers[text] = response.status_code

        def at(count: int) -> bool:
            return state.scheduling.upstream.queue.size == count

        async with client.stream(
            "POST", url + CHAT, json=holder_body, headers=bearer("alice")
        ) as holder:
            lines = holder.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            for number in (1, 2):
                nursery.start_soon(ask, "alice", f"alice {number}")
                await poll_until(partial(at, number))
            path.write_text(one_slot_toml(fake.url, 20))
            assert await state.reload_config() == "applied"
            # The new replica's one slot is the old one's, still held: bob waits too.
            nursery.start_soon(ask, "bob", "bob")
            await poll_until(partial(at, 3))
            assert len(fake.recorder.records) == 1
            await streams_on(state.scheduling)
        await poll_until(lambda: len(answers) == 3)
    assert answers == {"alice 1": 200, "alice 2": 200, "bob": 200}
    # Alice's service so far was not forgotten: bob, the least served, goes first.
    assert arrival_order(fake) == ["holder", "bob", "alice 1", "alice 2"]


async def test_a_reload_that_adds_slots_dispatches_the_queue_at_once(
    nursery: trio.Nursery, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=3, max_running=2)
    path = tmp_path / "sluice.toml"
    path.write_text(one_slot_toml(fake.url, 30))
    with trio.fail_after(DEADLINE):
        url, state = await serve_file(nursery, path)
        answered: list[httpx.Response] = []

        async def ask() -> None:
            answered.append(
                await client.post(
                    url + CHAT,
                    json=chat_body(MODEL, stream=False, messages=said("queued")),
                    headers=bearer("bob"),
                )
            )

        async with client.stream(
            "POST",
            url + CHAT,
            json=chat_body(MODEL, messages=said("holder"), fake=ENDLESS),
            headers=bearer("alice"),
        ) as holder:
            assert holder.status_code == 200
            nursery.start_soon(ask)
            await poll_until(lambda: state.scheduling.upstream.queue.size == 1)
            path.write_text(one_slot_toml(fake.url, 30, max_connections=2))
            assert await state.reload_config() == "applied"
            # The engine's second slot is used while the first is still held.
            await poll_until(lambda: answered)
            assert answered[0].status_code == 200
            assert arrival_order(fake) == ["holder", "queued"]
            assert fake.recorder.records[0].outcome == "pending"


# ---------------------------------------------------------------------------- the local model


async def test_a_local_models_slots_keep_deadlines_as_an_upstreams_do(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    step = 0.05
    loaded = slowed(tiny_loaded_model, step)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=1, max_queue=4)
        backend = proxy.state.local_backends["tiny"]
        url = proxy.url + CHAT
        running = await RawClient.post(proxy, CHAT, chat_body("tiny"))
        await running.read_until(b'"content":"')
        # Behind a held slot, a wait longer than its deadline: refused at once.
        refused = await client.post(
            url, json=chat_body("tiny", max_tokens=2), headers={"x-sluice-deadline": "0.3"}
        )
        await running.close()
        await backend.admission.wait_free()
        # Running when its deadline comes: it ends in-band, and the model stops within a step.
        sent = trio.current_time()
        async with client.stream(
            "POST",
            url,
            json=chat_body("tiny"),
            headers={"x-sluice-deadline": "0.5"},
        ) as response:
            text = (await response.aread()).decode()
        ended = trio.current_time()
        await backend.admission.wait_free()
        freed = trio.current_time()
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "deadline_unmeetable"
    assert "'tiny'" in refused.json()["error"]["message"]
    assert response.status_code == 200
    payloads = sse_payloads(text)
    assert len(payloads) > 3
    assert json.loads(payloads[-1])["error"]["code"] == "deadline_exceeded"
    assert 0.5 <= ended - sent < 0.5 + 0.5
    assert freed - sent < 0.5 + step + 0.5
    assert backend.active_generations == 0
