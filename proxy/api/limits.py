"""Per-key limits shared through Redis (``[limits] backend = "redis"``): every worker and every
instance counts against the same requests per minute and the same concurrent streams.

Per key, two sorted sets, both written by one Lua script (atomic: a script runs alone on the
server), and both named with the key's name as a hash tag so that a Redis Cluster keeps them on
one slot:

- ``<prefix>{<name>}:rpm``: one member per admission, scored by its time. The same exact
  sliding window as :class:`~proxy.api.auth.RateWindow`: an admission at t counts until t + 60,
  and a refusal's Retry-After is when the oldest one leaves.
- ``<prefix>{<name>}:streams``: one member per concurrency slot, a lease scored by its expiry.
  Its holder renews it every ``lease_seconds / 3`` and removes it when the request ends; the
  script drops expired leases before counting, so a crashed instance's slots free themselves
  within ``lease_seconds``.

Token budgets (``tokens_per_minute``, ``tokens_per_day``; see :mod:`proxy.api.token_budget`)
add, under the same hash tag:

- ``<prefix>{<name>}:tpm`` and ``:tpd``: one member per admitted request, scored by its
  admission time, for the minute's window and the day's;
- ``<prefix>{<name>}:tokens``: a hash of each member's charge (its reservation, then what it
  used) and of each window's running total (``=tpm``, ``=tpd``), so that admitting costs no
  sum over the window: members that leave a window are subtracted from its total as they go;
- ``<prefix>{<name>}:pending``: the reservations not yet settled, scored by their lease's
  expiry and renewed with the concurrency lease. A settlement applies only to a reservation
  still pending (removed as it applies: a retried settlement changes nothing); one whose
  worker died expires and stays charged in full.

Times are the Redis server's (``TIME`` inside the script): instances' clocks never disagree.
Every limit is checked before any is charged, as in memory.

The client is coredis (anyio: native on trio, no thread per call). Every call is bounded by
``[limits] timeout`` (connecting included): when Redis is down, slow or erroring, a request gets
``on_error``'s answer in that time, never a hang; errors are counted in
``sluice_limits_errors_total`` and logged at most once a minute.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from proxy.api.token_budget import DAY, reset_text, token_limited
from proxy.config import KeyConfig, LimitsConfig
from proxy.protocol.errors import RATE_LIMIT, SERVER_ERROR, ApiError

if TYPE_CHECKING:
    import coredis

    from proxy.ops.metrics import Metrics

log = logging.getLogger("sluice.limits")

RATE_PERIOD = 60.0
# A refused concurrent stream may retry as soon as one of the key's streams ends; we cannot
# know when that is, so suggest a short pause rather than an estimate.
CONCURRENCY_RETRY_AFTER = 1
# What a 503 limits_unavailable suggests: Redis is usually back (or failed over) in seconds.
UNAVAILABLE_RETRY_AFTER = 1
# Errors are logged at most this often (each log line says how many there were since the last).
LOG_INTERVAL = 60.0

# KEYS: the rate log, the leases, the token windows (minute, day), the token charges, the
# pending reservations. ARGV: requests per minute (0: none), concurrent streams (0: none), the
# lease id (also the member of every set), lease seconds, the minute's period, tokens per
# minute (0: none), tokens per day (0: none), the reservation, the day's period.
# Returns {0} admitted, {1, wait} over the rate (wait as a string: Lua numbers become
# integers), {2} over the concurrency, {3, wait, limit, remaining, period} over a token budget.
# An id already present means this very admission is being retried (the client retries a
# call whose connection broke): admitted, and charged only once.
ADMIT_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm = tonumber(ARGV[1])
local streams = tonumber(ARGV[2])
local id = ARGV[3]
local lease = tonumber(ARGV[4])
local period = tonumber(ARGV[5])
local budgets = {{KEYS[3], tonumber(ARGV[6]), period, '=tpm'}, {KEYS[4], tonumber(ARGV[7]),
  tonumber(ARGV[9]), '=tpd'}}
local reservation = tonumber(ARGV[8])
local tokens = budgets[1][2] > 0 or budgets[2][2] > 0
if (rpm > 0 and redis.call('ZSCORE', KEYS[1], id))
    or (streams > 0 and redis.call('ZSCORE', KEYS[2], id))
    or (tokens and redis.call('HEXISTS', KEYS[5], id) == 1) then
  return {0}
end
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - period)
  if redis.call('ZCARD', KEYS[1]) >= rpm then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {1, tostring(tonumber(oldest[2]) + period - now)}
  end
end
if streams > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  if redis.call('ZCARD', KEYS[2]) >= streams then
    return {2}
  end
end
if tokens then
  -- Expired reservations stay charged in full: only their pending mark goes.
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
  local longest = budgets[2][2] > 0 and 2 or 1
  local refusal = nil
  for i, budget in ipairs(budgets) do
    local zkey, limit, window, total = budget[1], budget[2], budget[3], budget[4]
    if limit > 0 then
      local gone = redis.call('ZRANGEBYSCORE', zkey, '-inf', now - window)
      if #gone > 0 then
        local freed = 0
        for _, member in ipairs(gone) do
          freed = freed + (tonumber(redis.call('HGET', KEYS[5], member)) or 0)
          if i == longest then
            redis.call('HDEL', KEYS[5], member)
          end
        end
        redis.call('ZREMRANGEBYSCORE', zkey, '-inf', now - window)
        redis.call('HINCRBY', KEYS[5], total, -freed)
      end
      local used = tonumber(redis.call('HGET', KEYS[5], total)) or 0
      if used >= limit then
        local need, freed, wait, start = used - limit + 1, 0, window, 0
        while wait == window do
          local page = redis.call('ZRANGE', zkey, start, start + 99, 'WITHSCORES')
          if #page == 0 then
            break
          end
          for j = 1, #page, 2 do
            freed = freed + (tonumber(redis.call('HGET', KEYS[5], page[j])) or 0)
            if freed >= need then
              wait = tonumber(page[j + 1]) + window - now
              break
            end
          end
          start = start + 100
        end
        if refusal == nil or wait > tonumber(refusal[2]) then
          refusal = {3, tostring(wait), limit, math.max(0, limit - used), tostring(window)}
        end
      end
    end
  end
  if refusal ~= nil then
    return refusal
  end
end
if rpm > 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('PEXPIRE', KEYS[1], math.ceil(period * 1000) + 1000)
end
if streams > 0 then
  redis.call('ZADD', KEYS[2], now + lease, id)
  redis.call('PEXPIRE', KEYS[2], math.ceil(lease * 1000) + 1000)
end
if tokens then
  local keep = 0
  redis.call('HSET', KEYS[5], id, reservation)
  for _, budget in ipairs(budgets) do
    if budget[2] > 0 then
      redis.call('ZADD', budget[1], now, id)
      redis.call('HINCRBY', KEYS[5], budget[4], reservation)
      redis.call('PEXPIRE', budget[1], math.ceil(budget[3] * 1000) + 1000)
      keep = math.max(keep, budget[3])
    end
  end
  redis.call('PEXPIRE', KEYS[5], math.ceil(keep * 1000) + 1000)
  redis.call('ZADD', KEYS[6], now + lease, id)
  redis.call('PEXPIRE', KEYS[6], math.ceil(lease * 1000) + 1000)
end
return {0}
"""

