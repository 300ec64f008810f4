"""/v1/ws: full answers, cancel-and-continue, close cancels, bad input, backpressure."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from tests.support import (
    DEADLINE,
    Proxy,
    slowed,
    start_fake,
    start_proxy,
    wait_until_steady,
)


def ws_url(proxy: Proxy) -> str:
    return proxy.url.replace("http://", "ws://") + "/v1/ws"


def chat(model: str = "fake-model", **extra: Any) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], **extra})


async def receive(ws: WebSocketConnection) -> dict[str, Any]:
    message = json.loads(await ws.get_message())
    assert isinstance(message, dict)
    return message


async def answer(ws: WebSocketConnection) -> tuple[str, dict[str, Any]]:
    """Read token messages until the final one (done, error or cancelled)."""
    text = ""
    while True:
        message = await receive(ws)
        if message["type"] != "token":
            return text, message
        text += message["content"]


async def test_full_answer_with_usage(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=4)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(chat())
            text, final = await answer(ws)
            assert text == "The quick brown fox "
            assert final["type"] == "done", final
            assert final["finish_reason"] == "stop"
            assert final["usage"]["completion_tokens"] == 4
            # The same socket serves the next request.
            await ws.send_message(chat(max_tokens=2))
            text, final = await answer(ws)
            assert (text, final["finish_reason"]) == ("The quick ", "length")


async def test_cancel_mid_stream_then_a_second_request(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=1000)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(chat())
            for _ in range(3):
                assert (await receive(ws))["type"] == "token"
            cancelled_at = trio.current_time()
            await ws.send_message(json.dumps({"type": "cancel"}))
            _, final = await answer(ws)
            assert final["type"] == "cancelled"
            await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
            assert fake.recorder.last().disconnected_at - cancelled_at < 0.05
            await ws.send_message(chat(fake={"tokens": 2}))
            text, final = await answer(ws)
            assert (text, final["type"]) == ("The quick ", "done")


async def test_closing_the_socket_cancels(nursery: trio.Nursery, tiny_loaded_model: Any) -> None:
    step = 0.05
    loaded = slowed(tiny_loaded_model, step)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=1000)
        proxy = await start_proxy(
            nursery,
            {
                "fake-model": [fake.url],
                "tiny": {"backend": "local", "path": "preloaded", "default_temperature": 0.0},
            },
            local_models={"tiny": loaded},
        )
        backend = proxy.state.local_backends["tiny"]
        for model in ("fake-model", "tiny"):
            async with open_websocket_url(ws_url(proxy)) as ws:
                await ws.send_message(chat(model, max_tokens=400))
                for _ in range(3):
                    assert (await receive(ws))["type"] == "token"
            closed_at = trio.current_time()
            if model == "fake-model":
                await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
                assert fake.recorder.last().disconnected_at - closed_at < 0.05
            else:
                await backend.admission.wait_free()
                assert trio.current_time() - closed_at < step + 0.1
                assert backend.active_generations == 0


async def test_bad_input_gets_an_error_and_the_socket_stays_usable(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            cases = [
                ("{not json", "invalid_json"),
                (json.dumps({"messages": []}), "invalid_request"),
                (chat("no-such-model"), "model_not_found"),
            ]
            for text, code in cases:
                await ws.send_message(text)
                message = await receive(ws)
                assert message["type"] == "error"
                assert message["error"]["code"] == code
                assert set(message["error"]) >= {"message", "type", "code"}
            await ws.send_message(chat())
            text, final = await answer(ws)
            assert (text, final["type"]) == ("The quick ", "done")


async def test_a_second_request_while_one_runs_is_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        # A first answer far longer than the test (it is cancelled at the end): however slow
        # the machine, the second request comes while it runs.
        fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=100_000)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(chat())
            running = await receive(ws)
            assert running["type"] == "token"
            await ws.send_message(chat())
            while (message := await receive(ws))["type"] == "token":
                pass
            assert message["type"] == "error"
            assert message["error"]["code"] == "request_in_progress"
            # The refused message is a request of its own, with its own id.
            assert message["id"] and message["id"] != running["id"]
            # The first runs on, untouched by the refusal, until it is cancelled.
            assert (await receive(ws))["type"] == "token"
            await ws.send_message(json.dumps({"type": "cancel"}))
            _, final = await answer(ws)
            assert (final["type"], final["id"]) == ("cancelled", running["id"])


async def test_slow_websocket_reader_pauses_upstream_then_is_cut(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=200_000, sndbuf=4096)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            relay={"channel_capacity": 4, "stall_timeout": 1.0},
            upstream={"socket_rcvbuf": 4096},
        )
        # message_queue_size=1: the client stops reading its socket once one message waits.
        async with open_websocket_url(ws_url(proxy), message_queue_size=1) as ws:
            await ws.send_message(chat())
            await fake.recorder.wait_for(lambda r: r.records and r.last().tokens_sent > 0)
            sent = await wait_until_steady(lambda: int(fake.recorder.last().tokens_sent))
            assert sent[-1] < 200_000 // 4, sent  # paused long before the end
            await fake.recorder.wait_for(lambda r: r.last().disconnected_at is not None)
            assert fake.recorder.last().outcome == "client_disconnected"
            await proxy.state.tracker.wait_idle()
            assert proxy.state.tracker.stalled == 1
            # Reading again, the client finds its connection dropped after what was in flight.
            with pytest.raises(ConnectionClosed):
                while True:
                    await ws.get_message()
            # trio-websocket leaves its TCP stream open after a reset (its _abort_web_socket
            # skips the close); closed here so that the socket is not left to the GC.
            await ws._stream.aclose()


async def test_the_docs_client_example_runs(nursery: trio.Nursery) -> None:
    """The WebSocket client of docs/api.md, as a user would copy it (its URL changed)."""
    page = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    section = page.split("## WebSocket", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
        proxy = await start_proxy(nursery, {"smollm2": [fake.url]})
        code = code.replace("ws://127.0.0.1:8080/v1/ws", ws_url(proxy))
        done = await trio.run_process(
            [sys.executable, "-c", code], capture_stdout=True, capture_stderr=True, check=False
        )
    assert done.returncode == 0, done.stderr.decode()
    out = done.stdout.decode()
    assert out.startswith("The quick brown ")
    assert "'type': 'done'" in out and "'finish_reason': 'stop'" in out
