"""OpenTelemetry's SDK, adapted: the one module that imports it, imported only when tracing is on.

What Sluice uses of it: a tracer provider with its own sampler and resource (never the global
one: a test or an embedding application may have its own), the W3C trace-context propagator,
a batch span processor (its bounded queue), and the OTLP exporters. One internal: the batch
processor's queue (``BatchSpanProcessor._batch_processor._queue``), read to count the spans it
drops when full (``sluice_trace_spans_dropped_total``); without it the spans are still bounded
and dropped, only not counted, and start-up says so once. :func:`check` runs at start-up.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger("sluice.tracing")

# The range the spans and the internal below were written and tested against.
FLOOR = (1, 45)
BELOW = (1, 46)
_DISTRIBUTIONS = (
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
)
_INSTALL = "pip install 'sluice[tracing]'"
_GRPC_INSTALL = "pip install opentelemetry-exporter-otlp-proto-grpc"


class TracingUnavailable(Exception):
    """Tracing is configured but cannot run here; the message says what to install."""


def _release(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits or 0))
    return tuple(numbers)


def check() -> None:
    """Refuse to start (TracingUnavailable) unless the SDK is installed in the tested range."""
    for distribution in _DISTRIBUTIONS:
        try:
            installed = version(distribution)
        except PackageNotFoundError:
            raise TracingUnavailable(
                f"tracing is configured but {distribution} is not installed: {_INSTALL}"
            ) from None
        if not FLOOR <= _release(installed) < BELOW:
            raise TracingUnavailable(
                f"{distribution} {installed} is outside the tested range "
                f">={'.'.join(map(str, FLOOR))},<{'.'.join(map(str, BELOW))}: {_INSTALL}"
            )


try:
    from opentelemetry.context import Context
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_OFF,
        ALWAYS_ON,
        ParentBased,
        Sampler,
        TraceIdRatioBased,
    )
    from opentelemetry.trace import (
        NonRecordingSpan,
        Span,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        set_span_in_context,
    )
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as error:
    raise TracingUnavailable(f"tracing is configured but {error}: {_INSTALL}") from None

__all__ = [
    "Context",
    "NonRecordingSpan",
    "Span",
    "SpanContext",
    "SpanKind",
    "Status",
    "StatusCode",
    "build_provider",
    "check",
    "extract",
    "inject",
    "set_span_in_context",
]

_PROPAGATOR = TraceContextTextMapPropagator()


def extract(traceparent: str | None, tracestate: str | None) -> Context | None:
    """The client's context (W3C trace context), or None without a valid traceparent."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _PROPAGATOR.extract(carrier)


def inject(span: Span) -> dict[str, str]:
    """``traceparent`` (and ``tracestate`` when there is one) naming ``span`` as the parent."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier


def sampler(name: str, ratio: float | None) -> Sampler:
    """A sampler by its OTEL_TRACES_SAMPLER name."""
    ratio = 1.0 if ratio is None else ratio
    samplers: dict[str, Callable[[], Sampler]] = {
        "always_on": lambda: ALWAYS_ON,
        "always_off": lambda: ALWAYS_OFF,
        "traceidratio": lambda: TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: ParentBased(ALWAYS_ON),
        "parentbased_always_off": lambda: ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": lambda: ParentBased(TraceIdRatioBased(ratio)),
    }
    if name not in samplers:
        raise TracingUnavailable(
            f"OTEL_TRACES_SAMPLER={name!r} is not one Sluice supports: {', '.join(samplers)}"
        )
    return samplers[name]()


def exporter(protocol: str, endpoint: str, headers: Mapping[str, str], timeout: float) -> Any:
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise TracingUnavailable(
                f"OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the gRPC exporter: {_GRPC_INSTALL}"
            ) from None
        return GrpcExporter(endpoint=endpoint, headers=dict(headers), timeout=timeout)
    if protocol != "http/protobuf":
        raise TracingUnavailable(
            f"OTLP protocol {protocol!r} is not supported: use http/protobuf or grpc"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, headers=dict(headers), timeout=timeout)


class CountingBatchProcessor(SpanProcessor):
    """The SDK's batch processor (a bounded queue, exported from its own thread: ending a span
    never waits on the collector), and a count of the spans it drops because the queue is
    full."""

    def __init__(
        self, exporter: SpanExporter, max_queue_size: int, on_drop: Callable[[], None]
    ) -> None:
        self._inner = BatchSpanProcessor(
            exporter,
            max_queue_size=max_queue_size,
            schedule_delay_millis=500,
            max_export_batch_size=min(512, max_queue_size),
        )
        self._max = max_queue_size
        self._on_drop = on_drop
        queue = getattr(getattr(self._inner, "_batch_processor", None), "_queue", None)
        self._queue: collections.deque[Any] | None = (
            queue if isinstance(queue, collections.deque) else None
        )
        if self._queue is None:
            log.warning(
                "opentelemetry-sdk: BatchSpanProcessor._batch_processor._queue is missing; "
                "spans dropped by a full export queue are not counted"
            )
        # Each drop is counted in sluice_trace_spans_dropped_total; the SDK's own warning per
        # dropped span would flood the log exactly when the collector is in trouble.
        logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        self._inner.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        if queue is not None and len(queue) >= self._max:
            self._on_drop()
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self._inner.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def build_provider(
    *,
    service_name: str,
    sampler_name: str,
    sampler_ratio: float | None,
    protocol: str,
    endpoint: str,
    headers: Mapping[str, str],
    max_queue_size: int,
    export_timeout: float,
    on_drop: Callable[[], None],
) -> TracerProvider:
    provider = TracerProvider(
        sampler=sampler(sampler_name, sampler_ratio),
        resource=Resource.create({"service.name": service_name}),
    )
    span_exporter = exporter(protocol, endpoint, headers, export_timeout)
    provider.add_span_processor(CountingBatchProcessor(span_exporter, max_queue_size, on_drop))
    return provider
