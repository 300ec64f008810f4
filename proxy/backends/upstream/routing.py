"""Replica choice and replica health, sans-IO: every decision is a pure step over state and the
time it is given, so it is tested without sockets or clocks.

- Least outstanding requests wins; ties go to the replica picked longest ago.
- Passive health: ``failure_threshold`` consecutive failures eject a replica for
  ``ejection_seconds``. After that it is *half-open*: one request (a probe) may try it; success
  brings it back, failure ejects it again.
- Active health checks report through the same two calls, ``success`` and ``failure``.

Three ways to choose among the healthy replicas (a model's ``balance``); health, ejection and
half-open probes are the same for all three (:meth:`LeastBusyRouter.decide`):

- ``least_busy`` (:class:`LeastBusyRouter`): this process's in-flight count.
- ``upstream_metrics`` (:class:`MetricsRouter`): each replica's own scraped load,
  :func:`metrics_score`.
- ``prefix_affinity`` (:class:`AffinityRouter`): rendezvous hashing of the request's key,
  bounded by load, :func:`overloaded`.
- ``cache_aware`` (:class:`CacheAwareRouter`): the prompt's leading tokens each replica's KV
  cache holds (its vLLM KV events, indexed in :class:`~proxy.protocol.kv_cache.BlockIndex`,
  or, for a replica whose events are not known, what this process routed there, in a
  :class:`~proxy.protocol.kv_cache.RoutedIndex`) against its ``upstream_metrics`` load,
  :func:`~proxy.protocol.kv_cache.cache_aware_pick`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from proxy.protocol.affinity import overloaded, rendezvous_order
from proxy.protocol.kv_cache import (
    BlockIndex,
    RoutedIndex,
    block_keys,
    cache_aware_pick,
    events_complete,
    fresh_load,
    key_tokens,
)
from proxy.protocol.replica_metrics import ReplicaMetrics


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
    # What it last failed with (its error code and message): the 503 of a model whose every
    # replica is ejected says it, or an operator's mistake (a wrong key) would read as an outage.
    last_failure: str = ""
    # A half-open replica admits one probe at a time.
    probing: bool = False

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def half_open(self, now: float) -> bool:
        return self.ejected_until > 0 and not self.ejected(now)

    def healthy(self) -> bool:
        return self.ejected_until == 0


@dataclass(frozen=True, slots=True)
class Decision:
    """A replica chosen, and why (the routing metric's ``reason``): ``least_busy``,
    ``probe`` (a half-open replica's one request), ``metrics`` (by its scraped load),
    ``fallback`` (upstream_metrics without a fresh scrape of the chosen replica: its in-flight
    count), ``affinity_hit`` (the key's own replica), ``affinity_overflow`` (the key's replica
    was over the bound: the least loaded instead); cache_aware's ``cache`` (credited with the
    prompt tokens its KV events say it holds), ``cache_approx`` (credited with the prompt
    tokens this process routed there: its events are not known), ``load`` (none holds any,
    or the one holding them was over the bound) and ``fallback`` (the prompt's tokens
    unknown: by load). ``cached_fraction``: the
    share of the prompt's blocks the chosen replica holds, for cache_aware's choices made with
    the prompt's tokens."""

    replica: ReplicaLoad | None
    reason: str = "none"
    cached_fraction: float | None = None


class LeastBusyRouter:
    __slots__ = ("_picks", "policy")
    balance = "least_busy"

    def __init__(self, policy: HealthPolicy | None = None) -> None:
        self._picks = 0
        self.policy = policy or HealthPolicy()

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        exclude: Collection[ReplicaLoad] = (),
        now: float = 0.0,
        key: bytes = b"",
    ) -> ReplicaLoad | None:
        """The replica to try next: a half-open replica as its one probe, else the best
        healthy one by this router's balance; None when every candidate is excluded, ejected,
        or being probed."""
        return self.decide(replicas, exclude, now, key).replica

    def decide(
        self,
        replicas: Sequence[ReplicaLoad],
        exclude: Collection[ReplicaLoad] = (),
        now: float = 0.0,
        key: bytes = b"",
    ) -> Decision:
        """:meth:`choose`, with the reason."""
        healthy: list[ReplicaLoad] = []
        probe: ReplicaLoad | None = None
        for replica in replicas:
            if replica in exclude:
                continue
            if replica.healthy():
                healthy.append(replica)
            elif (
                replica.half_open(now)
                and not replica.probing
                and (probe is None or replica.ejected_until < probe.ejected_until)
            ):
                probe = replica
        # A half-open replica gets the next request as its probe (one at a time); without
        # that, a replica would never come back while any other is healthy.
        if probe is not None:
            probe.probing = True
            decision = Decision(probe, "probe")
        elif healthy:
            decision = self._pick(healthy, now, key)
        else:
            return Decision(None)
        chosen = decision.replica
        assert chosen is not None
        self._picks += 1
        chosen.last_pick = self._picks
        self._picked(chosen)
        return decision

    def _pick(self, healthy: Sequence[ReplicaLoad], now: float, key: bytes) -> Decision:
        return Decision(least_busy(healthy), "least_busy")

    def _picked(self, replica: ReplicaLoad) -> None:
        """After any choice (a probe too): what the balance counts."""

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


