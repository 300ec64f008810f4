"""Identity from JWTs and forward auth (proxy/api/identity.py), mapped onto key profiles.

The decisions are tested sans-IO with explicit times; the key set's cooldown and refresh over
hours under virtual time (an in-memory source); the rest against real servers on 127.0.0.1: an
OIDC issuer serving its discovery document and key set (RSA and EC keys made by the test), a
forward-auth service, and the proxy itself on HTTP and WebSocket. Every I/O test runs under
``fail_after``.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
import trio
from cryptography.hazmat.primitives import serialization
from trio_websocket import open_websocket_url

from proxy.api.auth import KeyRing, hash_key
from proxy.api.identity import (
    ForwardCache,
    HttpJsonSource,
    Identity,
    JwtIssuer,
    KeySet,
    RefetchPolicy,
    Refused,
    check_times,
    map_claims,
    parse_key_set,
    unverified_parts,
)
from proxy.config import ConfigError, JwtIssuerConfig, config_from_mapping, key_of_account
from proxy.protocol.errors import ApiError
from tests.api.issuer import Issuer, Signer, start_issuer, start_service
from tests.api.test_reload import serve_file
from tests.ops.test_metrics import scrape, value
from tests.support import DEADLINE, Fake, chat_body, poll_until, start_proxy

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
SECRET = "sk-sluice-static-0123456789"
PROFILES = [
    {"name": "batch"},
    {"name": "chat"},
    {"name": "static", "sha256": hash_key(SECRET)},
]


def jwt_table(issuer: str, **overrides: Any) -> dict[str, Any]:
    return {
        "issuer": issuer,
        "audiences": ["sluice"],
        "cooldown": 60.0,
        "map": [
            {"claim": "groups", "value": "ml-batch", "key": "batch"},
            {"claim": "realm_access.roles", "value": "chatter", "key": "chat"},
        ],
        **overrides,
    }


def build(data: dict[str, Any]) -> Any:
    return config_from_mapping(data, "test.toml", env={})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# -- sans-IO -----------------------------------------------------------------------------------


def test_a_key_set_keeps_only_signing_keys_of_accepted_types() -> None:
    rsa, ec = Signer("RSA", "r1"), Signer("EC", "e1")
    document = {
        "keys": [
            rsa.jwk,
            ec.jwk,
            {"kty": "oct", "kid": "h1", "k": "c2VjcmV0"},  # HMAC: never a verifier
            {**Signer("RSA", "enc").jwk, "use": "enc"},
            {**rsa.jwk},  # the same kid again: the first stays
            {"kty": "RSA", "kid": "broken", "n": "??", "e": "AQAB"},
            "not a key",
        ]
    }
    keys = parse_key_set(document)
    assert sorted(keys) == ["e1", "r1"]
    with pytest.raises(Exception, match="not a JWK set"):
        parse_key_set({"keys": "no"})


def test_a_key_verifies_only_the_algorithm_of_its_type() -> None:
    rsa, ec = Signer("RSA", "r1"), Signer("EC", "e1")
    keys = KeySet(
        parse_key_set({"keys": [rsa.jwk, ec.jwk, {**Signer("RSA", "r2").jwk, "alg": "RS512"}]})
    )
    assert keys.key("r1", "RS256").algorithm_name == "RS256"
    assert keys.key("r1", "PS256").algorithm_name == "PS256"
    assert keys.key("e1", "ES256") is keys.key("e1", "ES256")  # made once
    for kid, algorithm in (("e1", "RS256"), ("r1", "ES256"), ("e1", "ES384"), ("r2", "RS256")):
        with pytest.raises(Refused) as refused:
            keys.key(kid, algorithm)
        assert refused.value.reason == "algorithm"


def test_times_are_checked_with_the_leeway() -> None:
    now = 1_000_000.0
    check_times({"exp": now + 1, "iat": now}, now, 0)
    check_times({"exp": now - 5, "iat": now, "nbf": now + 5}, now, 10)
    cases: dict[str, dict[str, Any]] = {
        "expired": {"exp": now - 11, "iat": now - 100},
        "not_yet_valid": {"exp": now + 100, "iat": now, "nbf": now + 11},
        "issued_in_future": {"exp": now + 100, "iat": now + 11},
        "missing_claim": {"iat": now},
        "malformed": {"exp": "soon", "iat": now},
    }
    for reason, claims in cases.items():
        with pytest.raises(Refused) as refused:
            check_times(claims, now, 10)
        assert refused.value.reason == reason
    with pytest.raises(Refused, match="no 'iat'"):
        check_times({"exp": now + 100}, now, 10)


def test_claims_map_onto_the_first_matching_profile_else_the_default() -> None:
    config = build(
        {
            "keys": PROFILES,
            "auth": {"jwt": [jwt_table("https://id.example", per_subject=False)]},
        }
    ).auth.jwt[0]
    assert map_claims({"groups": ["x", "ml-batch"]}, config) == ("batch", False)
    assert map_claims({"groups": "ml-batch"}, config) == ("batch", False)
    assert map_claims({"realm_access": {"roles": ["chatter"]}}, config) == ("chat", False)
    assert map_claims({"groups": ["ml-batchy"], "realm_access": "chatter"}, config) is None
    assert map_claims({"groups": [1, None]}, config) is None
    defaulted = JwtIssuerConfig(
        issuer="i", audiences=("a",), default_key="chat", per_subject=True, map=config.map
    )
    assert map_claims({}, defaulted) == ("chat", True)
    assert map_claims({"groups": "ml-batch"}, defaulted) == ("batch", True)


def test_a_token_is_refused_by_size_and_shape_before_any_verification() -> None:
    with pytest.raises(Refused) as refused:
        unverified_parts("a." + "b" * 9000 + ".c", 8192)
    assert refused.value.reason == "too_large"
    for token in ("%%%.e30.x", "e30.bm90IGpzb24.x", "W10.e30.x"):
        with pytest.raises(Refused) as refused:
            unverified_parts(token, 8192)
        assert refused.value.reason == "malformed"


def test_the_refetch_cooldown_and_the_forward_cache() -> None:
    policy = RefetchPolicy(60)
    assert policy.allows(0)
    policy.fetched(0)
    assert not policy.allows(59.9)
    assert policy.allows(60)
    cache = ForwardCache(5, size=2)
    cache.put(b"a", "A", 0)
    cache.put(b"b", "B", 1)
    assert cache.get(b"a", 4.9) == "A"
    assert cache.get(b"a", 5) is None  # expired
    cache.put(b"c", "C", 2)
    cache.put(b"d", "D", 2)  # the oldest goes
    assert cache.get(b"b", 2) is None
    assert len(cache) == 2
    off = ForwardCache(0)
    off.put(b"a", "A", 0)
    assert off.get(b"a", 0) is None


@pytest.mark.parametrize(
    ("auth", "message"),
    [
        ({"jwt": [{"issuer": "https://id.example"}]}, "needs 'audiences'"),
        ({"jwt": [jwt_table("https://id.example", algorithms=["HS256"])]}, "asymmetric"),
        ({"jwt": [jwt_table("https://id.example", algorithms=["none"])]}, "asymmetric"),
        ({"jwt": [jwt_table("http://id.example")]}, "https://"),
        ({"jwt": [jwt_table("https://id.example", jwks_url="http://10.0.0.1/k")]}, "https://"),
        ({"jwt": [jwt_table("https://id.example", colldown=1)]}, "unknown key 'colldown'"),
        (
            {
                "jwt": [
                    jwt_table("https://id.example", map=[{"claim": "g", "value": "v", "key": "x"}])
                ]
            },
            "no [[keys]] entry",
        ),
        (
            {"jwt": [jwt_table("https://id.example", map=[{"claim": "g", "key": "batch"}])]},
            "needs 'value'",
        ),
        ({"jwt": [jwt_table("https://id.example", default_key="nobody")]}, "no [[keys]] entry"),
        ({"jwt": [jwt_table("https://a.example"), jwt_table("https://a.example")]}, "twice"),
        ({"forward_url": "http://auth:9000/check", "on_error": "allow"}, "set default_key"),
        ({"forward_url": "ftp://auth/check"}, "'forward_url'"),
        ({"jwt": "x"}, "[[auth.jwt]] tables"),
    ],
)
def test_auth_config_errors(auth: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        build({"keys": PROFILES, "auth": auth})
    assert message in str(error.value)


def test_a_profile_without_sha256_needs_auth_and_the_environment_cannot_set_issuers() -> None:
    with pytest.raises(ConfigError, match="'sha256'"):
        build({"keys": [{"name": "batch"}]})
    with pytest.raises(ConfigError, match="not the environment"):
        config_from_mapping({}, "t", env={"SLUICE_AUTH_JWT": "x"})
    env = config_from_mapping(
        {"keys": PROFILES, "auth": {"jwt": [jwt_table("https://id.example")]}},
        "t",
        env={"SLUICE_AUTH_MAX_TOKEN_BYTES": "4096"},
    )
    assert env.auth.max_token_bytes == 4096
    assert env.auth.jwt[0].map[1].claim == "realm_access.roles"


# -- the key set over hours, under virtual time ------------------------------------------------


class MemorySource:
    """An issuer's documents in memory, each fetch counted (the JsonSource seam)."""

    def __init__(self, issuer: str, *signers: Signer) -> None:
        self.issuer = issuer
        self.signers = list(signers)
        self.fetches = 0
        self.down = False

    async def get_json(self, url: str) -> object:
        from proxy.api.identity import FetchError

        await trio.sleep(0.01)
        if self.down:
            raise FetchError("connection refused")
        self.fetches += 1
        return {"keys": [signer.jwk for signer in self.signers]}


