"""Identities besides the static keys: bearer JWTs of configured issuers (``[[auth.jwt]]``) and a
forward-auth service (``[auth] forward_url``), each mapped onto a ``[[keys]]`` profile, whose
name, limits, budget, band and weight the request then has.

The order, for every transport and endpoint (:meth:`Identity.identify`):

1. a bearer token (``Authorization: Bearer``, or ``x-api-key``) that is a static key's is that
   key (compared as :class:`~proxy.api.auth.KeyRing` always has);
2. one shaped like a JWT whose ``iss`` is a configured issuer is decided by that issuer alone:
   verified against its key set, then mapped by its claims (401 when invalid, 403 when valid
   but mapped onto nothing);
3. anything else goes to the forward-auth service when one is configured;
4. else the static keys' 401.

Decisions without I/O live at the top of this file (a token's size and shape, the key set as
parsed, which key verifies which algorithm, the times, claims onto keys, when the key set may be
fetched again), tested with explicit times. The I/O is below: the key set fetched through one
:class:`JsonSource` (Sluice's async HTTP client, never a blocking fetch on the event loop), one
fetch per issuer at a time, run in the served config's nursery so that a request that leaves
does not cancel a fetch that others wait for.

Key rotation: a token whose ``kid`` is not in the cached set fetches the set again, at most
once per ``cooldown`` (a flood of made-up ``kid``\\s is one fetch per cooldown, and between two
such fetches an unknown ``kid`` is refused at once); the set is also fetched again every
``refresh_seconds``, which does not use up the cooldown, so keys an issuer publishes before
signing with them are known before the first token. When the issuer cannot be reached, the
cached keys keep verifying.

A hung issuer (it accepts the connection and never answers) holds no request for long: the
requests that need a fetch share the one under way, and each waits for it only until
``unknown_kid_wait`` after it began (0.5 s by default), then is refused; while the issuer's
last fetch failed, none waits at all. The fetch itself goes on, to ``fetch_timeout``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import jwt
import trio

from proxy.api.auth import bearer_token, invalid_api_key
from proxy.config import (
    ACCOUNT_SEPARATOR,
    AuthConfig,
    JwtIssuerConfig,
    KeyConfig,
)
from proxy.protocol.errors import INVALID_REQUEST, SERVER_ERROR, ApiError
from proxy.server.call import HeaderLookup

if TYPE_CHECKING:
    from proxy.api.auth import KeyRing
    from proxy.ops.metrics import Metrics

log = logging.getLogger("sluice.auth")

# What RFC 9728 serves the protected resource's metadata at.
RESOURCE_METADATA_PATH = "/.well-known/oauth-protected-resource"
# The OIDC discovery document, under the issuer's URL.
DISCOVERY_PATH = "/.well-known/openid-configuration"
# A discovery document or key set larger than this is refused (a JWKS is a few KB).
MAX_DOCUMENT_BYTES = 1024 * 1024
# A subject longer than this is refused: it becomes a key of the limits' counters.
MAX_SUBJECT_CHARS = 256
# Decisions of the forward-auth service kept at most, beside their expiry.
FORWARD_CACHE_ENTRIES = 10_000
# Forward-auth calls in flight at once (their client's pool, so nothing queues in httpcore).
FORWARD_CONNECTIONS = 64

# Why a credential was refused: sluice_auth_refusals_total's reason label (a bounded set).
REASONS = (
    "too_large",
    "malformed",
    "issuer",
    "algorithm",
    "unknown_kid",
    "signature",
    "audience",
    "expired",
    "not_yet_valid",
    "issued_in_future",
    "missing_claim",
    "unmapped",
    "refused",
    "unavailable",
)

# Which key types (and EC curves) sign each accepted algorithm.
_KEY_TYPES: dict[str, tuple[str, str | None]] = {
    **{f"RS{bits}": ("RSA", None) for bits in (256, 384, 512)},
    **{f"PS{bits}": ("RSA", None) for bits in (256, 384, 512)},
    "ES256": ("EC", "P-256"),
    "ES384": ("EC", "P-384"),
    "ES512": ("EC", "P-521"),
    "EdDSA": ("OKP", None),
}


class Refused(Exception):
    """A credential refused, with the reason (one of :data:`REASONS`) and what to tell the
    client (never a secret: no token, no signature)."""

    def __init__(self, reason: str, detail: str, *, status: int = 401) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.status = status


def invalid_token(detail: str, *, resource_metadata: str = "") -> ApiError:
    """RFC 6750's 401 for a bearer token refused, in the API's error shape."""
    challenge = f'Bearer error="invalid_token", error_description="{_quoted(detail)}"'
    if resource_metadata:
        challenge += f', resource_metadata="{_quoted(resource_metadata)}"'
    return ApiError(
        401,
        f"Invalid bearer token: {detail}.",
        type=INVALID_REQUEST,
        code="invalid_token",
        headers={"WWW-Authenticate": challenge},
    )


def forbidden(detail: str) -> ApiError:
    """A valid identity that this server gives no key (403, RFC 6750's insufficient_scope is
    about scopes; this is about the caller)."""
    return ApiError(403, f"Forbidden: {detail}.", type=INVALID_REQUEST, code="permission_denied")


def auth_unavailable() -> ApiError:
    return ApiError(
        503,
        "The authentication service did not answer; try again shortly.",
        type=SERVER_ERROR,
        code="auth_unavailable",
        headers={"Retry-After": "1"},
    )


def _quoted(text: str) -> str:
    # A quoted-string's value: printable ASCII without '"' or '\\' (RFC 6750 section 3).
    return "".join(c for c in text if 0x20 <= ord(c) < 0x7F and c not in '"\\')


class FetchError(Exception):
    """A document that could not be fetched or read (logged; never the client's error)."""


# -- sans-IO -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SubjectKey(KeyConfig):
    """A key profile as one subject of a per-subject mapping has it: the key's name (metrics and
    logs name the key: bounded labels) with limits, budget and fair share of its own."""

    subject: str = ""

    @property
    def account(self) -> str:
        return f"{self.name}{ACCOUNT_SEPARATOR}{self.subject}"


def jwt_shaped(token: str) -> bool:
    """Three dot-separated parts (JWS compact serialization); what else a static key may be
    never reaches the JWT path."""
    return token.count(".") == 2


def _b64json(part: str) -> dict[str, Any]:
    try:
        raw = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError):
        raise Refused("malformed", "not a well-formed JWT") from None
    if not isinstance(value, dict):
        raise Refused("malformed", "not a well-formed JWT")
    return value


