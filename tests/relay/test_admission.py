"""Sluice's queue (proxy/relay/admission.py) under virtual time: requests dispatched only while
a room has room, in the scheduler's order, work-conserving across rooms, with its refusals
(queue full, queue timeout, a deadline that cannot be met), and nothing held by a request that
leaves. The order itself is tests/protocol/test_scheduling.py's."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from proxy.protocol.errors import ApiError
from proxy.protocol.scheduling import SchedulingSettings, Ticket
from proxy.relay.admission import Admission, Dispatcher, Room, Scheduling


class Asks:
    """A producer's :class:`~proxy.relay.admission.Pausable`, from a function."""

    def __init__(self, ask: Callable[[], bool]) -> None:
        self._ask = ask

    def ask(self) -> bool:
        return self._ask()

    def withdraw(self) -> bool:
        return False


def model_queue(
    capacity: int = 1,
    *,
    rooms: int = 1,
    max_queue: int = 10,
    queue_timeout: float = 30.0,
    policy: str = "fair",
) -> Admission:
    dispatcher = Dispatcher(SchedulingSettings(policy=policy, starvation_seconds=0))
    made = [dispatcher.room(Room(f"replica {i}", capacity)) for i in range(rooms)]
    return Admission("m", dispatcher, max_queue=max_queue, queue_timeout=queue_timeout, rooms=made)


async def hold(
    admission: Admission,
    ticket: Ticket,
    order: list[str],
    seconds: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    task_status.started()
    async with admission.slot(ticket) as room:
        order.append(f"{ticket.tenant}@{room.name}")
        await trio.sleep(seconds)


async def test_requests_past_the_capacity_wait_and_go_in_the_fair_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = model_queue(capacity=1)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            await nursery.start(hold, admission, Ticket("flood", input_tokens=100), order, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        await nursery.start(hold, admission, Ticket("chat", input_tokens=100), order, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 4
    # The chat arrived last, behind three of the flood's, and is lifted to the flood's
    # counter (being new is not banked); the tie goes to the key served less: it takes the
    # next slot to free, not the fifth.
    assert [entry.split("@")[0] for entry in order] == ["flood", "chat", "flood", "flood", "flood"]
    assert admission.waiting == 0 and admission.rooms[0].in_flight == 0


async def test_fifo_keeps_arrival_order(autojump_clock: trio.abc.Clock) -> None:
    admission = model_queue(capacity=1, policy="fifo")
    admission.dispatcher.queue.counters.update({"flood": 1000.0})
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for tenant in ("flood", "flood", "flood", "chat"):
            await nursery.start(hold, admission, Ticket(tenant), order, 1.0)
            await trio.testing.wait_all_tasks_blocked()
    assert [entry.split("@")[0] for entry in order] == ["flood", "flood", "flood", "chat"]


async def test_a_request_goes_to_whichever_room_has_room_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Work-conserving: a request waiting while one replica is busy for long goes to the
    other the moment it has room."""
    admission = model_queue(capacity=1, rooms=2)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission, Ticket("x"), order, 100.0)  # replica 0, long
        await nursery.start(hold, admission, Ticket("y"), order, 1.0)  # replica 1, short
        await nursery.start(hold, admission, Ticket("z"), order, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        assert admission.waiting == 1
        began = trio.current_time()
        await trio.sleep(1.5)
        assert order == ["x@replica 0", "y@replica 1", "z@replica 1"]
        assert trio.current_time() - began < 2
        nursery.cancel_scope.cancel()


async def test_a_room_that_gets_room_dispatches_at_once() -> None:
    """A scrape that says an upstream's own queue drained (room.full turns false), or a reload
    that grows its capacity: what waits goes."""
    admission = model_queue(capacity=1)
    room = admission.rooms[0]
    blocked = True
    room.full = lambda: blocked
    order: list[str] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(hold, admission, Ticket("a"), order, 0.0)
            await trio.testing.wait_all_tasks_blocked()
            assert admission.waiting == 1 and order == []
            blocked = False
            room.poke()
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["a@replica 0"]
    room.full = None
    room.resize(3)
    assert room.capacity == 3


async def test_the_queue_is_bounded_in_size_and_time(autojump_clock: trio.abc.Clock) -> None:
    admission = model_queue(capacity=1, max_queue=1, queue_timeout=5.0)
    order: list[str] = []
    left: list[str] = []
    admission.on_leave = lambda ticket, seconds, outcome: left.append(outcome)
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission, Ticket("a"), order, 100.0)
        queued = trio.Event()

        async def waits() -> None:
            queued.set()
            with pytest.raises(ApiError) as timed_out:
                async with admission.slot(Ticket("b")):
                    pass
            assert (timed_out.value.status, timed_out.value.code) == (503, "queue_timeout")
            assert "model 'm'" in timed_out.value.message
            assert "replica" not in timed_out.value.message  # no address reaches a client

        nursery.start_soon(waits)
        await queued.wait()
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(ApiError) as full:
            async with admission.slot(Ticket("c")):
                pass
        assert (full.value.status, full.value.code) == (429, "queue_full")
        assert int(full.value.headers["Retry-After"]) >= 1
        await trio.sleep(6)
        nursery.cancel_scope.cancel()
    assert left == ["admitted", "queue_full", "queue_timeout"]


async def test_a_deadline_that_cannot_be_met_is_refused_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Four requests ahead, one slot held 10 s on average: one whose client stops waiting in
    20 s cannot start in time, and is told so at once rather than left waiting."""
    admission = model_queue(capacity=1, queue_timeout=1000)
    room = admission.rooms[0]
    room.average_hold = 10.0
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(5):
            await nursery.start(hold, admission, Ticket("a"), order, 10.0)
        await trio.testing.wait_all_tasks_blocked()
        now = trio.current_time()
        with pytest.raises(ApiError) as refused:
            async with admission.slot(Ticket("b", first_byte_by=now + 20)):
                pass
        assert trio.current_time() == now  # at once
        assert (refused.value.status, refused.value.code) == (503, "deadline_unmeetable")
        # One with time enough waits its turn.
        await nursery.start(hold, admission, Ticket("b", first_byte_by=now + 1000), order, 0.0)
    assert order.count("b@replica 0") == 1


async def test_a_waiting_request_is_refused_at_its_deadline_and_none_starts_after_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = model_queue(capacity=1)
    admission.rooms[0].average_hold = 0.001  # the estimate says it will make it
    started: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission, Ticket("a"), [], 30.0)
        deadline = trio.current_time() + 5
        with pytest.raises(ApiError) as refused:
            async with admission.slot(Ticket("b", first_byte_by=deadline)):
                started.append(trio.current_time())
        assert refused.value.code == "deadline_unmeetable"
        assert trio.current_time() == pytest.approx(deadline)
        assert started == []
        with pytest.raises(ApiError):
            async with admission.slot(Ticket("c", first_byte_by=trio.current_time())):
                started.append(trio.current_time())
        assert started == []
        nursery.cancel_scope.cancel()


async def test_a_request_that_leaves_while_queued_or_just_dispatched_holds_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = model_queue(capacity=1)
    room = admission.rooms[0]
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hold, admission, Ticket("a"), order, 1.0)
        with trio.CancelScope() as leaving:
            leaving.deadline = trio.current_time() + 0.5
            async with admission.slot(Ticket("b")):
                pytest.fail("never dispatched")
        assert admission.waiting == 0
        # Dispatched in the same step as it is cancelled: the slot goes on to the next.
        waiter_scope = trio.CancelScope()

        async def dispatched_then_cancelled() -> None:
            with waiter_scope:
                async with admission.slot(Ticket("c")):
                    await trio.sleep_forever()

        nursery.start_soon(dispatched_then_cancelled)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.6)  # a's slot frees: c is dispatched...
        waiter_scope.cancel()  # ...and leaves
        await trio.testing.wait_all_tasks_blocked()
    assert room.in_flight == 0
    assert admission.dispatcher.queue.size == 0


