"""One replica: its URL, pool, load and health state.

One :class:`UpstreamReplica` per base URL owns one connection pool (the lean ``pool`` or
``httpx_pool``), and has a room in Sluice's queue (``relay/admission.py``) whose capacity
bounds the requests in it. Everything above this module reaches the upstream server through a
replica.
"""

from __future__ import annotations

import logging
import time
import weakref
from importlib.metadata import version
from typing import Any

import httpx
from prometheus_client import Counter

from proxy.backends.upstream.httpx_pool import HttpxPool
from proxy.backends.upstream.pool import KeepAlivePool, Origin
from proxy.backends.upstream.routing import ReplicaLoad
from proxy.backends.upstream.transports import ConnectionSettings, Pool
from proxy.config import UpstreamConfig
from proxy.ops.metrics import Metrics
from proxy.protocol.capacity import LEARNED_CEILING, START
from proxy.protocol.openai import NATIVE_ENDPOINTS, CompletionRequest, Endpoint
from proxy.relay.admission import Room

log = logging.getLogger("sluice.upstream")
# A replica's warning of one kind is logged at most this often (seconds): an operator's
# mistake repeats on every request, and the log must not.
WARN_INTERVAL = 60.0

# How the proxy names itself to a replica: in its requests, health checks and scrapes.
USER_AGENT = f"sluice/{version('sluice')}".encode()

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
            "metrics, fallback, affinity_hit, affinity_overflow, cache, load).",
            ["model", "balance", "reason"],
            registry=metrics.registry,
        )
        _ROUTING_COUNTERS[metrics] = counter
    return counter


def start_slots(max_connections: int) -> int:
    """A replica's slots before anything is learned: ``max_connections``, or when it is not
    set (0) the lowest of vLLM's defaults (see proxy.protocol.capacity)."""
    return max_connections or START


def public_name(model_name: str, upstreams: list[str] | tuple[str, ...], url: str) -> str:
    """How a replica is named to clients: by its place in its model's table, never by its
    address (an internal one, as often as not; the logs and the metrics keep it)."""
    for place, each in enumerate(upstreams):
        if each.rstrip("/") == url:
            return f"model '{model_name}' upstreams[{place}]"
    return f"an upstream of model '{model_name}'"


class UpstreamReplica:
    """One upstream server, as reached with one set of :class:`ConnectionSettings`: its pool
    (the lean KeepAlivePool or the HttpxPool), and its room in Sluice's queue, which bounds
    the requests in it.

    Waiting happens in Sluice's queue only, never inside the pool: a request that gets a slot
    always gets a connection (an idle one, or a new one), and a request cancelled while it
    waits holds nothing (the bug class of httpcore #1093, whose pool leaked a connection so).
    """

    def __init__(
        self,
        url: str,
        settings: UpstreamConfig,
        connection: ConnectionSettings | None = None,
        *,
        socket_options: Any = None,
        room: Room | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        # Its slots in Sluice's queue (relay/admission.py): the process's, so that a reload,
        # which builds its replicas anew, keeps what is in flight on the server counted.
        self.room = room or Room(self.url, start_slots(settings.max_connections))
        self.connection = connection or ConnectionSettings(transport="lean")
        self.load = ReplicaLoad(self.url)
        self._pool: Pool
        if self.connection.transport == "httpx":
            self._pool = HttpxPool(
                self.connection,
                # The room bounds what is in flight, learned or set; httpcore's pool only must
                # never be what holds a request (httpcore #1093), whatever the room grows to.
                max_connections=max(self.room.capacity, LEARNED_CEILING),
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
        # When each kind of warning (warn) was last logged.
        self._warned: dict[str, float] = {}
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

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log a warning of ``kind`` about this replica, at most once per WARN_INTERVAL."""
        now = time.monotonic()
        last = self._warned.get(kind)
        if last is not None and now - last < WARN_INTERVAL:
            return
        self._warned[kind] = now
        log.warning(message, *args)

    async def aclose(self) -> None:
        await self._pool.aclose()