def least_busy(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    """Fewest in flight; equal loads to the replica picked longest ago."""
    return min(replicas, key=lambda r: (r.in_flight, r.last_pick))


# ----------------------------------------------------------------------------- upstream_metrics

# A request waiting in a replica's queue costs more than one running: it has not even started
# its prefill, and everything queued before it must finish first.
WAITING_WEIGHT = 4.0
# A scrape older than this many metrics_interval is stale: the replica is scored as least_busy.
STALE_INTERVALS = 3.0


@dataclass(eq=False, slots=True)
class Scrape:
    """What one replica's last scrape said, and what this process sent it since."""

    metrics: ReplicaMetrics | None = None
    at: float = -math.inf
    # Requests this process started on the replica since that scrape.
    started: int = 0
    # This process's requests in flight on the replica when it was scraped.
    ours: int = 0


def metrics_score(
    load: ReplicaLoad, scrape: Scrape | None, now: float, stale_after: float
) -> tuple[float, bool]:
    """A replica's load score for ``upstream_metrics`` (lower is better), and whether it came
    from a fresh scrape:

        WAITING_WEIGHT x waiting + running + min(started since the scrape, in_flight) + kv_usage

    ``waiting`` and ``running`` are the server's own gauges (every client's requests, every
    instance's); the requests this process started since the scrape (and still has in flight)
    are not in them yet, so a burst between two scrapes spreads instead of piling onto the
    replica that looked idle. KV cache usage (a fraction, 0 to 1) is worth at most one running
    request: it breaks ties toward the replica with room for more context, and penalises one
    close to preempting. With no scrape, a failed one, or one older than ``stale_after``
    seconds, the score is this process's in-flight count, as least_busy's."""
    if scrape is None or scrape.metrics is None or now - scrape.at > stale_after:
        return float(load.in_flight), False
    m = scrape.metrics
    recent = min(scrape.started, load.in_flight)
    return WAITING_WEIGHT * m.waiting + m.running + recent + m.kv_usage, True


class MetricsRouter(LeastBusyRouter):
    """``upstream_metrics``: the lowest :func:`metrics_score`, ties to the replica picked
    longest ago. The backend's scrapers report through :meth:`observe` and :meth:`failed`."""

    __slots__ = ("_scrapes", "stale_after")
    balance = "upstream_metrics"

    def __init__(self, policy: HealthPolicy | None = None, *, interval: float = 2.0) -> None:
        super().__init__(policy)
        self.stale_after = STALE_INTERVALS * interval
        self._scrapes: dict[ReplicaLoad, Scrape] = {}

    def scrape_of(self, replica: ReplicaLoad) -> Scrape:
        return self._scrapes.setdefault(replica, Scrape())

    def observe(self, replica: ReplicaLoad, metrics: ReplicaMetrics, now: float) -> None:
        scrape = self.scrape_of(replica)
        scrape.metrics, scrape.at, scrape.started = metrics, now, 0
        scrape.ours = replica.in_flight

    def failed(self, replica: ReplicaLoad) -> None:
        """A failed scrape: least_busy for this replica until the next good one."""
        scrape = self.scrape_of(replica)
        scrape.metrics, scrape.started = None, 0

    def score(self, replica: ReplicaLoad, now: float) -> tuple[float, bool]:
        return metrics_score(replica, self._scrapes.get(replica), now, self.stale_after)

    def waiting(self, replica: ReplicaLoad, now: float) -> float | None:
        """The replica's own queue (its requests waiting), as a fresh scrape says it; None
        with no fresh scrape (then only the count in flight says whether it has room)."""
        scrape = self._scrapes.get(replica)
        if scrape is None or scrape.metrics is None or now - scrape.at > self.stale_after:
            return None
        return scrape.metrics.waiting

    def _pick(self, healthy: Sequence[ReplicaLoad], now: float, key: bytes) -> Decision:
        scored = [(self.score(r, now), r.last_pick, i) for i, r in enumerate(healthy)]
        (_, fresh), _, index = min(scored, key=lambda item: (item[0][0], item[1]))
        return Decision(healthy[index], "metrics" if fresh else "fallback")

    def _picked(self, replica: ReplicaLoad) -> None:
        self.scrape_of(replica).started += 1


# ----------------------------------------------------------------------------- prefix_affinity


class AffinityRouter(LeastBusyRouter):
    """``prefix_affinity``: the key's replica by rendezvous hashing of the healthy candidates
    (so a retry, which excludes the one tried, goes to the key's next replica); when that one
    is :func:`overloaded` (by this process's in-flight counts), the least busy instead. A
    request with no key is least_busy's."""

    __slots__ = ("max_load",)
    balance = "prefix_affinity"

    def __init__(self, policy: HealthPolicy | None = None, *, max_load: float = 1.5) -> None:
        super().__init__(policy)
        self.max_load = max_load

    def _pick(self, healthy: Sequence[ReplicaLoad], now: float, key: bytes) -> Decision:
        if not key:
            return super()._pick(healthy, now, key)
        owner = healthy[rendezvous_order(key, [r.url for r in healthy])[0]]
        loads = [r.in_flight for r in healthy]
        if overloaded(owner.in_flight, loads, self.max_load):
            return Decision(least_busy(healthy), "affinity_overflow")
        return Decision(owner, "affinity_hit")


# ----------------------------------------------------------------------------- cache_aware


# With complete KV events, a prompt routed to a replica this recently is credited there even
# before its events tell of it: the engine stores its blocks only once they are prefilled
# (queued behind other prefills, seconds), and a request with the same prefix sent meanwhile
# would otherwise go elsewhere and cache the prefix twice.
PENDING_SECONDS = 5.0


class CacheAwareRouter(MetricsRouter):
    """``cache_aware``: each healthy candidate's load (:func:`metrics_score`: its scraped queue,
    or this process's in-flight count) against the prompt tokens its KV cache holds, by
    :func:`~proxy.protocol.kv_cache.cache_aware_pick`. The key is the prompt's token ids
    (:func:`~proxy.protocol.kv_cache.token_key`); with none (the prompt could not be tokenized
    in time, or its endpoint has no prompt) the choice is upstream_metrics', as ``fallback``.

    What a replica holds: its :class:`BlockIndex` (:meth:`index_of`), filled by its KV-event
    subscriber, once its events are complete
    (:func:`~proxy.protocol.kv_cache.events_complete`); what was routed there in the last
    ``PENDING_SECONDS`` (stored once prefilled) is pending, credited only where it is more
    than any candidate holds stored (``pending_tokens``). Before its events are
    complete, or for a replica that publishes none, the more of the events' and its whole
    :class:`RoutedIndex`, the prompts this router sent it (recorded at every choice made with
    the prompt's tokens): reason ``cache_approx`` when the guess decided."""

    __slots__ = (
        "_indexes",
        "_routed",
        "approx_block_size",
        "approx_max_blocks",
        "approx_ttl",
        "cache_weight",
        "max_blocks",
        "max_load",
    )
    balance = "cache_aware"

    def __init__(
        self,
        policy: HealthPolicy | None = None,
        *,
        interval: float = 2.0,
        cache_weight: float = 4.0,
        max_load: float = 1.5,
        max_blocks: int = 131072,
        approx_max_blocks: int = 32768,
        approx_ttl: float = 120.0,
        approx_block_size: int = 16,
    ) -> None:
        super().__init__(policy, interval=interval)
        self.cache_weight = cache_weight
        self.max_load = max_load
        self.max_blocks = max_blocks
        self.approx_max_blocks = approx_max_blocks
        self.approx_ttl = approx_ttl
        self.approx_block_size = approx_block_size
        self._indexes: dict[ReplicaLoad, BlockIndex] = {}
        self._routed: dict[ReplicaLoad, RoutedIndex] = {}

    def index_of(self, replica: ReplicaLoad) -> BlockIndex:
        """``replica``'s block index (made empty on first use)."""
        index = self._indexes.get(replica)
        if index is None:
            index = self._indexes[replica] = BlockIndex(self.max_blocks)
        return index

    def routed_of(self, replica: ReplicaLoad) -> RoutedIndex:
        """``replica``'s approximate index (made empty on first use)."""
        routed = self._routed.get(replica)
        if routed is None:
            routed = RoutedIndex(self.approx_max_blocks, self.approx_ttl, self.approx_block_size)
            self._routed[replica] = routed
        return routed

    def cached_blocks(self, replica: ReplicaLoad, keys_by_size: dict[int, list[bytes]]) -> int:
        """How many of the prompt's leading blocks ``replica``'s events say it holds, in its
        own block size."""
        index = self._indexes.get(replica)
        if index is None or index.block_size is None:
            return 0
        keys = keys_by_size.get(index.block_size)
        return 0 if keys is None else index.matched(keys)

    def load(self, replica: ReplicaLoad, now: float) -> float:
        """:func:`~proxy.protocol.kv_cache.fresh_load`: this process's count in flight, and
        the others' as a fresh scrape says (none without one)."""
        scrape = self._scrapes.get(replica)
        if scrape is None or scrape.metrics is None or now - scrape.at > self.stale_after:
            return float(replica.in_flight)
        m = scrape.metrics
        return fresh_load(replica.in_flight, scrape.ours, m.running, m.waiting)

    def _held(
        self, replica: ReplicaLoad, keys_by_size: dict[int, list[bytes]], now: float
    ) -> tuple[int, int, bool, int]:
        """(blocks of the prompt ``replica`` holds, their size, whether they are the routed
        index's guess, and the prompt's leading tokens routed there in the last
        ``PENDING_SECONDS``, which its complete events may not show yet: 0 without complete
        events, when the routed index's whole guess is weighed as held)."""
        index = self._indexes.get(replica)
        blocks = self.cached_blocks(replica, keys_by_size)
        size = 0 if index is None or index.block_size is None else index.block_size
        routed = self._routed.get(replica)
        if routed is None:
            return blocks, size, False, 0
        routed.expire(now)
        keys = keys_by_size[routed.block_size]
        if events_complete(index, now, self.approx_ttl):
            # Complete events still lag what was just routed: its blocks are stored only once
            # its prefill is done.
            recent = routed.matched(keys, now, PENDING_SECONDS)
            return blocks, size, False, recent * routed.block_size
        guess = routed.matched(keys, now)
        if guess * routed.block_size > blocks * size:
            return guess, routed.block_size, True, 0
        return blocks, size, False, 0

    def _pick(self, healthy: Sequence[ReplicaLoad], now: float, key: bytes) -> Decision:
        tokens = key_tokens(key)
        if not tokens:
            return Decision(super()._pick(healthy, now, key).replica, "fallback")
        # Equal scores to the replica picked longest ago.
        ordered = sorted(healthy, key=lambda r: r.last_pick)
        sizes = {self.approx_block_size} | {
            index.block_size
            for r in ordered
            if (index := self._indexes.get(r)) is not None and index.block_size is not None
        }
        keys_by_size = {size: block_keys(tokens, size) for size in sizes}
        held = [self._held(r, keys_by_size, now) for r in ordered]
        loads = [self.load(r, now) for r in ordered]
        cached = [blocks * size for blocks, size, _, _ in held]
        pick = cache_aware_pick(
            loads,
            cached,
            cache_weight=self.cache_weight,
            max_load=self.max_load,
            pending_tokens=[pending for _, _, _, pending in held],
        )
        chosen = ordered[pick.index]
        self.routed_of(chosen).routed(keys_by_size[self.approx_block_size], now)
        blocks, size, guessed, _ = held[pick.index]
        if pick.cached_tokens > cached[pick.index]:
            # Credited with what was just routed there: the routed index's.
            size = self.approx_block_size
            blocks, guessed = pick.cached_tokens // size, True
        total = len(keys_by_size.get(size, ())) if size else 0
        reason = "cache_approx" if pick.reason == "cache" and guessed else pick.reason
        return Decision(chosen, reason, blocks / total if total else 0.0)


def router_for(
    balance: str,
    policy: HealthPolicy | None = None,
    *,
    metrics_interval: float = 2.0,
    affinity_max_load: float = 1.5,
    cache_weight: float = 4.0,
    max_blocks: int = 131072,
    approx_max_blocks: int = 32768,
    approx_ttl: float = 120.0,
    approx_block_size: int = 16,
) -> LeastBusyRouter:
    """The router of a model's ``balance``."""
    if balance == "cache_aware":
        return CacheAwareRouter(
            policy,
            interval=metrics_interval,
            cache_weight=cache_weight,
            max_load=affinity_max_load,
            max_blocks=max_blocks,
            approx_max_blocks=approx_max_blocks,
            approx_ttl=approx_ttl,
            approx_block_size=approx_block_size,
        )
    if balance == "upstream_metrics":
        return MetricsRouter(policy, interval=metrics_interval)
    if balance == "prefix_affinity":
        return AffinityRouter(policy, max_load=affinity_max_load)
    if balance != "least_busy":
        raise ValueError(f"unknown balance {balance!r}")
    return LeastBusyRouter(policy)
