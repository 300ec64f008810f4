"""Admission: Sluice holds the queue. Requests wait here, in the scheduler's order, for a slot
where they can run (a room: an upstream replica's connections, a local model's slots), and are
dispatched only while that room has room.

The order is :class:`~proxy.protocol.scheduling.FairQueue`'s (bands, then a fair share between
keys, with a guard against starvation), decided sans-IO; this is its trio shell. It is
work-conserving: the moment a room has room (a request ends, its capacity grows, its upstream's
own queue drains), the next request that room can serve is dispatched to it, and a request that
arrives while one of its rooms has room is dispatched at once.

Excess waits in a bounded queue (``max_queue`` per model: 429 ``queue_full`` at once past it)
with a deadline (``queue_timeout``: 503 ``queue_timeout``), and a request whose first byte
cannot come out in time (its client's SDK gives up then) is refused at once with 503
``deadline_unmeetable``, never left waiting for a slot it cannot use; all with ``Retry-After``
estimated from how long slots have recently been held. A client that leaves while queued frees
its place at once (the wait is cancelled with it). Refusals name the model, never an address.

Preemption (``[scheduling] preempt_after``): a request that has waited that long while a less
urgent band (or, within its band, a key served well beyond its own) holds a slot it could use
pauses one of those (the queue's choice, :func:`~proxy.protocol.scheduling.choose_preemption`),
through the :class:`Pausable` its producer registered (:meth:`Dispatcher.track`), and only in a
room where the slot freed would serve it at once (not full by its upstream's own queue, not
ejected, not over a capacity a reload lowered). The producer stops at an event boundary and
gives its slot up (:meth:`Lease.pause`): the slot goes to the request that asked for it, the
paused request waits at the head of its band, its client kept alive by comments, and it holds a
slot again to be continued. A request that gets another slot before its pause is taken
withdraws it where the producer still can (:meth:`Pausable.withdraw`).

Drain (:meth:`Dispatcher.drain`, after SIGTERM): no new preemption; paused requests go first; a
queued request that cannot start before the grace ends is refused at once (503
``shutting_down`` with ``Retry-After``), and one still queued when it ends is refused then.

State: a ticket's fields change only through the scheduler's steps
(:class:`~proxy.protocol.scheduling.Ticket`'s methods, :class:`FairQueue`'s); the rooms' counts
and the waiters change only here, in :class:`Dispatcher`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import trio

from proxy.ops import tracing
from proxy.protocol.capacity import Capacity
from proxy.protocol.errors import RATE_LIMIT, SERVER_ERROR, ApiError, shutting_down
from proxy.protocol.scheduling import (
    FairQueue,
    SchedulingSettings,
    Ticket,
    choose_preemption,
    expected_wait,
    keepalive_interval,
    preemption_due,
    retry_after,
)

# Weight of the newest observation in the moving average of slot hold times.
_EWMA_WEIGHT = 0.2
# How often a waiting request looks again at its rooms, for room no event announced.
_RECHECK_SECONDS = 1.0

# The request's deadlines that stand still while it is paused: an upstream's total_timeout
# bounds the upstream's work, and the time a paused stream waits for a slot is not that.
PAUSE_STOPS: ContextVar[tuple[trio.CancelScope, ...]] = ContextVar("sluice_pause_stops", default=())


class Pausable(Protocol):
    """A running request that can be paused for a more urgent one: registered by its producer
    with :meth:`Dispatcher.track`, asked by the dispatcher."""

    def ask(self) -> bool:
        """Pause at the next event boundary. True: it will, and gives its slot up soon
        (:meth:`Lease.pause`); False: it cannot now (its last event is out, or it is ending),
        and the dispatcher does not ask it again."""
        ...

    def withdraw(self) -> bool:
        """The request it was asked to pause for got another slot first, or left: do not
        pause after all, if the pause has not been taken yet. True: it will not pause, and
        runs on in its slot; False: too late, it pauses as asked (its slot then goes in the
        queue's order)."""
        ...


class Room:
    """Slots requests are dispatched to: one upstream replica's connections (shared by every
    model it serves), or one local model's slots."""

    __slots__ = (
        "_dispatcher",
        "average_hold",
        "capacity",
        "full",
        "in_flight",
        "learning",
        "name",
        "owner",
        "retired",
    )

    def __init__(self, name: str, capacity: int, *, full: Callable[[], bool] | None = None) -> None:
        # For logs and diagnostics only: a replica's address never reaches a client.
        self.name = name
        self.capacity = capacity
        # Requests dispatched here and not yet finished.
        self.in_flight = 0
        # Whether the room has no room whatever its count says (an upstream whose own queue
        # is over its threshold, as its scrape says).
        self.full = full
        # Its capacity as learned from its engine's gauges (proxy.protocol.capacity), when it
        # is: then that, not a config's number, sets ``capacity``.
        self.learning: Capacity | None = None
        self.average_hold = 1.0
        self._dispatcher: Dispatcher | None = None
        # What serves its slots now (an upstream replica, as the config now served built it),
        # for a request dispatched here by a backend of an earlier config.
        self.owner: object = None
        # Its replica is no longer in the config (a reload): nothing more is dispatched here.
        self.retired = False

    @property
    def free(self) -> int:
        if self.retired or (self.full is not None and self.full()):
            return 0
        return max(0, self.capacity - self.in_flight)

    @property
    def free_after_release(self) -> int:
        """The slots free once one request here gives its own up: what a pause here frees for
        a waiting request (none while the room is full whatever its count, or holds more than
        a lowered capacity)."""
        if self.retired or (self.full is not None and self.full()):
            return 0
        return max(0, self.capacity - self.in_flight + 1)

    def resize(self, capacity: int) -> None:
        """A new capacity (a reload): more room is used at once."""
        self.capacity = capacity
        self.poke()

    def retire(self) -> None:
        """Its replica left the config: what runs here finishes, nothing more comes, and what
        waits for it alone waits for the model's rooms now (:meth:`Admission._until_dispatched`)."""
        self.retired = True
        self.poke()
        if self._dispatcher is not None:
            self._dispatcher.wake_all()

    def poke(self) -> None:
        """The room may have room now (a scrape, a resize): dispatch what it can take."""
        if self._dispatcher is not None:
            self._dispatcher.dispatch(self)

    def __repr__(self) -> str:
        return f"<Room {self.name} {self.in_flight}/{self.capacity}>"


class _Waiter:
    __slots__ = (
        "admission",
        "event",
        "fail_if",
        "pausing",
        "room",
        "rooms",
        "scope",
        "shut_out",
    )

    def __init__(self, admission: Admission, rooms: Sequence[Room]) -> None:
        self.admission = admission
        self.rooms = rooms
        # Set when it is dispatched (room set first), or to make it look again (a reload).
        self.event = trio.Event()
        # The room it was dispatched to, once it is.
        self.room: Room | None = None
        # The request it paused, until that one has given its slot up: one at a time.
        self.pausing: Ticket | None = None
        # Its wait's bounds (a new request's: queue_timeout, its deadline, a drain's grace).
        self.scope: trio.CancelScope | None = None
        # Refused by a drain that leaves it no time to start.
        self.shut_out = False
        # A paused request's check, at each look: why it can never be served (raised), or None.
        self.fail_if: Callable[[], ApiError | None] | None = None


class _Running:
    __slots__ = ("charged", "for_ticket", "pause", "pausing", "progress", "room")

    def __init__(
        self,
        progress: Callable[[], int],
        room: Room | None,
        pause: Pausable | None,
        counted: int,
    ) -> None:
        self.progress = progress
        self.charged = counted
        self.room = room
        # None: it cannot be continued, so it is never paused.
        self.pause = pause
        self.pausing = False
        # The waiting request it is being paused for: its slot goes to that one.
        self.for_ticket: Ticket | None = None


class Dispatcher:
    """One queue and the rooms it dispatches to: the order, and the dispatching."""

    def __init__(self, settings: SchedulingSettings | None = None) -> None:
        self.queue = FairQueue(settings)
        self._waiters: dict[Ticket, _Waiter] = {}
        # The dispatched requests whose output is counted as it streams.
        self._running: dict[Ticket, _Running] = {}
        # Called at each dispatch, with the ticket and how long it waited (metrics).
        self.on_dispatch: Callable[[Ticket, float], None] | None = None
        # When a drain's grace ends (inf: not draining).
        self.grace_end = math.inf

    def room(self, room: Room) -> Room:
        """``room`` dispatched to by this dispatcher from now on."""
        room._dispatcher = self
        return room

    def track(
        self,
        ticket: Ticket,
        progress: Callable[[], int],
        *,
        room: Room | None = None,
        pause: Pausable | None = None,
        counted: int = 0,
    ) -> None:
        """``ticket``'s request, dispatched to ``room``, has put out ``progress()`` output
        tokens so far, of which ``counted`` were charged already (a paused request's, before
        its pause): its tenant is charged for the rest as they stream, each time the queue
        decides. ``pause``: how to ask it to pause for a more urgent request (see
        :meth:`preempt_for`); without it, it is never paused."""
        self._running[ticket] = _Running(progress, room, pause, counted)

    def preempt_for(self, ticket: Ticket, rooms: Sequence[Room]) -> Ticket | None:
        """Pause a running request in one of ``rooms`` for waiting ``ticket``, as the queue
        chooses (:func:`~proxy.protocol.scheduling.choose_preemption`); the one paused, or
        None. Only a request in a room where the slot it frees would serve ``ticket`` at once;
        none during a drain. A request that declines (it has just sent its last event) is not
        asked again."""
        if self.queue.draining:
            return None
        self.settle()
        running = self._running
        candidates = {
            each: entry
            for each, entry in running.items()
            if entry.pause is not None
            and not entry.pausing
            and entry.room is not None
            and entry.room in rooms
            and entry.room.free_after_release > 0
        }
        settings = self.queue.settings
        held: dict[str, int] = {}
        for each, entry in running.items():
            if entry.room is not None and entry.room in rooms:
                # A slot whose pause is under way is its preemptor's already: several waiters
                # looking at one instant see the slots as they will be.
                paused_for = entry.for_ticket if entry.pausing else None
                owner = each.tenant if paused_for is None else paused_for.tenant
                held[owner] = held.get(owner, 0) + 1
        while candidates:
            victim = choose_preemption(settings, ticket, candidates, self.queue.counters, held)
            if victim is None:
                return None
            entry = candidates.pop(victim)
            if entry.pause is not None and entry.pause.ask():
                entry.pausing = True
                entry.for_ticket = ticket
                victim.pause_asked(by=ticket)
                return victim
            entry.pause = None
        return None

    def running(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s request holds a slot."""
        return ticket in self._running

    def _charge(self, ticket: Ticket, running: _Running) -> None:
        produced = running.progress()
        if produced > running.charged:
            self.queue.charge(
                ticket.tenant, ticket.weight, output_tokens=produced - running.charged
            )
            running.charged = produced

    def settle(self) -> None:
        """Charge every running request's output so far to its tenant's counter (before the
        queue decides, and before the counters are shared)."""
        for running_ticket, running in self._running.items():
            self._charge(running_ticket, running)

    def dispatch(self, room: Room) -> None:
        """Fill ``room``'s free slots with the requests it can serve, in the queue's order."""
        if not self.queue.size:
            return
        self.settle()
        now = trio.current_time()
        while room.free > 0:
            ticket = self.queue.next(now, lambda each: room in self._waiters[each].rooms)
            if ticket is None:
                return
            waiter = self._waiters.pop(ticket)
            self._take(room, ticket, now)
            waiter.room = room
            waiter.event.set()
            if waiter.pausing is not None:
                self._withdraw(waiter.pausing, ticket)

    def _withdraw(self, victim: Ticket, ticket: Ticket) -> None:
        """``ticket`` got another slot, or left the queue, while ``victim`` was being paused
        for it: that pause would serve nobody. Withdrawn if it is not too late; if it is, the
        slot it frees goes in the queue's order."""
        entry = self._running.get(victim)
        if entry is None or not entry.pausing or entry.for_ticket is not ticket:
            return
        entry.for_ticket = None
        if entry.pause is not None and entry.pause.withdraw():
            entry.pausing = False
            victim.pause_withdrawn()

    def _take(self, room: Room, ticket: Ticket, now: float) -> None:
        room.in_flight += 1
        self.queue.dispatched(ticket)
        if self.queue.crowded:
            # The idle tenants' counters go (a tenant per subject: there may be many); the
            # running requests' tenants stay, as they are still charged.
            self.queue.forget_idle({running.tenant for running in self._running})
        if self.on_dispatch is not None:
            self.on_dispatch(ticket, now - ticket.waiting_since)

    def release(self, room: Room, held: float, ticket: Ticket | None = None) -> None:
        handed_to: Ticket | None = None
        if ticket is not None:
            running = self._running.pop(ticket, None)
            if running is not None:
                self._charge(ticket, running)
                handed_to = running.for_ticket
        room.in_flight -= 1
        room.average_hold += _EWMA_WEIGHT * (held - room.average_hold)
        if handed_to is not None:
            self._hand(room, handed_to)
        self.dispatch(room)

    def _hand(self, room: Room, ticket: Ticket) -> None:
        """The slot a pause freed in ``room`` goes to the request it was paused for, whatever
        the queue's order says (the starvation guard's included), if it still waits and can
        go there."""
        waiter = self._waiters.get(ticket)
        if waiter is None or room not in waiter.rooms or room.free <= 0:
            return
        del self._waiters[ticket]
        self._take(room, ticket, trio.current_time())
        waiter.room = room
        waiter.event.set()

    def drain(self, grace_end: float) -> None:
        """A drain has begun, and its grace ends at ``grace_end``: no new preemption, paused
        requests first, and every new request still waiting refused at once when it cannot
        start by then (and at ``grace_end`` if it is still waiting)."""
        self.queue.draining = True
        self.grace_end = min(self.grace_end, grace_end)
        now = trio.current_time()
        for ticket, waiter in list(self._waiters.items()):
            scope = waiter.scope
            if scope is None:
                continue  # a paused request: it finishes, or the grace's end tells its client
            scope.deadline = min(scope.deadline, self.grace_end)
            expected = waiter.admission._expected_wait(ticket, waiter.rooms)
            if now + expected > self.grace_end:
                waiter.shut_out = True
                scope.cancel()

    def wake_all(self) -> None:
        """Every waiter looks again at its rooms now (a reload retired some, or changed the
        settings that say when it may pause another)."""
        for waiter in self._waiters.values():
            waiter.event.set()

    def waiting_for(self, admission: Admission) -> int:
        return sum(1 for waiter in self._waiters.values() if waiter.admission is admission)


@dataclass(frozen=True)
class QueueLimits:
    max_queue: int
    queue_timeout: float


class Admission:
    """One model's way into a dispatcher's rooms: its queue's limits, and its refusals (which
    name the model)."""

    def __init__(
        self,
        model: str,
        dispatcher: Dispatcher,
        *,
        max_queue: int,
        queue_timeout: float,
        on_leave: Callable[[Ticket, float, str], None] | None = None,
        rooms: Sequence[Room] = (),
    ) -> None:
        self.model = model
        self.dispatcher = dispatcher
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        # Called once per request as it leaves the queue, with its ticket, the seconds it
        # waited, and how it left: "admitted", "queue_timeout", "deadline", "cancelled", or
        # "queue_full" (never queued).
        self.on_leave = on_leave
        # The rooms this model's requests may go to, unless a call says otherwise.
        self.rooms = list(rooms)
        # Called as one of this model's requests is paused (with its ticket), and as it holds
        # a slot again (with the seconds it was paused): metrics.
        self.on_preempt: Callable[[Ticket], None] | None = None
        self.on_resume: Callable[[Ticket, float], None] | None = None
        self._waiting = 0
        self._changed = trio.Event()

    @property
    def waiting(self) -> int:
        return self._waiting

    def _set_waiting(self, value: int) -> None:
        self._waiting = value
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_queued(self, count: int) -> None:
        """Return once exactly ``count`` requests are queued (tests, diagnostics)."""
        while self._waiting != count:
            await self._changed.wait()

    async def wait_free(self) -> None:
        """Return once no slot of this model's rooms is in use."""
        while any(room.in_flight for room in self.rooms):
            await self._changed.wait()

    def retry_after(self, rooms: Sequence[Room] | None = None) -> int:
        """Seconds until a place is likely free: the queue ahead, in turn, each slot held
        for its typical time."""
        rooms = self.rooms if rooms is None else rooms
        slots = sum(room.capacity for room in rooms)
        hold = max((room.average_hold for room in rooms), default=1.0)
        return retry_after(self.dispatcher.queue.size, slots, hold)

    @asynccontextmanager
    async def slot(
        self,
        ticket: Ticket,
        rooms: Sequence[Room] | None = None,
        choose: Callable[[Sequence[Room]], Room | None] | None = None,
    ) -> AsyncIterator[Room]:
        """A slot in one of ``rooms`` (this model's, by default) for ``ticket``'s request, for
        the duration: at once if one has room (``choose`` picks among those that do, the
        first by default), else once the queue's order comes to it."""
        async with self.lease(ticket, rooms, choose) as lease:
            assert lease.room is not None
            yield lease.room

    @asynccontextmanager
    async def lease(
        self,
        ticket: Ticket,
        rooms: Sequence[Room] | None = None,
        choose: Callable[[Sequence[Room]], Room | None] | None = None,
    ) -> AsyncIterator[Lease]:
        """As :meth:`slot`, for a request that can be paused: the :class:`Lease` holds the
        slot, and its :meth:`Lease.pause` gives it up and holds another."""
        rooms = self.rooms if rooms is None else rooms
        dispatcher = self.dispatcher
        now = trio.current_time()
        ticket.begin_wait(now)
        if now >= ticket.first_byte_by:
            # Never started after its deadline: its client has stopped waiting.
            self._left(ticket, 0.0, "deadline")
            raise self._unmeetable(ticket, rooms)
        room = self._take_open(ticket, rooms, choose or _first, now)
        if room is not None:
            self._left(ticket, 0.0, "admitted")
        else:
            room = await self._wait(ticket, rooms, now)
        lease = Lease(self, ticket, room)
        try:
            yield lease
        finally:
            if lease.room is not None:
                dispatcher.release(lease.room, trio.current_time() - lease.since, ticket)
            self._notify()

    def _take_open(
        self,
        ticket: Ticket,
        rooms: Sequence[Room],
        choose: Callable[[Sequence[Room]], Room | None],
        now: float,
    ) -> Room | None:
        """A slot at once for ``ticket`` in one of ``rooms`` that has room (``choose``'s pick
        among them), taken; None when none has (or ``choose`` takes none)."""
        dispatcher = self.dispatcher
        for each in rooms:
            dispatcher.dispatch(each)  # a room that got room without a word (a scrape)
        open_rooms = [each for each in rooms if each.free > 0]
        chosen = choose(open_rooms) if open_rooms else None
        if chosen is not None:
            dispatcher._take(chosen, ticket, now)
        return chosen

    async def _wait(self, ticket: Ticket, rooms: Sequence[Room], now: float) -> Room:
        dispatcher = self.dispatcher
        queue = dispatcher.queue
        if self._waiting >= self.max_queue:
            self._left(ticket, 0.0, "queue_full")
            raise ApiError(
                429,
                f"model '{self.model}' is busy: every slot in use and {self._waiting} "
                "request(s) queued; retry later.",
                type=RATE_LIMIT,
                code="queue_full",
                headers={"Retry-After": str(self.retry_after(rooms))},
            )
        queue.add(ticket)
        expected = self._expected_wait(ticket, rooms)
        grace_end = dispatcher.grace_end
        if now + expected > grace_end:
            queue.remove(ticket)
            self._left(ticket, 0.0, "shutting_down")
            raise shutting_down()
        if now + expected > ticket.first_byte_by:
            queue.remove(ticket)
            self._left(ticket, 0.0, "deadline")
            raise self._unmeetable(ticket, rooms)
        waiter = _Waiter(self, rooms)
        outcome = "cancelled"
        try:
            with trio.move_on_at(
                min(now + self.queue_timeout, ticket.first_byte_by, grace_end)
            ) as waiter.scope:
                await self._queued(ticket, waiter)
        finally:
            dispatched = waiter.room
            ended = trio.current_time()
            if dispatched is not None:
                outcome = "admitted"
            elif waiter.shut_out or ended >= dispatcher.grace_end:
                outcome = "shutting_down"
            elif ended >= ticket.first_byte_by:
                outcome = "deadline"
            elif ended >= now + self.queue_timeout:
                outcome = "queue_timeout"
            self._left(ticket, ended - now, outcome)
        if dispatched is None:
            if outcome == "shutting_down":
                raise shutting_down()
            if outcome == "deadline":
                raise self._unmeetable(ticket, rooms)
            raise ApiError(
                503,
                f"model '{self.model}' had no free slot within "
                f"queue_timeout={self.queue_timeout:g}s; retry later.",
                type=SERVER_ERROR,
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after(rooms))},
            )
        return dispatched

    async def _queued(self, ticket: Ticket, waiter: _Waiter) -> None:
        """``ticket``, in the queue already, waits until it is dispatched (to
        ``waiter.room``), within whatever bounds the caller puts around this; however it ends,
        it is no longer waiting then."""
        dispatcher = self.dispatcher
        dispatcher._waiters[ticket] = waiter
        self._set_waiting(self._waiting + 1)
        try:
            await self._until_dispatched(ticket, waiter)
        except BaseException:
            # Cancelled (the client left) just as it was dispatched: the slot goes to the next.
            if waiter.room is not None:
                dispatcher.release(waiter.room, 0.0)
                waiter.room = None
            raise
        finally:
            self._set_waiting(self._waiting - 1)
            if waiter.room is None:
                dispatcher._waiters.pop(ticket, None)
                dispatcher.queue.remove(ticket)
                if waiter.pausing is not None:
                    # It left the queue (its client, a timeout): a pause asked for it would
                    # serve nobody either.
                    dispatcher._withdraw(waiter.pausing, ticket)

    async def _until_dispatched(self, ticket: Ticket, waiter: _Waiter) -> None:
        dispatcher = self.dispatcher
        while waiter.room is None:
            if all(room.retired for room in waiter.rooms):
                # Every replica it could go to left the config: the model's rooms now.
                fresh = [room for room in self.rooms if not room.retired]
                if fresh:
                    waiter.rooms = fresh
                    for each in fresh:
                        dispatcher.dispatch(each)
                    continue
            # Read each time round: a reload may change preempt_after, or a drain begin.
            queue = dispatcher.queue
            preempt_at = preemption_due(queue.settings, ticket, draining=queue.draining)
            # A room may get room with nothing to say so (an ejection that ends): look again
            # now and then, and when this request may pause a less urgent one.
            wake = trio.current_time() + _RECHECK_SECONDS
            if preempt_at is not None and preempt_at > trio.current_time():
                wake = min(wake, preempt_at)
            with trio.move_on_at(wake):
                await waiter.event.wait()
            if waiter.room is None and waiter.event.is_set():
                waiter.event = trio.Event()  # a nudge: look again, and wait anew
            if waiter.room is None and waiter.fail_if is not None:
                failure = waiter.fail_if()
                if failure is not None:
                    raise failure
            for each in waiter.rooms:
                dispatcher.dispatch(each)
            queue = dispatcher.queue  # as it stands now: a reload or a drain may have come
            preempt_at = preemption_due(queue.settings, ticket, draining=queue.draining)
            if (
                preempt_at is not None
                and waiter.room is None
                and trio.current_time() >= preempt_at
                and (waiter.pausing is None or not dispatcher.running(waiter.pausing))
            ):
                waiter.pausing = dispatcher.preempt_for(ticket, waiter.rooms)

    async def _wait_resumed(
        self,
        ticket: Ticket,
        rooms: Sequence[Room],
        fail_if: Callable[[], ApiError | None] | None = None,
    ) -> Room:
        """A paused request waits again for a slot, at the head of its band: neither the
        queue's bound nor its timeout applies (it was admitted already, and its client holds
        half an answer); its deadline, kept by its relay, still does."""
        room = self._take_open(ticket, rooms, _first, trio.current_time())
        if room is not None:
            return room
        self.dispatcher.queue.add(ticket)
        waiter = _Waiter(self, rooms)
        waiter.fail_if = fail_if
        await self._queued(ticket, waiter)
        assert waiter.room is not None
        return waiter.room

    def _expected_wait(self, ticket: Ticket, rooms: Sequence[Room]) -> float:
        slots = sum(room.capacity for room in rooms)
        hold = max((room.average_hold for room in rooms), default=1.0)
        free = sum(room.free for room in rooms)
        return expected_wait(self.dispatcher.queue.ahead_of(ticket), free, slots, hold)

    def _unmeetable(self, ticket: Ticket, rooms: Sequence[Room]) -> ApiError:
        why = (
            "its client's read timeout (it stops waiting for a first byte then)"
            if ticket.by_read_timeout
            else "its deadline (x-sluice-deadline, or its key's max_request_seconds)"
        )
        return ApiError(
            503,
            f"model '{self.model}' cannot start this request before {why}: every slot is in "
            "use and the requests ahead of it would take longer; retry later, or with a "
            "longer timeout.",
            type=SERVER_ERROR,
            code="deadline_unmeetable",
            # Worth a retry once the queue ahead has moved on: the SDKs wait Retry-After (up to
            # 60 s) before they send it again, with a fresh read timeout.
            headers={"Retry-After": str(self.retry_after(rooms)), "x-should-retry": "true"},
        )

    def _left(self, ticket: Ticket, seconds: float, outcome: str) -> None:
        if ticket.report is not None:
            ticket.report(seconds)
        if self.on_leave is not None:
            self.on_leave(ticket, seconds, outcome)


