"""Everything vLLM serves, through Sluice, under the same lifetime contract: the Responses API,
Anthropic Messages, embeddings and pass-through paths, with the official ``openai`` and
``anthropic`` SDKs unmodified, against the fake upstream and the local model.

Each endpoint goes through the one pipeline: keys (``x-api-key`` as well as ``Authorization``),
limits, errors in the API's own shape, the endpoint label on the requests metric, and a client
that leaves closing the upstream at once, streamed or not.
"""

from __future__ import annotations

import gc
import hashlib
import json
import warnings
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from proxy.api.auth import hash_key
from proxy.testing.fake_upstream import token_text
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    RawClient,
    poll_until,
    slowed,
    start_fake,
    start_proxy,
)

# The fake's answer to any request (5 tokens), and how soon a disconnect must reach it.
FAKE_TEXT = "".join(token_text(i) for i in range(5))
CANCEL_BOUND = 0.1
KEY = "sk-endpoints-test"
PASSTHROUGH = ["/tokenize", "/detokenize", "/v1/rerank", "/v1/score", "/v1/audio/transcriptions"]


@pytest.fixture
async def rig(nursery: trio.Nursery, tiny_loaded_model: Any) -> tuple[Proxy, Fake]:
    fake = await start_fake(nursery, ttft=0.01, interval=0.005, tokens=5)
    proxy = await start_proxy(
        nursery,
        {
            "fake-model": {"upstreams": [fake.url], "passthrough": PASSTHROUGH},
            "other": {"upstreams": [fake.url], "passthrough": ["/v1/score"]},
            "tiny": {"backend": "local", "path": "unused-preloaded", "default_temperature": 0.0},
        },
        local_models={"tiny": tiny_loaded_model},
        keys=[{"name": "t", "sha256": hash_key(KEY)}],
    )
    return proxy, fake


def openai_client(proxy: Proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY, max_retries=0)


def anthropic_client(proxy: Proxy, key: str = KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=proxy.url, api_key=key, max_retries=0)


# -- the Responses API -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fake-model", "tiny"])
async def test_responses_streamed_and_whole_with_the_openai_sdk(
    rig: tuple[Proxy, Fake], model: str
) -> None:
    proxy, _ = rig
    with trio.fail_after(DEADLINE):
        async with openai_client(proxy) as client:
            stream = await client.responses.create(
                model=model, input="Say hello.", stream=True, max_output_tokens=5
            )
            types: list[str] = []
            deltas: list[str] = []
            final: Any = None
            async for event in stream:
                types.append(event.type)
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                if event.type in ("response.completed", "response.incomplete"):
                    final = event.response
            whole = await client.responses.create(
                model=model, input="Say hello.", max_output_tokens=5
            )
    assert types[0] == "response.created"
    assert types[-1] in ("response.completed", "response.incomplete")
    assert final is not None and final.output_text == "".join(deltas)
    assert whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens > 0
    if model == "fake-model":
        assert "".join(deltas) == whole.output_text == FAKE_TEXT


