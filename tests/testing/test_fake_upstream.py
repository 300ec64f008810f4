"""The fake upstream, seen from a real client over 127.0.0.1.

Policy: port 0, real httpx (pooled, keep-alive) or raw trio sockets where the exact bytes
matter, a ``fail_after`` on every I/O test, millisecond ttft/interval so the file stays fast.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import socket
import ssl
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pydantic
import pytest
import trio
import trio.testing
import trustme
from openai.types import CreateEmbeddingResponse
from openai.types.audio import Transcription
from openai.types.responses import Response, ResponseStreamEvent

from proxy.testing.fake_upstream import (
    MALFORMED_EVENT,
    MAX_BODY_BYTES,
    MAX_MODEL_LEN,
    WORDS,
    FakeSettings,
    FakeUpstream,
    NoRecordsYet,
    PrefixCache,
    Recorder,
    RequestRecord,
    add_arguments,
    embedding_vector,
    relevance_score,
    run_from_args,
    settings_from_args,
    token_text,
)

FAST: dict[str, Any] = {"ttft": 0.01, "interval": 0.002, "tokens": 5}
# How soon the fake must notice that its client left.
DISCONNECT_BUDGET = 0.05
ROOT = Path(__file__).resolve().parents[2]


async def start(nursery: trio.Nursery, **settings: Any) -> tuple[FakeUpstream, int]:
    fake = FakeUpstream(FakeSettings(**{**FAST, **settings}))
    port: int = await nursery.start(fake.serve)
    return fake, port


def client(port: int, **kwargs: Any) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must not stand between test and fake.
    kwargs.setdefault("trust_env", False)
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", **kwargs)


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "one two three"}]} | (
        extra
    )


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "one two"} | extra


async def sse_events(response: httpx.Response) -> list[str]:
    """The payloads of ``data:`` lines, and any other non-empty line verbatim."""
    events = []
    async for line in response.aiter_lines():
        if line:
            events.append(line.removeprefix("data: "))
    return events


async def settled(recorder: Recorder) -> RequestRecord:
    """The newest record once its outcome is final.

    The fake stamps ``finished_at`` when its last ``send_all`` returns, and the client may be
    scheduled first and already hold every byte: so wait, do not assert at once.
    """
    await recorder.wait_for(lambda r: r.last().outcome != "pending")
    return recorder.last()


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send raw bytes, read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        received = bytearray()
        while data := await stream.receive_some():
            received += data
    return bytes(received)


def split_chunked(raw: bytes) -> tuple[bytes, list[bytes], bytes]:
    """(head, chunks, rest after the terminating chunk) of one chunked response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    chunks: list[bytes] = []
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body.startswith(b"\r\n")
            return head, chunks, body[2:]
        chunks.append(body[:size])
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def post(path: str, body: bytes, *, extra: bytes = b"") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )


# --------------------------------------------------------------------------- happy paths


