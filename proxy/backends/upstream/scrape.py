"""What the proxy learns of its replicas in the background: their metrics scraped for
``upstream_metrics`` routing, active health checks, and the start-up reachability report.

Each runs under the app's nursery, one task per replica, so a replica that hangs never delays
another's scrape or check.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import httpx
import trio

from proxy.backends.upstream.exchange import reason
from proxy.backends.upstream.replica import USER_AGENT, UpstreamReplica
from proxy.backends.upstream.routing import HealthPolicy, LeastBusyRouter, MetricsRouter
from proxy.backends.upstream.transports import health_client
from proxy.protocol.capacity import learn
from proxy.protocol.replica_metrics import (
    MetricsParseError,
    ReplicaMetrics,
    parse_replica_metrics,
)

log = logging.getLogger("sluice.upstream")

# A scrape's body is a few KiB (vLLM's: ~30 KiB with its histograms); bounded all the same.
_MAX_METRICS_BODY = 4 * 1024 * 1024


async def scrape_replicas(
    model: str,
    metrics_path: str,
    replicas: Sequence[UpstreamReplica],
    router: MetricsRouter,
    interval: float,
) -> None:
    """One scraper per replica, in a nursery of their own, each giving ``model``'s figures
    from ``metrics_path`` to ``router`` every ``interval``. Runs until cancelled."""

    async def scrape(client: httpx.AsyncClient, replica: UpstreamReplica) -> None:
        url = replica.root_url + metrics_path
        await _Scraper(model, client, router, replica, url).run(interval)

    await _each_replica(replicas, interval, scrape)


async def _each_replica(
    replicas: Sequence[UpstreamReplica],
    interval: float,
    task: Callable[[httpx.AsyncClient, UpstreamReplica], Awaitable[None]],
) -> None:
    """``task`` for every replica, each in a task of its own, with a client of its own: the
    replica's proxy, TLS and key (transports.health_client) over connections of its own, so
    that it never waits behind streams for a slot. Returns when every task has."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(health_client(replica.connection, interval))
            for replica in replicas
        ]
        async with trio.open_nursery() as nursery:
            for client, replica in zip(clients, replicas, strict=True):
                nursery.start_soon(task, client, replica)


class _Scraper:
    """One replica's scrapes for one model."""

    def __init__(
        self,
        model: str,
        client: httpx.AsyncClient,
        router: MetricsRouter,
        replica: UpstreamReplica,
        url: str,
    ) -> None:
        self.model = model
        self.client = client
        self.router = router
        self.replica = replica
        self.url = url

    async def run(self, interval: float) -> None:
        """Scrape forever, every ``interval``; each scrape bounded by the interval itself."""
        url = self.url
        failing = False
        while True:
            problem: str | None = "no answer within metrics_interval"
            with trio.move_on_after(interval):
                problem = await self.once()
            if problem is None:
                if failing:
                    log.info("model %s: scraping %s works again", self.model, url)
                failing = False
            else:
                self.router.failed(self.replica.load)
                self.replica.room.poke()  # its count in flight alone says now
                if not failing:
                    # Once per failing spell, not per scrape.
                    log.warning(
                        "model %s: scraping %s failed (%s); least_busy for that replica "
                        "until it answers",
                        self.model,
                        url,
                        problem,
                    )
                failing = True
            await trio.sleep(interval)

    async def once(self) -> str | None:
        """One scrape, its figures given to the router; what went wrong, or None."""
        replica = self.replica
        headers = {"User-Agent": USER_AGENT.decode(), "Accept": "text/plain"}
        if replica.authorization is not None:
            headers["Authorization"] = replica.authorization
        try:
            async with self.client.stream("GET", self.url, headers=headers) as response:
                if response.status_code != 200:
                    return f"HTTP {response.status_code}"
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > _MAX_METRICS_BODY:
                        return f"more than {_MAX_METRICS_BODY} bytes"
        except httpx.HTTPError as error:
            return f"{type(error).__name__}: {reason(error)}"
        try:
            metrics = parse_replica_metrics(body.decode("utf-8", "replace"), self.model)
        except MetricsParseError as error:
            return str(error)
        now = trio.current_time()
        self.router.observe(replica.load, metrics, now)
        self.learn(metrics, now)
        # Its own queue may have drained (or its capacity grown): what Sluice holds for it
        # may go now.
        replica.room.poke()
        return None

    def learn(self, metrics: ReplicaMetrics, now: float) -> None:
        """The replica's capacity after this scrape, where it is learned."""
        room = self.replica.room
        if room.learning is None:
            return
        before = room.learning
        after = room.learning = learn(
            before,
            running=metrics.running,
            waiting=metrics.waiting,
            in_flight=room.in_flight,
            now=now,
        )
        room.capacity = after.limit
        if after.queued_at != before.queued_at and after.limit < before.limit:
            log.info(
                "model %s: %s queues past %d running; it gets %d at most (was %d)",
                self.model,
                self.replica.url,
                after.edge,
                after.limit,
                before.limit,
            )


async def check_replicas(
    replicas: Sequence[UpstreamReplica], path: str, interval: float, policy: HealthPolicy
) -> None:
    """Active health checks, forever: GET ``path`` on every replica each ``interval``; a 200 is
    a success, anything else (or no answer within the interval) a failure. One task per
    replica, so a hanging replica never delays the others' checks. Runs under the app's
    nursery and ends with it."""
    router = LeastBusyRouter(policy)

    async def check(client: httpx.AsyncClient, replica: UpstreamReplica) -> None:
        await _check_replica(client, router, replica, path, interval)

    await _each_replica(replicas, interval, check)


async def _check_replica(
    client: httpx.AsyncClient,
    router: LeastBusyRouter,
    replica: UpstreamReplica,
    path: str,
    interval: float,
) -> None:
    while True:
        healthy = False
        with trio.move_on_after(interval):
            try:
                headers = {"User-Agent": USER_AGENT.decode()}
                if replica.authorization is not None:
                    headers["Authorization"] = replica.authorization
                response = await client.get(replica.root_url + path, headers=headers)
                healthy = response.status_code == 200
            except httpx.HTTPError:
                healthy = False
        if healthy:
            router.success(replica.load)
        else:
            router.failure(replica.load, trio.current_time())
        await trio.sleep(interval)


async def report_reachability(replicas: Sequence[UpstreamReplica], within: float) -> None:
    """One line per replica at start-up: whether its server (or, through a proxy, the proxy)
    accepts a TCP connection. Only said, never acted on: health is the router's and the
    checks' business. No request is sent, so that the upstream's logs (and its request
    counters) see nothing of it."""

    async def probe(replica: UpstreamReplica) -> None:
        proxy = replica.connection.proxy
        target = httpx.URL(proxy) if proxy else httpx.URL(replica.url)
        port = target.port or (443 if target.scheme == "https" else 80)
        where = f"upstream {replica.url} ({replica.connection.label})"
        hop = f"its proxy {target.host}:{port}" if proxy else f"{target.host}:{port}"
        with trio.move_on_after(within):
            try:
                stream = await trio.open_tcp_stream(target.host, port)
            except OSError as error:
                log.warning("%s: %s not reachable: %s", where, hop, error.strerror or error)
                return
            await trio.aclose_forcefully(stream)
            log.info("%s: %s reachable", where, hop)
            return
        log.warning("%s: %s not reachable within %gs", where, hop, within)

    async with trio.open_nursery() as nursery:
        for replica in replicas:
            nursery.start_soon(probe, replica)