def sign(signer: Signer, now: float, lifetime: float = 300, **claims: Any) -> str:
    payload = {
        "iss": "https://id.example",
        "aud": "sluice",
        "sub": "alice",
        "iat": int(now),
        "exp": int(now + lifetime),
        **claims,
    }
    return jwt.encode(
        payload, signer.private, algorithm=signer.algorithm, headers={"kid": signer.kid}
    )


async def test_unknown_kids_fetch_once_per_cooldown_and_refresh_keeps_up_over_hours(
    autojump_clock: trio.testing.MockClock,
) -> None:
    epoch = 1_700_000_000.0
    old, new = Signer("RSA", "old"), Signer("EC", "new")
    source = MemorySource("https://id.example", old)
    config = JwtIssuerConfig(
        issuer="https://id.example",
        audiences=("sluice",),
        jwks_url="https://id.example/jwks",
        cooldown=300,
        refresh_seconds=3600,
    )
    issuer = JwtIssuer(config, source, wall=lambda: epoch + trio.current_time())

    def now() -> float:
        return epoch + trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(issuer.run)
        await trio.sleep(1)
        assert source.fetches == 1
        token = sign(old, now())
        claims = await issuer.verify(token, jwt.get_unverified_header(token))
        assert claims["sub"] == "alice"
        # A flood of made-up kids for 6 hours: one fetch per cooldown at most, besides the
        # hourly refreshes; each made-up kid refused.
        refused = 0
        for _ in range(6 * 3600 // 10):
            forged = sign(old, now()).replace(*_kid_swap(old.kid))
            try:
                await issuer.verify(forged, {"alg": "RS256", "kid": f"made-up-{refused}"})
            except Refused as error:
                assert error.reason == "unknown_kid"
                refused += 1
            await trio.sleep(10)
        assert refused == 6 * 3600 // 10
        assert source.fetches <= 1 + 6 * 3600 // 300 + 6 + 1
        # A new key published ahead of use is picked up by the refresh: the first token it
        # signs passes without a refetch.
        source.signers.append(new)
        await trio.sleep(3600)
        fetches = source.fetches
        token = sign(new, now())
        await issuer.verify(token, jwt.get_unverified_header(token))
        assert source.fetches == fetches
        # A token past its exp (and the leeway) is refused, on the same clock.
        await trio.sleep(300 + 31)
        with pytest.raises(Refused) as refused_token:
            await issuer.verify(token, jwt.get_unverified_header(token))
        assert refused_token.value.reason == "expired"
        # The issuer down: cached keys still verify, an unknown kid is refused.
        source.down = True
        await trio.sleep(3600)
        token = sign(new, now())
        await issuer.verify(token, jwt.get_unverified_header(token))
        with pytest.raises(Refused):
            await issuer.verify(token, {"alg": "ES256", "kid": "unknown"})
        nursery.cancel_scope.cancel()


def _kid_swap(kid: str) -> tuple[str, str]:
    return kid, kid  # the header passed to verify() names the kid; the token's is irrelevant


# -- against a real issuer, through the proxy ---------------------------------------------------


async def start_identity_proxy(
    nursery: trio.Nursery, fake: Fake, issuer: Issuer, **jwt_overrides: Any
) -> Any:
    proxy = await start_proxy(
        nursery,
        {"fake-model": [fake.url]},
        keys=[
            {"name": "batch", "requests_per_minute": 1000},
            {"name": "chat"},
            {"name": "static", "sha256": hash_key(SECRET)},
        ],
        auth={"jwt": [jwt_table(issuer.issuer, **jwt_overrides)]},
    )
    await keys_fetched(proxy.state)
    return proxy


async def keys_fetched(state: Any) -> None:
    """Returns once each issuer's first fetch of its key set, begun as the app started, has
    brought the keys. Until then a token waits for that fetch only until unknown_kid_wait
    (0.5 s) after it began, then is refused: on a loaded machine a test's first request could
    come that late, and be refused for a reason that is not what the test is about."""
    issuers = state.current.identity.issuers.values()
    await poll_until(lambda: all(issuer.fetches for issuer in issuers))
    assert all(len(issuer.keys) for issuer in issuers)


async def test_a_token_is_admitted_on_http_and_websocket_and_counted_under_its_key(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA", "EC")
        proxy = await start_identity_proxy(nursery, fake, issuer)
        rsa = issuer.token(issuer.signers[0], groups=["ml-batch"])
        ec = issuer.token(issuer.signers[1], realm_access={"roles": ["chatter"]})
        with caplog.at_level(logging.INFO, logger="sluice.access"):
            for token in (rsa, ec):
                response = await client.post(
                    proxy.url + CHAT, json=chat_body(), headers=bearer(token)
                )
                assert response.status_code == 200, response.text
            # Static keys keep working beside them.
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(SECRET))
            assert response.status_code == 200
            # Anthropic's SDK sends its key as x-api-key: a token there works too.
            response = await client.post(
                proxy.url + MESSAGES,
                json={
                    "model": "fake-model",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers={"x-api-key": rsa, "anthropic-version": "2023-06-01"},
            )
            assert response.status_code == 200, response.text
        keys = [
            json.loads(r.getMessage())["key"] for r in caplog.records if r.name == "sluice.access"
        ]
        assert keys == ["batch", "chat", "static", "batch"]
        ws_url = proxy.url.replace("http://", "ws://") + "/v1/ws"
        async with open_websocket_url(
            ws_url, extra_headers=[(b"authorization", f"Bearer {ec}".encode())]
        ) as ws:
            await ws.send_message(json.dumps(chat_body()))
            while True:
                message = json.loads(await ws.get_message())
                assert message["type"] != "error", message
                if message["type"] == "done":
                    break
        samples = await scrape(client, proxy)
        assert (
            value(
                samples, "sluice_requests_total", model="fake-model", key="batch", endpoint="chat"
            )
            == 1
        )
        assert (
            value(samples, "sluice_requests_total", model="fake-model", key="chat", endpoint="chat")
            == 2
        )
        assert value(samples, "sluice_jwks_fetches_total", outcome="ok") == 1


async def test_each_bad_token_is_refused_with_its_reason_in_both_error_shapes(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")
        other = await start_issuer(nursery, "RSA")
        proxy = await start_identity_proxy(nursery, fake, issuer)
        signer = issuer.signers[0]
        now = time.time()
        public_pem = signer.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        good = issuer.token(groups="ml-batch")
        header, claims, _ = good.split(".")
        # Another subject's claims under this token's signature.
        tampered = issuer.token(groups="ml-batch", sub="mallory").split(".")[1]
        none_header = (
            base64.urlsafe_b64encode(json.dumps({"alg": "none", "kid": signer.kid}).encode())
            .rstrip(b"=")
            .decode()
        )
        hs_header = (
            base64.urlsafe_b64encode(
                json.dumps({"alg": "HS256", "kid": signer.kid, "typ": "JWT"}).encode()
            )
            .rstrip(b"=")
            .decode()
        )
        import hashlib
        import hmac

        hs_signature = (
            base64.urlsafe_b64encode(
                hmac.new(public_pem, f"{hs_header}.{claims}".encode(), hashlib.sha256).digest()
            )
            .rstrip(b"=")
            .decode()
        )
        cases = {
            "expired": (issuer.token(groups="ml-batch", now=now - 3600), "expired", "expired"),
            "not yet valid": (
                issuer.token(groups="ml-batch", nbf=int(now + 600)),
                "not_yet_valid",
                "not valid yet",
            ),
            "issued in the future": (
                issuer.token(groups="ml-batch", now=now + 600),
                "issued_in_future",
                "future",
            ),
            "wrong issuer": (other.token(groups="ml-batch"), "issuer", "issuer"),
            "iss claim forged": (
                issuer.token(groups="ml-batch", iss="https://evil.example"),
                "issuer",
                "issuer",
            ),
            "wrong audience": (
                issuer.token(groups="ml-batch", aud="other-service"),
                "audience",
                "aud",
            ),
            "no audience": (issuer.token(groups="ml-batch", aud=None), "missing_claim", "aud"),
            "alg none": (f"{none_header}.{claims}.", "algorithm", "not accepted"),
            "HS256 with the public key": (
                f"{hs_header}.{claims}.{hs_signature}",
                "algorithm",
                "not accepted",
            ),
            "bad signature": (
                f"{header}.{tampered}.{good.split('.')[2]}",
                "signature",
                "signature",
            ),
            "oversized": (good + "." * 0 + "A" * 9000, "too_large", "over 8192"),
            "malformed base64": (f"{header}.%%%%.{good.split('.')[2]}", "malformed", "well-formed"),
            "unknown kid": (
                issuer.token(Signer("RSA", "made-up"), groups="ml-batch"),
                "unknown_kid",
                "signing key",
            ),
        }
        reasons: dict[str, int] = {}
        for case, (token, reason, text) in cases.items():
            reasons[reason] = reasons.get(reason, 0) + 1
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(token))
            assert response.status_code == 401, case
            challenge = response.headers["www-authenticate"]
            assert challenge.startswith('Bearer error="invalid_token"'), case
            assert text in error_of(response)["message"], (case, error_of(response))
            assert error_of(response)["code"] == "invalid_token"
            assert token not in response.text
        # The same refusal in Anthropic's shape on /v1/messages.
        response = await client.post(
            proxy.url + MESSAGES,
            json={
                "model": "fake-model",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"x-api-key": cases["expired"][0], "anthropic-version": "2023-06-01"},
        )
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"
        # Valid but mapped onto nothing: 403.
        unmapped = issuer.token(groups=["interns"])
        response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(unmapped))
        assert response.status_code == 403
        assert error_of(response)["code"] == "permission_denied"
        response = await client.post(
            proxy.url + MESSAGES,
            json={
                "model": "fake-model",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"x-api-key": unmapped, "anthropic-version": "2023-06-01"},
        )
        assert (response.status_code, response.json()["error"]["type"]) == (403, "permission_error")
        assert fake.recorder.records == []
        samples = await scrape(client, proxy)
        reasons["expired"] += 1  # the Anthropic-shaped one
        for reason, count in reasons.items():
            counted = value(samples, "sluice_auth_refusals_total", method="jwt", reason=reason)
            assert counted == count, reason
        assert value(samples, "sluice_auth_refusals_total", method="jwt", reason="unmapped") == 2
        assert (
            value(samples, "sluice_requests_total", model="-", status="401", key="-")
            == len(cases) + 1
        )


async def test_an_unmapped_token_takes_the_default_key(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "EC")
        proxy = await start_identity_proxy(nursery, fake, issuer, default_key="chat")
        response = await client.post(
            proxy.url + CHAT, json=chat_body(), headers=bearer(issuer.token(groups="interns"))
        )
        assert response.status_code == 200
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_requests_total", model="fake-model", key="chat") == 1
        # RFC 9728: the protected resource's metadata names the issuer.
        metadata = (await client.get(proxy.url + "/.well-known/oauth-protected-resource")).json()
        assert metadata["authorization_servers"] == [issuer.issuer]
        assert metadata["resource"] == proxy.url


async def test_a_rotation_during_a_stream_of_requests_refuses_none(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")
        # The first tokens of the new kid wait for the fetch they start: on a loaded machine
        # that fetch (the issuer is served in this process) can take longer than the default
        # half second, which is not what this test is about.
        proxy = await start_identity_proxy(
            nursery, fake, issuer, cooldown=3600.0, unknown_kid_wait=5.0
        )
        old = issuer.signers[0]
        new = Signer("EC")
        statuses: list[int] = []

        async def ask(token: str) -> None:
            response = await client.post(
                proxy.url + CHAT, json=chat_body(stream=False), headers=bearer(token)
            )
            statuses.append(response.status_code)

        for _ in range(5):
            await ask(issuer.token(old, groups="ml-batch"))
        # The issuer publishes the new key and signs with it at once (no publishing ahead):
        # the first token of the new kid fetches the set again; the old key's tokens pass.
        issuer.signers.append(new)
        async with trio.open_nursery() as requests:
            for index in range(20):
                signer = new if index % 2 else old
                requests.start_soon(ask, issuer.token(signer, groups="ml-batch"))
        # The old key goes: its tokens already minted pass until they expire (the cached set),
        # new ones pass too.
        issuer.signers.remove(old)
        for _ in range(5):
            await ask(issuer.token(new, groups="ml-batch"))
        assert statuses == [200] * 30
        assert issuer.jwks_fetches == 2  # at start, then once for the new kid


async def test_a_thousand_made_up_kids_cost_one_fetch_per_cooldown(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")
        proxy = await start_identity_proxy(nursery, fake, issuer, cooldown=3600.0)
        identity = proxy.state.current.identity
        good = issuer.token(groups="ml-batch")
        assert (
            await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(good))
        ).status_code == 200
        fetches = issuer.jwks_fetches
        forger = Signer("RSA")
        refused = 0
        for number in range(1000):
            forger.kid = f"made-up-{number}"
            token = issuer.token(forger, groups="ml-batch")
            try:
                await identity.identify({"Authorization": f"Bearer {token}"}, "POST", CHAT)
            except ApiError as error:
                assert error.status == 401
                refused += 1
        assert refused == 1000
        assert issuer.jwks_fetches - fetches == 1
        # Through HTTP too (fewer, the machine is small): no fetch more within the cooldown.
        for number in range(50):
            forger.kid = f"http-{number}"
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(),
                headers=bearer(issuer.token(forger, groups="ml-batch")),
            )
            assert response.status_code == 401
        assert issuer.jwks_fetches - fetches == 1


async def test_with_the_issuer_down_cached_keys_admit_and_unknown_kids_are_refused_at_once(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")
        proxy = await start_identity_proxy(nursery, fake, issuer, cooldown=0.05)
        good = issuer.token(groups="ml-batch")
        assert (
            await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(good))
        ).status_code == 200
        issuer.server.stop()
        await trio.sleep(0.1)  # past the cooldown: the next unknown kid tries the issuer
        for number in range(20):
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(good))
            assert response.status_code == 200
            forger = Signer("RSA", f"unknown-{number}")
            started = trio.current_time()
            response = await client.post(
                proxy.url + CHAT,
                json=chat_body(),
                headers=bearer(issuer.token(forger, groups="ml-batch")),
            )
            assert response.status_code == 401
            assert trio.current_time() - started < 0.1
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_jwks_fetches_total", outcome="error") >= 1


