"""Upstreams as they really behave, over both transports (lean and httpx), through the proxy:
keep-alive races retried and never reported, the ejection rules, HTTPS with a throwaway CA and
mTLS, HTTP proxies (a CONNECT tunnel the proxy must see, absolute-form for http, the
environment's HTTP(S)_PROXY / NO_PROXY), and health checks made the way requests are.

Every upstream here is the fake (``proxy.testing.fake_upstream``) with one real server's habit
switched on, on 127.0.0.1, port 0.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import pytest
import trio
import trustme

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
            upstream={"health_check_path": "/v1/models", "health_check_interval": 0.05},
        )
        await fake.recorder.wait_for(lambda r: any(x.path == "/v1/models" for x in r.records))
        assert_streamed(await ask(client, proxy, "m"))
        await trio.sleep(0.2)  # a few more checks: each one passes
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
            upstream={"health_check_path": "/v1/models", "health_check_interval": 0.05},
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
