"""Hours of traffic through the real scheduler (proxy/relay/admission.py's Dispatcher,
Admission and Lease over proxy/protocol/scheduling.py's FairQueue), no sockets, under virtual
time, with its invariants checked at every step.

The scenario (every random draw from a seeded ``random.Random``: the workload is fixed):

- two rooms (replicas) of 2 slots each, one Dispatcher, one Admission whose queue bound and
  queue timeout are never reached; the default SchedulingSettings but ``preempt_after = 0.5``
  (``starvation_seconds = 60``, ``max_preemptions = 3``, ``preempt_within_band`` on);
- a batch flood the whole run: keys "batch-a" and "batch-b", band 5, each with 4 lanes that
  start a new stream as the last one ends (8 streams in flight or queued for 4 slots); each
  stream is 20 s of work at 50 tokens/s and pausable: a pause cancels its work's scope, it gives
  its slot up (``Lease.pause``) and does the rest of its work once it holds one again; its
  ``progress()`` counts its tokens across pieces, so its key is charged as it streams;
- "chat", band 0: Poisson arrivals every 20 s on average, 2 s of work, pausable; about 20% of
  chats carry an SDK read timeout (``first_byte_by`` = arrival + 5 s);
- "light", band 5 (the flood's band): Poisson arrivals every 30 s on average, 2 s of work;
- about 10% of chat and light requests, and 2% of flood streams, have their client leave at a
  random moment: their cancel scope is cancelled, whether they are queued, running or paused
  then; and since only the flood is ever paused, 5% of flood clients give up during a pause,
  within 10 s of its start, if it lasts that long;
- at 1 h a reload sets ``preempt_after = 1.0`` (``queue.configure``); from 1.5 h to 1.6 h
  replica 1 is ejected (``room.full`` says so), then comes back with a ``poke()``;
- after 3 h no more arrivals: the flood's lanes start nothing new, and everything in flight or
  queued runs to its end.

The invariants:

- each time a waiting request looks for a stream to pause, the dispatcher pauses one the rules
  allow (a less urgent band; or, within the band and for a key holding no slot, a key holding
  at least two slots and served at least as much; paused fewer than ``max_preemptions``
  times; in a room not ejected), and finds none only when none is allowed, both read by this
  rig from what it saw;
- each waiting request first looks ``preempt_after`` after it arrived (the setting in force
  then: 0.5 s before the reload, 1.0 s after);
- a chat or "light" request got its slot within ``preempt_after`` + 1.0 s (the waiter's recheck
  interval) of its arrival, or else it looked, at most a second apart, and nothing was allowed
  to pause, until it had its slot: every running stream had been paused ``max_preemptions``
  times, chats held the slots, or, for "light", no key held two slots while it held none (the
  flood's two keys sharing the two slots the ejection leaves, or a "light" request already
  running); a request whose first look found a stream to pause got its slot then,
  ``preempt_after`` after it arrived (``Simulation.figures`` has the longest waits per hour,
  and the pauses by who paused whom);
- a request that paused a stream got a slot at that instant: the paused stream's, unless
  another stream gave its slot up at that same instant (a pause then serves nobody, and is
  withdrawn if it is not too late: see
  ``test_a_pause_that_would_serve_nobody_is_withdrawn_unless_too_late``);
- a refusal (503 ``deadline_unmeetable``) comes only at the request's arrival or at its
  ``first_byte_by``, and a request dispatched is dispatched before it;
- over every stretch of time in which both batch-a and batch-b have a request waiting (VTC's
  premise: a key whose every stream runs is not backlogged, and rejoins lifted), the service
  each received in it (``dispatcher.queue.served``, and the exact service of this rig's own
  ledger, which counts the tokens out up to the instant) differs by at most
  ``vtc_bound(w_in, 400, w_out, 4 * 1000)``: the flood's input, and, as the most tokens one
  batch holds, every slot running a flood stream of 1000 tokens to its end. Since the start
  the difference is no such invariant: each time one key's streams all run, the other gains
  on it, and that drift adds up over hours (past 20,000 in some of trio's orders);
- every paused stream was resumed or its client left; every request whose client stayed did all
  its work;
- at every step no room holds more than its capacity; at the end no slot, ticket or waiter is
  left anywhere.

The rules the rig reads count a key's slots as the dispatcher does at the look: a stream whose
pause is under way counts as its preemptor's already, so several looks at one instant keep the
within-band margin (``test_waiters_looking_at_one_instant_keep_the_within_band_margin``).

The order trio picks among tasks runnable at one instant is its own (it reverses a batch at
random), so the figures may differ slightly between runs; the invariants hold in each.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from proxy.protocol.errors import ApiError
from proxy.protocol.scheduling import FairQueue, SchedulingSettings, Ticket, vtc_bound
from proxy.relay.admission import Admission, Dispatcher, Lease, Room
from tests.support import Pauser

SEED = 20261207
HOUR = 3600.0
HOURS = 3
RELOAD_AT = 1 * HOUR
EJECTED = (1.5 * HOUR, 1.6 * HOUR)

SLOTS_PER_ROOM = 2
ROOMS = 2
RATE = 50.0  # tokens per second of work, every stream
FLOOD_KEYS = ("batch-a", "batch-b")
FLOOD_LANES = 4  # per key
FLOOD_WORK = 20.0
FLOOD_INPUT = 400
FLOOD_LEAVES = 0.02
# The share of flood clients that give up during a pause, and how long they bear it at most.
FLOOD_LEAVES_PAUSED, FLOOD_PATIENCE = 0.05, 10.0
CHAT_EVERY, LIGHT_EVERY = 20.0, 30.0
SHORT_WORK = 2.0
SHORT_INPUT = 150
LEAVES = 0.10
SDK_TIMEOUT_SHARE, SDK_TIMEOUT = 0.20, 5.0
RECHECK = 1.0  # how often a waiting request looks again (admission._RECHECK_SECONDS)
# Sums of virtual times in floats: two instants this close are one.
EPSILON = 1e-6

BEFORE_RELOAD = SchedulingSettings(preempt_after=0.5)
AFTER_RELOAD = dataclasses.replace(BEFORE_RELOAD, preempt_after=1.0)


def in_force(at: float) -> float:
    """The preempt_after in force at ``at``."""
    return (BEFORE_RELOAD if at < RELOAD_AT else AFTER_RELOAD).preempt_after


@dataclass(eq=False)
class Request:
    """One request and what became of it, as the rig saw it."""

    kind: str  # "flood", "chat" or "light"
    ticket: Ticket
    arrived: float
    work: float
    pausable: bool
    leaves_at: float = math.inf
    # How long its client bears a pause before it leaves (inf: it waits it out).
    patience: float = math.inf
    client: trio.CancelScope | None = None
    # queued, running (holds a slot, tracked), stopped (its piece ended, its slot about to be
    # given up), paused, done, left, refused
    stage: str = "new"
    dispatched_at: float | None = None
    refused_at: float | None = None
    left_while: str | None = None
    worked: float = 0.0  # seconds of work done in the pieces that ended
    piece_started: float = 0.0
    pauser: Pauser | None = None
    rooms_held: list[Room] = field(default_factory=list)
    paused_at: list[float] = field(default_factory=list)
    resumed_at: list[float] = field(default_factory=list)
    # Each time it looked for a stream to pause: when, and whether it paused one.
    looked: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return round(RATE * self.work)

    def tokens(self) -> int:
        """Output tokens so far, across pieces: what the dispatcher charges as it streams."""
        elapsed = self.worked
        if self.stage == "running":
            elapsed += trio.current_time() - self.piece_started
        return min(self.total_tokens, math.floor(RATE * elapsed + EPSILON))

    @property
    def room(self) -> Room:
        return self.rooms_held[-1]


@dataclass(frozen=True)
class Asked:
    """A pause the dispatcher asked: when, for whom, of whom, in which room."""

    at: float
    preemptor: Request
    victim: Request
    room: Room


class Stretch:
    """The difference between the flood keys' service over the present stretch of time in
    which both have a request waiting: its highest and lowest values since the stretch began,
    and the widest gap seen in any stretch (the service the two received in some interval
    where both were backlogged differs by that much)."""

    def __init__(self) -> None:
        self.on = False
        self.high = self.low = 0.0
        self.widest = 0.0

    def sample(self, difference: float, both_waiting: bool) -> None:
        if self.on or both_waiting:
            if not self.on:
                self.high = self.low = difference
            self.high, self.low = max(self.high, difference), min(self.low, difference)
            self.widest = max(self.widest, self.high - self.low)
        self.on = both_waiting


class RecordingQueue(FairQueue):
    """The real queue; the rig samples the flood keys' service each time a key may start or
    stop waiting."""

    def __init__(self, sim: Simulation, settings: SchedulingSettings) -> None:
        super().__init__(settings)
        self.sim = sim

    def add(self, ticket: Ticket) -> None:
        self.sim.sample_service()
        super().add(ticket)
        self.sim.sample_service()

    def remove(self, ticket: Ticket) -> None:
        self.sim.sample_service()
        super().remove(ticket)
        self.sim.sample_service()


class RecordingDispatcher(Dispatcher):
    """The real dispatcher; each time a waiting request looks for a stream to pause, what it
    found is checked against the rig's own reading of the rules."""

    def __init__(self, sim: Simulation, settings: SchedulingSettings) -> None:
        super().__init__(settings)
        self.queue = RecordingQueue(sim, settings)
        self.sim = sim
        self.asked: list[Asked] = []
        # Looks where the dispatcher and the rules disagreed: (when, who, paused, allowed).
        self.disagreements: list[tuple[float, str, str | None, list[str]]] = []
        # Looks whose outcome the docstring's reading of the margin would not give.
        self.margin_breaches: list[tuple[float, str, str | None]] = []

    def preempt_for(self, ticket: Ticket, rooms: Sequence[Room]) -> Ticket | None:
        # Charged here rather than inside the call, so that the rules read the counters the
        # dispatcher reads (it charges nothing more at the same instant).
        self.settle()
        # The dispatcher counts a slot whose pause is under way as its preemptor's already.
        allowed = self.sim.pausable_for(ticket, rooms, promised=True)
        promised = allowed
        victim = super().preempt_for(ticket, rooms)
        now = trio.current_time()
        waiting = self.sim.by_ticket[ticket]
        waiting.looked.append((now, victim is not None))
        paused = None if victim is None else victim.tenant
        if (victim is None) != (not allowed) or (victim is not None and victim not in allowed):
            self.disagreements.append((now, ticket.tenant, paused, [t.tenant for t in allowed]))
        if (victim is None) != (not promised) or (victim is not None and victim not in promised):
            self.margin_breaches.append((now, ticket.tenant, paused))
        if victim is not None:
            request = self.sim.by_ticket[victim]
            self.sim.slot_of[request] = ticket.tenant
            self.asked.append(Asked(now, waiting, request, request.room))
        return victim


