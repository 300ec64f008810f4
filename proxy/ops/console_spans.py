"""Spans without a collector: ``[tracing] exporter = "console"`` writes each finished span as one
line on the log, and needs nothing of OpenTelemetry.

It offers the few things :mod:`proxy.ops.tracing` uses of the SDK through
:mod:`proxy.ops.otel_adapter` (a provider and its tracer, spans with attributes, events and a
status, the W3C ``traceparent`` read and written, the six samplers by their
``OTEL_TRACES_SAMPLER`` names), so that a request's spans are the same tree, named the same,
whichever exporter ends them. A line, when the span ends (a child before its parent)::

    chat fake-model [client] 52.4ms unset trace=0af76519 span=5d3a9c01 parent=b7ad6b71
    sluice.outcome=completed gen_ai.usage.output_tokens=5 | first token +12.1ms

(one line: wrapped here). Ids are their first 8 hex digits: the access line's ``trace_id`` begins
with the same 8. The prompt and answer text (content capture) are never written.
"""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

SPANS_LOGGER = "sluice.spans"
spans_log = logging.getLogger(SPANS_LOGGER)

# Said elsewhere in the lines (the span's name holds the method, path, operation and model; an
# attempt's sluice.replica the upstream's address), too long for a line (content capture's
# prompt and answer), or of use to a trace store rather than a reader.
_LEFT_OUT = frozenset(
    {
        "http.request.method",
        "url.path",
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "sluice.endpoint",
        "server.address",
        "server.port",
        "gen_ai.response.id",
        "gen_ai.response.model",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
    }
)
_ID_DIGITS = 8
_TRACE_ID_LIMIT = (1 << 64) - 1


class SpanKind(enum.Enum):
    INTERNAL = "internal"
    SERVER = "server"
    CLIENT = "client"


class StatusCode(enum.Enum):
    UNSET = "unset"
    OK = "ok"
    ERROR = "error"


@dataclass(frozen=True)
class Status:
    status_code: StatusCode
    description: str | None = None


@dataclass(frozen=True)
class SpanContext:
    trace_id: int
    span_id: int
    trace_flags: int
    # The client's tracestate, passed on unchanged to every span of its trace.
    tracestate: str | None = None

    @property
    def sampled(self) -> bool:
        return bool(self.trace_flags & 1)


@dataclass(frozen=True)
class Parent:
    """The context a span is started in: its parent's (a span of ours, or the client's)."""

    span_context: SpanContext