def unverified_parts(token: str, max_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The header and claims of ``token``, not yet verified (to choose the issuer and the key);
    a token over ``max_bytes`` is refused before any decoding."""
    if len(token) > max_bytes:
        raise Refused("too_large", f"the token is over {max_bytes} bytes")
    header, claims, _ = token.split(".")
    return _b64json(header), _b64json(claims)


def parse_key_set(document: object) -> dict[str, dict[str, Any]]:
    """A JWKS's signing keys by ``kid`` ("" for a key without one). Keys that cannot sign an
    accepted algorithm are left out: symmetric ("oct") keys above all, so that no HMAC can
    ever be verified with what the issuer publishes; so are encryption keys and unusable ones."""
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise FetchError("not a JWK set (no 'keys' array)")
    keys: dict[str, dict[str, Any]] = {}
    for jwk in document["keys"]:
        if not isinstance(jwk, dict) or jwk.get("kty") not in ("RSA", "EC", "OKP"):
            continue
        if jwk.get("use", "sig") != "sig":
            continue
        kid = jwk.get("kid", "")
        if not isinstance(kid, str) or kid in keys:
            continue
        try:
            jwt.PyJWK(jwk)
        # PyJWT at the declared floor lets cryptography's ValueError out of a malformed key
        # ("n must be >= 3"); later releases wrap it. Either way the key is skipped.
        except (jwt.PyJWTError, ValueError):
            continue
        keys[kid] = jwk
    return keys


class KeySet:
    """One issuer's keys as last fetched, each made once per algorithm it verifies."""

    def __init__(self, keys: Mapping[str, dict[str, Any]]) -> None:
        self.keys = dict(keys)
        self._made: dict[tuple[str, str], jwt.PyJWK] = {}

    def __contains__(self, kid: str) -> bool:
        return kid in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, kid: str, algorithm: str) -> jwt.PyJWK:
        """The key ``kid`` as a verifier of ``algorithm``: a token's header names both, and the
        key must be of the algorithm's type (and curve), and of its ``alg`` when it says one."""
        made = self._made.get((kid, algorithm))
        if made is not None:
            return made
        jwk = self.keys[kid]
        kty, curve = _KEY_TYPES[algorithm]
        fits = jwk.get("kty") == kty and (curve is None or jwk.get("crv") == curve)
        if not fits or jwk.get("alg", algorithm) != algorithm:
            raise Refused("algorithm", f"the signing key does not sign {algorithm}")
        try:
            made = jwt.PyJWK(jwk, algorithm=algorithm)
        except (jwt.PyJWTError, ValueError):
            raise Refused("algorithm", f"the signing key cannot verify {algorithm}") from None
        self._made[(kid, algorithm)] = made
        return made


