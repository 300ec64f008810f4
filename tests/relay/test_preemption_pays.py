"""Preemption that pays off for the request that made it, over runs longer than every timer
(proxy/relay/admission.py with proxy/protocol/scheduling.py), under virtual time: the slot a
pause frees goes to the request that asked for it, even after an hour of batch work that the
starvation guard would favour; a pause is asked only where the slot freed can serve the waiter;
one ticket across retries; hedges never pause; no preemption during a drain, paused requests
first then, and queued requests that cannot start before the grace refused at once."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from proxy.protocol.errors import ApiError
from proxy.protocol.scheduling import SchedulingSettings, Ticket, keepalive_interval
from proxy.relay.admission import Admission, Dispatcher, Room
from tests.support import Pauser


def settings(**changes: object) -> SchedulingSettings:
    values: dict[str, object] = {
        "starvation_seconds": 60.0,
        "preempt_after": 0.5,
        "pause_keepalive": 5.0,
    }
    values.update(changes)
    return SchedulingSettings(**values)  # type: ignore[arg-type]


def one_model(capacity: int, scheduling: SchedulingSettings, *, rooms: int = 1) -> Admission:
    dispatcher = Dispatcher(scheduling)
    made = [dispatcher.room(Room(f"replica {i}", capacity)) for i in range(rooms)]
    return Admission("m", dispatcher, max_queue=100, queue_timeout=10_000.0, rooms=made)


async def batch_stream(
    admission: Admission,
    ticket: Ticket,
    seconds: float,
    log: list[str],
    *,
    rooms: list[Room] | None = None,
) -> None:
    """A pausable stream of ``seconds`` of work, continued after each pause until done."""
    async with admission.lease(ticket, rooms) as lease:
        left = seconds
        while True:
            pauser = Pauser()
            admission.dispatcher.track(ticket, lambda: 0, room=lease.room, pause=pauser)
            started = trio.current_time()
            with pauser.scope:
                await trio.sleep(left)
                log.append(f"{ticket.tenant} done at {trio.current_time():g}")
                return
            left -= trio.current_time() - started
            log.append(f"{ticket.tenant} paused at {trio.current_time():g}")
            await lease.pause(admission.rooms if rooms is None else rooms, lambda _: None)
            log.append(f"{ticket.tenant} resumed at {trio.current_time():g}")


async def urgent(admission: Admission, name: str, log: list[str], seconds: float = 1.0) -> None:
    async with admission.slot(Ticket(name, band=0)):
        log.append(f"{name} dispatched at {trio.current_time():g}")
        await trio.sleep(seconds)


async def test_after_an_hour_of_batch_work_the_slot_a_pause_frees_goes_to_the_urgent_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Two slots held by batch streams of two hours each, two more batch streams queued behind
    # them for an hour: every one of those is "starved" by then (starvation_seconds = 60). An
    # urgent chat sent an hour in gets the slot its preemption frees, at preempt_after.
    admission = one_model(2, settings())
    log: list[str] = []
    tickets = [Ticket(f"batch{i}", band=5) for i in range(4)]
    async with trio.open_nursery() as nursery:
        for ticket in tickets:
            nursery.start_soon(batch_stream, admission, ticket, 7200.0, log)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(3600.0)
        nursery.start_soon(urgent, admission, "chat", log)
    chat = next(line for line in log if line.startswith("chat"))
    assert chat == "chat dispatched at 3600.5", log
    # The paused stream was not "starved" at once (its age counts from its pause): the queued
    # batch streams, older, went first, and every stream finished whole.
    assert sum("done" in line for line in log) == 4
    assert sum("paused" in line for line in log) == 1
    paused = next(t for t in tickets if t.preemptions)
    assert not paused.resumed and paused.attempts == 1


async def test_a_second_urgent_request_gets_its_own_pause_and_its_own_slot(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(2, settings())
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(batch_stream, admission, Ticket(f"batch{i}", band=5), 600.0, log)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(120.0)
        nursery.start_soon(urgent, admission, "chat1", log, 30.0)
        nursery.start_soon(urgent, admission, "chat2", log, 30.0)
    assert "chat1 dispatched at 120.5" in log and "chat2 dispatched at 120.5" in log, log


@pytest.mark.parametrize("why", ["full by its upstream's queue", "ejected", "capacity lowered"])
async def test_no_pause_is_asked_where_the_slot_freed_could_not_serve_the_waiter(
    autojump_clock: trio.abc.Clock, why: str
) -> None:
    admission = one_model(2, settings())
    (room,) = admission.rooms
    pausers: list[Pauser] = []

    async def running(name: str) -> None:
        ticket = Ticket(name, band=5)
        async with admission.lease(ticket) as lease:
            pauser = Pauser()
            pausers.append(pauser)
            admission.dispatcher.track(ticket, lambda: 0, room=lease.room, pause=pauser)
            with pauser.scope:
                await trio.sleep(30.0)

    dispatched: list[float] = []

    async def chat() -> None:
        async with admission.slot(Ticket("chat", band=0)):
            dispatched.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(running, "a")
        nursery.start_soon(running, "b")
        await trio.testing.wait_all_tasks_blocked()
        if why == "capacity lowered":
            room.resize(1)  # a reload: two in flight where one now fits
        else:
            room.full = lambda: True  # the scrape says its queue is over the threshold
        nursery.start_soon(chat)
        await trio.sleep(10.0)  # ten rechecks, each past preempt_after
        assert [p.asked for p in pausers] == [0, 0]
        if why != "capacity lowered":
            room.full = None
            room.poke()
    if why == "capacity lowered":
        # Served once a slot was really free, without a pause made for nothing.
        assert dispatched == [30.0] and [p.asked for p in pausers] == [0, 0]
    else:
        # Once the room can serve it again, one pause, at the next look, and its slot.
        assert dispatched == [10.5] and sorted(p.asked for p in pausers) == [0, 1]


async def test_one_ticket_across_retries_keeps_its_age_and_its_pauses() -> None:
    ticket = Ticket("batch", band=5)
    ticket.begin_wait(10.0)
    ticket.begin_pause(50.0)
    ticket.end_pause()
    ticket.begin_wait(70.0)  # a retry, on another replica
    assert ticket.attempts == 2 and ticket.preemptions == 1
    assert ticket.arrived == 50.0  # its age: from its last pause, not from the retry
    assert ticket.waiting_since == 70.0
    hedge = ticket.companion()
    assert not hedge.may_preempt and hedge.arrived == 50.0 and hedge.tenant == "batch"


async def test_a_hedge_never_pauses_anything(autojump_clock: trio.abc.Clock) -> None:
    admission = one_model(1, settings())
    pauser = Pauser()
    batch = Ticket("batch", band=5)
    dispatched: list[float] = []

    async def running() -> None:
        async with admission.lease(batch) as lease:
            admission.dispatcher.track(batch, lambda: 0, room=lease.room, pause=pauser)
            with pauser.scope:
                await trio.sleep(20.0)

    async def hedge() -> None:
        async with admission.slot(Ticket("chat", band=0).companion()):
            dispatched.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(running)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hedge)
    assert pauser.asked == 0 and dispatched == [20.0]


def test_the_pause_comments_come_twice_within_the_clients_read_timeout() -> None:
    scheduling = settings(pause_keepalive=5.0)
    assert keepalive_interval(scheduling, Ticket("k")) == 5.0
    assert keepalive_interval(scheduling, Ticket("k", read_timeout=4.0)) == 2.0
    assert keepalive_interval(scheduling, Ticket("k", read_timeout=60.0)) == 5.0


async def test_a_light_key_pauses_the_flooding_key_of_its_own_band(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(2, settings())
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(batch_stream, admission, Ticket("flood"), 100.0, log)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(5.0)
        nursery.start_soon(urgent, admission, "light", log)
    # The flood holds both slots: the light key takes one of them at preempt_after, and the
    # flood's own queued request pauses nothing.
    assert "light dispatched at 5.5" in log
    assert sum("flood paused" in line for line in log) == 1
    assert sum("flood done" in line for line in log) == 3


async def test_two_keys_holding_a_slot_each_never_pause_each_other(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(2, settings())
    admission.dispatcher.queue.counters.update({"a": 50_000.0, "b": 10.0})
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch_stream, admission, Ticket("a"), 100.0, log)
        nursery.start_soon(batch_stream, admission, Ticket("b"), 100.0, log)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(batch_stream, admission, Ticket("b"), 10.0, log)
        nursery.start_soon(urgent, admission, "c", log)
    assert not any("paused" in line for line in log), log


async def test_within_band_preemption_can_be_turned_off_alone(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(2, settings(preempt_within_band=False))
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(batch_stream, admission, Ticket("flood"), 20.0, log)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(urgent, admission, "light", log)
    assert log[-1] == "light dispatched at 20" and not any("paused" in line for line in log)


async def test_a_drain_pauses_nothing_resumes_paused_requests_first_and_refuses_what_cannot_start(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(1, settings())
    dispatcher = admission.dispatcher
    (room,) = admission.rooms
    room.average_hold = 30.0
    log: list[str] = []
    refused: list[tuple[str, float, ApiError]] = []

    async def queued(name: str, band: int) -> None:
        try:
            async with admission.slot(Ticket(name, band=band)):
                log.append(f"{name} dispatched at {trio.current_time():g}")
                await trio.sleep(2.0)
        except ApiError as error:
            refused.append((name, trio.current_time(), error))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch_stream, admission, Ticket("batch", band=5), 30.0, log)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(5.0)
        nursery.start_soon(urgent, admission, "chat", log, 10.0)  # pauses the batch at 5.5
        await trio.sleep(1.0)
        # Queued behind the chat (which has 9.5 s to go) and the paused batch (25 s more).
        nursery.start_soon(queued, "early", 0)
        await trio.testing.wait_all_tasks_blocked()
        dispatcher.drain(trio.current_time() + 20.0)  # the grace ends at 26
        await trio.testing.wait_all_tasks_blocked()
        # Expected to start past the grace (every slot held ~30 s on average): refused now.
        assert [(name, at) for name, at, _ in refused] == [("early", 6.0)]
        # New requests during the drain: refused at once too, and nobody is paused for them.
        nursery.start_soon(queued, "late", 0)
        await trio.testing.wait_all_tasks_blocked()
    assert [name for name, _, _ in refused] == ["early", "late"]
    error = refused[0][2]
    assert error.status == 503 and error.code == "shutting_down"
    assert error.headers["Retry-After"] == "1"
    # The paused batch went first once the chat's slot was free, and finished.
    assert log.index("chat dispatched at 5.5") < log.index("batch resumed at 15.5")
    assert "batch done at 40" in log
    assert sum("paused" in line for line in log) == 1
    assert room.in_flight == 0 and admission.waiting == 0


async def test_a_paused_request_goes_first_during_a_drain_whatever_its_band(
    autojump_clock: trio.abc.Clock,
) -> None:
    admission = one_model(1, settings(preempt_after=0.5))
    dispatcher = admission.dispatcher
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(batch_stream, admission, Ticket("batch", band=5), 10.0, log)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(urgent, admission, "chat", log, 5.0)
        await trio.sleep(1.0)
        # A second urgent request queues (band 0) behind the chat, before the drain.
        nursery.start_soon(urgent, admission, "chat2", log, 1.0)
        await trio.testing.wait_all_tasks_blocked()
        dispatcher.drain(trio.current_time() + 100.0)
    # Without the drain, chat2 (band 0) would go before the paused batch (band 5).
    assert log == [
        "batch paused at 0.5",
        "chat dispatched at 0.5",
        "batch resumed at 5.5",
        "batch done at 15",
        "chat2 dispatched at 15",
    ]


def test_what_a_ticket_is_refused_for_names_the_deadline_that_applied() -> None:
    from proxy.protocol.scheduling import Schedule

    by_sdk = Schedule(first_byte_by=10.0, done_by=50.0).ticket()
    by_total = Schedule(first_byte_by=math.inf, done_by=50.0).ticket()
    assert by_sdk.by_read_timeout and not by_total.by_read_timeout
    admission = one_model(1, settings())
    assert "read timeout" in admission._unmeetable(by_sdk, admission.rooms).message
    message = admission._unmeetable(by_total, admission.rooms).message
    assert "x-sluice-deadline" in message and "read timeout" not in message
