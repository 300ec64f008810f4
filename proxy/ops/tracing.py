"""OpenTelemetry traces: a request's spans, each ended once, on every exit path, with its outcome.

The tree of one request (the same for every endpoint and transport, since all go through the
one pipeline):

* a SERVER span for the HTTP request (or the WebSocket message), continuing the client's
  ``traceparent`` and ``tracestate``; ended with the access line (:meth:`RequestTrace.end`,
  called by :meth:`~proxy.ops.logs.AccessRecord.emit`), with ``sluice.outcome`` the line's
  outcome;
* under it, ``{gen_ai.operation.name} {model}`` (CLIENT for an upstream, INTERNAL for the local
  model), from the relay's start to its close (queueing, retries and hedging, and the upstream
  closed): ended by :meth:`RequestTrace.relay_ended` as the relay closes, with the events
  ``first token``, ``client disconnected`` and ``upstream closed`` and the times between;
* under that, one span per upstream attempt (:meth:`RequestTrace.attempt`), whose context is
  the ``traceparent`` the upstream receives.

``trio.Cancelled`` is a BaseException, and the SDK's context managers would mark a cancelled
span as a success: every span here is started and ended by hand, its status set from the
outcome (UNSET when the client left or stalled: not Sluice's error; ERROR with ``error.type``
for a failure of the upstream, a timeout, a shutdown).

Tracing is off without an endpoint: then :data:`ACTIVE` is None, the SDK is never imported,
and a request costs one ``is None`` test. With ``exporter = "console"`` the spans are
:mod:`proxy.ops.console_spans`' (the same tree, each span a line on the log when it ends), and
the SDK is not imported either. Events are not recorded as they happen (that would
cost the relay's per-chunk path): their times are known when the relay closes (its account
keeps them) and they are added then, with those timestamps.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import trio

from proxy.config import TRACE_EXPORTERS, ConfigError, TracingConfig
from proxy.ops import console_spans
from proxy.protocol import response_facts

if TYPE_CHECKING:
    from proxy.ops.metrics import Metrics

log = logging.getLogger("sluice.tracing")

TRACES_PATH = "/v1/traces"
# Spans waiting for export at most; beyond it they are dropped and counted.
MAX_QUEUE_SIZE = 2048
# One export's bound, in seconds (it runs in the processor's thread, never a request's).
EXPORT_TIMEOUT = 5.0
_PROTOCOLS = ("http/protobuf", "grpc")

# The process's tracing, or None (off). Read once per request and once per upstream attempt.
ACTIVE: Tracing | None = None
# The request whose producer runs in this task (and its children: trio copies contextvars).
_CURRENT: contextvars.ContextVar[RequestTrace] = contextvars.ContextVar("sluice_request_trace")
# gen_ai.operation.name by endpoint label (semantic conventions v1.41).
_OPERATIONS = {
    "chat": "chat",
    "messages": "chat",
    "responses": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}


@dataclass(frozen=True)
class TraceSettings:
    """What the exporter and sampler are built from: [tracing] over the OTEL_* variables."""

    # "otlp" or "console" ("none" is no settings at all).
    exporter: str
    endpoint: str
    protocol: str
    headers: Mapping[str, str]
    service_name: str
    sampler: str
    sampler_arg: float | None
    capture_content: bool


def _parse_headers(text: str, where: str) -> dict[str, str]:
    """``k=v,k2=v2`` (values URL-encoded), as OTEL_EXPORTER_OTLP_HEADERS."""
    headers = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            raise ConfigError(f"{where} must be 'name=value,...', not {text!r}")
        headers[unquote(name.strip()).lower()] = unquote(value.strip())
    return headers


def _traces_url(base: str, protocol: str) -> str:
    if protocol == "grpc" or urlsplit(base).path.rstrip("/").endswith(TRACES_PATH):
        return base
    return base.rstrip("/") + TRACES_PATH


def exporter_of(config: TracingConfig, env: Mapping[str, str]) -> tuple[str, str]:
    """The exporter ("otlp", "console" or "none"), and what chose it, in the config's words."""
    if config.exporter:
        return config.exporter, f'[tracing] exporter = "{config.exporter}"'
    text = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not text:
        return "otlp", "the default exporter"
    if text not in TRACE_EXPORTERS:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={text!r}: Sluice exports to one of "
            f"{', '.join(TRACE_EXPORTERS)} (set [tracing] exporter to override it)"
        )
    return text, f"OTEL_TRACES_EXPORTER={text}"


