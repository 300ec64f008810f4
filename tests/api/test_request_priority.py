"""A request's asked priority: checked (a malformed one is a 400 in the endpoint's own error
shape, before anything of the request is taken), and the band it was served in said back in
the ``x-sluice-priority`` response header of every answer to a scheduled request."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
import trio

from proxy.api.auth import hash_key
from proxy.protocol.errors import ApiError
from proxy.protocol.request_priority import LEAST_URGENT_BAND, asked_priority, request_band
from tests.support import DEADLINE, Fake, Proxy, chat_body, start_fake, start_proxy

MODEL = "fake-model"
BATCH = "sk-priority-batch"  # a band-10 key
ONE_A_MINUTE = "sk-priority-rpm"  # a band-0 key that may start one request a minute
HEADER = "x-sluice-priority"

# -- the check, sans-IO ------------------------------------------------------------------------


def test_nothing_asked_is_none() -> None:
    assert asked_priority(None, None) is None


@pytest.mark.parametrize(
    ("header", "body", "asked"),
    [
        ("7", None, 7),
        (" 7 ", None, 7),  # read after strip, as a header's value is
        ("007", None, 7),
        ("+7", None, 7),
        (None, 0, 0),
        (None, LEAST_URGENT_BAND, LEAST_URGENT_BAND),
        (str(LEAST_URGENT_BAND), None, LEAST_URGENT_BAND),
        ("3", 8, 8),  # both: the less urgent
        ("8", 3, 8),
    ],
)
def test_a_valid_priority_is_the_band_asked(header: str | None, body: object, asked: int) -> None:
    assert asked_priority(header, body) == asked


@pytest.mark.parametrize(
    "header",
    [
        "soon",
        "1.5",
        "NOT_GIVEN",  # what the Anthropic SDK may send for a header it was given no value for
        "",
        "  ",
        "1_0",  # int() would read 10
        "\u0663",  # an Arabic-Indic three: int() would read 3
        "0x1",
        "-1",
        "100",
        pytest.param("9" * 5000, id="more-digits-than-int-reads"),
    ],
)
def test_a_header_that_is_not_a_band_is_a_400_naming_the_header(header: str) -> None:
    with pytest.raises(ApiError) as refused:
        asked_priority(header, None)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, HEADER, "invalid_priority")
    assert f"from 0 (most urgent) to {LEAST_URGENT_BAND}" in error.message


@pytest.mark.parametrize(
    "body", [-1, LEAST_URGENT_BAND + 1, 1000, 10**50, True, False, "5", 5.0, [5], {}]
)
def test_a_body_priority_that_is_not_a_band_is_a_400_naming_priority(body: object) -> None:
    with pytest.raises(ApiError) as refused:
        asked_priority("5", body)
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "priority", "invalid_priority")


def test_a_valid_band_more_urgent_than_the_keys_is_not_refused_but_not_granted() -> None:
    asked = asked_priority("0", None)
    assert asked == 0
    assert request_band(10, asked) == 10
    assert request_band(10, asked_priority("20", None)) == 20
    assert request_band(10, asked_priority(None, None)) == 10


# -- through a real Sluice -------------------------------------------------------------------


@pytest.fixture
async def rig(nursery: trio.Nursery) -> tuple[Proxy, Fake]:
    fake = await start_fake(nursery, ttft=0.01, interval=0.005, tokens=3)
    proxy = await start_proxy(
        nursery,
        {MODEL: [fake.url]},
        keys=[
            {"name": "batch", "sha256": hash_key(BATCH), "priority": 10},
            {"name": "rpm", "sha256": hash_key(ONE_A_MINUTE), "requests_per_minute": 1},
        ],
    )
    return proxy, fake


def bearer(key: str = BATCH) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# Each endpoint that is scheduled, with a body that asks for nothing.
ENDPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-streamed": ("/v1/chat/completions", chat_body(MODEL, stream=True)),
    "chat": ("/v1/chat/completions", chat_body(MODEL, stream=False)),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
    "responses-streamed": ("/v1/responses", {"model": MODEL, "input": "hi", "stream": True}),
    "messages": (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    ),
    "embeddings": ("/v1/embeddings", {"model": MODEL, "input": "hi"}),
}


@pytest.mark.usefixtures("each_server_path")
@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
async def test_every_scheduled_answer_says_its_band_and_a_more_urgent_ask_gets_the_keys(
    rig: tuple[Proxy, Fake], client: httpx.AsyncClient, endpoint: str
) -> None:
    proxy, fake = rig
    path, body = ENDPOINTS[endpoint]
    bands: dict[str | None, str] = {}
    with trio.fail_after(DEADLINE):
        for asked in (None, "0", "20"):
            headers = bearer() if asked is None else {**bearer(), HEADER: asked}
            async with client.stream("POST", proxy.url + path, json=body, headers=headers) as r:
                await r.aread()
            assert r.status_code == 200, r.text
            bands[asked] = r.headers[HEADER]
        await proxy.state.tracker.wait_idle()
    # Its key's band; asking for a more urgent one is served in the key's, not refused.
    assert bands == {None: "10", "0": "10", "20": "20"}
    # The header is Sluice's to read: it never reaches the upstream.
    assert all(HEADER not in record.headers for record in fake.recorder.records)


async def test_the_openai_sdk_sees_the_band_of_a_body_priority_which_the_upstream_does_not(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, fake = rig
    with trio.fail_after(DEADLINE):
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key=BATCH, max_retries=0
        ) as sdk:
            raw = await sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"priority": 20},
            )
            urgent = await sdk.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"priority": 0},
            )
    assert (raw.status_code, raw.headers[HEADER]) == (200, "20")
    assert (urgent.status_code, urgent.headers[HEADER]) == (200, "10")
    # vLLM's default policy refuses a priority field: taken out before forwarding.
    assert all("priority" not in record.body for record in fake.recorder.records)


MALFORMED: list[tuple[dict[str, str], dict[str, Any], str]] = [
    ({HEADER: "soon"}, {}, HEADER),
    ({HEADER: "1.5"}, {}, HEADER),
    ({HEADER: "NOT_GIVEN"}, {}, HEADER),
    ({}, {"priority": -1}, "priority"),
    ({}, {"priority": 1000}, "priority"),
    ({}, {"priority": True}, "priority"),
    ({}, {"priority": "5"}, "priority"),
    ({HEADER: "5"}, {"priority": 5.5}, "priority"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_malformed_priority_is_an_openai_shaped_400_that_takes_nothing(
    rig: tuple[Proxy, Fake], client: httpx.AsyncClient, stream: bool
) -> None:
    proxy, fake = rig
    with trio.fail_after(DEADLINE):
        for headers, extra, param in MALFORMED:
            refused = await client.post(
                proxy.url + "/v1/chat/completions",
                json=chat_body(MODEL, stream=stream, **extra),
                # The key that may start one request a minute: a refusal must not spend it.
                headers={**bearer(ONE_A_MINUTE), **headers},
            )
            assert refused.status_code == 400, (headers, extra, refused.text)
            error = refused.json()["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "invalid_request_error",
                param,
                "invalid_priority",
            )
            # Refused before it was scheduled: no band was decided, none is said.
            assert HEADER not in refused.headers
        assert fake.recorder.records == []
        assert not proxy.state.pipeline.relays
        # Its one request of the minute is still there, and the next is its key's 429: a
        # refusal after scheduling, which says the band all the same.
        ok = await client.post(
            proxy.url + "/v1/chat/completions",
            json=chat_body(MODEL, stream=stream),
            headers=bearer(ONE_A_MINUTE),
        )
        limited = await client.post(
            proxy.url + "/v1/chat/completions",
            json=chat_body(MODEL, stream=stream),
            headers=bearer(ONE_A_MINUTE),
        )
        await proxy.state.tracker.wait_idle()
    assert (ok.status_code, ok.headers[HEADER]) == (200, "0")
    assert (limited.status_code, limited.headers[HEADER]) == (429, "0")
    assert len(fake.recorder.records) == 1


async def test_an_unauthenticated_request_hears_401_not_its_priority(
    rig: tuple[Proxy, Fake], client: httpx.AsyncClient
) -> None:
    proxy, _ = rig
    with trio.fail_after(DEADLINE):
        refused = await client.post(
            proxy.url + "/v1/chat/completions",
            json=chat_body(MODEL, priority="soon"),
            headers={"Authorization": "Bearer sk-wrong", HEADER: "soon"},
        )
    assert refused.status_code == 401
    assert HEADER not in refused.headers


async def test_messages_refuses_a_malformed_priority_in_anthropics_shape(
    rig: tuple[Proxy, Fake],
) -> None:
    proxy, fake = rig
    messages: Any = [{"role": "user", "content": "hi"}]
    with trio.fail_after(DEADLINE):
        async with anthropic.AsyncAnthropic(
            base_url=proxy.url, api_key=BATCH, max_retries=0
        ) as sdk:
            with pytest.raises(anthropic.BadRequestError) as by_header:
                await sdk.messages.create(
                    model=MODEL,
                    max_tokens=3,
                    messages=messages,
                    extra_headers={HEADER: "soon"},
                )
            with pytest.raises(anthropic.BadRequestError) as by_body:
                await sdk.messages.create(
                    model=MODEL, max_tokens=3, messages=messages, extra_body={"priority": -1}
                )
    for raised, named in ((by_header, HEADER), (by_body, "'priority'")):
        response = raised.value.response
        assert response.status_code == 400
        body = json.loads(response.content)
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert named in body["error"]["message"]
    assert fake.recorder.records == []
