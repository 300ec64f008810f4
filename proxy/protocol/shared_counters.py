"""The fair scheduler's counters shared between instances through a store (Redis), sans-IO:
the arithmetic of one sync. The I/O (the script, its bounds) is ``proxy/api/shared_service.py``'s.

The contract with the store, so that a sync taken twice (a script that ran although the client
had given up on it, then sent again) or late (after a newer one) counts once:

- An instance sends, for each key whose service here changed since the last sync the store
  answered, its absolute service here so far (``FairQueue.served``, which only grows), and
  with it the value sent in that answered sync (what the store took from it for sure).
- The store keeps, per instance, the largest service it took from it for each key (its
  *record*), and adds to the key's total only what a sent value exceeds the record by; the
  record becomes the larger of the two. The same sync again, or an older one, adds nothing.
- With no record of the key (a store that has never heard of this instance, that dropped the
  record of an instance long silent, or that restarted empty), the value the instance says
  was answered stands in for it: only what came since is added, never the instance's whole
  past again. What can still count twice is what syncs the store took without answering
  carried beyond that value, when the store then loses their record.
- A floor (:attr:`SharedCounters.floors`) raises a key's total to at least it, never adds to
  it; then the store answers every key's total.

**Forgetting idle keys** (a key per subject makes many). The store forgets a key's total, and
then each instance's record of it, once the total has not changed for a stated time and every
live instance (one whose record lives) has heard an answer given at or after its last change
(each sync says when it last heard one: :attr:`SharedCounters.heard`). That loses nothing:

- every live instance holds, as its counter for the key, at least that last total (an answer
  sets each counter to at least its total), and keeps it until its queue forgets the key by
  the local rule (``proxy/protocol/scheduling.py``: not waiting, not running, at or below the
  floor it would be lifted to on returning), which loses nothing by itself;
- an instance's record of the key goes in the same script that answers it without the key
  (or, that answer lost, the next one sends the key with the value answered, which stands in
  for the record), so its service for the key restarts here from what the store has not
  taken, and nothing is counted twice or lost;
- a sync that carries service or a floor for the key changes its total in the same atomic
  script: it is never forgotten then, and a key returning to the store after it was forgotten
  starts from what is sent then (a lift here is sent as a floor).

What the store no longer tells is only what an instance starting later would have learnt:
it lifts the key, on its return, to its own floor, as it does any key it never heard of.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.protocol.scheduling import FairQueue


class SharedCounters:
    """The keys' counters shared between instances (through a store, such as Redis): the
    arithmetic, sans-IO. Each sync sends each key's absolute service here (:meth:`outgoing`)
    with the value the store last answered for (:attr:`answered`), and the counter of each key
    lifted here since (:attr:`floors`); the store adds what it had not taken from this instance
    yet (the module's docstring), raises each total to at least its floor, and answers every
    key's total, which becomes the counter here, plus what was added here meanwhile
    (:meth:`incoming`). A key flooding one instance is behind on every other, as of the last
    sync.

    A lift is a floor, never an increment: two instances that lift one key (it returns to both)
    each to about the same counter would otherwise lift it twice in the store, and the key
    would wait behind every other key's whole past service. Counters never go back: a store
    that has lost its totals (Redis restarted) gets them again from the floors of the next
    syncs, since a counter here above the store's total is sent as one."""

    def __init__(self, queue: FairQueue) -> None:
        self._queue = queue
        # Each key's total as the store last answered (a key it did not answer: 0).
        self._base: dict[str, float] = {}
        # Each key's service here (FairQueue.served) when outgoing() last read it.
        self._sent: dict[str, float] = {}
        # Each key's service here as sent with the last sync the store answered: what the store
        # took from this instance for sure.
        self.answered: dict[str, float] = {}
        # The keys lifted here beyond the store's total, each with its counter: read with
        # outgoing()'s totals.
        self.floors: dict[str, float] = {}
        # The store's clock at the last answer it gave knowing this instance (0: none yet):
        # sent with each sync, so that the store forgets no total this instance has not heard.
        self.heard = 0.0
        # The keys the store forgot while their counter stayed here, each with that counter
        # less the service not yet sent: what the store would hold for it (no floor is sent
        # for it unless it is lifted here again).
        self._quiet: dict[str, float] = {}
        # The queue forgets no key the store counts, nor one whose service it is yet to take:
        # a key's service here must only grow (the module's docstring).
        queue.pinned = self.holds

    def holds(self, key: str) -> bool:
        """Whether the store has, or is yet to get, ``key``'s service from this instance."""
        return key in self._queue.served or key in self._base

    def outgoing(self) -> dict[str, float]:
        """Each key's service here so far, for the keys whose service changed since the last
        sync the store answered (a sync that failed, or that the store took without answering,
        is covered by the next: the values only grow); :attr:`floors` is set with it."""
        served, answered, base = self._queue.served, self.answered, self._base
        counters, quiet = self._queue.counters, self._quiet
        for key in [key for key in quiet if key not in counters]:
            del quiet[key]
        self._sent = dict(served)
        totals = {key: value for key, value in served.items() if value != answered.get(key, 0.0)}
        # A counter above the store's total plus the service here since was lifted here, or the
        # store lost the total (beyond what summing in another order leaves over).
        self.floors = {
            key: value
            for key, value in counters.items()
            if value
            - base.get(key, quiet.get(key, 0.0))
            - (served.get(key, 0.0) - answered.get(key, 0.0))
            > 1e-9 * max(1.0, value)
        }
        return totals

    def incoming(self, shared: Mapping[str, float], *, at: float | None = None) -> None:
        """The store's totals (every key it holds) after it took :meth:`outgoing`'s values and
        floors. ``at``: the store's clock, when the store knew this instance before this sync;
        then a key it held at the last answer and holds no more was forgotten there (idle,
        with its last total heard everywhere: the module's docstring), and so is this
        instance's record of it. Here the key is let go of too: its counter stays until the
        queue forgets it by its own rule, its service here restarts from what the store has
        not taken, and no floor is sent for it unless it is lifted again. Without ``at`` (a
        store that lost everything, or that had dropped this instance), a key missing is a
        total lost: the floors of the next sync give it back."""
        counters, served, sent = self._queue.counters, self._queue.served, self._sent
        for key, total in shared.items():
            since = served.get(key, 0.0) - sent.get(key, 0.0)
            # A lift here meanwhile is kept, and so is a counter the store has lost.
            counters[key] = max(total + since, counters.get(key, 0.0))
            self._quiet.pop(key, None)
        if at is not None:
            self.heard = at
            for key in self._base.keys() - shared.keys():
                since = served.get(key, 0.0) - sent.pop(key, 0.0)
                if since > 0:
                    served[key] = since
                else:
                    served.pop(key, None)
                if key in counters:
                    self._quiet[key] = counters[key] - max(since, 0.0)
        self._base = dict(shared)
        self.answered = sent
        self.floors = {}
