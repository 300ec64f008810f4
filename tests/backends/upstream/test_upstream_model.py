"""A model's public name need not be the upstream's (``upstream_model``): the upstream is
asked for its own name on every endpoint, and the client reads the public one back in every
chunk and every whole answer (the fake answers with the model it was asked for, so the public
name in an answer proves the mapping back). A model without an alias sends the client's bytes
unchanged, byte for byte."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from proxy.backends.upstream.catalog import ModelCatalog
from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    Fake,
    Proxy,
    chat_body,
    read_request_head,
    start_fake,
    start_proxy,
)

PUBLIC = "HuggingFaceTB/SmolLM2-135M-Instruct"
UPSTREAM = "smol/served-é"  # not ASCII: written as UTF-8 by some servers, \u-escaped by others
PASSTHROUGH = ["/tokenize", "/v1/audio/transcriptions"]

over_transports = pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)

# Each JSON endpoint, with its body beyond "model" and "stream".
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]},
}


async def rig(nursery: trio.Nursery, transport: str) -> tuple[Proxy, Fake]:
    fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=4)
    table = {"upstreams": [fake.url], "transport": transport, "passthrough": PASSTHROUGH}
    proxy = await start_proxy(
        nursery, {PUBLIC: {**table, "upstream_model": UPSTREAM}, "plain": table}
    )
    return proxy, fake


def models_in(value: Any) -> Iterator[Any]:
    """Every "model" member's value in a JSON value, however deep."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "model":
                yield inner
            yield from models_in(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from models_in(inner)


def payloads(text: str) -> list[Any]:
    """The JSON of each event's data line (``[DONE]`` left out)."""
    found = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                found.append(json.loads(line[5:]))
    return found


@over_transports
@pytest.mark.parametrize("path", ENDPOINTS)
async def test_a_stream_names_the_public_model_in_every_chunk(
    nursery: trio.Nursery, transport: str, path: str
) -> None:
    with trio.fail_after(DEADLINE):
        proxy, fake = await rig(nursery, transport)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            body = {"model": PUBLIC, "stream": True, **ENDPOINTS[path]}
            response = await client.post(proxy.url + path, json=body)
    assert response.status_code == 200, response.text
    assert fake.recorder.last(path).model == UPSTREAM
    events = payloads(response.text)
    assert events
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert all(event["model"] == PUBLIC for event in events)
    named = [model for event in events for model in models_in(event)]
    # Responses: in each event's "response"; Messages: in message_start's "message".
    assert named and set(named) == {PUBLIC}
    assert UPSTREAM not in response.text


@over_transports
@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/embeddings"])
async def test_a_whole_answer_names_the_public_model(
    nursery: trio.Nursery, transport: str, path: str
) -> None:
    extra = ENDPOINTS.get(path, {"input": ["a", "b"]})
    with trio.fail_after(DEADLINE):
        proxy, fake = await rig(nursery, transport)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + path, json={"model": PUBLIC, **extra})
    assert response.status_code == 200, response.text
    assert fake.recorder.last(path).model == UPSTREAM
    assert response.json()["model"] == PUBLIC
    assert int(response.headers["content-length"]) == len(response.content)


@over_transports
async def test_a_model_without_an_alias_is_sent_and_answered_as_it_is(
    nursery: trio.Nursery, transport: str
) -> None:
    with trio.fail_after(DEADLINE):
        proxy, fake = await rig(nursery, transport)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + "/v1/chat/completions", json=chat_body("plain", stream=True)
            )
    assert fake.recorder.last().model == "plain"
    assert {event["model"] for event in payloads(response.text)} == {"plain"}


