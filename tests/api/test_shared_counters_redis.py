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
from proxy.api.shared_service import RECORD_SECONDS, SYNC_SCRIPT
from proxy.config import LimitsConfig
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
        super().__init__(LimitsConfig(backend="redis", url=server.url, timeout=0.25))
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


async def run_script(store: RedisLimits, *args: object) -> dict[str, float]:
    """``SYNC_SCRIPT`` once, on the totals and the record ``RECORD``: the totals it answers."""
    answer: list[Any] = []

    async def call(client: Any) -> None:
        script = client.register_script(SYNC_SCRIPT)
        answer.extend(
            await script(keys=[HASH, RECORD], args=[str(arg) for arg in args], client=client)
        )

    assert await store.bounded("share", call)
    return {
        field.decode(): float(total) for field, total in zip(answer[::2], answer[1::2], strict=True)
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