async def test_a_hung_issuer_holds_unknown_kids_at_most_unknown_kid_wait_and_fetches_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The issuer accepts the connection, reads the request and never answers (a real socket
    on 127.0.0.1; Sluice's own httpx client), under virtual time. Requests with a kid it has
    not seen share the one fetch and wait for it until unknown_kid_wait after it began (0.5 s),
    no longer; later ones, and every one once the fetch has failed, are refused at once; tokens
    of cached keys pass meanwhile without waiting."""
    with trio.fail_after(600):
        issuer = await start_issuer(nursery, "RSA")
        config = JwtIssuerConfig(
            issuer=issuer.issuer, audiences=("sluice",), cooldown=60.0, fetch_timeout=5.0
        )
        assert config.unknown_kid_wait == 0.5
        async with httpx.AsyncClient() as http, trio.open_nursery() as inner:
            checker = JwtIssuer(config, HttpJsonSource(http))
            await inner.start(checker.run)
            await trio.sleep(1)
            assert len(checker.keys) == 1  # the discovery document and the key set
            cached = issuer.token()
            new = Signer("EC")
            issuer.signers.append(new)  # published, and never served: the issuer hangs
            issuer.delay = math.inf
            connections = issuer.server.connections

            async def refused_after(token: str) -> float:
                started = trio.current_time()
                with pytest.raises(Refused) as refused:
                    await checker.verify(token, jwt.get_unverified_header(token))
                assert refused.value.reason == "unknown_kid"
                return trio.current_time() - started

            async def admitted_after(token: str) -> float:
                started = trio.current_time()
                await checker.verify(token, jwt.get_unverified_header(token))
                return trio.current_time() - started

            waits: list[float] = []
            passes: list[float] = []

            async def refuse(token: str) -> None:
                waits.append(await refused_after(token))

            async def admit(token: str) -> None:
                passes.append(await admitted_after(token))

            async with trio.open_nursery() as requests:
                for _ in range(50):
                    requests.start_soon(refuse, issuer.token(new))
                    requests.start_soon(admit, cached)
            # Fifty unknown-kid requests at once: one fetch, each refused when the wait ends.
            assert waits == [0.5] * 50
            assert passes == [0.0] * 50
            assert issuer.server.connections == connections + 1
            # The fetch still hangs: a request past its wait is refused at once.
            await trio.sleep(1)
            assert await refused_after(issuer.token(new)) == 0.0
            # The fetch gives up at fetch_timeout; until one answers, nothing waits.
            await trio.sleep(5)
            assert not answering(checker)
            await trio.sleep(60)  # past the cooldown: the next unknown kid fetches again
            assert await refused_after(issuer.token(new)) == 0.0
            await trio.sleep(0.1)
            assert issuer.server.connections == connections + 2
            assert await admitted_after(cached) == 0.0
            # The issuer answers again. The last fetch failed, so the next unknown kid past the
            # cooldown is still refused at once, and the fetch it starts brings the new key.
            issuer.delay = 0.0
            await trio.sleep(60)
            assert await refused_after(issuer.token(new)) == 0.0
            await trio.sleep(0.1)
            assert answering(checker)
            assert await admitted_after(issuer.token(new)) == 0.0
            inner.cancel_scope.cancel()


def answering(checker: JwtIssuer) -> bool:
    """Whether the issuer's last fetch brought its key set (read afresh: it changes while the
    test awaits)."""
    return checker.answering


async def test_through_the_proxy_a_hung_issuer_costs_an_unknown_kid_half_a_second_at_most(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    """The same, on real time, over HTTP: the refusal's latency measured."""
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")
        proxy = await start_identity_proxy(nursery, fake, issuer, cooldown=0.5)
        good = issuer.token(groups="ml-batch")
        assert (
            await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(good))
        ).status_code == 200
        issuer.delay = math.inf
        connections = issuer.server.connections
        statuses: list[int] = []
        took: list[float] = []

        async def ask(token: str) -> None:
            started = trio.current_time()
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(token))
            took.append(trio.current_time() - started)
            statuses.append(response.status_code)

        async with trio.open_nursery() as requests:
            for number in range(20):
                forger = Signer("RSA", f"unknown-{number}")
                requests.start_soon(ask, issuer.token(forger, groups="ml-batch"))
        assert statuses == [401] * 20
        assert issuer.server.connections == connections + 1  # one fetch for the twenty
        first = max(took)
        # Once the wait is over, and once the fetch failed: at once, and cached keys pass.
        took.clear()
        statuses.clear()
        await ask(issuer.token(Signer("RSA", "later"), groups="ml-batch"))
        await ask(good)
        assert statuses == [401, 200]
        print(
            f"hung issuer: unknown kid refused in {first * 1000:.0f} ms (20 at once), "
            f"then {took[0] * 1000:.1f} ms; a cached key admitted in {took[1] * 1000:.1f} ms"
        )
        assert 0.45 <= first < 0.5 + 0.25
        assert took[0] < 0.1