async def test_output_is_charged_to_its_key_as_it_streams(autojump_clock: trio.abc.Clock) -> None:
    admission = model_queue(capacity=1)
    queue = admission.dispatcher.queue
    produced = 0
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        ticket = Ticket("streamer", input_tokens=10)

        async def streams(task_status: trio.TaskStatus[None]) -> None:
            nonlocal produced
            async with admission.slot(ticket):
                admission.dispatcher.track(ticket, lambda: produced)
                task_status.started()
                for _ in range(100):
                    produced += 1
                    await trio.sleep(0.01)

        await nursery.start(streams)
        assert queue.counters["streamer"] == 10.0  # its input, at dispatch
        await trio.sleep(0.5)
        # Someone waits: each decision charges what has streamed so far (w_out = 2).
        await nursery.start(hold, admission, Ticket("other"), order, 0.0)
        admission.dispatcher.dispatch(admission.rooms[0])
        assert queue.counters["streamer"] == pytest.approx(10.0 + 2 * produced)
    # And all of it, once it is done.
    assert queue.counters["streamer"] == pytest.approx(10.0 + 2 * 100)


def test_a_processs_rooms_outlive_a_reload() -> None:
    scheduling = Scheduling(SchedulingSettings())
    room = scheduling.room("http://replica:8000", 4)
    room.in_flight = 3
    again = scheduling.room("http://replica:8000", 6)
    assert again is room and (room.capacity, room.in_flight) == (6, 3)
    scheduling.upstream.queue.counters["a"] = 5.0
    scheduling.configure(SchedulingSettings(policy="fifo"))
    assert scheduling.upstream.queue.settings.policy == "fifo"
    assert scheduling.upstream.queue.counters == {"a": 5.0}
    assert math.isfinite(room.average_hold)


