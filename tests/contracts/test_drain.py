"""The drain contract: a server that is told to stop stops taking work, lets what is in flight
finish within its deadline, cancels the rest as a client leaving would, and exits; on a real
`sluice serve` process, with its worker processes.

SIGTERM: /readyz turns 503 at once; after drain_delay the listeners close; streams that finish
within graceful_timeout finish; the rest are cancelled (their upstream connections closed) and
the process exits 0. Every client is told: a stream still running as the grace ends gets an
in-band ``shutting_down`` error before the cut, and a queued request that cannot start in time a
503 with ``Retry-After``; paused streams go first, and nothing is paused during the drain.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.api.test_websocket import answer, ws_url
from tests.support import (
    DEADLINE,
    RawClient,
    chat_body,
    local_model,
    shutdown_trigger,
    slowed,
    sse_payloads,
    start_fake,
    start_proxy,
    start_sluice,
    stop,
)

# At the server seam: each contract holds whichever server reads the request.
pytestmark = pytest.mark.usefixtures("each_server_path")

CHAT = "/v1/chat/completions"


async def test_sigterm_drains_then_cancels_the_rest(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=1000)
    config = tmp_path / "drain.toml"
    config.write_text(
        "[server]\nport = 0\ngraceful_timeout = 1.5\ndrain_delay = 0.5\n"
        f'[models.fake-model]\nupstreams = ["{fake.url}"]\n'
    )
    with trio.fail_after(30):
        process, url = await start_sluice(config)
        try:
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                assert (await client.get(url + "/readyz")).status_code == 200
                results: dict[str, str] = {}

                async def stream(name: str, tokens: int) -> None:
                    body = chat_body(fake={"tokens": tokens})
                    text = ""
                    try:
                        async with client.stream("POST", url + CHAT, json=body) as response:
                            async for chunk in response.aiter_text():
                                text += chunk
                    except httpx.RemoteProtocolError:
                        text += "<cut>"  # a cancelled stream ends without its last chunk
                    results[name] = text

                async with trio.open_nursery() as streams:
                    # 0.5 s of tokens: ends within the grace period. 50 s: cannot.
                    streams.start_soon(stream, "short", 10)
                    streams.start_soon(stream, "long", 1000)
                    await fake.recorder.wait_for(lambda r: len(r.records) == 2)
                    signalled_at = trio.current_time()
                    process.send_signal(signal.SIGTERM)
                    await trio.sleep(0.2)
                    # Draining: not ready, though still accepting for drain_delay.
                    ready = await client.get(url + "/readyz")
                    assert ready.status_code == 503
                    assert ready.json() == {"ready": False, "draining": True}
                assert await process.wait() == 0
                exited_after = trio.current_time() - signalled_at
            assert sse_payloads(results["short"])[-1] == "[DONE]"
            # Told before the cut: an in-band error, and the stream's end (no [DONE]).
            assert not results["long"].endswith("<cut>")
            long_payloads = sse_payloads(results["long"])
            assert "[DONE]" not in long_payloads
            assert 5 < len(long_payloads) < 1000
            assert json.loads(long_payloads[-1])["error"]["code"] == "shutting_down"
            # drain_delay + graceful_timeout, then the long stream's upstream was closed.
            long_record = next(r for r in fake.recorder.records if r.tokens_sent > 10)
            await fake.recorder.wait_for(lambda r: long_record.disconnected_at is not None)
            assert long_record.disconnected_at - signalled_at < 0.5 + 1.5 + 1.0
            assert exited_after < 0.5 + 1.5 + 3.0
        finally:
            await stop(process)


async def test_workers_share_the_port(tmp_path: Path) -> None:
    config = tmp_path / "workers.toml"
    config.write_text(
        "[server]\nport = 0\n[fake_upstream]\nenabled = true\nttft = 0\ninterval = 0\n"
        'tokens = 3\n[models.fake-model]\nupstreams = ["fake:"]\n'
    )
    with trio.fail_after(60):
        process, url = await start_sluice(config, "--workers", "2")
        try:
            pids: set[int] = set()
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                while len(pids) < 2:
                    # A fresh connection each time, so the kernel may pick either worker.
                    health = await client.get(url + "/healthz", headers={"Connection": "close"})
                    pids.add(health.json()["pid"])
                    if len(pids) < 2:
                        await trio.sleep(0.05)
                response = await client.post(url + CHAT, json=chat_body())
                assert sse_payloads(response.text)[-1] == "[DONE]"
            assert process.pid not in pids and os.getpid() not in pids
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await stop(process)


async def test_sigterm_with_queued_paused_and_running_requests_tells_every_client(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Two slots held by batch streams (band 5), an urgent stream that paused one of them,
    # three requests queued behind: SIGTERM with a 3 s grace. Each ends with a whole answer, a
    # 503 with Retry-After, or an in-band shutting_down error; the process exits in the grace.
    fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=1000)
    config = tmp_path / "drain.toml"
    config.write_text(
        "[server]\nport = 0\ngraceful_timeout = 3.0\n"
        "[scheduling]\npreempt_after = 0.5\n"
        f'[models.fake-model]\nupstreams = ["{fake.url}"]\nmax_connections = 2\n'
        "max_queue = 10\n"
    )
    batch = {"x-sluice-priority": "5"}
    with trio.fail_after(40):
        process, url = await start_sluice(config)
        try:
            async with httpx.AsyncClient(timeout=20, trust_env=False) as client:
                ends: dict[str, str] = {}

                async def stream(name: str, headers: dict[str, str]) -> None:
                    text = ""
                    try:
                        async with client.stream(
                            "POST", url + CHAT, json=chat_body(), headers=headers
                        ) as response:
                            if response.status_code != 200:
                                await response.aread()
                                error = response.json()["error"]
                                assert response.headers["retry-after"] == "1"
                                ends[name] = f"{response.status_code} {error['code']}"
                                return
                            async for chunk in response.aiter_text():
                                text += chunk
                    except httpx.RemoteProtocolError:
                        ends[name] = "cut"
                        return
                    payloads = sse_payloads(text)
                    if payloads[-1] == "[DONE]":
                        ends[name] = "whole"
                    else:
                        ends[name] = "in-band " + json.loads(payloads[-1])["error"]["code"]

                async with trio.open_nursery() as clients:
                    for name in ("batch1", "batch2"):
                        clients.start_soon(stream, name, batch)
                    await fake.recorder.wait_for(lambda r: len(r.records) == 2)
                    clients.start_soon(stream, "urgent", {})
                    # The urgent stream pauses a batch stream and takes its slot.
                    await fake.recorder.wait_for(lambda r: len(r.records) == 3)
                    for name in ("queued1", "queued2", "queued3"):
                        clients.start_soon(stream, name, batch)
                    await trio.sleep(0.3)
                    signalled_at = trio.current_time()
                    process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
                exited_after = trio.current_time() - signalled_at
            assert exited_after < 3.0 + 1.0, exited_after
            assert "cut" not in ends.values(), ends
            assert ends["urgent"] == "in-band shutting_down"
            assert {ends["batch1"], ends["batch2"]} == {"in-band shutting_down"}
            for name in ("queued1", "queued2", "queued3"):
                assert ends[name] == "503 shutting_down", ends
            # Nothing was paused during the drain: three upstream requests in all (the paused
            # batch stream was not resumed, since no slot was free before the grace ended).
            assert len(fake.recorder.records) == 3
        finally:
            await stop(process)


async def test_a_local_stream_still_running_as_the_grace_ends_is_told_in_band(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, tiny_loaded_model: Any
) -> None:
    # What a new user sees on Ctrl-C during the chat page's answer: an error event, not a cut.
    shutdown = shutdown_trigger(monkeypatch)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"tiny": local_model()},
            local_models={"tiny": slowed(tiny_loaded_model, step_seconds=0.02)},
            server={"graceful_timeout": 1.0},
        )
        body = chat_body("tiny", ignore_eos=True)
        raw = await RawClient.post(proxy, "/v1/chat/completions", body)
        await raw.read_until(b"data: ", count=3)
        shutdown.set()
        told_at = trio.current_time()
        await raw.read_until(b"shutting_down")
        await raw.read_until(b"\r\n0\r\n\r\n")  # the stream's end, not a cut
        await proxy.state.tracker.wait_idle()
        assert trio.current_time() - told_at < 1.0
    assert b"[DONE]" not in raw.received


async def test_a_websocket_answer_still_running_as_the_grace_ends_is_told(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutdown = shutdown_trigger(monkeypatch)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=1000)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"graceful_timeout": 1.0}
        )
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(
                json.dumps(
                    {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
                )
            )
            await fake.recorder.wait_for(lambda r: len(r.records) == 1)
            shutdown.set()
            text, final = await answer(ws)
        await proxy.state.tracker.wait_idle()
    assert text
    assert final["type"] == "error", final
    assert "shutting_down" in json.dumps(final)
