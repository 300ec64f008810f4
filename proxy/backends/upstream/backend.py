"""The upstream backend: one model relayed from an OpenAI-compatible server (vLLM,
llama.cpp, ...), composed once from the layers below it and holding no wire code.

Bottom to top: a :class:`~replica.UpstreamReplica` per server (its pool, load and health),
the :class:`~exchange.UpstreamExchange` (one attempt's bytes), an :class:`~retry.Attempt` (a
slot in Sluice's queue on a replica, and the replica's health verdict, around an exchange),
and :class:`~retry.Retry` or :class:`~hedge.Hedge` over attempts. Here: routing (which replica,
among those with room), the model's queue, the total deadline, and the background work
``balance`` needs (``scrape``; for ``cache_aware`` also ``kv_events``, one subscriber per
replica, and ``tokenize``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import trio

from proxy.backends.upstream.exchange import UpstreamExchange, upstream_error
from proxy.backends.upstream.hedge import Hedge
from proxy.backends.upstream.replica import (
    UpstreamReplica,
    public_name,
    routing_counter,
    start_slots,
)
from proxy.backends.upstream.retry import Attempt, Retry, RetryPolicy
from proxy.backends.upstream.routing import (
    CacheAwareRouter,
    HealthPolicy,
    LeastBusyRouter,
    MetricsRouter,
    ReplicaLoad,
    router_for,
)
from proxy.backends.upstream.scrape import scrape_replicas
from proxy.backends.upstream.tokenize import ReplicaTokenizer, Tokenizer
from proxy.backends.upstream.transports import health_client
from proxy.config import RelayConfig, UpstreamModel, key_of_account
from proxy.ops.metrics import Metrics
from proxy.protocol.affinity import affinity_key
from proxy.protocol.capacity import LEARNED_CEILING, bounded, start_capacity
from proxy.protocol.errors import UPSTREAM_ERROR, ApiError
from proxy.protocol.kv_cache import token_key
from proxy.protocol.openai import CompletionRequest
from proxy.protocol.scheduling import Ticket
from proxy.relay.admission import PAUSE_STOPS, Admission, Dispatcher
from proxy.relay.body import Sink


class UpstreamBackend:
    """Serves one model from one or more replicas, chosen by its ``balance``."""

    def __init__(
        self,
        model: UpstreamModel,
        replicas: Sequence[UpstreamReplica],
        relay: RelayConfig,
        *,
        dispatcher: Dispatcher | None = None,
        admission: Admission | None = None,
        api_key: str | None = None,
        policy: HealthPolicy | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"model {model.name!r} has no replicas")
        self.model = model
        self.replicas = list(replicas)
        self._loads = [replica.load for replica in self.replicas]
        self._router: LeastBusyRouter = router_for(
            model.balance,
            policy,
            metrics_interval=model.metrics_interval,
            affinity_max_load=model.affinity_max_load,
            cache_weight=model.kv_cache_weight,
            max_blocks=model.kv_index_max_blocks,
            approx_max_blocks=model.kv_approx_max_blocks,
            approx_ttl=model.kv_approx_ttl,
            approx_block_size=model.kv_block_size,
        )
        # cache_aware: where prompts are tokenized, while watch_replicas runs (until then,
        # and without it, requests are routed by load: "fallback").
        self.tokenizer: Tokenizer | None = None
        self._decisions = None if metrics is None else routing_counter(metrics)
        self._metrics = metrics
        if dispatcher is None:
            dispatcher = Dispatcher()
            for replica in self.replicas:
                dispatcher.room(replica.room)
        for replica in self.replicas:
            replica.room.full = partial(self._no_room, replica.load)
            # A request a backend of an earlier config dispatches here runs on this replica.
            replica.room.owner = replica
            self._bound_capacity(replica)
        # Sluice's queue for this model: its requests wait there, in the scheduler's order,
        # for a slot on one of its replicas (each replica's slots shared by every model it
        # serves), and are dispatched to the first with room. The process's (Scheduling),
        # the same across reloads, where one is given.
        rooms = [replica.room for replica in self.replicas]
        if admission is None:
            admission = Admission(
                model.name,
                dispatcher,
                max_queue=model.max_queue,
                queue_timeout=model.queue_timeout,
                rooms=rooms,
            )
        self.admission = admission
        admission.on_leave = None if metrics is None else self._left_queue
        if metrics is not None:
            # Read at scrape time, as the local model's.
            metrics.queue_depth.labels(model.name).set_function(lambda: self.queued)
            for replica in self.replicas:
                metrics.upstream_capacity.labels(model.name, replica.url).set_function(
                    partial(getattr, replica.room, "capacity")
                )
            self.admission.on_preempt = partial(metrics.paused, model.name, seconds=None)
            self.admission.on_resume = partial(metrics.paused, model.name)
        retry_policy = RetryPolicy(model.max_attempts)
        attempt = Attempt(
            UpstreamExchange(model, relay, api_key=api_key),
            self._router,
            self.admission,
            self.replicas,
            retry_policy,
            self._count_error,
            self._choose,
            # A hedged request has two exchanges at once: not one stream to pause.
            resumable=model.resumable and model.hedge_after == 0,
            no_replica=self._no_healthy_replica,
        )
        self._attempts: Retry | Hedge = (
            Hedge(
                attempt,
                retry_policy,
                model.hedge_after,
                self._no_healthy_replica,
                on_loser=self._hedge_lost,
            )
            if model.hedge_after > 0
            else Retry(attempt, retry_policy, len(self._loads), self._no_healthy_replica)
        )

    def _bound_capacity(self, replica: UpstreamReplica) -> None:
        """Whether ``replica``'s capacity is learned, and within what: with the engine's
        gauges scraped (a MetricsRouter), from where it starts to queue, under
        ``max_connections`` when set; otherwise ``max_connections`` (or its default) as set.
        What a room learned under an earlier config is kept, within the new bound."""
        model, room = self.model, replica.room
        if isinstance(self._router, MetricsRouter):
            upper = model.max_connections or LEARNED_CEILING
            room.learning = (
                start_capacity(
                    upper,
                    model.max_upstream_waiting,
                    model.metrics_interval,
                    start=start_slots(model.max_connections),
                )
                if room.learning is None
                else bounded(
                    room.learning, upper, model.max_upstream_waiting, model.metrics_interval
                )
            )
            if room.capacity != room.learning.limit:
                room.resize(room.learning.limit)
        elif room.learning is not None:
            room.learning = None
            room.resize(start_slots(model.max_connections))

    def _no_room(self, load: ReplicaLoad) -> bool:
        """Whether a replica has no room whatever its count in flight: ejected, probed by a
        request already (half-open: one at a time), or (upstream_metrics) with more waiting
        in its own queue, as its last scrape says, than ``max_upstream_waiting``."""
        now = trio.current_time()
        if load.ejected(now) or (load.half_open(now) and load.probing):
            return True
        router = self._router
        if isinstance(router, MetricsRouter):
            waiting = router.waiting(load, now)
            return waiting is not None and waiting > self.model.max_upstream_waiting
        return False

    async def watch_replicas(self) -> None:
        """Runs for the server's lifetime in the app's nursery: what this model's ``balance``
        needs in the background. ``upstream_metrics``: one scraper per replica, in a nursery
        of their own (a replica that hangs never delays another's scrape); ``least_busy`` and
        ``prefix_affinity`` need nothing, and it returns at once. ``cache_aware``: the scrapers
        (its load), a KV-event subscriber per replica that publishes events (the others are
        judged by what was routed there), and the tokenizer's client, in one nursery: when it
        is cancelled (shutdown, a reload) nothing of them is left."""
        router = self._router
        if not isinstance(router, MetricsRouter):
            return
        model = self.model
        if not isinstance(router, CacheAwareRouter):
            await scrape_replicas(
                model.name, model.metrics_path, self.replicas, router, model.metrics_interval
            )
            return
        # The replicas that publish events: by endpoint ("" for none), or all by port; each
        # with its replay socket, by endpoint ("" for the model's replay port, or none).
        publishing = [
            (replica, endpoint, replay)
            for replica, endpoint, replay in zip(
                self.replicas,
                model.kv_events_endpoints or ("",) * len(self.replicas),
                model.kv_events_replay_endpoints or ("",) * len(self.replicas),
                strict=True,
            )
            if endpoint or (model.kv_events_port and not model.kv_events_endpoints)
        ]
        timeout = model.kv_tokenize_timeout
        async with health_client(self.replicas[0].connection, timeout) as client:
            self.tokenizer = ReplicaTokenizer(client, self.replicas, model.upstream_model, timeout)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        scrape_replicas,
                        model.name,
                        model.metrics_path,
                        self.replicas,
                        router,
                        model.metrics_interval,
                    )
                    if publishing:
                        self._subscribe(nursery, router, publishing)
            finally:
                self.tokenizer = None

    def _subscribe(
        self,
        nursery: trio.Nursery,
        router: CacheAwareRouter,
        publishing: Sequence[tuple[UpstreamReplica, str, str]],
    ) -> None:
        """A KV-event subscriber for each replica in ``publishing`` (its endpoint, or "" for
        kv_events_port on its host; its replay endpoint, or "" for kv_events_replay_port)."""
        # Imported only by a model that subscribes: ZeroMQ is loaded for it alone.
        from proxy.backends.upstream.kv_events import (
            KvEventSubscriber,
            MetricsObserver,
            publisher_of,
        )

        model = self.model
        for replica, endpoint, replay in publishing:
            publisher = publisher_of(
                replica.root_url,
                model.kv_events_port,
                model.kv_events_replay_port,
                endpoint,
                replay,
            )
            observer = (
                None
                if self._metrics is None
                else MetricsObserver(self._metrics, model.name, replica.url)
            )
            subscriber = KvEventSubscriber(
                f"model {model.name}: upstream {replica.url}",
                publisher,
                router.index_of(replica.load),
                observer,
            )
            nursery.start_soon(subscriber.run)

    @property
    def queued(self) -> int:
        """This model's requests waiting in Sluice's queue for a slot on a replica."""
        return self.admission.waiting

    @property
    def router(self) -> LeastBusyRouter:
        return self._router

    def affinity_key(self, request: CompletionRequest) -> bytes:
        """The request's key for ``prefix_affinity`` (b"" for the other balances): the value
        of the model's ``affinity_header`` when the pipeline passed it on (``request.session``),
        else the prompt's first ``affinity_prefix_bytes``."""
        if self.model.balance != "prefix_affinity":
            return b""
        session = getattr(request, "session", "") if self.model.affinity_header else ""
        return affinity_key(request, self.model.affinity_prefix_bytes, session or "")

    async def route_key(self, request: CompletionRequest) -> tuple[bytes, bool]:
        """The key the router is given for ``request``, and whether its prompt's tokens are
        still to be learnt: ``cache_aware``'s is its prompt's token ids
        (:func:`~proxy.protocol.kv_cache.token_key`; b"" when they are not known in time), or
        at once those of the earlier turn its conversation began with, which begin its own
        (then its own are to be learnt); the others' is :meth:`affinity_key`."""
        if not isinstance(self._router, CacheAwareRouter):
            return self.affinity_key(request), False
        tokenizer = self.tokenizer
        if tokenizer is None:
            return b"", False
        recalled = tokenizer.recall(request)
        if recalled is not None:
            return recalled.key, not recalled.exact
        tokens = await tokenizer.tokens(request)
        return (b"" if tokens is None else token_key(tokens)), False

    async def produce(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
        key, learn = await self.route_key(request)
        tokenizer = self.tokenizer
        if not learn or tokenizer is None:
            await self._produce(request, request_id, sink, key)
            return
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            # Routed by an earlier turn's tokens: this turn's own, for the next one, are asked
            # beside the request, never past it (its client gone, or its answer ended).
            nursery.start_soon(tokenizer.tokens, request)
            try:
                await self._produce(request, request_id, sink, key)
            except Exception as error:  # noqa: BLE001 - re-raised below
                # Raised as itself, not inside the nursery's exception group.
                failure = error
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    def _choose(self, loads: Sequence[ReplicaLoad], key: bytes) -> ReplicaLoad | None:
        """The router's pick among replicas that have room now."""
        decision = self._router.decide(loads, (), trio.current_time(), key)
        if decision.replica is not None and self._metrics is not None:
            assert self._decisions is not None
            self._decisions.labels(self.model.name, self._router.balance, decision.reason).inc()
            if decision.cached_fraction is not None:
                self._metrics.route_cached_fraction.labels(self.model.name).observe(
                    decision.cached_fraction
                )
        return decision.replica

    async def _produce(
        self, request: CompletionRequest, request_id: str, sink: Sink, key: bytes
    ) -> None:
        with trio.move_on_after(self.model.total_timeout) as total:
            # The upstream's bound: a paused stream's wait for a slot again is not counted.
            stops = PAUSE_STOPS.set((*PAUSE_STOPS.get(), total))
            try:
                await self._attempts(request, request_id, sink, key)
            finally:
                PAUSE_STOPS.reset(stops)
            return
        error = upstream_error(
            504,
            "upstream_total_timeout",
            f"the upstream did not finish within total_timeout={self.model.total_timeout:g}s",
            retryable=False,
        )
        self._count_error(error)
        raise error

    def _count_error(self, error: ApiError) -> None:
        """Once per failed attempt (a retried one too), per total timeout, and per request
        that found no replica to try."""
        if self._metrics is not None:
            self._metrics.upstream_errors.labels(self.model.name, error.code or "error").inc()

    def _hedge_lost(self, request: CompletionRequest) -> None:
        if self._metrics is not None:
            schedule = request.schedule
            self._metrics.tokens_for_nobody.labels(
                key_of_account(schedule.tenant) or "-", self.model.name, "hedge_loser"
            ).inc(schedule.input_tokens)

    def _left_queue(self, ticket: Ticket, seconds: float, outcome: str) -> None:
        if self._metrics is not None:
            service = self.admission.dispatcher.queue.counters.get(ticket.tenant, 0.0)
            self._metrics.left_queue(self.model.name, ticket, seconds, outcome, "upstream", service)

    def _no_healthy_replica(self) -> ApiError:
        now = trio.current_time()
        wait = self._router.next_recovery(self._loads, now)
        failures = [
            f"{public_name(self.model.name, self.model.upstreams, load.url)} ({load.last_failure})"
            for load in self._loads
            if load.ejected(now) and load.last_failure
        ]
        said = f"; ejected after failing: {', '.join(failures)}" if failures else ""
        error = ApiError(
            503,
            f"no healthy upstream replica for model '{self.model.name}'{said}",
            type=UPSTREAM_ERROR,
            code="no_healthy_upstream",
            headers={"Retry-After": str(max(1, math.ceil(wait))) if wait < math.inf else "10"},
        )
        self._count_error(error)
        return error
