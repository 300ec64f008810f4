"""One request pipeline for every transport: the key's limits, the stall limit, the access log,
outcomes and shutdown hold the same over HTTP (SSE and JSON) and over the WebSocket.

Real sockets on 127.0.0.1, port 0; ``sluice serve`` as a real process where SIGTERM is tested.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from proxy.api.pipeline import RequestPipeline
from proxy.ops.logs import ACCESS_LOGGER
from tests.api.test_auth import SECRET, bearer, key_table
from tests.api.test_websocket import answer, chat, receive, ws_url
from tests.contracts.test_drain import start_sluice, stop
from tests.ops.test_access_log import lines
from tests.support import (
    DEADLINE,
    Proxy,
    RawClient,
    chat_body,
    connect_client,
    read_request_head,
    start_fake,
    start_proxy,
)

CHAT = "/v1/chat/completions"
AUTH = [(b"Authorization", f"Bearer {SECRET}".encode())]


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    return caplog


async def first_event(response: httpx.Response) -> None:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            return


# ---------------------------------------------------------------- limits across transports


async def test_ws_refused_by_concurrency_while_an_http_stream_of_the_key_runs_and_back(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.02, tokens=100_000)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, keys=[key_table(max_concurrent_streams=1)]
        )
        async with (
            httpx.AsyncClient(timeout=10, trust_env=False) as client,
            open_websocket_url(ws_url(proxy), extra_headers=AUTH) as ws,
        ):
            async with client.stream(
                "POST", proxy.url + CHAT, json=chat_body(), headers=bearer()
            ) as stream:
                await first_event(stream)
                await ws.send_message(chat())
                refused = await receive(ws)
                assert refused["type"] == "error", refused
                assert refused["status"] == 429
                assert refused["error"]["code"] == "concurrency_limit_exceeded"
            await proxy.state.tracker.wait_idle()
            # The socket stays usable, and now the WebSocket holds the key's one stream.
            await ws.send_message(chat(fake={"tokens": 100_000}))
            assert (await receive(ws))["type"] == "token"
            assert proxy.state.keys.streams("alice") == 1
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer())
            assert response.status_code == 429
            assert response.json()["error"]["code"] == "concurrency_limit_exceeded"
            await ws.send_message(json.dumps({"type": "cancel"}))
            _, final = await answer(ws)
            assert final["type"] == "cancelled"
        await proxy.state.tracker.wait_idle()
        assert proxy.state.keys.streams("alice") == 0
    ws_lines = [line for line in lines(access) if line["method"] == "WS"]
    assert [line["outcome"] for line in ws_lines] == [
        "concurrency_limit_exceeded",
        "cancelled(mid_stream)",
    ]
    assert {line["key"] for line in ws_lines} == {"alice"}


async def test_requests_per_minute_are_counted_across_http_and_ws(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, keys=[key_table(requests_per_minute=3)]
        )
        url = proxy.url + CHAT
        async with (
            httpx.AsyncClient(timeout=10, trust_env=False) as client,
            open_websocket_url(ws_url(proxy), extra_headers=AUTH) as ws,
        ):
            for _ in range(2):
                ok = await client.post(url, json=chat_body(stream=False), headers=bearer())
                assert ok.status_code == 200
            await ws.send_message(chat())
            _, final = await answer(ws)
            assert final["type"] == "done"
            await ws.send_message(chat())
            refused = await receive(ws)
            assert (refused["type"], refused["status"]) == ("error", 429)
            assert refused["error"]["code"] == "rate_limit_exceeded"
            again = await client.post(url, json=chat_body(stream=False), headers=bearer())
            assert again.status_code == 429
            assert int(again.headers["Retry-After"]) >= 1
        # Every WebSocket request is in the metrics, like HTTP's, under its key.
        requests = proxy.state.metrics.requests
        assert requests.labels("fake-model", "200", "chat", "alice")._value.get() == 3
        assert requests.labels("fake-model", "429", "chat", "alice")._value.get() == 2


async def test_ws_without_a_valid_key_is_refused_with_401_and_logged(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table()])
        async with open_websocket_url(ws_url(proxy)) as ws:
            refused = await receive(ws)
            assert (refused["type"], refused["status"]) == ("error", 401)
            assert refused["error"]["code"] == "invalid_api_key"
    (line,) = [line for line in lines(access) if line["method"] == "WS"]
    assert (line["status"], line["outcome"]) == (401, "invalid_api_key")


# ---------------------------------------------------------------- every credential form


def credentials(authorization: str | None = None, api_key: str | None = None) -> list[Any]:
    """Handshake headers: an ``Authorization: Bearer``, an ``x-api-key``, both or neither."""
    headers = []
    if authorization is not None:
        headers.append((b"Authorization", f"Bearer {authorization}".encode()))
    if api_key is not None:
        headers.append((b"x-api-key", api_key.encode()))
    return headers


async def ws_refusal(proxy: Proxy, headers: list[Any]) -> dict[str, Any]:
    """What a WebSocket client that sends these handshake headers is told at once: a refusal
    (the socket is then closed, so nothing is sent on it)."""
    async with open_websocket_url(ws_url(proxy), extra_headers=headers) as ws:
        return await receive(ws)


async def ws_first_token(proxy: Proxy, headers: list[Any]) -> dict[str, Any]:
    async with open_websocket_url(ws_url(proxy), extra_headers=headers) as ws:
        await ws.send_message(chat())
        return await receive(ws)


async def test_ws_authenticates_with_x_api_key(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table()])
        async with open_websocket_url(
            ws_url(proxy), extra_headers=credentials(api_key=SECRET)
        ) as ws:
            await ws.send_message(chat())
            text, final = await answer(ws)
            assert (text, final["type"]) == ("The quick ", "done"), final
    (line,) = [line for line in lines(access) if line["method"] == "WS"]
    assert (line["status"], line["outcome"], line["key"]) == (200, "completed", "alice")
    # Checked, and as Authorization never forwarded.
    (record,) = fake.recorder.records
    assert SECRET not in json.dumps(dict(record.headers))


async def test_a_wrong_x_api_key_is_refused_as_a_wrong_bearer_is(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table()])
        as_bearer = await ws_refusal(proxy, credentials(authorization="sk-wrong"))
        as_api_key = await ws_refusal(proxy, credentials(api_key="sk-wrong"))
        assert (as_api_key["type"], as_api_key["status"]) == ("error", 401)
        assert as_api_key["error"] == as_bearer["error"]
        assert as_api_key["error"]["code"] == "invalid_api_key"
        # Over HTTP, the same refusal for either form.
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for headers in ({"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
                response = await client.post(proxy.url + CHAT, json=chat_body(), headers=headers)
                assert response.status_code == 401
                assert response.json()["error"] == as_bearer["error"]
    assert fake.recorder.records == []
    ws_lines = [line for line in lines(access) if line["method"] == "WS"]
    assert [(line["status"], line["outcome"]) for line in ws_lines] == [
        (401, "invalid_api_key")
    ] * 2


async def test_authorization_wins_over_x_api_key_on_every_transport(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table()])
        wrong_bearer = credentials(authorization="sk-wrong", api_key=SECRET)
        right_bearer = credentials(authorization=SECRET, api_key="sk-wrong")
        refused = await ws_refusal(proxy, wrong_bearer)
        assert (refused["type"], refused["status"]) == ("error", 401)
        assert (await ws_first_token(proxy, right_bearer))["type"] == "token"
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            statuses = []
            for pairs in (wrong_bearer, right_bearer):
                headers = [(name.decode(), value.decode()) for name, value in pairs]
                response = await client.post(
                    proxy.url + CHAT, json=chat_body(stream=False), headers=headers
                )
                statuses.append(response.status_code)
        assert statuses == [401, 200]


async def test_the_pipeline_reads_every_credential_form() -> None:
    from werkzeug.datastructures import Headers

    from proxy.api.auth import KeyRing
    from proxy.config import config_from_mapping
    from proxy.ops.metrics import Metrics
    from proxy.protocol.errors import ApiError
    from proxy.relay.body import RelayTracker

    config = config_from_mapping(
        {"keys": [key_table()], "models": {"m": {"upstreams": ["http://127.0.0.1:9"]}}},
        "test",
        env={},
    )
    metrics = Metrics()
    keys = KeyRing(config.keys, config.limits, metrics)
    pipeline = RequestPipeline(config, keys, metrics, RelayTracker(metrics), {}, {})

    async def key_of(**headers: str) -> str | None:
        access = pipeline.begin("POST", CHAT, "-", None)
        found = await pipeline.authenticate(Headers(headers.items()), access)
        assert found is not None and access.key == found.name
        return found.name

    async def code_of(**headers: str) -> str | None:
        with pytest.raises(ApiError) as refused:
            await pipeline.authenticate(
                Headers(headers.items()), pipeline.begin("WS", "/v1/ws", "-", None)
            )
        assert refused.value.status == 401
        return refused.value.code

    assert await key_of(Authorization=f"Bearer {SECRET}") == "alice"
    assert await key_of(**{"x-api-key": SECRET}) == "alice"
    assert await key_of(**{"X-Api-Key": SECRET}) == "alice"  # header names: any case
    assert await key_of(Authorization=f"Bearer {SECRET}", **{"x-api-key": "sk-wrong"}) == "alice"
    wrong_bearer = {"Authorization": "Bearer sk-wrong", "x-api-key": SECRET}
    assert await code_of(**wrong_bearer) == "invalid_api_key"
    assert await code_of(**{"x-api-key": "sk-wrong"}) == "invalid_api_key"
    assert await code_of() == "invalid_api_key"
    # No [[keys]]: no authentication, whatever is sent.
    open_config = config_from_mapping(
        {"models": {"m": {"upstreams": ["http://127.0.0.1:9"]}}}, "test", env={}
    )
    unkeyed = RequestPipeline(open_config, KeyRing([]), metrics, RelayTracker(metrics), {}, {})
    assert await unkeyed.authenticate(Headers(), unkeyed.begin("WS", "/v1/ws", "-", None)) is None


# ---------------------------------------------------------------- what the WebSocket is sent


async def serve_events(events: list[bytes], task_status: trio.TaskStatus[str]) -> None:
    """An OpenAI-compatible upstream that answers every request with these SSE events."""

    async def handle(stream: trio.SocketStream) -> None:
        received = await read_request_head(stream)
        if received is None:
            return
        head, _, body = received.partition(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":", 1)[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
        )
        while len(body) < length:
            body += await stream.receive_some(65536)
        payload = b"".join(b"data: " + event + b"\n\n" for event in events)
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%b" % (len(payload), payload)
        )
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        task_status.started(f"http://127.0.0.1:{port}")


GOOD = json.dumps(
    {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}
).encode()


@pytest.mark.parametrize("odd", [b"5", b"[]", b'"text"', b'{"choices": 7}'])
async def test_a_non_object_upstream_event_is_an_error_message_and_the_socket_lives(
    nursery: trio.Nursery, odd: bytes
) -> None:
    with trio.fail_after(DEADLINE):
        odd_url = await nursery.start(serve_events, [odd, GOOD, b"[DONE]"])
        good_url = await nursery.start(serve_events, [GOOD, b"[DONE]"])
        proxy = await start_proxy(nursery, {"odd": [odd_url], "good": [good_url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(chat("odd"))
            _, final = await answer(ws)
            assert final["type"] == "error", final
            assert final["error"]["code"] == "upstream_protocol_error"
            await ws.send_message(chat("good"))
            text, final = await answer(ws)
            assert (text, final["type"]) == ("ok", "done")
        await proxy.state.tracker.wait_idle()
        # Over HTTP the same events pass through as the upstream sent them.
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body("odd"))
        assert response.status_code == 200
        assert b"data: " + odd + b"\n\n" in response.content


async def test_one_parser_for_bodies_and_messages(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"max_body_bytes": 300_000}
        )
        long_number = b'{"model": "fake-model", "messages": [], "seed": ' + b"9" * 5000 + b"}"
        deep = b'{"model": "fake-model", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        not_utf8 = b'{"model": "fake-\xff"}'
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            for raw in (long_number, deep, not_utf8):
                response = await client.post(
                    proxy.url + CHAT, content=raw, headers={"Content-Type": "application/json"}
                )
                assert response.status_code == 400, response.text
                assert response.json()["error"]["code"] == "invalid_json"
                # What is wrong with the request, not advice for the server's code.
                assert "set_int_max_str_digits" not in response.text
            too_long = await client.post(
                proxy.url + CHAT, content=long_number, headers={"Content-Type": "application/json"}
            )
            assert "an integer with more than 4300 digits" in too_long.json()["error"]["message"]
        async with open_websocket_url(ws_url(proxy)) as ws:
            for raw in (long_number, deep, not_utf8):
                await ws.send_message(raw)
                refused = await receive(ws)
                assert (refused["type"], refused["status"]) == ("error", 400), refused
                assert refused["error"]["code"] == "invalid_json"
            await ws.send_message(chat())
            text, final = await answer(ws)
            assert (text, final["type"]) == ("The quick ", "done")
        # One size limit: a message over max_body_bytes closes the socket (1009, too big).
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(b"x" * 400_000)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009
            # trio-websocket leaves its TCP stream open after the server's close; closed here.
            await ws._stream.aclose()


# ---------------------------------------------------------------- stalls and shutdown


async def test_a_non_streamed_answer_to_a_client_that_never_reads_is_cut(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=1_500_000)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, relay={"stall_timeout": 1.0})
        raw = await RawClient.post(proxy, CHAT, chat_body(stream=False), rcvbuf=4096)
        await proxy.state.tracker.wait_until(lambda tracker: tracker.started == 1)
        started = trio.current_time()
        await proxy.state.tracker.wait_idle()
        cut_after = trio.current_time() - started
        assert proxy.state.tracker.stalled == 1
        assert cut_after < 1.0 + 2.0  # the stall limit, plus reading the upstream's answer
        with pytest.raises((trio.BrokenResourceError, EOFError)):
            await raw.read_until(b"never-in-the-answer")
    (line,) = lines(access)
    assert line["outcome"] == "stalled"


async def test_a_complete_non_streamed_answer_then_a_close_is_completed(
    nursery: trio.Nursery, access: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=3)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        payload = json.dumps(chat_body(stream=False)).encode()
        host, port = proxy.host_port
        for connection in (b"Connection: close\r\n", b""):
            for _ in range(3):
                stream = await connect_client(proxy)
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\n%b"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                    % (host.encode(), port, connection, len(payload), payload)
                )
                received = b""
                while b"\r\n\r\n" not in received:
                    received += await stream.receive_some(65536)
                head, _, body = received.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += await stream.receive_some(65536)
                assert json.loads(body)["choices"][0]["message"]["content"]
                # As curl does: the answer is complete, the client closes at once.
                await stream.aclose()
            await proxy.state.tracker.wait_idle()
        assert proxy.state.tracker.cancelled == 0
    outcomes = [line["outcome"] for line in lines(access)]
    assert outcomes == ["completed"] * 6


def sluice_config(tmp_path: Path, upstream: str, **relay: float) -> Path:
    config = tmp_path / "sluice.toml"
    relay_lines = "".join(f"{name} = {value}\n" for name, value in relay.items())
    config.write_text(
        "[server]\nport = 0\ngraceful_timeout = 2\ndrain_delay = 0\n"
        f"[relay]\n{relay_lines}"
        f'[models.fake-model]\nupstreams = ["{upstream}"]\n'
    )
    return config


async def raw_websocket(url: str, first_message: str) -> trio.SocketStream:
    """A WebSocket client that sends one message and then never reads (a tiny receive buffer),
    spoken with wsproto by hand so that nothing reads on its behalf."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    connection = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(connection.send(Request(host=f"{host}:{port}", target="/v1/ws")))
    accepted = False
    while not accepted:
        connection.receive_data(await stream.receive_some(65536))
        accepted = any(isinstance(event, AcceptConnection) for event in connection.events())
    await stream.send_all(connection.send(TextMessage(data=first_message)))
    return stream


