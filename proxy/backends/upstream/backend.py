"""The upstream backend: relay an OpenAI-compatible server (vLLM, llama.cpp, ...).

One :class:`UpstreamReplica` per base URL owns one connection pool (upstream_pool). Each request
runs inside the relay's nursery, so its ``async with replica.pool.stream(...)`` is inside the
request's cancel scope: when the client leaves, the stream is closed (the connection is
dropped, never pooled half-read) and the upstream server sees the disconnect and aborts the
generation.

Deadlines are trio cancel scopes, each with its own error: connect (httpx's connect timeout),
first token, idle between chunks, and total. Retries go to another replica and happen only
before anything has been sent to the client.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version
from typing import Any

import httpx
import trio
from prometheus_client import Counter

from proxy.backends.upstream.httpx_pool import HttpxPool
from proxy.backends.upstream.pool import KeepAlivePool, Origin, UpstreamRequest
from proxy.backends.upstream.routing import (
    HealthPolicy,
    LeastBusyRouter,
    MetricsRouter,
    ReplicaLoad,
    router_for,
)
from proxy.backends.upstream.transports import ConnectionSettings, Pool, Response, health_client
from proxy.config import RelayConfig, UpstreamConfig, UpstreamModel
from proxy.ops.metrics import Metrics
from proxy.protocol import anthropic, http1, responses
from proxy.protocol.affinity import affinity_key
from proxy.protocol.errors import UPSTREAM_ERROR, ApiError
from proxy.protocol.openai import NATIVE_ENDPOINTS, CompletionRequest, Endpoint
from proxy.protocol.replica_metrics import MetricsParseError, parse_replica_metrics
from proxy.protocol.sse import SSEProtocolError, SSESplitter, check_event, is_done
from proxy.relay.admission import Admission
from proxy.relay.body import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, Sink

log = logging.getLogger("sluice.upstream")

# Upstream error bodies are passed through to the client, so they are read, but bounded.
_MAX_ERROR_BODY = 64 * 1024
# Response headers of an upstream 4xx worth passing on to the client.
_PASSED_ERROR_HEADERS = ("retry-after",)
# The proxy's own queue refusing a request: not the replica's fault.
_QUEUE_REFUSALS = frozenset({"queue_full", "queue_timeout"})
# The most an idle deadline fires after idle_timeout (see _relay_stream).
_IDLE_SLACK = 1.0
USER_AGENT = f"sluice/{version('sluice')}".encode()
ANTHROPIC_VERSION = b"2023-06-01"
# What each endpoint's stream ends with, when it ends properly.
_STREAM_END: dict[Endpoint, Callable[[bytes], bool]] = {
    Endpoint.CHAT: is_done,
    Endpoint.COMPLETIONS: is_done,
    Endpoint.RESPONSES: responses.is_terminal_event,
    Endpoint.MESSAGES: anthropic.is_terminal_event,
}
# The Accept header, by endpoint and streaming: a pass-through takes whatever its server says.
_ACCEPT = {
    (endpoint, stream): (
        b"*/*"
        if endpoint is Endpoint.PASSTHROUGH
        else b"text/event-stream"
        if stream
        else b"application/json"
    )
    for endpoint in Endpoint
    for stream in (False, True)
}


# A scrape's body is a few KiB (vLLM's: ~30 KiB with its histograms); bounded all the same.
_MAX_METRICS_BODY = 4 * 1024 * 1024
# sluice_routing_decisions_total, one per app's registry (several backends share one Metrics).
_ROUTING_COUNTERS: weakref.WeakKeyDictionary[Metrics, Counter] = weakref.WeakKeyDictionary()


def routing_counter(metrics: Metrics) -> Counter:
    """``sluice_routing_decisions_total{model, balance, reason}`` in ``metrics``' registry:
    how each attempt's replica was chosen (see routing.Decision for the reasons)."""
    counter = _ROUTING_COUNTERS.get(metrics)
    if counter is None:
        counter = Counter(
            "sluice_routing_decisions_total",
            "Upstream replicas chosen, by model, balance and reason (least_busy, probe, "
            "metrics, fallback, affinity_hit, affinity_overflow).",
            ["model", "balance", "reason"],
            registry=metrics.registry,
        )
        _ROUTING_COUNTERS[metrics] = counter
    return counter