class Simulation:
    def __init__(self, seed: int, hours: float) -> None:
        self.rng = random.Random(seed)
        self.end = hours * HOUR
        self.dispatcher = RecordingDispatcher(self, BEFORE_RELOAD)
        self.rooms = [
            self.dispatcher.room(Room(f"replica {i}", SLOTS_PER_ROOM)) for i in range(ROOMS)
        ]
        self.admission = Admission(
            "m", self.dispatcher, max_queue=10_000, queue_timeout=1e9, rooms=self.rooms
        )
        self.requests: list[Request] = []
        self.by_ticket: dict[Ticket, Request] = {}
        # The requests running now (tracked by the dispatcher): stage running or stopped.
        self.holding: set[Request] = set()
        # Each slot held now, by the key it is for: a dispatched request's own (tracked or not
        # yet), or, for a stream asked to pause, the key of the request it is paused for.
        self.slot_of: dict[Request, str] = {}
        # The requests paused now, waiting for a slot again.
        self.paused: set[Request] = set()
        self.paused_events = 0
        # Each piece of work that ended: when, where, whose.
        self.released: list[tuple[float, Room, Request]] = []
        # The exact service of each flood key: what ended, and (at a sample) what runs.
        self.served_base = dict.fromkeys(FLOOD_KEYS, 0.0)
        self.checks = 0
        # The flood keys' service, by the queue and by this rig's ledger, over the stretches
        # in which both have a request waiting; and, for a reader, since the start.
        self.vtc_served = Stretch()
        self.vtc_exact = Stretch()
        self.since_start = 0.0
        self.over_capacity: list[tuple[float, str, int]] = []
        self.dispatcher.on_dispatch = self._on_dispatch
        self.admission.on_preempt = self._on_preempt
        self.admission.on_resume = self._on_resume

    # -- the scheduling rules, read by the rig -------------------------------------------

    def pausable_for(
        self, waiting: Ticket, rooms: Sequence[Room], *, promised: bool = False
    ) -> list[Ticket]:
        """The running streams the rules allow to pause for ``waiting`` now (see
        choose_preemption and Dispatcher.preempt_for), from what the rig saw. Each key's slots
        are counted as the dispatcher counts them (the running streams), or, ``promised``, as
        they will be once every pause asked and every dispatch made has taken effect."""
        settings = self.dispatcher.queue.settings
        counters = self.dispatcher.queue.counters
        if not settings.preempts or waiting.resumed or not waiting.may_preempt:
            return []
        held: dict[str, int] = {}
        if promised:
            # As the dispatcher counts: the running streams in these rooms, a stream whose
            # pause is under way counted as its preemptor's.
            paused_for = {
                asked.victim: asked.preemptor.ticket.tenant for asked in self.dispatcher.asked
            }
            for each in self.holding:
                if each.room in rooms:
                    asked = each.pauser is not None and each.pauser.asked
                    key = paused_for.get(each, each.ticket.tenant) if asked else each.ticket.tenant
                    held[key] = held.get(key, 0) + 1
        else:
            for each in self.holding:
                if each.room in rooms:
                    held[each.ticket.tenant] = held.get(each.ticket.tenant, 0) + 1
        own_slots = held.get(waiting.tenant, 0)
        own = counters.get(waiting.tenant, 0.0)
        allowed = []
        for each in self.holding:
            ticket = each.ticket
            if (
                each.stage != "running"
                or not each.pausable
                or each.pauser is None
                or each.pauser.asked
                or each.room not in rooms
                or each.room.free_after_release <= 0
                or ticket.band < waiting.band
                or ticket.preemptions >= settings.max_preemptions
            ):
                continue
            if ticket.band == waiting.band and (
                not settings.preempt_within_band
                or own_slots > 0
                or held.get(ticket.tenant, 0) < 2
                or counters.get(ticket.tenant, 0.0) < own
            ):
                continue
            allowed.append(ticket)
        return allowed

    # -- the checks at every step ----------------------------------------------------------

    def check(self) -> None:
        self.checks += 1
        now = trio.current_time()
        for room in self.rooms:
            if not 0 <= room.in_flight <= room.capacity:
                self.over_capacity.append((now, room.name, room.in_flight))
        self.sample_service()

    def sample_service(self) -> None:
        a, b = FLOOD_KEYS
        queue = self.dispatcher.queue
        waiting = {ticket.tenant for ticket in queue.waiting()}
        both = a in waiting and b in waiting
        served = queue.served.get(a, 0.0) - queue.served.get(b, 0.0)
        self.vtc_served.sample(served, both)
        self.since_start = max(self.since_start, abs(served))
        exact = dict(self.served_base)
        w_out = queue.settings.w_out
        for each in self.holding | self.paused:
            if each.kind == "flood":
                exact[each.ticket.tenant] += w_out * each.tokens()
        self.vtc_exact.sample(exact[a] - exact[b], both)

    def _on_dispatch(self, ticket: Ticket, seconds: float) -> None:
        self.slot_of[self.by_ticket[ticket]] = ticket.tenant
        self.check()

    def _on_preempt(self, ticket: Ticket) -> None:
        self.paused_events += 1
        self.check()

    def _on_resume(self, ticket: Ticket, seconds: float) -> None:
        self.check()

    async def watch(self) -> None:
        while True:
            self.check()
            await trio.sleep(1.0)

    # -- the traffic -----------------------------------------------------------------------

    async def serve(self, request: Request) -> None:
        """One request from arrival to its end: queued, running in pieces between pauses,
        done; or refused, or its client gone at ``leaves_at``."""
        self.requests.append(request)
        self.by_ticket[request.ticket] = request
        try:
            with trio.CancelScope(deadline=request.leaves_at) as client:
                request.client = client
                request.stage = "queued"
                async with self.admission.lease(request.ticket) as lease:
                    request.dispatched_at = trio.current_time()
                    await self._work(request, lease)
                request.stage = "done"
        except ApiError as error:
            assert error.code == "deadline_unmeetable", error
            request.stage = "refused"
            request.refused_at = trio.current_time()
        if client.cancelled_caught:
            # A piece cut short by its client ended while running.
            request.left_while = "running" if request.stage == "stopped" else request.stage
            request.stage = "left"
        self.paused.discard(request)
        self.slot_of.pop(request, None)
        if request.kind == "flood":
            w_out = self.dispatcher.queue.settings.w_out
            self.served_base[request.ticket.tenant] += w_out * request.tokens()
        self.check()

    async def _work(self, request: Request, lease: Lease) -> None:
        """Its work, in pieces: each piece holds the lease's slot until it is done or paused;
        after a pause, the rest once it holds a slot again."""
        ticket = request.ticket
        settings = self.dispatcher.queue.settings
        while True:
            assert lease.room is not None
            request.rooms_held.append(lease.room)
            if request.kind == "flood":
                # The dispatcher charges its input at each dispatch, a resume's too.
                self.served_base[ticket.tenant] += settings.w_in * ticket.input_tokens
            request.pauser = pauser = Pauser()
            request.stage = "running"
            request.piece_started = trio.current_time()
            self.holding.add(request)
            self.dispatcher.track(
                ticket,
                request.tokens,
                room=lease.room,
                pause=pauser if request.pausable else None,
                counted=request.tokens(),
            )
            try:
                with pauser.scope:
                    await trio.sleep(request.work - request.worked)
            finally:
                request.worked += trio.current_time() - request.piece_started
                request.stage = "stopped"
                # Its slot is given up right after this, with no checkpoint between.
                self.holding.discard(request)
                self.slot_of.pop(request, None)
                self.released.append((trio.current_time(), request.room, request))
            if not pauser.scope.cancelled_caught:
                request.worked = request.work
                return
            request.stage = "paused"
            request.paused_at.append(trio.current_time())
            self.paused.add(request)
            if request.client is not None and request.patience < math.inf:
                request.client.deadline = min(
                    request.client.deadline, trio.current_time() + request.patience
                )
            await lease.pause(self.rooms, lambda _: None)
            self.paused.discard(request)
            request.resumed_at.append(trio.current_time())

    async def flood_lane(self, key: str, rng: random.Random) -> None:
        while trio.current_time() < self.end:
            now = trio.current_time()
            leaves_at = now + rng.uniform(0.0, 60.0) if rng.random() < FLOOD_LEAVES else math.inf
            patience = math.inf
            if rng.random() < FLOOD_LEAVES_PAUSED:
                patience = rng.uniform(0.0, FLOOD_PATIENCE)
            ticket = Ticket(key, band=5, input_tokens=FLOOD_INPUT)
            request = Request("flood", ticket, now, FLOOD_WORK, True, leaves_at, patience)
            await self.serve(request)

    async def arrivals(self, kind: str, rng: random.Random, nursery: trio.Nursery) -> None:
        every = CHAT_EVERY if kind == "chat" else LIGHT_EVERY
        while True:
            await trio.sleep(rng.expovariate(1.0 / every))
            now = trio.current_time()
            if now >= self.end:
                return
            leaves_at = now + rng.uniform(0.0, 4.0) if rng.random() < LEAVES else math.inf
            first_byte_by = math.inf
            if kind == "chat" and rng.random() < SDK_TIMEOUT_SHARE:
                first_byte_by = now + SDK_TIMEOUT
            band = 0 if kind == "chat" else 5
            ticket = Ticket(kind, band=band, input_tokens=SHORT_INPUT, first_byte_by=first_byte_by)
            request = Request(kind, ticket, now, SHORT_WORK, kind == "chat", leaves_at)
            nursery.start_soon(self.serve, request)

    async def operator(self) -> None:
        await trio.sleep_until(RELOAD_AT)
        self.dispatcher.queue.configure(AFTER_RELOAD)
        await trio.sleep_until(EJECTED[0])
        ejected = self.rooms[1]
        ejected.full = lambda: True
        self.check()
        await trio.sleep_until(EJECTED[1])
        ejected.full = None
        ejected.poke()
        self.check()

    async def run(self) -> None:
        # One generator per task, drawn here: the order trio starts tasks in is its own.
        lanes = [
            (key, random.Random(self.rng.random()))
            for key in FLOOD_KEYS
            for _ in range(FLOOD_LANES)
        ]
        chat, light = random.Random(self.rng.random()), random.Random(self.rng.random())
        async with trio.open_nursery() as outer:
            outer.start_soon(self.watch)
            async with trio.open_nursery() as traffic:
                traffic.start_soon(self.operator)
                traffic.start_soon(self.arrivals, "chat", chat, traffic)
                traffic.start_soon(self.arrivals, "light", light, traffic)
                for key, rng in lanes:
                    traffic.start_soon(self.flood_lane, key, rng)
            self.check()
            outer.cancel_scope.cancel()

    # -- the figures -----------------------------------------------------------------------

    def over_bound(self, request: Request) -> bool:
        """Whether ``request`` waited past preempt_after + the recheck for its slot."""
        assert request.dispatched_at is not None
        bound = max(in_force(request.arrived), in_force(request.dispatched_at)) + RECHECK
        return request.dispatched_at - request.arrived > bound + EPSILON

    def raced(self, asked: Asked) -> bool:
        """Whether the request ``asked`` paused a stream for got another slot instead, one that
        a third request gave up at that same instant."""
        preemptor = asked.preemptor
        return preemptor.rooms_held[0] is not asked.room and any(
            at == asked.at and room is preemptor.rooms_held[0] and whose is not asked.victim
            for at, room, whose in self.released
        )

    def figures(self) -> dict[str, object]:
        """What the run measured, for a reader (the test asserts on the parts it bounds)."""
        worst: dict[str, dict[int, float]] = {}
        over: dict[str, int] = {}
        for kind in ("chat", "light"):
            served = [r for r in self.requests if r.kind == kind and r.dispatched_at is not None]
            per_hour: dict[int, float] = {}
            for each in served:
                assert each.dispatched_at is not None
                hour = int(each.arrived // HOUR)
                waited = each.dispatched_at - each.arrived
                per_hour[hour] = max(per_hour.get(hour, 0.0), round(waited, 3))
            worst[kind] = per_hour
            over[kind] = sum(1 for each in served if self.over_bound(each))
        pairs: dict[str, int] = {}
        for asked in self.dispatcher.asked:
            pair = f"{asked.preemptor.ticket.tenant}>{asked.victim.ticket.tenant}"
            pairs[pair] = pairs.get(pair, 0) + 1
        return {
            "worst_wait_per_hour": worst,
            "over_preempt_after_plus_recheck": over,
            "served": {k: sum(1 for r in self.requests if r.kind == k) for k in worst},
            "vtc_served": self.vtc_served.widest,
            "vtc_exact": self.vtc_exact.widest,
            "flood_difference_since_start": self.since_start,
            "pauses": pairs,
            "raced_pauses": sum(1 for asked in self.dispatcher.asked if self.raced(asked)),
            "margin_breaches": len(self.dispatcher.margin_breaches),
            "refused": sum(1 for r in self.requests if r.refused_at is not None),
            "left": {
                stage: sum(1 for r in self.requests if r.left_while == stage)
                for stage in ("queued", "running", "paused")
            },
            "checks": self.checks,
        }


async def test_hours_of_traffic_keep_the_schedulers_promises(
    autojump_clock: trio.abc.Clock,
) -> None:
    sim = Simulation(SEED, HOURS)
    # Every stream is done well within an hour of the last arrival: past it, something waits
    # forever.
    with trio.fail_after(sim.end + HOUR):
        await sim.run()
    dispatcher, admission = sim.dispatcher, sim.admission
    requests = sim.requests
    chats = [r for r in requests if r.kind == "chat"]
    urgent = [r for r in requests if r.kind in ("chat", "light")]

    # Nothing left anywhere, and no room ever held more than its capacity.
    assert sim.over_capacity == []
    assert [room.in_flight for room in sim.rooms] == [0, 0]
    assert dispatcher.queue.size == 0 and admission.waiting == 0
    assert not any(dispatcher.running(r.ticket) for r in requests)
    assert not sim.holding and not sim.paused and not sim.slot_of

    # Every look for a stream to pause found what the rules allow, and found one when one was.
    assert dispatcher.disagreements == []
    # The first look came preempt_after after the arrival, the setting in force then.
    for request in requests:
        if request.looked:
            first = request.looked[0][0]
            assert math.isclose(first - request.arrived, in_force(first)), request

    # Urgent waits: within preempt_after + the recheck, or spent looking every second while
    # nothing was allowed to pause (max_preemptions spent, slots held by chats, an ejection).
    for request in urgent:
        if request.looked and request.looked[0][1]:
            assert request.dispatched_at == request.looked[0][0], request
        if request.dispatched_at is None or not sim.over_bound(request):
            continue
        looks = [at for at, _ in request.looked]
        assert looks and not any(found for _, found in request.looked[:-1]), request
        gaps = [later - earlier for earlier, later in itertools.pairwise(looks)]
        assert max(gaps, default=0.0) <= RECHECK + EPSILON, looks
        assert request.dispatched_at - looks[-1] <= RECHECK + EPSILON, looks

    # Each pause: its preemptor got a slot at that instant, the paused stream's unless another
    # one came free at that same instant; chats paused a stream 0.5 s after they arrived before
    # the reload, 1.0 s after from then on.
    assert sim.paused_events == len(dispatcher.asked) > 0
    for asked in dispatcher.asked:
        assert asked.preemptor.dispatched_at == asked.at, asked
        assert asked.preemptor.rooms_held[0] is asked.room or sim.raced(asked), asked
    by_chats = [a for a in dispatcher.asked if a.preemptor.kind == "chat"]
    for before in (True, False):
        waits = [a.at - a.preemptor.arrived for a in by_chats if (a.at < RELOAD_AT) == before]
        assert math.isclose(min(waits), in_force(0.0 if before else RELOAD_AT)), waits

    # Every pause ended: resumed, or its client left while paused; at most one per stream.
    for request in requests:
        assert len(request.paused_at) <= BEFORE_RELOAD.max_preemptions
        if request.left_while == "paused":
            assert len(request.resumed_at) == len(request.paused_at) - 1
        else:
            assert len(request.resumed_at) == len(request.paused_at)

    # Every request whose client stayed, and was not refused, did all its work.
    for request in requests:
        if request.stage == "done":
            assert request.tokens() == request.total_tokens
        else:
            assert request.stage in ("left", "refused"), request
    # Clients left in every phase, and many streams were paused, resumed and finished.
    assert {r.left_while for r in requests} >= {"queued", "running", "paused"}
    assert sum(1 for r in requests if r.paused_at and r.stage == "done") > 100

    # Refusals only at arrival or at the deadline; what was dispatched, before it.
    for request in chats:
        deadline = request.ticket.first_byte_by
        if request.refused_at is not None:
            at = request.refused_at
            assert math.isclose(at, request.arrived) or math.isclose(at, deadline), request
        if request.dispatched_at is not None:
            assert request.dispatched_at <= deadline

    # Fair share between the flood keys: within VTC's bound over every stretch in which both
    # were backlogged. The longest input is the flood's; the most tokens one batch holds:
    # every slot running a flood stream to its end (a key charged as it streams can be
    # dispatched every slot at once).
    settings = BEFORE_RELOAD
    batch_tokens = ROOMS * SLOTS_PER_ROOM * round(FLOOD_WORK * RATE)
    bound = vtc_bound(settings.w_in, FLOOD_INPUT, settings.w_out, batch_tokens)
    assert sim.checks > sim.end
    widest = (sim.vtc_served.widest, sim.vtc_exact.widest)
    assert 0 < widest[0] <= bound and 0 < widest[1] <= bound, widest


# -- what the long run shows, one instant at a time --------------------------------------------


def _one_room(capacity: int) -> Admission:
    dispatcher = Dispatcher(SchedulingSettings(preempt_after=0.5))
    room = dispatcher.room(Room("replica", capacity))
    return Admission("m", dispatcher, max_queue=100, queue_timeout=1e9, rooms=[room])


async def _pausable(
    admission: Admission,
    ticket: Ticket,
    seconds: float,
    log: list[str],
    ask: Pauser | None = None,
) -> None:
    """``seconds`` of work, paused when asked (through ``ask``'s scope if given), continued."""
    async with admission.lease(ticket) as lease:
        left = seconds
        while True:
            pauser = ask or Pauser()
            admission.dispatcher.track(ticket, lambda: 0, room=lease.room, pause=pauser)
            started = trio.current_time()
            with pauser.scope:
                await trio.sleep(left)
                return
            left -= trio.current_time() - started
            log.append(f"{ticket.tenant} paused at {trio.current_time():g}")
            await lease.pause(admission.rooms, lambda _: None)
            ask = None


async def test_waiters_looking_at_one_instant_keep_the_within_band_margin(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Key b holds all four slots; four requests of key a, of the same band, arrive together
    # and look at the same instant. The first pause gives key a a slot (counted as its at
    # once, though the paused stream has yet to give it up): a key running a stream pauses
    # nothing of its band, so the other three wait for the fair order.
    admission = _one_room(4)
    log: list[str] = []
    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(_pausable, admission, Ticket("b", band=5), 100.0, log)
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(4):
            nursery.start_soon(_pausable, admission, Ticket("a", band=5), 100.0, log)
        await trio.sleep(5.0)
        nursery.cancel_scope.cancel()
    assert log == ["b paused at 0.5"]


class AtBoundary(Pauser):
    """A producer that stops at its next event boundary, ``delay`` seconds after it is asked
    (a local model's next step), not at once; until then a pause asked can be withdrawn,
    unless ``withdrawable`` is False (an upstream exchange, stopped as it is asked)."""

    def __init__(self, nursery: trio.Nursery, delay: float, *, withdrawable: bool = True) -> None:
        super().__init__()
        self.nursery = nursery
        self.delay = delay
        self.withdrawable = withdrawable
        self.pending: trio.CancelScope | None = None
        self.withdrawn = 0

    def ask(self) -> bool:
        self.asked += 1
        self.pending = trio.CancelScope()
        self.nursery.start_soon(self._stop, self.pending)
        return True

    def withdraw(self) -> bool:
        if not self.withdrawable or self.pending is None:
            return False
        self.pending.cancel()
        self.pending = None
        self.withdrawn += 1
        return True

    async def _stop(self, pending: trio.CancelScope) -> None:
        with pending:
            await trio.sleep(self.delay)
            self.pending = None
            self.scope.cancel()


@pytest.mark.parametrize("withdrawable", [True, False])
async def test_a_pause_that_would_serve_nobody_is_withdrawn_unless_too_late(
    autojump_clock: trio.abc.Clock, withdrawable: bool
) -> None:
    # Two slots: a batch stream, and another stream that ends at 10.6. A chat arrives at 10.0
    # and asks the batch to pause at 10.5; the batch would reach its boundary at 10.7. The
    # chat takes the slot freed at 10.6, and the pause, which would serve nobody, is
    # withdrawn: the batch runs on, and keeps its pause for a request that needs it. One that
    # cannot take its pause back (an upstream exchange is stopped as it is asked) pauses at
    # 10.7, and the slot it frees, no longer the chat's, goes in the queue's order: to the
    # batch itself, at the head of its band, at once.
    admission = _one_room(2)
    log: list[str] = []
    batch = Ticket("batch", band=5)

    async def other() -> None:
        async with admission.slot(Ticket("other", band=5)):
            await trio.sleep(10.6)

    async def chat() -> None:
        await trio.sleep(10.0)
        async with admission.slot(Ticket("chat", band=0)):
            log.append(f"chat dispatched at {trio.current_time():g}")
            await trio.sleep(5.0)

    async with trio.open_nursery() as nursery:
        pauser = AtBoundary(nursery, 0.2, withdrawable=withdrawable)
        nursery.start_soon(_pausable, admission, batch, 100.0, log, pauser)
        nursery.start_soon(other)
        nursery.start_soon(chat)
        await trio.sleep(11.0)
        assert admission.dispatcher.running(batch)
        assert admission.rooms[0].in_flight == 2
        nursery.cancel_scope.cancel()
    if withdrawable:
        assert log == ["chat dispatched at 10.6"]
        assert (pauser.asked, pauser.withdrawn, batch.preemptions) == (1, 1, 0)
        assert not batch.paused_for_share
    else:
        assert log == ["chat dispatched at 10.6", "batch paused at 10.7"]
        assert (pauser.asked, pauser.withdrawn, batch.preemptions) == (1, 0, 1)


async def test_a_pause_is_withdrawn_when_its_waiter_leaves_the_queue(
    autojump_clock: trio.abc.Clock,
) -> None:
    # One slot, the batch's. A chat arrives at 10.0, asks the batch to pause at 10.5, and its
    # client leaves at 10.6, before the batch's boundary at 10.7: the pause is withdrawn.
    admission = _one_room(1)
    log: list[str] = []
    batch = Ticket("batch", band=5)

    async def chat() -> None:
        await trio.sleep(10.0)
        with trio.move_on_after(0.6):
            async with admission.slot(Ticket("chat", band=0)):
                log.append("chat dispatched")

    async with trio.open_nursery() as nursery:
        pauser = AtBoundary(nursery, 0.2)
        nursery.start_soon(_pausable, admission, batch, 100.0, log, pauser)
        nursery.start_soon(chat)
        await trio.sleep(20.0)
        assert admission.dispatcher.running(batch)
        nursery.cancel_scope.cancel()
    assert log == []
    assert (pauser.asked, pauser.withdrawn, batch.preemptions) == (1, 1, 0)
