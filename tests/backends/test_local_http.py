"""The local backend behind the relay: real hypercorn, real httpx, a tiny random Llama."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import trio

from tests.support import (
    DEADLINE,
    Proxy,
    RawClient,
    chat_body,
    poll_until,
    producer_tasks,
    slowed,
    sse_payloads,
    start_proxy,
    stream_text,
    wait_until_steady,
)

CHAT = "/v1/chat/completions"


def local_model(**overrides: Any) -> dict[str, Any]:
    return {"backend": "local", "path": "unused-preloaded", "default_temperature": 0.0, **overrides}


async def start_local_proxy(nursery: trio.Nursery, loaded: Any, **overrides: Any) -> Proxy:
    relay = overrides.pop("relay", {})
    return await start_proxy(
        nursery,
        {"tiny": local_model(**overrides)},
        local_models={"tiny": loaded},
        relay=relay,
    )


def engine_threads() -> int:
    """Threads stepping a local model's batch: one per model, whatever the requests."""
    # trio names a worker thread after its job while it runs (the engine names its own).
    return sum(1 for t in threading.enumerate() if t.name.startswith("sluice engine "))


async def test_local_stream_and_non_stream(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, tiny_loaded_model)
        response = await client.post(
            proxy.url + CHAT,
            json=chat_body("tiny", max_tokens=8, stream_options={"include_usage": True}),
        )
        assert response.status_code == 200
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]"
        usage = json.loads(payloads[-2])["usage"]
        assert usage["completion_tokens"] == 8
        streamed = stream_text(payloads)
        response = await client.post(
            proxy.url + CHAT, json=chat_body("tiny", stream=False, max_tokens=8)
        )
        body = response.json()
        assert body["choices"][0]["message"]["content"] == streamed
        assert body["choices"][0]["finish_reason"] == "length"
        # The step-time watch: 2 requests x 7 decode steps (the first step is the prefill).
        health = (await client.get(proxy.url + "/healthz")).json()["local_models"]["tiny"]
        assert health["decode_step_ms_p50"] is not None
        assert len(proxy.state.local_backends["tiny"].decode_seconds) == 14
        assert (health["slots"], health["busy"], health["queued"]) == (1, 0, 0)


async def test_disconnect_mid_generation_stops_the_thread_within_one_step(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    step = 0.05
    loaded = slowed(tiny_loaded_model, step)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded)
        backend = proxy.state.local_backends["tiny"]
        raw = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=400))
        await raw.read_until(b'"content":"', count=4)
        assert backend.active_generations == 1
        assert engine_threads() == 1
        steps_at_close = loaded.model.steps
        closed_at = await raw.close()
        await backend.admission.wait_free()
        freed_after = trio.current_time() - closed_at
        # The step in progress finishes, then the thread notices and returns.
        assert freed_after < step + 0.1, freed_after
        assert loaded.model.steps - steps_at_close <= 1
        assert backend.active_generations == 0
        assert engine_threads() == 1
        assert backend.engine.sequences == 0
        await proxy.state.tracker.wait_idle()
        assert producer_tasks() == []
        registry = proxy.state.metrics.registry
        labels = {"backend": "local", "phase": "mid_stream"}
        assert registry.get_sample_value("sluice_cancellations_total", labels) == 1
        propagation = registry.get_sample_value(
            "sluice_cancel_propagation_seconds_sum", {"backend": "local"}
        )
        assert propagation is not None and 0 < propagation < step + 0.1
        # The slot is free: the next request is served at once.
        response = await client.post(
            proxy.url + CHAT, json=chat_body("tiny", stream=False, max_tokens=2)
        )
        assert response.status_code == 200


async def test_slow_reader_blocks_the_model_itself(
    nursery: trio.Nursery, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.0)
    capacity = 4
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(
            nursery, loaded, relay={"channel_capacity": capacity, "stall_timeout": 2.0}
        )
        backend = proxy.state.local_backends["tiny"]
        raw = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=100_000), rcvbuf=4096)
        await raw.read_until(b'"content":"', count=2)
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        # The model pauses (the thread waits in from_thread.run(send)), its output held in
        # the bounded channel, far from the 100k tokens it was asked for.
        steps = await wait_until_steady(lambda: loaded.model.steps)
        assert steps[-1] < 5_000, steps
        assert relay.buffered() == capacity
        assert backend.active_generations == 1
        # Past stall_timeout the client is cut off and the model released.
        await backend.admission.wait_free()
        assert backend.active_generations == 0
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.stalled == 1
        await raw.stream.aclose()


async def test_admission_queue_full_is_429_and_deadline_is_503(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.02)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=1, max_queue=1, queue_timeout=0.5)
        backend = proxy.state.local_backends["tiny"]
        running = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=10_000))
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
        running = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=10_000))
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


async def test_local_bad_prompts_are_400(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, tiny_loaded_model)
        too_long = chat_body("tiny", messages=[{"role": "user", "content": "word " * 2000}])
        response = await client.post(proxy.url + CHAT, json=too_long)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "context_length_exceeded"
        odd_role = chat_body("tiny", messages=[{"role": "wizard", "content": "hi"}])
        response = await client.post(proxy.url + CHAT, json=odd_role)
        assert response.status_code == 400
        response = await client.post(proxy.url + CHAT, json=chat_body("tiny", temperature=5))
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temperature"


# --- several requests in one batch -----------------------------------------------------------

QUESTIONS = ["Tell me about rivers.", "What is the capital of France?", "Hi", "Count to ten."]


