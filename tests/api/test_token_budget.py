"""Per-key token budgets in memory (``[limits] backend = "memory"``): the config, the windows'
edges under virtual time, and whole requests through a proxy (reservation, settlement from
usage blocks or from counted events, the dodge of leaving early, refusals, the cap)."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from proxy.api.auth import CORS_EXPOSED_HEADERS, KeyRing
from proxy.api.token_budget import Charge, TokenWindow, reset_text
from proxy.config import ConfigError, KeyConfig
from proxy.ops.logs import ACCESS_LOGGER
from proxy.protocol.errors import ApiError
from tests.api.test_auth import bearer, build, key_table
from tests.ops.test_metrics import scrape, value
from tests.support import (
    DEADLINE,
    Proxy,
    chat_body,
    local_model,
    sse_payloads,
    start_fake,
    start_proxy,
)

CHAT = "/v1/chat/completions"


# -- configuration ----------------------------------------------------------------------------


def test_token_settings_are_read_and_checked() -> None:
    config = build(
        {
            "keys": [
                key_table(tokens_per_minute=100, tokens_per_day=1000, max_tokens_cap=50)
                | {"tokens_counted": "output"}
            ]
        }
    )
    key = config.keys[0]
    assert (key.tokens_per_minute, key.tokens_per_day, key.max_tokens_cap) == (100, 1000, 50)
    assert key.tokens_counted == "output" and key.token_budgeted
    with pytest.raises(ConfigError, match="unknown key 'tokens_per_minit'"):
        build({"keys": [key_table() | {"tokens_per_minit": 5}]})
    with pytest.raises(ConfigError, match=r"'tokens_counted'.*total, output"):
        build({"keys": [key_table() | {"tokens_counted": "input"}]})
    with pytest.raises(ConfigError, match=r"'tokens_per_day'.*>= 0"):
        build({"keys": [key_table(tokens_per_day=-1)]})


# -- the window, sans-IO (explicit times) and under virtual time ------------------------------


def test_a_window_admits_while_it_has_room_and_says_when_it_frees_enough() -> None:
    window = TokenWindow(100, 60.0)
    assert window.wait(0.0) == 0.0
    first, second = _charge(window, 10.0, 60), _charge(window, 20.0, 50)
    assert window.used == 110
    # 11 tokens must leave: the first charge (60) is enough, at 10 + 60.
    assert window.wait(30.0) == pytest.approx(40.0)
    assert window.remaining(30.0) == 0
    # Settled below the reservation: room again at once.
    window.settle(first, 5)
    first.tokens = 5
    assert window.wait(30.0) == 0.0 and window.used == 55
    window.settle(second, 200)
    second.tokens = 200
    # The edge: a charge at t counts until t + 60 exactly, not after.
    assert window.wait(79.999) > 0
    assert window.wait(80.0) == 0.0
    assert window.used == 0
    # A settlement of a charge that has left changes nothing.
    window.settle(second, 1)
    assert window.used == 0


def _charge(window: TokenWindow, at: float, tokens: int) -> Charge:
    charge = Charge(at, tokens)
    window.add(charge)
    return charge


def test_reset_is_written_as_openai_writes_it() -> None:
    assert [reset_text(s) for s in (0.02, 1.5, 12.0, 360.0, 3723.0)] == [
        "20ms",
        "1.5s",
        "12s",
        "6m0s",
        "1h2m3s",
    ]


def budget_key(**settings: Any) -> KeyConfig:
    return KeyConfig(name="alice", sha256="0" * 64, **settings)


async def test_window_edges_under_virtual_time(autojump_clock: trio.abc.Clock) -> None:
    key = budget_key(tokens_per_minute=100, tokens_per_day=150)
    keys = KeyRing([key])
    lease = keys.admit(key, trio.current_time(), 400)  # admitted: the window had room
    lease.settle(70)
    await trio.sleep(10)
    keys.admit(key, trio.current_time(), 40).settle(40)
    with pytest.raises(ApiError) as refused:
        keys.admit(key, trio.current_time(), 1)
    # The minute needs 11 tokens out: the first charge's, at 60 s after it.
    assert refused.value.code == "token_limit_exceeded"
    assert refused.value.headers["Retry-After"] == "50"
    await trio.sleep(49.999)
    with pytest.raises(ApiError):
        keys.admit(key, trio.current_time(), 1)
    await trio.sleep(0.001)
    keys.admit(key, trio.current_time(), 30).settle(30)
    # The day has 140 of 150 now: room for one more (170), then full until the first charge
    # (70, at 0 s) leaves it.
    keys.admit(key, trio.current_time(), 30).settle(30)
    await trio.sleep(3600)
    with pytest.raises(ApiError) as daily:
        keys.admit(key, trio.current_time(), 1)
    assert daily.value.headers["x-ratelimit-limit-tokens"] == "150"
    assert int(daily.value.headers["Retry-After"]) == 86_400 - 3600 - 60
    assert daily.value.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_reload_keeps_the_charges(autojump_clock: trio.abc.Clock) -> None:
    old_key = budget_key(tokens_per_minute=100)
    old = KeyRing([old_key])
    old.admit(old_key, trio.current_time(), 90).settle(90)
    new_key = budget_key(tokens_per_minute=80)
    new = KeyRing([new_key])
    new.carry_over(old)
    with pytest.raises(ApiError):
        new.admit(new_key, trio.current_time(), 1)


# -- through a proxy ---------------------------------------------------------------------------


async def budget_proxy(
    nursery: trio.Nursery, fake_settings: dict[str, Any] | None = None, **key: Any
) -> tuple[Any, Proxy]:
    settings = {"ttft": 0.0, "interval": 0.0, "tokens": 30, **(fake_settings or {})}
    fake = await start_fake(nursery, **settings)
    proxy = await start_proxy(
        nursery,
        {"fake-model": [fake.url]},
        keys=[
            key_table(**{name: v for name, v in key.items() if name != "tokens_counted"})
            | ({"tokens_counted": key["tokens_counted"]} if "tokens_counted" in key else {})
        ],
        server={"cors_origins": ["*"]},
    )
    return fake, proxy


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Any:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        yield caplog


async def settled_lines(proxy: Proxy, caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access lines, once every relay has closed (a line is written as its body closes,
    which may be after the client has read the whole response)."""
    await proxy.state.tracker.wait_idle()
    return access_lines(caplog)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        json.loads(record.getMessage())
        for record in caplog.records
        if record.name == ACCESS_LOGGER and '"path":"/v1/' in record.getMessage()
    ]


