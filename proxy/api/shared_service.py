"""The fair scheduler's counters shared through Redis (``[limits] backend = "redis"``): a key
that floods one instance is behind on every other too.

One hash per kind of queue (``<prefix>scheduling:upstream``): a field per key (``-``: requests
with no key), its total. Beside it, one hash per instance, its record
(``<prefix>scheduling:upstream:inst:<id>``, the id random per process): the largest service
the store took from that instance for each key. Every ``[scheduling] share_seconds`` each
instance sends its absolute service so far for each key served since its last answered sync,
with the value that sync carried, and reads every total back, in one Lua script (atomic: a
script runs alone on the server). The script adds only what the sent value exceeds the record
by (the answered value stands in for a record it lacks), so what a script carried counts once
when it still ran after the client gave up on it (``[limits] timeout``) and the next sync sends
it again, grown; and a script run twice, or late (after a newer one), adds nothing. The
arithmetic and the contract are :class:`~proxy.protocol.shared_counters.SharedCounters`' (a
lift is sent as a floor, not as service).

A record expires ``RECORD_SECONDS`` (or ten intervals, if longer) after the instance's last
sync that reached Redis: what a process gone leaves behind goes, and a live instance loses its
record only after that long without reaching Redis (even then, what counts twice is only what
the store took from it without answering).

A key's total unchanged for ``IDLE_SECONDS`` (or ten intervals, if longer) whose last change
every live instance has heard is forgotten by the script, with the instance's record of it, so
that a key per subject leaves the store (``<prefix>scheduling:upstream:changed``: each total's
last change on Redis's clock; ``:synced`` and ``:heard``: each live instance's last sync and
the last answer it heard). Why that loses nothing is in
:mod:`proxy.protocol.shared_counters`; each sync reads every total, so its cost grows with the
keys held, which this bounds.

Running requests' output is settled first, so what one instance served reaches another within
two intervals and the script's round trip: it goes out at the first's next sync and comes back
at the other's (one interval, with the syncs in phase). The service difference between two
backlogged keys stays within the VTC bound plus what the instances serve in that time
(``tests/protocol/test_scheduling_shared.py`` derives it).

A local model's counters are not shared: each instance's own model is its own resource.
Through :class:`~proxy.api.limits.RedisLimits`' client and its bounds (``[limits] timeout``,
errors counted and logged): what a sync that fails carried goes again with the next (its
values are absolute: the next carries them, grown).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable

import trio

from proxy.api.limits import RedisLimits
from proxy.protocol.shared_counters import SharedCounters
from proxy.relay.admission import Dispatcher

# KEYS: the totals, this instance's record, each total's last change (the store's clock), each
# instance's last sync, each instance's last answer heard. ARGV: the record's lifetime in seconds,
# how long a total stays unchanged before it may be forgotten, this instance's id, the store's
# clock at the last answer this instance heard (0: none), then per key: field, service sent,
# service answered (the record's stand-in), floor. Only what the record has not taken is added;
# a lift is a floor: the total is raised to it, never added to. A total unchanged that long
# whose last change every live instance has heard is forgotten, and so is this instance's
# record of each key the totals no longer hold (the module's docstring). Returns the store's
# clock if it knew this instance already (else -1), then every field of the totals and its
# total.
SYNC_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
for i = 5, #ARGV, 4 do
  local sent = tonumber(ARGV[i + 1])
  local taken = tonumber(redis.call('HGET', KEYS[2], ARGV[i]) or ARGV[i + 2])
  if sent > taken then
    redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], sent - taken)
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    redis.call('HSET', KEYS[3], ARGV[i], tostring(now))
  end
  if tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') < tonumber(ARGV[i + 3]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 3])
    redis.call('HSET', KEYS[3], ARGV[i], tostring(now))
  end
end
redis.call('EXPIRE', KEYS[2], ARGV[1])
local known = redis.call('HEXISTS', KEYS[4], ARGV[3]) == 1
redis.call('HSET', KEYS[4], ARGV[3], tostring(now))
redis.call('HSET', KEYS[5], ARGV[3], ARGV[4])
local heard = nil
local synced = redis.call('HGETALL', KEYS[4])
for j = 1, #synced, 2 do
  if now - tonumber(synced[j + 1]) > tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[4], synced[j])
    redis.call('HDEL', KEYS[5], synced[j])
  else
    local at = tonumber(redis.call('HGET', KEYS[5], synced[j]) or '0')
    if heard == nil or at < heard then heard = at end
  end
end
local answer = {known and tostring(now) or '-1'}
local totals = redis.call('HGETALL', KEYS[1])
for j = 1, #totals, 2 do
  local changed = tonumber(redis.call('HGET', KEYS[3], totals[j]) or '-1')
  if changed < 0 then
    redis.call('HSET', KEYS[3], totals[j], tostring(now))
    changed = now
  end
  if now - changed > tonumber(ARGV[2]) and changed <= heard then
    redis.call('HDEL', KEYS[1], totals[j])
    redis.call('HDEL', KEYS[3], totals[j])
  else
    answer[#answer + 1] = totals[j]
    answer[#answer + 1] = totals[j + 1]
  end
end
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  if redis.call('HEXISTS', KEYS[1], field) == 0 then
    redis.call('HDEL', KEYS[2], field)
  end
end
return answer
"""
# How long an instance's record outlives its last sync that reached Redis, at least (the
# module's docstring).
RECORD_SECONDS = 600
# How long a key's total stays unchanged before the store may forget it, at least (the
# module's docstring).
IDLE_SECONDS = 600
# The store's name of requests with no key (the queue's "" tenant).
_NO_KEY = "-"


