"""The local model's slots are ordered by the same fair scheduler as the upstreams', and keep the
same deadlines: a tiny random Llama (slowed, one slot), real hypercorn, real httpx, two keys.

- alice queues several requests behind her own running one, then bob queues one: bob's goes
  next (FIFO would serve all of alice's first);
- a request queued behind a long one, whose deadline (``x-sluice-deadline``, the SDK's
  ``x-stainless-read-timeout``) comes before its slot can, gets 503 ``deadline_unmeetable``:
  at once when the estimate says so, else when the deadline comes;
- a request that passes its deadline while it runs stops within one decode step: 504
  ``deadline_exceeded`` before its first byte (a JSON answer), an in-band error event once
  its stream has begun.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from tests.api.test_auth import OTHER_SECRET, SECRET, bearer, key_table
from tests.support import (
    DEADLINE,
    Proxy,
    chat_body,
    gated,
    local_model,
    poll_until,
    slowed,
    sse_payloads,
    start_proxy,
)

CHAT = "/v1/chat/completions"
# One decode step of the slowed model.
STEP = 0.02


async def start(nursery: trio.Nursery, loaded: Any, policy: str = "fair") -> Proxy:
    return await start_proxy(
        nursery,
        {"tiny": local_model(slots=1)},
        local_models={"tiny": loaded},
        keys=[key_table(SECRET, "alice"), key_table(OTHER_SECRET, "bob")],
        scheduling={"policy": policy},
    )


def backend(proxy: Proxy) -> Any:
    return proxy.state.local_backends["tiny"]


async def post(client: httpx.AsyncClient, proxy: Proxy, secret: str, **body: Any) -> httpx.Response:
    headers = {**bearer(secret), **body.pop("headers", {})}
    return await client.post(
        proxy.url + CHAT, json=chat_body("tiny", stream=False, **body), headers=headers
    )


@pytest.fixture
def slow_model(tiny_loaded_model: Any) -> Any:
    return slowed(tiny_loaded_model, STEP)


@pytest.mark.parametrize("policy", ["fair", "fifo"])
async def test_a_key_queued_behind_another_keys_backlog_goes_next(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any, policy: str
) -> None:
    loaded = gated(tiny_loaded_model, STEP)
    model = loaded.model
    with trio.fail_after(DEADLINE):
        proxy = await start(nursery, loaded, policy)
        local = backend(proxy)
        finished: list[str] = []

        async def request(name: str, secret: str, max_tokens: int) -> None:
            response = await post(client, proxy, secret, max_tokens=max_tokens)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == max_tokens
            finished.append(name)

        # alice's first holds the one slot, its prefill held by the gate until the others
        # have queued behind it one by one (however slowly a loaded machine queues them),
        # then for 30 steps.
        model.gate.clear()
        try:
            async with trio.open_nursery() as requests:
                requests.start_soon(request, "alice-0", SECRET, 30)
                await poll_until(lambda: local.room.in_flight == 1)
                for index in range(1, 4):
                    requests.start_soon(request, f"alice-{index}", SECRET, 3)
                    await local.admission.wait_queued(index)
                requests.start_soon(request, "bob", OTHER_SECRET, 3)
                await local.admission.wait_queued(4)
                # Still alice's first in the slot: every other request waited in Sluice's queue.
                assert local.room.in_flight == 1 and "alice-0" not in finished
                model.gate.set()
        finally:
            model.gate.set()
        # One slot: they ended in the order they were dispatched. bob was lifted to alice's
        # counter as he arrived; alice's first request went on being served after that. FIFO
        # (the A/B setting) serves alice's backlog first.
        alices = ["alice-1", "alice-2", "alice-3"]
        if policy == "fair":
            assert finished == ["alice-0", "bob", *alices]
        else:
            assert finished == ["alice-0", *alices, "bob"]
        counters = local.admission.dispatcher.queue.counters
        assert counters["alice"] > counters["bob"] > 0


async def test_a_queued_request_that_cannot_start_in_time_is_refused(
    nursery: trio.Nursery, client: httpx.AsyncClient, slow_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start(nursery, slow_model)
        local = backend(proxy)
        async with trio.open_nursery() as requests:
            # bob holds the slot for about 2 s (100 steps), his own deadline well after.
            requests.start_soon(partial(post, client, proxy, OTHER_SECRET, max_tokens=100))
            await poll_until(lambda: local.room.in_flight == 1)
            # Slots are held 1 s by the estimate: a first byte due in 0.3 s cannot come.
            for header in ("x-stainless-read-timeout", "x-sluice-deadline"):
                started = trio.current_time()
                refused = await post(client, proxy, SECRET, max_tokens=3, headers={header: "0.3"})
                assert trio.current_time() - started < 0.2
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "deadline_unmeetable"
                assert "Retry-After" in refused.headers
                assert "tiny" in refused.json()["error"]["message"]
            # One due in 1.2 s waits (the estimate says 1 s), and is refused when it comes.
            started = trio.current_time()
            late = await post(
                client, proxy, SECRET, max_tokens=3, headers={"x-stainless-read-timeout": "1.2"}
            )
            waited = trio.current_time() - started
            assert 1.1 < waited < 1.2 + 0.3, waited
            assert late.status_code == 503, late.text
            assert late.json()["error"]["code"] == "deadline_unmeetable"
            # Refused in the queue: the model never saw it; bob's is still running.
            assert local.room.in_flight == 1
            assert local.admission.waiting == 0
            requests.cancel_scope.cancel()
        with trio.fail_after(1):
            await local.admission.wait_free()


async def test_a_running_request_past_its_deadline_stops_within_a_step(
    nursery: trio.Nursery, client: httpx.AsyncClient, slow_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start(nursery, slow_model)
        local = backend(proxy)
        deadline = 0.3
        # Before its first byte (a JSON answer is all at its end): 504.
        started = trio.current_time()
        response = await post(
            client, proxy, SECRET, max_tokens=400, headers={"x-sluice-deadline": str(deadline)}
        )
        took = trio.current_time() - started
        steps = slow_model.model.steps
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "deadline_exceeded"
        # Answered once the sequence was out: within a step (and the loop's turn) of the
        # deadline, and the model stepped no more.
        assert deadline <= took < deadline + 3 * STEP + 0.1, took
        assert local.active_generations == 0
        await trio.sleep(3 * STEP)
        assert slow_model.model.steps == steps
        # Mid-stream: an in-band error event ends the stream.
        started = trio.current_time()
        async with client.stream(
            "POST",
            proxy.url + CHAT,
            json=chat_body("tiny", max_tokens=400),
            headers={**bearer(SECRET), "x-sluice-deadline": str(deadline)},
        ) as streamed:
            assert streamed.status_code == 200
            text = (await streamed.aread()).decode()
        took = trio.current_time() - started
        steps = slow_model.model.steps
        assert deadline <= took < deadline + 3 * STEP + 0.1, took
        payloads = sse_payloads(text)
        assert len(payloads) > 3  # it had begun
        errors = [json.loads(p)["error"] for p in payloads if p != "[DONE]" and "error" in p]
        assert errors and errors[-1]["code"] == "deadline_exceeded", payloads[-3:]
        assert local.active_generations == 0
        await trio.sleep(3 * STEP)
        assert slow_model.model.steps == steps
        with trio.fail_after(1):
            await local.admission.wait_free()