def _sdk_disabled(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def _sampling(config: TracingConfig, env: Mapping[str, str]) -> tuple[str, float | None]:
    """The sampler's OTEL_TRACES_SAMPLER name and its argument: [tracing] sample_ratio when
    set, else the variables."""
    if config.sample_ratio >= 0:
        return "parentbased_traceidratio", config.sample_ratio
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    try:
        return sampler, float(text) if text else None
    except ValueError:
        raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number, not {text!r}") from None


def settings_from(config: TracingConfig, env: Mapping[str, str]) -> TraceSettings | None:
    """The settings, or None when tracing is off (exporter "none", "otlp" with no endpoint, or
    OTEL_SDK_DISABLED=true)."""
    if _sdk_disabled(env):
        return None
    exporter, _ = exporter_of(config, env)
    if exporter == "none":
        return None
    if exporter == "console":
        sampler, sampler_arg = _sampling(config, env)
        return TraceSettings(
            exporter="console",
            endpoint="",
            protocol="",
            headers={},
            service_name=env.get("OTEL_SERVICE_NAME", "").strip() or "sluice",
            sampler=sampler,
            sampler_arg=sampler_arg,
            capture_content=config.capture_content,
        )
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: Sluice exports {' or '.join(_PROTOCOLS)}"
        )
    if config.endpoint:
        endpoint = _traces_url(config.endpoint, protocol)
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        endpoint = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = _traces_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), protocol)
    else:
        return None
    if config.headers_env:
        if config.headers_env not in env:
            raise ConfigError(
                f"'headers_env' in [tracing] names {config.headers_env}, which is not set"
            )
        headers = _parse_headers(env[config.headers_env], config.headers_env)
    else:
        variable = next(
            (
                v
                for v in ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")
                if env.get(v)
            ),
            None,
        )
        headers = {} if variable is None else _parse_headers(env[variable], variable)
    sampler, sampler_arg = _sampling(config, env)
    return TraceSettings(
        exporter="otlp",
        endpoint=endpoint,
        protocol=protocol,
        headers=headers,
        service_name=env.get("OTEL_SERVICE_NAME", "").strip() or "sluice",
        sampler=sampler,
        sampler_arg=sampler_arg,
        capture_content=config.capture_content,
    )


def install(
    config: TracingConfig, env: Mapping[str, str], metrics: Metrics | None = None
) -> Tracing | None:
    """Set this process's tracing from ``config`` and ``env`` (ACTIVE); None when off, and then
    nothing of OpenTelemetry is imported. Raises ConfigError (with what to install) when it is
    configured and cannot run."""
    global ACTIVE
    settings = settings_from(config, env)
    if ACTIVE is not None:
        ACTIVE.shutdown()
    if settings is None:
        ACTIVE = None
        return None
    if settings.exporter == "console":
        ACTIVE = Tracing(settings, _console_provider(settings), console_spans)
        return ACTIVE
    from proxy.ops import otel_adapter

    try:
        otel_adapter.check()
        dropped = None if metrics is None else metrics.trace_spans_dropped
        provider = otel_adapter.build_provider(
            service_name=settings.service_name,
            sampler_name=settings.sampler,
            sampler_ratio=settings.sampler_arg,
            protocol=settings.protocol,
            endpoint=settings.endpoint,
            headers=settings.headers,
            max_queue_size=MAX_QUEUE_SIZE,
            export_timeout=EXPORT_TIMEOUT,
            on_drop=(lambda: None) if dropped is None else dropped.inc,
        )
    except otel_adapter.TracingUnavailable as error:
        raise ConfigError(str(error)) from None
    ACTIVE = Tracing(settings, provider, otel_adapter)
    return ACTIVE


def _console_provider(settings: TraceSettings) -> console_spans.ConsoleProvider:
    try:
        return console_spans.ConsoleProvider(settings.sampler, settings.sampler_arg)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check(config: TracingConfig, env: Mapping[str, str]) -> str:
    """At start-up, before binding: a configured tracing that cannot run is a ConfigError.
    Returns where the spans go, for the start-up line (:func:`destination`)."""
    settings = settings_from(config, env)
    if settings is None:
        return _destination(settings, config, env)
    if settings.exporter == "console":
        _console_provider(settings)
        return _destination(settings, config, env)
    from proxy.ops import otel_adapter

    try:
        otel_adapter.check()
        otel_adapter.exporter(settings.protocol, settings.endpoint, settings.headers, 1.0)
        otel_adapter.sampler(settings.sampler, settings.sampler_arg)
    except otel_adapter.TracingUnavailable as error:
        raise ConfigError(str(error)) from None
    return _destination(settings, config, env)


