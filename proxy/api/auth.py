"""Client API keys, their limits, and CORS: who may use the proxy, how often, how much at once.

Keys are configured as SHA-256 digests (``[[keys]]`` in the config, printed by ``sluice
hash-key``). A presented key is hashed, then compared in constant time with *every* configured
digest, so neither the comparison nor the loop tells a caller how close a guess came or which
entry matched.

Limits are per key: requests per minute (an exact sliding window of 60 s) and concurrent relays.
``[limits] backend = "memory"`` counts them in this process (N processes allow N x the limits):
a stream is held from the relay's start until its body closes, disconnects included, and the
decisions here are sans-IO (they take the time as an argument, so the window arithmetic is
tested with explicit times). ``backend = "redis"`` counts them in one Redis shared by every
worker and instance (:mod:`proxy.api.limits`): a stream is held while its producer runs, as a
lease the request renews. Token budgets (:mod:`proxy.api.token_budget`) are admitted with
them, in the same check, and settled when the producer ends.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from proxy.api.limits import (
    RATE_PERIOD,
    RedisLimits,
    concurrency_limited,
    rate_limited,
)
from proxy.api.token_budget import Charge, KeyBudget, Metered, metered_producer
from proxy.config import KeyConfig, LimitsConfig, key_of_account
from proxy.protocol.errors import INVALID_REQUEST, ApiError

if TYPE_CHECKING:
    from proxy.ops.metrics import Metrics
    from proxy.relay.body import Producer, RelaySink

UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}

CORS_METHODS = "GET, POST, OPTIONS"
CORS_REQUEST_HEADERS = "Authorization, Content-Type, X-Request-ID"
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
_MAX_REQUESTED_HEADERS = 32
# Response headers a browser script may read besides the CORS-safelisted ones.
CORS_EXPOSED_HEADERS = (
    "X-Request-ID, Retry-After, traceresponse, x-sluice-priority, "
    "x-ratelimit-limit-tokens, x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens, "
    "x-ratelimit-limit-requests, x-ratelimit-remaining-requests, x-ratelimit-reset-requests"
)
# How long a browser may cache a preflight answer.
CORS_MAX_AGE = "600"


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key, as configured in ``[[keys]] sha256``."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header; None when absent or another
    scheme. The scheme is case-insensitive (RFC 9110 section 11.1)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def invalid_api_key(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        type=INVALID_REQUEST,
        code="invalid_api_key",
        headers=UNAUTHORIZED_HEADERS,
    )


class RateWindow:
    """At most ``limit`` admissions in any ``period`` seconds (a sliding log).

    Exact, unlike a token bucket (which lets a full bucket plus a minute's refill through in
    one minute), and bounded: it keeps one timestamp per admission still inside the window,
    never more than ``limit``.
    """

    def __init__(self, limit: int, period: float = RATE_PERIOD) -> None:
        if limit <= 0:
            raise ValueError("limit must be > 0; 0 (unlimited) needs no window")
        self.limit = limit
        self.period = period
        self._admitted: deque[float] = deque(maxlen=limit)

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the window admits one more; 0.0 when it admits now."""
        admitted = self._admitted
        # An admission at t leaves the window at t + period exactly.
        while admitted and admitted[0] <= now - self.period:
            admitted.popleft()
        if len(admitted) < self.limit:
            return 0.0
        return admitted[0] + self.period - now

    def admit(self, now: float) -> None:
        """Record an admission; the caller has seen ``wait(now) == 0``."""
        self._admitted.append(now)

    def __len__(self) -> int:
        return len(self._admitted)

    def resized(self, limit: int) -> RateWindow:
        """A window of ``limit`` that remembers this one's admissions (the latest ``limit``)."""
        window = RateWindow(limit, self.period)
        window._admitted.extend(self._admitted)
        return window


class Lease:
    """One admitted request's hold on its key's concurrency, released exactly once, and its
    token reservation, settled at most once (to what it used)."""

    __slots__ = ("_charge", "_settling", "_state")

    def __init__(self, state: _KeyState | None, charge: Charge | None = None) -> None:
        self._state = state
        self._settling = state
        self._charge = charge

    def release(self) -> None:
        state, self._state = self._state, None
        if state is not None:
            state.streams -= 1

    def settle(self, tokens: int) -> None:
        state, charge, self._settling = self._settling, self._charge, None
        if state is not None and charge is not None and state.budget is not None:
            state.budget.settle(charge, tokens)


# A subject's counters (a key mapped per subject) that hold nothing any more are let go once
# this many subjects are kept: no stream in flight, nothing admitted within the longest window
# (a day's token budget).
_SUBJECTS_KEPT = 1024
_SUBJECT_IDLE_SECONDS = 24 * 3600 + RATE_PERIOD