async def test_a_whole_answer_is_charged_from_its_usage_block(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await budget_proxy(nursery, tokens_per_minute=100)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            statuses = []
            for _ in range(5):
                response = await client.post(
                    proxy.url + CHAT, json=chat_body(stream=False), headers=bearer()
                )
                statuses.append(response.status_code)
            # Each is 2 prompt words + 30 tokens, by the fake's usage block: 32, 64, 96, 128.
            assert statuses == [200, 200, 200, 200, 429]
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("token_limit_exceeded", "rate_limit_error")
            assert response.headers["x-ratelimit-limit-tokens"] == "100"
            assert response.headers["x-ratelimit-remaining-tokens"] == "0"
            assert 55 <= int(response.headers["retry-after"]) <= 60
            assert response.headers["x-ratelimit-reset-tokens"].endswith("s")
            await proxy.state.tracker.wait_idle()
            samples = await scrape(client, proxy)
        assert value(samples, "sluice_key_tokens_total", key="alice", kind="input") == 8
        assert value(samples, "sluice_key_tokens_total", key="alice", kind="output") == 120
        lines = await settled_lines(proxy, access)
        assert [(line["input_tokens"], line["output_tokens"]) for line in lines[:4]] == [
            (2, 30)
        ] * 4
        assert lines[0]["input_estimated"] is False and lines[0]["for_nobody_tokens"] == 0
        assert lines[4]["outcome"] == "token_limit_exceeded"
        assert lines[4]["input_tokens"] is None
        # Upstream, the first request reserved its input estimate and the default output.
        assert fake.recorder.records[0].body.get("stream_options") is None


async def test_the_usage_chunk_is_asked_for_upstream_and_kept_from_the_client(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await budget_proxy(nursery, tokens_per_minute=10_000)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            plain = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            asked = await client.post(
                proxy.url + CHAT,
                json=chat_body(stream_options={"include_usage": True}),
                headers=bearer(),
            )
        upstream = [record.body for record in fake.recorder.records]
        assert [body["stream_options"] for body in upstream] == [{"include_usage": True}] * 2
        plain_events = sse_payloads(plain.text)
        assert plain_events[-1] == "[DONE]"
        assert not any('"usage"' in event for event in plain_events)
        assert len(plain_events) == 30 + 3  # role, 29 more tokens, finish... as without a key
        asked_events = sse_payloads(asked.text)
        assert json.loads(asked_events[-2])["usage"]["completion_tokens"] == 30
        lines = await settled_lines(proxy, access)
        assert [(line["input_tokens"], line["output_tokens"]) for line in lines] == [(2, 30)] * 2


async def test_without_usage_blocks_the_deltas_are_counted(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        _, proxy = await budget_proxy(
            nursery, {"usage": False}, tokens_per_minute=10_000, tokens_counted="output"
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            streamed = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            whole = await client.post(
                proxy.url + CHAT, json=chat_body(stream=False), headers=bearer()
            )
        assert streamed.status_code == whole.status_code == 200
        lines = await settled_lines(proxy, access)
        # One per content delta (the role chunk's empty content counted with them); the
        # prompt estimated: "hello there" and "user" are 15 characters, 4 tokens.
        assert 30 <= lines[0]["output_tokens"] <= 31
        assert (lines[0]["input_tokens"], lines[0]["input_estimated"]) == (4, True)
        # A whole answer without usage: its text estimated (the fake's words are 4-6 chars).
        assert 25 <= lines[1]["output_tokens"] <= 50


async def test_the_dodge_a_stream_left_early_is_charged_what_was_generated(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        _, proxy = await budget_proxy(
            nursery, {"usage": False, "interval": 0.01, "tokens": 5000}, tokens_per_minute=100
        )
        outcomes = []
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for _ in range(6):
                async with client.stream(
                    "POST", proxy.url + CHAT, json=chat_body(), headers=bearer()
                ) as response:
                    outcomes.append(response.status_code)
                    if response.status_code != 200:
                        break
                    seen = 0
                    async for chunk in response.aiter_bytes():
                        seen += chunk.count(b"data:")
                        # The client leaves after about 40 tokens (and the opening role
                        # delta, which carries none).
                        if seen >= 41:
                            break
                await proxy.state.tracker.wait_idle()
        # Charged ~40 and more each (what was received), never nothing: refused by the 4th.
        assert 429 in outcomes and outcomes.index(429) <= 3
        lines = [line for line in await settled_lines(proxy, access) if line["status"] == 200]
        assert all(line["output_tokens"] >= 40 for line in lines)
        assert all(line["outcome"].startswith("cancelled") for line in lines)


async def test_a_refusal_is_exposed_to_browsers_and_counts_no_tokens(
    nursery: trio.Nursery,
) -> None:
    assert "x-ratelimit-remaining-tokens" in CORS_EXPOSED_HEADERS
    with trio.fail_after(DEADLINE):
        _, proxy = await budget_proxy(nursery, tokens_per_minute=1)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            origin = {"Origin": "https://app.example"}
            ok = await client.post(
                proxy.url + CHAT, json=chat_body(stream=False), headers=bearer() | origin
            )
            refused = await client.post(
                proxy.url + CHAT, json=chat_body(stream=False), headers=bearer() | origin
            )
        assert (ok.status_code, refused.status_code) == (200, 429)
        exposed = refused.headers["access-control-expose-headers"]
        assert "x-ratelimit-reset-tokens" in exposed


async def test_over_websocket_a_refusal_is_an_error_message(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        _, proxy = await budget_proxy(nursery, tokens_per_minute=1)
        url = proxy.url.replace("http://", "ws://") + "/v1/ws"
        message = json.dumps(
            {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        )
        async with open_websocket_url(
            url, extra_headers=[(b"Authorization", bearer()["Authorization"].encode())]
        ) as ws:
            await ws.send_message(message)
            while json.loads(await ws.get_message())["type"] == "token":
                pass
            await ws.send_message(message)
            refusal = json.loads(await ws.get_message())
        assert refusal["type"] == "error" and refusal["status"] == 429
        assert refusal["error"]["code"] == "token_limit_exceeded"


@pytest.mark.parametrize(
    ("path", "body", "field", "expected"),
    [
        (CHAT, chat_body(stream=False), "max_completion_tokens", 7),
        (CHAT, chat_body(stream=False, max_tokens=500), "max_tokens", 7),
        (CHAT, chat_body(stream=False, max_tokens=3), "max_tokens", 3),
        (
            "/v1/completions",
            {"model": "fake-model", "prompt": "hi", "max_tokens": 99},
            "max_tokens",
            7,
        ),
        ("/v1/responses", {"model": "fake-model", "input": "hi"}, "max_output_tokens", 7),
        (
            "/v1/messages",
            {
                "model": "fake-model",
                "max_tokens": 1024,
                "messages": [{"role": "user", "content": "hi"}],
            },
            "max_tokens",
            7,
        ),
    ],
)
async def test_the_cap_goes_in_each_endpoints_own_field(
    nursery: trio.Nursery, path: str, body: dict[str, Any], field: str, expected: int
) -> None:
    with trio.fail_after(DEADLINE):
        fake, proxy = await budget_proxy(nursery, max_tokens_cap=7)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + path, json=body, headers=bearer())
        assert response.status_code == 200, response.text
        assert fake.recorder.records[-1].body[field] == expected


async def test_a_local_model_is_charged_its_own_count(
    nursery: trio.Nursery, tiny_loaded_model: Any, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"tiny": local_model()},
            local_models={"tiny": tiny_loaded_model},
            keys=[key_table(tokens_per_minute=10_000, max_tokens_cap=6)],
        )
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            whole = await client.post(
                proxy.url + CHAT, json=chat_body("tiny", stream=False), headers=bearer()
            )
            streamed = await client.post(
                proxy.url + CHAT, json=chat_body("tiny", max_tokens=50), headers=bearer()
            )
        usage = whole.json()["usage"]
        # The cap held both to 6 tokens; no usage chunk was asked of a local model.
        assert usage["completion_tokens"] == 6
        assert not any('"usage"' in event for event in sse_payloads(streamed.text))
        lines = await settled_lines(proxy, access)
        assert [(line["input_tokens"], line["output_tokens"]) for line in lines] == [
            (usage["prompt_tokens"], 6)
        ] * 2
        assert lines[0]["input_estimated"] is False
