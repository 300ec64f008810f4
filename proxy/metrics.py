"""Prometheus metrics, one registry per app: what the tests and benchmarks measure, visible in
production too. Updated once per request (never per event), so they cost nothing on the hot path.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Cancel propagation is measured in milliseconds on a healthy server; seconds mean trouble.
_CANCEL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "sluice_requests",
            "Completion requests by model and final HTTP status.",
            ["model", "status"],
            registry=registry,
        )
        self.active_streams = Gauge(
            "sluice_active_streams", "Requests whose relay is running now.", registry=registry
        )
        self.cancellations = Counter(
            "sluice_cancellations",
            "Requests whose client left before they finished, by backend and phase.",
            ["backend", "phase"],
            registry=registry,
        )
        self.cancel_propagation = Histogram(
            "sluice_cancel_propagation_seconds",
            "From the client's disconnect to its work being gone (upstream stream closed, "
            "worker thread returned).",
            ["backend"],
            buckets=_CANCEL_BUCKETS,
            registry=registry,
        )
        self.wasted_tokens = Histogram(
            "sluice_wasted_tokens",
            "Per cancelled request: events (~tokens) produced for it but never written to it.",
            ["backend"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        self.stalled_clients = Counter(
            "sluice_stalled_clients",
            "Clients cut off for not reading within stall_timeout.",
            registry=registry,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
