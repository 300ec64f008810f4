"""Replica choice and replica health, sans-IO: every decision is a pure step over state and the
time it is given, so it is tested without sockets or clocks.

- Least outstanding requests wins; ties go to the replica picked longest ago.
- Passive health: ``failure_threshold`` consecutive failures eject a replica for
  ``ejection_seconds``. After that it is *half-open*: one request (a probe) may try it; success
  brings it back, failure ejects it again.
- Active health checks report through the same two calls, ``success`` and ``failure``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class HealthPolicy:
    failure_threshold: int = 3
    ejection_seconds: float = 10.0


@dataclass(eq=False)
class ReplicaLoad:
    """What the router knows about one replica. Mutated only by the backend that owns it."""

    url: str
    in_flight: int = 0
    # Monotonic counter of the last time this replica was picked: equal loads go to the one
    # picked longest ago, so idle replicas share work instead of the first one taking it all.
    last_pick: int = field(default=0)
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    # A half-open replica admits one probe at a time.
    probing: bool = False

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def half_open(self, now: float) -> bool:
        return self.ejected_until > 0 and not self.ejected(now)

    def healthy(self) -> bool:
        return self.ejected_until == 0


class LeastBusyRouter:
    __slots__ = ("_picks", "policy")

    def __init__(self, policy: HealthPolicy | None = None) -> None:
        self._picks = 0
        self.policy = policy or HealthPolicy()

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        exclude: Collection[ReplicaLoad] = (),
        now: float = 0.0,
    ) -> ReplicaLoad | None:
        """The replica to try next: a half-open replica as its one probe, else the least busy
        healthy one; None when every candidate is excluded, ejected, or being probed."""
        best: ReplicaLoad | None = None
        probe: ReplicaLoad | None = None
        for replica in replicas:
            if replica in exclude:
                continue
            if replica.healthy():
                if best is None or (replica.in_flight, replica.last_pick) < (
                    best.in_flight,
                    best.last_pick,
                ):
                    best = replica
            elif (
                replica.half_open(now)
                and not replica.probing
                and (probe is None or replica.ejected_until < probe.ejected_until)
            ):
                probe = replica
        # A half-open replica gets the next request as its probe (one at a time); without
        # that, a replica would never come back while any other is healthy.
        chosen = probe or best
        if chosen is not None:
            if chosen is probe:
                chosen.probing = True
            self._picks += 1
            chosen.last_pick = self._picks
        return chosen

    def success(self, replica: ReplicaLoad) -> None:
        replica.consecutive_failures = 0
        replica.ejected_until = 0.0
        replica.probing = False

    def failure(self, replica: ReplicaLoad, now: float) -> None:
        replica.consecutive_failures += 1
        if replica.probing or replica.consecutive_failures >= self.policy.failure_threshold:
            replica.ejected_until = now + self.policy.ejection_seconds
        replica.probing = False

    def release_probe(self, replica: ReplicaLoad) -> None:
        """A probe that ended without a verdict (the client left): let another request try."""
        replica.probing = False

    def next_recovery(self, replicas: Sequence[ReplicaLoad], now: float) -> float:
        """Seconds until some ejected replica may be probed (for Retry-After)."""
        waits = [r.ejected_until - now for r in replicas if r.ejected(now)]
        return max(0.0, min(waits)) if waits else 0.0 if replicas else math.inf
