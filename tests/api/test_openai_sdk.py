"""The official OpenAI Python SDK, unmodified, against Sluice: sync and async, streaming and
not, usage, errors as the SDK's own exception types, and leaving a stream early."""

from __future__ import annotations

from typing import Any

import openai
import pytest
import trio

from proxy.api.auth import hash_key
from tests.support import DEADLINE, Fake, Proxy, start_fake, start_proxy

MESSAGES: Any = [{"role": "user", "content": "hello"}]


def sync_client(proxy: Proxy, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=10)


async def test_sync_client_streams_and_not(proxy: Proxy) -> None:
    def talk() -> tuple[str, str, Any, str]:
        with sync_client(proxy) as client:
            whole = client.chat.completions.create(model="fake-model", messages=MESSAGES)
            text = ""
            usage = None
            with client.chat.completions.create(
                model="fake-model",
                messages=MESSAGES,
                stream=True,
                stream_options={"include_usage": True},
            ) as stream:
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                    if chunk.usage is not None:
                        usage = chunk.usage
            legacy = client.completions.create(model="fake-model", prompt="Once", max_tokens=2)
            return whole.choices[0].message.content or "", text, usage, legacy.choices[0].text

    with trio.fail_after(DEADLINE):
        whole, streamed, usage, legacy = await trio.to_thread.run_sync(talk)
    assert whole == streamed == "The quick brown fox jumps "
    assert usage is not None and usage.completion_tokens == 5
    assert legacy == "The quick "


async def test_async_client_under_trio(proxy: Proxy) -> None:
    with trio.fail_after(DEADLINE):
        async with openai.AsyncOpenAI(
            base_url=proxy.url + "/v1", api_key="unused", max_retries=0
        ) as client:
            stream = await client.chat.completions.create(
                model="fake-model", messages=MESSAGES, stream=True
            )
            pieces = [
                chunk.choices[0].delta.content
                async for chunk in stream
                if chunk.choices and chunk.choices[0].delta.content
            ]
            assert "".join(pieces) == "The quick brown fox jumps "
            whole = await client.chat.completions.create(model="fake-model", messages=MESSAGES)
            assert whole.usage is not None and whole.usage.total_tokens > 5


async def test_errors_are_the_sdks_exception_types(nursery: trio.Nursery, fake: Fake) -> None:
    key = "sk-test-sdk"
    proxy = await start_proxy(
        nursery,
        {"fake-model": [fake.url]},
        keys=[{"name": "t", "sha256": hash_key(key), "requests_per_minute": 1}],
    )

    def provoke() -> list[type[Exception]]:
        raised: list[type[Exception]] = []
        attempts: list[tuple[str, dict[str, Any]]] = [
            ("wrong-key", {"model": "fake-model"}),
            (key, {"model": "no-such-model"}),
            (key, {"model": "fake-model", "temperature": "hot"}),
            # Refused requests above never reached the limiter; this is the first counted.
            (key, {"model": "fake-model"}),
            (key, {"model": "fake-model"}),  # the second this minute: over the limit
        ]
        for api_key, params in attempts:
            with sync_client(proxy, api_key) as client:
                try:
                    client.chat.completions.create(messages=MESSAGES, **params)
                except openai.APIStatusError as error:
                    raised.append(type(error))
                else:
                    raised.append(type(None))  # type: ignore[arg-type]
        return raised

    with trio.fail_after(DEADLINE):
        raised = await trio.to_thread.run_sync(provoke)
    assert raised == [
        openai.AuthenticationError,
        openai.NotFoundError,
        openai.BadRequestError,
        type(None),
        openai.RateLimitError,
    ]


async def test_in_band_error_raises_mid_stream(nursery: trio.Nursery, fake: Fake) -> None:
    # The two tokens before the stall come at once, and the idle timeout is a second: a loaded
    # machine's pause between them must not pass for the upstream's silence.
    proxy = await start_proxy(
        nursery, {"fake-model": {"upstreams": [fake.url], "idle_timeout": 1.0}}
    )

    def read_until_error() -> tuple[str, BaseException | None]:
        text = ""
        with sync_client(proxy) as client:
            try:
                stream = client.chat.completions.create(
                    model="fake-model",
                    messages=MESSAGES,
                    stream=True,
                    extra_body={"fake": {"mode": "stall", "at": 2, "interval": 0}},
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
            except openai.APIError as error:
                return text, error
        return text, None

    with trio.fail_after(DEADLINE):
        text, error = await trio.to_thread.run_sync(read_until_error)
    assert text == "The quick "
    assert isinstance(error, openai.APIError)
    assert "idle_timeout" in str(error)


@pytest.mark.parametrize("style", ["sync", "async"])
async def test_leaving_a_stream_early_cancels_upstream(nursery: trio.Nursery, style: str) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=1000)
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
    with trio.fail_after(DEADLINE):
        if style == "sync":

            def leave_early() -> float:
                with (
                    sync_client(proxy) as client,
                    client.chat.completions.create(
                        model="fake-model", messages=MESSAGES, stream=True
                    ) as stream,
                ):
                    for index, _ in enumerate(stream):
                        if index == 3:
                            break
                    closed_at = trio.from_thread.run_sync(trio.current_time)
                return closed_at

            closed_at = await trio.to_thread.run_sync(leave_early)
        else:
            async with openai.AsyncOpenAI(
                base_url=proxy.url + "/v1", api_key="unused", max_retries=0
            ) as client:
                stream = await client.chat.completions.create(
                    model="fake-model", messages=MESSAGES, stream=True
                )
                async with stream:
                    index = 0
                    async for _ in stream:
                        index += 1
                        if index == 3:
                            break
                    closed_at = trio.current_time()
        await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
        # The SDK closes its response when the `with` block exits: the upstream sees it.
        assert fake.recorder.last().disconnected_at - closed_at < 0.1
        await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.cancelled == 1
