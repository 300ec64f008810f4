"""Upstream answers a proxy must not mangle: redirects are not followed, and a body the server
encoded although asked for identity is decoded (gzip, deflate) or passed on with its
Content-Encoding (anything else, when not streamed)."""

from __future__ import annotations

import gzip
import json
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
    nursery: trio.Nursery, transport: str, status: str
) -> None:
    with trio.fail_after(DEADLINE):
        location = "https://elsewhere.example/v1/chat/completions"
        response = await ask(
            nursery, status, [("Location", location)], b"", stream=False, transport=transport
        )
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_redirect"
    assert status.split()[0] in error["message"] and location in error["message"]


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
