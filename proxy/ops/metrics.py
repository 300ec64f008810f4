"""Prometheus metrics, one registry per app: what the tests and benchmarks measure, visible in
production too. Updated once per request (never per event), so they cost nothing on the hot path.

Per-event quantities (the gap between writes, the local model's decode steps) are counted by
their owner in a plain list of bucket counts (:meth:`BucketHistogram.new_counts`, ``bisect``),
and merged into a :class:`BucketHistogram` once, when the request ends: one ``observe`` per
event would take a lock per token.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

from proxy.config import key_of_account

# How prometheus-client spells a bucket bound in "le" (untyped upstream).
_le_text = cast(Callable[[float], str], floatToGoString)
# What a MetricSpec builds: a Counter, Gauge, Histogram or BucketHistogram.
_Metric = TypeVar("_Metric")

# Cancel propagation is measured in milliseconds on a healthy server; seconds mean trouble.
_CANCEL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
# Time to first token: tens of milliseconds on an idle server, seconds under load or in a queue.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Between two writes of a stream: a model's decode step (ms to tens of ms) up to a stall.
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# One decode step of a local model: sub-millisecond (tiny test models) to a slow CPU's 100s of ms.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The contract is at most 1 (the step in flight when the cancel arrived).
_STEPS_AFTER_CANCEL_BUCKETS = (0, 1, 2, 3, 5, 10, 20)
_PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Waiting for a local model's slot: none at all, up to queue_timeout (seconds to minutes).
_FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# A guard call: a regex's microseconds up to a policy service's or a model's seconds.
_GUARD_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_QUEUE_BUCKETS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class BucketHistogram:
    """A Prometheus histogram fed with bucket counts kept by its users, merged once per request.

    A user takes ``counts = histogram.new_counts()``, then per observation does
    ``counts[bisect_left(histogram.bounds, value)] += 1`` and adds ``value`` to its own sum (a
    list index and an add, no lock), and finally calls :meth:`merge` once. Bounds are upper
    bounds (``le``), as in Prometheus; the last slot is ``+Inf``. Thread-safe: a local model's
    worker thread merges while the event loop may be scraping.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(float(bound) for bound in buckets)
        self._le = [_le_text(bound) for bound in self.bounds] + ["+Inf"]
        # label values -> (non-cumulative counts per bucket, sum)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def new_counts(self) -> list[int]:
        return [0] * (len(self.bounds) + 1)

    def observe_all(self, labelvalues: Sequence[str], values: Sequence[float]) -> None:
        """Merge many observations at once (counted here, off the event loop if called from a
        worker thread)."""
        counts = self.new_counts()
        bounds = self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.merge(labelvalues, counts, sum(values))

    def merge(self, labelvalues: Sequence[str], counts: Sequence[int], total: float) -> None:
        if len(counts) != len(self._le):
            raise ValueError(f"{self.name}: expected {len(self._le)} bucket counts")
        key = tuple(labelvalues)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = ([0] * len(self._le), [0.0])
            mine, sums = series
            for index, count in enumerate(counts):
                mine[index] += count
            sums[0] += total

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = [(key, list(counts), sums[0]) for key, (counts, sums) in self._series.items()]
        for key, counts, total in series:
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for le, count in zip(self._le, counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(list(key), buckets, total)
        yield family


class MetricSpec(Generic[_Metric]):
    """One metric, declared once as a class attribute of :class:`Metrics`: its kind, name, help,
    labels and buckets. Each :class:`Metrics` builds it in its own registry and stores it under
    the same attribute, which then shadows this spec (so reading it costs a plain lookup)."""

    def __init__(
        self,
        kind: Callable[..., _Metric],
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] | None = None,
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        self.buckets = buckets

    def build(self, registry: CollectorRegistry) -> _Metric:
        options: dict[str, Any] = {"registry": registry}
        if self.buckets is not None:
            options["buckets"] = self.buckets
        return self.kind(self.name, self.documentation, self.labels, **options)

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> MetricSpec[_Metric]: ...
    @overload
    def __get__(self, instance: Metrics, owner: type[Any]) -> _Metric: ...
    def __get__(self, instance: Metrics | None, owner: type[Any]) -> MetricSpec[_Metric] | _Metric:
        if instance is None:
            return self
        # Metrics.__init__ stores every metric on the instance, where it shadows this
        # non-data descriptor: reaching here means __init__ did not run for this instance.
        raise AttributeError(f"metric {self.name} was not built for this Metrics")


class Metrics:
    """Every metric of one app, each declared once below and built into the app's registry."""

    # Its series are bounded by the configuration: a key label is a name some [[keys]] table
    # gave since the process started (a key removed by a reload keeps its counts until the
    # restart, as every key-labelled metric here), or "-"; a presented credential never is one.
    requests = MetricSpec(
        Counter,
        "sluice_requests",
        "API requests by model, final HTTP status, endpoint (chat, completions, "
        "responses, messages, embeddings, passthrough) and key: a configured key's name, or "
        "'-' (no keys configured, or a credential refused).",
        ["model", "status", "endpoint", "key"],
    )
    active_streams = MetricSpec(
        Gauge, "sluice_active_streams", "Requests whose relay is running now."
    )
    cancellations = MetricSpec(
        Counter,
        "sluice_cancellations",
        "Requests whose client left before they finished, by backend and phase.",
        ["backend", "phase"],
    )
    cancel_propagation = MetricSpec(
        Histogram,
        "sluice_cancel_propagation_seconds",
        "From the client's disconnect to its work being gone (upstream stream closed, "
        "worker thread returned).",
        ["backend"],
        _CANCEL_BUCKETS,
    )
    wasted_tokens = MetricSpec(
        Histogram,
        "sluice_wasted_tokens",
        "Per cancelled request: events (~tokens) produced for it but never written to it.",
        ["backend"],
        _TOKEN_BUCKETS,
    )
    stalled_clients = MetricSpec(
        Counter,
        "sluice_stalled_clients",
        "Clients cut off for not reading within stall_timeout.",
    )
    ttft = MetricSpec(
        Histogram,
        "sluice_ttft_seconds",
        "Streamed responses: from the start of the request's relay (admission included) "
        "to its first body chunk handed to the HTTP layer. For chat that chunk is often "
        "the assistant role delta, which the local backend sends before the prefill.",
        ["model"],
        _TTFT_BUCKETS,
    )
    token_gaps = MetricSpec(
        BucketHistogram,
        "sluice_token_gap_seconds",
        "Streamed responses: time between consecutive body writes handed to the HTTP "
        "layer. Events already waiting are coalesced into one write, so a burst counts "
        "as one gap, not one per token.",
        ["model"],
        GAP_BUCKETS,
    )
    tokens_out = MetricSpec(
        Counter,
        "sluice_tokens_out",
        "SSE data events (~tokens; role, finish, usage and in-band error events included, "
        "[DONE] excluded) handed to the HTTP layer, by model.",
        ["model"],
    )
    upstream_errors = MetricSpec(
        Counter,
        "sluice_upstream_errors",
        "Failed upstream attempts by model and error code, retried ones included "
        "(upstream_connect_error, upstream_first_token_timeout, no_healthy_upstream, ...).",
        ["model", "code"],
    )
    limits_errors = MetricSpec(
        Counter,
        "sluice_limits_errors",
        'Calls to the shared limits store ([limits] backend = "redis") that failed or '
        "timed out, by operation (admit, renew, release, settle, share) and outcome: for "
        "admit, what on_error did (denied: 503, allowed: admitted uncounted); for renew and "
        "release, failed (the lease expires on its own after lease_seconds); for settle, "
        "failed (the token reservation stays charged in full); for share, failed (the "
        "scheduler's counters go with the next sync, ordered by this instance's meanwhile).",
        ["operation", "outcome"],
    )
    auth_refusals = MetricSpec(
        Counter,
        "sluice_auth_refusals",
        "Credentials refused ([auth]: JWTs, forward auth; and static keys beside them), by "
        "method (key, jwt, forward) and reason: too_large, malformed, issuer, algorithm, "
        "unknown_kid, signature, audience, expired, not_yet_valid, issued_in_future, "
        "missing_claim, unmapped (403), refused (by the forward-auth service), unavailable "
        '(forward auth failed under on_error = "deny": 503).',
        ["method", "reason"],
    )
    jwks_fetches = MetricSpec(
        Counter,
        "sluice_jwks_fetches",
        "Fetches of an [[auth.jwt]] issuer's key set (at start, every refresh_seconds, and for "
        "an unknown kid at most once per cooldown), by issuer and outcome (ok, error: the "
        "cached keys stay in use).",
        ["issuer", "outcome"],
    )
    key_tokens = MetricSpec(
        Counter,
        "sluice_key_tokens",
        "Tokens used by the requests of keys with a token budget or cap ([[keys]] "
        "tokens_per_minute, tokens_per_day, max_tokens_cap), by key, model and kind: input, "
        "output (the model's count when it gave one; otherwise one per content delta event "
        "received), and for_nobody (output made for a client that had already left). What "
        "the budgets are charged; distinct from sluice_tokens_out (events written).",
        ["key", "model", "kind"],
    )
    config_reloads = MetricSpec(
        Counter,
        "sluice_config_reloads",
        "Config reloads (SIGHUP) by outcome: applied; restart_needed (applied, but the file "
        "also changed what only a restart applies: host, port, workers, a local model); "
        "invalid (the file did not load or validate: the previous config goes on serving).",
        ["outcome"],
    )
    trace_spans_dropped = MetricSpec(
        Counter,
        "sluice_trace_spans_dropped",
        "Spans dropped because the export queue was full ([tracing]: a collector down or "
        "slow); a request never waits on the collector.",
    )
    queue_depth = MetricSpec(
        Gauge,
        "sluice_queue_depth",
        "Requests waiting now for a local model's slot or an upstream connection slot.",
        ["model"],
    )
    queue_wait = MetricSpec(
        Histogram,
        "sluice_queue_wait_seconds",
        "Time a request waited in Sluice's queue for a local model's slot or an upstream "
        "replica's, observed when it left the queue, by model, key ('-': none), band, and "
        "outcome: admitted, queue_timeout (503), deadline (503 deadline_unmeetable: it could "
        "not start before its client stops waiting), cancelled (the client left), "
        "queue_full (429 at once, 0 s), or shutting_down (503: the drain's grace leaves it "
        "no time to start).",
        ["model", "outcome", "key", "band"],
        _QUEUE_BUCKETS,
    )
    tokens_for_nobody = MetricSpec(
        Counter,
        "sluice_tokens_for_nobody",
        "Tokens made for nobody, by key ('-': none), model and cause: client_left (output "
        "made for a client that had gone), deadline (a request stopped at its deadline), "
        "stall (a client cut off for not reading), hedge_loser (the prompt a hedge's losing "
        "attempt had the upstream read), shutdown (a stream cut by the graceful deadline), "
        "budget (none: a token budget refuses at admission, before any token), guard (output "
        "a guard's refusal kept from the client: held for its verdict, or made after it "
        "before the upstream stopped).",
        ["key", "model", "cause"],
    )
    guard_decisions = MetricSpec(
        Counter,
        "sluice_guard_decisions",
        "Guard calls ([[guards]]) by guard (its name), stage (request, prompt, output, after) "
        "and verdict: pass, refuse, error (it raised), timeout (past its timeout), dropped (an "
        "after hook over the bound of calls running at once, or after the drain began). An "
        "output guard is called once per window.",
        ["guard", "stage", "verdict"],
    )
    guard_seconds = MetricSpec(
        Histogram,
        "sluice_guard_seconds",
        "How long each guard call took, by guard and stage (a prompt guard's time beyond the "
        "upstream's first token is added to the time to first token).",
        ["guard", "stage"],
        _GUARD_BUCKETS,
    )
    dispatches = MetricSpec(
        Counter,
        "sluice_dispatches",
        "Requests dispatched from Sluice's queue to a slot, by model and band: how the bands "
        "share the upstream.",
        ["model", "band"],
    )
    preemptions = MetricSpec(
        Counter,
        "sluice_preemptions",
        "Streams paused so that a request of a more urgent band could take their slot "
        "([scheduling] preempt_after), by the paused request's model and band. A paused "
        "stream is continued where it stopped: its tokens are not wasted.",
        ["model", "band"],
    )
    pause_seconds = MetricSpec(
        Histogram,
        "sluice_pause_seconds",
        "How long a paused stream waited before it was continued, by model and band.",
        ["model", "band"],
        _QUEUE_BUCKETS,
    )
    key_service = MetricSpec(
        Gauge,
        "sluice_key_service",
        "Each key's virtual counter in the fair scheduler ('-': requests with no key): the "
        "service it has received, input tokens x w_in plus output tokens x w_out, over its "
        "weight. The backlogged key with the smallest goes next.",
        ["key", "backend"],
    )
    local_steps = MetricSpec(
        BucketHistogram,
        "sluice_local_step_seconds",
        "Local models: duration of each decode step (one token for each sequence in the "
        "batch), by batch size.",
        ["model", "batch_size"],
        STEP_BUCKETS,
    )
    local_batch_size = MetricSpec(
        Gauge,
        "sluice_local_batch_size",
        "Local models: sequences decoded together now (parked slow readers and prompts "
        "being prefilled excluded).",
        ["model"],
    )
    local_tokens = MetricSpec(
        Counter,
        "sluice_local_generated_tokens",
        "Local models: tokens generated, all sequences together (rate() is tokens/s).",
        ["model"],
    )
    local_steps_after_cancel = MetricSpec(
        Histogram,
        "sluice_local_steps_after_cancel",
        "Local models: forward passes a sequence still took part in after its request was "
        "cancelled (the client left, or shutdown), per cancelled sequence; 1 is the step "
        "already in flight.",
        ["model"],
        _STEPS_AFTER_CANCEL_BUCKETS,
    )
    local_tokens_for_nobody = MetricSpec(
        Counter,
        "sluice_local_tokens_for_nobody",
        "Local models: tokens generated for requests that had already been cancelled.",
        ["model"],
    )
    local_prefill = MetricSpec(
        Histogram,
        "sluice_local_prefill_seconds",
        "Local models: time to prefill a prompt (its chunks, and the decode steps of "
        "others between them), per request.",
        ["model"],
        _PREFILL_BUCKETS,
    )
    local_prefix_hits = MetricSpec(
        Counter,
        "sluice_local_prefix_cache_hits",
        "Local models: prompts that began with the KV of a cached prefix (a chat's earlier "
        "turns, a shared system prompt) and prefilled only the rest.",
        ["model"],
    )
    local_prefix_misses = MetricSpec(
        Counter,
        "sluice_local_prefix_cache_misses",
        "Local models: prompts that shared no prefix with the prefix cache (prefilled whole).",
        ["model"],
    )
    local_prefix_evictions = MetricSpec(
        Counter,
        "sluice_local_prefix_cache_evictions",
        "Local models: prefix cache entries evicted (least recently used) for room.",
        ["model"],
    )
    local_prefix_bytes = MetricSpec(
        Gauge,
        "sluice_local_prefix_cache_bytes",
        "Local models: bytes of KV held by the prefix cache now (at most prefix_cache_bytes).",
        ["model"],
    )
    upstream_capacity = MetricSpec(
        Gauge,
        "sluice_upstream_capacity",
        "Requests Sluice dispatches to each upstream replica at most, now: learned from "
        "where its engine starts to queue (balance upstream_metrics or cache_aware with "
        "max_connections unset, and under it when set), else max_connections.",
        ["model", "replica"],
    )
    # balance = "cache_aware": each replica's vLLM KV events (replica: its URL).
    kv_event_batches = MetricSpec(
        Counter,
        "sluice_kv_event_batches",
        'balance = "cache_aware": KV event batches received from each replica\'s publisher '
        "and applied to its block index (replayed ones included).",
        ["model", "replica"],
    )
    kv_blocks = MetricSpec(
        Counter,
        "sluice_kv_blocks",
        'balance = "cache_aware": blocks in the replicas\' KV events, by change: stored and '
        "removed (indexed, forgotten), skipped (not indexed: a parent never seen, another "
        "tier, group or LoRA adapter), evicted (forgotten to stay within "
        "kv_index_max_blocks).",
        ["model", "replica", "change"],
    )
    kv_indexed_blocks = MetricSpec(
        Gauge,
        "sluice_kv_indexed_blocks",
        'balance = "cache_aware": blocks each replica\'s index holds now (at most '
        "kv_index_max_blocks).",
        ["model", "replica"],
    )
    kv_event_gaps = MetricSpec(
        Counter,
        "sluice_kv_event_gaps",
        'balance = "cache_aware": breaks in a replica\'s KV-event sequence, by outcome: '
        "replayed (the missed batches fetched from its replay endpoint), dropped (not "
        "replayable: its index emptied), restart (its publisher started again: emptied).",
        ["model", "replica", "outcome"],
    )
    kv_subscriber_restarts = MetricSpec(
        Counter,
        "sluice_kv_subscriber_restarts",
        'balance = "cache_aware": subscriptions to a replica\'s KV events that failed '
        "(a malformed message, a socket error) and were made again after a backoff, its "
        "index emptied.",
        ["model", "replica"],
    )
    route_cached_fraction = MetricSpec(
        Histogram,
        "sluice_route_cached_fraction",
        'balance = "cache_aware": per request routed with its prompt\'s tokens, the share '
        "of the prompt's blocks the chosen replica held.",
        ["model"],
        _FRACTION_BUCKETS,
    )

    def left_queue(
        self, model: str, ticket: Any, seconds: float, outcome: str, backend: str, service: float
    ) -> None:
        """A request left Sluice's queue (``ticket``: proxy.protocol.scheduling.Ticket), its
        key's counter then at ``service``."""
        # The key's name: a key mapped per subject is one series, whatever its subjects.
        key = key_of_account(ticket.tenant) or "-"
        band = str(ticket.band)
        self.queue_wait.labels(model, outcome, key, band).observe(seconds)
        if outcome == "admitted":
            self.dispatches.labels(model, band).inc()
            self.key_service.labels(key, backend).set(service)

    def paused(self, model: str, ticket: Any, seconds: float | None) -> None:
        """One of ``model``'s requests was paused (``seconds`` None), or resumed after a pause
        of ``seconds`` (``ticket``: proxy.protocol.scheduling.Ticket)."""
        band = str(ticket.band)
        if seconds is None:
            self.preemptions.labels(model, band).inc()
        else:
            self.pause_seconds.labels(model, band).observe(seconds)

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # In declaration order, which is the order /metrics lists them in.
        for attribute, spec in vars(Metrics).items():
            if isinstance(spec, MetricSpec):
                setattr(self, attribute, spec.build(self.registry))

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition a scraper asked for: OpenMetrics when its Accept header names it
        (Prometheus sends that), else the classic text format."""
        if "application/openmetrics-text" in accept:
            # prometheus-client leaves this one function unannotated.
            payload: bytes = openmetrics.generate_latest(self.registry)  # type: ignore[no-untyped-call]
            return payload, openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
