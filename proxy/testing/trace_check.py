"""Does one request's trace say what happened? The judge that the cancellation harness
(tests/contracts/test_lifetime_matrix.py) and ``sluice bench --matrix`` apply to each trial's
spans, as an OTLP receiver (:mod:`proxy.testing.otlp_receiver`) decoded them.

A trace says what happened when:

* it holds exactly one SERVER span (the request, or the WebSocket message) and, under it, one
  operation span (``{gen_ai.operation.name} {model}``), every upstream attempt under that; a
  ``request`` stage guard's span (``guard <name>``, made before the operation exists) under
  the server span too; a request that such a guard refused has no operation at all, and its
  server span and guard spans say what happened;
* every span ended (it was exported at all, with an end not before its start, and no child
  ending after its parent);
* both carry the outcome the access line should have (``completed``, ``cancelled(<phase>)``...)
  and no ERROR status for a client that left;
* a cancelled request's operation span has the event ``client disconnected`` and, after it,
  ``upstream closed`` (an upstream) or ``generation stopped`` (the local model), and the
  ``sluice.cancel.latency_s`` between them.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.testing.otlp_receiver import KIND_SERVER, STATUS_ERROR, Span

UPSTREAM_CLOSED = "upstream closed"
GENERATION_STOPPED = "generation stopped"
CLIENT_DISCONNECTED = "client disconnected"


def _request_guard(span: Span) -> bool:
    """A guard call of the ``request`` stage: before the operation span exists."""
    return span.attributes.get("sluice.guard.stage") == "request"


def judge(spans: Sequence[Span], outcome: str, *, local: bool = False) -> str | None:
    """None when ``spans`` (one trace's) say the request ended with ``outcome``; otherwise what
    they get wrong, in a few words."""
    servers = [span for span in spans if span.kind == KIND_SERVER]
    if len(servers) != 1:
        return f"{len(servers)} server spans"
    (server,) = servers
    operations = [
        span for span in spans if span.parent_span_id == server.span_id and not _request_guard(span)
    ]
    guards = [span for span in spans if _request_guard(span)]
    if not operations and guards and not outcome.startswith(("completed", "cancelled")):
        return _refused_before_its_operation(server, guards, spans, outcome)
    if len(operations) != 1:
        return f"{len(operations)} operation spans under the server span"
    (operation,) = operations
    for span in spans:
        if span.end < span.start or span.end == 0:
            return f"span {span.name!r} did not end"
        if span is not server and span is not operation:
            if _request_guard(span):
                if span.parent_span_id != server.span_id or span.end > server.end:
                    return f"span {span.name!r} is not within the server span"
                continue
            if span.parent_span_id != operation.span_id:
                return f"span {span.name!r} is not under the operation span"
            if span.end > operation.end:
                return f"span {span.name!r} ends after the operation span"
    if operation.end > server.end:
        return "the operation span ends after the server span"
    for span in (server, operation):
        said = span.attributes.get("sluice.outcome")
        if said != outcome:
            return f"{span.name!r} says {said!r}, not {outcome!r}"
    if not outcome.startswith("cancelled"):
        return None
    if any(span.status == STATUS_ERROR for span in (server, operation)):
        return "a client that left is marked as an error"
    stopped = GENERATION_STOPPED if local else UPSTREAM_CLOSED
    for event in (CLIENT_DISCONNECTED, stopped):
        if event not in operation.events:
            return f"no {event!r} event"
    if operation.event_times[stopped] < operation.event_times[CLIENT_DISCONNECTED]:
        return f"{stopped!r} before {CLIENT_DISCONNECTED!r}"
    if not isinstance(operation.attributes.get("sluice.cancel.latency_s"), float):
        return "no sluice.cancel.latency_s"
    return None


def _refused_before_its_operation(
    server: Span, guards: Sequence[Span], spans: Sequence[Span], outcome: str
) -> str | None:
    """A request a ``request`` stage guard refused: no operation was made, so the trace is the
    server span and its guards' spans, every one ended within it, the server saying ``outcome``."""
    if len(spans) != 1 + len(guards):
        return f"{len(spans) - 1 - len(guards)} spans beside a refused request's guards"
    for span in guards:
        if span.end < span.start or span.end == 0:
            return f"span {span.name!r} did not end"
        if span.parent_span_id != server.span_id or span.end > server.end:
            return f"span {span.name!r} is not within the server span"
    if server.end < server.start or server.end == 0:
        return f"span {server.name!r} did not end"
    said = server.attributes.get("sluice.outcome")
    if said != outcome:
        return f"{server.name!r} says {said!r}, not {outcome!r}"
    return None