async def test_per_subject_limits_and_fair_shares_hold_for_two_subjects_of_one_key(
    nursery: trio.Nursery, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        from tests.support import start_fake

        fake = await start_fake(nursery, ttft=0.0, interval=0.0, tokens=3)
        issuer = await start_issuer(nursery, "RSA")
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=[
                {"name": "batch", "requests_per_minute": 2, "tokens_per_minute": 100000},
                {"name": "chat"},
            ],
            auth={"jwt": [jwt_table(issuer.issuer, per_subject=True)]},
        )
        await keys_fetched(proxy.state)
        tokens = {sub: issuer.token(groups="ml-batch", sub=sub) for sub in ("ann", "bob")}
        for sub in ("ann", "ann", "bob", "bob"):
            response = await client.post(
                proxy.url + CHAT, json=chat_body(), headers=bearer(tokens[sub])
            )
            assert response.status_code == 200, (sub, response.text)
        for sub in ("ann", "bob"):
            response = await client.post(
                proxy.url + CHAT, json=chat_body(), headers=bearer(tokens[sub])
            )
            assert response.status_code == 429, sub
            assert "'batch'" in error_of(response)["message"]
        keys = proxy.state.keys
        assert keys.subjects() == 2
        # The scheduler sees two tenants; the metrics one key.
        counters = proxy.state.scheduling.upstream.queue.counters
        tenants = sorted(tenant for tenant in counters if tenant)
        assert [key_of_account(t) for t in tenants] == ["batch", "batch"]
        assert len(tenants) == 2
        samples = await scrape(client, proxy)
        series = {
            dict(labels)["key"]
            for (name, labels) in samples
            if name.startswith(
                (
                    "sluice_requests_total",
                    "sluice_queue_wait_seconds",
                    "sluice_key_service",
                    "sluice_key_tokens",
                )
            )
            and "key" in dict(labels)
        }
        assert series <= {"batch", "-"}
        assert (
            value(samples, "sluice_requests_total", model="fake-model", key="batch", status="200")
            == 4
        )