def upstream_error(status: int, code: str, message: str, *, retryable: bool) -> ApiError:
    return ApiError(status, message, type=UPSTREAM_ERROR, code=code, retryable=retryable)


class UpstreamReplica:
    """One upstream server, as reached with one set of :class:`ConnectionSettings`: its pool
    (the lean KeepAlivePool or the HttpxPool), and a capacity limiter that bounds the requests
    in it.

    Waiting happens on the limiter only (in each model's bounded queue for it), never inside
    the pool: a request that gets a slot always gets a connection (an idle one, or a new one),
    and a request cancelled while it waits holds nothing (the bug class of httpcore #1093,
    whose pool leaked a connection so).
    """

    def __init__(
        self,
        url: str,
        settings: UpstreamConfig,
        connection: ConnectionSettings | None = None,
        *,
        socket_options: Any = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.connection = connection or ConnectionSettings(transport="lean")
        self.load = ReplicaLoad(self.url)
        self._pool: Pool
        if self.connection.transport == "httpx":
            self._pool = HttpxPool(
                self.connection,
                max_connections=settings.max_connections,
                max_keepalive=settings.max_keepalive_connections,
                keepalive_expiry=settings.keepalive_expiry,
                socket_options=socket_options,
            )
        else:
            https = self.url.startswith("https://")
            self._pool = KeepAlivePool(
                max_keepalive=settings.max_keepalive_connections,
                keepalive_expiry=settings.keepalive_expiry,
                socket_options=socket_options,
                ssl_context=self.connection.ssl_context(alpn=["http/1.1"]) if https else None,
                spare=settings.preconnect,
            )
        self._connect_timeout = settings.connect_timeout
        self.slots = trio.CapacityLimiter(settings.max_connections)
        # What health checks send as Authorization: the upstream key of a model this replica
        # serves (set by the app), as its requests do; a hosted API answers 401 without it.
        self.authorization: str | None = None
        parsed = httpx.URL(self.url)
        self.origin = Origin.of(parsed)
        # Sent as the Host header (with the port unless it is the scheme's default).
        self.host_header = parsed.netloc
        # The request targets, built once: "http://host:8000" and "http://host:8000/v1" both
        # name the server whose /v1/... endpoints we call.
        root: bytes = httpx.URL(self.root_url).raw_path.rstrip(b"/")
        self._root = root
        self._targets: dict[Endpoint, bytes] = {
            endpoint: root + endpoint.value.encode() for endpoint in NATIVE_ENDPOINTS
        }

    @staticmethod
    def key(url: str, connection: ConnectionSettings) -> str:
        """How the app names a replica: its URL, with its connection settings unless it is
        the plain lean default (two models may reach one URL in two ways)."""
        url = url.rstrip("/")
        return (
            url
            if connection == ConnectionSettings(transport="lean")
            else (f"{url} ({connection.label})")
        )

    def endpoint_target(self, endpoint: Endpoint) -> bytes:
        return self._targets[endpoint]

    def target(self, request: CompletionRequest) -> bytes:
        """The request target: the endpoint's, or a pass-through's path on the server's root
        (a pass-through "/tokenize" is the root's, as vLLM serves it)."""
        if request.endpoint is Endpoint.PASSTHROUGH:
            return self._root + request.path.encode()
        return self._targets[request.endpoint]

    @property
    def root_url(self) -> str:
        """The server's root, where health endpoints live, whichever way the base was given."""
        return self.url[:-3] if self.url.endswith("/v1") else self.url

    def pool_connections(self) -> list[Any]:
        """The connections in this pool, busy or idle (for tests and diagnostics)."""
        return self._pool.connections()

    @property
    def pool(self) -> Pool:
        return self._pool

    async def maintain_connections(self) -> None:
        """The pool's background work: the lean pool keeps ``[upstream] preconnect`` idle
        connections open ahead of demand (KeepAlivePool.keep_spare), the httpx one closes idle
        connections that their server closed (HttpxPool.keep_spare). Runs until the pool
        closes or the task is cancelled."""
        await self._pool.keep_spare(self.origin, self._connect_timeout)

    async def aclose(self) -> None:
        await self._pool.aclose()


class UpstreamBackend:
    """Serves one model from one or more replicas, chosen by its ``balance``."""

    async def watch_replicas(self) -> None:
        """Runs for the server's lifetime in the app's nursery: what this model's ``balance``
        needs in the background. ``upstream_metrics``: one scraper per replica, in a nursery
        of their own (a replica that hangs never delays another's scrape); ``least_busy`` and
        ``prefix_affinity`` need nothing, and it returns at once."""
        router = self._router
        if not isinstance(router, MetricsRouter):
            return
        interval = self.model.metrics_interval
        async with contextlib.AsyncExitStack() as stack:
            # Each replica's own client: its requests' proxy and TLS (transports.health_client),
            # connections of its own, so a scrape never waits behind streams for a slot.
            clients = [
                await stack.enter_async_context(health_client(replica.connection, interval))
                for replica in self.replicas
            ]
            async with trio.open_nursery() as nursery:
                for client, replica in zip(clients, self.replicas, strict=True):
                    nursery.start_soon(self._scrape_replica, client, router, replica, interval)

    async def _scrape_replica(
        self,
        client: httpx.AsyncClient,
        router: MetricsRouter,
        replica: UpstreamReplica,
        interval: float,
    ) -> None:
        """Scrape forever, every ``interval``; each scrape bounded by the interval itself."""
        url = replica.root_url + self.model.metrics_path
        failing = False
        while True:
            problem: str | None = "no answer within metrics_interval"
            with trio.move_on_after(interval):
                problem = await self._scrape_once(client, router, replica, url)
            if problem is None:
                if failing:
                    log.info("model %s: scraping %s works again", self.model.name, url)
                failing = False
            else:
                router.failed(replica.load)
                if not failing:
                    # Once per failing spell, not per scrape.
                    log.warning(
                        "model %s: scraping %s failed (%s); least_busy for that replica "
                        "until it answers",
                        self.model.name,
                        url,
                        problem,
                    )
                failing = True
            await trio.sleep(interval)

    async def _scrape_once(
        self, client: httpx.AsyncClient, router: MetricsRouter, replica: UpstreamReplica, url: str
    ) -> str | None:
        """One scrape, its figures given to the router; what went wrong, or None."""
        headers = {"User-Agent": USER_AGENT.decode(), "Accept": "text/plain"}
        if replica.authorization is not None:
            headers["Authorization"] = replica.authorization
        try:
            async with client.stream("GET", url, headers=headers) as response:
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
            metrics = parse_replica_metrics(body.decode("utf-8", "replace"), self.model.name)
        except MetricsParseError as error:
            return str(error)
        router.observe(replica.load, metrics, trio.current_time())
        return None

    def __init__(
        self,
        model: UpstreamModel,
        replicas: Sequence[UpstreamReplica],
        relay: RelayConfig,
        *,
        api_key: str | None = None,
        policy: HealthPolicy | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if not replicas:
            raise ValueError(f"model {model.name!r} has no replicas")
        self.model = model
        self.replicas = list(replicas)
        self._by_load = {replica.load: replica for replica in self.replicas}
        self._loads = [replica.load for replica in self.replicas]
        self._router: LeastBusyRouter = router_for(
            model.balance,
            policy,
            metrics_interval=model.metrics_interval,
            affinity_max_load=model.affinity_max_load,
        )
        self._decisions = None if metrics is None else routing_counter(metrics)
        self._relay = relay
        self._api_key = api_key
        self._metrics = metrics
        self._authorization = f"Bearer {api_key}".encode() if api_key else None
        # Each replica's connection slots, shared by every model it serves; this model's
        # requests wait for them in a queue of max_queue per replica, as a local model's do.
        self._queues = {
            replica: Admission(
                f"model '{model.name}' on {replica.url}",
                slots=replica.slots,
                max_queue=model.max_queue,
                queue_timeout=model.queue_timeout,
                on_leave=None if metrics is None else self._left_queue,
                retryable=True,  # another replica may have a free slot
            )
            for replica in self.replicas
        }
        if metrics is not None:
            # Read at scrape time, as the local model's.
            metrics.queue_depth.labels(model.name).set_function(lambda: self.queued)

    @property
    def queued(self) -> int:
        """This model's requests waiting for a connection slot, on every replica."""
        return sum(queue.waiting for queue in self._queues.values())

    def _request(
        self, replica: UpstreamReplica, request: CompletionRequest, request_id: str
    ) -> UpstreamRequest:
        # Headers built from scratch: nothing of the client's (its Authorization above all)
        # reaches the upstream. The body is the client's bytes, as they came.
        headers = [
            (b"host", replica.host_header),
            (b"user-agent", USER_AGENT),
            (b"content-type", request.content_type.encode("latin-1")),
            (b"accept", _ACCEPT[request.endpoint, request.stream]),
            (b"accept-encoding", b"identity"),
            (b"content-length", str(len(request.raw)).encode()),
            (b"x-request-id", request_id.encode()),
        ]
        if self._authorization is not None:
            headers.append((b"authorization", self._authorization))
        if request.endpoint is Endpoint.MESSAGES:
            # The Messages API is versioned by this header (vLLM ignores it; Anthropic's
            # own API requires it).
            headers.append((b"anthropic-version", ANTHROPIC_VERSION))
        # Reads are bounded by the relay's own deadlines (first token, idle, total).
        return UpstreamRequest(
            replica.origin,
            b"POST",
            replica.target(request),
            headers,
            request.raw,
            connect_timeout=self.model.connect_timeout,
        )

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

    def _choose(self, tried: Sequence[ReplicaLoad], key: bytes) -> ReplicaLoad | None:
        decision = self._router.decide(self._loads, tried, trio.current_time(), key)
        if decision.replica is not None and self._decisions is not None:
            self._decisions.labels(self.model.name, self._router.balance, decision.reason).inc()
        return decision.replica

    async def produce(self, request: CompletionRequest, request_id: str, sink: Sink) -> None:
        key = self.affinity_key(request)
        with trio.move_on_after(self.model.total_timeout):
            await self._attempts(request, request_id, sink, key)
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

    async def _attempts(
        self, request: CompletionRequest, request_id: str, sink: Sink, key: bytes = b""
    ) -> None:
        if self.model.hedge_after > 0:
            await self._hedged(request, request_id, sink, key)
            return
        tried: list[ReplicaLoad] = []
        failures: list[str] = []
        last_error: ApiError | None = None
        attempts = min(self.model.max_attempts, len(self._loads))
        for _ in range(attempts):
            load = self._choose(tried, key)
            if load is None:
                break
            tried.append(load)
            try:
                await self._attempt(load, request, request_id, sink)
                return
            except ApiError as error:
                if sink.started or not error.retryable or sink.client_gone:
                    raise
                last_error = error
                failures.append(f"{load.url}: {error.message}")
                if len(tried) < attempts:
                    self._log_retry(request_id, load, error, len(tried))
        if last_error is None:
            raise self._no_healthy_replica()
        if len(failures) > 1:
            # The client hears of every replica that was tried, not just the last one.
            last_error.message = "every replica tried failed: " + "; ".join(failures)
            last_error.args = (last_error.message,)
        raise last_error

    async def _hedged(
        self, request: CompletionRequest, request_id: str, sink: Sink, key: bytes = b""
    ) -> None:
        """Attempts that may overlap: after hedge_after without a first token another replica
        gets the same request; the first to send an event wins and the others are cancelled
        (their streams closed, so their servers abort the work)."""
        race = _Race(sink)
        tried: list[ReplicaLoad] = []
        outcomes_send, outcomes = trio.open_memory_channel[ApiError | None](self.model.max_attempts)
        final_error: ApiError | None = None
        async with trio.open_nursery() as nursery:
            running = 0

            def launch() -> bool:
                nonlocal running
                load = self._choose(tried, key)
                if load is None:
                    return False
                tried.append(load)
                running += 1
                nursery.start_soon(
                    self._race_attempt, load, request, request_id, race, outcomes_send
                )
                return True

            if not launch():
                final_error = self._no_healthy_replica()
            hedge_at = trio.current_time() + self.model.hedge_after
            while running and final_error is None:
                with trio.move_on_at(hedge_at if race.winner is None else math.inf):
                    outcome = await outcomes.receive()
                    running -= 1
                    if outcome is None:
                        break  # the winner streamed to the end
                    if race.winner is not None or not outcome.retryable:
                        # Failed mid-stream, or in a way no other replica would fix.
                        final_error = outcome
                    elif running:
                        pass  # the other attempt is still in the race
                    elif len(tried) < self.model.max_attempts and launch():
                        self._log_retry(request_id, tried[-2], outcome, len(tried) - 1)
                    else:
                        final_error = outcome
                    continue
                # No first token within hedge_after: hedge, once.
                hedge_at = math.inf
                if len(tried) < self.model.max_attempts and launch():
                    log.info("request %s: hedging on %s", request_id, tried[-1].url)
            if final_error is not None:
                nursery.cancel_scope.cancel()
        if final_error is not None:
            raise final_error

    async def _race_attempt(
        self,
        load: ReplicaLoad,
        request: CompletionRequest,
        request_id: str,
        race: _Race,
        outcomes: trio.MemorySendChannel[ApiError | None],
    ) -> None:
        with trio.CancelScope() as scope:
            entrant = race.enter(scope)
            outcome: ApiError | None = None
            try:
                await self._attempt(load, request, request_id, entrant)
            except ApiError as error:
                outcome = error
            # Capacity max_attempts: never blocks. A loser was cancelled and reports nothing.
            outcomes.send_nowait(outcome)

    async def _attempt(
        self, load: ReplicaLoad, request: CompletionRequest, request_id: str, sink: Sink
    ) -> None:
        """One try on one replica, with its health verdict."""
        replica = self._by_load[load]
        load.in_flight += 1
        verdict = False
        try:
            sink.set_phase("queued")
            async with self._queues[replica].slot():
                sink.set_phase("awaiting_headers")
                await self._exchange(replica, request, request_id, sink)
            self._router.success(load)
            verdict = True
        except ApiError as error:
            if error.code in _QUEUE_REFUSALS:
                # The proxy's own queue was full or too slow: nothing about the replica.
                self._count_error(error)
                raise
            if not sink.client_gone:
                self._router.failure(load, trio.current_time())
                self._count_error(error)
                verdict = True
            raise
        finally:
            load.in_flight -= 1
            if not verdict:
                # Cancelled (client left, lost a hedge race) or stalled: says nothing about
                # the replica, but a probe slot it held must be released.
                self._router.release_probe(load)

    def _left_queue(self, seconds: float, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.queue_wait.labels(self.model.name, outcome).observe(seconds)

    def _log_retry(self, request_id: str, load: ReplicaLoad, error: ApiError, tries: int) -> None:
        # Only when another attempt will follow: a single replica, or the last attempt, has
        # nobody to try, and its failure is the client's error (and the access line's).
        log.warning(
            "request %s: %s failed before the first byte (%s); trying another replica",
            request_id,
            load.url,
            error.code,
        )

    def _no_healthy_replica(self) -> ApiError:
        wait = self._router.next_recovery(self._loads, trio.current_time())
        error = ApiError(
            503,
            f"no healthy upstream replica for model '{self.model.name}'",
            type=UPSTREAM_ERROR,
            code="no_healthy_upstream",
            headers={"Retry-After": str(max(1, math.ceil(wait))) if wait < math.inf else "10"},
        )
        self._count_error(error)
        return error

    async def _exchange(
        self,
        replica: UpstreamReplica,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
    ) -> None:
        model = self.model
        first_token_deadline = (
            trio.current_time() + model.first_token_timeout if request.stream else math.inf
        )
        try:
            with trio.CancelScope(deadline=first_token_deadline) as read_scope:
                async with replica.pool.stream(
                    self._request(replica, request, request_id)
                ) as response:
                    sink.on_disconnect(response.abort)
                    sink.set_phase("awaiting_first_token")
                    if response.status_code != 200:
                        await self._relay_error_response(replica, response, sink)
                    elif request.endpoint is Endpoint.PASSTHROUGH and request.stream:
                        await self._relay_bytes(replica, response, read_scope, sink)
                    elif request.stream:
                        await self._relay_stream(
                            replica, response, read_scope, sink, _STREAM_END[request.endpoint]
                        )
                    else:
                        await self._relay_whole(replica, response, sink)
        except httpx.ConnectTimeout:
            raise upstream_error(
                504,
                "upstream_connect_timeout",
                f"could not connect to {replica.url} within {model.connect_timeout:g}s",
                retryable=True,
            ) from None
        except httpx.ProxyError as error:
            # The proxy refused the tunnel (407: credentials; 403: not allowed there...).
            raise upstream_error(
                502,
                "upstream_proxy_error",
                f"the proxy to {replica.url} refused: {reason(error)}",
                retryable=True,
            ) from None
        except httpx.ConnectError as error:
            raise upstream_error(
                502,
                "upstream_connect_error",
                f"could not connect to {replica.url}: {reason(error)}",
                retryable=True,
            ) from None
        except (httpx.TransportError, httpx.StreamError) as error:
            raise upstream_error(
                502,
                "upstream_protocol_error",
                f"the connection to {replica.url} failed: {type(error).__name__}: {reason(error)}",
                retryable=not sink.started,
            ) from None
        except SSEProtocolError as error:
            raise upstream_error(
                502, "upstream_malformed", f"{replica.url}: {error}", retryable=not sink.started
            ) from None
        if read_scope.cancelled_caught:
            if sink.started:
                raise upstream_error(
                    504,
                    "upstream_idle_timeout",
                    f"{replica.url} sent nothing for idle_timeout={model.idle_timeout:g}s "
                    "in the middle of the stream",
                    retryable=False,
                )
            raise upstream_error(
                504,
                "upstream_first_token_timeout",
                f"{replica.url} sent no token within first_token_timeout="
                f"{model.first_token_timeout:g}s",
                retryable=True,
            )

    async def _relay_stream(
        self,
        replica: UpstreamReplica,
        response: Response,
        read_scope: trio.CancelScope,
        sink: Sink,
        ends_stream: Callable[[bytes], bool],
    ) -> None:
        """Relay an SSE stream event by event; it must end with the endpoint's own last event
        (``ends_stream``: chat's ``data: [DONE]``, Responses' ``response.completed``...), or it
        was cut."""
        content_type = response.headers.get("content-type", "")
        if not content_type.startswith("text/event-stream"):
            raise SSEProtocolError(
                f"answered a streaming request with content-type {content_type!r}"
            )
        decoder = self._decoder(replica, response, streaming=True)
        idle_timeout = self.model.idle_timeout
        # The idle deadline is moved only once it is closer than idle_timeout, and then to
        # idle_timeout + slack from now: a stream is cut between idle_timeout and
        # idle_timeout + slack after its last chunk, and a deadline change (a context manager
        # and a heap push in trio) happens about once per slack, not per chunk.
        slack = min(idle_timeout / 10, _IDLE_SLACK)
        splitter = SSESplitter(self._relay.max_event_bytes)
        saw_done = False
        async for chunk in response.chunks():
            events = splitter.feed(chunk if decoder is None else decode(decoder, chunk))
            if not events:
                continue
            if not sink.started:
                check_event(events[0])
                sink.begin(200, SSE_CONTENT_TYPE)
            for event in events:
                check_event(event)
                if ends_stream(event):
                    saw_done = True
                if not sink.offer(event):
                    # Waiting on the client now: the upstream is not the one being idle.
                    read_scope.deadline = math.inf
                    await sink.send(event)
            # Outside [now + idle_timeout, now + idle_timeout + slack]: still the first-token
            # deadline, inf after waiting on the client, or due for its move.
            now = trio.current_time()
            if not 0.0 <= read_scope.deadline - now - idle_timeout <= slack:
                read_scope.deadline = now + idle_timeout + slack
        if not saw_done:
            raise upstream_error(
                502,
                "upstream_protocol_error",
                f"{replica.url} ended the stream before its last event",
                retryable=not sink.started,
            )

    async def _relay_bytes(
        self,
        replica: UpstreamReplica,
        response: Response,
        read_scope: trio.CancelScope,
        sink: Sink,
    ) -> None:
        """A streamed pass-through: its bytes as they come, with the upstream's content type
        and encoding (nothing here knows their format). The idle deadline applies as to SSE."""
        content_type = response.headers.get("content-type", "application/octet-stream")
        headers = {}
        if "content-encoding" in response.headers:
            headers["Content-Encoding"] = response.headers["content-encoding"]
        idle_timeout = self.model.idle_timeout
        async for chunk in response.chunks():
            if not sink.started:
                sink.begin(200, content_type, headers)
            if not sink.offer(chunk):
                read_scope.deadline = math.inf
                await sink.send(chunk)
            read_scope.deadline = trio.current_time() + idle_timeout
        if not sink.started:
            sink.begin(200, content_type, headers, content_length=0)

    def _decoder(
        self, replica: UpstreamReplica, response: Response, *, streaming: bool
    ) -> http1.ContentDecoder | None:
        """A decoder for a body the server encoded though asked not to; None for identity (or,
        for a whole body, an encoding passed on with its Content-Encoding)."""
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding in ("", "identity"):
            return None
        if encoding in http1.DECODABLE_ENCODINGS:
            if streaming:
                # A stream has no total: each chunk's output is bounded like an event.
                return http1.ContentDecoder(encoding, sys.maxsize, self._relay.max_event_bytes)
            return http1.ContentDecoder(encoding, self._relay.max_response_bytes)
        if streaming:
            raise upstream_error(
                502,
                "upstream_encoding",
                f"{replica.url} sent its stream with Content-Encoding {encoding!r}, which "
                "Sluice cannot decode (it asks for identity)",
                retryable=False,
            )
        return None

    async def _relay_whole(self, replica: UpstreamReplica, response: Response, sink: Sink) -> None:
        body = await _read_bounded(response, self._relay.max_response_bytes)
        content_type = response.headers.get("content-type", JSON_CONTENT_TYPE)
        headers: dict[str, str] = {}
        decoder = self._decoder(replica, response, streaming=False)
        if decoder is not None:
            body = decode(decoder, body)
        elif "content-encoding" in response.headers:
            # Not ours to decode: passed on with its encoding, never mislabelled.
            headers["Content-Encoding"] = response.headers["content-encoding"]
        sink.begin(200, content_type, headers, content_length=len(body))
        await sink.send(body)

    async def _relay_error_response(
        self, replica: UpstreamReplica, response: Response, sink: Sink
    ) -> None:
        body = await _read_bounded(response, _MAX_ERROR_BODY)
        status = response.status_code
        if 300 <= status < 400:
            # Never followed: a redirect from an inference server is a misconfigured URL (a
            # missing /v1, http for https), and following it would resend the client's body
            # to wherever it points.
            location = response.headers.get("location", "(no Location)")
            raise upstream_error(
                502,
                "upstream_redirect",
                f"{replica.url} answered HTTP {status} to {location}; redirects are not "
                "followed (check the model's upstreams URL)",
                retryable=False,
            )
        if status >= 500 or status < 400:
            snippet = body[:500].decode("utf-8", "replace")
            raise upstream_error(
                502,
                "upstream_http_error",
                f"{replica.url} answered HTTP {status}: {snippet}",
                retryable=status >= 500,
            )
        # The upstream's own 4xx (bad parameters, context too long, rate limited) is the
        # client's to see, as the upstream said it.
        headers = {
            name: response.headers[name]
            for name in _PASSED_ERROR_HEADERS
            if name in response.headers
        }
        content_type = response.headers.get("content-type", JSON_CONTENT_TYPE)
        sink.begin(status, content_type, headers, content_length=len(body))
        await sink.send(body)


def reason(error: BaseException) -> str:
    """What went wrong, in words: httpx's own message, or, where it has none (a TLS handshake
    that failed under httpcore says nothing), that of the error it came from."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            break
        if str(seen):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__


def decode(decoder: http1.ContentDecoder, data: bytes) -> bytes:
    try:
        return decoder.feed(data)
    except http1.ProtocolError as error:
        raise upstream_error(
            502, "upstream_protocol_error", f"the upstream's body: {error}", retryable=False
        ) from None


async def _read_bounded(response: Response, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.chunks():
        size += len(chunk)
        if size > limit:
            raise upstream_error(
                502,
                "upstream_response_too_large",
                f"the upstream response exceeds this proxy's limit of {limit} bytes",
                retryable=False,
            )
        parts.append(chunk)
    return b"".join(parts)


class _Race:
    """Hedged attempts racing for one client: the first to produce its response head wins."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.winner: _Entrant | None = None
        self.entrants: list[_Entrant] = []

    def enter(self, scope: trio.CancelScope) -> _Entrant:
        entrant = _Entrant(self, scope)
        self.entrants.append(entrant)
        return entrant

    def claim(self, entrant: _Entrant) -> bool:
        if self.winner is None:
            self.winner = entrant
            for other in self.entrants:
                if other is not entrant:
                    other.scope.cancel()
        return self.winner is entrant


class _Entrant:
    """The sink one hedged attempt sees: it forwards only once it has won the race."""

    def __init__(self, race: _Race, scope: trio.CancelScope) -> None:
        self.race = race
        self.scope = scope

    @property
    def started(self) -> bool:
        return self.race.winner is self

    @property
    def client_gone(self) -> bool:
        return self.race.sink.client_gone

    def set_phase(self, phase: str) -> None:
        if self.race.winner is None:
            self.race.sink.set_phase(phase)

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        if self.race.claim(self):
            self.race.sink.begin(status, content_type, headers, content_length=content_length)
        else:
            self.scope.cancel()

    def offer(self, chunk: bytes) -> bool:
        return self.race.winner is self and self.race.sink.offer(chunk)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        # Every attempt works for the same client: each is shut down if it leaves.
        self.race.sink.on_disconnect(callback)

    async def send(self, chunk: bytes) -> None:
        if self.race.winner is self:
            await self.race.sink.send(chunk)
        else:
            await trio.lowlevel.checkpoint()  # lost: our scope is cancelled, this raises


async def check_replicas(
    replicas: Sequence[UpstreamReplica], path: str, interval: float, policy: HealthPolicy
) -> None:
    """Active health checks, forever: GET ``path`` on every replica each ``interval``; a 200 is
    a success, anything else (or no answer within the interval) a failure. One task per
    replica, so a hanging replica never delays the others' checks. Runs under the app's
    nursery and ends with it."""
    router = LeastBusyRouter(policy)
    async with contextlib.AsyncExitStack() as stack:
        # Each replica's own client: its requests' proxy, TLS and key (transports.health_client).
        clients = [
            await stack.enter_async_context(health_client(replica.connection, interval))
            for replica in replicas
        ]
        async with trio.open_nursery() as nursery:
            for client, replica in zip(clients, replicas, strict=True):
                nursery.start_soon(_check_replica, client, router, replica, path, interval)


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
