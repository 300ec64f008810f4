"""A replica's capacity learned from its own load gauges, sans-IO.

Sluice holds the queue: a request waits in Sluice's queue (fair, banded, with deadlines) rather
than in the engine's (first come, first served). For that it must dispatch to a replica no more
than the engine runs at once, and that number is the engine's (vLLM's ``max_num_seqs``, or
fewer when its KV cache fills first), not Sluice's to guess. With the engine's gauges scraped
(``running`` and ``waiting``: vLLM's ``num_requests_running`` and ``num_requests_waiting``), it
is learned instead, from where the engine starts to queue:

- The limit starts at ``start`` (the lowest engine default, so that nothing is sent past an
  engine left at its defaults).
- It grows by ``step`` only when a scrape proves the current one: the engine runs at least the
  limit, nothing waits in its queue, and this process is what holds requests back (its count in
  flight is at the limit), in a scrape taken at least ``settle`` seconds (one scrape interval)
  after the limit last changed, so that the requests the last growth let through are in it.
  ``step`` is how far past a proven limit the engine's queue may be pushed:
  ``max_upstream_waiting`` (at least 1), so a probe never queues more in the engine than that.
- A scrape with requests waiting in the engine and some running says where it queues: the limit
  comes down to what it runs (never up: requests of other clients may be in it), and that edge
  is remembered. Past the edge the limit grows again only after ``EDGE_HOLD`` scrape intervals
  without queueing, so that a fixed capacity is not probed at every scrape, and one that grew
  (a KV cache freed by shorter prompts) is found again.
- Never above ``upper`` (``max_connections`` when set, else ``LEARNED_CEILING``), never below 1.

:func:`learn` is the one step: a new :class:`Capacity` from the old and one scrape.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Where learning starts: vLLM's lowest max_num_seqs default (CPU), which was max_connections'
# fixed default before it was learned.
START = 128
# The limit's ceiling when max_connections is not set: above the largest engine default (vLLM
# 1,024 on the largest GPUs), so that it never binds in front of one.
LEARNED_CEILING = 4096
# Scrape intervals without queueing before the limit is pushed past where the engine last
# queued.
EDGE_HOLD = 30


@dataclass(frozen=True, slots=True)
class Capacity:
    """One replica's learned limit, and what learning it needs to remember."""

    # Requests this process dispatches to the replica at most, now.
    limit: int
    # The limit's ceiling (max_connections, or LEARNED_CEILING).
    upper: int
    # How much one growth adds (max_upstream_waiting, at least 1).
    step: int
    # Seconds after a change before a scrape can prove the new limit (the scrape interval).
    settle: float
    # The engine's running count when it was last seen to queue; None until it has been.
    edge: int | None = None
    # When the limit last changed, and when the engine last queued.
    changed_at: float = -math.inf
    queued_at: float = -math.inf


def start_capacity(
    upper: int, max_upstream_waiting: int, settle: float, start: int = START
) -> Capacity:
    """The state before any scrape: ``start`` (within ``upper``)."""
    if upper < 1 or not settle > 0:
        raise ValueError("upper must be at least 1 and settle over 0")
    return Capacity(
        limit=max(1, min(start, upper)),
        upper=upper,
        step=max(1, max_upstream_waiting),
        settle=settle,
    )


def learn(
    capacity: Capacity, *, running: float, waiting: float, in_flight: int, now: float
) -> Capacity:
    """The capacity after one scrape of the engine (``running`` and ``waiting``: every client's
    requests), with ``in_flight`` of this process's requests on it, at ``now``."""
    limit = capacity.limit
    if waiting > 0:
        if running < 1:
            # A queue with nothing running (an engine starting, or stuck): nothing learned.
            return capacity
        edge = max(1, math.floor(running))
        return dataclasses.replace(
            capacity,
            limit=min(limit, edge),
            edge=edge,
            changed_at=now if edge < limit else capacity.changed_at,
            queued_at=now,
        )
    proven = running >= limit and in_flight >= limit
    settled = now - capacity.changed_at >= capacity.settle
    if not (proven and settled) or limit >= capacity.upper:
        return capacity
    past_edge = capacity.edge is not None and limit >= capacity.edge
    if past_edge and now - capacity.queued_at < EDGE_HOLD * capacity.settle:
        return capacity
    return dataclasses.replace(
        capacity, limit=min(capacity.upper, limit + capacity.step), changed_at=now
    )


def bounded(capacity: Capacity, upper: int, max_upstream_waiting: int, settle: float) -> Capacity:
    """``capacity`` under new settings (a reload): what was learned kept, within ``upper``."""
    return dataclasses.replace(
        capacity,
        limit=max(1, min(capacity.limit, upper)),
        upper=upper,
        step=max(1, max_upstream_waiting),
        settle=settle,
    )
