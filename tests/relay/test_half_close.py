"""A client that half-closes (``shutdown(SHUT_WR)``) and reads on, on both server paths, at the
two moments the cancellation sweep found wrong: after the stream's last event while the
producer still tidies up, and after the producer is done but before the answer is written.
Either way the answer is all decided, so the client gets all of it, the chunked terminator
included (RFC 9112 7.1: without it a body cannot be told from a cut one), and the access line
says it ended as it did; before, the first was logged ``cancelled(mid_stream)``, and the
second cut (the fast path) or failed writing its head (``RuntimeError ... (SEND_RESPONSE)``,
under hypercorn), while the line said ``completed``.

Each test holds Sluice at the moment (a gate), half-closes, gives the proxy time to hear it,
then lets it go on."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from proxy.backends.upstream.exchange import UpstreamExchange
from proxy.bench.sweep.answers import answered, tokens_received
from proxy.ops.logs import ACCESS_LOGGER
from proxy.server import writer
from tests.support import DEADLINE, Fake, access_lines, chat_body, connect_client, start_proxy

SERVER_PATHS = [pytest.param(True, id="fast_path"), pytest.param(False, id="hypercorn")]
# Long enough for either path to hear the FIN (the hangup watcher polls every millisecond).
HEARD = 0.05


async def half_close_at(
    nursery: trio.Nursery,
    fake: Fake,
    gate: trio.Event,
    reached: trio.Event,
    body: dict[str, Any],
    fast_path: bool,
    ready: Callable[[bytes], bool],
) -> bytes:
    """Send ``body``; once ``reached`` (Sluice is at the gate) and the client holds what
    ``ready`` wants, half-close, wait, open the gate, and read to the end."""
    proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, server={"fast_path": fast_path})
    host, port = proxy.host_port
    payload = json.dumps(body).encode()
    received = b""
    async with await connect_client(proxy) as stream:
        await stream.send_all(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await reached.wait()
        while not ready(received):
            received += await stream.receive_some(65536)
        await stream.send_eof()
        await trio.sleep(HEARD)
        gate.set()
        while data := await stream.receive_some(65536):
            received += data
    await proxy.state.tracker.wait_idle()
    return received


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
async def test_a_half_close_after_the_last_event_cancels_nothing(
    nursery: trio.Nursery,
    fake: Fake,
    fast_path: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    gate, reached = trio.Event(), trio.Event()
    relay_stream = UpstreamExchange._relay_stream

    async def then_wait(*args: Any, **kwargs: Any) -> None:
        await relay_stream(*args, **kwargs)
        reached.set()  # the last event is handed on; the producer has yet to unwind
        await gate.wait()

    monkeypatch.setattr(UpstreamExchange, "_relay_stream", then_wait)
    with trio.fail_after(DEADLINE):
        received = await half_close_at(
            nursery, fake, gate, reached, chat_body(), fast_path, lambda got: b"[DONE]" in got
        )
    assert received.endswith(b"\r\n0\r\n\r\n"), received[-40:]
    assert answered("chat", True, received)
    (line,) = access_lines(caplog)
    assert line["outcome"] == "completed", line
    sent = tokens_received("chat", True, received)
    assert (line["output_tokens"], line["for_nobody_tokens"]) == (sent, 0)


@pytest.mark.parametrize("fast_path", SERVER_PATHS)
@pytest.mark.parametrize("fault", [None, {"mode": "status", "status": 503}])
async def test_a_half_close_once_the_producer_is_done_gets_the_whole_answer(
    nursery: trio.Nursery,
    fake: Fake,
    fast_path: bool,
    fault: dict[str, Any] | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A whole JSON answer, or an error's: decided, not yet written, when the client
    half-closes."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    gate, reached = trio.Event(), trio.Event()
    push: Callable[..., Awaitable[None]] = writer._HeldBack.push

    async def held(self: Any, wire: Any, chunk: bytes) -> None:
        reached.set()
        await gate.wait()
        await push(self, wire, chunk)

    monkeypatch.setattr(writer._HeldBack, "push", held)
    extra: dict[str, Any] = {} if fault is None else {"fake": fault}
    with trio.fail_after(DEADLINE):
        received = await half_close_at(
            nursery,
            fake,
            gate,
            reached,
            chat_body(stream=False, **extra),
            fast_path,
            lambda got: True,
        )
    assert answered("chat", False, received), received
    (line,) = access_lines(caplog)
    assert line["outcome"] == ("completed" if fault is None else "upstream_http_error"), line
    assert line["status"] == (200 if fault is None else 502)