class RefetchPolicy:
    """When the key set may be fetched again for a ``kid`` it lacks: at most once per
    ``cooldown``, counted from the last such fetch (a scheduled refresh does not count)."""

    def __init__(self, cooldown: float) -> None:
        self.cooldown = cooldown
        self.last = -math.inf

    def allows(self, now: float) -> bool:
        return now - self.last >= self.cooldown

    def fetched(self, now: float) -> None:
        self.last = now


def check_times(claims: Mapping[str, Any], now: float, leeway: float) -> None:
    """``exp`` and ``iat`` required, ``nbf`` when present; each within ``leeway`` of ``now``
    (seconds since the epoch)."""
    for name in ("exp", "iat"):
        if name not in claims:
            raise Refused("missing_claim", f"the token has no '{name}'")
    times: dict[str, float] = {}
    for name in ("exp", "iat", "nbf"):
        if name in claims:
            value = claims[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise Refused("malformed", f"'{name}' is not a number")
            times[name] = float(value)
    if times["exp"] + leeway <= now:
        raise Refused("expired", "the token has expired")
    if "nbf" in times and times["nbf"] - leeway > now:
        raise Refused("not_yet_valid", "the token is not valid yet")
    if times["iat"] - leeway > now:
        raise Refused("issued_in_future", "the token was issued in the future")


def claim_value(claims: Mapping[str, Any], name: str) -> object:
    """A claim by name; a dotted name walks into objects (Keycloak's ``realm_access.roles``)
    when no top-level claim has the whole name."""
    if name in claims:
        return claims[name]
    value: object = claims
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def holds(value: object, wanted: str) -> bool:
    """A claim holds ``wanted``: it is that string, or a list with that string in it."""
    if isinstance(value, str):
        return value == wanted
    if isinstance(value, list):
        return any(item == wanted for item in value if isinstance(item, str))
    return False


def map_claims(claims: Mapping[str, Any], issuer: JwtIssuerConfig) -> tuple[str, bool] | None:
    """The key profile a verified token is, and whether per subject: the first map that
    matches, else the issuer's default_key; None when neither."""
    for mapping in issuer.map:
        if holds(claim_value(claims, mapping.claim), mapping.value):
            return mapping.key, mapping.per_subject or issuer.per_subject
    if issuer.default_key:
        return issuer.default_key, issuer.per_subject
    return None


def profile_of(profiles: Mapping[str, KeyConfig], name: str, subject: str | None) -> KeyConfig:
    """The request's key: the profile, or the profile counted for ``subject`` alone."""
    key = profiles[name]
    if subject is None:
        return key
    if not subject or len(subject) > MAX_SUBJECT_CHARS:
        raise Refused("missing_claim", "the token names no usable subject")
    return SubjectKey(
        **{f.name: getattr(key, f.name) for f in dataclasses.fields(KeyConfig)}, subject=subject
    )


class ForwardCache:
    """The forward-auth service's decisions by a digest of what was sent, each until its
    expiry; at most ``size`` (the oldest go first)."""

    def __init__(self, seconds: float, size: int = FORWARD_CACHE_ENTRIES) -> None:
        self.seconds = seconds
        self.size = size
        self._entries: dict[bytes, tuple[float, object]] = {}

    def get(self, digest: bytes, now: float) -> object | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._entries[digest]
            return None
        return entry[1]

    def put(self, digest: bytes, decision: object, now: float) -> None:
        if self.seconds <= 0:
            return
        entries = self._entries
        entries.pop(digest, None)
        while len(entries) >= self.size:
            del entries[next(iter(entries))]
        entries[digest] = (now + self.seconds, decision)

    def __len__(self) -> int:
        return len(self._entries)


# -- I/O ---------------------------------------------------------------------------------------


class JsonSource(Protocol):
    """Where the issuers' documents come from: Sluice's HTTP client, or a test's."""

    async def get_json(self, url: str) -> object: ...


class HttpJsonSource:
    """GET a JSON document with an ``httpx.AsyncClient`` on trio, its size bounded."""

    def __init__(self, client: httpx.AsyncClient, max_bytes: int = MAX_DOCUMENT_BYTES) -> None:
        self.client = client
        self.max_bytes = max_bytes

    async def get_json(self, url: str) -> object:
        try:
            async with self.client.stream("GET", url, headers={"Accept": "application/json"}) as r:
                if r.status_code != 200:
                    raise FetchError(f"{url} answered {r.status_code}")
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise FetchError(f"{url} sent over {self.max_bytes} bytes")
        except httpx.HTTPError as error:
            raise FetchError(f"{url}: {type(error).__name__} {error}") from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError):
            raise FetchError(f"{url} sent no JSON") from None