def extract(traceparent: str | None, tracestate: str | None) -> Parent | None:
    """The client's context from a W3C ``traceparent``, or None when there is none or it is not
    valid (as the SDK's propagator: the request then starts a trace of its own)."""
    if not traceparent:
        return None
    parts = traceparent.strip().lower().split("-")
    if len(parts) < 4 or parts[0] == "ff" or len(parts[0]) != 2:
        return None
    if parts[0] == "00" and len(parts) != 4:
        return None
    version, trace_hex, span_hex, flags_hex = parts[:4]
    if (len(trace_hex), len(span_hex), len(flags_hex)) != (32, 16, 2):
        return None
    try:
        int(version, 16)
        trace_id, span_id, flags = int(trace_hex, 16), int(span_hex, 16), int(flags_hex, 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return Parent(SpanContext(trace_id, span_id, flags, tracestate or None))


def inject(span: ConsoleSpan) -> dict[str, str]:
    """``traceparent`` (and ``tracestate`` when there is one) naming ``span`` as the parent."""
    context = span.context
    carrier = {
        "traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-"
        f"{context.trace_flags:02x}"
    }
    if context.tracestate:
        carrier["tracestate"] = context.tracestate
    return carrier


def set_span_in_context(span: ConsoleSpan) -> Parent:
    return Parent(span.context)


# A root sampler: whether a new trace (of this id) is written.
RootSampler = Callable[[int], bool]


def sampler(name: str, ratio: float | None) -> tuple[RootSampler, bool]:
    """The root decision and whether a client's sampled flag is followed instead, by the
    sampler's OTEL_TRACES_SAMPLER name (ValueError for a name that is not one of them)."""
    ratio = 1.0 if ratio is None else ratio
    bound = round(ratio * (_TRACE_ID_LIMIT + 1))

    def by_ratio(trace_id: int) -> bool:
        return trace_id & _TRACE_ID_LIMIT < bound

    roots: dict[str, RootSampler] = {
        "always_on": lambda _: True,
        "always_off": lambda _: False,
        "traceidratio": by_ratio,
    }
    base = name.removeprefix("parentbased_")
    if base not in roots:
        choices = [*roots, *(f"parentbased_{root}" for root in roots)]
        raise ValueError(
            f"OTEL_TRACES_SAMPLER={name!r} is not one Sluice supports: {', '.join(choices)}"
        )
    return roots[base], name.startswith("parentbased_")


class ConsoleSpan:
    """One span; written as one line when it ends (once), if its trace is sampled."""

    __slots__ = ("_attributes", "_events", "_open", "_status", "context", "kind", "name")

    def __init__(
        self,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        start_time: int,
        attributes: Mapping[str, Any] | None,
    ) -> None:
        self.name = name
        self.context = context
        self.kind = kind
        self._attributes: dict[str, Any] = dict(attributes or {})
        self._events: list[tuple[str, int]] = []
        self._status = StatusCode.UNSET
        # Until it ends: its start and its parent's span id, for the line.
        self._open: tuple[int, int | None] | None = (
            start_time,
            None if parent is None else parent.span_id,
        )

    def get_span_context(self) -> SpanContext:
        return self.context

    def set_attribute(self, key: str, value: Any) -> None:
        self._attributes[key] = value

    def add_event(
        self, name: str, timestamp: int | None = None, attributes: Mapping[str, Any] | None = None
    ) -> None:
        self._events.append((name, time.time_ns() if timestamp is None else timestamp))

    def set_status(self, status: Status) -> None:
        self._status = status.status_code

    def end(self, end_time: int | None = None) -> None:
        started = self._open
        if started is None:
            return
        self._open = None
        if not self.context.sampled or not spans_log.isEnabledFor(logging.INFO):
            return
        start, parent = started
        ended = time.time_ns() if end_time is None else end_time
        spans_log.info("%s", self._line(start, ended, parent))

    def _line(self, start: int, end: int, parent: int | None) -> str:
        context = self.context
        words = [
            f"{self.name} [{self.kind.value}] {(end - start) / 1e6:.1f}ms {self._status.value}",
            f"trace={context.trace_id:032x}"[: 6 + _ID_DIGITS],
            f"span={context.span_id:016x}"[: 5 + _ID_DIGITS],
            "parent=-" if parent is None else f"parent={parent:016x}"[: 7 + _ID_DIGITS],
        ]
        words += [
            f"{key}={_value(value)}"
            for key, value in self._attributes.items()
            if key not in _LEFT_OUT
        ]
        line = " ".join(words)
        if self._events:
            line += " | " + ", ".join(
                f"{name} +{(at - start) / 1e6:.1f}ms" for name, at in self._events
            )
        return line


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple | list):
        return ",".join(_value(item) for item in value)
    text = str(value)
    return text if text and " " not in text else repr(text)


class ConsoleTracer:
    def __init__(self, root: RootSampler, parent_based: bool) -> None:
        self._root = root
        self._parent_based = parent_based

    def start_span(
        self,
        name: str,
        context: Parent | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        start_time: int | None = None,
    ) -> ConsoleSpan:
        parent = None if context is None else context.span_context
        span_id = random.getrandbits(64) or 1
        if parent is None:
            trace_id = random.getrandbits(128) or 1
            sampled, tracestate = self._root(trace_id), None
        else:
            trace_id, tracestate = parent.trace_id, parent.tracestate
            sampled = parent.sampled if self._parent_based else self._root(trace_id)
        return ConsoleSpan(
            name,
            SpanContext(trace_id, span_id, int(sampled), tracestate),
            parent,
            kind,
            time.time_ns() if start_time is None else start_time,
            attributes,
        )


class ConsoleProvider:
    """What :class:`proxy.ops.tracing.Tracing` holds as its provider: each line is written as
    its span ends, so there is nothing to flush or shut down."""

    def __init__(self, sampler_name: str, sampler_ratio: float | None) -> None:
        self._tracer = ConsoleTracer(*sampler(sampler_name, sampler_ratio))

    def get_tracer(self, name: str) -> ConsoleTracer:
        return self._tracer

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        return None