def question(text: str, **extra: Any) -> dict[str, Any]:
    return chat_body(
        "tiny", messages=[{"role": "user", "content": text}], **{"max_tokens": 24, **extra}
    )


async def streamed_answer(client: httpx.AsyncClient, proxy: Proxy, body: dict[str, Any]) -> str:
    response = await client.post(proxy.url + CHAT, json=body)
    assert response.status_code == 200, response.text
    return stream_text(sse_payloads(response.text))


async def test_four_requests_share_the_batch_and_answer_as_they_would_alone(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.005)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=4)
        backend = proxy.state.local_backends["tiny"]
        assert backend.engine.batching
        alone = [await streamed_answer(client, proxy, question(q)) for q in QUESTIONS]
        together: dict[int, str] = {}
        sizes: list[int] = []

        async def ask(index: int) -> None:
            together[index] = await streamed_answer(client, proxy, question(QUESTIONS[index]))

        async def watch() -> None:
            while True:
                sizes.append(backend.engine.batch_size)
                await trio.sleep(0.002)

        async with trio.open_nursery() as requests:
            requests.start_soon(watch)
            async with trio.open_nursery() as asking:
                for index in range(len(QUESTIONS)):
                    asking.start_soon(ask, index)
            requests.cancel_scope.cancel()
        assert [together[i] for i in range(len(QUESTIONS))] == alone
        assert max(sizes) == 4
        non_streamed = await client.post(
            proxy.url + CHAT, json=question(QUESTIONS[1], stream=False)
        )
        assert non_streamed.json()["choices"][0]["message"]["content"] == alone[1]
        samples = (await client.get(proxy.url + "/metrics")).text
        assert 'sluice_local_step_seconds_count{batch_size="4",model="tiny"}' in samples
        assert backend.describe()["batch_size"] == 0


async def test_a_client_leaving_takes_only_its_sequence_out_of_the_batch(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    step = 0.03
    loaded = slowed(tiny_loaded_model, step)
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=3)
        backend = proxy.state.local_backends["tiny"]
        alone = [await streamed_answer(client, proxy, question(q)) for q in QUESTIONS[:2]]
        leaving = await RawClient.post(proxy, CHAT, chat_body("tiny", max_tokens=10_000))
        await leaving.read_until(b'"content":"', count=3)
        answers: dict[int, str] = {}

        async def ask(index: int) -> None:
            answers[index] = await streamed_answer(client, proxy, question(QUESTIONS[index]))

        async with trio.open_nursery() as asking:
            for index in range(2):
                asking.start_soon(ask, index)
            await poll_until(lambda: backend.engine.batch_size == 3)
            steps_at_close = loaded.model.steps
            closed_at = await leaving.close()
            await poll_until(lambda: backend.active_generations == 2)
            left_after = trio.current_time() - closed_at
            # Out within the step in progress (one model call for the whole batch).
            assert left_after < step + 0.1, left_after
            assert loaded.model.steps - steps_at_close <= 2
        assert [answers[0], answers[1]] == alone
        await proxy.state.tracker.wait_idle()
        assert backend.engine.sequences == 0
        registry = proxy.state.metrics.registry
        labels = {"backend": "local", "phase": "mid_stream"}
        assert registry.get_sample_value("sluice_cancellations_total", labels) == 1


async def test_a_stalled_reader_is_parked_then_evicted_and_the_others_finish(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    loaded = slowed(tiny_loaded_model, 0.002)
    capacity = 4
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(
            nursery,
            loaded,
            slots=2,
            relay={"channel_capacity": capacity, "stall_timeout": 1.5},
        )
        backend = proxy.state.local_backends["tiny"]
        expected = await streamed_answer(client, proxy, question(QUESTIONS[0], max_tokens=200))
        stalled = await RawClient.post(
            proxy, CHAT, chat_body("tiny", max_tokens=100_000), rcvbuf=4096
        )
        await stalled.read_until(b'"content":"', count=2)
        (relay,) = proxy.state.tracker.active
        await poll_until(lambda: relay.buffered() == capacity)
        (sequence,) = backend._listeners
        await poll_until(lambda: sequence.parked)
        # Parked: not stepped, so the other request runs alone in the batch meanwhile.
        answer = await streamed_answer(client, proxy, question(QUESTIONS[0], max_tokens=200))
        assert answer == expected
        assert sequence.parked and sequence.produced < 5_000
        # Past stall_timeout the pipeline cuts the client off; the sequence leaves.
        await poll_until(lambda: backend.active_generations == 0)
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.stalled == 1
        assert backend.engine.sequences == 0
        await stalled.stream.aclose()


async def test_a_character_cut_by_max_tokens_never_reaches_the_client_as_u_fffd(
    nursery: trio.Nursery, client: httpx.AsyncClient, smol_tokenizer: Any
) -> None:
    from tests.inference.test_batching import cut_character_model

    loaded, text, tokens = cut_character_model(smol_tokenizer)
    body = chat_body(
        "tiny",
        messages=[{"role": "user", "content": "请用中文写一句关于河流的话。"}],
        max_tokens=tokens,
        temperature=0,
    )
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded)
        response = await client.post(proxy.url + CHAT, json=body)
        payloads = sse_payloads(response.text)
        assert stream_text(payloads) == text
        assert "\ufffd" not in response.text and "\\ufffd" not in response.text
        response = await client.post(proxy.url + CHAT, json={**body, "stream": False})
        choice = response.json()["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (text, "length")
