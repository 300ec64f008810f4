"""connection_server.IdleTimer: hypercorn's keep-alive timer, restarted and stopped without a
scheduler round trip (through a real server: test_relay_http's keep-alive tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from proxy.server.connection_server import IdleTimer


class TaskGroupStandIn:
    """What IdleTimer uses of hypercorn's TaskGroup: spawn (start_soon in its nursery)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery

    def spawn(self, func: Callable[..., Awaitable[None]], *args: object) -> None:
        self._nursery.start_soon(func, *args)


async def test_restart_and_stop_take_no_checkpoint(autojump_clock: trio.abc.Clock) -> None:
    fired: list[float] = []

    async def action() -> None:
        await trio.sleep(5)
        fired.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        timer = IdleTimer()
        group = TaskGroupStandIn(nursery)
        task = trio.lowlevel.current_task()
        checkpoints = task._cancel_points + task._schedule_points
        await timer.restart(group, action)
        await timer.stop()
        await timer.restart(group, action)
        # hypercorn's waits for the timer's task to start, under a lock: round trips each.
        assert task._cancel_points + task._schedule_points == checkpoints
    # Only the last restart's timer ran to its end; the first was stopped before it started.
    assert fired == [5.0]


async def test_a_restart_cancels_the_running_timer(autojump_clock: trio.abc.Clock) -> None:
    fired: list[str] = []

    def timer_named(name: str) -> Callable[[], Awaitable[None]]:
        async def action() -> None:
            await trio.sleep(5)
            fired.append(name)

        return action

    async with trio.open_nursery() as nursery:
        timer = IdleTimer()
        group = TaskGroupStandIn(nursery)
        await timer.restart(group, timer_named("first"))
        await trio.sleep(3)  # running, not yet fired
        await timer.restart(group, timer_named("second"))
        await trio.sleep(3)
        assert fired == []  # the first did not fire at 5 s: it was cancelled
        await trio.sleep(3)
        assert fired == ["second"]
        await timer.stop()  # after it fired: harmless
    assert fired == ["second"]
