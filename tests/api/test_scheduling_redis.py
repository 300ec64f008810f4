"""The fair scheduler's counters shared through a real Redis (``proxy/api/shared_service.py``).

Two instances in one process: each its own :class:`Dispatcher` (its queue and counters), its own
:class:`RedisLimits` client and its own :class:`SharedService`, over one throwaway
``redis-server`` (``tests/api/test_limits_redis.py``'s, started per test); without the binary
these tests skip, saying so. The arithmetic is simulated in
``tests/protocol/test_scheduling_shared.py``; here: the script, the wire, the timing, and Redis
going away.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from proxy.api.limits import RedisLimits
from proxy.api.shared_service import SharedService
from proxy.config import LimitsConfig
from proxy.ops.metrics import Metrics
from proxy.protocol.scheduling import SchedulingSettings, Ticket
from proxy.relay.admission import Dispatcher
from tests.api.test_limits_redis import REDIS_SERVER, RedisServer
from tests.support import DEADLINE

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (`make redis` installs Debian's package when root)",
)

SETTINGS = SchedulingSettings(policy="fair", w_in=1.0, w_out=2.0, starvation_seconds=0)
HASH = "sluice:scheduling:upstream"


class Instance:
    """One Sluice instance's side of it: its dispatcher, its store, its sync."""

    def __init__(self, server: RedisServer, *, interval: float = 1.0, timeout: float = 2.0) -> None:
        self.metrics = Metrics()
        # A generous timeout by default: a call a loaded machine makes slow would be a failed
        # sync. The tests of the timeout itself pass their own.
        self.store = RedisLimits(
            LimitsConfig(backend="redis", url=server.url, timeout=timeout), self.metrics
        )
        self.dispatcher = Dispatcher(SETTINGS)
        self.queue = self.dispatcher.queue
        self.service = SharedService(self.dispatcher, lambda: self.store, interval=interval)

    def share_failures(self) -> float:
        text = self.metrics.render()[0].decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "sluice_limits_errors_total" and sample.labels == {
                    "operation": "share",
                    "outcome": "failed",
                }:
                    return sample.value
        return 0.0


async def stored(instance: Instance) -> dict[str, float]:
    """The hash in Redis, read through ``instance``'s client."""
    answer: list[Any] = []

    async def read(client: Any) -> None:
        answer.append(await client.hgetall(HASH))

    assert await instance.store.bounded("read", read)
    return {field.decode(): float(total) for field, total in answer[0].items()}


