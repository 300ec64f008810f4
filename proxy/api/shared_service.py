"""The fair scheduler's counters shared through Redis (``[limits] backend = "redis"``): a key
that floods one instance is behind on every other too.

One hash per process kind of queue (``<prefix>scheduling:upstream``): a field per key (``-``:
requests with no key), its counter. Every ``[scheduling] share_seconds`` each instance sends
what it added to each counter since its last sync and reads every total back, in one Lua script
(atomic: a script runs alone on the server); the arithmetic is
:class:`~proxy.protocol.shared_counters.SharedCounters`' (a lift is sent as a floor, not as
service). Running requests' output is settled first, so what one instance served reaches
another within two intervals and the script's round trip: it goes out at the first's next sync
and comes back at the other's (one interval, with the syncs in phase). The service difference
between two backlogged keys stays within the VTC bound plus what the instances serve in that
time (``tests/protocol/test_scheduling_shared.py`` derives it).

A local model's counters are not shared: each instance's own model is its own resource.
Through :class:`~proxy.api.limits.RedisLimits`' client and its bounds (``[limits] timeout``,
errors counted and logged): a sync that fails is sent again, with what follows, at the next.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from proxy.api.limits import RedisLimits
from proxy.protocol.shared_counters import SharedCounters
from proxy.relay.admission import Dispatcher

# KEYS: the hash. ARGV: key, increment, floor, key, increment, floor... (a lift is a floor: the
# total is raised to it, never added to). Returns every field and its total.
SYNC_SCRIPT = """
for i = 1, #ARGV, 3 do
  local total = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]))
  if total < tonumber(ARGV[i + 2]) then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  end
end
return redis.call('HGETALL', KEYS[1])
"""
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
        self._script: object = None

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
        outgoing = self._counters.outgoing()
        floors = self._counters.floors
        args: list[str] = []
        for key in outgoing.keys() | floors.keys():
            increment, floor = outgoing.get(key, 0.0), floors.get(key, 0.0)
            args += [key or _NO_KEY, repr(increment), repr(floor)]
        key = f"{store.limits.key_prefix}scheduling:{self._name}"
        answer: list[object] = []

        async def call(client: object) -> None:
            script = client.register_script(SYNC_SCRIPT)  # type: ignore[attr-defined]
            answer.extend(await script(keys=[key], args=args, client=client))

        if not await store.bounded("share", call):
            return False
        totals: dict[str, float] = {}
        for field, value in zip(answer[::2], answer[1::2], strict=True):
            name = field.decode() if isinstance(field, bytes) else str(field)
            raw = value.decode() if isinstance(value, bytes) else str(value)
            totals["" if name == _NO_KEY else name] = float(raw)
        self._counters.incoming(totals)
        return True