# What a paused request's client is sent meanwhile: an SSE comment, which every client skips,
# and which keeps proxies and the client's read timeout from taking the stream for dead.
PAUSED_COMMENT = b": paused\n\n"


class Lease:
    """A request's hold on a slot (:meth:`Admission.lease`), which a preemption may take from
    it and give back (:meth:`pause`)."""

    __slots__ = ("admission", "pauses", "room", "since", "ticket")

    def __init__(self, admission: Admission, ticket: Ticket, room: Room) -> None:
        self.admission = admission
        self.ticket = ticket
        # The room it holds a slot in; None while paused.
        self.room: Room | None = room
        self.since = trio.current_time()
        self.pauses = 0

    def give_up(self) -> None:
        """Give the slot up for good (the request ends while paused, before it waits)."""
        room, self.room = self.room, None
        if room is not None:
            self.admission.dispatcher.release(room, trio.current_time() - self.since, self.ticket)

    async def pause(
        self,
        rooms: Sequence[Room],
        keep_alive: Callable[[bytes], object],
        *,
        input_tokens: int | None = None,
        fail_if: Callable[[], ApiError | None] | None = None,
    ) -> float:
        """The request was paused (its producer has stopped at an event boundary): give the
        slot up (to the request it was paused for), wait at the head of its band for a slot in
        one of ``rooms``, hold it, and return the seconds paused. Meanwhile ``keep_alive`` is
        handed :data:`PAUSED_COMMENT` at once and then every
        :func:`~proxy.protocol.scheduling.keepalive_interval`. ``input_tokens``: what it
        prefills again on resuming. ``fail_if``, asked at each look while it waits: an error
        to end it with (none of its replicas can serve it any more). A client that leaves
        cancels the wait, and nothing of the request is left queued."""
        admission = self.admission
        dispatcher = admission.dispatcher
        ticket = self.ticket
        paused_at = trio.current_time()
        room, self.room = self.room, None
        assert room is not None
        self.pauses += 1
        ticket.begin_pause(paused_at, input_tokens)
        dispatcher.release(room, paused_at - self.since, ticket)
        admission._notify()
        if admission.on_preempt is not None:
            admission.on_preempt(ticket)
        trace = tracing.current()
        if trace is not None:
            trace.event("preempted", paused_at, {"sluice.band": ticket.band})
        # The deadlines that stand still while paused: each keeps what it had left.
        stopped = [(scope, scope.deadline - paused_at) for scope in PAUSE_STOPS.get()]
        for scope, _ in stopped:
            scope.deadline = math.inf
        failure: ApiError | None = None
        try:
            async with trio.open_nursery() as nursery:
                interval = keepalive_interval(dispatcher.queue.settings, ticket)
                nursery.start_soon(_keep_alive, keep_alive, interval)
                try:
                    self.room = await admission._wait_resumed(ticket, rooms, fail_if)
                except ApiError as error:
                    # Raised below, as itself: not in the nursery's exception group.
                    failure = error
                nursery.cancel_scope.cancel()
        finally:
            ticket.end_pause()
            now = trio.current_time()
            for scope, left in stopped:
                scope.deadline = now + left
        if failure is not None:
            raise failure
        self.since = trio.current_time()
        seconds = self.since - paused_at
        if trace is not None:
            trace.event("resumed", self.since, {"sluice.paused_seconds": seconds})
        if ticket.paused is not None:
            ticket.paused(seconds)
        if admission.on_resume is not None:
            admission.on_resume(ticket, seconds)
        return seconds


