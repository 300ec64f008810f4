"""Upstream answers a proxy must not mangle: redirects are not followed, and a body the server
encoded although asked for identity is decoded (gzip, deflate) or passed on with its
Content-Encoding (anything else, when not streamed). And upstream answers that are the
operator's mistake, or the upstream's, read as such: a refusal of Sluice's credentials is a
502 upstream_auth_error (never the client's own 401), an unknown model's 404 says it came from
the upstream, and a non-JSON 200 is upstream_malformed."""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from functools import partial

import httpx
import pytest
import trio

from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    chat_body,
    read_request_head,
    sse_payloads,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"
ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
}


def event(content: str) -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


STREAM = event("Hel") + event("lo") + b"data: [DONE]\n\n"

# Each answer over both transports: httpx must not follow or decode either.
pytestmark = pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)


async def serve_response(
    status: str, headers: list[tuple[str, str]], body: bytes, task_status: trio.TaskStatus[str]
) -> None:
    """An upstream that answers every request with this status line, headers and body."""

    async def handle(stream: trio.SocketStream) -> None:
        received = await read_request_head(stream)
        if received is None:
            return
        head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers)
        await stream.send_all(head.encode() + b"\r\n" + body)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    await trio.serve_listeners(handle, listeners)


async def ask(
    nursery: trio.Nursery,
    status: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    stream: bool,
    transport: str,
    **sections: dict[str, int],
) -> httpx.Response:
    url = await nursery.start(partial(serve_response, status, headers, body))
    model = {"upstreams": [url], "transport": transport}
    proxy = await start_proxy(nursery, {"m": model}, upstream={"max_attempts": 1}, **sections)
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        return await client.post(proxy.url + CHAT, json=chat_body("m", stream=stream))


@pytest.mark.parametrize("status", ["301 Moved Permanently", "307 Temporary Redirect"])
async def test_a_redirect_is_a_502_naming_status_and_location(
    nursery: trio.Nursery, transport: str, status: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.upstream")
    with trio.fail_after(DEADLINE):
        location = "https://gpu-box.internal:8443/v1/chat/completions"
        response = await ask(
            nursery, status, [("Location", location)], b"", stream=False, transport=transport
        )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_redirect"
    # Where it points, less the host (an internal name): the scheme and path say what is
    # wrong with the URL. The operator's log has all of it.
    assert status.split()[0] in error["message"]
    assert "https://<address>/v1/chat/completions" in error["message"], error
    assert "gpu-box" not in response.text
    assert any(location in r.getMessage() for r in caplog.records), caplog.records


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
)
async def test_an_encoded_answer_is_decoded(
    nursery: trio.Nursery, transport: str, encoding: str, compress: object
) -> None:
    assert callable(compress)
    body = compress(json.dumps(ANSWER).encode())
    headers = [("Content-Type", "application/json"), ("Content-Encoding", encoding)]
    with trio.fail_after(DEADLINE):
        response = await ask(nursery, "200 OK", headers, body, stream=False, transport=transport)
    assert response.status_code == 200
    assert "content-encoding" not in response.headers
    assert response.json() == ANSWER


async def test_an_encoded_stream_is_decoded(nursery: trio.Nursery, transport: str) -> None:
    headers = [("Content-Type", "text/event-stream"), ("Content-Encoding", "gzip")]
    with trio.fail_after(DEADLINE):
        response = await ask(
            nursery, "200 OK", headers, gzip.compress(STREAM), stream=True, transport=transport
        )
    assert response.status_code == 200
    assert stream_text(sse_payloads(response.text)) == "Hello"


async def test_an_encoding_sluice_cannot_decode_is_passed_on_or_refused(
    nursery: trio.Nursery,
    transport: str,
) -> None:
    opaque = b"\x1b\x00an-encoding-of-its-own"
    whole = [("Content-Type", "application/json"), ("Content-Encoding", "x-custom")]
    streamed = [("Content-Type", "text/event-stream"), ("Content-Encoding", "x-custom")]
    with trio.fail_after(DEADLINE):
        raw = await ask(nursery, "200 OK", whole, opaque, stream=False, transport=transport)
        refused = await ask(nursery, "200 OK", streamed, opaque, stream=True, transport=transport)
    # Passed on as it came, labelled as it came (httpx reads an unknown encoding raw).
    assert raw.status_code == 200
    assert raw.headers["content-encoding"] == "x-custom"
    assert raw.content == opaque
    assert refused.status_code == 502
    assert refused.json()["error"]["code"] == "upstream_encoding"


