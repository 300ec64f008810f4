"""The fair scheduler's counters shared between instances through a store (Redis), sans-IO:
the arithmetic of one sync. The I/O (the script, its bounds) is ``proxy/api/shared_service.py``'s.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.protocol.scheduling import FairQueue


class SharedCounters:
    """The keys' counters shared between instances (through a store, such as Redis): the
    arithmetic, sans-IO. Each sync sends the service each key received here since the last
    sync the store took (:meth:`outgoing`), and the counter of each key lifted here since
    (:attr:`floors`); the store adds the increments to its totals, raises each total to at least
    its floor, and answers every key's total, which becomes the counter here, plus what was added
    here meanwhile (:meth:`incoming`). A key flooding one instance is behind on every other, as
    of the last sync.

    A lift is a floor, never an increment: two instances that lift one key (it returns to both)
    each to about the same counter would otherwise lift it twice in the store, and the key
    would wait behind every other key's whole past service. Counters never go back: a store
    that has lost its totals (Redis restarted) gets them again from the floors of the next
    sync."""

    def __init__(self, queue: FairQueue) -> None:
        self._queue = queue
        # Each key's total as the store last said it.
        self._base: dict[str, float] = {}
        # Each key's service here (FairQueue.served) when the store last took it, and when
        # outgoing() last read it.
        self._served_base: dict[str, float] = {}
        self._served_sent: dict[str, float] = {}
        # The keys lifted here since the last sync the store took, each with its counter:
        # read with outgoing()'s increments.
        self.floors: dict[str, float] = {}

    def outgoing(self) -> dict[str, float]:
        """Each key's service here since the last sync that the store took (a sync that failed
        sends its increments again, with the later ones); :attr:`floors` is set with it."""
        served, served_base, base = self._queue.served, self._served_base, self._base
        self._served_sent = dict(served)
        increments = {
            key: value - served_base.get(key, 0.0)
            for key, value in served.items()
            if value != served_base.get(key, 0.0)
        }
        # A counter above the store's total plus the service here was lifted here (beyond
        # what summing in another order leaves over).
        self.floors = {
            key: value
            for key, value in self._queue.counters.items()
            if value - base.get(key, 0.0) - increments.get(key, 0.0) > 1e-9 * max(1.0, value)
        }
        return increments

    def incoming(self, shared: Mapping[str, float]) -> None:
        """The store's totals after it took :meth:`outgoing`'s increments and floors."""
        counters, served, sent = self._queue.counters, self._queue.served, self._served_sent
        for key, total in shared.items():
            since = served.get(key, 0.0) - sent.get(key, 0.0)
            # A lift here meanwhile is kept, and so is a counter the store has lost.
            counters[key] = max(total + since, counters.get(key, 0.0))
            self._base[key] = total
        self._served_base = sent
        self.floors = {}