# KEYS: the leases to renew (the concurrency slot's, the pending reservation's). ARGV: the
# lease id, lease seconds. Pushes each lease's expiry; one that has expired already (renewals
# late by a whole lease) is not brought back: its slot may be taken, its reservation is final.
RENEW_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[2])
local renewed = 0
for _, key in ipairs(KEYS) do
  local changed = redis.call('ZADD', key, 'XX', 'CH', now + lease, ARGV[1])
  if changed > 0 then
    redis.call('PEXPIRE', key, math.ceil(lease * 1000) + 1000)
  end
  renewed = renewed + changed
end
return renewed
"""

# KEYS: the token windows (minute, day), the token charges, the pending reservations. ARGV:
# the lease id, the tokens used. Applies only to a reservation still pending, and only once
# (the pending mark goes as it applies); returns 1 if it did, 0 if the reservation had expired
# (charged in full) or was settled already.
SETTLE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local id = ARGV[1]
local used = tonumber(ARGV[2])
local pending = redis.call('ZSCORE', KEYS[4], id)
if not pending then
  return 0
end
redis.call('ZREM', KEYS[4], id)
if tonumber(pending) < now then
  return 0
end
local charged = tonumber(redis.call('HGET', KEYS[3], id))
if not charged then
  return 0
end
redis.call('HSET', KEYS[3], id, used)
if redis.call('ZSCORE', KEYS[1], id) then
  redis.call('HINCRBY', KEYS[3], '=tpm', used - charged)
end
if redis.call('ZSCORE', KEYS[2], id) then
  redis.call('HINCRBY', KEYS[3], '=tpd', used - charged)
end
return 1
"""


