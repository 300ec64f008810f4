"""The local backend behind the relay: real hypercorn, real httpx, a tiny random Llama."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from tests.support import (
    DEADLINE,
    Proxy,
    RawClient,
    chat_body,
    gated,
    poll_until,
    slowed,
    sse_payloads,
    start_local_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"


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
    loaded = gated(tiny_loaded_model, 0.005)
    model = loaded.model
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, loaded, slots=4)
        backend = proxy.state.local_backends["tiny"]
        assert backend.engine.batching
        alone = [await streamed_answer(client, proxy, question(q)) for q in QUESTIONS]
        together: dict[int, str] = {}

        async def ask(index: int) -> None:
            together[index] = await streamed_answer(client, proxy, question(QUESTIONS[index]))

        # The first to come waits in its prefill until all four are inside the engine: then
        # they join the batch one prefill a step, long before the first's 24 tokens are out,
        # however the requests' arrivals were spread (a loaded machine spreads them).
        model.decode_rows.clear()
        model.gate.clear()
        try:
            async with trio.open_nursery() as asking:
                for index in range(len(QUESTIONS)):
                    asking.start_soon(ask, index)
                await poll_until(lambda: backend.active_generations == len(QUESTIONS))
                model.gate.set()
        finally:
            model.gate.set()
        assert [together[i] for i in range(len(QUESTIONS))] == alone
        assert max(model.decode_rows) == 4
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
        leaving = await RawClient.post(proxy, CHAT, chat_body("tiny"))
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
        stalled = await RawClient.post(proxy, CHAT, chat_body("tiny"), rcvbuf=4096)
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


# --- the prefix cache ------------------------------------------------------------------------


async def test_a_repeated_prompt_reuses_its_prefix_and_healthz_and_metrics_say_so(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, tiny_loaded_model, slots=2)
        body = question("Tell me about rivers.", stream=False, max_tokens=8)
        answers = [
            (await client.post(proxy.url + CHAT, json=body)).json()["choices"][0]["message"]
            for _ in range(2)
        ]
        assert answers[0] == answers[1]
        health = (await client.get(proxy.url + "/healthz")).json()["local_models"]["tiny"]
        cache = health["prefix_cache"]
        assert (cache["hits"], cache["misses"], cache["entries"]) == (1, 1, 1)
        assert 0 < cache["bytes"] <= cache["limit_bytes"] == 256 * 1024 * 1024
        metrics = (await client.get(proxy.url + "/metrics")).text
        assert 'sluice_local_prefix_cache_hits_total{model="tiny"} 1.0' in metrics
        assert 'sluice_local_prefix_cache_misses_total{model="tiny"} 1.0' in metrics
        assert f'sluice_local_prefix_cache_bytes{{model="tiny"}} {float(cache["bytes"])}' in metrics


async def test_a_prefix_cache_of_zero_bytes_is_off(
    nursery: trio.Nursery, client: httpx.AsyncClient, tiny_loaded_model: Any
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_local_proxy(nursery, tiny_loaded_model, prefix_cache_bytes=0)
        response = await client.post(proxy.url + CHAT, json=question("Hi", stream=False))
        assert response.status_code == 200
        health = (await client.get(proxy.url + "/healthz")).json()["local_models"]["tiny"]
        assert health["prefix_cache"] is None
