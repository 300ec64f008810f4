"""Sluice in front of llama.cpp's server (llama-cpp-python[server]; opt-in: `make
test-llamacpp` starts one and sets SLUICE_LLAMACPP_URL; deselected from `make test`).

llama-cpp-python's server checks for a disconnect after each chunk and stops generating, logging
"Disconnected from client"; the time from the client's close to that line is printed.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
import trio

from tests.support import RawClient, chat_body, sse_payloads, start_proxy, stream_text

pytestmark = pytest.mark.llamacpp

URL = os.environ.get("SLUICE_LLAMACPP_URL", "")
LOG = os.environ.get("SLUICE_LLAMACPP_LOG", "")
CHAT = "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def llamacpp_url() -> str:
    if not URL or not LOG:
        pytest.fail("SLUICE_LLAMACPP_URL/_LOG are not set: run `make test-llamacpp`")
    return URL


async def test_stream_non_stream_and_usage_through_sluice(
    nursery: trio.Nursery, llamacpp_url: str
) -> None:
    with trio.fail_after(120):
        proxy = await start_proxy(nursery, {"smollm2": [llamacpp_url]})
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            body = chat_body("smollm2", messages=QUESTION, temperature=0, max_tokens=30)
            response = await client.post(proxy.url + CHAT, json=body)
            assert response.status_code == 200
            payloads = sse_payloads(response.text)
            assert payloads[-1] == "[DONE]"
            answer = stream_text(payloads)
            print(f"\nllama.cpp via Sluice, streamed: {answer!r}")
            # llama.cpp runs the Q4_1 weights as they are (no dequantization), and its greedy
            # answer here is not the same as transformers'; what matters is the relay, so the
            # streamed and the non-streamed greedy answers must agree.
            assert answer.strip()
            whole = await client.post(proxy.url + CHAT, json={**body, "stream": False})
            assert whole.status_code == 200
            content = whole.json()["choices"][0]["message"]["content"]
            assert content == answer
            assert json.loads(whole.text)["usage"]["completion_tokens"] > 0


async def test_disconnect_mid_stream_stops_llamacpp(
    nursery: trio.Nursery, llamacpp_url: str
) -> None:
    with trio.fail_after(180):
        proxy = await start_proxy(nursery, {"smollm2": [llamacpp_url]})
        log = trio.Path(LOG)
        before = (await log.read_text(errors="replace")).count("Disconnected from client")
        body = chat_body(
            "smollm2",
            messages=[{"role": "user", "content": "Write a very long story about the sea."}],
            max_tokens=1500,
        )
        raw = await RawClient.post(proxy, CHAT, body)
        await raw.read_until(b"data: ", count=5)
        closed_at = trio.current_time()
        await raw.close()
        while True:
            text = await log.read_text(errors="replace")
            if text.count("Disconnected from client") > before:
                break
            await trio.sleep(0.01)
        seconds = trio.current_time() - closed_at
        print(f"\nclient close -> llama.cpp 'Disconnected from client' in {seconds * 1000:.0f} ms")
        assert seconds < 5
        # The server is free again at once: a short request is answered promptly.
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            started = trio.current_time()
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body("smollm2", messages=QUESTION, stream=False, max_tokens=5),
            )
            assert response.status_code == 200
            assert trio.current_time() - started < 10