class JwtIssuer:
    """One ``[[auth.jwt]]``: its key set (fetched, cached, refetched) and the check of a token."""

    def __init__(
        self,
        config: JwtIssuerConfig,
        source: JsonSource,
        *,
        metrics: Metrics | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.source = source
        self.metrics = metrics
        self.wall = wall
        self.keys = KeySet({})
        self.jwks_url = config.jwks_url
        self.policy = RefetchPolicy(config.cooldown)
        # The fetch under way, if any (one per issuer: requests that need it share it), and
        # when it began: a request waits for it until unknown_kid_wait after that, no longer.
        self._fetching: trio.Event | None = None
        self._fetch_began = -math.inf
        # Whether the last fetch that ended brought the key set (True before the first): while
        # it did not, an unknown kid is refused at once rather than waiting for the next.
        self.answering = True
        self._nursery: trio.Nursery | None = None
        # How many fetches of the key set were made (tests, diagnostics).
        self.fetches = 0

    def carry_over(self, previous: JwtIssuer) -> None:
        """After a reload, an unchanged issuer keeps its keys and its cooldown: a reload is no
        401 window and no burst of fetches."""
        if previous.config.jwks_url == self.config.jwks_url:
            self.keys = previous.keys
            self.jwks_url = previous.jwks_url
            self.policy.last = previous.policy.last
            self.answering = previous.answering

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Fetch the key set now (unless carried over) and every ``refresh_seconds``, and host
        the fetches requests ask for, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not len(self.keys):
                self._start_fetch()
            task_status.started()
            while True:
                await trio.sleep(self.config.refresh_seconds)
                if self._fetching is None:
                    self._start_fetch()

    def _start_fetch(self) -> trio.Event:
        assert self._nursery is not None, "JwtIssuer.run hosts the fetches"
        done = self._fetching = trio.Event()
        self._fetch_began = trio.current_time()
        self._nursery.start_soon(self._fetch, done)
        return done

    async def _fetch(self, done: trio.Event) -> None:
        keys: dict[str, dict[str, Any]] | None = None
        problem = f"no answer within {self.config.fetch_timeout} s"
        try:
            with trio.move_on_after(self.config.fetch_timeout):
                try:
                    keys = await self._fetch_keys()
                except FetchError as error:
                    problem = str(error)
            if keys is None:
                log.warning(
                    "jwt issuer %s: key set not fetched (%s); the cached keys stay (%d)",
                    self.config.issuer,
                    problem,
                    len(self.keys),
                )
                self._count("error")
                self.answering = False
            else:
                known = set(self.keys.keys)
                self.keys = KeySet(keys)
                self.answering = True
                self._count("ok")
                if set(keys) != known:
                    log.info("jwt issuer %s: key set now %s", self.config.issuer, sorted(keys))
        finally:
            self.fetches += 1
            self._fetching = None
            done.set()

    async def _fetch_keys(self) -> dict[str, dict[str, Any]]:
        if not self.jwks_url:
            url = self.config.issuer.rstrip("/") + DISCOVERY_PATH
            document = await self.source.get_json(url)
            found = document.get("jwks_uri") if isinstance(document, dict) else None
            if not isinstance(document, dict) or document.get("issuer") != self.config.issuer:
                raise FetchError(f"{url} is not the discovery document of {self.config.issuer}")
            if not isinstance(found, str) or not _fetchable(found):
                raise FetchError(f"{url} names no https:// jwks_uri")
            self.jwks_url = found
        return parse_key_set(await self.source.get_json(self.jwks_url))

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.jwks_fetches.labels(self.config.issuer, outcome).inc()

    async def _key(self, kid: str, algorithm: str) -> jwt.PyJWK:
        if kid not in self.keys:
            now = trio.current_time()
            fetching = self._fetching
            if fetching is None and self.policy.allows(now):
                self.policy.fetched(now)
                fetching = self._start_fetch()
            if fetching is not None and self.answering:
                # Every request shares the one fetch (it runs in the issuer's nursery, bounded
                # by fetch_timeout); none waits past unknown_kid_wait after it began, so a
                # hung issuer holds the first requests that long and later ones not at all.
                with trio.move_on_at(self._fetch_began + self.config.unknown_kid_wait):
                    await fetching.wait()
            if kid not in self.keys:
                raise Refused("unknown_kid", "the token's signing key is not the issuer's")
        return self.keys.key(kid, algorithm)

    async def verify(self, token: str, header: Mapping[str, Any]) -> dict[str, Any]:
        """The token's claims, its signature, issuer, audience and times checked; else
        :class:`Refused`."""
        config = self.config
        algorithm = header.get("alg")
        if not isinstance(algorithm, str) or algorithm not in config.algorithms:
            raise Refused("algorithm", f"the algorithm {_printable(algorithm)} is not accepted")
        kid = header.get("kid", "")
        if not isinstance(kid, str):
            raise Refused("malformed", "the token's kid is not a string")
        key = await self._key(kid, algorithm)
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key.key,
                algorithms=[algorithm],
                audience=list(config.audiences),
                issuer=config.issuer,
                # The times are checked below, on a clock the tests can move.
                options={
                    "verify_exp": False,
                    "verify_nbf": False,
                    "verify_iat": False,
                    "require": ["iss", "aud"],
                },
            )
        except jwt.InvalidAudienceError:
            raise Refused("audience", "the token is not for this service (aud)") from None
        except jwt.InvalidIssuerError:
            raise Refused("issuer", "the token's issuer is not accepted") from None
        except jwt.MissingRequiredClaimError as error:
            raise Refused("missing_claim", f"the token has no '{error.claim}'") from None
        except jwt.InvalidSignatureError:
            raise Refused("signature", "the signature does not verify") from None
        except jwt.InvalidAlgorithmError:
            raise Refused("algorithm", "the algorithm is not accepted") from None
        except jwt.PyJWTError:
            raise Refused("malformed", "not a well-formed JWT") from None
        check_times(claims, self.wall(), config.leeway)
        return claims


