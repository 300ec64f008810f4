"""The keys' counters shared between instances (``[limits] backend = "redis"``), simulated sans-IO:
two instances, each a :class:`FairQueue` with its slots and its own :class:`SharedCounters`, in
front of a simulated store (:class:`Store`: the totals and each instance's record, as the Lua
script keeps them), on a virtual clock of decode steps. No sockets, no trio.

**The model.** A step is one decode step: every running request puts out one token (its key's
service grows by ``w_out``); a request that has put out all its tokens ends, and its slot is
filled in the same step from the queue (the input charged then: ``w_in`` per token). Output is
charged to the counters as the product's dispatcher does (``relay/admission.py``): before each
decision, when a request ends, and before each sync (``SharedService`` settles what is running
first). Instance ``i`` syncs at the steps ``phase[i] (mod P)`` (``P``: ``share_seconds`` in
steps): it sends its service and floors at once (the script is atomic) and takes the store's
totals ``lag`` steps later (the answer's way back; ``1 <= lag < P``). Within a step: answers
arrive, tokens come out, requests end, arrivals, then each instance decides (instance 1 first),
then the syncs go out (instance 1 first).

**The staleness term.** When instance ``j`` decides at step ``t``, what the other instance
``i`` served is known to it as of ``i``'s last sync before the sync whose answer ``j`` holds:
``j``'s answered sync went out at ``t_o`` with ``t - P - lag < t_o <= t - lag``, and ``i``'s
last sync at or before it at ``t_o - g``, ``g = (phase[j] - phase[i]) mod P`` (same step:
``i`` goes first). So ``j`` misses at most what ``i`` served in ``W_ij = P - 1 + lag + g``
steps, each at most ``slots_i * (w_out + w_in * L_in)`` (every slot puts out a token and starts
a request with the longest input): ``Δ_ij = W_ij * slots_i * (w_out + w_in * L_in)``. The
staleness term is ``Δ_12 + Δ_21``; with the syncs in phase and an answer back in one step it is
``P * (slots_1 + slots_2) * (w_out + w_in * L_in)``: the most both instances can serve in one
share interval.

**The bound.** ``vtc_bound(w_in, L_in, w_out, M) + Δ_12 + Δ_21``, with ``M`` the tokens both
instances' batches hold, ``(slots_1 + slots_2) * (L_in + OUT_MAX)``: the single-instance bound
of one server with every slot, plus the staleness. Why it holds (the VTC argument, with stale
views) is in each test's docstring.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from proxy.protocol.scheduling import (
    FairQueue,
    SchedulingSettings,
    Ticket,
    vtc_bound,
)
from proxy.protocol.shared_counters import SharedCounters

W_IN, W_OUT = 1.0, 2.0
# A request's input costs no more than its shortest output (W_IN * L_IN <= W_OUT * OUT_MIN):
# see the first test's argument.
L_IN, OUT_MIN, OUT_MAX = 16, 8, 24
SETTINGS = SchedulingSettings(policy="fair", w_in=W_IN, w_out=W_OUT, starvation_seconds=0)


@dataclass(eq=False)
class Request:
    tenant: str
    input_tokens: int
    output_tokens: int
    ticket: Ticket
    emitted: int = 0
    charged: int = 0


@dataclass
class Instance:
    slots: int
    phase: int
    queue: FairQueue = field(default_factory=lambda: FairQueue(SETTINGS))
    running: list[Request] = field(default_factory=list)
    waiting: dict[Ticket, Request] = field(default_factory=dict)
    # The store's answer on its way back: (the step it arrives, the totals).
    answer: tuple[int, dict[str, float]] | None = None

    def __post_init__(self) -> None:
        self.shared = SharedCounters(self.queue)

    def backlog(self, tenant: str) -> int:
        return sum(1 for request in self.waiting.values() if request.tenant == tenant)

    def add(self, request: Request) -> None:
        self.waiting[request.ticket] = request
        self.queue.add(request.ticket)

    def _charge(self, request: Request) -> None:
        if request.emitted > request.charged:
            self.queue.charge(request.tenant, 1.0, output_tokens=request.emitted - request.charged)
            request.charged = request.emitted

    def settle(self) -> None:
        for request in self.running:
            self._charge(request)

    def emit(self, served: dict[str, float]) -> None:
        """One decode step: a token from every running request; those done end."""
        for request in self.running:
            request.emitted += 1
            served[request.tenant] += W_OUT
        for request in [r for r in self.running if r.emitted == r.output_tokens]:
            self._charge(request)
            self.running.remove(request)

    def dispatch(self, step: int, served: dict[str, float]) -> None:
        if self.queue.size:
            self.settle()
        while len(self.running) < self.slots and self.queue.size:
            ticket = self.queue.next(float(step))
            assert ticket is not None
            self.queue.dispatched(ticket)
            request = self.waiting.pop(ticket)
            self.running.append(request)
            served[request.tenant] += W_IN * request.input_tokens


@dataclass(frozen=True)
class Sync:
    """What one sync sends (``SharedService``'s script arguments), kept to be run again."""

    source: int
    sent: dict[str, float]
    answered: dict[str, float]
    floors: dict[str, float]


def outgoing(shared: SharedCounters) -> Sync:
    sent = shared.outgoing()
    return Sync(id(shared), sent, dict(shared.answered), dict(shared.floors))


@dataclass
class Store:
    """The script, in Python: each key's total, and each instance's record (the largest service
    taken from it for each key, the answered value standing in for a record it lacks)."""

    totals: dict[str, float] = field(default_factory=dict)
    records: dict[int, dict[str, float]] = field(default_factory=dict)

    def take(self, sync: Sync) -> dict[str, float]:
        """Only what the record has not taken added, floors kept, every total answered."""
        record = self.records.setdefault(sync.source, {})
        for key in sync.sent.keys() | sync.floors.keys():
            taken = record.get(key, sync.answered.get(key, 0.0))
            sent = sync.sent.get(key, sync.answered.get(key, 0.0))
            if sent > taken:
                self.totals[key] = self.totals.get(key, 0.0) + sent - taken
                record[key] = sent
            self.totals[key] = max(self.totals.get(key, 0.0), sync.floors.get(key, 0.0))
        return dict(self.totals)


def sync_out(instance: Instance, store: Store, step: int, lag: int) -> Sync:
    instance.settle()
    sync = outgoing(instance.shared)
    instance.answer = (step + lag, store.take(sync))
    return sync


def staleness(instances: list[Instance], period: int, lag: int) -> float:
    """``Δ_12 + Δ_21`` (the module's docstring)."""
    total = 0.0
    for j, decider in enumerate(instances):
        for i, other in enumerate(instances):
            if i != j:
                gap = (decider.phase - other.phase) % period
                window = period - 1 + lag + gap
                total += window * other.slots * (W_OUT + W_IN * L_IN)
    return total


def bound(instances: list[Instance], period: int, lag: int) -> tuple[float, float]:
    """(the single-instance bound for all the slots, the staleness term)."""
    slots = sum(instance.slots for instance in instances)
    single = vtc_bound(W_IN, L_IN, W_OUT, slots * (L_IN + OUT_MAX))
    return single, staleness(instances, period, lag)


def simulate(
    instances: list[Instance],
    sends: dict[str, list[int]],
    *,
    period: int | None,
    lag: int = 1,
    steps: int = 3000,
    joins: dict[str, int] | None = None,
    seed: int = 0,
    store: Store | None = None,
    lost: float = 0.0,
) -> tuple[dict[str, float], float]:
    """Run ``steps`` steps. ``sends[key]`` lists the instances ``key`` keeps backlogged (at
    least twice their slots waiting) from step ``joins[key]`` (0 by default) on. ``period``
    None: no sharing. ``lost``: the chance that the store takes a sync but its answer never
    comes back (the client gave up), and, apart, that a sync runs in the store once more,
    within two periods (late, perhaps after a newer one). The service each key got, and the
    largest difference between a's and b's service over any interval after both have joined:
    ``max D - min D``, D = a - b."""
    assert period is None or 1 <= lag < period
    rng = random.Random(seed)
    losses = random.Random(seed + 1)
    joins = joins or {}
    store = store if store is not None else Store()
    replays: list[tuple[int, Sync]] = []
    served = {key: 0.0 for key in sends}
    start = max(joins.get(key, 0) for key in sends)
    highest, lowest = -float("inf"), float("inf")
    for step in range(steps):
        for instance in instances:
            if instance.answer is not None and instance.answer[0] <= step:
                instance.shared.incoming(instance.answer[1])
                instance.answer = None
        for instance in instances:
            instance.emit(served)
        for key, where in sends.items():
            if step < joins.get(key, 0):
                continue
            for index in where:
                instance = instances[index]
                while instance.backlog(key) < 2 * instance.slots:
                    ticket = Ticket(key, input_tokens=rng.randint(1, L_IN), arrived=step)
                    output = rng.randint(OUT_MIN, OUT_MAX)
                    instance.add(Request(key, ticket.input_tokens, output, ticket))
        for instance in instances:
            instance.dispatch(step, served)
        if period is not None:
            for due, sync in replays:
                if due == step:
                    store.take(sync)
            for instance in instances:
                if step % period == instance.phase:
                    sync = sync_out(instance, store, step, lag)
                    if lost and losses.random() < lost:
                        instance.answer = None
                    if lost and losses.random() < lost:
                        replays.append((step + losses.randint(1, 2 * period), sync))
        if step >= start:
            difference = served["a"] - served["b"]
            highest, lowest = max(highest, difference), min(lowest, difference)
    return served, highest - lowest


# The figures the report quotes: (scenario, sharing) -> (measured, bound).
FIGURES: dict[tuple[str, str], tuple[float, float]] = {}


def test_a_key_flooding_one_instance_is_behind_on_the_other_within_the_bound() -> None:
    """a floods instance 1 (S slots, no one else there) and instance 2 (2S slots); b floods
    instance 2 only. With the counters shared, instance 2 sees what a got on instance 1 and
    serves b until b has caught up: the service difference between a and b over any interval
    stays within the bound. Without sharing, instance 2 splits its slots as if a had had
    nothing, and a gets twice what b gets: the difference grows without end, past the bound.

    Why it holds. Let ``D = c_a - c_b`` (service received, both backlogged throughout;
    instance 2 decides with ``v_b = c_b`` exactly, b being served only there, and
    ``v_a = c_a - u_a``, ``0 <= u_a <= Δ_12``, what instance 1 served that it has not heard of).
    *a ahead:* at instance 2's last dispatch of a, ``v_a <= v_b``, so ``D <= Δ_12``. After it a
    gains that request's input (``<= w_in L_in``), its requests running on instance 2
    (``<= w_out * 2S * OUT_MAX``), and instance 1's service, ``<= S (2 w_out τ + w_in L_in)``
    in τ steps (a slot starts a request at most every ``OUT_MIN`` steps, whose input costs at
    most ``w_out * OUT_MIN``); b gains ``>= w_out * 2S * (τ - OUT_MAX)`` (a's requests there
    end within ``OUT_MAX`` steps, then every slot is b's). So ``D <= Δ_12 + (S+1) w_in L_in +
    4S w_out OUT_MAX``. *b ahead:* at instance 2's last dispatch of b, ``c_b <= c_a - u_a <=
    c_a``; after it b gains ``<= w_in L_in + w_out * 2S * OUT_MAX``. The difference over any
    interval is at most the sum: ``Δ_12 + (S+2) w_in L_in + 6S w_out OUT_MAX``, within
    ``vtc_bound(w_in, L_in, w_out, 3S (L_in + OUT_MAX)) + Δ_12 + Δ_21``."""
    slots = 4
    for period, lag, phases in ((5, 1, (0, 0)), (5, 2, (0, 4)), (8, 3, (3, 0))):
        for seed in range(3):
            instances = [Instance(slots, phases[0]), Instance(2 * slots, phases[1])]
            single, stale = bound(instances, period, lag)
            served, worst = simulate(
                instances, {"a": [0, 1], "b": [1]}, period=period, lag=lag, seed=seed
            )
            assert worst <= single + stale, (period, lag, phases, seed, worst, single, stale)
            # The two got about the same: a a third of instance 2, b the rest.
            assert abs(served["a"] / served["b"] - 1) < 0.02, served
            FIGURES[("flood", f"P={period} lag={lag} phases={phases} seed={seed}")] = (
                worst,
                single + stale,
            )
    instances = [Instance(slots, 0), Instance(2 * slots, 0)]
    single, stale = bound(instances, 5, 1)
    served, worst = simulate(instances, {"a": [0, 1], "b": [1]}, period=None)
    FIGURES[("flood", "no sharing")] = (worst, single + stale)
    assert worst > single + stale, (worst, single, stale)
    assert served["a"] / served["b"] > 1.8, served


def test_a_key_returning_on_both_instances_is_lifted_once() -> None:
    """a floods both instances alone for a while; then b floods both too. Each instance lifts b
    to the counter a has there (idle time is not banked), and the store keeps the larger lift:
    a lift is a floor, not service. Were it sent as an increment, the store would hold b lifted
    twice (once per instance), a's counter ahead of a by a's whole past service, and a would
    be served alone until it caught up.

    Why it holds (both keys backlogged on both instances from b's arrival). *a ahead:* at a's
    last dispatch, on instance j, ``c_a - u_a <= c_b - u_b``, so ``D <= u_a <= Δ_ij``; after
    it a gains at most one input and what its running requests put out,
    ``w_in L_in + w_out * 3S * OUT_MAX``. *b ahead:* the same with a and b swapped, and ``Δ_ji``
    (b's lift, from a stale view, puts it at most that far below a, and the store's floor keeps
    the larger lift). The difference over any interval: within
    ``vtc_bound(w_in, L_in, w_out, 3S (L_in + OUT_MAX)) + Δ_12 + Δ_21``."""
    slots = 4
    for period, lag, phases in ((5, 1, (0, 0)), (5, 2, (0, 3))):
        instances = [Instance(slots, phases[0]), Instance(2 * slots, phases[1])]
        single, stale = bound(instances, period, lag)
        _, worst = simulate(
            instances,
            {"a": [0, 1], "b": [0, 1]},
            period=period,
            lag=lag,
            joins={"b": 1500},
        )
        FIGURES[("return", f"P={period} lag={lag} phases={phases}")] = (worst, single + stale)
        assert worst <= single + stale, (period, lag, phases, worst, single, stale)


# -- a sync taken twice, or late ------------------------------------------------------------


def test_a_sync_taken_but_never_answered_counts_once_and_a_late_one_adds_nothing() -> None:
    """The client gives up on a sync (``[limits] timeout``) that the store still takes: the
    next sync carries the same service again, grown, and the store adds only what it had not
    taken. That sync, or the one before, run again (late, after the newer one) adds nothing:
    the key's total is its real service, not twice it."""
    queue = FairQueue(SETTINGS)
    shared = SharedCounters(queue)
    store = Store({"b": 1000.0})  # another instance served b
    queue.charge("a", 1.0, input_tokens=30)
    first = outgoing(shared)
    store.take(first)  # its answer lost
    queue.charge("a", 1.0, input_tokens=5)
    second = outgoing(shared)
    shared.incoming(store.take(second))
    assert store.totals == {"a": 35.0, "b": 1000.0} and queue.served == {"a": 35.0}
    assert queue.counters == {"a": 35.0, "b": 1000.0}
    for late in (first, second, first):
        store.take(late)
    assert store.totals == {"a": 35.0, "b": 1000.0}
    # What came after goes with the next sync, once.
    queue.charge("a", 1.0, input_tokens=1)
    shared.incoming(store.take(outgoing(shared)))
    assert store.totals == {"a": 36.0, "b": 1000.0}
    assert queue.counters == {"a": 36.0, "b": 1000.0}


def test_a_store_without_the_instances_record_counts_only_what_came_since_the_answer() -> None:
    """The store dropped the instance's record (silent past its lifetime): the service last
    answered stands in for it, and the instance's past is not added again. A store that lost
    everything (Redis restarted empty) gets the totals back from the floors: the counter here is
    above the store's answer, and goes as a floor at the next sync."""
    queue = FairQueue(SETTINGS)
    shared = SharedCounters(queue)
    store = Store()
    queue.charge("a", 1.0, input_tokens=30)
    shared.incoming(store.take(outgoing(shared)))
    store.records.clear()
    queue.charge("a", 1.0, input_tokens=5)
    shared.incoming(store.take(outgoing(shared)))
    assert store.totals == {"a": 35.0}
    restarted = Store()
    shared.incoming(restarted.take(outgoing(shared)))
    assert restarted.totals == {} and queue.counters == {"a": 35.0}
    shared.incoming(restarted.take(outgoing(shared)))
    assert restarted.totals == {"a": 35.0}
    queue.charge("a", 1.0, input_tokens=1)
    shared.incoming(restarted.take(outgoing(shared)))
    assert restarted.totals == {"a": 36.0} and queue.counters == {"a": 36.0}


def test_with_answers_lost_and_syncs_run_again_each_total_is_the_real_service() -> None:
    """The flood of the first test, with a third of the answers lost after the store took the
    sync and a third of the syncs run once more, late: at the end (one clean sync each) every
    key's total in the store is what both instances served it, and the two keys still got
    about the same."""
    for seed in range(3):
        instances = [Instance(4, 0), Instance(8, 2)]
        store = Store()
        served, _ = simulate(
            instances,
            {"a": [0, 1], "b": [1]},
            period=5,
            lag=1,
            seed=seed,
            store=store,
            lost=0.33,
        )
        for instance in instances:
            sync_out(instance, store, 0, 0)
        assert store.totals == pytest.approx(served), (seed, store.totals, served)
        assert abs(served["a"] / served["b"] - 1) < 0.05, served


@dataclass
class ForgettingStore(Store):
    """:class:`Store` that also forgets, as the script does: a total unchanged for ``idle``
    (on the store's clock) whose last change every instance has heard (an answer at or after
    it), and then each instance's record of what it no longer holds."""

    idle: float = 5.0
    now: float = 0.0
    changed: dict[str, float] = field(default_factory=dict)
    heard: dict[int, float] = field(default_factory=dict)

    def forgetting(self, sync: Sync, heard: float) -> tuple[dict[str, float], float | None]:
        known = sync.source in self.heard
        before = dict(self.totals)
        self.take(sync)
        for key, total in self.totals.items():
            if before.get(key) != total:
                self.changed[key] = self.now
        self.heard[sync.source] = heard
        oldest = min(self.heard.values())
        for key in [k for k, at in self.changed.items() if self.now - at > self.idle]:
            if self.changed[key] <= oldest:
                del self.totals[key], self.changed[key]
        record = self.records[sync.source]
        for key in [key for key in record if key not in self.totals]:
            del record[key]
        return dict(self.totals), self.now if known else None


def test_idle_keys_leave_the_store_and_nothing_is_counted_twice_or_lost() -> None:
    """Two instances, on a virtual clock: 200 subjects served once on the first, then idle;
    key ``a`` served on both at every step. The subjects leave the store and both instances'
    records once both have heard their last totals, the first instance's queue forgets them
    (nothing pins them), and ``a``'s total stays its whole service. A subject's service charged
    between a sync's going out and its answer (the answer that lets it go) is counted, once;
    so is what subjects get when they come back, to the instance that still holds their
    counters: their totals are what they would be had nothing been forgotten."""
    store = ForgettingStore()
    queues = [FairQueue(SETTINGS), FairQueue(SETTINGS)]
    shared = [SharedCounters(queue) for queue in queues]
    truth: dict[str, float] = {}

    def serve(i: int, tenant: str, tokens: int) -> None:
        # Charged, not dispatched: no lift, so that each total is its service alone.
        queues[i].charge(tenant, 1.0, input_tokens=tokens)
        truth[tenant] = truth.get(tenant, 0.0) + tokens

    def sync(i: int, charged_meanwhile: str | None = None) -> None:
        sent = outgoing(shared[i])
        totals, at = store.forgetting(sent, shared[i].heard)
        if charged_meanwhile is not None:
            serve(i, charged_meanwhile, 3)
        shared[i].incoming(totals, at=at)

    for n in range(200):
        serve(0, f"sub{n}", 1)
    for step in range(20):
        store.now = float(step)
        serve(0, "a", 5)
        serve(1, "a", 7)
        # At step 6 the subjects leave (idle past 5, heard by both since step 1): sub0's
        # service charged while that sync was out is sent with the next.
        sync(0, "sub0" if step == 6 else None)
        sync(1)
        if step == 7:
            assert store.totals["sub0"] == 3.0 and "sub1" not in store.totals
    assert store.totals == {"a": truth["a"]}
    assert all(set(record) == {"a"} for record in store.records.values())
    # The floor: the counter of the last dispatched, a's.
    queues[0].dispatched(Ticket("a"))
    assert queues[0].forget_idle() == 200
    assert set(queues[0].counters) == set(queues[0].served) == {"a"}
    assert not any(shared[1].holds(f"sub{n}") for n in range(200))
    # They come back, on the other instance: what they get now is counted, once.
    for n in range(5):
        serve(1, f"sub{n}", 2)
    for step in range(20, 23):
        store.now = float(step)
        sync(0)
        sync(1)
    # The other instance still holds their counters (heard, at or above its floor of 0): the
    # store gets them back as floors, their totals as if never forgotten.
    assert store.totals == {
        key: truth[key] for key in ("a", "sub0", "sub1", "sub2", "sub3", "sub4")
    }
