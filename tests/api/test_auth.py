"""Client keys, per-key limits, the public-bind guard and CORS.

The window arithmetic is tested sans-IO with explicit times (no socket, no clock); the HTTP
behaviour over real sockets with small limits, each test under ``fail_after``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from proxy.api.auth import (
    CORS_EXPOSED_HEADERS,
    CorsPolicy,
    KeyRing,
    RateWindow,
    bearer_token,
    hash_key,
)
from proxy.cli import main
from proxy.config import (
    ConfigError,
    KeyConfig,
    check_public_bind,
    config_from_mapping,
    is_loopback,
    load_config,
    placeholder_keys,
)
from proxy.protocol.errors import ApiError
from tests.ops.test_metrics import scrape, value
from tests.support import DEADLINE, Fake, chat_body, sse_payloads, start_proxy

CHAT = "/v1/chat/completions"
SECRET = "sk-sluice-test-0123456789"
OTHER_SECRET = "sk-sluice-other-9876543210"


def key_table(secret: str = SECRET, name: str = "alice", **limits: int) -> dict[str, Any]:
    return {"name": name, "sha256": hash_key(secret), **limits}


def bearer(secret: str = SECRET) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def build(data: dict[str, Any], **env: str) -> Any:
    return config_from_mapping(data, "test.toml", env=env)


def ring(*tables: dict[str, Any]) -> KeyRing:
    return KeyRing(build({"keys": list(tables)}).keys)


# -- sans-IO: hashing, parsing, the window, admission ------------------------------------------


def test_hash_key_is_hex_sha256_of_utf8() -> None:
    assert hash_key("sk-abc") == hashlib.sha256(b"sk-abc").hexdigest()
    assert hash_key("clé") == hashlib.sha256("clé".encode()).hexdigest()
    assert len(hash_key("x")) == 64


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer abc", "abc"),
        ("bearer abc", "abc"),
        ("BEARER   abc  ", "abc"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic YWxhZGRpbjpvcGVuc2VzYW1l", None),
        ("abc", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


def test_rate_window_admits_limit_per_period_and_says_when_next() -> None:
    window = RateWindow(2, period=60.0)
    assert window.wait(0.0) == 0.0
    window.admit(0.0)
    assert window.wait(10.0) == 0.0
    window.admit(10.0)
    # Full: the oldest admission (t=0) leaves the window at t=60.
    assert window.wait(10.0) == pytest.approx(50.0)
    assert window.wait(59.5) == pytest.approx(0.5)
    assert window.wait(60.0) == 0.0
    window.admit(60.0)
    # Now t=10 is the oldest: free again at t=70.
    assert window.wait(61.0) == pytest.approx(9.0)
    assert window.wait(1000.0) == 0.0
    assert len(window) == 0  # expired admissions are dropped: memory follows the window


def test_rate_window_memory_is_bounded_by_the_limit() -> None:
    window = RateWindow(3)
    now = 0.0
    for _ in range(1000):
        if window.wait(now) == 0.0:
            window.admit(now)
        assert len(window) <= 3
        now += 0.5
    with pytest.raises(ValueError, match="unlimited"):
        RateWindow(0)


def test_admit_rate_limit_with_retry_after() -> None:
    keys = ring(key_table(requests_per_minute=2))
    (key,) = build({"keys": [key_table(requests_per_minute=2)]}).keys
    keys.admit(key, 100.0).release()
    keys.admit(key, 130.2).release()
    with pytest.raises(ApiError) as info:
        keys.admit(key, 131.0)
    error = info.value
    assert (error.status, error.type, error.code) == (
        429,
        "rate_limit_error",
        "rate_limit_exceeded",
    )
    # Free at t=160: 29 s from t=131. OpenAI's request-window headers say the same, as the
    # token budget's refusal does for tokens.
    assert error.headers["Retry-After"] == "29"
    assert error.headers["x-ratelimit-limit-requests"] == "2"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.headers["x-ratelimit-reset-requests"] == "29s"
    assert "x-ratelimit-reset-requests" in CORS_EXPOSED_HEADERS
    with pytest.raises(ApiError) as info:
        keys.admit(key, 159.9)
    assert info.value.headers["Retry-After"] == "1"  # never "0": that invites a busy loop
    keys.admit(key, 160.0).release()


def test_admit_concurrency_is_held_until_release_and_refusals_cost_no_rate() -> None:
    table = key_table(requests_per_minute=3, max_concurrent_streams=1)
    keys = ring(table)
    (key,) = build({"keys": [table]}).keys
    lease = keys.admit(key, 0.0)
    assert keys.streams("alice") == 1
    for _ in range(5):
        with pytest.raises(ApiError) as info:
            keys.admit(key, 1.0)
        assert info.value.code == "concurrency_limit_exceeded"
        assert info.value.headers["Retry-After"] == "1"
    lease.release()
    lease.release()  # idempotent: a second release must not free someone else's slot
    assert keys.streams("alice") == 0
    # The five refusals did not use up the window: two more requests fit in this minute.
    keys.admit(key, 2.0).release()
    keys.admit(key, 3.0).release()
    with pytest.raises(ApiError, match="Rate limit"):
        keys.admit(key, 4.0)


def test_limits_are_per_key() -> None:
    tables = [
        key_table(max_concurrent_streams=1),
        key_table(OTHER_SECRET, "bob", max_concurrent_streams=1),
    ]
    config = build({"keys": tables})
    keys = KeyRing(config.keys)
    alice, bob = config.keys
    keys.admit(alice, 0.0)
    keys.admit(bob, 0.0)  # alice's stream does not count against bob
    assert (keys.streams("alice"), keys.streams("bob")) == (1, 1)
    assert not KeyRing.limited(KeyConfig(name="x", sha256="0" * 64))


def test_identify_compares_every_digest_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    tables = [key_table(name=f"k{i}", secret=f"secret-{i}") for i in range(5)]
    keys = ring(*tables)
    calls: list[bytes] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return bool(compare(a, b))

    # auth.py looks compare_digest up on the hmac module at each call.
    monkeypatch.setattr(hmac, "compare_digest", counting)
    for presented in ("secret-0", "secret-4", "wrong"):
        calls.clear()
        with contextlib.suppress(ApiError):
            keys.identify(f"Bearer {presented}")
        # The first key matching stops nothing: all five digests are compared every time.
        assert len(calls) == 5, presented
    assert keys.identify("Bearer secret-3").name == "k3"


def test_identify_refuses_with_openai_shaped_401() -> None:
    keys = ring(key_table())
    assert keys.enabled and not KeyRing([]).enabled
    for header in (None, "Bearer nope", f"Basic {SECRET}", SECRET):
        with pytest.raises(ApiError) as info:
            keys.identify(header)
        error = info.value
        assert (error.status, error.type, error.code) == (
            401,
            "invalid_request_error",
            "invalid_api_key",
        )
        assert error.headers == {"WWW-Authenticate": "Bearer"}
        assert SECRET not in error.message  # a presented key is never echoed


def test_cors_policy() -> None:
    off = CorsPolicy([])
    assert not off.enabled and off.allow_origin("https://a.example") is None
    listed = CorsPolicy(["https://App.example", "http://localhost:3000"])
    assert listed.allow_origin("https://app.example") == "https://app.example"
    assert listed.allow_origin("http://localhost:3000") == "http://localhost:3000"
    assert listed.allow_origin("https://evil.example") is None
    assert listed.allow_origin(None) is None
    assert listed.varies
    wildcard = CorsPolicy(["*"])
    assert wildcard.allow_origin("https://any.example") == "*" and not wildcard.varies


# -- config ------------------------------------------------------------------------------------


def test_keys_config() -> None:
    digest = hash_key(SECRET)
    config = build(
        {
            "keys": [
                {"name": "a", "sha256": digest.upper(), "requests_per_minute": 60},
                {"name": "b", "sha256": hash_key("other"), "max_concurrent_streams": 2},
            ]
        }
    )
    a, b = config.keys
    assert (a.name, a.sha256, a.requests_per_minute, a.max_concurrent_streams) == (
        "a",
        digest,  # normalized to lowercase
        60,
        0,
    )
    assert (b.requests_per_minute, b.max_concurrent_streams) == (0, 2)
    assert build({}).keys == ()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([{"name": "a", "sha256": hash_key("k"), "rpm": 5}], r"unknown key 'rpm' in \[\[keys\]\]"),
        ([{"name": "a", "sha256": SECRET}], "64 hex digits"),
        ([{"name": "a", "sha256": hash_key("k")[:-1]}], "64 hex digits"),
        ([{"name": "a"}], "64 hex digits"),
        ([{"sha256": hash_key("k")}], "needs 'name'"),
        ([{"name": "a", "sha256": hash_key("k"), "requests_per_minute": -1}], "'requests_per"),
        ([{"name": "a", "sha256": hash_key("k"), "max_concurrent_streams": 1.5}], "integer"),
        ([key_table(name="a"), key_table("other", name="a")], "used by another key"),
        ([key_table(name="a"), key_table(name="b")], "configured twice"),
        ({"name": "a"}, "array of tables"),
        (["a"], "must be a table"),
    ],
)
def test_keys_config_errors(keys: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build({"keys": keys})


def test_unknown_sections_list_keys() -> None:
    with pytest.raises(ConfigError, match="keys, limits, models"):
        build({"key": []})


def test_cors_origins_config() -> None:
    origins = ("https://app.example", "http://localhost:3000", "*")
    assert build({"server": {"cors_origins": list(origins)}}).server.cors_origins == origins
    env = build({}, SLUICE_SERVER_CORS_ORIGINS="https://a.example, https://b.example")
    assert env.server.cors_origins == ("https://a.example", "https://b.example")
    for bad in ("https://app.example/", "app.example", "https://app.example/path", "ftp://h"):
        with pytest.raises(ConfigError, match="is not an origin"):
            build({"server": {"cors_origins": [bad]}})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.10.20.30", True),
        ("::1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_public_bind_needs_keys_or_an_explicit_opt_out() -> None:
    public = {"host": "0.0.0.0"}
    with pytest.raises(ConfigError, match=r"refusing to listen on '0.0.0.0' without API keys"):
        check_public_bind(build({"server": public}))
    check_public_bind(build({"server": public, "keys": [key_table()]}))
    check_public_bind(build({"server": {**public, "allow_unauthenticated": True}}))
    check_public_bind(build({}))  # the default host is loopback
    check_public_bind(build({"server": {"host": "::1"}}))
    # Env and CLI overrides are guarded alike: the check reads the final config.
    with pytest.raises(ConfigError, match="allow_unauthenticated = true"):
        check_public_bind(build({}, SLUICE_SERVER_HOST="::"))
    with pytest.raises(ConfigError, match="without API keys"):
        check_public_bind(load_config(None, env={}, host="0.0.0.0"))


# -- CLI ---------------------------------------------------------------------------------------


def _snippet_config(out: str) -> Any:
    digest, blank, *snippet = out.splitlines()
    assert blank == ""
    data = tomllib.loads("\n".join(snippet))
    assert data["keys"][0]["sha256"] == digest
    return build(data)


def test_hash_key_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash-key", "--key", SECRET, "--name", 'ci "runner"']) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == hash_key(SECRET)
    config = _snippet_config(out)
    (key,) = config.keys
    assert (key.name, key.requests_per_minute, key.max_concurrent_streams) == (
        'ci "runner"',
        0,
        0,
    )
    # The pasted snippet admits exactly that key.
    keys = KeyRing(config.keys)
    assert keys.identify(f"Bearer {SECRET}").name == 'ci "runner"'
    with pytest.raises(ApiError):
        keys.identify(f"Bearer {OTHER_SECRET}")


def test_hash_key_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As from `echo "$KEY" | sluice hash-key`: the newline is not part of the key.
    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    assert main(["hash-key"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == hash_key(SECRET)
    assert KeyRing(_snippet_config(out).keys).identify(f"Bearer {SECRET}").name == "client"


@pytest.mark.parametrize("stdin", ["", "\n", "two words\n"])
def test_hash_key_refuses_empty_or_spaced_keys(
    stdin: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["hash-key"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "no whitespace" in captured.err


def test_serve_on_a_public_address_without_keys_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sluice.toml"
    config.write_text('[server]\nport = 0\n[models.m]\nupstreams = ["http://127.0.0.1:9"]\n')
    assert main(["serve", "--config", str(config), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "configuration error" in err
    assert "refusing to listen on '0.0.0.0' without API keys" in err


# -- over real sockets -------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    error: dict[str, Any] = body["error"]
    return error


async def test_keys_guard_the_api_but_not_health_or_metrics(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table()])
        url = proxy.url + CHAT
        cases = {
            "missing": await client.post(url, json=chat_body()),
            "wrong": await client.post(url, json=chat_body(), headers=bearer(OTHER_SECRET)),
            "scheme": await client.post(url, json=chat_body(), headers={"Authorization": SECRET}),
            "models": await client.get(proxy.url + "/v1/models"),
        }
        for case, response in cases.items():
            assert response.status_code == 401, case
            assert response.headers["www-authenticate"] == "Bearer", case
            error = error_of(response)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert "Missing API key" in error_of(cases["missing"])["message"]
        assert fake.recorder.records == []  # nothing unauthenticated reached the upstream

        response = await client.post(url, json=chat_body(), headers=bearer())
        assert response.status_code == 200
        assert sse_payloads(response.text)[-1] == "[DONE]"
        models = await client.get(proxy.url + "/v1/models", headers=bearer())
        assert models.status_code == 200

        assert (await client.get(proxy.url + "/healthz")).status_code == 200
        samples = await scrape(client, proxy)  # /metrics, without a key
        # The three refused completions count under "-": their bodies were never read. So do
        # their keys: a client inventing credentials cannot grow the metrics, while the
        # configured key's requests are its own.
        assert value(samples, "sluice_requests_total", model="-", status="401", key="-") == 3
        assert value(samples, "sluice_requests_total", model="fake-model", key="alice") == 1
        keys = {
            dict(labels)["key"] for (name, labels) in samples if name == "sluice_requests_total"
        }
        assert keys == {"-", "alice"}


async def test_no_keys_configured_means_no_auth(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(nursery, {"fake-model": [fake.url]})
        # Whatever Authorization a client sends is ignored (and never forwarded).
        response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer("x"))
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers  # CORS off by default


async def test_cors_preflight_and_headers_on_streamed_and_refused_responses(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    app_origin = "https://app.example"
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[key_table()],
            server={"cors_origins": [app_origin]},
        )
        url = proxy.url + CHAT
        # The preflight carries no key; it must succeed anyway.
        preflight = await client.options(
            url,
            headers={
                "Origin": app_origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": (
                    "authorization, content-type, x-request-id, x-stainless-os, bad header!"
                ),
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == app_origin
        methods = preflight.headers["access-control-allow-methods"]
        assert "POST" in methods and "GET" in methods
        allowed = {
            h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")
        }
        assert allowed >= {"authorization", "content-type", "x-request-id"}
        # An SDK's own headers are allowed; a malformed name is not echoed.
        assert "x-stainless-os" in allowed
        assert not any("bad" in name for name in allowed)
        assert "origin" in preflight.headers["vary"].lower()

        # A streamed response: the headers reach the relayed head.
        headers = {"Origin": app_origin, "X-Request-ID": "cors-1", **bearer()}
        async with client.stream("POST", url, json=chat_body(), headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["access-control-allow-origin"] == app_origin
            assert "x-request-id" in response.headers["access-control-expose-headers"].lower()
            assert "origin" in response.headers["vary"].lower()
            assert response.headers["x-request-id"] == "cors-1"
            text = "".join([chunk async for chunk in response.aiter_text()])
        assert sse_payloads(text)[-1] == "[DONE]"

        # A refusal is readable by the page too, so it can tell the user about the key.
        refused = await client.post(url, json=chat_body(), headers={"Origin": app_origin})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == app_origin

        # Another origin gets no grant, neither on the preflight nor on the response.
        evil = {"Origin": "https://evil.example"}
        denied = await client.options(
            url, headers={**evil, "Access-Control-Request-Method": "POST"}
        )
        assert "access-control-allow-origin" not in denied.headers
        response = await client.post(
            url, json=chat_body(stream=False), headers={**evil, **bearer()}
        )
        assert response.status_code == 200
        assert "access-control-allow-origin" not in response.headers
        assert "origin" in response.headers["vary"].lower()


async def test_cors_wildcard(nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient) -> None:
    with trio.fail_after(DEADLINE):
        proxy = await start_proxy(
            nursery, {"fake-model": [fake.url]}, server={"cors_origins": ["*"]}
        )
        response = await client.post(
            proxy.url + CHAT, json=chat_body(), headers={"Origin": "https://any.example"}
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"
        health = await client.get(proxy.url + "/healthz", headers={"Origin": "https://x.example"})
        assert health.headers["access-control-allow-origin"] == "*"
        assert json.loads(health.text)["status"] == "ok"


async def test_serving_a_public_address_without_keys_is_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(DEADLINE), pytest.raises(ConfigError, match="without API keys"):
        # Refused before binding: nothing listens on 0.0.0.0, even for a moment.
        await start_proxy(nursery, {"m": ["http://127.0.0.1:9"]}, server={"host": "0.0.0.0"})


def test_the_examples_placeholder_hash_is_found_by_name() -> None:
    root = Path(__file__).resolve().parents[2]
    example = load_config(root / "deploy" / "systemd" / "sluice.toml", env={})
    assert placeholder_keys(example) == ["team-a"]
    assert placeholder_keys(build({"keys": [key_table()]})) == []


async def test_a_placeholder_hash_is_served_with_a_loud_warning_naming_the_key(
    nursery: trio.Nursery, fake: Fake, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.app")
    placeholder = {"name": "team-b", "sha256": "0" * 64}
    with trio.fail_after(DEADLINE):
        await start_proxy(nursery, {"fake-model": [fake.url]}, keys=[key_table(), placeholder])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    flagged = [line for line in warnings if "placeholder sha256" in line]
    assert len(flagged) == 1, warnings
    assert "'team-b'" in flagged[0] and "alice" not in flagged[0]