async def test_a_decoded_body_past_the_limit_is_refused(
    nursery: trio.Nursery, transport: str
) -> None:
    bomb = gzip.compress(b"{" + b" " * 2_000_000 + b"}")
    headers = [("Content-Type", "application/json"), ("Content-Encoding", "gzip")]
    with trio.fail_after(DEADLINE):
        response = await ask(
            nursery,
            "200 OK",
            headers,
            bomb,
            stream=False,
            transport=transport,
            relay={"max_response_bytes": 100_000},
        )
    assert response.status_code == 502
    assert "limit" in response.json()["error"]["message"]


@pytest.mark.parametrize("status", ["401 Unauthorized", "403 Forbidden"])
async def test_a_refusal_of_sluices_credentials_is_a_502_of_the_upstream(
    nursery: trio.Nursery, transport: str, status: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = b'{"error": {"message": "Incorrect API key provided.", "code": "invalid_api_key"}}'
    with trio.fail_after(DEADLINE):
        url = await nursery.start(
            partial(serve_response, status, [("Content-Type", "application/json")], body)
        )
        model = {"upstreams": [url], "transport": transport}
        proxy = await start_proxy(nursery, {"m": model}, upstream={"max_attempts": 1})
        with caplog.at_level(logging.WARNING, logger="sluice.upstream"):
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                answers = [
                    await client.post(proxy.url + CHAT, json=chat_body("m", stream=stream))
                    for stream in (False, True, False)
                ]
                anthropic = await client.post(
                    proxy.url + "/v1/messages",
                    json={
                        "model": "m",
                        "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
    for response in answers:
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["code"] == "upstream_auth_error"
        assert error["type"] == "upstream_error"
        # The replica named by its place in the model's table, never by its address.
        assert "model 'm' upstreams[0]" in error["message"]
        assert url.split("//")[1] not in response.text
        assert "Incorrect API key" not in error["message"]
    # In the endpoint's own shape; by now the replica is ejected (three failures), and the
    # 503 says what it failed with.
    assert anthropic.status_code == 503
    assert anthropic.json()["type"] == "error"
    assert "upstream_auth_error" in anthropic.json()["error"]["message"]
    # The operator hears of it, once a minute per replica, not once a request.
    warned = [r for r in caplog.records if "refused Sluice's credentials" in r.getMessage()]
    assert len(warned) == 1 and url in warned[0].getMessage()


async def test_an_unknown_models_404_says_it_came_from_the_upstream(
    nursery: trio.Nursery, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    vllm = {
        "error": {
            "message": "The model `m` does not exist.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    with trio.fail_after(DEADLINE), caplog.at_level(logging.WARNING, logger="sluice.upstream"):
        response = await ask(
            nursery,
            "404 Not Found",
            [("Content-Type", "application/json")],
            json.dumps(vllm).encode(),
            stream=False,
            transport=transport,
        )
    assert response.status_code == 404
    error = response.json()["error"]
    # Its status and code kept; its message names who said it.
    assert (error["code"], error["type"]) == (404, "NotFoundError")
    assert error["message"].startswith("The upstream model 'm' upstreams[0] answered")
    assert "127.0.0.1" not in response.text
    assert error["message"].endswith("answered: The model `m` does not exist.")
    assert any("does not exist" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "body", [b"<html><body>Welcome to nginx!</body></html>", b'{"id": "x", "choi']
)
async def test_a_non_json_answer_is_upstream_malformed(
    nursery: trio.Nursery, transport: str, body: bytes
) -> None:
    with trio.fail_after(DEADLINE):
        response = await ask(
            nursery,
            "200 OK",
            [("Content-Type", "text/html")],
            body,
            stream=False,
            transport=transport,
        )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_malformed"
    assert "not JSON" in error["message"]
