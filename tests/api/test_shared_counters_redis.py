"""The fair scheduler's shared counters against a real Redis: a sync script that runs twice, or
late, counts once (``proxy/api/shared_service.py``'s ``SYNC_SCRIPT``).

Over one throwaway ``redis-server`` per test (``tests/api/test_limits_redis.py``'s); without
the binary these tests skip, saying so. The arithmetic around the script is simulated sans-IO
in ``tests/protocol/test_scheduling_shared.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from proxy.api.limits import RedisLimits
from proxy.api.shared_service import IDLE_SECONDS, RECORD_SECONDS, SYNC_SCRIPT
from proxy.config import LimitsConfig
from proxy.protocol.scheduling import Ticket
from tests.api.test_limits_redis import REDIS_SERVER, RedisServer
from tests.api.test_scheduling_redis import HASH, Instance, stored
from tests.support import DEADLINE

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (`make redis` installs Debian's package when root)",
)

RECORD = f"{HASH}:inst:test"


class AnswersLost(RedisLimits):
    """A store whose calls reach Redis but, while :attr:`lose` is set, whose answers are lost,
    as when ``[limits] timeout`` fires while Redis still runs the script. Every sync's call is
    kept, to be run again later."""

    lose = False

    def __init__(self, server: RedisServer) -> None:
        # A generous timeout: a call a loaded machine makes slow would be a sync that failed
        # for real, not one whose answer the test loses.
        super().__init__(LimitsConfig(backend="redis", url=server.url, timeout=2.0))
        self.calls: list[Callable[[Any], Awaitable[object]]] = []

    async def bounded(
        self,
        operation: str,
        call: Callable[[Any], Awaitable[object]],
        *,
        shield: bool = False,
    ) -> bool:
        if operation == "share":
            self.calls.append(call)
        went = await super().bounded(operation, call, shield=shield)
        return went and not self.lose


async def run_script(store: RedisLimits, record: int, *fields: object) -> dict[str, float]:
    """``SYNC_SCRIPT`` once, on the totals and the record ``RECORD`` (nothing idle long enough
    to be forgotten): the totals it answers."""
    answer: list[Any] = []
    keys = [HASH, RECORD, f"{HASH}:changed", f"{HASH}:synced", f"{HASH}:heard"]
    args = [str(record), str(IDLE_SECONDS), "test", "0", *(str(field) for field in fields)]

    async def call(client: Any) -> None:
        script = client.register_script(SYNC_SCRIPT)
        answer.extend(await script(keys=keys, args=args, client=client))

    assert await store.bounded("share", call)
    return {
        field.decode(): float(total)
        for field, total in zip(answer[1::2], answer[2::2], strict=True)
    }


async def test_the_sync_script_run_again_or_late_adds_nothing(
    redis_server: RedisServer,
) -> None:
    """The same arguments twice (a timeout, then the script run again), and an older sync after
    a newer one: each key's total is the largest service sent, counted once. Without a record
    (dropped), the value answered stands in for it; the record lives ``RECORD_SECONDS``."""
    with trio.fail_after(DEADLINE):
        store = AnswersLost(redis_server)
        # field, service sent, service answered, floor
        for sent in (10.0, 10.0, 25.0, 10.0, 40.0, 25.0, 40.0, 10.0):
            totals = await run_script(store, RECORD_SECONDS, "alice", sent, 0.0, 0.0)
        assert totals == {"alice": 40.0}
        ttl: list[int] = []

        async def expiry(client: Any) -> None:
            ttl.append(await client.ttl(RECORD))
            await client.delete([RECORD])

        assert await store.bounded("read", expiry)
        assert 0 < ttl[0] <= RECORD_SECONDS
        # The record gone, the store answered 40 last: only what came since is added.
        assert await run_script(store, RECORD_SECONDS, "alice", 45.0, 40.0, 0.0) == {"alice": 45.0}
        assert await run_script(store, RECORD_SECONDS, "alice", 45.0, 40.0, 0.0) == {"alice": 45.0}
        # A floor raises the total, never adds to it; a floor below it changes nothing.
        assert await run_script(store, RECORD_SECONDS, "alice", 45.0, 45.0, 60.0) == {"alice": 60.0}
        assert await run_script(store, RECORD_SECONDS, "alice", 45.0, 45.0, 50.0) == {"alice": 60.0}


async def test_a_sync_redis_ran_after_the_client_gave_up_counts_once(
    redis_server: RedisServer,
) -> None:
    """Through ``SharedService``: the first sync runs in Redis but its answer is lost (the sync
    fails here); the next carries the same service, grown, and the total is the real service,
    not the first sync's twice. Both scripts run again, late: nothing is added. Another
    instance's service adds as ever."""
    with trio.fail_after(DEADLINE):
        one, two = Instance(redis_server), Instance(redis_server)
        lossy = one.store = AnswersLost(redis_server)
        one.queue.charge("alice", 1.0, input_tokens=100)
        lossy.lose = True
        assert not await one.service.sync()
        lossy.lose = False
        assert await stored(one) == {"alice": 100.0}
        one.queue.charge("alice", 1.0, input_tokens=5)
        assert await one.service.sync()
        assert await stored(one) == {"alice": 105.0}
        assert one.queue.counters == {"alice": 105.0}
        for call in list(lossy.calls):
            assert await lossy.bounded("share", call)
        assert await stored(one) == {"alice": 105.0}
        two.queue.charge("alice", 1.0, input_tokens=7)
        assert await two.service.sync()
        assert await one.service.sync()
        assert await stored(one) == {"alice": 112.0}
        assert one.queue.counters == two.queue.counters == {"alice": 112.0}


async def test_idle_subjects_leave_the_store_and_an_active_key_keeps_its_counter(
    redis_server: RedisServer,
) -> None:
    """1,000 subjects served once, then idle past the TTL, leave the totals, their last changes
    and every record, once both instances have heard their last totals; each instance lets go
    of them (the one that served them forgets them by the local rule). A key served at every
    sync meanwhile keeps every token counted."""
    with trio.fail_after(DEADLINE):
        one, two = Instance(redis_server, interval=0.01), Instance(redis_server, interval=0.01)
        for instance in (one, two):
            instance.service.record_seconds = 1
            instance.service.idle_seconds = 0.05
        for n in range(1000):
            one.queue.charge(f"sub{n}", 1.0, input_tokens=1)
        served = 0.0
        for _ in range(6):
            one.queue.dispatched(Ticket("active", input_tokens=10))
            served += 10.0
            assert await one.service.sync()
            assert await two.service.sync()
            await trio.sleep(0.1)
        assert await stored(one) == {"active": served}
        answer: list[Any] = []

        async def read(client: Any) -> None:
            for key in (f"{HASH}:changed", f"{HASH}:inst:{one.service.instance}"):
                answer.append(sorted(field.decode() for field in await client.hkeys(key)))
            answer.append(await client.exists(f"{HASH}:inst:{two.service.instance}"))

        assert await one.store.bounded("read", read)
        assert answer == [["active"], ["active"], 0]
        # Nothing pins them here any more: the queue's own rule forgets them (each at or below
        # the floor, the last dispatched's counter).
        assert one.queue.forget_idle() == 1000
        assert one.queue.counters == one.queue.served == {"active": served}
        assert not any(two.service._counters.holds(f"sub{n}") for n in range(1000))
        assert two.queue.counters["active"] == served
