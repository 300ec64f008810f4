"""Traces in the tests: a proxy exports its spans to a real OTLP/HTTP receiver
(:mod:`proxy.testing.otlp_receiver`) set up with only the standard variables
(:func:`tracing_env`); :func:`flush` waits until they are there, and :func:`tree` reads one
request's. The cancellation harness's trials each carry a fresh ``traceparent``, and
:func:`proxy.testing.trace_check.judge` must find that the trace says what the access line says.

The exporter's connections to the receiver live in this process, as the requests' do: they are
the collector's, not a request's, and :func:`collector_sockets` names them so that the harness's
descriptor baseline can leave them out (the batch processor exports every 500 ms, whenever)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import trio

from proxy.bench.sweep.observe import AccessLines
from proxy.ops import tracing
from proxy.testing.otlp_receiver import KIND_SERVER, Receiver, Span
from proxy.testing.trace_check import judge
from tests.support import Proxy


def tracing_env(receiver: Receiver) -> dict[str, str]:
    """Only the standard variables, as an operator sets them."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }


def new_traceparent() -> tuple[str, str]:
    """A fresh trace id, and the sampled ``traceparent`` that starts it (the client's span)."""
    trace_id = os.urandom(16).hex()
    return trace_id, f"00-{trace_id}-{os.urandom(8).hex()}-01"


def collector_sockets(port: int) -> set[str]:
    """``socket:[inode]`` of this process's TCP connections with ``port`` at either end: the
    exporter's to the receiver, and the receiver's accepted ones."""
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    ports = {
                        int(fields[1].rsplit(":", 1)[1], 16),
                        int(fields[2].rsplit(":", 1)[1], 16),
                    }
                    if port in ports:
                        found.add(f"socket:[{fields[9]}]")
        except FileNotFoundError:
            continue
    return found


def without_collector(fds: Counter[str], port: int) -> Counter[str]:
    excluded = collector_sockets(port)
    return Counter({target: n for target, n in fds.items() if target not in excluded})


@dataclass
class Traced:
    """A case's tracing: where its spans go, and the access lines written meanwhile."""

    receiver: Receiver
    access: AccessLines

    @property
    def env(self) -> dict[str, str]:
        return tracing_env(self.receiver)

    @property
    def port(self) -> int:
        return int(self.receiver.url.rsplit(":", 1)[1])


def describe(spans: list[Span]) -> str:
    return "; ".join(
        f"{span.name} ({span.span_id} under {span.parent_span_id or '-'}): "
        f"outcome={span.attributes.get('sluice.outcome')!r} status={span.status} "
        f"events={list(span.events)} {span.start}..{span.end}"
        for span in spans
    )


async def flush(proxy: Proxy | None = None) -> None:
    """Every span ended so far is at the receiver (the export runs in the processor's thread;
    the test waits for it in one of its own); with ``proxy``, once its relays are done."""
    if proxy is not None:
        await proxy.state.tracker.wait_idle()
    active = tracing.ACTIVE
    assert active is not None, "tracing is not on"
    assert await trio.to_thread.run_sync(active.provider.force_flush)


def tree(spans: list[Span]) -> tuple[Span, Span, list[Span]]:
    """The server span, the operation span under it, and the spans under that (the upstream
    attempts, or the local model's stages); every one ended."""
    (server,) = [span for span in spans if span.kind == KIND_SERVER]
    (operation,) = [span for span in spans if span.parent_span_id == server.span_id]
    children = [span for span in spans if span.parent_span_id == operation.span_id]
    assert len(spans) == 2 + len(children), spans
    for span in spans:
        assert span.end >= span.start > 0
    return server, operation, children


def verdict(receiver: Receiver, trace_id: str, outcome: str, *, local: bool) -> str | None:
    """The judge's reason against the trace ``trace_id``, with its spans; None when it says
    ``outcome``."""
    spans = receiver.of_trace(trace_id)
    reason = judge(spans, outcome, local=local)
    if reason is None:
        return None
    return f"trace {trace_id} does not say {outcome!r}: {reason}; spans: {describe(spans)}"
