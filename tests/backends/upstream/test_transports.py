"""Upstreams as they really behave, over both transports (lean and httpx), through the proxy:
keep-alive races retried and never reported, the ejection rules, HTTPS with a throwaway CA and
mTLS, HTTP proxies (a CONNECT tunnel the proxy must see, absolute-form for http, the
environment's HTTP(S)_PROXY / NO_PROXY), and health checks made the way requests are.

Every upstream here is the fake (``proxy.testing.fake_upstream``) with one real server's habit
switched on, on 127.0.0.1, port 0.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import socket
from typing import Any

import httpx
import pytest
import trio
import trustme

from proxy.backends.upstream import httpx_pool
from proxy.backends.upstream.httpx_pool import HttpxPool, HttpxResponse
from proxy.backends.upstream.pool import Origin, UpstreamRequest
from proxy.backends.upstream.transports import ConnectionSettings
from proxy.server import adapters
from proxy.server.adapters import httpcore_adapter
from tests.support import (
    DEADLINE,
    UPSTREAM_TRANSPORTS,
    Fake,
    Proxy,
    RawClient,
    chat_body,
    only_replica,
    poll_until,
    sse_payloads,
    start_fake,
    start_proxy,
    stream_text,
)

CHAT = "/v1/chat/completions"
# A name that resolves nowhere: only a proxy can reach it (the fake, as the proxy, serves it).
HIDDEN = "upstream.internal"


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and the hidden name, and a client
    certificate, all signed by it; and a second CA that signed nothing here."""
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost", HIDDEN)
    client = ca.issue_cert("sluice-client@example.com", common_name="sluice-client")
    files = {
        "ca": directory / "ca.pem",
        "server": directory / "server.pem",
        "client": directory / "client.pem",
        "other_ca": directory / "other-ca.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    trustme.CA().cert_pem.write_to_path(str(files["other_ca"]))
    return {name: str(path) for name, path in files.items()}


def tls_fake_settings(tls_files: dict[str, str], **more: Any) -> dict[str, Any]:
    return {"tls_cert": tls_files["server"], "tls_key": tls_files["server"], **more}


async def ask(
    client: httpx.AsyncClient, proxy: Proxy, model: str, *, stream: bool = True
) -> httpx.Response:
    return await client.post(proxy.url + CHAT, json=chat_body(model, stream=stream))


def assert_streamed(response: httpx.Response, tokens: int = 5) -> None:
    assert response.status_code == 200, response.text
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert len(stream_text(payloads).split()) == tokens


def upstream_errors(proxy: Proxy) -> float:
    """Every upstream error the proxy counted (sluice_upstream_errors_total, all labels)."""
    total = 0.0
    for metric in proxy.state.metrics.upstream_errors.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                total += sample.value
    return total


@pytest.fixture
async def client() -> Any:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        yield client


# -- keep-alive races ------------------------------------------------------------------------

HABITS = {
    # Closes right after each answer, without Connection: close (legal HTTP/1.1).
    "close-after-response": {"close_after_response": True},
    # Closes 50 ms after an answer without reading what came meanwhile: the request sent
    # right after the previous answer is lost on that connection.
    "late-close": {"late_close": 0.05},
    # Closes an idle connection after 50 ms (uvicorn does after 5 s).
    "keepalive-timeout": {"keepalive_timeout": 0.05},
}


@pytest.mark.parametrize("habit", sorted(HABITS))
@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_every_keepalive_race_gets_a_200_and_the_replica_stays_healthy(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str, habit: str
) -> None:
    with trio.fail_after(DEADLINE * 2):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5, **HABITS[habit])
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            # One attempt, so a race reported as an error could not hide behind a retry on
            # another replica; a threshold of 1, so one blamed race would eject it.
            upstream={"max_attempts": 1, "failure_threshold": 1},
        )
        replica = only_replica(proxy)
        for index in range(40):
            if habit == "keepalive-timeout" and index % 4 == 3:
                await trio.sleep(0.06)  # idle past the server's timeout now and then
            response = await ask(client, proxy, "m", stream=index % 2 == 0)
            assert response.status_code == 200, (index, response.text)
            assert replica.load.healthy(), index
    assert upstream_errors(proxy) == 0
    # The fake really closed connections under the proxy: more than one was opened.
    assert fake.recorder.connections_accepted > 1


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_concurrent_clients_on_connections_that_close_behind_them_get_only_200s(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str
) -> None:
    """Many idle connections, each closed by its server 50 ms after its answer, and requests
    arriving all the while: a request may meet several dead ones in a row (httpcore hands
    out its oldest idle connection first), and still gets a 200."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0.01, interval=0, tokens=5, late_close=0.05)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            upstream={"max_attempts": 1, "failure_threshold": 1},
        )
        statuses: list[int] = []

        async def client_loop(index: int) -> None:
            await trio.sleep(index * 0.007)
            for _ in range(8):
                response = await ask(client, proxy, "m", stream=False)
                statuses.append(response.status_code)

        async with trio.open_nursery() as clients:
            for index in range(8):
                clients.start_soon(client_loop, index)
    assert statuses == [200] * 64
    assert only_replica(proxy).load.healthy()
    assert upstream_errors(proxy) == 0


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_a_reset_on_a_reused_connection_after_its_head_is_not_retried(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str
) -> None:
    """Only "no byte of an answer" is a keep-alive race: a reused connection that failed
    after its head had come is the replica's fault, and is not sent again (the server has
    started the work)."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            upstream={"max_attempts": 1, "failure_threshold": 5},
        )
        assert_streamed(await ask(client, proxy, "m"))  # leaves a connection to reuse
        records = len(fake.recorder.records)
        body = chat_body("m", fake={"mode": "reset", "at": 0})  # the head, then a reset
        response = await client.post(proxy.url + CHAT, json=body)
    assert response.status_code == 502
    assert len(fake.recorder.records) == records + 1  # sent once, not twice
    assert only_replica(proxy).load.consecutive_failures == 1