class _KeyState:
    __slots__ = ("budget", "config", "last_admitted", "streams", "window")

    def __init__(self, config: KeyConfig) -> None:
        self.config = config
        self.last_admitted = -math.inf
        self.window = RateWindow(config.requests_per_minute) if config.requests_per_minute else None
        self.streams = 0
        budgeted = config.tokens_per_minute or config.tokens_per_day
        self.budget = KeyBudget(config) if budgeted else None


class KeyRing:
    """The configured keys and each key's live counters. Empty: no authentication at all."""

    def __init__(
        self,
        keys: Sequence[KeyConfig],
        limits: LimitsConfig | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.limits = limits or LimitsConfig()
        self.metrics = metrics
        # Shared through Redis, or None: counted here, per process.
        self.shared: RedisLimits | None = None
        if self.limits.backend == "redis":
            self.shared = RedisLimits(self.limits, metrics)
        # A key without sha256 is a profile that [auth] maps identities onto: no static key.
        self._digests = [(bytes.fromhex(key.sha256), key) for key in keys if key.sha256]
        self._states = {key.name: _KeyState(key) for key in keys}
        # The counters of each subject of a key mapped per subject, by account.
        self._subjects: dict[str, _KeyState] = {}
        self._subjects_kept = _SUBJECTS_KEPT

    @property
    def enabled(self) -> bool:
        return bool(self._states)

    def identify(self, authorization: str | None) -> KeyConfig:
        """The key an ``Authorization`` header presents; a 401 :class:`ApiError` otherwise."""
        token = bearer_token(authorization)
        if token is None:
            raise invalid_api_key(
                "Missing API key: send it as the header 'Authorization: Bearer <key>'."
            )
        found = self.match(token)
        if found is None:
            raise invalid_api_key("Incorrect API key provided.")
        return found

    def match(self, token: str) -> KeyConfig | None:
        """The static key ``token`` is, if any."""
        # Header values reach us decoded as latin-1 (ASGI): encoding back to latin-1 recovers
        # the bytes on the wire, which are the UTF-8 bytes `sluice hash-key` hashed.
        presented = hashlib.sha256(token.encode("latin-1", errors="replace")).digest()
        found: KeyConfig | None = None
        for digest, key in self._digests:
            # No break: every digest is compared, whichever one matches (digests are unique).
            if hmac.compare_digest(presented, digest):
                found = key
        return found

    def reidentify(self, key: KeyConfig | None) -> KeyConfig | None:
        """A key identified by an earlier ring (before a reload), as this ring has it: by its
        name and hash, with this ring's limits; a 401 :class:`ApiError` when it is gone. None
        when this ring has no keys (authentication is off)."""
        if not self.enabled:
            return None
        state = None if key is None else self._states.get(key.name)
        if key is None or state is None or state.config.sha256 != key.sha256:
            raise invalid_api_key("This API key is no longer accepted (the config was reloaded).")
        return state.config

    @staticmethod
    def limited(key: KeyConfig) -> bool:
        return bool(
            key.requests_per_minute
            or key.max_concurrent_streams
            or key.tokens_per_minute
            or key.tokens_per_day
        )

    def admit(self, key: KeyConfig, now: float, reservation: int = 0) -> Lease:
        """Admit one request for ``key`` at ``now``, or raise a 429 :class:`ApiError`; a
        token-budgeted key's request reserves ``reservation`` tokens.

        Every limit is checked before any is charged: a request refused for concurrency
        does not use up the key's requests per minute, nor its tokens.
        """
        state = self._state(key, now)
        if state.window is not None:
            wait = state.window.wait(now)
            if wait > 0:
                raise rate_limited(key, wait)
        if key.max_concurrent_streams and state.streams >= key.max_concurrent_streams:
            raise concurrency_limited(key)
        budget = state.budget
        if budget is not None:
            budget.check(key, now)
        if state.window is not None:
            state.window.admit(now)
        state.streams += 1
        state.last_admitted = now
        return Lease(state, None if budget is None else budget.reserve(now, reservation))

    def _state(self, key: KeyConfig, now: float) -> _KeyState:
        """The counters ``key`` is held to: its own, or its subject's (one of its identities
        mapped per subject: api/identity.py), made at the subject's first request."""
        account = key.account
        if account == key.name:
            return self._states[key.name]
        state = self._subjects.get(account)
        if state is None:
            if len(self._subjects) >= self._subjects_kept:
                self._let_go_idle_subjects(now)
            state = self._subjects[account] = _KeyState(self._states[key.name].config)
        return state

    def _let_go_idle_subjects(self, now: float) -> None:
        idle = [
            account
            for account, state in self._subjects.items()
            if not state.streams and now - state.last_admitted > _SUBJECT_IDLE_SECONDS
        ]
        for account in idle:
            del self._subjects[account]
        # Amortized: the next sweep waits until as many subjects again are kept.
        self._subjects_kept = max(_SUBJECTS_KEPT, 2 * len(self._subjects))

    def subjects(self) -> int:
        """Subjects whose counters are kept now (tests, diagnostics)."""
        return len(self._subjects)

    def carry_over(self, previous: KeyRing) -> None:
        """After a reload: a key that kept its name keeps its counters (its streams in flight,
        the requests in its window) under its new limits, so that a reload frees no capacity.
        The previous ring's leases then release into these same counters."""
        for name, state in self._states.items():
            kept = previous._states.get(name)
            if kept is None:
                continue
            self._states[name] = self._carried(kept, state)
        for account, kept in previous._subjects.items():
            profile = self._states.get(key_of_account(account))
            if profile is not None:
                self._subjects[account] = self._carried(kept, _KeyState(profile.config))

    @staticmethod
    def _carried(kept: _KeyState, state: _KeyState) -> _KeyState:
        """``kept``'s counters under ``state``'s (new) limits."""
        rpm = state.config.requests_per_minute
        if not rpm:
            kept.window = None
        elif kept.window is None:
            kept.window = state.window
        elif kept.window.limit != rpm:
            kept.window = kept.window.resized(rpm)
        if state.budget is None:
            kept.budget = None
        elif kept.budget is None:
            kept.budget = state.budget
        else:
            kept.budget.resized(state.config)
        kept.config = state.config
        return kept

    def streams(self, name: str) -> int:
        """Requests of the key or account ``name`` in flight now (tests, diagnostics)."""
        state = self._states.get(name) or self._subjects.get(name)
        return 0 if state is None else state.streams


def limited_producer(
    keys: KeyRing, key: KeyConfig, produce: Producer, metered: Metered | None = None
) -> Producer:
    """``produce``, admitted against ``key``'s limits first.

    Admission runs inside the relay, so the concurrency lease exists only once the relay body
    has been entered. In memory, the body's close (normal end, error, or client disconnect)
    always releases it. Through Redis, the lease is renewed by a task beside ``produce`` (in a
    nursery of its own) and released when ``produce`` ends, however it ends. A refusal is an
    ApiError before the head: the relay turns it into the 429 (or the 503 of on_error = "deny").

    A ``metered`` request reserves its tokens on admission and settles them when ``produce``
    ends, however it ends (every token it will ever be charged is counted by then): in
    memory at once, through Redis shielded and bounded, once.
    """

    reservation = 0 if metered is None else metered.reservation
    if metered is not None:
        produce = metered_producer(produce, metered)
    shared = keys.shared
    if shared is None:

        async def admitted(sink: RelaySink) -> None:
            lease = keys.admit(key, trio.current_time(), reservation)
            sink.on_close(lease.release)
            if metered is None:
                await produce(sink)
                return
            try:
                await produce(sink)
            finally:
                lease.settle(metered.charged)

        return admitted

    async def admitted_shared(sink: RelaySink) -> None:
        # Bounded by [limits] timeout: a 429, a 503 (on_error = "deny"), or a lease (None: no
        # slot to hold, or admitted uncounted under on_error = "allow").
        lease = await shared.acquire(key, reservation)
        if lease is None:
            await produce(sink)
            return
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lease.keep_renewed)
                await produce(sink)
                nursery.cancel_scope.cancel()
        finally:
            # Shielded and bounded: a cancelled request gives its slot back too, and is
            # charged what it used.
            if metered is not None:
                await lease.settle(metered.charged)
            await lease.release()

    return admitted_shared