async def capture_upstream(
    received: list[bytes], task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """An upstream that keeps each request's exact body and answers a chat completion naming
    the model it was asked for."""

    async def handle(stream: trio.SocketStream) -> None:
        data = await read_request_head(stream)
        if data is None:
            return
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")[1:]
        headers = {
            name.lower(): value.strip() for name, _, value in (h.partition(":") for h in lines)
        }
        while len(body) < int(headers["content-length"]):
            body += await stream.receive_some(65536)
        received.append(body)
        model = json.loads(body)["model"]
        answer = json.dumps({"id": "x", "object": "chat.completion", "model": model}).encode()
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
        )
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    await trio.serve_listeners(handle, listeners)


@over_transports
async def test_the_upstream_receives_the_client_s_bytes_or_the_renamed_body(
    nursery: trio.Nursery, transport: str
) -> None:
    received: list[bytes] = []
    url = await nursery.start(partial(capture_upstream, received))
    table = {"upstreams": [url], "transport": transport}
    proxy = await start_proxy(
        nursery, {"plain": table, PUBLIC: {**table, "upstream_model": UPSTREAM}}
    )
    # Spacing and key order no serializer of Sluice's would write: only the client's bytes.
    plain = b'{ "messages" : [ {"content": "h\\u00e9", "role": "user"} ],  "model":"plain" }'
    aliased = plain.replace(b'"plain"', json.dumps(PUBLIC).encode())
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            answers = [
                await client.post(
                    proxy.url + "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                for body in (plain, aliased)
            ]
    assert received[0] == plain
    assert json.loads(received[1]) == {**json.loads(aliased), "model": UPSTREAM}
    assert [answer.json()["model"] for answer in answers] == ["plain", PUBLIC]


@over_transports
async def test_pass_throughs_send_the_upstream_s_name(
    nursery: trio.Nursery, transport: str
) -> None:
    audio = b"RIFF\x00\x00fake-audio"
    with trio.fail_after(DEADLINE):
        proxy, fake = await rig(nursery, transport)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            tokenized = await client.post(
                proxy.url + "/tokenize", json={"model": PUBLIC, "prompt": "hi"}
            )
            sent = {}
            transcribed = {}
            for model, stream in ((PUBLIC, "true"), ("plain", "false")):
                outgoing = client.build_request(
                    "POST",
                    proxy.url + "/v1/audio/transcriptions",
                    data={"model": model, "stream": stream},
                    files={"file": ("a.wav", audio, "audio/wav")},
                )
                sent[model] = outgoing.read()
                transcribed[model] = await client.send(outgoing)
                assert transcribed[model].status_code == 200, transcribed[model].text
                form = fake.recorder.last("/v1/audio/transcriptions").form
                assert form["model"] == (UPSTREAM if model == PUBLIC else "plain")
    assert tokenized.status_code == 200, tokenized.text
    assert fake.recorder.last("/tokenize").model == UPSTREAM
    # The aliased stream's chunks name the public model; the plain form arrived byte for byte.
    streamed = payloads(transcribed[PUBLIC].text)
    assert streamed and {event["model"] for event in streamed} == {PUBLIC}
    assert transcribed["plain"].json()["sha256"] == hashlib.sha256(sent["plain"]).hexdigest()
    renamed = sent[PUBLIC].replace(
        b"\r\n\r\n" + PUBLIC.encode() + b"\r\n", b"\r\n\r\n" + UPSTREAM.encode() + b"\r\n"
    )
    assert streamed[-1]["sha256"] == hashlib.sha256(renamed).hexdigest()


def test_the_catalog_finds_an_aliased_model_under_its_upstream_name() -> None:
    catalog = ModelCatalog()
    listed = [
        {"id": UPSTREAM, "object": "model", "max_model_len": 8192},
        {"id": "plain", "object": "model", "max_model_len": 2048},
        {"id": PUBLIC, "object": "model", "max_model_len": 1},  # another model's, by chance
    ]
    catalog._merge([PUBLIC, "plain"], listed, {PUBLIC: UPSTREAM})
    assert catalog.entries == {PUBLIC: {"max_model_len": 8192}, "plain": {"max_model_len": 2048}}