async def stalled_client(url: str, transport: str) -> trio.SocketStream:
    """A client of ``url`` (a real sluice serve) that asks for a long answer, then never reads."""
    if transport == "websocket":
        return await raw_websocket(url, chat(fake={"tokens": 1_500_000}))
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    client = trio.SocketStream(sock)
    payload = json.dumps(chat_body(stream=transport == "sse")).encode()
    await client.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    return client


@pytest.mark.parametrize(
    ("transport", "signals"),
    [("websocket", 1), ("json", 1), ("sse", 1), ("json", 2)],
    ids=["websocket", "json", "sse", "json-second-signal"],
)
async def test_sigterm_exits_in_time_whatever_a_stalled_client_does(
    nursery: trio.Nursery, tmp_path: Path, transport: str, signals: int
) -> None:
    # One signal: the graceful timeout bounds the exit. Two: the second one ends it at once,
    # however long the graceful timeout is.
    graceful = 2.0 if signals == 1 else 60.0
    fake = await start_fake(nursery, ttft=0, interval=0, tokens=1_500_000)
    # The stall limit is far away: only the shutdown's own bound can end this in time.
    config = sluice_config(tmp_path, fake.url, stall_timeout=60)
    config.write_text(
        config.read_text().replace("graceful_timeout = 2", f"graceful_timeout = {graceful}")
    )
    with trio.fail_after(30):
        process, url = await start_sluice(config)
        client: trio.SocketStream | None = None
        try:
            client = await stalled_client(url, transport)
            await fake.recorder.wait_for(lambda r: r.records and r.last().tokens_sent > 0)
            # The proxy's write is stuck by now: buffers fill in milliseconds at interval 0.
            await trio.sleep(1.0)
            assert fake.recorder.last().disconnected_at is None  # still held, not cut
            process.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            if signals == 2:
                await trio.sleep(0.5)
                process.send_signal(signal.SIGTERM)
            await process.wait()
            took = trio.current_time() - signalled
            assert process.returncode == 0
            assert took < (graceful if signals == 1 else 0.5) + 1.0, took
        finally:
            if client is not None:
                await client.aclose()
            await stop(process)


# ---------------------------------------------------------------- errors inside a generation


async def test_a_bug_in_a_websocket_generation_is_its_error_not_a_closed_socket(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from proxy.api import ws as ws_module

    original = ws_module.Translator.messages
    calls = 0

    def failing_once(self: ws_module.Translator, chunk: bytes) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the translator")
        return original(self, chunk)

    monkeypatch.setattr(ws_module.Translator, "messages", failing_once)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=2)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with open_websocket_url(ws_url(proxy)) as ws:
            await ws.send_message(chat())
            _, final = await answer(ws)
            assert (final["type"], final["status"]) == ("error", 500)
            assert final["error"]["code"] == "internal_error"
            await ws.send_message(chat())
            text, final = await answer(ws)
            assert (text, final["type"]) == ("The quick ", "done")
        await proxy.state.tracker.wait_idle()
    assert "websocket generation failed" in caplog.text