async def test_one_instances_counters_after_a_sync_include_the_others(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        one, two = Instance(redis_server), Instance(redis_server)
        one.queue.charge("alice", 1.0, input_tokens=100)
        # A request still running on instance one: its output so far goes with the sync, not
        # when it ends.
        one.dispatcher.track(Ticket("alice"), lambda: 10)
        two.queue.charge("bob", 2.0, input_tokens=40)  # weight 2: 20
        assert await one.service.sync()
        assert await two.service.sync()
        # Two has heard of everything; one of bob at its next sync.
        assert two.queue.counters == {"alice": 120.0, "bob": 20.0}
        assert one.queue.counters == {"alice": 120.0}
        assert await one.service.sync()
        assert one.queue.counters == two.queue.counters
        assert await stored(one) == {"alice": 120.0, "bob": 20.0}
        # Only what came since goes out: nothing is counted twice.
        one.queue.charge("alice", 1.0, input_tokens=5)
        for _ in range(2):
            assert await one.service.sync()
            assert await two.service.sync()
        assert await stored(two) == {"alice": 125.0, "bob": 20.0}
        assert two.queue.counters == {"alice": 125.0, "bob": 20.0}


async def test_requests_with_no_key_are_dash_in_redis_and_no_key_again_here(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(DEADLINE):
        one, two = Instance(redis_server), Instance(redis_server)
        one.queue.charge("", 1.0, input_tokens=7)
        assert await one.service.sync()
        assert await stored(one) == {"-": 7.0}
        assert await two.service.sync()
        assert two.queue.counters == {"": 7.0}


async def test_a_key_lifted_on_both_instances_is_lifted_once_in_redis(
    redis_server: RedisServer,
) -> None:
    """bob returns to both instances while alice waits on each: each lifts bob to alice's
    counter. The script keeps the larger lift (a floor); added, bob would wait behind twice
    alice's past service."""
    with trio.fail_after(DEADLINE):
        one, two = Instance(redis_server), Instance(redis_server)
        one.queue.charge("alice", 1.0, input_tokens=1000)
        assert await one.service.sync()
        assert await two.service.sync()
        for instance in (one, two):
            instance.queue.add(Ticket("alice", input_tokens=1))
            instance.queue.add(Ticket("bob", input_tokens=1))
            assert instance.queue.counters["bob"] == 1000.0
        assert await one.service.sync()
        assert await two.service.sync()
        assert await stored(two) == {"alice": 1000.0, "bob": 1000.0}
        # Its first request served on one: service, added to the lift.
        one.queue.charge("bob", 1.0, input_tokens=10)
        assert await one.service.sync()
        assert await two.service.sync()
        assert two.queue.counters["bob"] == 1010.0


class Syncs:
    """Every sync both instances' run loops make, in the order they start and end: for each,
    whether it went through and how much of alice's service ``two`` had heard at its end."""

    def __init__(self, two: Instance) -> None:
        self.two = two
        self.log: list[tuple[str, str, int, bool, float]] = []
        self.changed = trio.Event()

    def count(self, name: str, instance: Instance) -> None:
        sync = instance.service.sync
        number = 0

        async def counted() -> bool:
            nonlocal number
            number += 1
            mine = number
            # Everything up to the script's call runs before the first checkpoint: a sync
            # logged as started after a charge carries it.
            self._note(name, "start", mine, True)
            went = await sync()
            self._note(name, "end", mine, went)
            return went

        instance.service.sync = counted  # type: ignore[method-assign]

    def _note(self, name: str, what: str, number: int, went: bool) -> None:
        heard = self.two.queue.counters.get("alice", 0.0)
        self.log.append((name, what, number, went, heard))
        self.changed.set()
        self.changed = trio.Event()

    async def first_start(self, name: str, after: int) -> int:
        """The log's index of the first start of ``name``'s syncs logged after ``after``."""
        return await self._first(after, (name, "start"))

    async def end_of(self, start: int) -> int:
        """The log's index of the end of the sync whose start is at ``start``."""
        name, _, number, _, _ = self.log[start]
        return await self._first(start, (name, "end", number))

    async def _first(self, after: int, prefix: tuple[str | int, ...]) -> int:
        """The log's index of the first entry after ``after`` that begins with ``prefix``,
        waiting for it to be logged."""
        while True:
            for index in range(after + 1, len(self.log)):
                if self.log[index][: len(prefix)] == prefix:
                    return index
            await self.changed.wait()


async def test_what_one_instance_serves_reaches_the_other_within_two_intervals(
    redis_server: RedisServer,
) -> None:
    """Both syncing every ``interval`` on their own: a charge on one reaches two's counters
    at one's next sync and two's after it, so within two intervals (one when they fall
    together) and the round trips. Counted in syncs, not seconds: each run loop's syncs are
    logged, and two must have heard the charge at the end of its first sync that starts after
    the end of one's first sync that starts after the charge."""
    interval = 0.2
    with trio.fail_after(DEADLINE):
        one = Instance(redis_server, interval=interval)
        two = Instance(redis_server, interval=interval)
        # Redis connected before the loops start (the first call connects).
        assert await one.service.sync()
        assert await two.service.sync()
        syncs = Syncs(two)
        syncs.count("one", one)
        syncs.count("two", two)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one.service.run)
            await trio.sleep(interval / 2)  # out of phase
            nursery.start_soon(two.service.run)
            for round_ in range(1, 6):
                await trio.sleep(interval * 0.37 * round_ % interval)
                charged = len(syncs.log) - 1
                one.queue.charge("alice", 1.0, input_tokens=10)
                out = await syncs.end_of(await syncs.first_start("one", charged))
                assert syncs.log[out][3], syncs.log  # went through
                back = await syncs.end_of(await syncs.first_start("two", out))
                _, _, _, went, heard = syncs.log[back]
                assert went, syncs.log
                assert heard == 10.0 * round_, syncs.log
            nursery.cancel_scope.cancel()


async def test_redis_gone_fails_the_sync_not_the_scheduling_and_it_catches_up_after(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stops: each sync fails within ``[limits] timeout``, is counted and logged, and the
    instance orders by its own counters meanwhile. Redis returns empty (no persistence): what
    each instance knew and what it served meanwhile are in Redis again within two syncs."""
    with trio.fail_after(DEADLINE):
        one = Instance(redis_server, interval=0.05, timeout=0.25)
        two = Instance(redis_server, timeout=0.25)
        one.queue.charge("alice", 1.0, input_tokens=100)
        assert await one.service.sync()
        assert await two.service.sync()
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="sluice.limits"):
            started = trio.current_time()
            assert not await one.service.sync()
            assert trio.current_time() - started < 1.0
            assert one.share_failures() == 1
            # The loop goes on failing, without breaking.
            with trio.move_on_after(0.5):
                await one.service.run()
            assert one.share_failures() >= 2
        assert any("share failed" in record.getMessage() for record in caplog.records)
        # Scheduling goes on here, by the counters it has: alice served more, bob goes first.
        one.queue.charge("alice", 1.0, input_tokens=50)
        bob, alice = Ticket("bob"), Ticket("alice")
        one.queue.add(bob)
        one.queue.add(alice)
        assert one.queue.next(0.0) is bob
        one.queue.dispatched(bob)
        assert one.queue.next(0.0) is alice
        one.queue.dispatched(alice)
        redis_server.start()
        for _ in range(2):
            assert await one.service.sync()
            assert await two.service.sync()
        assert await stored(two) == {"alice": 150.0}
        assert two.queue.counters == {"alice": 150.0}
        assert one.queue.counters["alice"] == 150.0
