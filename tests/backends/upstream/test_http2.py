"""HTTP/2 to an upstream (httpx transport, ``http2 = true``), against a real HTTP/2 server:
hypercorn over TLS with a throwaway CA, serving a small SSE app.

What must hold, as over HTTP/1.1: a client that leaves makes the server see its stream go at
once. httpcore 1.0.x never resets a stream whose response was closed early (httpcore #943,
#1022); ``proxy.server.adapters.httpcore_adapter`` adds the reset, and these tests show both
that it works and that without it the server would never know.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trustme
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from proxy.backends.upstream import httpx_pool
from proxy.server.adapters import httpcore_adapter
from tests.support import DEADLINE, Proxy, RawClient, chat_body, sse_payloads, start_proxy

CHAT = "/v1/chat/completions"
CANCEL_BOUND = 0.05


class H2Upstream:
    """An OpenAI-style SSE endpoint: ``max_tokens`` tokens, ``interval`` apart (from the
    request's ``"interval"``), recording each request's HTTP version, client port, and when
    it saw its client go."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.changed = trio.Event()

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, predicate: Any) -> None:
        while not predicate():
            await self.changed.wait()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body or b"{}")
        record: dict[str, Any] = {
            "http_version": scope["http_version"],
            "client_port": scope["client"][1],
            "disconnected_at": None,
            "completed": False,
        }
        self.requests.append(record)
        self._touch()
        tokens = int(request.get("max_tokens", 3))
        interval = float(request.get("interval", 0.01))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                if not record["completed"]:  # (a stream that ended also "disconnects")
                    record["disconnected_at"] = trio.current_time()
                self._touch()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            for index in range(tokens):
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{index} "}}]}
                event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await trio.sleep(interval)
            record["completed"] = True
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            self._touch()
            nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("h2tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    paths = {"ca": str(directory / "ca.pem"), "server": str(directory / "server.pem")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.private_key_and_cert_chain_pem.write_to_path(paths["server"])
    return paths


async def start_h2(nursery: trio.Nursery, tls: dict[str, str]) -> tuple[H2Upstream, str]:
    app = H2Upstream()
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.certfile = config.keyfile = tls["server"]
    config.accesslog = config.errorlog = None
    binds = await nursery.start(partial(hypercorn_serve, app, config))  # type: ignore[arg-type]
    return app, binds[0]


async def start_h2_proxy(nursery: trio.Nursery, url: str, tls: dict[str, str]) -> Proxy:
    model = {"upstreams": [url], "http2": True, "ca_file": tls["ca"]}
    return await start_proxy(nursery, {"m": model}, upstream={"max_attempts": 1})


async def test_http2_is_negotiated_and_streams(nursery: trio.Nursery, tls: dict[str, str]) -> None:
    with trio.fail_after(DEADLINE):
        upstream, url = await start_h2(nursery, tls)
        proxy = await start_h2_proxy(nursery, url, tls)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            responses = [
                await client.post(proxy.url + CHAT, json=chat_body("m", max_tokens=3))
                for _ in range(3)
            ]
    for response in responses:
        assert response.status_code == 200, response.text
        assert sse_payloads(response.text)[-1] == "[DONE]"
    assert [r["http_version"] for r in upstream.requests] == ["2", "2", "2"]
    # One connection carried them all.
    assert len({r["client_port"] for r in upstream.requests}) == 1


async def test_a_client_that_leaves_resets_its_stream_and_only_its_stream(
    nursery: trio.Nursery, tls: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        upstream, url = await start_h2(nursery, tls)
        proxy = await start_h2_proxy(nursery, url, tls)
        staying = await RawClient.post(proxy, CHAT, chat_body("m", max_tokens=30, interval=0.02))
        await staying.read_until(b"data: ")
        leaving = await RawClient.post(proxy, CHAT, chat_body("m", max_tokens=1000, interval=0.02))
        await leaving.read_until(b"data: ", count=3)
        record = upstream.requests[-1]
        closed_at = await leaving.close()
        await upstream.wait_for(lambda: record["disconnected_at"] is not None)
        assert record["disconnected_at"] - closed_at < CANCEL_BOUND
        # The other stream, on the same connection, runs to its end.
        await staying.read_until(b"data: [DONE]")
        await staying.close()
    stayed = upstream.requests[0]
    assert stayed["completed"] and stayed["disconnected_at"] is None
    assert stayed["client_port"] == record["client_port"]


async def test_many_cancelled_streams_leave_the_connection_usable(
    nursery: trio.Nursery, tls: dict[str, str]
) -> None:
    """Past the server's 100 concurrent streams: without the reset, h2's count of open
    streams would grow by one per cancelled request until it refused new ones."""
    with trio.fail_after(DEADLINE * 3):
        upstream, url = await start_h2(nursery, tls)
        proxy = await start_h2_proxy(nursery, url, tls)
        for _ in range(110):
            raw = await RawClient.post(proxy, CHAT, chat_body("m", max_tokens=1000, interval=0.05))
            await raw.read_until(b"data: ")
            await raw.close()
        await proxy.state.tracker.wait_idle()
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body("m", max_tokens=3))
        await upstream.wait_for(
            lambda: all(r["completed"] or r["disconnected_at"] for r in upstream.requests)
        )
    assert response.status_code == 200, response.text
    assert sum(r["disconnected_at"] is not None for r in upstream.requests) == 110
    assert len({r["client_port"] for r in upstream.requests}) == 1


async def test_without_the_reset_the_server_would_never_know(
    nursery: trio.Nursery, tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard's reason: httpcore's own close of an HTTP/2 response tells the server
    nothing."""
    from httpcore._async.http2 import AsyncHTTP2Connection

    original = httpcore_adapter.original_response_closed
    assert original is not None  # installed by the first proxy that served
    monkeypatch.setattr(AsyncHTTP2Connection, "_response_closed", original)
    with trio.fail_after(DEADLINE):
        upstream, url = await start_h2(nursery, tls)
        proxy = await start_h2_proxy(nursery, url, tls)
        raw = await RawClient.post(proxy, CHAT, chat_body("m", max_tokens=1000, interval=0.02))
        await raw.read_until(b"data: ", count=2)
        record = upstream.requests[-1]
        await raw.close()
        await proxy.state.tracker.wait_idle()
        await trio.sleep(0.3)
    assert record["disconnected_at"] is None  # still generating for nobody
    assert not record["completed"]


async def test_without_its_guard_http2_is_not_offered(
    nursery: trio.Nursery, tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpcore_adapter, "install", lambda: False)
    monkeypatch.setattr(httpx_pool, "http2_stream_reset_installed", False)
    with trio.fail_after(DEADLINE):
        upstream, url = await start_h2(nursery, tls)
        proxy = await start_h2_proxy(nursery, url, tls)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            response = await client.post(proxy.url + CHAT, json=chat_body("m", max_tokens=3))
    assert response.status_code == 200
    assert upstream.requests[-1]["http_version"] == "1.1"
