"""A real OTLP/HTTP trace receiver, for the tests and the benches: an HTTP server on 127.0.0.1
(its own thread, as a collector is its own process) that decodes each ExportTraceServiceRequest
with opentelemetry-proto and keeps the spans. It can also answer 500, or answer late, as a
collector in trouble does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

# opentelemetry.proto.trace.v1.Span.SpanKind and Status.StatusCode
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    trace_state: str
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]]
    event_times: dict[str, int]
    status: int
    start: int
    end: int
    service: str


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@dataclass
class Receiver:
    url: str
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    # What the collector does: "ok", "fail" (500) or "slow" (answers after `delay`).
    mode: str = "ok"
    delay: float = 3.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.name == name]

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        decoded = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    decoded.append(
                        Span(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            trace_state=span.trace_state,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events={
                                e.name: {a.key: _value(a.value) for a in e.attributes}
                                for e in span.events
                            },
                            event_times={e.name: e.time_unix_nano for e in span.events},
                            status=span.status.code,
                            start=span.start_time_unix_nano,
                            end=span.end_time_unix_nano,
                            service=str(resource.get("service.name", "")),
                        )
                    )
        with self.lock:
            self.requests += 1
            self.spans.extend(decoded)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if receiver.mode == "slow":
                time.sleep(receiver.delay)
            if receiver.mode == "fail" or self.path != "/v1/traces":
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            receiver.receive(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    # A short poll: its shutdown (every test that uses one) waits up to one interval.
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="otlp receiver", daemon=True
    )
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