class _ErrorLog:
    """At most one log line per :data:`LOG_INTERVAL`, saying how many errors it stands for."""

    def __init__(self) -> None:
        self._last = -math.inf
        self._unlogged = 0

    def error(self, operation: str, what: str) -> None:
        self._unlogged += 1
        now = trio.current_time()
        if now - self._last < LOG_INTERVAL:
            return
        log.warning(
            "limits store (Redis) %s failed: %s (%d error(s) in the last minute)",
            operation,
            what,
            self._unlogged,
        )
        self._last, self._unlogged = now, 0


# OpenAI's names for the request window, beside the token ones: an SDK or dashboard that reads
# one reads the other.
REQUESTS_LIMIT_HEADER = "x-ratelimit-limit-requests"
REQUESTS_REMAINING_HEADER = "x-ratelimit-remaining-requests"
REQUESTS_RESET_HEADER = "x-ratelimit-reset-requests"


def rate_limited(key: KeyConfig, wait: float) -> ApiError:
    """The 429 of a key over its requests per minute; ``wait``: until the oldest leaves. The
    window is full when this is raised, so nothing remains until then."""
    return ApiError(
        429,
        f"Rate limit reached for key {key.name!r}: {key.requests_per_minute} "
        f"requests per minute. Retry in {wait:.1f}s.",
        type=RATE_LIMIT,
        code="rate_limit_exceeded",
        headers={
            "Retry-After": str(max(1, math.ceil(wait))),
            REQUESTS_LIMIT_HEADER: str(key.requests_per_minute),
            REQUESTS_REMAINING_HEADER: "0",
            REQUESTS_RESET_HEADER: reset_text(wait),
        },
    )


def concurrency_limited(key: KeyConfig) -> ApiError:
    return ApiError(
        429,
        f"Concurrency limit reached for key {key.name!r}: "
        f"{key.max_concurrent_streams} request(s) in flight. Retry when one ends.",
        type=RATE_LIMIT,
        code="concurrency_limit_exceeded",
        headers={"Retry-After": str(CONCURRENCY_RETRY_AFTER)},
    )


def limits_unavailable() -> ApiError:
    return ApiError(
        503,
        "Per-key limits cannot be checked right now (their store, Redis, does not answer); "
        "retry shortly.",
        type=SERVER_ERROR,
        code="limits_unavailable",
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)},
    )


class RedisLease:
    """One admitted request's hold in Redis: its concurrency slot (a member of the key's
    leases), its token reservation (a member of the key's pending reservations), or both."""

    __slots__ = ("_settled", "_store", "budget", "id", "key")

    def __init__(
        self,
        store: RedisLimits,
        key: str | None,
        lease_id: str,
        budget: tuple[str, str, str, str] | None = None,
    ) -> None:
        self._store = store
        self.key = key
        self.id = lease_id
        # The token windows (minute, day), the charges and the pending reservations.
        self.budget = budget
        self._settled = False

    @property
    def renewed_keys(self) -> list[str]:
        keys = [] if self.key is None else [self.key]
        if self.budget is not None:
            keys.append(self.budget[3])
        return keys

    async def settle(self, tokens: int) -> None:
        """The reservation becomes ``tokens`` (once; shielded and bounded)."""
        if self.budget is None or self._settled:
            return
        self._settled = True
        await self._store.settle(self, tokens)

    async def keep_renewed(self) -> None:
        """Renew the lease every ``lease_seconds / 3`` until cancelled: two renewals may fail
        (or be late) before it expires."""
        interval = self._store.limits.lease_seconds / 3
        while True:
            await trio.sleep(interval)
            await self._store.renew(self)

    async def release(self) -> None:
        await self._store.release(self)