async def test_a_responses_stream_cut_before_its_end_is_an_error_event(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, _ = rig
    body = {"model": "fake-model", "input": "hi", "stream": True, "fake": {"mode": "eof", "at": 2}}
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(
                proxy.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
            )
    assert response.status_code == 200
    last = response.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error" and error["code"] == "upstream_protocol_error"


# -- Anthropic Messages ----------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fake-model", "tiny"])
async def test_messages_streamed_and_whole_with_the_anthropic_sdk(
    rig: tuple[Proxy, Fake], model: str
) -> None:
    proxy, _ = rig
    messages: Any = [{"role": "user", "content": "Say hello."}]
    with trio.fail_after(DEADLINE):
        async with anthropic_client(proxy) as client:
            async with client.messages.stream(
                model=model, max_tokens=5, messages=messages
            ) as stream:
                streamed = "".join([text async for text in stream.text_stream])
                final = await stream.get_final_message()
            whole = await client.messages.create(model=model, max_tokens=5, messages=messages)
    assert final.content[0].text == streamed  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert whole.content[0].text  # type: ignore[union-attr]
    assert whole.usage.output_tokens > 0
    if model == "fake-model":
        assert streamed == FAKE_TEXT
    else:
        assert whole.stop_reason == "max_tokens" or whole.usage.output_tokens < 5


async def test_the_anthropic_key_header_is_checked_and_errors_are_anthropic_shaped(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, fake = rig
    messages: Any = [{"role": "user", "content": "hi"}]
    with trio.fail_after(DEADLINE):
        async with anthropic_client(proxy, key="sk-wrong") as wrong:
            with pytest.raises(anthropic.AuthenticationError):
                await wrong.messages.create(model="fake-model", max_tokens=5, messages=messages)
        async with anthropic_client(proxy) as client:
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.create(model="no-such", max_tokens=5, messages=messages)
            ok = await client.messages.create(model="fake-model", max_tokens=5, messages=messages)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as raw:
            missing = await raw.post(
                proxy.url + "/v1/messages",
                json={"model": "fake-model", "messages": messages},
                headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
            )
    assert ok.content
    # The client's key, in whichever header, never reaches the upstream.
    seen = fake.recorder.last().headers
    assert "x-api-key" not in seen and KEY not in json.dumps(seen)
    assert missing.status_code == 400
    error = missing.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]


# -- embeddings --------------------------------------------------------------------------------


async def test_embeddings_through_the_openai_sdk_and_refused_by_a_chat_model(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, fake = rig
    with trio.fail_after(DEADLINE):
        async with openai_client(proxy) as client:
            result = await client.embeddings.create(model="fake-model", input=["one", "two"])
            with pytest.raises(openai.BadRequestError) as refused:
                await client.embeddings.create(model="tiny", input="one")
    assert len(result.data) == 2 and all(item.embedding for item in result.data)
    assert fake.recorder.last().path == "/v1/embeddings"
    assert refused.value.code == "model_not_supported"
    assert "embeddings" in refused.value.message


# -- pass-through ------------------------------------------------------------------------------


async def test_passthrough_is_relayed_byte_for_byte_and_routed_by_model(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, fake = rig
    auth = {"Authorization": f"Bearer {KEY}"}
    audio = bytes(range(256)) * 64
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            tokenized = await client.post(
                proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "hi"}, headers=auth
            )
            outgoing = client.build_request(
                "POST",
                proxy.url + "/v1/audio/transcriptions",
                data={"model": "fake-model"},
                files={"file": ("a.wav", audio, "audio/wav")},
                headers=auth,
            )
            sent = outgoing.read()
            transcribed = await client.send(outgoing)
            unlisted = await client.post(
                proxy.url + "/pooling", json={"model": "fake-model"}, headers=auth
            )
            not_its_path = await client.post(
                proxy.url + "/tokenize", json={"model": "other", "prompt": "hi"}, headers=auth
            )
            ambiguous = await client.post(proxy.url + "/v1/score", json={}, headers=auth)
            unauthenticated = await client.post(
                proxy.url + "/tokenize", json={"model": "fake-model", "prompt": "hi"}
            )
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"]
    assert transcribed.status_code == 200, transcribed.text
    echoed = transcribed.json()
    assert echoed["sha256"] == hashlib.sha256(sent).hexdigest()
    assert echoed["file_sha256"] == hashlib.sha256(audio).hexdigest()
    assert fake.recorder.last().path == "/v1/audio/transcriptions"
    for refused, status in ((unlisted, 404), (not_its_path, 404), (ambiguous, 400)):
        assert refused.status_code == status, refused.text
        assert set(refused.json()["error"]) >= {"message", "type", "code"}
    assert unauthenticated.status_code == 401


# -- the lifetime contract on every endpoint ----------------------------------------------------

BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "embeddings": ("/v1/embeddings", {"input": "hi"}),
    "passthrough": ("/tokenize", {"prompt": "hi"}),
}
LONG = {"ttft": 0, "interval": 0.02, "tokens": 1000}


@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [
        *((endpoint, stream) for endpoint in ("messages", "responses") for stream in (True, False)),
        # Never streamed.
        ("embeddings", False),
        ("passthrough", False),
    ],
)
async def test_a_client_that_leaves_closes_the_upstream(
    rig: tuple[Proxy, Fake], endpoint: str, stream: bool
) -> None:
    proxy, fake = rig
    path, extra = BODIES[endpoint]
    # Streamed: mid-stream. Whole: while the upstream is still working on it.
    steer = LONG if stream else {"ttft": 30}
    body = {"model": "fake-model", "stream": stream, **extra, "fake": steer}
    headers = {"Authorization": f"Bearer {KEY}"}
    with trio.fail_after(DEADLINE):
        records = len(fake.recorder.records)
        raw = await RawClient.post(proxy, path, body, headers=headers)
        await fake.recorder.wait_for(lambda r: len(r.records) > records)
        record = fake.recorder.last()
        if stream:
            await raw.read_until(b"data: ", count=3)
        else:
            await trio.sleep(0.05)
        closed_at = await raw.close()
        await fake.recorder.wait_for(lambda _: record.outcome != "pending")
        await proxy.state.tracker.wait_idle()
    assert record.outcome == "client_disconnected", record
    assert record.disconnected_at - closed_at < CANCEL_BOUND


async def test_the_requests_metric_names_the_endpoint(rig: tuple[Proxy, Fake]) -> None:
    proxy, _ = rig
    with trio.fail_after(DEADLINE):
        async with openai_client(proxy) as client:
            await client.responses.create(model="fake-model", input="hi")
            await client.embeddings.create(model="fake-model", input="hi")
        await proxy.state.tracker.wait_idle()  # each counts when its relay closes
    registry = proxy.state.metrics.registry
    for endpoint in ("responses", "embeddings"):
        labels = {"model": "fake-model", "status": "200", "endpoint": endpoint, "key": "t"}
        assert registry.get_sample_value("sluice_requests_total", labels) == 1