def destination(config: TracingConfig, env: Mapping[str, str]) -> str:
    """Where this process's spans go, as the start-up line says it: "traces: ..."."""
    return _destination(settings_from(config, env), config, env)


def _destination(
    settings: TraceSettings | None, config: TracingConfig, env: Mapping[str, str]
) -> str:
    if settings is None:
        if _sdk_disabled(env):
            return "traces: off (OTEL_SDK_DISABLED=true)"
        exporter, chosen_by = exporter_of(config, env)
        if exporter == "none":
            return f"traces: off ({chosen_by})"
        return (
            "traces: off (no [tracing] endpoint or OTEL_EXPORTER_OTLP_ENDPOINT; "
            '[tracing] exporter = "console" writes them to the log)'
        )
    sampling = settings.sampler + (
        "" if settings.sampler_arg is None else f" {settings.sampler_arg:g}"
    )
    if settings.exporter == "console":
        return (
            f"traces: console, one line per finished span on the log "
            f"(logger {console_spans.SPANS_LOGGER}; sampler {sampling})"
        )
    parts = urlsplit(settings.endpoint)
    # A collector's credentials may sit in its URL; the line is for a log.
    shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    return f"traces: OTLP {settings.protocol} to {shown} (sampler {sampling})"


def classify(outcome: str, status: int, *, cut: bool = False) -> tuple[bool, str | None]:
    """(is an error, error.type) of an outcome: a client that left or stalled is no error of
    Sluice's, nor is a refusal of the client's request (4xx); a failure, a timeout or a
    shutdown is (5xx, or in-band after a 2xx head). ``cut``: cancelled with no client gone,
    which only the server's graceful deadline does (a stream cut by shutdown)."""
    if outcome.startswith("cancelled"):
        return (True, "shutdown") if cut else (False, None)
    if outcome == "completed" or outcome == "stalled":
        return False, None
    return (status >= 500 or status < 400), outcome