# -- ejection: only the replica's own faults count -----------------------------------------

# (stream?, the fake's fault). The failed connection is never reused, so each request after
# the first is on a fresh connection too: a reset or an EOF there is the server's doing.
FAULTS = {
    "5xx": (True, {"mode": "status", "status": 503}),
    "malformed": (True, {"mode": "malformed"}),
    "reset-on-a-fresh-connection": (False, {"mode": "reset"}),
    "eof-on-a-fresh-connection": (False, {"mode": "refuse"}),
    "first-token-timeout": (True, {"mode": "stall"}),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_the_replicas_own_faults_eject_it(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str, fault: str
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(
            nursery,
            {
                "m": {
                    "upstreams": [fake.url],
                    "transport": transport,
                    "first_token_timeout": 0.2,
                }
            },
            upstream={"max_attempts": 1, "failure_threshold": 2, "ejection_seconds": 60},
        )
        replica = only_replica(proxy)
        stream, injected = FAULTS[fault]
        for _ in range(2):
            body = chat_body("m", stream=stream, fake=injected)
            response = await client.post(proxy.url + CHAT, json=body)
            assert response.status_code in (502, 503, 504), response.text
        assert not replica.load.healthy()
        refused = await ask(client, proxy, "m")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_healthy_upstream"
    assert "Retry-After" in refused.headers


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_a_refused_connect_ejects_the_replica(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        with trio.fail_after(DEADLINE):
            proxy = await start_proxy(
                nursery,
                {"m": {"upstreams": [f"http://127.0.0.1:{port}"], "transport": transport}},
                upstream={"max_attempts": 1, "failure_threshold": 2, "ejection_seconds": 60},
            )
            codes = [(await ask(client, proxy, "m")).json()["error"]["code"] for _ in range(3)]
    assert codes == ["upstream_connect_error", "upstream_connect_error", "no_healthy_upstream"]


# -- HTTPS -------------------------------------------------------------------------------------


async def start_tls_fake(nursery: trio.Nursery, tls_files: dict[str, str], **more: Any) -> Fake:
    fake = await start_fake(
        nursery, ttft=0, interval=0, tokens=5, **tls_fake_settings(tls_files, **more)
    )
    fake.url = fake.url.replace("http://", "https://")
    return fake


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_https_needs_the_ca_and_works_with_it(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_tls_fake(nursery, tls_files)
        base = {"upstreams": [fake.url], "transport": transport}
        proxy = await start_proxy(
            nursery,
            {"untrusted": base, "trusted": {**base, "ca_file": tls_files["ca"]}},
            upstream={"max_attempts": 1},
        )
        refused = await ask(client, proxy, "untrusted")
        served = await ask(client, proxy, "trusted")
        whole = await ask(client, proxy, "trusted", stream=False)
    assert refused.status_code == 502
    error = refused.json()["error"]
    assert error["code"] == "upstream_connect_error"
    assert "CERTIFICATE_VERIFY_FAILED" in error["message"] or "certificate" in error["message"]
    assert_streamed(served)
    assert whole.status_code == 200 and whole.json()["choices"][0]["message"]["content"]
    assert fake.recorder.last().tls


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_ssl_cert_file_is_honoured_by_requests_and_health_checks(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    transport: str,
    tls_files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", tls_files["ca"])
    with trio.fail_after(DEADLINE):
        fake = await start_tls_fake(nursery, tls_files)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": transport}},
            # Also each check's time to answer (a TLS handshake, at first): long enough that a
            # loaded machine does not fail a check that TLS passed.
            upstream={"health_check_path": "/v1/models", "health_check_interval": 0.5},
        )
        await fake.recorder.wait_for(lambda r: any(x.path == "/v1/models" for x in r.records))
        assert_streamed(await ask(client, proxy, "m"))
        # More checks: each one passes.
        await fake.recorder.wait_for(lambda r: sum(x.path == "/v1/models" for x in r.records) >= 3)
    assert only_replica(proxy).load.healthy()


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_mtls_required_by_the_server(
    nursery: trio.Nursery, client: httpx.AsyncClient, transport: str, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_tls_fake(nursery, tls_files, tls_client_ca=tls_files["ca"])
        base = {"upstreams": [fake.url], "transport": transport, "ca_file": tls_files["ca"]}
        proxy = await start_proxy(
            nursery,
            {"anonymous": base, "identified": {**base, "client_cert": tls_files["client"]}},
            upstream={"max_attempts": 1},
        )
        refused = await ask(client, proxy, "anonymous")
        served = await ask(client, proxy, "identified")
    assert refused.status_code == 502
    assert refused.json()["error"]["code"].startswith("upstream_")
    assert fake.recorder.tls_handshake_failures >= 1
    assert_streamed(served)
    assert fake.recorder.last().client_cert_cn == "sluice-client"


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_verify_false_serves_and_says_so_loudly(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    transport: str,
    tls_files: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.app")
    with trio.fail_after(DEADLINE):
        fake = await start_tls_fake(nursery, tls_files)
        model = {"upstreams": [fake.url], "transport": transport, "verify": False}
        proxy = await start_proxy(nursery, {"m": model})
        assert_streamed(await ask(client, proxy, "m"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("TLS VERIFICATION IS OFF" in line and fake.url in line for line in warnings)


# -- HTTP proxies -----------------------------------------------------------------------------


async def start_egress(
    nursery: trio.Nursery, tls_files: dict[str, str], **fake: Any
) -> tuple[Fake, dict[str, Any]]:
    """A TLS upstream reachable only through itself as an HTTP proxy, and the model table
    that reaches it so (by a name only the proxy knows)."""
    settings = {"ttft": 0, "interval": 0, "tokens": 5, **fake}
    egress = await start_fake(nursery, via_proxy=True, **tls_fake_settings(tls_files, **settings))
    model = {
        "upstreams": [f"https://{HIDDEN}:8443"],
        "proxy": egress.url,
        "ca_file": tls_files["ca"],
    }
    return egress, model


async def test_https_through_a_connect_proxy_that_sees_the_tunnel(
    nursery: trio.Nursery, client: httpx.AsyncClient, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        egress, model = await start_egress(nursery, tls_files)
        proxy = await start_proxy(nursery, {"m": model})
        assert only_replica(proxy).connection.transport == "httpx"  # auto: a proxy
        assert_streamed(await ask(client, proxy, "m"))
        whole = await ask(client, proxy, "m", stream=False)
    assert whole.status_code == 200
    assert egress.recorder.proxy_tunnels[0] == f"{HIDDEN}:8443"
    record = egress.recorder.last()
    assert record.via_proxy and record.tls and record.tunnel == f"{HIDDEN}:8443"


async def test_plain_http_through_a_proxy_and_the_environment_decides(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        egress = await start_fake(nursery, ttft=0, interval=0, tokens=5, via_proxy=True)
        direct = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(
            nursery,
            {
                # No proxy key: HTTP_PROXY applies to it...
                "hidden": [f"http://{HIDDEN}:8000"],
                # ...but not to 127.0.0.1, which NO_PROXY sends direct (on the lean path).
                "direct": [direct.url],
                # "none": direct whatever the environment says.
                "opted-out": {"upstreams": [direct.url], "proxy": "none", "transport": "httpx"},
            },
            env={"HTTP_PROXY": egress.url, "NO_PROXY": "localhost,127.0.0.0/8"},
        )
        assert_streamed(await ask(client, proxy, "hidden"))
        assert_streamed(await ask(client, proxy, "direct"))
        assert_streamed(await ask(client, proxy, "opted-out"))
    record = egress.recorder.last()
    assert record.via_proxy and record.tunnel is None  # absolute-form, as http proxies are used
    assert len(egress.recorder.records) == 1
    assert len(direct.recorder.records) == 2
    assert sorted(proxy.state.replicas) == sorted(
        [f"http://{HIDDEN}:8000 (httpx, proxy {egress.url})", direct.url, f"{direct.url} (httpx)"]
    )


async def test_a_proxy_that_refuses_is_a_clear_502(
    nursery: trio.Nursery, client: httpx.AsyncClient, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        # Not a proxy: it answers CONNECT with 405.
        origin = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        model = {"upstreams": [f"https://{HIDDEN}:8443"], "proxy": origin.url}
        proxy = await start_proxy(nursery, {"m": model}, upstream={"max_attempts": 1})
        response = await ask(client, proxy, "m")
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_proxy_error"
    assert "405" in error["message"]


async def test_a_client_that_leaves_closes_the_tunnel_at_once(
    nursery: trio.Nursery, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        egress, model = await start_egress(nursery, tls_files, interval=0.02, tokens=1000)
        proxy = await start_proxy(nursery, {"m": model})
        raw = await RawClient.post(proxy, CHAT, chat_body("m"))
        await raw.read_until(b"data: ", count=3)
        record = egress.recorder.last()
        closed_at = await raw.close()
        await egress.recorder.wait_for(lambda _: record.outcome != "pending")
    assert record.outcome == "client_disconnected"
    assert record.disconnected_at - closed_at < 0.05
    await proxy.state.tracker.wait_idle()


@pytest.mark.parametrize("transport", UPSTREAM_TRANSPORTS)
async def test_a_client_that_leaves_during_the_upstream_tls_handshake_closes_its_socket(
    nursery: trio.Nursery, transport: str
) -> None:
    # A server that takes the ClientHello and never answers: the handshake waits until the
    # client leaves, and then the socket must close at once, not when the GC finds it.
    hello = trio.Event()
    closed_at: list[float] = []

    async def silent(stream: trio.SocketStream) -> None:
        said = False  # start-up's reachability check connects and says nothing
        async with stream:
            while await stream.receive_some():
                said = True
                hello.set()
        if said:
            closed_at.append(trio.current_time())

    serving = functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1")
    (listener,) = await nursery.start(serving)
    url = f"https://127.0.0.1:{listener.socket.getsockname()[1]}"
    # Closed by Sluice, not by a collection that happens to run meanwhile (the socket of a
    # forgotten stream sits in a reference cycle, which gc would close at some point).
    gc.disable()
    try:
        with trio.fail_after(DEADLINE):
            proxy = await start_proxy(nursery, {"m": {"upstreams": [url], "transport": transport}})
            raw = await RawClient.post(proxy, CHAT, chat_body("m"))
            await hello.wait()
            left_at = await raw.close()
            with trio.move_on_after(1):
                await poll_until(lambda: bool(closed_at))
    finally:
        gc.enable()
    assert closed_at, "the upstream socket stayed open after its client left"
    assert closed_at[0] - left_at < 0.05
    await proxy.state.tracker.wait_idle()


async def test_health_checks_go_the_requests_way(
    nursery: trio.Nursery, tls_files: dict[str, str]
) -> None:
    """Through the proxy, with the TLS settings and the upstream key that requests use."""
    with trio.fail_after(DEADLINE):
        egress, model = await start_egress(nursery, tls_files)
        model["api_key_env"] = "UPSTREAM_KEY"
        proxy = await start_proxy(
            nursery,
            {"m": model},
            env={"UPSTREAM_KEY": "sk-upstream"},
            # Also each check's time to answer (through the proxy, TLS): long enough that a
            # loaded machine does not fail a check.
            upstream={"health_check_path": "/v1/models", "health_check_interval": 0.5},
        )
        await egress.recorder.wait_for(lambda r: len(r.records) >= 2)
    checks = [r for r in egress.recorder.records if r.path == "/v1/models"]
    assert checks, egress.recorder.records
    assert all(r.via_proxy and r.tls for r in checks)
    assert all(r.headers.get("authorization") == "Bearer sk-upstream" for r in checks)
    assert only_replica(proxy).load.healthy()


# -- the choice of transport -------------------------------------------------------------------


async def test_auto_is_lean_for_plain_http_and_httpx_for_the_rest(
    nursery: trio.Nursery, tls_files: dict[str, str]
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {
                "plain": ["http://127.0.0.1:9"],
                "plain-twin": ["http://127.0.0.1:9"],
                "tls": {"upstreams": ["https://127.0.0.1:9"], "ca_file": tls_files["ca"]},
                "tls-lean": {"upstreams": ["https://127.0.0.1:9"], "transport": "lean"},
                "proxied": {"upstreams": ["http://127.0.0.1:9"], "proxy": "http://127.0.0.1:8"},
            },
        )
    labels = sorted(proxy.state.replicas)
    assert labels == sorted(
        [
            "http://127.0.0.1:9",
            f"https://127.0.0.1:9 (httpx, ca {tls_files['ca']})",
            "https://127.0.0.1:9",
            "http://127.0.0.1:9 (httpx, proxy http://127.0.0.1:8)",
        ]
    ), labels
    # Two models that reach one URL the same way share its replica (and its pool).
    backends = proxy.state.backends
    assert backends["plain"].replicas[0] is backends["plain-twin"].replicas[0]  # type: ignore[attr-defined]


async def test_httpx_never_queues_inside_httpcore(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    """httpcore #1093: a request cancelled while it waits for httpcore's pool leaks a
    CONNECTING connection, until every request gets PoolTimeout. Requests wait for the
    replica's slots instead (as many as httpcore's pool has connections), so clients that
    leave while queued take nothing of httpcore's with them."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0.01, tokens=100_000)
        proxy = await start_proxy(
            nursery,
            {"m": {"upstreams": [fake.url], "transport": "httpx"}},
            upstream={"max_connections": 2},
        )
        backend = proxy.state.backends["m"]
        holders = [await RawClient.post(proxy, CHAT, chat_body("m")) for _ in range(2)]
        for holder in holders:
            await holder.read_until(b"data: ")
        queued = [await RawClient.post(proxy, CHAT, chat_body("m")) for _ in range(10)]
        await poll_until(lambda: backend.queued == 10)  # type: ignore[attr-defined]
        for raw in queued + holders:
            await raw.close()
        await proxy.state.tracker.wait_idle()
        replica = only_replica(proxy)
        for _ in range(3):
            body = chat_body("m", fake={"tokens": 3})
            response = await client.post(proxy.url + CHAT, json=body)
            assert response.status_code == 200, response.text
    connections = replica.pool_connections()
    assert len(connections) <= 2
    assert all(connection.is_idle() for connection in connections), connections


# -- httpx: idle connections that their server closed ---------------------------------------

# /proc/net/tcp's state codes, for the ones these tests meet.
TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0B": "CLOSING"}
# The sweep looks once a second; the rest is a loaded machine's slack.
SWEPT_WITHIN = httpx_pool.SWEEP_INTERVAL + 0.5
# The server's close, then: right after its answer (often after the proxy closed the
# response, sometimes before), or surely after (the proxy has long closed the response).
SERVER_CLOSES = {
    "close-after-response": {"close_after_response": True},
    "late": {"late_close": 0.3},
}


def sockets_to(port: int) -> list[str]:
    """The TCP states of this process's sockets whose peer is ``port`` on 127.0.0.1: the
    proxy's upstream connections to the fake (the fake's own ends have it as local port)."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    states = []
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if inode in inodes and remote == f"0100007F:{port:04X}":
                states.append(TCP_STATES.get(state, state))
    return states


def fake_port(fake: Fake) -> int:
    return int(fake.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("habit", sorted(SERVER_CLOSES))
async def test_httpx_closes_an_idle_connection_soon_after_its_server_did(
    nursery: trio.Nursery, client: httpx.AsyncClient, habit: str
) -> None:
    """httpcore alone would keep it, in CLOSE_WAIT, until the replica's next request: it sees
    the server's close only as it assigns a request. No other request comes here."""
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5, **SERVER_CLOSES[habit])
        proxy = await start_proxy(nursery, {"m": {"upstreams": [fake.url], "transport": "httpx"}})
        replica = only_replica(proxy)
        assert_streamed(await ask(client, proxy, "m"))
        await fake.recorder.wait_for(lambda recorder: recorder.open_connections == 0)
        port = fake_port(fake)
        # Closed by the next sweep, about a second after the server's close; without the sweep
        # never (no request comes to show httpcore the close), and the test's deadline fails.
        # How soon is the sweep's interval, not waited on here: a loaded machine runs late.
        await poll_until(lambda: not replica.pool_connections() and not sockets_to(port))
        # And the next request simply opens a new connection.
        assert_streamed(await ask(client, proxy, "m"))
    assert upstream_errors(proxy) == 0


async def test_httpx_drops_at_once_a_connection_whose_server_closed_before_its_response(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other half, httpcore's own: as a response closes it assigns requests, and so
    closes an idle connection whose server's close has already arrived. No sweep runs here."""
    monkeypatch.setattr(httpx_pool, "connection_pool_of", httpcore_adapter.connection_pool)
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5, close_after_response=True)
        port = fake_port(fake)
        body = json.dumps(chat_body("m")).encode()
        headers = [
            (b"host", f"127.0.0.1:{port}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        origin = Origin("http", "127.0.0.1", port)
        request = UpstreamRequest(origin, b"POST", CHAT.encode(), headers, body)
        pool = HttpxPool(
            ConnectionSettings(transport="httpx"),
            max_connections=2,
            max_keepalive=2,
            keepalive_expiry=4.0,
        )
        try:
            async with pool.stream(request) as response:
                read = b"".join([chunk async for chunk in response.chunks()])
                assert read.endswith(b"data: [DONE]\n\n")
                await poll_until(lambda: sockets_to(port) == ["CLOSE_WAIT"])  # its FIN is in
                (connection,) = pool.connections()
                assert not connection.is_idle()  # the response's, until it closes
            assert pool.connections() == []
            assert sockets_to(port) == []
        finally:
            await pool.aclose()


async def test_httpx_keeps_and_reuses_a_connection_its_server_keeps_open(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        fake = await start_fake(nursery, ttft=0, interval=0, tokens=5)
        proxy = await start_proxy(nursery, {"m": {"upstreams": [fake.url], "transport": "httpx"}})
        replica = only_replica(proxy)
        assert_streamed(await ask(client, proxy, "m"))
        (kept,) = replica.pool_connections()
        accepted = fake.recorder.connections_accepted
        await trio.sleep(SWEPT_WITHIN)  # a sweep or two, well within the keep-alive expiry
        assert replica.pool_connections() == [kept]
        assert kept.is_idle()
        assert sockets_to(fake_port(fake)) == ["ESTABLISHED"]
        assert_streamed(await ask(client, proxy, "m"))
    assert replica.pool_connections() == [kept]
    assert fake.recorder.connections_accepted == accepted


async def test_without_the_reach_to_httpcores_pool_httpx_behaves_as_before(
    nursery: trio.Nursery,
    client: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A future httpx that keeps its pool elsewhere: said once at start-up, and the idle
    connection that its server closed stays open until the next request, which still gets
    its 200 (httpcore drops the dead connection as it assigns it)."""
    monkeypatch.setattr(httpcore_adapter, "_TRANSPORT_POOL", "_no_such_pool")
    # install() sets the reach from the check as it stands; put the real one back after.
    monkeypatch.setattr(httpx_pool, "connection_pool_of", httpx_pool.connection_pool_of)
    adapters.reset()
    try:
        with caplog.at_level(logging.WARNING, logger="sluice.adapters"), trio.fail_after(DEADLINE):
            fake = await start_fake(nursery, ttft=0, interval=0, tokens=5, **SERVER_CLOSES["late"])
            proxy = await start_proxy(
                nursery, {"m": {"upstreams": [fake.url], "transport": "httpx"}}
            )
            assert not adapters.usable("idle_sweep")
            assert_streamed(await ask(client, proxy, "m"))
            await fake.recorder.wait_for(lambda recorder: recorder.open_connections == 0)
            await trio.sleep(SWEPT_WITHIN)
            assert sockets_to(fake_port(fake)) == ["CLOSE_WAIT"]
            assert_streamed(await ask(client, proxy, "m"))
            await poll_until(lambda: "CLOSE_WAIT" not in sockets_to(fake_port(fake)))
    finally:
        adapters.reset()
    assert upstream_errors(proxy) == 0
    lines = [record.getMessage() for record in caplog.records]
    (line,) = [line for line in lines if "AsyncHTTPTransport" in line]
    assert "stays open (CLOSE_WAIT) until the replica's next request" in line


class FakeConnection:
    """httpcore's connection interface, as the sweep uses it; ``aclose`` marks it closed
    before its first await, as httpcore's do."""

    def __init__(self, *, idle: bool, expired: bool) -> None:
        self.idle = idle
        self.expired = expired
        self.closed_at: float | None = None

    def is_idle(self) -> bool:
        return self.idle and self.closed_at is None

    def has_expired(self) -> bool:
        return self.expired

    def is_closed(self) -> bool:
        return self.closed_at is not None

    async def aclose(self) -> None:
        self.closed_at = trio.current_time()
        await trio.lowlevel.checkpoint()


class FakeConnectionPool:
    """What the sweep reads of httpcore's pool; counts the looks."""

    def __init__(self, *connections: FakeConnection) -> None:
        self.held = list(connections)
        self.looks = 0

    @property
    def connections(self) -> list[FakeConnection]:
        self.looks += 1
        return list(self.held)


def swept_pool(monkeypatch: pytest.MonkeyPatch, fake_pool: FakeConnectionPool) -> HttpxPool:
    monkeypatch.setattr(httpx_pool, "connection_pool_of", lambda transport: fake_pool)
    return HttpxPool(
        ConnectionSettings(transport="httpx"),
        max_connections=4,
        max_keepalive=4,
        keepalive_expiry=4.0,
    )


async def a_response_closes(pool: HttpxPool) -> None:
    """What wakes the sweep: a response closed (its connection may now be idle)."""
    response = HttpxResponse(httpx.Response(200, stream=httpx.ByteStream(b"")), pool)
    await response.aclose()


async def test_the_sweep_looks_only_while_a_connection_is_idle_and_then_once_a_second(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy_and_expired = FakeConnection(idle=False, expired=True)
    fake_pool = FakeConnectionPool(busy_and_expired)
    pool = swept_pool(monkeypatch, fake_pool)
    origin = Origin("http", "127.0.0.1", 9)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.keep_spare, origin, 5.0)
        await trio.sleep(30)
        assert fake_pool.looks == 1  # nothing idle: asleep until a response closes
        kept = FakeConnection(idle=True, expired=False)
        fake_pool.held.append(kept)
        await a_response_closes(pool)
        await trio.sleep(10.5)
        # Once to see an idle one, then once a second: each sweep looks, then the loop does.
        assert 20 <= fake_pool.looks <= 23
        dead = FakeConnection(idle=True, expired=True)
        fake_pool.held.append(dead)
        expired_at = trio.current_time()
        await trio.sleep(1.5)
        assert dead.closed_at is not None
        assert dead.closed_at - expired_at <= httpx_pool.SWEEP_INTERVAL
        assert kept.closed_at is None and busy_and_expired.closed_at is None
        kept.expired = True  # past its keep-alive expiry
        await trio.sleep(1.5)
        assert kept.closed_at is not None
        looks = fake_pool.looks
        await trio.sleep(30)
        assert fake_pool.looks == looks  # nothing idle again
        assert busy_and_expired.closed_at is None
        await pool.aclose()  # the sweep returns: the nursery can close


async def test_the_sweep_touches_nothing_while_a_request_is_inside_httpcores_pool(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """httpcore hands a request an idle connection and marks it active only after awaiting a
    lock: until then it still looks idle (and its server's close may arrive meanwhile)."""
    handed = FakeConnection(idle=True, expired=True)
    pool = swept_pool(monkeypatch, FakeConnectionPool(handed))
    inside = trio.Event()

    async def handle_async_request(request: httpx.Request) -> httpx.Response:
        inside.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(pool._transport, "handle_async_request", handle_async_request)
    origin = Origin("http", "127.0.0.1", 9)
    request = UpstreamRequest(origin, b"GET", b"/", [(b"host", b"127.0.0.1:9")])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pool.keep_spare, origin, 5.0)
        requests = trio.CancelScope()

        async def send() -> None:
            with requests:
                await pool.open(request)

        nursery.start_soon(send)
        await inside.wait()
        await trio.sleep(10)
        assert handed.closed_at is None
        requests.cancel()  # it leaves without using the connection
        cancelled_at = trio.current_time()
        await trio.sleep(1.5)
        assert handed.closed_at is not None
        assert handed.closed_at - cancelled_at <= httpx_pool.SWEEP_INTERVAL
        await pool.aclose()


async def test_the_sweep_returns_at_once_without_httpcores_pool(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpx_pool, "connection_pool_of", httpx_pool.out_of_reach)
    pool = HttpxPool(
        ConnectionSettings(transport="httpx"),
        max_connections=1,
        max_keepalive=1,
        keepalive_expiry=4,
    )
    started = trio.current_time()
    await pool.keep_spare(Origin("http", "127.0.0.1", 9), 5.0)
    assert trio.current_time() == started
    assert pool.connections() == []
    await pool.aclose()