class SharedService:
    """Shares one dispatcher's counters through the current config's Redis store."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        store: Callable[[], RedisLimits | None],
        *,
        name: str = "upstream",
        interval: float = 1.0,
    ) -> None:
        self._dispatcher = dispatcher
        self._counters = SharedCounters(dispatcher.queue)
        # The store of the config now served (a reload may change it, or turn it off).
        self._store = store
        self._name = name
        self.interval = interval
        # This process's name in the store: its record is its own.
        self.instance = uuid.uuid4().hex
        # How long a record outlives its instance's last sync; how long a key's total stays
        # unchanged before the store may forget it (each at least ten intervals).
        self.record_seconds: int = RECORD_SECONDS
        self.idle_seconds: float = IDLE_SECONDS

    async def run(self) -> None:
        """Sync every ``interval`` seconds, until cancelled."""
        while True:
            await trio.sleep(self.interval)
            await self.sync()

    async def sync(self) -> bool:
        """One sync; whether it went through."""
        store = self._store()
        if store is None:
            return False
        # What the running requests have put out so far is sent now, not when they end.
        self._dispatcher.settle()
        totals = self._counters.outgoing()
        answered, floors = self._counters.answered, self._counters.floors
        record = max(self.record_seconds, math.ceil(10 * self.interval))
        idle = max(self.idle_seconds, 10 * self.interval)
        args: list[str] = [str(record), repr(idle), self.instance, repr(self._counters.heard)]
        for key in totals.keys() | floors.keys():
            taken = answered.get(key, 0.0)
            sent, floor = totals.get(key, taken), floors.get(key, 0.0)
            args += [key or _NO_KEY, repr(sent), repr(taken), repr(floor)]
        prefix = f"{store.limits.key_prefix}scheduling:{self._name}"
        keys = [
            prefix,
            f"{prefix}:inst:{self.instance}",
            f"{prefix}:changed",
            f"{prefix}:synced",
            f"{prefix}:heard",
        ]
        answer: list[object] = []

        async def call(client: object) -> None:
            script = client.register_script(SYNC_SCRIPT)  # type: ignore[attr-defined]
            answer.extend(await script(keys=keys, args=args, client=client))

        if not await store.bounded("share", call):
            return False
        texts = [item.decode() if isinstance(item, bytes) else str(item) for item in answer]
        shared = {
            "" if name == _NO_KEY else name: float(total)
            for name, total in zip(texts[1::2], texts[2::2], strict=True)
        }
        clock = float(texts[0])
        self._counters.incoming(shared, at=clock if clock >= 0 else None)
        return True