async def test_streaming_chat_shape_and_order(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            body = chat(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                events = await sse_events(r)
        record = await settled(fake.recorder)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    role, tokens, finish, usage = chunks[0], chunks[1:6], chunks[6], chunks[7]
    assert len(chunks) == 8
    for chunk in chunks:
        assert chunk["id"] == "chatcmpl-0"
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "fake-model"
        assert isinstance(chunk["created"], int)
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    for i, chunk in enumerate(tokens):
        assert chunk["choices"] == [
            {
                "index": 0,
                "delta": {"content": WORDS[i] + " "},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    assert record.path == "/v1/chat/completions"
    assert record.body == body
    assert record.headers["content-type"] == "application/json"
    assert record.outcome == "completed"
    assert record.tokens_sent == 5
    assert record.disconnected_at is None
    assert record.first_token_at is not None
    assert record.finished_at is not None
    assert record.first_token_at - record.received_at >= FAST["ttft"]
    assert record.finished_at - record.received_at >= FAST["ttft"] + 4 * FAST["interval"]


async def test_max_tokens_caps_and_says_length(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            body = chat(stream=True, max_tokens=2)
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                events = await sse_events(r)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:3]] == [
        token_text(0),
        token_text(1),
    ]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == 4  # no usage chunk without include_usage
    assert fake.recorder.last().tokens_sent == 2


async def test_streaming_completions(nursery: trio.Nursery) -> None:
    _, port = await start(nursery, tokens=20)
    with trio.fail_after(10):
        async with client(port) as c:
            body = completion(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", "/v1/completions", json=body) as r:
                events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["id"] == "cmpl-0" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks[:20]]
    assert texts == [WORDS[i % len(WORDS)] + " " for i in range(20)]
    assert chunks[0]["choices"][0] == {
        "index": 0,
        "text": "The ",
        "logprobs": None,
        "finish_reason": None,
    }
    assert chunks[20]["choices"][0]["finish_reason"] == "stop"
    assert chunks[20]["choices"][0]["text"] == ""
    assert chunks[21]["usage"] == {"prompt_tokens": 2, "completion_tokens": 20, "total_tokens": 22}


async def test_a_continuation_goes_on_from_the_answer_so_far_as_vllm_s_does(
    nursery: trio.Nursery,
) -> None:
    _, port = await start(nursery, tokens=8)
    held = "".join(token_text(i) for i in range(3))
    with trio.fail_after(10):
        async with client(port) as c:
            messages = [{"role": "user", "content": "hello there"}]
            body = chat(
                stream=True,
                messages=[*messages, {"role": "assistant", "content": held}],
                continue_final_message=True,
                add_generation_prompt=False,
                stream_options={"include_usage": True},
            )
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                events = await sse_events(r)
            text = completion(stream=True, prompt="Say it: " + held)
            async with c.stream("POST", "/v1/completions", json=text) as r:
                text_events = await sse_events(r)
            # vLLM refuses both, and a continuation with no assistant message last.
            both = chat(messages=messages, continue_final_message=True)
            refused = await c.post("/v1/chat/completions", json=both)
            no_answer = chat(
                messages=messages, continue_final_message=True, add_generation_prompt=False
            )
            refused_too = await c.post("/v1/chat/completions", json=no_answer)
    chunks = [json.loads(e) for e in events[:-1]]
    # The role delta as always, then the answer from its fourth token on.
    contents = [chunk["choices"][0]["delta"].get("content") for chunk in chunks[1:6]]
    assert contents == [token_text(i) for i in range(3, 8)]
    # Its prompt held the answer so far: 2 + 3 words.
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    texts = [json.loads(e)["choices"][0]["text"] for e in text_events[:5]]
    assert texts == [token_text(i) for i in range(3, 8)]
    assert refused.status_code == 400 and "add_generation_prompt" in refused.text
    assert refused_too.status_code == 400


async def test_non_streaming(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            before = trio.current_time()
            r = await c.post("/v1/chat/completions", json=chat())
            elapsed = trio.current_time() - before
            assert elapsed >= FAST["ttft"] + 4 * FAST["interval"]
            assert r.status_code == 200
            answer = r.json()
            assert answer["object"] == "chat.completion"
            assert answer["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "The quick brown fox jumps "},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ]
            assert answer["usage"] == {
                "prompt_tokens": 3,
                "completion_tokens": 5,
                "total_tokens": 8,
            }
            record = fake.recorder.last()
            assert (record.outcome, record.tokens_sent) == ("completed", 5)

            r = await c.post("/v1/completions", json=completion(max_tokens=3))
            answer = r.json()
            assert answer["object"] == "text_completion"
            assert answer["choices"][0]["text"] == "The quick brown "
            assert answer["choices"][0]["finish_reason"] == "length"
            assert answer["usage"]["completion_tokens"] == 3


async def test_one_http_chunk_per_sse_event(nursery: trio.Nursery) -> None:
    _, port = await start(nursery, tokens=3)
    body = json.dumps(chat(stream=True, stream_options={"include_usage": True})).encode()
    with trio.fail_after(10):
        raw = await raw_exchange(
            port, post("/v1/chat/completions", body, extra=b"connection: close\r\n")
        )
    head, chunks, rest = split_chunked(raw)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in head
    assert b"connection: close" in head
    assert rest == b""
    # role, 3 tokens, finish, usage, [DONE]: each its own chunk, each one whole event.
    assert len(chunks) == 7
    for chunk in chunks:
        assert chunk.startswith(b"data: ")
        assert chunk.endswith(b"\n\n")
        assert chunk.count(b"\n\n") == 1
    assert chunks[-1] == b"data: [DONE]\n\n"


async def test_keep_alive_reuses_one_connection(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port, limits=httpx.Limits(max_connections=1)) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                await sse_events(r)
            r = await c.post("/v1/completions", json=completion())
            assert r.status_code == 200
            first, second = fake.recorder.records
            assert first.connection == second.connection
            assert fake.recorder.connections_accepted == 1
            assert fake.recorder.open_connections == 1
        # The pooled connection closed between requests: not a disconnect of any request.
        await fake.recorder.wait_for(lambda rec: rec.open_connections == 0)
    assert [r.outcome for r in fake.recorder.records] == ["completed", "completed"]


async def test_pipelined_requests_answered_in_order(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    one = post("/v1/completions", json.dumps(completion(max_tokens=1)).encode())
    two = post(
        "/v1/completions",
        json.dumps(completion(max_tokens=2)).encode(),
        extra=b"connection: close\r\n",
    )
    with trio.fail_after(10):
        raw = await raw_exchange(port, one + two)
    first, _, rest = raw.partition(b"\r\n\r\n")
    length = int(first.split(b"content-length: ")[1].split(b"\r\n")[0])
    assert json.loads(rest[:length])["usage"]["completion_tokens"] == 1
    second_head, _, second_body = rest[length:].partition(b"\r\n\r\n")
    assert b"connection: close" in second_head
    assert json.loads(second_body)["usage"]["completion_tokens"] == 2
    assert [r.outcome for r in fake.recorder.records] == ["completed", "completed"]
    assert fake.recorder.connections_accepted == 1


async def test_models_health_and_unknown_path(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, models=["a", "b"])
    with trio.fail_after(10):
        async with client(port) as c:
            r = await c.get("/health")
            assert (r.status_code, r.content) == (200, b"")
            r = await c.get("/v1/models")
            assert [m["id"] for m in r.json()["data"]] == ["a", "b"]
            assert r.json()["object"] == "list"
            r = await c.get("/v2/nothing")
            assert r.status_code == 404
            assert r.json()["error"]["type"] == "NotFoundError"
            assert r.json()["error"]["code"] == 404
            r = await c.get("/v1/chat/completions")
            assert r.status_code == 405
    assert [r.path for r in fake.recorder.records] == [
        "/health",
        "/v1/models",
        "/v2/nothing",
        "/v1/chat/completions",
    ]


async def test_per_request_override_and_bad_requests(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            r = await c.post("/v1/completions", json=completion(fake={"tokens": 2, "ttft": 0}))
            assert r.json()["usage"]["completion_tokens"] == 2
            r = await c.post("/v1/chat/completions", content=b"{not json")
            assert r.status_code == 400
            assert r.json() == {
                "error": {
                    "message": "request body must be a JSON object",
                    "type": "BadRequestError",
                    "code": 400,
                }
            }
            assert fake.recorder.last().body is None
            r = await c.post("/v1/chat/completions", json=chat(fake={"mode": "explode"}))
            assert r.status_code == 400
            assert "mode" in r.json()["error"]["message"]
            r = await c.post("/v1/chat/completions", json=chat(fake={"bogus": 1}))
            assert r.status_code == 400
            r = await c.post("/v1/chat/completions", json=chat(max_tokens=-1))
            assert r.status_code == 400
            r = await c.post("/v1/completions", json={"model": "m"})
            assert r.status_code == 400
            # The connection survives a 400.
            assert fake.recorder.connections_accepted == 1


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n", 411),
        (b"POST /v1/completions HTTP/1.1\r\ncontent-length: 999999999\r\n\r\n", 413),
        (b"GET /health HTTP/1.1\r\nx: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/1.1\r\nbad header\r\n\r\n", 400),
        (b"NONSENSE\r\n\r\n", 400),
        (b"GET /health HTTP/2.0\r\n\r\n", 505),
        (b"GET ftp://upstream.internal/health HTTP/1.1\r\n\r\n", 400),
        (b"GET http:///health HTTP/1.1\r\n\r\n", 400),
        # Not started as a proxy: a client that tunnels must learn so at once.
        (b"CONNECT upstream.internal:443 HTTP/1.1\r\nhost: upstream.internal:443\r\n\r\n", 405),
    ],
)
async def test_framing_errors_answered_and_closed(
    nursery: trio.Nursery, request_bytes: bytes, status: int
) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        raw = await raw_exchange(port, request_bytes)
    assert raw.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"connection: close" in raw
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == status
    assert fake.recorder.records == []


async def test_http_1_0_stream_is_close_delimited(nursery: trio.Nursery) -> None:
    _, port = await start(nursery, tokens=2)
    body = json.dumps(completion(stream=True)).encode()
    request = f"POST /v1/completions HTTP/1.0\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    with trio.fail_after(10):
        raw = await raw_exchange(port, request + body)
    head, _, events = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head
    assert events.count(b"data: ") == 4
    assert events.endswith(b"data: [DONE]\n\n")


# --------------------------------------------------------------------------- failure modes


async def test_mode_refuse(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, mode="refuse")
    with trio.fail_after(10):
        async with client(port) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post("/v1/chat/completions", json=chat(stream=True))
            # The fake's own endpoints and health never take part in fault injection.
            assert (await c.get("/health")).status_code == 200
    assert fake.recorder.last("/v1/chat/completions").outcome == "failed_injected"


async def test_mode_status(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            for stream in (True, False):
                body = chat(stream=stream, fake={"mode": "status", "status": 503})
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 503
                assert r.json() == {
                    "error": {
                        "message": "fake upstream error",
                        "type": "ServiceUnavailableError",
                        "code": 503,
                    }
                }
                record = await settled(fake.recorder)
                assert record.outcome == "failed_injected"
                assert record.finished_at is not None
                assert record.finished_at - record.received_at >= FAST["ttft"]
            # Default status is 500, and the connection is kept.
            r = await c.post("/v1/completions", json=completion(fake={"mode": "status"}))
            assert r.status_code == 500
            assert r.json()["error"]["type"] == "InternalServerError"
            assert fake.recorder.connections_accepted == 1


async def test_fail_attempts_fails_only_a_request_ids_first_attempts(nursery: trio.Nursery) -> None:
    """A retry of the same request (its X-Request-ID) is answered once its first N failed."""
    _, port = await start(nursery)
    body = chat(stream=False, fake={"mode": "status", "status": 503, "fail_attempts": 2})
    with trio.fail_after(10):
        async with client(port) as c:
            statuses = [
                (
                    await c.post("/v1/chat/completions", json=body, headers={"X-Request-ID": rid})
                ).status_code
                for rid in ("a", "a", "b", "a", "a")
            ]
            bad = chat(fake={"mode": "status", "fail_attempts": -1})
            refused = await c.post("/v1/chat/completions", json=bad)
    assert statuses == [503, 503, 503, 200, 200]
    assert refused.status_code == 400 and "fail_attempts" in refused.text


async def _stream_until_error(port: int, body: dict[str, Any], error: type[Exception]) -> list[str]:
    events: list[str] = []
    async with client(port, timeout=5.0) as c:
        with pytest.raises(error):
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line:
                        events.append(line.removeprefix("data: "))
    return events


def _contents(events: list[str]) -> list[str]:
    return [json.loads(e)["choices"][0]["delta"].get("content") for e in events]


async def test_mode_reset(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        body = chat(stream=True, fake={"mode": "reset", "at": 2})
        events = await _stream_until_error(port, body, httpx.ReadError)
    assert _contents(events) == ["", token_text(0), token_text(1)]
    record = fake.recorder.last()
    assert (record.outcome, record.tokens_sent, record.disconnected_at) == (
        "failed_injected",
        2,
        None,
    )


async def test_mode_eof(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        body = chat(stream=True, fake={"mode": "eof", "at": 3})
        events = await _stream_until_error(port, body, httpx.RemoteProtocolError)
    assert _contents(events) == ["", token_text(0), token_text(1), token_text(2)]
    assert fake.recorder.last().outcome == "failed_injected"


async def test_mode_stall_after_last_token(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        body = chat(stream=True, fake={"mode": "stall", "at": 99})
        events: list[str] = []
        # No short read timeout while the tokens come (a loaded machine may pause between
        # two): all of them are read first, then the silence is listened for.
        async with (
            client(port, timeout=5) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            lines = r.aiter_lines()
            while len(events) < 6:
                if line := await anext(lines):
                    events.append(line.removeprefix("data: "))
            # All tokens, then silence where the finish chunk belongs.
            assert _contents(events) == [""] + [token_text(i) for i in range(5)]
            with trio.move_on_after(0.2) as silence:
                async for line in lines:
                    assert not line, line
            assert silence.cancelled_caught, "the stream ended"
        await fake.recorder.wait_for(lambda r: r.last().outcome == "client_disconnected")


async def test_mode_stall_headers(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, mode="stall_headers")
    with trio.fail_after(10):
        async with client(port, timeout=0.1) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat(stream=True))
        await fake.recorder.wait_for(lambda r: r.last().outcome == "client_disconnected")


async def test_mode_malformed(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            body = chat(stream=True, fake={"mode": "malformed", "at": 1})
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                events = await sse_events(r)
            # role, token 0, then the garbage where token 1 belongs, then token 1 and on.
            assert events[2] == MALFORMED_EVENT.decode().strip()
            del events[2]
            assert _contents(events[:-1]) == [""] + [token_text(i) for i in range(5)] + [None]
            assert events[-1] == "[DONE]"
            assert (await settled(fake.recorder)).outcome == "failed_injected"

            r = await c.post("/v1/chat/completions", json=chat(fake={"mode": "malformed"}))
            with pytest.raises(json.JSONDecodeError):
                r.json()


async def test_non_streaming_faults(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post("/v1/completions", json=completion(fake={"mode": "eof"}))
            with pytest.raises(httpx.ReadError):
                await c.post("/v1/completions", json=completion(fake={"mode": "reset"}))
    assert [r.outcome for r in fake.recorder.records] == ["failed_injected"] * 2


# --------------------------------------------------------------------------- disconnects


async def _leave_during_ttft(c: httpx.AsyncClient, recorder: Recorder) -> float:
    body = chat(stream=True, fake={"ttft": 5})
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200  # vLLM sends its headers before the first token
        left = trio.current_time()
    return left


async def _leave_mid_stream(c: httpx.AsyncClient, recorder: Recorder) -> float:
    body = chat(stream=True, fake={"interval": 0.02, "tokens": 1000})
    async with c.stream("POST", "/v1/chat/completions", json=body):
        # Not reading: breaking out of httpx's nested line iterators leaves inner async
        # generators to the garbage collector, which trio reports as a ResourceWarning.
        await recorder.wait_for(lambda r: r.last().tokens_sent >= 3)
        left = trio.current_time()
    return left


async def _leave_while_stalled(c: httpx.AsyncClient, recorder: Recorder) -> float:
    body = chat(stream=True, fake={"mode": "stall", "at": 0})
    async with c.stream("POST", "/v1/chat/completions", json=body):
        await trio.sleep(0.05)
        left = trio.current_time()
    return left


async def _leave_before_headers(c: httpx.AsyncClient, recorder: Recorder) -> float:
    body = chat(stream=True, fake={"mode": "stall_headers"})
    with trio.move_on_after(0.05) as scope:
        await c.post("/v1/chat/completions", json=body)
    assert scope.cancelled_caught
    return scope.deadline


async def _leave_non_streaming(c: httpx.AsyncClient, recorder: Recorder) -> float:
    with trio.move_on_after(0.05) as scope:
        await c.post("/v1/chat/completions", json=chat(fake={"ttft": 5}))
    assert scope.cancelled_caught
    return scope.deadline


@pytest.mark.parametrize(
    "leave",
    [
        _leave_during_ttft,
        _leave_mid_stream,
        _leave_while_stalled,
        _leave_before_headers,
        _leave_non_streaming,
    ],
    ids=["ttft", "mid-stream", "stall", "stall_headers", "non-stream"],
)
@pytest.mark.usefixtures("quiet_collector")
async def test_disconnect_noticed_in_every_phase(nursery: trio.Nursery, leave: Any) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            left = await leave(c, fake.recorder)
        with trio.fail_after(1):
            await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        record = fake.recorder.last()
        assert record.outcome == "client_disconnected"
        assert record.finished_at is None
        assert record.disconnected_at is not None
        assert record.disconnected_at - left < DISCONNECT_BUDGET
        assert record.disconnected_at_mono is not None
        # The response work was cancelled: nothing more goes out.
        sent = record.tokens_sent
        await trio.sleep(0.05)
        assert record.tokens_sent == sent
        await fake.recorder.wait_for(lambda r: r.open_connections == 0)


async def test_backpressure_reaches_the_fake(nursery: trio.Nursery) -> None:
    from tests.support import wait_until_steady

    fake, port = await start(nursery, sndbuf=4096, ttft=0, interval=0, tokens=5000)
    body = json.dumps(completion(stream=True)).encode()
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    with trio.fail_after(10):
        async with stream:
            await stream.send_all(post("/v1/completions", body, extra=b"connection: close\r\n"))
            # The fake has started, then stopped: the buffers are full, nobody reads them.
            await fake.recorder.wait_for(lambda r: r.last().tokens_sent > 0)
            stuck = (await wait_until_steady(lambda: fake.recorder.last().tokens_sent))[-1]
            assert 0 < stuck < 1000
            assert fake.recorder.last().outcome == "pending"
            while await stream.receive_some():
                pass
    assert fake.recorder.last().outcome == "completed"
    assert fake.recorder.last().tokens_sent == 5000


# --------------------------------------------------------------------------- recording


async def test_fake_requests_endpoint(nursery: trio.Nursery) -> None:
    _, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            await c.post("/v1/completions", json=completion(max_tokens=2))
            await c.post("/v1/chat/completions", json=chat(max_tokens=1))
            records = (await c.get("/_fake/requests")).json()
            assert [r["id"] for r in records] == [0, 1]
            assert [r["path"] for r in records] == ["/v1/completions", "/v1/chat/completions"]
            assert records[0]["body"]["max_tokens"] == 2
            assert records[0]["tokens_sent"] == 2
            assert records[0]["outcome"] == "completed"
            for r in records:
                assert r["received_at_mono"] <= r["first_token_at_mono"] <= r["finished_at_mono"]
                assert r["disconnected_at_mono"] is None
            newer = (await c.get("/_fake/requests?since=1")).json()
            assert [r["id"] for r in newer] == [1]
            # Control endpoints are not recorded.
            assert len((await c.get("/_fake/requests")).json()) == 2


async def test_wait_for_wakes_on_changes(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, tokens=3)
    recorder = fake.recorder
    seen: list[int] = []

    async def watch_tokens() -> None:
        # last() before any request raises NoRecordsYet, which wait_for reads as "not yet".
        for n in (1, 2, 3):

            def reached(r: Recorder, n: int = n) -> bool:
                return r.last().tokens_sent >= n

            await recorder.wait_for(reached)
            seen.append(recorder.last().tokens_sent)

    with pytest.raises(NoRecordsYet):
        recorder.last()
    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            inner.start_soon(watch_tokens)
            async with client(port) as c:
                body = completion(stream=True, fake={"interval": 0.02})
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    await sse_events(r)
    assert seen == [1, 2, 3]
    with trio.fail_after(1):
        await recorder.wait_for(lambda r: r.last().outcome == "completed")


async def test_recorder_keeps_a_bounded_history(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, max_records=4)
    with pytest.raises(NoRecordsYet):
        fake.recorder.last("/health")
    with trio.fail_after(10):
        async with client(port) as c:
            for _ in range(6):
                await c.get("/health")
    ids = [r.id for r in fake.recorder.records]
    assert len(ids) <= 4
    assert ids == sorted(ids)
    assert ids[-1] == 5
    assert fake.recorder.last("/health").id == 5


def test_settings_validate() -> None:
    with pytest.raises(ValueError, match="mode"):
        FakeSettings(mode="nope")
    with pytest.raises(ValueError, match="ttft"):
        FakeSettings(ttft=-1)
    with pytest.raises(ValueError, match="models"):
        FakeSettings(models=[])
    with pytest.raises(ValueError, match="keepalive_timeout"):
        FakeSettings(keepalive_timeout=-1)
    with pytest.raises(ValueError, match="late_close"):
        FakeSettings(late_close=float("inf"))
    with pytest.raises(ValueError, match="at most one"):
        FakeSettings(close_after_response=True, keepalive_timeout=0)
    with pytest.raises(ValueError, match="at most one"):
        FakeSettings(keepalive_timeout=5, late_close=1)
    with pytest.raises(ValueError, match="close_after_response"):
        FakeSettings(close_after_response=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="go together"):
        FakeSettings(tls_cert="server.pem")
    with pytest.raises(ValueError, match="tls_client_ca"):
        FakeSettings(tls_client_ca="ca.pem")
    with pytest.raises(ValueError, match="via_proxy"):
        FakeSettings(via_proxy="yes")  # type: ignore[arg-type]


async def test_command_line(nursery: trio.Nursery, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = "--port 0 --model a --model b --tokens 3 --mode eof --at 1 --ttft 0"
    args = parser.parse_args([*argv.split(), "--interval", "0.001", "--sndbuf", "65536"])
    settings = settings_from_args(args)
    assert settings == FakeSettings(
        ttft=0, interval=0.001, tokens=3, models=["a", "b"], mode="eof", at=1, sndbuf=65536
    )
    assert settings_from_args(parser.parse_args([])).models == ["fake-model"]

    nursery.start_soon(run_from_args, args)
    with trio.fail_after(10):
        # run_from_args announces itself on stdout only; poll for the line as a script would.
        while not (out := capsys.readouterr().out):  # noqa: ASYNC110
            await trio.sleep(0.01)
        prefix = "fake upstream listening on http://127.0.0.1:"
        assert out.startswith(prefix)
        assert out.endswith("\n")
        port = int(out.removeprefix(prefix))
        async with client(port) as c:
            r = await c.get("/v1/models")
            assert [m["id"] for m in r.json()["data"]] == ["a", "b"]


async def test_client_reset_mid_stream(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, tokens=1000, interval=0.005)
    body = json.dumps(completion(stream=True)).encode()
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(post("/v1/completions", body))
        await fake.recorder.wait_for(lambda r: r.last().tokens_sent >= 3)
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        left = trio.current_time()
        await stream.aclose()
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
    record = fake.recorder.last()
    assert record.outcome == "client_disconnected"
    assert record.disconnected_at is not None
    assert record.disconnected_at - left < DISCONNECT_BUDGET


async def test_many_streams_share_the_clock(nursery: trio.Nursery) -> None:
    """Streams leaving early must not disturb the others the ticker is writing."""
    fake, port = await start(nursery, tokens=30, interval=0.003)
    results: dict[int, list[str]] = {}

    async def run(i: int, c: httpx.AsyncClient) -> None:
        # The leavers' streams outlast the test (100,000 tokens, 300 s): however long a loaded
        # machine stretches their 20 ms wait, they leave before their stream could end.
        body = (
            completion(stream=True, max_tokens=30)
            if i % 2
            else completion(stream=True, fake={"tokens": 100_000})
        )
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if i % 2:
                events = await sse_events(r)
                results[i] = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
            else:
                await trio.sleep(0.02)

    with trio.fail_after(10):
        limits = httpx.Limits(max_connections=40)
        async with client(port, limits=limits) as c, trio.open_nursery() as inner:
            for i in range(40):
                inner.start_soon(run, i, c)
        await fake.recorder.wait_for(lambda r: r.open_connections == 0)
    expected = [token_text(i) for i in range(30)] + [""]
    assert len(results) == 20
    assert all(texts == expected for texts in results.values())
    outcomes = sorted(r.outcome for r in fake.recorder.records)
    assert outcomes == ["client_disconnected"] * 20 + ["completed"] * 20


def test_command_line_habits_tls_and_proxy() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--keepalive-timeout", "5", "--tls-cert", "s.pem", "--tls-key", "k.pem"]
    args = parser.parse_args([*argv, "--tls-client-ca", "ca.pem", "--via-proxy"])
    assert settings_from_args(args) == FakeSettings(
        keepalive_timeout=5,
        tls_cert="s.pem",
        tls_key="k.pem",
        tls_client_ca="ca.pem",
        via_proxy=True,
    )
    assert settings_from_args(parser.parse_args(["--close-after-response"])).close_after_response
    assert settings_from_args(parser.parse_args(["--late-close", "0.5"])).late_close == 0.5
    defaults = settings_from_args(parser.parse_args([]))
    assert (defaults.keepalive_timeout, defaults.tls_cert, defaults.via_proxy) == (None, "", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--close-after-response", "--late-close", "1"])


@pytest.mark.parametrize(
    "entry",
    [["-m", "proxy.testing.fake_upstream"], ["-m", "proxy.cli", "fake-upstream"]],
    ids=["python -m", "sluice fake-upstream"],
)
async def test_the_fake_runs_as_a_program(entry: list[str]) -> None:
    """The balance bench starts its replicas with ``python -m``, the load bench through the CLI."""
    command = [sys.executable, *entry, "--port", "0", "--model", "m"]
    with trio.fail_after(30):
        process = await trio.lowlevel.open_process(command, cwd=ROOT, stdout=subprocess.PIPE)
        assert process.stdout is not None
        try:
            line = b""
            while not line.endswith(b"\n"):
                data = await process.stdout.receive_some()
                assert data, "the fake exited before announcing itself"
                line += data
            prefix = b"fake upstream listening on http://127.0.0.1:"
            assert line.startswith(prefix)
            async with client(int(line.removeprefix(prefix))) as c:
                r = await c.get("/v1/models")
            assert [m["id"] for m in r.json()["data"]] == ["m"]
        finally:
            process.terminate()
            await process.wait()
            await process.stdout.aclose()


# --------------------------------------------------------------------------- connection habits


@pytest.fixture
def virtual_clock(mock_clock: trio.testing.MockClock) -> trio.testing.MockClock:
    """Virtual time that jumps once the loop idled 10 ms of real time: long enough for the
    loopback bytes in flight to land first."""
    mock_clock.autojump_threshold = 0.01
    return mock_clock


async def read_response(stream: trio.abc.ReceiveStream, buf: bytearray) -> bytes:
    """One whole response (Content-Length or chunked) off a kept-alive connection."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some()
        assert data, f"EOF after {bytes(buf)!r}"
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    if b"transfer-encoding: chunked" in head:
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            buf += await stream.receive_some()
        total = len(buf)
    else:
        total = end + int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(buf) < total:
            buf += await stream.receive_some()
    response = bytes(buf[:total])
    del buf[:total]
    return response


async def answer_on_reuse(stream: trio.abc.Stream, request: bytes) -> bytes:
    """What a client gets that writes ``request`` onto a connection the server has given up:
    every byte until EOF or a reset."""
    received = bytearray()
    with contextlib.suppress(trio.BrokenResourceError):
        await stream.send_all(request)
        while data := await stream.receive_some():
            received += data
    return bytes(received)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
async def test_close_after_response_closes_unannounced(
    nursery: trio.Nursery, streamed: bool
) -> None:
    fake, port = await start(nursery, close_after_response=True)
    request = post("/v1/completions", json.dumps(completion(stream=streamed)).encode())
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            buf = bytearray()
            head = (await read_response(stream, buf)).partition(b"\r\n\r\n")[0]
            # The answer promised nothing: a client has no reason not to reuse the connection.
            assert b"connection: keep-alive" in head
            assert b"connection: close" not in head
            assert await answer_on_reuse(stream, request) == b""
        await fake.recorder.wait_for(lambda r: r.open_connections == 0)
    assert [r.outcome for r in fake.recorder.records] == ["completed"]


async def test_keepalive_timeout_closes_idle_connections(
    nursery: trio.Nursery, virtual_clock: trio.testing.MockClock
) -> None:
    fake, port = await start(nursery, keepalive_timeout=5)
    request = post("/v1/completions", json.dumps(completion()).encode())
    with trio.fail_after(60):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            buf = bytearray()
            await stream.send_all(request)
            await read_response(stream, buf)
            # A request inside the timeout is served, and the timeout starts over after it.
            await trio.sleep(4)
            await stream.send_all(request)
            await read_response(stream, buf)
            answered = trio.current_time()
            assert await stream.receive_some() == b""
            idle = trio.current_time() - answered
        assert 5 <= idle < 5.1
        assert fake.recorder.connections_accepted == 1

        # A pool that notices the FIN before reusing the connection just opens another.
        async with client(port) as c:
            assert (await c.get("/health")).status_code == 200
            await trio.sleep(6)
            assert (await c.get("/health")).status_code == 200
    assert fake.recorder.connections_accepted == 3
    assert [r.outcome for r in fake.recorder.records] == ["completed"] * 4


async def test_late_close_leaves_a_request_unanswered(
    nursery: trio.Nursery, virtual_clock: trio.testing.MockClock
) -> None:
    fake, port = await start(nursery, late_close=1)
    request = post("/v1/completions", json.dumps(completion()).encode())
    with trio.fail_after(60):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            head = (await read_response(stream, bytearray())).partition(b"\r\n\r\n")[0]
            assert b"connection: keep-alive" in head
            answered = trio.current_time()
            # The connection still looks alive when the client writes its next request.
            await trio.sleep(0.5)
            assert await answer_on_reuse(stream, request) == b""
            closed = trio.current_time() - answered
    assert 1 <= closed < 1.1
    assert len(fake.recorder.records) == 1


# --------------------------------------------------------------------------- TLS


@dataclass
class PKI:
    """A throwaway CA, the fake's certificate (127.0.0.1, localhost, upstream.internal) and a
    client certificate, all signed by that CA."""

    ca: trustme.CA
    ca_file: str
    server_pem: str  # key and chain in one file: both tls_cert and tls_key
    client: trustme.LeafCert

    def settings(self, **extra: Any) -> dict[str, Any]:
        return {"tls_cert": self.server_pem, "tls_key": self.server_pem, **extra}

    def client_context(self, cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        if cert is not None:
            cert.configure_cert(context)
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    directory: Path = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost", "upstream.internal")
    server.private_key_and_cert_chain_pem.write_to_path(directory / "server.pem")
    ca.cert_pem.write_to_path(directory / "ca.pem")
    client_cert = ca.issue_cert("client.example", common_name="sluice-test-client")
    return PKI(ca, str(directory / "ca.pem"), str(directory / "server.pem"), client_cert)


def tls_client(port: int, context: ssl.SSLContext, **kwargs: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"https://127.0.0.1:{port}", verify=context, **kwargs)


async def test_tls_streamed_and_whole_answers(nursery: trio.Nursery, pki: PKI) -> None:
    fake, port = await start(nursery, **pki.settings())
    with trio.fail_after(10):
        async with tls_client(port, pki.client_context()) as c:
            body = chat(stream=True, stream_options={"include_usage": True})
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.extensions["http_version"] == b"HTTP/1.1"
                events = await sse_events(r)
            streamed = await settled(fake.recorder)
            r = await c.post("/v1/completions", json=completion())
            assert r.json()["choices"][0]["text"] == "The quick brown fox jumps "
            whole = await settled(fake.recorder)
    assert events[-1] == "[DONE]"
    assert _contents(events[:-2]) == [""] + [token_text(i) for i in range(5)] + [None]
    assert (streamed.outcome, streamed.tokens_sent) == ("completed", 5)
    assert (whole.outcome, whole.tokens_sent) == ("completed", 5)
    assert streamed.tls and whole.tls
    assert streamed.client_cert_cn is None
    assert whole.connection == streamed.connection
    assert fake.recorder.tls_handshake_failures == 0


async def test_tls_disconnect_noticed_mid_stream(nursery: trio.Nursery, pki: PKI) -> None:
    """The watcher reads through the TLS stream, and tokens go out through its task."""
    fake, port = await start(nursery, **pki.settings())
    with trio.fail_after(10):
        async with tls_client(port, pki.client_context()) as c:
            left = await _leave_mid_stream(c, fake.recorder)
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
        record = fake.recorder.last()
        assert record.outcome == "client_disconnected"
        assert record.disconnected_at is not None
        assert record.disconnected_at - left < DISCONNECT_BUDGET
        await fake.recorder.wait_for(lambda r: r.open_connections == 0)


async def test_mtls_records_the_client_certificate(nursery: trio.Nursery, pki: PKI) -> None:
    fake, port = await start(nursery, **pki.settings(tls_client_ca=pki.ca_file))
    stranger = trustme.CA().issue_cert("stranger.example", common_name="stranger")
    with trio.fail_after(10):
        async with tls_client(port, pki.client_context(pki.client)) as c:
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200
        record = await settled(fake.recorder)
        assert (record.tls, record.client_cert_cn) == (True, "sluice-test-client")

        for cert in (None, stranger):
            async with tls_client(port, pki.client_context(cert)) as c:
                # Under TLS 1.3 the client's side of the handshake is done before the server
                # judges its certificate, and trio closes without the alert: so the client
                # sees the refusal as EOF or a reset where its answer should be.
                refused = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)
                with pytest.raises(refused):
                    await c.get("/health")
        await fake.recorder.wait_for(lambda r: r.tls_handshake_failures == 2)
    assert len(fake.recorder.records) == 1


async def test_unreadable_certificate_fails_at_start(nursery: trio.Nursery, tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.pem")
    fake = FakeUpstream(FakeSettings(tls_cert=missing, tls_key=missing))
    with pytest.raises(FileNotFoundError):
        await nursery.start(fake.serve)


# --------------------------------------------------------------------------- as its own proxy


async def test_via_proxy_absolute_form_and_direct_refusal(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, via_proxy=True)
    proxy = f"http://127.0.0.1:{port}"
    with trio.fail_after(10):
        # The origin's name need not resolve: the proxy is the origin.
        async with httpx.AsyncClient(base_url="http://upstream.internal:8000", proxy=proxy) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                assert r.status_code == 200
                events = await sse_events(r)
            proxied = await settled(fake.recorder)
            r = await c.get("/v1/models?x=1")
            assert r.status_code == 200
        assert events[-1] == "[DONE]"
        assert (proxied.path, proxied.via_proxy, proxied.tunnel) == (
            "/v1/chat/completions",
            True,
            None,
        )
        assert proxied.headers["host"] == "upstream.internal:8000"
        assert fake.recorder.last().path == "/v1/models"

        async with client(port) as c:
            r = await c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 403
            error = r.json()["error"]
            assert error["type"] == "PermissionDeniedError"
            assert "only through a proxy" in error["message"]
            # The fake's own endpoints stay reachable directly (the bench polls them).
            assert (await c.get("/_fake/requests")).status_code == 200
    direct = fake.recorder.last()
    assert (direct.via_proxy, direct.outcome, direct.tokens_sent) == (False, "completed", 0)
    assert fake.recorder.proxy_tunnels == []


async def test_via_proxy_connect_tunnel_with_tls(nursery: trio.Nursery, pki: PKI) -> None:
    fake, port = await start(nursery, **pki.settings(via_proxy=True))
    with trio.fail_after(10):
        async with httpx.AsyncClient(
            base_url="https://upstream.internal",
            proxy=f"http://127.0.0.1:{port}",
            verify=pki.client_context(),
        ) as c:
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                events = await sse_events(r)
            r = await c.post("/v1/completions", json=completion())
            assert r.status_code == 200
        await fake.recorder.wait_for(lambda r: r.last().outcome != "pending")
    assert events[-1] == "[DONE]"
    assert fake.recorder.proxy_tunnels == ["upstream.internal:443"]
    assert fake.recorder.connections_accepted == 1
    for record in fake.recorder.records:
        assert (record.tls, record.via_proxy, record.tunnel) == (
            True,
            True,
            "upstream.internal:443",
        )
        assert record.outcome == "completed"


async def test_via_proxy_plain_tunnel(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, via_proxy=True)
    connect = b"CONNECT upstream.internal:80 HTTP/1.1\r\nhost: upstream.internal:80\r\n\r\n"
    request = post("/v1/completions", json.dumps(completion()).encode())
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(connect)
            buf = bytearray()
            while b"\r\n\r\n" not in buf:
                buf += await stream.receive_some()
            assert bytes(buf) == b"HTTP/1.1 200 Connection established\r\n\r\n"
            buf.clear()
            # Inside the tunnel a request is origin-form, as to any server; a second
            # CONNECT is no request for the origin.
            await stream.send_all(request)
            answer = await read_response(stream, buf)
            assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
            assert (await answer_on_reuse(stream, connect)).startswith(b"HTTP/1.1 405 ")
    record = await settled(fake.recorder)
    assert (record.tls, record.via_proxy, record.tunnel) == (False, True, "upstream.internal:80")
    assert fake.recorder.proxy_tunnels == ["upstream.internal:80"]


# --------------------------------------------------------------------------- more endpoints

RESPONSE_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
FIVE = "".join(token_text(i) for i in range(5))


def responses_body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "input": "one two three"} | extra


def messages_body(**extra: Any) -> dict[str, Any]:
    body = {"model": "claude-fake", "max_tokens": 100}
    return body | {"messages": [{"role": "user", "content": "one two"}]} | extra


async def typed_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event; any other line as (None, line)."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            events.append((name, line.removeprefix("data: ")))
            name = None
        elif line:
            events.append((None, line))
    return events


def openai_client(port: int) -> openai.AsyncOpenAI:
    """The official SDK, under trio (through anyio). It takes an httpx client too, but is typed
    for its own fork, httpx2."""
    http = httpx2.AsyncClient(trust_env=False)
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, http_client=http
    )


def anthropic_event_adapter() -> pydantic.TypeAdapter[Any]:
    types = pytest.importorskip("anthropic.types")
    return pydantic.TypeAdapter(types.RawMessageStreamEvent)


RESPONSES_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 5,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_responses_stream_parses_as_the_sdks_events(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            body = responses_body(stream=True, instructions="be brief")
            async with c.stream("POST", "/v1/responses", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                events = await typed_events(r)
        record = await settled(fake.recorder)
    assert [name for name, _ in events] == RESPONSES_EVENTS
    parsed = [RESPONSE_EVENT.validate_json(data) for _, data in events]
    assert [e.type for e in parsed] == RESPONSES_EVENTS  # the event line names the data's type
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.delta for e in parsed if e.type == "response.output_text.delta"] == [
        token_text(i) for i in range(5)
    ]
    created, final = parsed[0].response, parsed[-1].response
    assert (created.status, created.output, created.usage) == ("in_progress", [], None)
    assert final.status == "completed" and final.incomplete_details is None
    assert final.output_text == FIVE
    assert final.instructions == "be brief"
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (5, 5)
    assert final.usage.total_tokens == 10
    assert parsed[-4].text == FIVE  # response.output_text.done
    assert "[DONE]" not in [data for _, data in events]
    assert (record.path, record.model, record.outcome) == (
        "/v1/responses",
        "fake-model",
        "completed",
    )
    assert record.tokens_sent == 5
    assert record.first_token_at is not None
    assert record.first_token_at - record.received_at >= FAST["ttft"]


async def test_responses_whole_and_max_output_tokens(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            items = [{"role": "user", "content": [{"type": "input_text", "text": "a b"}]}]
            r = await c.post("/v1/responses", json=responses_body(input=items, model="m2"))
            whole = Response.model_validate(r.json())
            assert (whole.status, whole.output_text, whole.model) == ("completed", FIVE, "m2")
            assert whole.usage is not None and whole.usage.input_tokens == 2
            assert fake.recorder.last().model == "m2"

            r = await c.post("/v1/responses", json=responses_body(max_output_tokens=2))
            capped = Response.model_validate(r.json())
            assert (capped.status, capped.output_text) == ("incomplete", "The quick ")
            assert capped.incomplete_details is not None
            assert capped.incomplete_details.reason == "max_output_tokens"
            assert capped.max_output_tokens == 2

            body = responses_body(stream=True, max_output_tokens=2)
            async with c.stream("POST", "/v1/responses", json=body) as r:
                events = await typed_events(r)
            parsed = [RESPONSE_EVENT.validate_json(data) for _, data in events]
            assert [e.type for e in parsed].count("response.output_text.delta") == 2
            last = parsed[-1]
            assert last.type == "response.incomplete"
            assert last.response.incomplete_details.reason == "max_output_tokens"
            assert last.response.usage.output_tokens == 2
            assert parsed[-2].item.status == "incomplete"
            assert fake.recorder.last().tokens_sent == 2

            r = await c.post("/v1/responses", json={"model": "m"})
            assert r.status_code == 400
            assert r.json()["error"]["type"] == "BadRequestError"


async def test_responses_through_the_openai_sdk(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with openai_client(port) as sdk:
            async with sdk.responses.stream(model="fake-model", input="hi") as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert "".join(deltas) == final.output_text == FIVE
            whole = await sdk.responses.create(model="fake-model", input="hi", max_output_tokens=3)
            assert (whole.status, whole.output_text) == ("incomplete", "The quick brown ")
    assert [r.path for r in fake.recorder.records] == ["/v1/responses"] * 2


MESSAGES_EVENTS = [
    "message_start",
    "content_block_start",
    "ping",
    *["content_block_delta"] * 5,
    "content_block_stop",
    "message_delta",
    "message_stop",
]


async def test_messages_stream_parses_as_the_sdks_events(nursery: trio.Nursery) -> None:
    adapter = anthropic_event_adapter()
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            body = messages_body(stream=True, system="terse")
            async with c.stream("POST", "/v1/messages", json=body) as r:
                assert r.status_code == 200
                events = await typed_events(r)
        record = await settled(fake.recorder)
    assert [name for name, _ in events] == MESSAGES_EVENTS
    assert json.loads(events[2][1]) == {"type": "ping"}  # not in the SDK's union: it skips them
    parsed = [adapter.validate_json(data) for name, data in events if name != "ping"]
    assert [e.type for e in parsed] == [n for n in MESSAGES_EVENTS if n != "ping"]
    start_event, block, *deltas, block_stop, delta, _ = parsed
    assert start_event.message.role == "assistant" and start_event.message.content == []
    assert start_event.message.model == "claude-fake"
    assert start_event.message.usage.input_tokens == 3
    assert (block.index, block.content_block.type, block.content_block.text) == (0, "text", "")
    assert [d.delta.text for d in deltas] == [token_text(i) for i in range(5)]
    assert {d.delta.type for d in deltas} == {"text_delta"}
    assert block_stop.index == 0
    assert delta.delta.stop_reason == "end_turn"
    assert delta.usage.output_tokens == 5
    assert (record.path, record.model, record.outcome) == (
        "/v1/messages",
        "claude-fake",
        "completed",
    )
    assert record.tokens_sent == 5


async def test_messages_whole_max_tokens_and_anthropic_errors(nursery: trio.Nursery) -> None:
    types = pytest.importorskip("anthropic.types")
    adapter = anthropic_event_adapter()
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            r = await c.post("/v1/messages", json=messages_body())
            message = types.Message.model_validate(r.json())
            assert (message.stop_reason, message.content[0].text) == ("end_turn", FIVE)
            assert (message.usage.input_tokens, message.usage.output_tokens) == (2, 5)

            r = await c.post("/v1/messages", json=messages_body(max_tokens=2))
            message = types.Message.model_validate(r.json())
            assert (message.stop_reason, message.content[0].text) == ("max_tokens", "The quick ")

            async with c.stream(
                "POST", "/v1/messages", json=messages_body(stream=True, max_tokens=3)
            ) as r:
                events = await typed_events(r)
            delta = adapter.validate_json(events[-2][1])
            assert (delta.delta.stop_reason, delta.usage.output_tokens) == ("max_tokens", 3)

            body = messages_body()
            del body["max_tokens"]
            r = await c.post("/v1/messages", json=body)
            assert r.status_code == 400
            assert r.json() == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": '"max_tokens" is required'},
            }
            r = await c.post("/v1/messages", content=b"{not json")
            assert r.json()["error"]["type"] == "invalid_request_error"
            r = await c.get("/v1/messages")
            assert r.status_code == 405 and r.json()["type"] == "error"
            for stream in (False, True):
                body = messages_body(stream=stream, fake={"mode": "status", "status": 529})
                r = await c.post("/v1/messages", json=body)
                assert r.status_code == 529
                assert r.json() == {
                    "type": "error",
                    "error": {"type": "overloaded_error", "message": "fake upstream error"},
                }
            r = await c.post("/v1/messages", json=messages_body(fake={"mode": "status"}))
            assert r.json()["error"]["type"] == "api_error"
    assert fake.recorder.last().outcome == "failed_injected"


async def test_messages_through_the_anthropic_sdk(nursery: trio.Nursery) -> None:
    anthropic = pytest.importorskip("anthropic")  # not a declared dev dependency
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with anthropic.AsyncAnthropic(
            base_url=f"http://127.0.0.1:{port}",
            api_key="x",
            max_retries=0,
            http_client=httpx2.AsyncClient(trust_env=False),  # it refuses an httpx client
        ) as sdk:
            messages = [{"role": "user", "content": "hi"}]
            async with sdk.messages.stream(
                model="claude-fake", max_tokens=3, messages=messages
            ) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            assert text == final.content[0].text == "The quick brown "
            assert final.stop_reason == "max_tokens"
            whole = await sdk.messages.create(model="claude-fake", max_tokens=99, messages=messages)
            assert (whole.stop_reason, whole.content[0].text) == ("end_turn", FIVE)
            with pytest.raises(anthropic.RateLimitError):
                await sdk.messages.create(
                    model="claude-fake",
                    max_tokens=9,
                    messages=messages,
                    extra_body={"fake": {"mode": "status", "status": 429}},
                )
    assert [r.model for r in fake.recorder.records] == ["claude-fake"] * 3


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/responses", responses_body()), ("/v1/messages", messages_body())],
    ids=["responses", "messages"],
)
@pytest.mark.parametrize("phase", ["ttft", "mid-stream"])
async def test_disconnect_from_typed_streams_recorded(
    nursery: trio.Nursery, path: str, body: dict[str, Any], phase: str
) -> None:
    fake, port = await start(nursery)
    steer = {"ttft": 5} if phase == "ttft" else {"interval": 0.02, "tokens": 1000}
    with trio.fail_after(10):
        steered = body | {"stream": True, "fake": steer}
        async with client(port) as c, c.stream("POST", path, json=steered) as r:
            assert r.status_code == 200
            if phase == "mid-stream":
                await fake.recorder.wait_for(lambda rec: rec.last().tokens_sent >= 3)
            left = trio.current_time()
        with trio.fail_after(1):
            await fake.recorder.wait_for(lambda rec: rec.last().outcome != "pending")
        record = fake.recorder.last()
        assert (record.outcome, record.path, record.finished_at) == (
            "client_disconnected",
            path,
            None,
        )
        assert record.disconnected_at is not None
        assert record.disconnected_at - left < DISCONNECT_BUDGET
        sent = record.tokens_sent
        await trio.sleep(0.05)
        assert record.tokens_sent == sent
        await fake.recorder.wait_for(lambda rec: rec.open_connections == 0)


TERMINAL = {"/v1/responses": "response.completed", "/v1/messages": "message_stop"}


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/responses", responses_body()), ("/v1/messages", messages_body())],
    ids=["responses", "messages"],
)
async def test_faults_cut_typed_streams_before_their_end(
    nursery: trio.Nursery, path: str, body: dict[str, Any]
) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        for mode, error in (("eof", httpx.RemoteProtocolError), ("reset", httpx.ReadError)):
            names: list[str | None] = []
            async with client(port) as c:
                steered = body | {"stream": True, "fake": {"mode": mode, "at": 2}}
                with pytest.raises(error):
                    async with c.stream("POST", path, json=steered) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("event: "):
                                names.append(line.removeprefix("event: "))
            deltas = [n for n in names if n and n.endswith("delta")]
            assert len(deltas) == 2
            assert TERMINAL[path] not in names
            assert (await settled(fake.recorder)).outcome == "failed_injected"

        async with client(port) as c:
            steered = body | {"stream": True, "fake": {"mode": "malformed", "at": 1}}
            async with c.stream("POST", path, json=steered) as r:
                events = await typed_events(r)
            assert (None, MALFORMED_EVENT.decode().strip()) in events
            assert events[-1][0] == TERMINAL[path]
            r = await c.post(path, json=body | {"fake": {"mode": "malformed"}})
            assert r.content == MALFORMED_EVENT
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post(path, json=body | {"fake": {"mode": "eof"}})
        async with client(port) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post(path, json=body | {"stream": True, "fake": {"mode": "refuse"}})


async def test_one_http_chunk_per_typed_event(nursery: trio.Nursery) -> None:
    _, port = await start(nursery, tokens=3)
    for path, body in (("/v1/responses", responses_body()), ("/v1/messages", messages_body())):
        raw_body = json.dumps(body | {"stream": True}).encode()
        with trio.fail_after(10):
            raw = await raw_exchange(port, post(path, raw_body, extra=b"connection: close\r\n"))
        _, chunks, rest = split_chunked(raw)
        assert rest == b""
        for chunk in chunks:
            assert chunk.startswith(b"event: ")
            assert chunk.count(b"\ndata: ") == 1
            assert chunk.endswith(b"\n\n") and chunk.count(b"\n\n") == 1


def f32(values: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


async def test_embeddings_floats_base64_and_token_arrays(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, ttft=0.03)
    with trio.fail_after(10):
        async with client(port) as c:
            before = trio.current_time()
            r = await c.post("/v1/embeddings", json={"model": "emb", "input": ["a b", "c"]})
            assert trio.current_time() - before >= 0.03  # ttft is the delay
            answer = CreateEmbeddingResponse.model_validate(r.json())
            assert [d.embedding for d in answer.data] == [
                embedding_vector("a b"),
                embedding_vector("c"),
            ]
            assert [d.index for d in answer.data] == [0, 1]
            assert (answer.model, answer.usage.prompt_tokens, answer.usage.total_tokens) == (
                "emb",
                3,
                3,
            )
            assert len(answer.data[0].embedding) == 8
            assert embedding_vector("a b") != embedding_vector("c")

            body = {"model": "emb", "input": "a b", "encoding_format": "base64"}
            r = await c.post("/v1/embeddings", json=body)
            encoded = r.json()["data"][0]["embedding"]
            assert encoded == f32(embedding_vector("a b"))
            decoded = list(struct.unpack("<8f", base64.b64decode(encoded)))
            assert decoded == embedding_vector("a b")  # exact in float32
            # The type says list[float]: the SDK builds it unvalidated and decodes after (the
            # SDK test below); strictly validated, it is the decoded answer that must fit.
            answer_json = r.json()
            answer_json["data"][0]["embedding"] = decoded
            CreateEmbeddingResponse.model_validate(answer_json)

            r = await c.post("/v1/embeddings", json={"input": [[1, 2, 3], [4]], "dimensions": 4})
            data = r.json()
            assert [d["embedding"] for d in data["data"]] == [
                embedding_vector([1, 2, 3], 4),
                embedding_vector([4], 4),
            ]
            assert data["usage"]["prompt_tokens"] == 4
            assert data["model"] == "fake-model"
            assert fake.recorder.last().model is None  # it named none
            r = await c.post("/v1/embeddings", json={"input": [1, 2]})
            assert r.json()["data"][0]["embedding"] == embedding_vector([1, 2])

            bad_bodies: list[dict[str, Any]] = [
                {"input": 3},
                {"input": []},
                {"input": "a", "encoding_format": "hex"},
            ]
            for bad in bad_bodies:
                assert (await c.post("/v1/embeddings", json=bad)).status_code == 400
    assert fake.recorder.records[0].path == "/v1/embeddings"
    assert fake.recorder.records[0].model == "emb"


async def test_embeddings_through_the_openai_sdk_base64(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with openai_client(port) as sdk:
            answer = await sdk.embeddings.create(model="emb", input=["one", "two three"])
            assert fake.recorder.last().body == {
                "model": "emb",
                "input": ["one", "two three"],
                "encoding_format": "base64",  # the SDK's default, decoded by the SDK
            }
            assert [d.embedding for d in answer.data] == [
                embedding_vector("one"),
                embedding_vector("two three"),
            ]
            floats = await sdk.embeddings.create(model="emb", input="one", encoding_format="float")
            assert floats.data[0].embedding == embedding_vector("one")
            assert fake.recorder.last().model == "emb"


async def test_embeddings_fault_modes(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    body = {"model": "emb", "input": "x"}
    with trio.fail_after(10):
        async with client(port) as c:
            r = await c.post(
                "/v1/embeddings", json=body | {"fake": {"mode": "status", "status": 429}}
            )
            assert (r.status_code, r.json()["error"]["type"]) == (429, "RateLimitError")
        for mode, error in (("refuse", httpx.RemoteProtocolError), ("reset", httpx.ReadError)):
            async with client(port) as c:
                with pytest.raises(error):
                    await c.post("/v1/embeddings", json=body | {"fake": {"mode": mode}})
        async with client(port, timeout=0.1) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/embeddings", json=body | {"fake": {"mode": "stall_headers"}})
        await fake.recorder.wait_for(lambda r: r.last().outcome == "client_disconnected")
    outcomes = [r.outcome for r in fake.recorder.records]
    assert outcomes == ["failed_injected"] * 3 + ["client_disconnected"]


async def test_tokenize_and_detokenize(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    with trio.fail_after(10):
        async with client(port) as c:
            r = await c.post("/tokenize", json={"model": "tok", "prompt": "The quick zebra"})
            answer = r.json()
            assert answer["count"] == 3 and len(answer["tokens"]) == 3
            assert answer["tokens"][:2] == [0, 1]  # words of WORDS are their index
            assert answer["max_model_len"] == MAX_MODEL_LEN
            again = (await c.post("/tokenize", json={"prompt": "The quick zebra"})).json()
            assert again["tokens"] == answer["tokens"]  # deterministic
            chat_form = {"messages": [{"role": "user", "content": "one two"}]}
            assert (await c.post("/tokenize", json=chat_form)).json()["count"] == 2
            assert (await c.post("/tokenize", json={"model": "tok"})).status_code == 400

            r = await c.post("/detokenize", json={"model": "tok", "tokens": [0, 1, 2, 18]})
            assert r.json() == {"prompt": "The quick brown " + token_text(18)}
            assert (await c.post("/detokenize", json={"tokens": ["x"]})).status_code == 400
    assert [(r.path, r.model) for r in fake.recorder.records[:2]] == [
        ("/tokenize", "tok"),
        ("/tokenize", None),
    ]


async def test_rerank_score_and_pooling(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    docs = ["alpha", "beta", "gamma"]
    with trio.fail_after(10):
        async with client(port) as c:
            body = {"model": "rr", "query": "q", "documents": [docs[0], {"text": docs[1]}, docs[2]]}
            answer = (await c.post("/v1/rerank", json=body | {"top_n": 2})).json()
            assert answer["model"] == "rr" and answer["id"].startswith("rerank-")
            scores = {d: relevance_score("q", d) for d in docs}
            best = sorted(docs, key=lambda d: -scores[d])[:2]
            assert [r["document"]["text"] for r in answer["results"]] == best
            assert [r["relevance_score"] for r in answer["results"]] == [scores[d] for d in best]
            assert [r["index"] for r in answer["results"]] == [docs.index(d) for d in best]
            assert all(0 <= s < 1 for s in scores.values())
            assert len((await c.post("/rerank", json=body)).json()["results"]) == 3

            score = {"model": "sc", "text_1": "q", "text_2": docs}
            answer = (await c.post("/v1/score", json=score)).json()
            assert answer["object"] == "list"
            assert [d["score"] for d in answer["data"]] == [scores[d] for d in docs]
            assert [d["object"] for d in answer["data"]] == ["score"] * 3
            pairs = {"text_1": ["a", "b"], "text_2": ["c", "d"]}
            answer = (await c.post("/score", json=pairs)).json()
            assert [d["score"] for d in answer["data"]] == [
                relevance_score("a", "c"),
                relevance_score("b", "d"),
            ]
            assert (
                await c.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["c"] * 3})
            ).status_code == 400

            answer = (await c.post("/pooling", json={"model": "pl", "input": ["x", "y"]})).json()
            assert [d["data"] for d in answer["data"]] == [
                embedding_vector("x"),
                embedding_vector("y"),
            ]
            assert [d["object"] for d in answer["data"]] == ["pooling"] * 2
            r = await c.post("/pooling", json={"input": "x", "fake": {"mode": "status"}})
            assert r.status_code == 500
    paths = [(r.path, r.model) for r in fake.recorder.records]
    assert paths[:3] == [("/v1/rerank", "rr"), ("/rerank", "rr"), ("/v1/score", "sc")]
    assert ("/pooling", "pl") in paths


def transcription_request(port: int, audio: bytes, **fields: str) -> httpx.Request:
    return httpx.Request(
        "POST",
        f"http://127.0.0.1:{port}/v1/audio/transcriptions",
        data={"model": "whisper-fake", **fields},
        files={"file": ("clip.wav", audio, "audio/wav")},
    )


async def test_transcription_digests_the_multipart_body_it_got(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    audio = bytes(range(256)) * 40 + b"\r\n--not-a-boundary\r\n"
    with trio.fail_after(10):
        async with client(port) as c:
            request = transcription_request(port, audio)
            sent = request.read()  # the exact bytes on the wire
            assert "content-length" in request.headers
            r = await c.send(request)
            answer = Transcription.model_validate(r.json())
            assert answer.text == FIVE
            assert r.json() == {
                "text": FIVE,
                "sha256": hashlib.sha256(sent).hexdigest(),
                "bytes": len(sent),
                "file_sha256": hashlib.sha256(audio).hexdigest(),
            }
            record = fake.recorder.last()
            assert (record.path, record.model, record.body) == (
                "/v1/audio/transcriptions",
                "whisper-fake",
                None,
            )
            assert record.form == {"model": "whisper-fake"}

            # Streamed, and steered through a "fake" form field.
            steer = json.dumps({"tokens": 3})
            request = transcription_request(port, audio, stream="true", fake=steer)
            sent = request.read()
            r = await c.send(request, stream=True)
            events = await sse_events(r)
            await r.aclose()
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert {ch["object"] for ch in chunks} == {"transcription.chunk"}
            assert [ch["choices"][0]["delta"].get("content") for ch in chunks] == [
                token_text(0),
                token_text(1),
                token_text(2),
                None,
            ]
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
            assert chunks[-1]["sha256"] == hashlib.sha256(sent).hexdigest()
            assert chunks[-1]["file_sha256"] == hashlib.sha256(audio).hexdigest()
            record = await settled(fake.recorder)
            assert (record.outcome, record.tokens_sent) == ("completed", 3)
            assert record.form is not None and record.form["stream"] == "true"

            no_file = await c.post("/v1/audio/transcriptions", data={"model": "w"}, files={})
            assert no_file.status_code == 400
            r = await c.post("/v1/audio/transcriptions", json={"model": "w"})
            assert r.status_code == 400 and "multipart" in r.json()["error"]["message"]
            boundary = b"multipart/form-data; boundary=xyz"
            r = await c.post(
                "/v1/audio/transcriptions",
                content=b"--xyz\r\nno disposition\r\n\r\ndata",
                headers={"content-type": boundary.decode()},
            )
            assert r.status_code == 400
            r = await c.send(
                transcription_request(port, audio, fake=json.dumps({"mode": "status"}))
            )
            assert r.status_code == 500

    # Too big is refused before it is read, as on every path.
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\n"
        f"content-type: multipart/form-data; boundary=b\r\n"
        f"content-length: {MAX_BODY_BYTES + 1}\r\n\r\n"
    ).encode()
    with trio.fail_after(10):
        raw = await raw_exchange(port, head)
    assert raw.startswith(b"HTTP/1.1 413 ")


async def test_transcription_through_the_openai_sdk(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery)
    audio = b"RIFF" + bytes(1000)
    with trio.fail_after(10):
        async with openai_client(port) as sdk:
            answer = await sdk.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio))
    assert answer.text == FIVE
    extra = answer.model_extra or {}
    assert extra["file_sha256"] == hashlib.sha256(audio).hexdigest()
    record = fake.recorder.last()
    assert extra["bytes"] == int(record.headers["content-length"])
    assert (record.model, record.outcome) == ("whisper-1", "completed")


async def test_every_endpoint_records_path_and_model(nursery: trio.Nursery) -> None:
    fake, port = await start(nursery, tokens=1)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", chat(model="a")),
        ("/v1/completions", completion(model="b")),
        ("/v1/responses", responses_body(model="c")),
        ("/v1/messages", messages_body(model="d")),
        ("/v1/embeddings", {"model": "e", "input": "x"}),
        ("/tokenize", {"model": "f", "prompt": "x"}),
        ("/detokenize", {"model": "g", "tokens": [1]}),
        ("/v1/rerank", {"model": "h", "query": "q", "documents": ["d"]}),
        ("/v1/score", {"model": "i", "text_1": "a", "text_2": "b"}),
        ("/pooling", {"model": "j", "input": "x"}),
    ]
    with trio.fail_after(10):
        async with client(port) as c:
            for path, body in calls:
                r = await c.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            r = await c.send(transcription_request(port, b"audio"))
            assert r.status_code == 200
            await c.get("/v1/models")
            records = (await c.get("/_fake/requests")).json()
    expected = [(path, body["model"]) for path, body in calls]
    expected += [("/v1/audio/transcriptions", "whisper-fake"), ("/v1/models", None)]
    assert [(r.path, r.model) for r in fake.recorder.records] == expected
    assert [(r["path"], r["model"]) for r in records] == expected
    assert {r.outcome for r in fake.recorder.records} == {"completed"}


# --------------------------------------------------------------------------- serving model


def test_prefix_cache_blocks_chain_and_evict() -> None:
    cache = PrefixCache(capacity=4)
    first = b"a" * 300
    assert cache.lookup(first, 100) == (3, 0, 1.0)
    # The same beginning, grown: its first three blocks hit, the rest of its bytes do not.
    blocks, hit, uncached = cache.lookup(first + b"b" * 100, 100)
    assert (blocks, hit) == (4, 3) and uncached == pytest.approx(0.25)
    # A different first block: nothing after it hits either (the chain).
    assert cache.lookup(b"c" + first[1:], 100)[1] == 0
    assert len(cache) == 4  # bounded: the oldest blocks went
    assert (cache.queries, cache.hits) == (3 + 4 + 3, 3)


async def test_prefix_cache_ttft_running_limit_and_metrics() -> None:
    from tests.support import poll_until, start_fake

    def body(content: str, **fake: Any) -> dict[str, Any]:
        # Long, so that the part of a block at its end, never cached, adds little to a hit.
        messages = [{"role": "system", "content": "s" * 2000}, {"role": "user", "content": content}]
        return {"model": "fake-model", "messages": messages, "stream": True, "tokens": 2, **fake}

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=5) as client:
            fake = await start_fake(
                nursery,
                interval=0.001,
                tokens=2,
                prefix_cache_size=64,
                prefix_block_bytes=64,
                ttft_hit=0.0,
                ttft_miss=1.0,
                max_running=1,
            )
            times = []
            for _ in range(2):
                started = trio.current_time()
                response = await client.post(f"{fake.url}/v1/chat/completions", json=body("q"))
                assert response.status_code == 200
                times.append(trio.current_time() - started)
            miss, hit = fake.recorder.records
            assert miss.prefix_hit_blocks == 0 and hit.prefix_hit_blocks == hit.prefix_blocks
            # A TTFT of 1 s against next to none: far apart, so that a loaded machine's pause
            # does not blur them.
            assert times[0] >= 1.0 > 0.5 > times[1], times

            # One running at a time: the second waits (and says so in /metrics). The first
            # runs until the test ends, so that the state holds however long the checks take.
            async def slow() -> None:
                await client.post(
                    f"{fake.url}/v1/chat/completions",
                    json=body("x", fake={"ttft": 60}),
                    timeout=None,
                )

            nursery.start_soon(slow)
            nursery.start_soon(slow)
            serving = fake.upstream.serving
            await poll_until(lambda: (serving.running, serving.waiting) == (1, 1))
            text = (await client.get(f"{fake.url}/metrics")).text
            assert 'vllm:num_requests_running{model_name="fake-model"} 1.0' in text
            assert 'vllm:num_requests_waiting{model_name="fake-model"} 1.0' in text
            assert 'vllm:kv_cache_usage_perc{model_name="fake-model"} 1.0' in text
            assert "vllm:prefix_cache_hits_total" in text
            assert len(fake.recorder.records) == 4  # /metrics is not recorded
            fake.upstream.settings.metrics_status = 503
            assert (await client.get(f"{fake.url}/metrics")).status_code == 503
            nursery.cancel_scope.cancel()
