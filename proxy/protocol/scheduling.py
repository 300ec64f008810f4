"""Who goes next: the order in which waiting requests are dispatched, sans-IO.

Every decision here is a pure step over the waiting requests (:class:`Ticket`), the service
counters and the time it is given; the trio shell that holds the slots and wakes the waiters is
``proxy/relay/admission.py``.

**Fair share between keys (VTC).** Each tenant (a client key; requests with no key form one
tenant, ``""``) has a virtual counter of the service it has received: each request's input
tokens times ``w_in`` when it is dispatched, and its output tokens times ``w_out`` as they
stream, each divided by the key's ``weight``. The waiting request of the tenant with the
smallest counter goes next (a tenant's own requests in arrival order). A tenant that becomes
backlogged again is lifted to the smallest counter among those waiting in its band (or, with
nobody waiting, to the counter of the last tenant dispatched): being idle is not banked.
Sheng et al. (OSDI 2024) prove that the service two tenants receive in any interval in which
both are backlogged then differs by at most ``2 * max(w_in * L_in, w_out * M)``
(:func:`vtc_bound`), while no slot idles.

**Forgetting idle tenants.** Each tenant's counter is kept while it matters, not forever (with a
tenant per subject of a key, there can be a great many). Let ``m`` be the smallest of the last
dispatched tenant's counter and the counters of the tenants waiting: every lift from now on is
to at least ``m`` (a lift is to the smallest waiting counter of a band, or to the last
dispatched's, and a tenant that takes a free slot without waiting is lifted first, as VTC's
arrival rule says), and ``m`` never goes down (counters only grow; a tenant starts waiting at
or above ``m``; the one dispatched is at or above it). So a tenant not waiting, whose counter
is at most ``m``, would be lifted on its return to a floor at least its counter: forgotten, it
is lifted to the same floor and loses nothing (:meth:`FairQueue.forget_idle`). What goes with
it is its service alone (``served``), the tie-break between equal counters. A tenant whose
request runs is kept (its output is still charged, and preemption weighs its counter), and so
is one a shared store still counts (:attr:`FairQueue.pinned`). Forgetting runs once the
counters reach :data:`FORGET_AT` tenants, and again at twice as many as were kept.

**Bands.** A request's band is an integer, lower first, as vLLM reads its ``priority``: a key's
``priority``, which a request may raise (less urgent) but never lower
(:func:`~proxy.protocol.request_priority.request_band`). A band is served strictly before the
bands after it, and fairly within itself.

**The starvation guard.** A request that has waited ``starvation_seconds`` goes before every
band (the oldest such first): a flood of urgent requests delays a batch job, never forever. Its
age counts from when it began waiting *this time*: a stream paused after an hour of batch work
is not starved, and a retry keeps the age of the request's first wait.

**FIFO** (``policy = "fifo"``): arrival order, bands ignored; what the fair order is measured
against.

**Preemption** (``preempt_after`` > 0, fair only): a request that has waited ``preempt_after``
seconds (:func:`preemption_due`) while a less urgent band holds a slot it could use has one of
those streams paused for it (:func:`choose_preemption`): of the least urgent band running, the
one whose key has been served most (of its streams, the one paused least). Within its own band
(``preempt_within_band``), a request of a key that holds none of those slots pauses a stream of
a key that holds at least two of them and has been served at least as much: a flood holding
every slot gives one up to a light key at ``preempt_after``, and the flood keeps at least as
many as the light key. A key that runs a stream already never pauses one of its band, so two
flooding keys never pause each other back and forth (the fair order balances them as slots
free). The slot a pause frees goes to the request that asked for it, never to another ticket,
and a pause is asked only where that slot can serve it at once (the shell checks the room). The
paused request waits again at the head of its band (:attr:`Ticket.resumed`; one paused within
its band, at the head of its key's requests, the fair order deciding between keys), to be
continued where it stopped; a paused request never pauses another, a hedge never pauses
anything, and a request is paused at most ``max_preemptions`` times, so that a batch job still
finishes.

**Drain** (:attr:`FairQueue.draining`, after SIGTERM): no new preemption, and paused requests
go before every request that never started, so that admitted work finishes first.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

POLICIES = ("fair", "fifo")
# How many tenants' counters are kept before the idle ones are forgotten (and, after, at least
# twice as many as were kept then).
FORGET_AT = 1024


@dataclass(frozen=True)
class SchedulingSettings:
    """The ``[scheduling]`` table's settings, as the queue uses them."""

    policy: str = "fair"
    w_in: float = 1.0
    w_out: float = 2.0
    # A request that has waited this long goes before every band (0: no guard).
    starvation_seconds: float = 60.0
    # A request of a more urgent band that has waited this long pauses a running stream of a
    # less urgent one (0: never).
    preempt_after: float = 0.0
    # The most times one request is paused.
    max_preemptions: int = 3
    # Seconds between two ": paused" comments to a paused request's client (at most half its
    # SDK's read timeout, when it sent one: see keepalive_interval).
    pause_keepalive: float = 5.0
    # Whether a request may pause a stream of its own band, of a key that holds at least two
    # more slots than its own key (see the module's docstring).
    preempt_within_band: bool = True

    @property
    def preempts(self) -> bool:
        """Whether a waiting request may pause a running one: fair order (FIFO knows no bands)
        and a positive ``preempt_after``."""
        return self.policy == "fair" and self.preempt_after > 0


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the scheduler knows of a request, decided once by the pipeline: whose it is, how
    urgent, how heavy, and by when it must have started and ended."""

    # The client key's name ("": no key; every such request is one tenant).
    tenant: str = ""
    band: int = 0
    weight: float = 1.0
    input_tokens: int = 0
    # When its first byte must be out (its SDK's read timeout) and when it must be done, on
    # the event loop's clock; inf: no such deadline.
    first_byte_by: float = math.inf
    done_by: float = math.inf
    # Its client's read timeout (x-stainless-read-timeout), seconds; inf: none said.
    read_timeout: float = math.inf
    # Told each time the request leaves a queue: the seconds it waited (its access line).
    report: Callable[[float], None] | None = field(default=None, compare=False, repr=False)
    # Told each time the request resumes after a pause: the seconds it was paused.
    paused: Callable[[float], None] | None = field(default=None, compare=False, repr=False)

    def ticket(self) -> Ticket:
        """A ticket for one attempt of the request (a retry or a hedge is another)."""
        return Ticket(
            self.tenant,
            self.band,
            self.weight,
            self.input_tokens,
            # A request that cannot start before either deadline is of no use to its client.
            first_byte_by=min(self.first_byte_by, self.done_by),
            by_read_timeout=self.first_byte_by <= self.done_by,
            read_timeout=self.read_timeout,
            report=self.report,
            paused=self.paused,
        )


DEFAULT_SCHEDULE = Schedule()


@dataclass(eq=False, slots=True)
class Ticket:
    """One request waiting for a slot, as the scheduler sees it: one per request, kept across its
    retries (a hedge's second attempt has a :meth:`companion`). Its fields change only through
    the scheduler's steps: :meth:`begin_wait`, :meth:`FairQueue.add` and the rest."""

    tenant: str
    band: int = 0
    weight: float = 1.0
    # The request's input tokens (estimated), charged when it is dispatched.
    input_tokens: int = 0
    # The origin of its age (the starvation guard's, preempt_after's): its first wait, or
    # the wait after its last pause.
    arrived: float = 0.0
    # When its present wait began (what it reports as waited).
    waiting_since: float = 0.0
    # When it must have started at the latest (the earlier of its two deadlines): inf for none.
    first_byte_by: float = math.inf
    # Whether first_byte_by is its client's read timeout (else its whole deadline's end).
    by_read_timeout: bool = True
    # Its client's read timeout: the pause's comments come at least twice within it.
    read_timeout: float = math.inf
    # Its place in arrival order, given by the queue (once: a paused request keeps its place).
    seq: int = field(default=-1)
    report: Callable[[float], None] | None = field(default=None, repr=False)
    paused: Callable[[float], None] | None = field(default=None, repr=False)
    # Whether it waits to be continued (paused for a more urgent request): it goes before the
    # rest of its band.
    resumed: bool = False
    # How many times it has been paused.
    preemptions: int = 0
    # How many times it has asked for a slot (its first attempt, its retries).
    attempts: int = 0
    # Whether it may pause another request (a hedge may not: its request already runs).
    may_preempt: bool = True
    # Paused for a request of its own band (for the fair share): resumed, it waits in the
    # fair order between keys, not before them, or the next free slot would undo the pause.
    paused_for_share: bool = False

    def pause_asked(self, by: Ticket) -> None:
        """It was asked to pause for ``by``."""
        self.paused_for_share = by.band == self.band

    def pause_withdrawn(self) -> None:
        """The pause asked was withdrawn before it was taken: it runs on."""
        self.paused_for_share = False

    def begin_wait(self, now: float) -> None:
        """It asks for a slot at ``now``: its age starts with its first attempt, and a retry
        keeps it."""
        if self.attempts == 0:
            self.arrived = now
        self.attempts += 1
        self.waiting_since = now

    def begin_pause(self, now: float, input_tokens: int | None = None) -> None:
        """It was paused at ``now`` and waits again, at the head of its band: its age starts
        over, so that the guard does not take a long stream's pause for starvation.
        ``input_tokens``: what it prefills again on resuming (charged at its dispatch)."""
        if input_tokens is not None:
            self.input_tokens = input_tokens
        self.resumed = True
        self.preemptions += 1
        self.arrived = self.waiting_since = now

    def end_pause(self) -> None:
        self.resumed = False
        self.paused_for_share = False

    def companion(self) -> Ticket:
        """A ticket for a hedge of this request: the same key, band, age and deadline, which
        never pauses anything (its request has an attempt running already)."""
        return Ticket(
            self.tenant,
            self.band,
            self.weight,
            self.input_tokens,
            arrived=self.arrived,
            first_byte_by=self.first_byte_by,
            by_read_timeout=self.by_read_timeout,
            read_timeout=self.read_timeout,
            report=self.report,
            paused=self.paused,
            attempts=self.attempts,
            may_preempt=False,
        )


class FairQueue:
    """The waiting requests and the tenants' counters (see the module's docstring)."""

    def __init__(self, settings: SchedulingSettings | None = None) -> None:
        self.settings = settings or SchedulingSettings()
        # Each tenant's virtual counter: the service it has received, weighted, and its lifts.
        self.counters: dict[str, float] = {}
        # Each tenant's service alone (weighted, never lifted): what SharedCounters sends.
        self.served: dict[str, float] = {}
        # band -> tenant -> its waiting tickets, oldest first (a tenant present is backlogged).
        self._bands: dict[int, dict[str, deque[Ticket]]] = {}
        self._seq = itertools.count()
        # The counter of the tenant dispatched last: where a tenant arriving to an empty queue
        # is lifted to.
        self._last_dispatched = 0.0
        self.size = 0
        # After SIGTERM: paused requests first, and no new preemption.
        self.draining = False
        # A tenant never forgotten while this says so (a store sharing the counters: its
        # record of this instance's service assumes ``served`` only grows).
        self.pinned: Callable[[str], bool] | None = None
        # The number of tenants at which forget_idle next runs (see the module's docstring).
        self.forget_at = FORGET_AT

    def configure(self, settings: SchedulingSettings) -> None:
        """New settings (a reload): the counters and the waiting requests stay."""
        self.settings = settings

    # -- what moves it --------------------------------------------------------------------

    def add(self, ticket: Ticket) -> None:
        """``ticket`` waits from now on."""
        if ticket.seq < 0:
            ticket.seq = next(self._seq)
        band = self._bands.setdefault(ticket.band, {})
        waiting = band.get(ticket.tenant)
        if not waiting:
            self._lift(ticket.tenant, band)
            band[ticket.tenant] = waiting = deque()
        if ticket.resumed:
            # At the head of its tenant's requests, as at the head of its band (see _order).
            waiting.appendleft(ticket)
        else:
            waiting.append(ticket)
        self.size += 1

    def _lift(self, tenant: str, band: Mapping[str, deque[Ticket]]) -> None:
        """A tenant becoming backlogged is lifted to the smallest counter among those waiting
        in its band (or to the last dispatched tenant's, with nobody waiting)."""
        floor = min((self.counters.get(other, 0.0) for other in band), default=None)
        if floor is None:
            floor = self._last_dispatched
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def remove(self, ticket: Ticket) -> None:
        """``ticket`` waits no longer (dispatched, refused, or its client left)."""
        band = self._bands.get(ticket.band)
        if band is None:
            return
        waiting = band.get(ticket.tenant)
        if waiting is None or ticket not in waiting:
            return
        waiting.remove(ticket)
        self.size -= 1
        if not waiting:
            del band[ticket.tenant]
            if not band:
                del self._bands[ticket.band]

    def dispatched(self, ticket: Ticket) -> None:
        """``ticket`` got its slot: it waits no longer, and its input is charged. A ticket that
        never waited (a free slot) arrives as a tenant becoming backlogged does: lifted first,
        unless its tenant waits already (then its counter is at least the floor)."""
        band = self._bands.get(ticket.band, {})
        if ticket.tenant not in band:
            self._lift(ticket.tenant, band)
        self.remove(ticket)
        self.charge(ticket.tenant, ticket.weight, input_tokens=ticket.input_tokens)
        self._last_dispatched = self.counters.get(ticket.tenant, 0.0)

    @property
    def floor(self) -> float:
        """``m`` of the module's docstring: no lift from now on is below it."""
        floor = self._last_dispatched
        for band in self._bands.values():
            for tenant in band:
                floor = min(floor, self.counters.get(tenant, 0.0))
        return floor

    @property
    def crowded(self) -> bool:
        """Whether :meth:`forget_idle` is due (the tenants kept reached :attr:`forget_at`)."""
        return len(self.counters) >= self.forget_at

    def forget_idle(self, busy: Collection[str] = ()) -> int:
        """Forget the tenants that lose nothing by it (the module's docstring): not waiting,
        not ``busy`` (a request of theirs runs), not :attr:`pinned`, their counter at most
        :attr:`floor`. How many were forgotten; the next run is due at twice as many tenants
        as are kept (at least :data:`FORGET_AT`)."""
        floor = self.floor
        waiting = {tenant for band in self._bands.values() for tenant in band}
        pinned = self.pinned
        idle = [
            tenant
            for tenant, counter in self.counters.items()
            if counter <= floor
            and tenant not in waiting
            and tenant not in busy
            and (pinned is None or not pinned(tenant))
        ]
        for tenant in idle:
            del self.counters[tenant]
            self.served.pop(tenant, None)
        self.forget_at = max(FORGET_AT, 2 * len(self.counters))
        return len(idle)

    def charge(
        self, tenant: str, weight: float, *, input_tokens: int = 0, output_tokens: int = 0
    ) -> None:
        """Service received by ``tenant``: tokens in and out, weighted and divided by the
        key's weight."""
        cost = self.settings.w_in * input_tokens + self.settings.w_out * output_tokens
        if cost:
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / weight
            self.served[tenant] = self.served.get(tenant, 0.0) + cost / weight

    # -- what it decides ------------------------------------------------------------------

    def next(self, now: float, eligible: Callable[[Ticket], bool] | None = None) -> Ticket | None:
        """The ticket to dispatch next (not removed: :meth:`dispatched` does), among those
        ``eligible`` says may go (a slot free on a replica that can serve them), or None."""
        if self.draining:
            # Admitted work first: a paused request's client holds half an answer.
            paused = self._oldest((t for t in self.waiting() if t.resumed), eligible)
            if paused is not None:
                return paused
        if self.settings.policy == "fifo":
            return self._oldest(self.waiting(), eligible)
        guard = self.settings.starvation_seconds
        if guard > 0:
            starved = self._oldest(
                (t for t in self.waiting() if now - t.arrived >= guard), eligible
            )
            if starved is not None:
                return starved
        for band in sorted(self._bands):
            chosen: Ticket | None = None
            chosen_key: tuple[float, ...] = (math.inf, math.inf, math.inf, math.inf)
            for tenant, waiting in self._bands[band].items():
                ticket = _first(waiting, eligible)
                if ticket is None:
                    continue
                key = self._order(tenant, ticket)
                if key < chosen_key:
                    chosen, chosen_key = ticket, key
            if chosen is not None:
                return chosen
        return None

    def _order(self, tenant: str, ticket: Ticket) -> tuple[float, float, float, float]:
        """Where ``tenant``'s next ``ticket`` stands: a request paused for a more urgent band first
        (its client holds half an answer; one paused for the fair share within its band
        waits in the fair order, first among its own key's); then the smallest counter;
        on equal counters (a tenant just lifted to the smallest among those waiting) the
        one actually served less, so that a key returning from idleness takes the next
        slot rather than waiting behind a flooder's older request; then the older
        ticket."""
        return (
            0.0 if ticket.resumed and not ticket.paused_for_share else 1.0,
            self.counters.get(tenant, 0.0),
            self.served.get(tenant, 0.0),
            ticket.seq,
        )

    @staticmethod
    def _oldest(
        tickets: Iterable[Ticket], eligible: Callable[[Ticket], bool] | None
    ) -> Ticket | None:
        oldest: Ticket | None = None
        for ticket in tickets:
            if (eligible is None or eligible(ticket)) and (
                oldest is None or ticket.seq < oldest.seq
            ):
                oldest = ticket
        return oldest

    def waiting(self) -> Iterable[Ticket]:
        """Every waiting ticket (no order)."""
        for band in self._bands.values():
            for waiting in band.values():
                yield from waiting

    def ahead_of(self, ticket: Ticket) -> int:
        """How many waiting tickets go before ``ticket`` in this order, as things stand: those
        of more urgent bands, those of its band whose tenant's counter is smaller (or equal,
        with an older ticket), and its own tenant's older ones (FIFO: every older ticket). An
        estimate: counters move as requests are served, and the guard may promote an old one."""
        if self.settings.policy == "fifo":
            return sum(1 for other in self.waiting() if other.seq < ticket.seq)
        mine = self._order(ticket.tenant, ticket)
        ahead = 0
        for band, tenants in self._bands.items():
            for tenant, waiting in tenants.items():
                if band < ticket.band:
                    ahead += len(waiting)
                elif band == ticket.band:
                    if tenant == ticket.tenant:
                        ahead += sum(1 for other in waiting if other.seq < ticket.seq)
                    elif self._order(tenant, waiting[0]) < mine:
                        ahead += len(waiting)
        return ahead


def _first(waiting: deque[Ticket], eligible: Callable[[Ticket], bool] | None) -> Ticket | None:
    if eligible is None:
        return waiting[0]
    for ticket in waiting:
        if eligible(ticket):
            return ticket
    return None


# -- deadlines and bands ------------------------------------------------------------------


def expected_wait(ahead: int, free: int, slots: int, average_hold: float) -> float:
    """Seconds until a request with ``ahead`` requests before it gets a slot: none while a
    slot is free for it; else the slots it waits for, in turn, each held ``average_hold`` on
    average (``ahead - free + 1`` dispatches, ``slots`` at a time)."""
    if free > ahead:
        return 0.0
    return (ahead - free + 1) * average_hold / max(1, slots)


def preemption_due(
    settings: SchedulingSettings, ticket: Ticket, *, draining: bool = False
) -> float | None:
    """When ``ticket``, waiting, may pause another stream for itself: ``preempt_after`` after
    its age began; None when it never may (preemption off, a drain, a paused request itself,
    which waits its turn at the head of its band, or a hedge)."""
    if not settings.preempts or ticket.resumed or not ticket.may_preempt or draining:
        return None
    return ticket.arrived + settings.preempt_after


def keepalive_interval(settings: SchedulingSettings, ticket: Ticket) -> float:
    """Seconds between two comments to a paused request's client: ``pause_keepalive``, or half
    its SDK's read timeout when that is shorter (the SDK gives up and retries after it)."""
    return min(settings.pause_keepalive, ticket.read_timeout / 2)


# How many slots a key must hold to have one paused within its band, for a key holding none:
# with two, it still holds at least as many afterwards.
WITHIN_BAND_MARGIN = 2


def choose_preemption(
    settings: SchedulingSettings,
    waiting: Ticket,
    running: Iterable[Ticket],
    counters: Mapping[str, float],
    held: Mapping[str, int] | None = None,
) -> Ticket | None:
    """The running request to pause so that ``waiting`` takes its slot, or None. A less urgent band
    is paused first, never a more urgent one; of the least urgent band running, the request
    whose key has the largest counter (the most served); of its streams the one paused
    least, the youngest on a tie (the least work to redo). In ``waiting``'s own band
    (``preempt_within_band``), and only while ``waiting``'s key holds none of the slots (by
    ``held``: each key's slots in the rooms ``waiting`` could use), a request of a key holding
    at least :data:`WITHIN_BAND_MARGIN` of them whose counter is at least ``waiting``'s
    key's; without ``held``, never within the band. Only a request paused fewer than
    ``max_preemptions`` times. ``running`` holds only requests that can be continued, in
    rooms where the slot freed would serve ``waiting``."""
    if not waiting.may_preempt or waiting.resumed:
        return None
    chosen: Ticket | None = None
    chosen_key = (-math.inf, -math.inf, -math.inf, -math.inf, -math.inf)
    own = counters.get(waiting.tenant, 0.0)
    own_slots = 0 if held is None else held.get(waiting.tenant, 0)
    for ticket in running:
        if ticket.band < waiting.band or ticket.preemptions >= settings.max_preemptions:
            continue
        served = counters.get(ticket.tenant, 0.0)
        slots = 0 if held is None else held.get(ticket.tenant, 0)
        if ticket.band == waiting.band and (
            not settings.preempt_within_band
            or held is None
            or own_slots > 0
            or slots < WITHIN_BAND_MARGIN
            or served < own
        ):
            continue
        # Its key first (the least urgent band, the most slots, the most served), then of
        # that key's streams the one paused least, the youngest on a tie.
        key = (
            float(ticket.band),
            float(slots),
            served,
            -float(ticket.preemptions),
            float(ticket.seq),
        )
        if key > chosen_key:
            chosen, chosen_key = ticket, key
    return chosen


def retry_after(queued: int, slots: int, average_hold: float) -> int:
    """Whole seconds (at least 1) until a place is likely free: the ``queued`` requests ahead
    and this one, in turn, ``slots`` at a time, each slot held ``average_hold`` on average."""
    return max(1, math.ceil(average_hold * (queued + 1) / max(1, slots)))


def vtc_bound(w_in: float, longest_input: int, w_out: float, batch_tokens: int) -> float:
    """The most service two backlogged tenants can differ by, fair scheduling's guarantee:
    ``2 * max(w_in * L_in, w_out * M)``, with ``L_in`` the longest input and ``M`` the most
    tokens one batch holds (Sheng et al., OSDI 2024)."""
    return 2 * max(w_in * longest_input, w_out * batch_tokens)