async def test_forward_auth_admits_refuses_caches_and_bounds_its_calls(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        slow = {"on": False}

        async def decide(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
            if slow["on"]:
                await trio.sleep(5)
            token = headers.get("authorization", "")
            if token == "Bearer team-a":
                return 200, {"x-sluice-key": "batch"}, b""
            if token == "Bearer team-b":
                return 204, {"x-sluice-key": "chat", "x-sluice-subject": "bob"}, b""
            if token == "Bearer nokey":
                return 200, {}, b""
            if token == "Bearer banned":
                return 403, {}, b""
            return 401, {}, b""

        service = await start_service(nursery, decide)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=PROFILES,
            auth={"forward_url": service.url + "/check", "forward_timeout": 0.5},
        )

        async def status(token: str) -> int:
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(token))
            return response.status_code

        assert await status("team-a") == 200
        assert await status("team-a") == 200
        assert await status("team-b") == 200
        assert await status("nokey") == 403
        assert await status("banned") == 403
        assert await status("who") == 401
        assert await status(SECRET) == 200  # a static key never asks the service
        path, sent = service.requests[0]
        assert (path, sent["authorization"], sent["x-forwarded-uri"]) == (
            "/check",
            "Bearer team-a",
            CHAT,
        )
        assert len(service.requests) == 5  # team-a's second answer came from the cache
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_requests_total", model="fake-model", key="batch") == 2
        assert value(samples, "sluice_requests_total", model="fake-model", key="chat") == 1
        # The service hangs: answered 503 within the timeout (on_error = "deny").
        slow["on"] = True
        started = trio.current_time()
        assert await status("team-c") == 503
        assert trio.current_time() - started < 2