class Tracing:
    """A process's tracer: begins each request's trace."""

    def __init__(self, settings: TraceSettings, provider: Any, otel: Any) -> None:
        self.settings = settings
        self.provider = provider
        self.otel = otel
        self.tracer = provider.get_tracer("sluice")
        self._shut = False

    def begin(
        self, traceparent: str | None, tracestate: str | None, method: str, path: str
    ) -> RequestTrace:
        otel = self.otel
        parent = otel.extract(traceparent, tracestate)
        wall = time.time_ns()
        span = self.tracer.start_span(
            f"{method} {path}" if method != "WS" else f"WS {path}",
            context=parent,
            kind=otel.SpanKind.SERVER,
            start_time=wall,
            attributes={"http.request.method": method, "url.path": path},
        )
        return RequestTrace(self, span, wall, self.settings.capture_content)

    def attempt(self, url: str, host: str, port: int | None) -> AttemptTrace | None:
        """The span of an upstream attempt of the request running in this task, if any."""
        trace = _CURRENT.get(None)
        return None if trace is None else trace.attempt(url, host, port)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop."""
        global ACTIVE
        if ACTIVE is self:
            ACTIVE = None
        if self._shut:
            return
        self._shut = True
        try:
            self.provider.shutdown()
        except Exception:  # a collector that fails at exit must not fail the exit
            log.exception("tracing: shutdown failed")


class RequestTrace:
    """One request's spans. ``end`` ends them all, once; whatever is still open at that point
    (an attempt whose task never reached its own end) ends then, with the request's outcome."""

    __slots__ = (
        "_attempts",
        "_capture",
        "_clock",
        "_cut",
        "_local",
        "_local_usage",
        "_operation",
        "_reported_usage",
        "_stopped",
        "_tracing",
        "ended",
        "server",
        "trace_id",
        "traceresponse",
    )

    def __init__(self, tracing: Tracing, server: Any, wall: int, capture: bool = False) -> None:
        self._tracing = tracing
        self.server = server
        # trio.current_time() and the wall clock at the start: the relay's times are trio's,
        # span timestamps are wall-clock nanoseconds.
        self._clock = (trio.current_time(), wall)
        self._operation: Any = None
        self._attempts: list[AttemptTrace] = []
        self._cut = False
        self._capture = capture
        self._local = False
        # The local model's own counts (prompt, generated), and where its generation stopped
        # for a request that left: (when, the decode step, tokens generated after the leave).
        self._local_usage: tuple[int, int] | None = None
        # An upstream's usage block that its client was not sent (asked for by a token budget).
        self._reported_usage: tuple[int | None, int | None] | None = None
        self._stopped: tuple[float, int, int] | None = None
        self.ended = False
        context = server.get_span_context()
        self.trace_id = f"{context.trace_id:032x}"
        self.traceresponse = (
            f"00-{self.trace_id}-{context.span_id:016x}-{int(context.trace_flags):02x}"
        )

    def _ns(self, at: float) -> int:
        mono, wall = self._clock
        return wall + int((at - mono) * 1e9)

    def operation(
        self,
        endpoint: str,
        model: str,
        *,
        local: bool,
        stream: bool,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        """Start the ``{gen_ai.operation.name} {model}`` span, under the server span; with
        content capture on, it records the prompt of ``body``."""
        otel = self._tracing.otel
        name = _OPERATIONS.get(endpoint, endpoint or "chat")
        self._local = local
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": name,
            "gen_ai.provider.name": "sluice.local" if local else "openai",
            "gen_ai.request.model": model,
            "gen_ai.request.stream": stream,
            "sluice.endpoint": endpoint,
        }
        if self._capture and body is not None:
            attributes["gen_ai.input.messages"] = json.dumps(
                response_facts.input_messages(body), ensure_ascii=False
            )
        self._operation = self._tracing.tracer.start_span(
            f"{name} {model}",
            context=otel.set_span_in_context(self.server),
            kind=otel.SpanKind.INTERNAL if local else otel.SpanKind.CLIENT,
            start_time=self._ns(trio.current_time()),
            attributes=attributes,
        )

    def reads_body(self, streaming: bool) -> bool:
        """Whether the relay keeps every write for this trace: a whole answer (its id, model,
        usage are somewhere in it), or a stream whose text is captured. A stream's first and
        last writes are always kept, at no cost."""
        return not streaming or self._capture

    def run(self, produce: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """``produce``, run with this trace as its task's current one (so that its upstream
        attempts, in this task or its children, find it)."""

        async def traced(sink: Any) -> None:
            _CURRENT.set(self)
            await produce(sink)

        return traced

    def attempt(self, url: str, host: str, port: int | None) -> AttemptTrace:
        otel = self._tracing.otel
        parent = self._operation if self._operation is not None else self.server
        attributes: dict[str, Any] = {
            "http.request.resend_count": len(self._attempts),
            "sluice.replica": url,
            "server.address": host,
        }
        if port is not None:
            attributes["server.port"] = port
        span = self._tracing.tracer.start_span(
            "POST",
            context=otel.set_span_in_context(parent),
            kind=otel.SpanKind.CLIENT,
            attributes=attributes,
            start_time=self._ns(trio.current_time()),
        )
        if self._operation is not None:
            self._operation.set_attribute("server.address", host)
            if port is not None:
                self._operation.set_attribute("server.port", port)
        attempt = AttemptTrace(self, span, otel.inject(span))
        self._attempts.append(attempt)
        return attempt

    def event(self, name: str, at: float, attributes: Mapping[str, Any] | None = None) -> None:
        """An event of the request (``preempted``, ``resumed``) on its operation span (the
        server span before there is one), at ``at`` (trio's clock)."""
        span = self._operation if self._operation is not None else self.server
        if span is None:
            return
        span.add_event(name, timestamp=self._ns(at), attributes=dict(attributes or {}))

    # -- the local model's stages -------------------------------------------------------------

    def stage(
        self, name: str, started: float, ended: float, attributes: Mapping[str, Any] | None = None
    ) -> None:
        """A stage of the local model's work (``queue wait``, ``prefill``, ``decode``), as a
        child span of the operation span, from ``started`` to ``ended`` (trio's clock)."""
        if self._operation is None:
            return
        otel = self._tracing.otel
        span = self._tracing.tracer.start_span(
            name,
            context=otel.set_span_in_context(self._operation),
            kind=otel.SpanKind.INTERNAL,
            start_time=self._ns(started),
            attributes=dict(attributes or {}),
        )
        span.end(end_time=self._ns(ended))

    def guard_call(
        self, guard: str, stage: str, verdict: str, started: float, ended: float
    ) -> None:
        """One guard call ([[guards]]) as a child span of the request's (its operation span,
        or the server span before there is one), from ``started`` to ``ended`` (trio's
        clock); a guard that failed or timed out is an error span."""
        parent = self._operation if self._operation is not None else self.server
        if parent is None:
            return
        otel = self._tracing.otel
        span = self._tracing.tracer.start_span(
            f"guard {guard}",
            context=otel.set_span_in_context(parent),
            kind=otel.SpanKind.INTERNAL,
            start_time=self._ns(started),
            attributes={
                "sluice.guard.name": guard,
                "sluice.guard.stage": stage,
                "sluice.guard.verdict": verdict,
            },
        )
        if verdict in ("error", "timeout"):
            span.set_attribute("error.type", f"guard_{verdict}")
            span.set_status(otel.Status(otel.StatusCode.ERROR, verdict))
        span.end(end_time=self._ns(ended))

    def generation_stopped(self, at: float, decode_step: int, for_nobody: int) -> None:
        """The local model let go of a sequence whose request had left, ``at`` (trio's clock),
        after ``decode_step`` steps, ``for_nobody`` of its tokens generated after the leave."""
        previous = self._stopped
        if previous is not None:
            for_nobody += previous[2]
        self._stopped = (at, decode_step, for_nobody)

    def local_usage(self, input_tokens: int, output_tokens: int) -> None:
        """The local model's own counts of a finished sequence (a request of ``n`` choices
        has ``n``: their outputs add up, over the one prompt)."""
        previous = 0 if self._local_usage is None else self._local_usage[1]
        self._local_usage = (input_tokens, previous + output_tokens)

    def reported_usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """The upstream's own usage block, read by the token budget's meter: the proxy asked
        for it, so the client was not sent it and the answer's bytes do not hold it."""
        self._reported_usage = (input_tokens, output_tokens)

    # -- the end ------------------------------------------------------------------------------

    def _answer(
        self, stream: bool, writes: tuple[bytes, ...], kept: list[bytes] | None
    ) -> tuple[response_facts.ResponseFacts, list[dict[str, Any]] | None]:
        """What the answer says of itself, and (content capture) its text."""
        answers: list[dict[str, Any]] | None = None
        if kept is not None:
            data = b"".join(kept)
            if stream:
                answers = list(response_facts.sse_payloads(data))
            else:
                whole = response_facts.whole_payload(data)
                answers = [] if whole is None else [whole]
            facts = response_facts.facts_of(answers)
        elif stream:
            facts = response_facts.stream_facts(*writes)
        else:
            facts = response_facts.ResponseFacts()
        if self._local_usage is not None:
            facts.input_tokens, facts.output_tokens = self._local_usage
        elif self._reported_usage is not None and facts.output_tokens is None:
            facts.input_tokens, facts.output_tokens = self._reported_usage
        output = None
        if self._capture and answers is not None:
            output = response_facts.output_messages(answers)
        return facts, output

    def relay_ended(
        self,
        *,
        outcome: str,
        status: int,
        started: float,
        ttft: float | None,
        gone_at: float | None,
        cancel_seconds: float | None,
        delivered: int,
        undelivered: int,
        closed: float,
        stream: bool = False,
        writes: tuple[bytes, ...] = (),
        kept: list[bytes] | None = None,
    ) -> None:
        """The relay has closed (its producer and upstream are gone): end the operation span
        with what the relay's account knows, the events at the times they happened."""
        span = self._operation
        if span is None or self.ended:
            return
        self._operation = None
        self._cut = outcome.startswith("cancelled") and gone_at is None
        span.set_attribute("sluice.outcome", outcome)
        span.set_attribute("sluice.tokens.delivered", delivered)
        if status < 300:
            facts, output = self._answer(stream, writes, kept)
            for name, value in facts.attributes().items():
                span.set_attribute(name, value)
            if output is not None:
                span.set_attribute("gen_ai.output.messages", json.dumps(output, ensure_ascii=False))
        if ttft is not None:
            span.set_attribute("gen_ai.response.time_to_first_chunk", ttft)
            span.add_event("first token", timestamp=self._ns(started + ttft))
        if gone_at is not None:
            span.add_event("client disconnected", timestamp=self._ns(gone_at))
        if cancel_seconds is not None:
            span.set_attribute("sluice.cancel.latency_s", cancel_seconds)
            span.set_attribute("sluice.tokens.undelivered", undelivered)
            self._stop_event(span, cancel_seconds, closed)
        self._set_status(span, outcome, status)
        ended = self._ns(closed)
        for attempt in self._attempts:
            attempt.end_late(outcome, ended, self._cut)
        span.end(end_time=ended)

    def _stop_event(self, span: Any, cancel_seconds: float, closed: float) -> None:
        """``upstream closed`` (the upstream exchange's close has returned by now), or, for the
        local model, ``generation stopped`` (when the engine let go, at which decode step)."""
        attributes: dict[str, Any] = {"sluice.cancel.latency_s": cancel_seconds}
        if not self._local:
            span.add_event("upstream closed", timestamp=self._ns(closed), attributes=attributes)
            return
        at, step, for_nobody = self._stopped if self._stopped is not None else (closed, 0, 0)
        attributes["sluice.local.decode_step"] = step
        attributes["sluice.tokens.for_nobody"] = for_nobody
        span.set_attribute("sluice.tokens.for_nobody", for_nobody)
        span.add_event(
            "generation stopped", timestamp=self._ns(min(at, closed)), attributes=attributes
        )

    def _set_status(self, span: Any, outcome: str, status: int) -> None:
        error, error_type = classify(outcome, status, cut=self._cut)
        if error_type is not None:
            span.set_attribute("error.type", error_type)
        if error:
            otel = self._tracing.otel
            span.set_status(otel.Status(otel.StatusCode.ERROR, error_type))

    def end(self, status: int, outcome: str, model: str, ended: float) -> None:
        """The access line is written: end every span still open, the server span last."""
        if self.ended:
            return
        if self._operation is not None:
            self.relay_ended(
                outcome=outcome,
                status=status,
                started=ended,
                ttft=None,
                gone_at=None,
                cancel_seconds=None,
                delivered=0,
                undelivered=0,
                closed=ended,
            )
        self.ended = True
        span = self.server
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("sluice.outcome", outcome)
        if model != "-":
            span.set_attribute("gen_ai.request.model", model)
        self._set_status(span, outcome, status)
        span.end(end_time=self._ns(ended))


def current() -> RequestTrace | None:
    """The trace of the request whose producer runs in this task (None: untraced, or off)."""
    return _CURRENT.get(None)


class AttemptTrace:
    """One upstream attempt's span, and the headers that name it as the upstream's parent."""

    __slots__ = ("_trace", "ended", "headers", "span")

    def __init__(self, trace: RequestTrace, span: Any, headers: Mapping[str, str]) -> None:
        self._trace = trace
        self.span = span
        self.headers = [(name.encode(), value.encode("latin-1")) for name, value in headers.items()]
        self.ended = False

    def finish(self, outcome: str, *, error: bool = False) -> None:
        """The attempt returned (``completed``), failed (an error code) or was cancelled
        (``cancelled``, ``hedge_lost``)."""
        if self.ended:
            return
        self.ended = True
        span = self.span
        span.set_attribute("sluice.outcome", outcome)
        if outcome == "hedge_lost":
            span.set_attribute("sluice.hedge.lost", True)
        if error:
            otel = self._trace._tracing.otel
            span.set_attribute("error.type", outcome)
            span.set_status(otel.Status(otel.StatusCode.ERROR, outcome))
        # On the request's clock, as its other spans' times: the wall clock read here could
        # put a child's end after its parent's.
        span.end(end_time=self._trace._ns(trio.current_time()))

    def end_late(self, outcome: str, ended: int, cut: bool) -> None:
        """Ended by the request (its task never reached its own end), with its outcome."""
        if not self.ended:
            self.ended = True
            self.span.set_attribute("sluice.outcome", outcome)
            if cut:
                otel = self._trace._tracing.otel
                self.span.set_attribute("error.type", "shutdown")
                self.span.set_status(otel.Status(otel.StatusCode.ERROR, "shutdown"))
            self.span.end(end_time=ended)
