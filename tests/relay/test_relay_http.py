"""The relay over real sockets: endpoints, streaming shape, errors, retries, headers."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest
import trio

from proxy.ops.logs import ACCESS_LOGGER
from tests.support import (
    DEADLINE,
    Fake,
    Proxy,
    access_lines,
    chat_body,
    poll_until,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"


async def test_non_streaming_chat_and_completions(proxy: Proxy, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        response = await client.post(proxy.url + CHAT, json=chat_body(stream=False))
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        body = response.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == "The quick brown fox jumps "
        assert body["usage"]["completion_tokens"] == 5

        response = await client.post(
            proxy.url + "/v1/completions",
            json={"model": "fake-model", "prompt": "Once", "max_tokens": 3},
        )
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "The quick brown "


async def test_streaming_completions_with_usage(proxy: Proxy, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        response = await client.post(
            proxy.url + "/v1/completions",
            json={
                "model": "fake-model",
                "prompt": "Once upon",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert response.status_code == 200
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]"
        assert json.loads(payloads[-2])["usage"]["completion_tokens"] == 5
        assert stream_text(payloads) == "The quick brown fox jumps "


async def test_models_and_health(proxy: Proxy, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        models = (await client.get(proxy.url + "/v1/models")).json()
        assert [model["id"] for model in models["data"]] == ["fake-model"]
        health = await client.get(proxy.url + "/healthz")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"


def _error(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "code"}, body
    error = body["error"]
    assert isinstance(error, dict)
    return error


async def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"max_body_bytes": 2048}
        )
        url = proxy.url + CHAT
        cases: list[tuple[httpx.Response, int, str]] = [
            (await client.post(url, content=b"{not json"), 400, "invalid_json"),
            (await client.post(url, content=b"[1, 2]"), 400, "invalid_request"),
            (await client.post(url, json={"messages": []}), 400, "invalid_request"),
            (await client.post(url, json=chat_body(stream="yes")), 400, "invalid_request"),
            (await client.post(url, json=chat_body(max_tokens=-1)), 400, "invalid_request"),
            (await client.post(url, json=chat_body("no-such-model")), 404, "model_not_found"),
            (
                await client.post(url, json=chat_body(padding="x" * 4096)),
                413,
                "request_too_large",
            ),
            (await client.get(url), 405, "method_not_allowed"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            assert _error(response)["code"] == code
        assert _error(cases[2][0])["param"] == "model"
        # Nothing above reached the upstream, and the server still serves.
        assert fake.recorder.records == []
        response = await client.post(url, json=chat_body(stream=False))
        assert response.status_code == 200


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_upstream_refused_is_502(nursery: trio.Nursery, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"m": [f"http://127.0.0.1:{_closed_port()}"]})
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 502
        assert _error(response)["code"] == "upstream_connect_error"


async def test_upstream_connect_timeout_is_504(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    # A listener that never accepts, with its backlog full: the kernel drops further SYNs, so
    # connecting hangs exactly like an unreachable host, without leaving loopback.
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler.connect(listener.getsockname())
        port = listener.getsockname()[1]
        with trio.fail_after(DEADLINE):
            proxy = await start_proxy(
                nursery,
                {"m": {"upstreams": [f"http://127.0.0.1:{port}"], "connect_timeout": 0.3}},
            )
            response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 504
        assert _error(response)["code"] == "upstream_connect_timeout"


async def test_first_token_timeout_is_504(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": {"upstreams": [fake.url], "first_token_timeout": 0.2}}
        )
        response = await client.post(proxy.url + CHAT, json=chat_body(fake={"ttft": 5}))
        assert response.status_code == 504
        assert _error(response)["code"] == "upstream_first_token_timeout"
        record = fake.recorder.last()
        assert record.disconnected_at is not None  # the proxy hung up on the slow upstream


async def test_total_timeout(nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        # The streamed answer's first byte must come before its limit, however slowly this
        # machine runs: a second model on the same upstream, with a longer limit.
        proxy = await start_proxy(
            nursery,
            {
                "fake-model": {"upstreams": [fake.url], "total_timeout": 0.3},
                "streamed": {"upstreams": [fake.url], "total_timeout": 1.0},
            },
        )
        # Non-streaming: nothing was sent yet, so the status says it.
        response = await client.post(
            proxy.url + CHAT, json=chat_body(stream=False, fake={"ttft": 5})
        )
        assert response.status_code == 504
        assert _error(response)["code"] == "upstream_total_timeout"
        # Streaming: the stream started, so the error comes in-band and the stream ends.
        response = await client.post(
            proxy.url + CHAT, json=chat_body("streamed", fake={"interval": 0.1, "tokens": 50})
        )
        assert response.status_code == 200
        payloads = sse_payloads(response.text)
        assert json.loads(payloads[-1])["error"]["code"] == "upstream_total_timeout"
        assert "[DONE]" not in payloads


async def test_mid_stream_failures_are_reported_in_band(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        # Health ejection is tested elsewhere; here the same replica must take every fault.
        # Only the stall waits for the idle limit: the other faults go through a model on the
        # same upstream whose limit a loaded machine's pause between two tokens cannot reach.
        proxy = await start_proxy(
            nursery,
            {
                "fake-model": {"upstreams": [fake.url], "idle_timeout": 0.3},
                "patient": {"upstreams": [fake.url], "idle_timeout": 10},
            },
            upstream={"failure_threshold": 100},
        )
        expectations = {
            "stall": ("fake-model", "upstream_idle_timeout"),
            "reset": ("patient", "upstream_protocol_error"),
            "eof": ("patient", "upstream_protocol_error"),
            "malformed": ("patient", "upstream_malformed"),
        }
        for mode, (model, code) in expectations.items():
            response = await client.post(
                proxy.url + CHAT, json=chat_body(model, fake={"mode": mode, "at": 2})
            )
            assert response.status_code == 200, (mode, response.text)
            payloads = sse_payloads(response.text)
            # The two tokens before the fault were delivered, then exactly one error event.
            assert stream_text(payloads[:-1]) == "The quick ", (mode, payloads)
            error = json.loads(payloads[-1])["error"]
            assert error["code"] == code, (mode, error)
            assert set(error) >= {"message", "type", "code"}
        assert (await client.post(proxy.url + CHAT, json=chat_body())).status_code == 200


async def test_a_malformed_event_charges_only_what_the_client_was_sent(
    nursery: trio.Nursery,
    fake: Fake,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fake sends every token at once with a bad event among them, so that one read holds
    good events on both sides of it: the access line's output is what reached the client (the
    tokens before the bad event), none of it for nobody. It was charged the tokens after it
    too, which nobody was sent (the cancellation sweep found it)."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, upstream={"failure_threshold": 100}
        )
        for at in range(4):
            fault = {"mode": "malformed", "at": at, "interval": 0, "tokens": 4}
            response = await client.post(proxy.url + CHAT, json=chat_body(fake=fault))
            payloads = sse_payloads(response.text)
            sent = sum('"content":"' in p and '"content":""' not in p for p in payloads)
            line = access_lines(caplog)[-1]
            assert line["outcome"] == "upstream_malformed", line
            assert (line["output_tokens"], line["for_nobody_tokens"]) == (sent, 0), (at, line)
            assert sent == at


async def test_upstream_errors_before_streaming(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, upstream={"failure_threshold": 100}
        )
        # The upstream's own 4xx is passed through, body and all.
        response = await client.post(
            proxy.url + CHAT, json=chat_body(fake={"mode": "status", "status": 400})
        )
        assert response.status_code == 400
        assert _error(response)["message"] == "fake upstream error"
        # A 5xx, a refused request, or a stream that ends before its first event: 502.
        for fake_mode in ({"mode": "status", "status": 500}, {"mode": "refuse"}):
            response = await client.post(proxy.url + CHAT, json=chat_body(fake=fake_mode))
            assert response.status_code == 502, fake_mode
            assert _error(response)["code"] in {"upstream_http_error", "upstream_protocol_error"}
        response = await client.post(proxy.url + CHAT, json=chat_body(fake={"mode": "malformed"}))
        assert response.status_code == 502
        assert _error(response)["code"] == "upstream_malformed"


async def test_retry_on_another_replica_before_the_first_byte(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        failing = await start_fake(nursery, mode="status", status=503, ttft=0)
        healthy = await start_fake(nursery, ttft=0.01, interval=0.01, tokens=3)
        dead = f"http://127.0.0.1:{_closed_port()}"
        proxy = await start_proxy(
            nursery,
            {
                "a": {"upstreams": [failing.url, healthy.url]},
                "b": {"upstreams": [dead, healthy.url]},
            },
        )
        for model in ("a", "b"):
            response = await client.post(proxy.url + CHAT, json=chat_body(model, stream=True))
            assert response.status_code == 200, response.text
            assert stream_text(sse_payloads(response.text)) == "The quick brown "
        assert len(failing.recorder.records) == 1
        assert len(healthy.recorder.records) == 2


async def test_no_retry_after_the_first_byte(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        breaking = await start_fake(nursery, mode="reset", at=2, ttft=0, interval=0.01)
        healthy = await start_fake(nursery, ttft=0, interval=0.01, tokens=3)
        proxy = await start_proxy(nursery, {"m": [breaking.url, healthy.url]})
        response = await client.post(proxy.url + CHAT, json=chat_body("m"))
        assert response.status_code == 200
        payloads = sse_payloads(response.text)
        assert json.loads(payloads[-1])["error"]["code"] == "upstream_protocol_error"
        assert stream_text(payloads[:-1]) == "The quick "
        # Tokens reached the client, so the other replica must not have been asked.
        assert healthy.recorder.records == []


async def test_least_busy_replica_gets_the_request(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        # Streams that outlast the test: each is still in flight when the next one is sent.
        first = await start_fake(nursery, ttft=0.01, interval=0.05, tokens=10_000)
        second = await start_fake(nursery, ttft=0.01, interval=0.05, tokens=10_000)
        proxy = await start_proxy(nursery, {"m": [first.url, second.url]})

        def dispatched() -> int:
            return len(first.recorder.records) + len(second.recorder.records)

        async def one_stream() -> None:
            async with client.stream("POST", proxy.url + CHAT, json=chat_body("m")) as response:
                assert response.status_code == 200
                await trio.sleep_forever()

        async with trio.open_nursery() as streams:
            for sent in range(1, 5):
                streams.start_soon(one_stream)
                # The next is sent once this one has reached its replica.
                await poll_until(lambda sent=sent: dispatched() == sent)
            # Each new stream went to the replica with fewer in flight: an even split.
            assert len(first.recorder.records) == 2
            assert len(second.recorder.records) == 2
            streams.cancel_scope.cancel()


async def test_client_authorization_is_never_forwarded(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        plain = await start_fake(nursery, ttft=0, interval=0, tokens=1)
        proxy = await start_proxy(
            nursery,
            {
                "keyed": {"upstreams": [fake.url], "api_key_env": "UPSTREAM_KEY"},
                "plain": [plain.url],
            },
            env={"UPSTREAM_KEY": "upstream-secret"},
        )
        headers = {"Authorization": "Bearer client-secret", "X-Request-ID": "req-42"}
        for model in ("keyed", "plain"):
            response = await client.post(
                proxy.url + CHAT, json=chat_body(model, stream=False), headers=headers
            )
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "req-42"
        keyed = fake.recorder.last().headers
        assert keyed["authorization"] == "Bearer upstream-secret"
        assert keyed["x-request-id"] == "req-42"
        assert "authorization" not in plain.recorder.last().headers


async def test_streams_outlive_quarts_response_timeout(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.05, tokens=20)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        # Quart would cut every response at RESPONSE_TIMEOUT, silently; relays opt out.
        proxy.app.config["RESPONSE_TIMEOUT"] = 0.3
        response = await client.post(proxy.url + CHAT, json=chat_body())
        payloads = sse_payloads(response.text)
        assert payloads[-1] == "[DONE]"
        assert len(stream_text(payloads).split()) == 20


@pytest.mark.usefixtures("quiet_collector")
async def test_concurrent_streams_interleave(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.05, interval=0.05, tokens=10)
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        count = 30
        first_token: list[float] = []
        done: list[float] = []
        started = trio.current_time()

        async def one_stream() -> None:
            async with client.stream("POST", proxy.url + CHAT, json=chat_body()) as response:
                async for line in response.aiter_lines():
                    if '"content":"The ' in line:
                        first_token.append(trio.current_time() - started)
            done.append(trio.current_time() - started)

        async with trio.open_nursery() as streams:
            for _ in range(count):
                streams.start_soon(one_stream)
        assert len(done) == count and len(first_token) == count
        # One stream takes ~0.5 s. If any waited for another, the last would finish after
        # several streams' worth of time; interleaved, all finish together.
        assert max(first_token) < 0.5, first_token
        assert max(done) < 1.5, done


async def _read_until_closed(stream: trio.SocketStream, within: float) -> bytes:
    received = b""
    with trio.fail_after(within):
        while data := await stream.receive_some(65536):
            received += data
    return received


async def test_an_http10_stream_ends_with_the_connection(nursery: trio.Nursery, fake: Fake) -> None:
    # An HTTP/1.0 client's streamed body is close-delimited: until the server closes, the
    # client cannot know the answer is complete. The close must not be cancelled by the
    # request's own disconnect handling, or the connection stays open.
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        host, port = proxy.host_port
        payload = json.dumps(chat_body()).encode()
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(
                b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            received = await _read_until_closed(stream, 2)
    assert received.startswith(b"HTTP/1.1 200")
    assert received.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /healthz HTTP/1.0\r\n\r\n",
    ],
)
async def test_a_connection_close_response_closes_the_connection(
    nursery: trio.Nursery, fake: Fake, request_head: bytes
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        async with await trio.open_tcp_stream(*proxy.host_port) as stream:
            await stream.send_all(request_head)
            received = await _read_until_closed(stream, 2)
    assert received.startswith(b"HTTP/1.1 200")
    assert b'"status":"ok"' in received.replace(b" ", b"")


@pytest.mark.parametrize("path", ["/healthz", "/v1/chat/completions"])
async def test_an_idle_keep_alive_connection_is_closed_after_keep_alive_timeout(
    nursery: trio.Nursery, fake: Fake, path: str
) -> None:
    # Idle client connections must not pile up: after a completed response (a plain route or
    # a relayed stream), the connection is closed once it has been idle keep_alive_timeout.
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"keep_alive_timeout": 0.5}
        )
        async with await trio.open_tcp_stream(*proxy.host_port) as stream:
            if path == "/healthz":
                await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            else:
                payload = json.dumps(chat_body()).encode()
                await stream.send_all(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                    % (len(payload), payload)
                )
            started = trio.current_time()
            received = await _read_until_closed(stream, 3)
            idle_for = trio.current_time() - started
    assert received.startswith(b"HTTP/1.1 200")
    assert 0.5 <= idle_for < 2.5