LOCAL_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 400}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]},
    ),
}
STEP = 0.03


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("endpoint", sorted(LOCAL_BODIES))
async def test_a_client_that_leaves_stops_the_local_model_within_a_step(
    nursery: trio.Nursery, tiny_loaded_model: Any, endpoint: str, stream: bool
) -> None:
    slow = slowed(tiny_loaded_model, step_seconds=STEP)
    proxy = await start_proxy(
        nursery,
        {"tiny": {"backend": "local", "path": "unused-preloaded", "default_temperature": 0.0}},
        local_models={"tiny": slow},
    )
    backend = proxy.state.local_backends["tiny"]
    path, extra = LOCAL_BODIES[endpoint]
    with trio.fail_after(DEADLINE):
        raw = await RawClient.post(proxy, path, {"model": "tiny", "stream": stream, **extra})
        if stream:
            await raw.read_until(b"delta", count=4)
        else:
            await poll_until(lambda: slow.model.steps >= 4)
        steps = slow.model.steps
        closed_at = await raw.close()
        await backend.admission.wait_free()
        freed_after = trio.current_time() - closed_at
        await proxy.state.tracker.wait_idle()
    assert freed_after < STEP + 0.1, freed_after
    assert slow.model.steps - steps <= 1
    assert backend.active_generations == 0


async def test_models_lists_what_the_upstream_says_of_each(nursery: trio.Nursery) -> None:
    fake = await start_fake(nursery, models=["fake-model"])
    only = await start_fake(nursery, models=["served-under-its-own-name"])
    # Two models upstream: the aliased one is found under its upstream_model.
    two = await start_fake(nursery, models=["other", "real-name"])
    proxy = await start_proxy(
        nursery,
        {
            "fake-model": [fake.url],
            "alias": [only.url],
            "public": {"upstreams": [two.url], "upstream_model": "real-name"},
            "unknown": ["http://127.0.0.1:9"],
        },
        upstream={"list_upstream_models": True, "models_refresh_interval": 0.05},
    )
    with trio.fail_after(DEADLINE):
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            while True:
                listed = (await client.get(proxy.url + "/v1/models")).json()["data"]
                owners = {entry["id"]: entry["owned_by"] for entry in listed}
                if "sluice" not in (owners["fake-model"], owners["alias"], owners["public"]):
                    break
                await trio.sleep(0.02)
    # The ids stay Sluice's (what a client must send); the rest is the upstream's.
    assert owners == {
        "fake-model": "sluice-fake",
        "alias": "sluice-fake",
        "public": "sluice-fake",
        "unknown": "sluice",
    }


def collect_left_sdk_generators() -> None:
    """The SDKs' ``close()`` closes the HTTP response but leaves their own async generators
    (``AsyncStream.__stream__``, the SSE decoder's) suspended, unreachable once the stream is
    dropped. Trio warns (ResourceWarning) when such a generator is collected unexhausted, and
    the collector may run in any later test: collect them here, where the cause is known."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", "Async generator .* was garbage collected", ResourceWarning
        )
        gc.collect()


async def test_leaving_an_sdk_stream_early_closes_the_upstream(rig: tuple[Proxy, Fake]) -> None:
    """The SDKs' own early exit (closing the stream, leaving its ``async with``), not a test
    client's socket close: the fake sees its connection go within CANCEL_BOUND."""
    proxy, fake = rig
    long: Any = {"fake": LONG}
    with trio.fail_after(DEADLINE):
        async with openai_client(proxy) as client:
            stream = await client.responses.create(
                model="fake-model", input="hi", stream=True, extra_body=long
            )
            async for event in stream:
                if event.type == "response.output_text.delta":
                    break
            responses_record = fake.recorder.last()
            closed_at = trio.current_time()
            await stream.close()
        await fake.recorder.wait_for(lambda _: responses_record.outcome != "pending")
        responses_after = responses_record.disconnected_at - closed_at
        async with (
            anthropic_client(proxy) as claude,
            claude.messages.stream(
                model="fake-model",
                max_tokens=1000,
                messages=[{"role": "user", "content": "hi"}],
                extra_body=long,
            ) as message_stream,
        ):
            async for _ in message_stream.text_stream:
                break
            messages_record = fake.recorder.last()
            closed_at = trio.current_time()
        await fake.recorder.wait_for(lambda _: messages_record.outcome != "pending")
        messages_after = messages_record.disconnected_at - closed_at
    del stream, message_stream
    collect_left_sdk_generators()
    assert responses_record.outcome == messages_record.outcome == "client_disconnected"
    assert responses_after < CANCEL_BOUND, responses_after
    assert messages_after < CANCEL_BOUND, messages_after
