"""Errors in the API's shape everywhere: unknown paths, wrong methods and unknown model ids get
OpenAI-shaped errors with a reason phrase on their status line, and GET /v1/models/{id} works
(model names may hold slashes)."""

from __future__ import annotations

import functools
import json
import logging
import socket
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from proxy.backends.upstream.exchange import reason, without_addresses
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.config import UpstreamConfig
from tests.support import DEADLINE, RawClient, chat_body, sse_payloads, start_fake, start_proxy

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


def test_a_redirects_location_and_an_upstreams_words_lose_their_addresses() -> None:
    replica = UpstreamReplica("http://gpu-box.internal:8000", UpstreamConfig())
    said = without_addresses(
        "moved to http://other-box.internal:9000/v1/ (from 10.0.0.5 via https://u:p@gw/x)",
        replica,
    )
    assert said == "moved to http://<address>/v1/ (from <address> via https://<address>/x)"


# Each failure a client may meet, and the code it gets: (the model's table beside its
# upstreams, the fake's plan for the request, its headers, the code, in-band or not).
FAILURES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, str], str, bool]] = {
    "refused": ({}, {}, {}, "upstream_connect_error", False),
    "tls_lean": ({"transport": "lean"}, {}, {}, "upstream_connect_error", False),
    "tls_httpx": ({"transport": "httpx"}, {}, {}, "upstream_connect_error", False),
    "first_token": (
        {"first_token_timeout": 0.2},
        {"ttft": 5},
        {},
        "upstream_first_token_timeout",
        False,
    ),
    "http_500": ({}, {"mode": "status", "status": 500}, {}, "upstream_http_error", False),
    "reset": ({}, {"mode": "reset", "at": 0}, {}, "upstream_protocol_error", False),
    "malformed": ({}, {"mode": "malformed", "at": 0}, {}, "upstream_malformed", False),
    # The tokens before the stall at once, and a second of silence: a loaded machine's pause
    # between two tokens must not pass for it.
    "idle": (
        {"idle_timeout": 1.0},
        {"mode": "stall", "at": 2, "interval": 0},
        {},
        "upstream_idle_timeout",
        True,
    ),
    "reset_mid_stream": ({}, {"mode": "reset", "at": 2}, {}, "upstream_protocol_error", True),
    "deadline": ({}, {"ttft": 5}, {"x-sluice-deadline": "0.2"}, "deadline_exceeded", False),
    "total": ({"total_timeout": 0.2}, {"ttft": 5}, {}, "upstream_total_timeout", False),
}


async def not_tls(nursery: trio.Nursery) -> int:
    """A server that answers a TLS handshake in plain HTTP, at once: its port."""

    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    serve = functools.partial(trio.serve_tcp, answer, 0, host="127.0.0.1")
    (listener,) = await nursery.start(serve)
    return int(listener.socket.getsockname()[1])


async def replica_url(nursery: trio.Nursery, case: str, fake_url: str, closed_port: int) -> str:
    if case == "refused":
        # By name: a resolver's words name the host too.
        return f"http://localhost:{closed_port}"
    if case.startswith("tls_"):
        return f"https://127.0.0.1:{await not_tls(nursery)}"
    return fake_url


def assert_no_address(text: str, url: str) -> None:
    port = url.rsplit(":", 1)[1]
    for leak in ("127.0.0.1", "localhost", port):
        assert leak not in text, f"{leak!r} in {text!r}"


@pytest.mark.parametrize("case", sorted(FAILURES))
async def test_no_client_error_shows_a_replicas_address_and_the_log_does(
    nursery: trio.Nursery, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    table, plan, headers, code, in_band = FAILURES[case]
    caplog.set_level(logging.INFO, logger="sluice.upstream")
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=5)
    closed = socket.socket()
    try:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        url = await replica_url(nursery, case, fake.url, closed.getsockname()[1])
        proxy = await start_proxy(nursery, {"m": {"upstreams": [url], **table}})
        with trio.fail_after(DEADLINE):
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                body = chat_body("m", fake=plan)
                response = await client.post(proxy.url + CHAT, json=body, headers=headers)
                if not in_band:
                    # The Messages API's shape says the same, as the WebSocket does.
                    messages = await client.post(
                        proxy.url + "/v1/messages",
                        json={
                            "model": "m",
                            "max_tokens": 8,
                            "stream": True,
                            "messages": body["messages"],
                            "fake": plan,
                        },
                        headers=headers,
                    )
                    assert messages.json()["type"] == "error", messages.text
                    assert_no_address(messages.text, url)
            if not in_band and not headers:
                ws_url = proxy.url.replace("http://", "ws://") + "/v1/ws"
                async with open_websocket_url(ws_url) as ws:
                    await ws.send_message(json.dumps({**body, "stream": True}))
                    message = await ws.get_message()
                    assert json.loads(message)["type"] == "error", message
                    assert_no_address(str(message), url)
    finally:
        closed.close()
    assert_no_address(response.text, url)
    if in_band:
        assert response.status_code == 200
        # The stream's last event, after some tokens: no [DONE] follows it.
        error = json.loads(sse_payloads(response.text)[-1])["error"]
    else:
        assert response.status_code >= 500, response.text
        error = response.json()["error"]
    assert error["code"] == code, error
    if case not in ("deadline", "total"):  # the request's deadlines: no replica's failure
        assert "model 'm' upstreams[0]" in error["message"], error
        logged = [r.getMessage() for r in caplog.records if r.name == "sluice.upstream"]
        assert any(url in line and code in line for line in logged), logged


async def test_a_replica_ejected_for_its_failures_is_named_without_its_address(
    nursery: trio.Nursery,
) -> None:
    closed = socket.socket()
    try:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        proxy = await start_proxy(
            nursery, {"m": {"upstreams": [url]}}, upstream={"failure_threshold": 1}
        )
        with trio.fail_after(DEADLINE):
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                first = await client.post(proxy.url + CHAT, json=chat_body("m"))
                second = await client.post(proxy.url + CHAT, json=chat_body("m"))
    finally:
        closed.close()
    assert first.json()["error"]["code"] == "upstream_connect_error"
    assert second.status_code == 503, second.text
    error = second.json()["error"]
    assert error["code"] == "no_healthy_upstream"
    assert "model 'm' upstreams[0] (upstream_connect_error" in error["message"], error
    assert_no_address(second.text, url)