class RedisLimits:
    """The Redis side of a :class:`~proxy.api.auth.KeyRing`; one per server process.

    Its connections live in :meth:`run`: the app may start it in its own nursery; otherwise the
    first request starts it as a trio system task (the connections then live as long as the
    process's event loop, and close when it ends).
    """

    def __init__(self, limits: LimitsConfig, metrics: Metrics | None = None) -> None:
        # Imported here, at start-up (it takes ~0.4 s), not in a request's bounded time; and
        # only by a server that uses Redis.
        import coredis

        self._coredis = coredis
        self.limits = limits
        self.metrics = metrics
        self._client: coredis.Redis[bytes] | None = None
        self._admit: Any = None
        self._renew: Any = None
        self._settle: Any = None
        self._ready: trio.Event | None = None
        self._errors = _ErrorLog()
        # Set by keep_connected (the server's nursery owns the client's task): a request
        # that needs a client asks for one here instead of starting it itself.
        self._wanted: trio.Event | None = None

    def _keys(self, name: str) -> tuple[str, str]:
        base = f"{self.limits.key_prefix}{{{name}}}"
        return f"{base}:rpm", f"{base}:streams"

    def _token_keys(self, name: str) -> tuple[str, str, str, str]:
        base = f"{self.limits.key_prefix}{{{name}}}"
        return f"{base}:tpm", f"{base}:tpd", f"{base}:tokens", f"{base}:pending"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the client's connections open until cancelled. Connecting happens on first use,
        so this starts at once whether or not Redis is up."""
        ready = self._ready
        if ready is None:
            ready = self._ready = trio.Event()
        try:
            limits = self.limits
            client: coredis.Redis[bytes] = self._coredis.Redis.from_url(
                limits.url,
                connect_timeout=limits.timeout,
                stream_timeout=limits.timeout,
                pool_timeout=limits.timeout,
                max_connections=limits.pool_size,
            )
            async with client:
                self._client = client
                self._admit = client.register_script(ADMIT_SCRIPT)
                self._renew = client.register_script(RENEW_SCRIPT)
                self._settle = client.register_script(SETTLE_SCRIPT)
                ready.set()
                task_status.started()
                await trio.sleep_forever()
        except Exception as error:  # noqa: BLE001
            # The client's own tasks failed: the next request opens a fresh one.
            self._errors.error("client", repr(error))
        finally:
            self._client = None
            if self._ready is ready:
                self._ready = None
            ready.set()  # whoever waits for this client: it is gone

    async def keep_connected(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """For the server's lifetime, in its nursery: run the client whenever a request needs
        one, and again after it fails (connecting stays lazy: a server starts with Redis down)."""
        wanted = self._wanted = trio.Event()
        task_status.started()
        try:
            while True:
                await wanted.wait()
                wanted = self._wanted = trio.Event()
                await self.run()
        finally:
            self._wanted = None

    async def _connected(self) -> coredis.Redis[bytes]:
        client = self._client
        if client is not None:
            return client
        ready = self._ready
        if ready is None:
            ready = self._ready = trio.Event()
            if self._wanted is not None:
                self._wanted.set()
            else:
                # Only outside a server (a store used on its own, in tests): no nursery of
                # ours to own the client's task.
                trio.lowlevel.spawn_system_task(self.run, name="sluice limits store (Redis)")
        await ready.wait()
        if self._client is None:
            raise RuntimeError("the Redis client could not start")
        return self._client

    def _count(self, operation: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.limits_errors.labels(operation, outcome).inc()

    async def acquire(self, key: KeyConfig, reservation: int = 0) -> RedisLease | None:
        """Admit one request for ``key``, reserving ``reservation`` tokens of a budgeted key:
        its lease (None when it holds no concurrency slot nor reservation, or was admitted
        uncounted under ``on_error = "allow"``), or a 429 / 503 ApiError."""
        # Its account: the key's name, or the key and one subject (a key mapped per subject).
        rate, streams = self._keys(key.account)
        budget = self._token_keys(key.account)
        budgeted = bool(key.tokens_per_minute or key.tokens_per_day)
        lease_id = os.urandom(9).hex()
        lease = RedisLease(
            self,
            streams if key.max_concurrent_streams else None,
            lease_id,
            budget if budgeted else None,
        )
        reply: Any = None
        failure = "timed out"
        sent = False
        try:
            with trio.move_on_after(self.limits.timeout):
                try:
                    client = await self._connected()
                    sent = True
                    reply = await self._admit(
                        keys=[rate, streams, *budget],
                        args=[
                            key.requests_per_minute,
                            key.max_concurrent_streams,
                            lease_id,
                            self.limits.lease_seconds,
                            RATE_PERIOD,
                            key.tokens_per_minute,
                            key.tokens_per_day,
                            reservation,
                            DAY,
                        ],
                        client=client,
                    )
                except Exception as error:  # noqa: BLE001 (any failure of the store is on_error's)
                    failure = repr(error)
        finally:
            if sent and reply is None:
                # The script may have run with its answer lost (the request cancelled, the
                # call timed out, the connection dropped): what it may have taken under this
                # lease id, a stream slot and a reservation, is given back rather than held
                # until it expires. Shielded and bounded, as every release is.
                await self.release(lease)
                if lease.budget is not None:
                    await self.settle(lease, 0)
        if reply is None:
            allow = self.limits.on_error == "allow"
            self._count("admit", "allowed" if allow else "denied")
            self._errors.error("admit", failure)
            if allow:
                return None
            raise limits_unavailable()
        verdict = int(reply[0])
        if verdict == 1:
            raise rate_limited(key, float(reply[1]))
        if verdict == 2:
            raise concurrency_limited(key)
        if verdict == 3:
            wait, limit, remaining, period = reply[1:5]
            raise token_limited(key, int(limit), float(period), int(remaining), float(wait))
        if not key.max_concurrent_streams and not budgeted:
            return None
        return lease

    async def renew(self, lease: RedisLease) -> None:
        """Push ``lease``'s expiry; a failure is counted and logged, and the lease expires
        unless a later renewal gets through."""
        args = [lease.id, self.limits.lease_seconds]
        await self._bounded(
            "renew", lambda client: self._renew(keys=lease.renewed_keys, args=args, client=client)
        )

    async def settle(self, lease: RedisLease, tokens: int) -> None:
        """Settle the reservation to ``tokens``, shielded and bounded; a failed settlement is
        counted and logged, and the reservation stays charged in full."""
        assert lease.budget is not None
        keys, args = list(lease.budget), [lease.id, tokens]
        await self._bounded(
            "settle",
            lambda client: self._settle(keys=keys, args=args, client=client),
            shield=True,
        )

    async def release(self, lease: RedisLease) -> None:
        """Give the slot back, shielded (the request may be cancelled) and bounded; a failed
        release is counted and logged, and the lease expires on its own."""
        key = lease.key
        if key is None:
            return
        await self._bounded("release", lambda client: client.zrem(key, [lease.id]), shield=True)

    async def _bounded(
        self,
        operation: str,
        call: Callable[[Any], Awaitable[object]],
        *,
        shield: bool = False,
    ) -> None:
        await self.bounded(operation, call, shield=shield)

    async def bounded(
        self,
        operation: str,
        call: Callable[[Any], Awaitable[object]],
        *,
        shield: bool = False,
    ) -> bool:
        """``call(client)`` within ``[limits] timeout`` (shielded from the caller's cancellation
        when ``shield``); whether it went through. A failure or a timeout is counted under
        ``operation`` and logged."""
        failure = "timed out"
        with trio.CancelScope(shield=shield), trio.move_on_after(self.limits.timeout):
            try:
                await call(await self._connected())
            except Exception as error:  # noqa: BLE001 (any failure of the store is on_error's)
                failure = repr(error)
            else:
                return True
        self._count(operation, "failed")
        self._errors.error(operation, failure)
        return False