async def test_forward_auth_calls_once_for_a_credential_many_requests_miss_at_once(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    """Single flight: requests with the same credential that miss the cache together share
    one call (the service answers after 0.3 s); another credential has its own; a failure is
    shared too but not cached (the next request asks again), and a request that leaves while
    the call is under way does not fail the others."""
    with trio.fail_after(DEADLINE):
        failing = {"on": False}
        # While failing, the service answers only once the test has seen every request wait on
        # the call: a failure is not cached, so a request that came after a timed answer (a
        # loaded machine) would ask again, and the count of calls would say nothing.
        fail_now = trio.Event()

        async def decide(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
            if failing["on"]:
                await fail_now.wait()
                return 500, {}, b""
            await trio.sleep(0.3)
            if headers.get("authorization") in ("Bearer team-a", "Bearer team-b"):
                return 200, {"x-sluice-key": "batch"}, b""
            return 401, {}, b""

        service = await start_service(nursery, decide)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=PROFILES,
            # The failing call below is held until all twenty wait on it: no timeout first.
            auth={
                "forward_url": service.url + "/check",
                "forward_cache_seconds": 60.0,
                "forward_timeout": 10.0,
            },
        )

        def calls(token: str) -> int:
            return sum(1 for _, sent in service.requests if sent["authorization"] == token)

        statuses: dict[str, list[int]] = {}

        async def ask(token: str) -> None:
            response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(token))
            statuses.setdefault(token, []).append(response.status_code)

        async def leaves(token: str) -> None:
            with trio.move_on_after(0.1):
                await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer(token))

        async with trio.open_nursery() as requests:
            requests.start_soon(leaves, "team-a")  # the first to ask, gone before the answer
            await trio.sleep(0.05)
            for _ in range(20):
                requests.start_soon(ask, "team-a")
                requests.start_soon(ask, "team-b")
                requests.start_soon(ask, "who")
        assert statuses == {"team-a": [200] * 20, "team-b": [200] * 20, "who": [401] * 20}
        assert (calls("Bearer team-a"), calls("Bearer team-b"), calls("Bearer who")) == (1, 1, 1)
        # Cached, the service's refusal too: no call more.
        await ask("team-a")
        await ask("who")
        assert (calls("Bearer team-a"), calls("Bearer who")) == (1, 1)
        # The service fails: twenty at once share one failing call (503 each), and the failure
        # is not kept: the next request asks again, and is admitted once the service is back.
        failing["on"] = True
        identity = proxy.state.current.identity
        assert identity is not None and identity.forward is not None
        flights = identity.forward._flights

        def waiting() -> int:
            return sum(flight.done.statistics().tasks_waiting for flight in flights.values())

        async with trio.open_nursery() as requests:
            for _ in range(20):
                requests.start_soon(ask, "team-c")
            await poll_until(lambda: waiting() == 20)
            fail_now.set()
        assert statuses["team-c"] == [503] * 20
        assert calls("Bearer team-c") == 1
        await ask("team-c")
        assert calls("Bearer team-c") == 2
        failing["on"] = False
        statuses.clear()
        await ask("team-a")  # cached, untouched by the failures
        assert (statuses["team-a"], calls("Bearer team-a")) == ([200], 1)
        assert flights == {}