class CorsPolicy:
    """Which browser origins may read responses. Empty: CORS is off and no header is sent."""

    def __init__(self, origins: Iterable[str]) -> None:
        origins = tuple(origins)
        self.any_origin = "*" in origins
        # Browsers send scheme and host in lowercase; config may not.
        self._origins = frozenset(origin.lower() for origin in origins)

    @property
    def enabled(self) -> bool:
        return bool(self._origins)

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, if any."""
        if not origin or not self._origins:
            return None
        if self.any_origin:
            return "*"
        return origin if origin.lower() in self._origins else None

    @property
    def varies(self) -> bool:
        """Whether responses depend on the request's Origin (caches must key on it)."""
        return self.enabled and not self.any_origin

    def preflight_headers(self, requested: str | None = None) -> dict[str, str]:
        """The answer to a preflight from an allowed origin. The headers the browser asks for
        are allowed too (well-formed names only, a bounded number): SDKs add their own, such
        as the OpenAI JS SDK's x-stainless-*, and the origin is trusted already."""
        allowed = [name.strip() for name in CORS_REQUEST_HEADERS.split(",")]
        known = {name.lower() for name in allowed}
        for name in (requested or "").split(",")[:_MAX_REQUESTED_HEADERS]:
            name = name.strip()
            if _HEADER_NAME.match(name) and name.lower() not in known:
                known.add(name.lower())
                allowed.append(name)
        return {
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": ", ".join(allowed),
            "Access-Control-Max-Age": CORS_MAX_AGE,
        }