async def _keep_alive(keep_alive: Callable[[bytes], object], interval: float) -> None:
    while True:
        keep_alive(PAUSED_COMMENT)
        await trio.sleep(interval)


def _first(rooms: Sequence[Room]) -> Room | None:
    return rooms[0] if rooms else None


class Scheduling:
    """A process's queues for its upstreams: one dispatcher (its order, the keys' counters)
    and each replica's room, by the replica's name. Kept across reloads: a reload builds its
    replicas anew, and what is in flight on a server, and what each key has been served,
    still count."""

    def __init__(self, settings: SchedulingSettings | None = None) -> None:
        self.upstream = Dispatcher(settings)
        self._rooms: dict[str, Room] = {}
        # Each upstream model's queue: one across reloads (one bound, one gauge), whose
        # waiters a reload leaves in place.
        self._admissions: dict[str, Admission] = {}

    def configure(self, settings: SchedulingSettings) -> None:
        """New settings (a reload): for the requests waiting already too."""
        self.upstream.queue.configure(settings)
        self.upstream.wake_all()

    def admission(
        self, model: str, *, max_queue: int, queue_timeout: float, rooms: Sequence[Room]
    ) -> Admission:
        """Upstream model ``model``'s queue, with the config's bounds and rooms: the same
        :class:`Admission` at every reload (a new request's bounds are the new ones)."""
        admission = self._admissions.get(model)
        if admission is None:
            admission = Admission(
                model, self.upstream, max_queue=max_queue, queue_timeout=queue_timeout
            )
            self._admissions[model] = admission
        admission.max_queue = max_queue
        admission.queue_timeout = queue_timeout
        admission.rooms = list(rooms)
        return admission

    def keep_only(self, replicas: Collection[str], models: Collection[str]) -> None:
        """A reload serves only ``replicas`` and ``models`` from now on: the other replicas'
        rooms are retired (what waits for them goes to its model's other rooms, paused
        requests included), and the other models' queues are let go once their waiters end."""
        for name in [name for name in self._rooms if name not in replicas]:
            self._rooms.pop(name).retire()
        for model in [model for model in self._admissions if model not in models]:
            del self._admissions[model]

    def admissions(self) -> list[Admission]:
        return list(self._admissions.values())

    def room(self, name: str, capacity: int) -> Room:
        """The room of the replica named ``name``, with ``capacity`` slots (a reload may
        change it)."""
        room = self._rooms.get(name)
        if room is None:
            room = self._rooms[name] = self.upstream.room(Room(name, capacity))
        elif room.capacity != capacity and room.learning is None:
            # A learned capacity is the backend's to bound (UpstreamBackend), not reset here.
            room.resize(capacity)
        return room