async def test_forward_auth_on_error_allow_admits_as_the_default_key(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient
) -> None:
    with trio.fail_after(DEADLINE):
        service = await start_service(nursery, _always_500)
        proxy = await start_proxy(
            nursery,
            {"fake-model": [fake.url]},
            keys=PROFILES,
            auth={"forward_url": service.url, "on_error": "allow", "default_key": "chat"},
        )
        response = await client.post(proxy.url + CHAT, json=chat_body(), headers=bearer("x"))
        assert response.status_code == 200
        samples = await scrape(client, proxy)
        assert value(samples, "sluice_requests_total", model="fake-model", key="chat") == 1


async def _always_500(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    return 500, {}, b""


async def test_a_reload_keeps_the_key_set_and_applies_new_mappings(
    nursery: trio.Nursery, fake: Fake, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        issuer = await start_issuer(nursery, "RSA")

        def write(value: str) -> None:
            path.write_text(
                f"""
[server]
port = 0
[upstream]
preconnect = 0
[models.fake-model]
upstreams = ["{fake.url}"]
[[keys]]
name = "batch"
[[keys]]
name = "chat"
[[auth.jwt]]
issuer = "{issuer.issuer}"
audiences = ["sluice"]
[[auth.jwt.map]]
claim = "groups"
value = "{value}"
key = "batch"
"""
            )

        path = tmp_path / "sluice.toml"
        write("ml-batch")
        url, state = await serve_file(nursery, path)
        await keys_fetched(state)
        token = issuer.token(groups="ml-batch")
        assert (
            await client.post(url + CHAT, json=chat_body(), headers=bearer(token))
        ).status_code == 200
        write("ml-other")
        assert await state.reload_config() == "applied"
        response = await client.post(url + CHAT, json=chat_body(), headers=bearer(token))
        assert response.status_code == 403
        other = issuer.token(groups="ml-other")
        assert (
            await client.post(url + CHAT, json=chat_body(), headers=bearer(other))
        ).status_code == 200
        assert issuer.jwks_fetches == 1  # the key set came across the reload


def test_subject_counters_are_kept_apart_and_let_go_when_idle() -> None:
    config = build(
        {
            "keys": [{"name": "batch", "requests_per_minute": 1}, {"name": "chat"}],
            "auth": {"jwt": [jwt_table("https://id.example")]},
        }
    )
    ring = KeyRing(config.keys)
    identity = Identity(config.auth, ring, config.keys)
    from proxy.api.identity import profile_of

    ann = profile_of(identity.profiles, "batch", "ann")
    bob = profile_of(identity.profiles, "batch", "bob")
    assert (ann.name, ann.account != bob.account) == ("batch", True)
    ring.admit(ann, 0).release()
    ring.admit(bob, 0).release()
    with pytest.raises(Exception, match="Rate limit"):
        ring.admit(ann, 1)
    assert ring.subjects() == 2
    # Many subjects, idle for over a day: their counters are let go.
    for number in range(3000):
        ring.admit(profile_of(identity.profiles, "batch", f"s{number}"), 0).release()
    assert ring.subjects() >= 1024
    for number in range(1100):
        ring.admit(profile_of(identity.profiles, "batch", f"later{number}"), 90_000).release()
    assert ring.subjects() < 3000


def test_the_docs_entra_id_and_google_examples_map_their_claims_as_written() -> None:
    """docs/identity.md's Entra ID and Google tables, loaded as written, map tokens shaped as
    those providers send them."""
    import re
    import tomllib

    text = (Path(__file__).resolve().parents[2] / "docs" / "identity.md").read_text()
    configs = {}
    for block in re.findall(r"```toml\n(.*?)```", text, re.DOTALL):
        data = tomllib.loads(block)
        for issuer in build(data).auth.jwt if "keys" in data else ():
            configs[issuer.issuer.split("/")[2]] = issuer
    entra = configs["login.microsoftonline.com"]
    assert (entra.subject_claim, entra.audiences) == (
        "oid",
        ("66666666-7777-8888-9999-000000000000",),
    )
    assert map_claims({"roles": ["Research.Use"], "groups": []}, entra) == ("research", True)
    staff = {"groups": ["aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"]}
    assert map_claims(staff, entra) == ("staff", True)
    assert map_claims({"_claim_names": {"groups": "src1"}}, entra) is None  # groups overage
    google = configs["accounts.google.com"]
    oncall = {"email": "oncall@example.com", "email_verified": True, "hd": "example.com"}
    assert map_claims(oncall, google) == ("ops", False)
    assert map_claims({"email": "ann@example.com", "hd": "example.com"}, google) == (
        "workspace",
        True,
    )
    assert map_claims({"email": "ann@gmail.com"}, google) is None  # no hd: not the domain's