# -- preemption ---------------------------------------------------------------------------


async def test_a_waiting_urgent_request_pauses_a_batch_one_which_then_takes_a_slot_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    dispatcher = Dispatcher(
        SchedulingSettings(starvation_seconds=0, preempt_after=2.0, pause_keepalive=5.0)
    )
    room = dispatcher.room(Room("replica", 1))
    admission = Admission("m", dispatcher, max_queue=1, queue_timeout=30.0, rooms=[room])
    events: list[str] = []
    comments: list[float] = []
    paused_for: list[float] = []
    admission.on_preempt = lambda ticket: events.append(f"paused {ticket.tenant}")
    admission.on_resume = lambda ticket, seconds: paused_for.append(seconds)
    batch = Ticket("batch", band=5)
    asked = trio.Event()

    async def run_batch() -> None:
        async with admission.lease(batch) as lease:
            scope = trio.CancelScope()

            def pause() -> bool:
                asked.set()
                scope.cancel()
                return True

            dispatcher.track(batch, lambda: 0, room=lease.room, pause=Asks(pause))
            with scope:
                await trio.sleep_forever()
            events.append("batch gave its slot up")
            seconds = await lease.pause([room], lambda _: comments.append(trio.current_time()))
            events.append(f"batch resumed after {seconds:g}s")
            assert lease.pauses == 1 and lease.room is room

    async def run_urgent() -> None:
        async with admission.slot(Ticket("chat", band=0)):
            events.append(f"chat dispatched at {trio.current_time():g}")
            await trio.sleep(12.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_batch)
        await trio.testing.wait_all_tasks_blocked()
        # The queue is full (max_queue=1) once the chat waits; a paused request waits again
        # whatever its bound says (it was admitted already).
        nursery.start_soon(run_urgent)
    assert events == [
        "batch gave its slot up",
        "paused batch",
        "chat dispatched at 2",
        "batch resumed after 12s",
    ]
    assert batch.preemptions == 1 and not batch.resumed
    # Its client heard of the pause at once, then every pause_keepalive seconds.
    assert comments == [2.0, 7.0, 12.0]
    assert paused_for == [12.0]
    assert room.in_flight == 0 and admission.waiting == 0


async def test_a_request_that_declines_is_not_paused_and_the_urgent_one_waits(
    autojump_clock: trio.abc.Clock,
) -> None:
    dispatcher = Dispatcher(SchedulingSettings(starvation_seconds=0, preempt_after=1.0))
    room = dispatcher.room(Room("replica", 1))
    admission = Admission("m", dispatcher, max_queue=5, queue_timeout=30.0, rooms=[room])
    asked = 0

    def decline() -> bool:
        nonlocal asked
        asked += 1
        return False

    dispatched_at: list[float] = []

    async def run_urgent() -> None:
        async with admission.slot(Ticket("chat", band=0)):
            dispatched_at.append(trio.current_time())

    batch = Ticket("batch", band=5)

    async def run_declining() -> None:
        async with admission.lease(batch) as lease:
            dispatcher.track(batch, lambda: 0, room=lease.room, pause=Asks(decline))
            await trio.sleep(5.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_declining)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run_urgent)
    # Asked once; it said no, so it is not asked again; the chat waited for its end.
    assert asked == 1
    assert dispatched_at == [5.0]
    assert batch.preemptions == 0


async def test_a_client_that_leaves_while_paused_leaves_nothing_queued(
    autojump_clock: trio.abc.Clock,
) -> None:
    dispatcher = Dispatcher(SchedulingSettings(starvation_seconds=0, preempt_after=1.0))
    room = dispatcher.room(Room("replica", 1))
    admission = Admission("m", dispatcher, max_queue=5, queue_timeout=30.0, rooms=[room])
    batch = Ticket("batch", band=5)

    async def run_batch(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as client:
            task_status.started(client)
            async with admission.lease(batch) as lease:
                scope = trio.CancelScope()
                dispatcher.track(
                    batch,
                    lambda: 0,
                    room=lease.room,
                    pause=Asks(lambda: bool(scope.cancel()) or True),
                )
                with scope:
                    await trio.sleep_forever()
                await lease.pause([room], lambda _: None)

    async def run_urgent() -> None:
        async with admission.slot(Ticket("chat", band=0)):
            await trio.sleep(10.0)

    async with trio.open_nursery() as nursery:
        client = await nursery.start(run_batch)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(run_urgent)
        await admission.wait_queued(1)  # the paused batch, waiting to be continued
        client.cancel()
        await admission.wait_queued(0)
        assert dispatcher.queue.size == 0
        assert not dispatcher.running(batch)
    assert room.in_flight == 0
