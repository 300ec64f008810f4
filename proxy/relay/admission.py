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
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from proxy.protocol.errors import RATE_LIMIT, SERVER_ERROR, ApiError
from proxy.protocol.scheduling import FairQueue, SchedulingSettings, Ticket, expected_wait

# Weight of the newest observation in the moving average of slot hold times.
_EWMA_WEIGHT = 0.2
# How often a waiting request looks again at its rooms, for room no event announced.
_RECHECK_SECONDS = 1.0


class Room:
    """Slots requests are dispatched to: one upstream replica's connections (shared by every
    model it serves), or one local model's slots."""

    __slots__ = ("_dispatcher", "average_hold", "capacity", "full", "in_flight", "name")

    def __init__(self, name: str, capacity: int, *, full: Callable[[], bool] | None = None) -> None:
        # For logs and diagnostics only: a replica's address never reaches a client.
        self.name = name
        self.capacity = capacity
        # Requests dispatched here and not yet finished.
        self.in_flight = 0
        # Whether the room has no room whatever its count says (an upstream whose own queue
        # is over its threshold, as its scrape says).
        self.full = full
        self.average_hold = 1.0
        self._dispatcher: Dispatcher | None = None

    @property
    def free(self) -> int:
        if self.full is not None and self.full():
            return 0
        return max(0, self.capacity - self.in_flight)

    def resize(self, capacity: int) -> None:
        """A new capacity (a reload): more room is used at once."""
        self.capacity = capacity
        self.poke()

    def poke(self) -> None:
        """The room may have room now (a scrape, a resize): dispatch what it can take."""
        if self._dispatcher is not None:
            self._dispatcher.dispatch(self)

    def __repr__(self) -> str:
        return f"<Room {self.name} {self.in_flight}/{self.capacity}>"


class _Waiter:
    __slots__ = ("admission", "event", "room", "rooms")

    def __init__(self, admission: Admission, rooms: Sequence[Room]) -> None:
        self.admission = admission
        self.rooms = rooms
        self.event = trio.Event()
        # The room it was dispatched to, once it is.
        self.room: Room | None = None


class _Running:
    __slots__ = ("charged", "progress")

    def __init__(self, progress: Callable[[], int]) -> None:
        self.progress = progress
        self.charged = 0


class Dispatcher:
    """One queue and the rooms it dispatches to: the order, and the dispatching."""

    def __init__(self, settings: SchedulingSettings | None = None) -> None:
        self.queue = FairQueue(settings)
        self._waiters: dict[Ticket, _Waiter] = {}
        # The dispatched requests whose output is counted as it streams.
        self._running: dict[Ticket, _Running] = {}
        # Called at each dispatch, with the ticket and how long it waited (metrics).
        self.on_dispatch: Callable[[Ticket, float], None] | None = None

    def room(self, room: Room) -> Room:
        """``room`` dispatched to by this dispatcher from now on."""
        room._dispatcher = self
        return room

    def track(self, ticket: Ticket, progress: Callable[[], int]) -> None:
        """``ticket``'s request, dispatched, has put out ``progress()`` output tokens so far:
        its tenant is charged for them as they stream, each time the queue decides."""
        self._running[ticket] = _Running(progress)

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

    def _take(self, room: Room, ticket: Ticket, now: float) -> None:
        room.in_flight += 1
        self.queue.dispatched(ticket)
        if self.on_dispatch is not None:
            self.on_dispatch(ticket, now - ticket.arrived)

    def release(self, room: Room, held: float, ticket: Ticket | None = None) -> None:
        if ticket is not None:
            running = self._running.pop(ticket, None)
            if running is not None:
                self._charge(ticket, running)
        room.in_flight -= 1
        room.average_hold += _EWMA_WEIGHT * (held - room.average_hold)
        self.dispatch(room)

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
        slots = sum(room.capacity for room in rooms) or 1
        hold = max((room.average_hold for room in rooms), default=1.0)
        estimate = hold * (self.dispatcher.queue.size + 1) / slots
        return max(1, math.ceil(estimate))

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
        rooms = self.rooms if rooms is None else rooms
        dispatcher = self.dispatcher
        now = trio.current_time()
        ticket.arrived = now
        if now >= ticket.first_byte_by:
            # Never started after its deadline: its client has stopped waiting.
            self._left(ticket, 0.0, "deadline")
            raise self._unmeetable(ticket, rooms)
        for each in rooms:
            dispatcher.dispatch(each)  # a room that got room without a word (a scrape)
        open_rooms = [each for each in rooms if each.free > 0]
        chosen = (choose or _first)(open_rooms) if open_rooms else None
        if chosen is not None:
            dispatcher._take(chosen, ticket, now)
            self._left(ticket, 0.0, "admitted")
            room = chosen
        else:
            room = await self._wait(ticket, rooms, now)
        started = trio.current_time()
        try:
            yield room
        finally:
            dispatcher.release(room, trio.current_time() - started, ticket)
            self._notify()

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
        if now + self._expected_wait(ticket, rooms) > ticket.first_byte_by:
            queue.remove(ticket)
            self._left(ticket, 0.0, "deadline")
            raise self._unmeetable(ticket, rooms)
        waiter = _Waiter(self, rooms)
        dispatcher._waiters[ticket] = waiter
        self._set_waiting(self._waiting + 1)
        outcome = "cancelled"
        try:
            with trio.move_on_at(min(now + self.queue_timeout, ticket.first_byte_by)):
                while not waiter.event.is_set():
                    # A room may get room with nothing to say so (an ejection that ends): look
                    # again now and then.
                    with trio.move_on_after(_RECHECK_SECONDS):
                        await waiter.event.wait()
                    for each in rooms:
                        dispatcher.dispatch(each)
        except BaseException:
            # Cancelled (the client left) just as it was dispatched: the slot goes to the next.
            if waiter.room is not None:
                dispatcher.release(waiter.room, 0.0)
                waiter.room = None
            raise
        finally:
            self._set_waiting(self._waiting - 1)
            dispatched = waiter.room
            if dispatched is None:
                dispatcher._waiters.pop(ticket, None)
                queue.remove(ticket)
            ended = trio.current_time()
            if dispatched is not None:
                outcome = "admitted"
            elif ended >= ticket.first_byte_by:
                outcome = "deadline"
            elif ended >= now + self.queue_timeout:
                outcome = "queue_timeout"
            self._left(ticket, ended - now, outcome)
        if dispatched is None:
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

    def _expected_wait(self, ticket: Ticket, rooms: Sequence[Room]) -> float:
        slots = sum(room.capacity for room in rooms)
        hold = max((room.average_hold for room in rooms), default=1.0)
        free = sum(room.free for room in rooms)
        return expected_wait(self.dispatcher.queue.ahead_of(ticket), free, slots, hold)

    def _unmeetable(self, ticket: Ticket, rooms: Sequence[Room]) -> ApiError:
        return ApiError(
            503,
            f"model '{self.model}' cannot start this request before its deadline (its "
            "client stops waiting for a first byte by then): every slot is in use and the "
            "requests ahead of it would take longer; retry later, or with a longer timeout.",
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

    def configure(self, settings: SchedulingSettings) -> None:
        self.upstream.queue.configure(settings)

    def room(self, name: str, capacity: int) -> Room:
        """The room of the replica named ``name``, with ``capacity`` slots (a reload may
        change it)."""
        room = self._rooms.get(name)
        if room is None:
            room = self._rooms[name] = self.upstream.room(Room(name, capacity))
        elif room.capacity != capacity:
            room.resize(capacity)
        return room
