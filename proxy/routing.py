"""Replica choice, sans-IO: least outstanding requests, ties broken round-robin."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class ReplicaLoad:
    """What the router knows about one replica. Mutated only by the backend that owns it."""

    url: str
    in_flight: int = 0
    # Monotonic counter of the last time this replica was picked: equal loads go to the one
    # picked longest ago, so idle replicas share work instead of the first one taking it all.
    last_pick: int = field(default=0)


class LeastBusyRouter:
    __slots__ = ("_picks",)

    def __init__(self) -> None:
        self._picks = 0

    def choose(
        self, replicas: Sequence[ReplicaLoad], exclude: Collection[ReplicaLoad] = ()
    ) -> ReplicaLoad | None:
        """The replica to try next, or None when every replica has been tried already."""
        best: ReplicaLoad | None = None
        for replica in replicas:
            if replica in exclude:
                continue
            if best is None or (replica.in_flight, replica.last_pick) < (
                best.in_flight,
                best.last_pick,
            ):
                best = replica
        if best is not None:
            self._picks += 1
            best.last_pick = self._picks
        return best
