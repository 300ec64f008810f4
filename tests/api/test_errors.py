"""Errors in the API's shape everywhere: unknown paths, wrong methods and unknown model ids get
OpenAI-shaped errors with a reason phrase on their status line, and GET /v1/models/{id} works
(model names may hold slashes)."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import trio

from proxy.backends.upstream.exchange import reason
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.config import UpstreamConfig
from tests.support import DEADLINE, RawClient, chat_body, start_fake, start_proxy

CHAT = "/v1/chat/completions"


async def test_unknown_paths_wrong_methods_and_model_ids(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
    proxy = await start_proxy(
        nursery, {"HuggingFaceTB/SmolLM2-135M-Instruct": [fake.url], "m": [fake.url]}
    )
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            unknown = await client.get(proxy.url + "/v2/chat")
            wrong = await client.get(proxy.url + "/v1/chat/completions")
            named = await client.get(proxy.url + "/v1/models/HuggingFaceTB/SmolLM2-135M-Instruct")
            missing = await client.get(proxy.url + "/v1/models/nope")
    assert unknown.status_code == 404 and unknown.reason_phrase == "Not Found"
    assert unknown.json()["error"]["code"] == "not_found"
    assert "/v1/chat/completions" in unknown.json()["error"]["message"]
    assert wrong.status_code == 405 and wrong.reason_phrase == "Method Not Allowed"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["Allow"] and "POST" in wrong.json()["error"]["message"]
    assert named.status_code == 200
    assert named.json()["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert named.json()["object"] == "model"
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


async def test_status_lines_carry_a_reason_phrase_streamed_or_not(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
    proxy = await start_proxy(nursery, {"m": [fake.url]})
    with trio.fail_after(DEADLINE):
        streamed = await RawClient.post(proxy, "/v1/chat/completions", chat_body("m"))
        await streamed.read_until(b"\r\n")
        refused = await RawClient.post(proxy, "/v1/chat/completions", b"{")
        await refused.read_until(b"\r\n")
        await streamed.close()
        await refused.close()
    assert streamed.received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert refused.received.startswith(b"HTTP/1.1 400 Bad Request\r\n")


async def test_a_502_names_every_replica_tried_and_one_replica_tries_no_other(
    nursery: trio.Nursery, caplog: Any
) -> None:
    closed = [socket.socket() for _ in range(2)]
    try:
        for sock in closed:
            sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        urls = [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in closed]
        proxy = await start_proxy(nursery, {"both": urls, "single": urls[:1]})
        with trio.fail_after(DEADLINE):
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                both = await client.post(proxy.url + CHAT, json=chat_body("both"))
                caplog.clear()
                single = await client.post(proxy.url + CHAT, json=chat_body("single"))
    finally:
        for sock in closed:
            sock.close()
    assert both.status_code == 502
    message = both.json()["error"]["message"]
    # Each named by its place in the model's table, never by its address.
    assert all(f"model 'both' upstreams[{i}]" in message for i in range(2)), message
    assert "127.0.0.1" not in both.text
    assert single.status_code == 502
    # The operator's log names the replica the client's error does not.
    assert any(urls[0] in r.getMessage() for r in caplog.records), caplog.records
    assert not any("trying another replica" in r.getMessage() for r in caplog.records)


ADDRESSES = [
    ("connect to 10.0.0.5:8000: refused", "connect to <address>: refused"),
    ("[Errno -2] gpu-box.internal: not known", "[Errno -2] <address>: not known"),
    ("connect to [fd00::5]:8000 failed", "connect to <address> failed"),
    ("peer closed connection without a body", "peer closed connection without a body"),
]


@pytest.mark.parametrize(("text", "said"), ADDRESSES)
def test_a_failures_words_reach_a_client_without_an_address(text: str, said: str) -> None:
    replica = UpstreamReplica("http://gpu-box.internal:8000", UpstreamConfig())
    assert reason(OSError(text), replica) == said