def _fetchable(url: str) -> bool:
    from proxy.config import is_loopback

    parts = httpx.URL(url)
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.host))


def _printable(value: object) -> str:
    return repr(_quoted(str(value))[:32])


class _Flight:
    """One call to the auth service that every request with the same credential waits on."""

    def __init__(self) -> None:
        self.done = trio.Event()
        # The service's decision: a key, a Refused, or None when it failed.
        self.decision: object | None = None


class ForwardAuth:
    """``[auth] forward_url``: the request's configured headers sent to an auth service, whose
    2xx admits (its ``forward_key_header`` naming the key), 401 and 403 refuse, anything else
    (or no answer within ``forward_timeout``) follows ``on_error``.

    Single flight: requests that send the same headers and miss the cache at the same moment
    share one call (a burst of one user's requests, or of many behind one shared token, is one
    call, not one each). The call runs in :meth:`run`'s nursery, so that a request that leaves
    does not fail the others waiting on it; it is bounded by ``forward_timeout``. A decision of
    the service (a key, 401, 403) is cached; a failure is not, and the next request asks
    again."""

    def __init__(
        self,
        config: AuthConfig,
        profiles: Mapping[str, KeyConfig],
        client: httpx.AsyncClient,
    ) -> None:
        self.config = config
        self.profiles = profiles
        self.client = client
        self.cache = ForwardCache(config.forward_cache_seconds)
        self.gate = trio.Semaphore(FORWARD_CONNECTIONS)
        self._sent = tuple(dict.fromkeys(name.lower() for name in config.forward_headers))
        # The calls under way, by the digest of what they send (at most one per digest).
        self._flights: dict[bytes, _Flight] = {}
        self._nursery: trio.Nursery | None = None
        # Calls made to the service (tests, diagnostics).
        self.calls = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the calls, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def identify(self, headers: HeaderLookup, method: str, path: str) -> KeyConfig:
        sent = {name: value for name in self._sent if (value := headers.get(name)) is not None}
        digest = hashlib.sha256(
            json.dumps([method, path, sorted(sent.items())]).encode("utf-8", "replace")
        ).digest()
        decision = self.cache.get(digest, trio.current_time())
        if decision is None:
            flight = self._flights.get(digest)
            if flight is None:
                flight = self._flights[digest] = _Flight()
                if self._nursery is not None:
                    self._nursery.start_soon(self._fly, digest, flight, sent, method, path)
                else:  # not served (a test of this class alone): the call is this request's
                    await self._fly(digest, flight, sent, method, path)
            await flight.done.wait()
            decision = flight.decision
        if decision is None:  # the service failed
            if self.config.on_error == "allow":
                return self.profiles[self.config.default_key]
            raise Refused("unavailable", "the authentication service did not answer", status=503)
        if isinstance(decision, Refused):
            raise Refused(decision.reason, decision.detail, status=decision.status)
        assert isinstance(decision, KeyConfig)
        return decision

    async def _fly(
        self, digest: bytes, flight: _Flight, sent: dict[str, str], method: str, path: str
    ) -> None:
        asked = trio.current_time()
        try:
            flight.decision = await self._ask(sent, method, path)
            if flight.decision is not None:
                self.cache.put(digest, flight.decision, asked)
        finally:
            del self._flights[digest]
            flight.done.set()

    async def _ask(self, sent: dict[str, str], method: str, path: str) -> object | None:
        """The service's decision: a key, a :class:`Refused`, or None when it failed."""
        config = self.config
        headers = {**sent, "X-Forwarded-Method": method, "X-Forwarded-Uri": path}
        with trio.move_on_after(config.forward_timeout):
            async with self.gate:
                self.calls += 1
                try:
                    # Streamed and not read: only the status and headers decide.
                    request = self.client.stream("GET", config.forward_url, headers=headers)
                    async with request as response:
                        status, answer = response.status_code, response.headers
                except httpx.HTTPError as error:
                    log.warning(
                        "forward auth %s failed: %s", config.forward_url, type(error).__name__
                    )
                    return None
            if status in (401, 403):
                return Refused(
                    "refused", "the authentication service refused the request", status=status
                )
            if not 200 <= status < 300:
                log.warning("forward auth %s answered %d", config.forward_url, status)
                return None
            name = answer.get(config.forward_key_header) or config.default_key
            if not name:
                return Refused("unmapped", "the authentication service named no key", status=403)
            if name not in self.profiles:
                log.warning(
                    "forward auth named the key %r, which is no [[keys]] entry", _quoted(name)[:64]
                )
                return Refused(
                    "unmapped", "the authentication service named an unknown key", status=403
                )
            subject = answer.get(config.forward_subject_header)
            try:
                return profile_of(self.profiles, name, subject)
            except Refused as refused:
                return refused
        log.warning(
            "forward auth %s: no answer within %s s", config.forward_url, config.forward_timeout
        )
        return None


