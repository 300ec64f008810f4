"""Forgetting idle tenants' counters (proxy/protocol/scheduling.py, "Forgetting idle tenants"):
the floor ``m`` never goes down, a tenant forgotten at or below it comes back with the very
counter it would have had, and with a tenant per subject the counters stay bounded. Sans-IO,
with explicit steps: two queues driven by the same decisions, one forgetting after every step
and one never, compared after each."""

from __future__ import annotations

import random
from dataclasses import dataclass

from proxy.protocol.scheduling import FORGET_AT, FairQueue, Ticket
from proxy.protocol.shared_counters import SharedCounters


@dataclass
class Pair:
    """One request, as each of the two queues has it."""

    kept: Ticket
    forgetting: Ticket

    @property
    def tenant(self) -> str:
        return self.kept.tenant


def pair(tenant: str, band: int, weight: float, tokens: int) -> Pair:
    return Pair(
        Ticket(tenant, band, weight, input_tokens=tokens),
        Ticket(tenant, band, weight, input_tokens=tokens),
    )


def test_a_forgotten_tenant_comes_back_with_the_counter_it_would_have_had() -> None:
    """Random arrivals (two bands, weights), dispatches in the fair order and through free
    slots without waiting, output charged while requests run, clients leaving; 200 tenants,
    5,000 steps (821 forgotten, 800 of them back). The queue that forgets after every step has,
    for every tenant it keeps, the counter the queue that never forgets has; so every lift,
    every order between counters, every preemption's weighing is the same."""
    rng = random.Random(58)
    kept, forgetting = FairQueue(), FairQueue()
    waiting: list[Pair] = []
    running: list[Pair] = []
    floor = kept.floor
    forgotten = returned = 0
    absent: set[str] = set()
    for _ in range(5000):
        step = rng.random()
        tenant = f"batch\x1fs{rng.randrange(200)}"
        if step < 0.25:
            band = rng.choice((0, 0, 0, 5))
            request = pair(tenant, band, rng.choice((1.0, 2.0)), rng.randrange(50))
            waiting.append(request)
            kept.add(request.kept)
            forgetting.add(request.forgetting)
        elif step < 0.45 and waiting:
            # The fair order's choice (the queue that never forgets decides for both).
            chosen = kept.next(0.0)
            (request,) = [each for each in waiting if each.kept is chosen]
            waiting.remove(request)
            kept.dispatched(request.kept)
            forgetting.dispatched(request.forgetting)
            running.append(request)
        elif step < 0.5:
            # A free slot: dispatched without waiting.
            request = pair(tenant, rng.choice((0, 5)), 1.0, rng.randrange(50))
            kept.dispatched(request.kept)
            forgetting.dispatched(request.forgetting)
            running.append(request)
        elif step < 0.7 and running:
            request = rng.choice(running)
            tokens = rng.randrange(1, 30)
            for queue, ticket in ((kept, request.kept), (forgetting, request.forgetting)):
                queue.charge(ticket.tenant, ticket.weight, output_tokens=tokens)
        elif step < 0.97 and running:
            running.pop(rng.randrange(len(running)))
        elif waiting:
            request = waiting.pop(rng.randrange(len(waiting)))
            kept.remove(request.kept)
            forgetting.remove(request.forgetting)
        # m never goes down: no lift from here on is below it.
        assert kept.floor >= floor
        floor = kept.floor
        returned += len(absent & forgetting.counters.keys())
        forgotten += forgetting.forget_idle({request.tenant for request in running})
        absent = kept.counters.keys() - forgetting.counters.keys()
        for name, counter in forgetting.counters.items():
            assert counter == kept.counters[name], name
        for name in absent:
            assert kept.counters[name] <= forgetting.floor
        assert kept.floor == forgetting.floor
    # The test did forget, and forgotten tenants did come back.
    assert forgotten > 500
    assert returned > 500


def test_with_a_tenant_per_subject_the_counters_stay_bounded() -> None:
    """100,000 subjects of one key, a few requests each, some flooding: the queue keeps at
    most twice FORGET_AT tenants, not one per subject ever seen."""
    queue = FairQueue()
    rng = random.Random(7)
    most = 0
    for number in range(100_000):
        subject = f"batch\x1fs{number}"
        ticket = Ticket(subject, 0, 1.0, input_tokens=rng.randrange(10, 200))
        queue.add(ticket)
        if rng.random() < 0.1:
            queue.add(Ticket("batch\x1fflood", 0, 1.0, input_tokens=500))
        while queue.size > 3:
            chosen = queue.next(0.0)
            assert chosen is not None
            queue.dispatched(chosen)
            queue.charge(chosen.tenant, 1.0, output_tokens=rng.randrange(100))
            if queue.crowded:
                queue.forget_idle()
        most = max(most, len(queue.counters))
    assert most <= 2 * FORGET_AT
    assert len(queue.served) <= len(queue.counters)


def test_a_waiting_running_or_shared_tenant_is_never_forgotten() -> None:
    queue = FairQueue()
    for name in ("a", "b", "c"):
        queue.dispatched(Ticket(name, input_tokens=10))
    queue.add(Ticket("d", input_tokens=10))  # lifted to the last dispatched: the floor
    queue.charge("a", 1.0, output_tokens=100)  # above the floor: kept
    assert queue.forget_idle(busy={"b"}) == 1  # c alone
    assert sorted(queue.counters) == ["a", "b", "d"]
    # A store that shares the counters counts on each key's service here only growing.
    shared = FairQueue()
    SharedCounters(shared)
    shared.dispatched(Ticket("e", input_tokens=10))
    shared.dispatched(Ticket("f", input_tokens=10))
    assert shared.forget_idle() == 0