class Identity:
    """Every credential form, for every transport: the static keys, the JWT issuers, forward
    auth. Built per served config (a reload builds another and carries the key sets over)."""

    def __init__(
        self,
        config: AuthConfig,
        keys: KeyRing,
        profiles: Sequence[KeyConfig],
        *,
        metrics: Metrics | None = None,
        source: JsonSource | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.keys = keys
        self.metrics = metrics
        self.profiles = {key.name: key for key in profiles}
        self._client: httpx.AsyncClient | None = None
        self.issuers: dict[str, JwtIssuer] = {}
        if config.jwt:
            if source is None:
                # Each fetch is bounded by its issuer's fetch_timeout (JwtIssuer._fetch).
                source = HttpJsonSource(self._http(max(j.fetch_timeout for j in config.jwt)))
            for issuer in config.jwt:
                self.issuers[issuer.issuer] = JwtIssuer(issuer, source, metrics=metrics, wall=wall)
        self.forward = (
            ForwardAuth(config, self.profiles, self._http(config.forward_timeout))
            if config.forward_url
            else None
        )
        # RFC 9728's URL, in a 401's challenge when [auth] resource says where this server is.
        self.resource_metadata = (
            config.resource.rstrip("/") + RESOURCE_METADATA_PATH if config.resource else ""
        )

    def _http(self, timeout: float) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=timeout,
                follow_redirects=False,
                trust_env=True,
                limits=httpx.Limits(max_connections=FORWARD_CONNECTIONS + len(self.config.jwt)),
            )
        return self._client

    def carry_over(self, previous: Identity | None) -> None:
        if previous is None:
            return
        for name, issuer in self.issuers.items():
            kept = previous.issuers.get(name)
            if kept is not None:
                issuer.carry_over(kept)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The issuers' fetches and forward auth's calls, until cancelled; then the client
        closes."""
        try:
            async with trio.open_nursery() as nursery:
                for issuer in self.issuers.values():
                    await nursery.start(issuer.run)
                if self.forward is not None:
                    await nursery.start(self.forward.run)
                task_status.started()
                # The client serves forward auth too: it closes only when this is cancelled.
                await trio.sleep_forever()
        finally:
            if self._client is not None:
                with trio.CancelScope(shield=True):
                    await self._client.aclose()

    async def identify(self, headers: HeaderLookup, method: str, path: str) -> KeyConfig:
        """The request's key, or the ApiError that refuses it (401, 403, or 503 when forward
        auth cannot answer under on_error = "deny")."""
        authorization = headers.get("Authorization")
        if authorization is None:
            api_key = headers.get("x-api-key")
            if api_key is not None:
                authorization = f"Bearer {api_key}"
        token = bearer_token(authorization)
        method_label = "key"
        try:
            if token is not None:
                key = self.keys.match(token)
                if key is not None:
                    return key
                if self.issuers and jwt_shaped(token):
                    method_label = "jwt"
                    header, claims = unverified_parts(token, self.config.max_token_bytes)
                    iss = claims.get("iss")
                    issuer = self.issuers.get(iss) if isinstance(iss, str) else None
                    if issuer is not None or self.forward is None:
                        return await self._jwt(issuer, token, header, claims)
                    method_label = "key"
            if self.forward is not None:
                method_label = "forward"
                return await self.forward.identify(headers, method, path)
        except Refused as refused:
            raise self._refusal(method_label, refused) from None
        # No identity of any kind: the static keys' own 401.
        self.keys.identify(authorization)
        raise AssertionError("identify() refuses what match() did not find")  # pragma: no cover

    async def _jwt(
        self,
        issuer: JwtIssuer | None,
        token: str,
        header: Mapping[str, Any],
        claims: Mapping[str, Any],
    ) -> KeyConfig:
        if issuer is None:
            raise Refused("issuer", "the token's issuer is not accepted")
        verified = await issuer.verify(token, header)
        mapped = map_claims(verified, issuer.config)
        if mapped is None:
            raise Refused("unmapped", "the token maps onto no key here", status=403)
        name, per_subject = mapped
        subject = None
        if per_subject:
            value = verified.get(issuer.config.subject_claim)
            subject = value if isinstance(value, str) else ""
        return profile_of(self.profiles, name, subject)

    def _refusal(self, method: str, refused: Refused) -> ApiError:
        if self.metrics is not None:
            self.metrics.auth_refusals.labels(method, refused.reason).inc()
        log.info("%s credential refused: %s (%s)", method, refused.reason, refused.detail)
        if refused.status == 503:
            return auth_unavailable()
        if refused.status == 403:
            return forbidden(refused.detail)
        if method == "key":
            return invalid_api_key("Incorrect API key provided.")
        return invalid_token(refused.detail, resource_metadata=self.resource_metadata)
