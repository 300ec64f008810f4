"""The access log: one JSON line per request, on the ``sluice.access`` logger at INFO.

Written once, when the request ends (for a relayed request when its relay closes, so that the
line knows how the stream ended), formatted with one ``json.dumps``. Nothing is built when the
logger is disabled for INFO.

The line is the record's whole message, so a handler with :class:`BareFormatter` writes exactly
the JSON; :func:`configure_access_log` installs such a handler (the CLI's logging set-up should
call it: the root handler's format would otherwise prefix the line with time and level).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from proxy.ops.tracing import RequestTrace

ACCESS_LOGGER = "sluice.access"
access_log = logging.getLogger(ACCESS_LOGGER)


class AccessRecord:
    """What is known of a request when it arrives; completed by whoever sees it end."""

    __slots__ = (
        "band",
        "client",
        "deadline",
        "guard",
        "guard_reason",
        "guard_waste",
        "guard_withheld",
        "key",
        "method",
        "outcome",
        "path",
        "paused_seconds",
        "pauses",
        "queue_wait",
        "request_id",
        "started",
        "tokens",
        "trace",
    )

    def __init__(
        self, request_id: str, method: str, path: str, client: str, started: float
    ) -> None:
        self.request_id = request_id
        self.method = method
        self.path = path
        self.client = client
        # trio.current_time() at arrival: durations use the same clock as the relay.
        self.started = started
        self.key: str | None = None
        # Set by the error handlers (the error code) for a response that is not relayed.
        self.outcome = "completed"
        # The request's spans (proxy/ops/tracing.py), or None when tracing is off.
        self.trace: RequestTrace | None = None
        # A metered request's tokens (a key with a token budget): input, output, for nobody,
        # and whether the input is an estimate. None: not metered.
        self.tokens: tuple[int, int, int, bool] | None = None
        # Its band in the scheduler, the seconds it waited in Sluice's queue (every attempt's
        # wait together), and the seconds from its arrival to its earliest deadline (None:
        # none).
        self.band: int | None = None
        self.queue_wait = 0.0
        self.deadline: float | None = None
        # How many times it was paused for a more urgent request, and for how long in all.
        self.pauses = 0
        self.paused_seconds = 0.0
        # The guard that refused it ([[guards]] name) and its reason; the tokens its upstream
        # made that the refusal kept from the client: held when it came, and made after it
        # (None: no guard refused it).
        self.guard: str | None = None
        self.guard_reason: str | None = None
        self.guard_waste: int | None = None
        # Tokens its guards held when it ended otherwise (its client gone): made, never sent
        # (a whole answer held: more than any answer, every token of it).
        self.guard_withheld = 0

    @property
    def key_label(self) -> str:
        """Its key as the metrics label it: a configured key's name, or "-" (no keys, or a
        credential refused), so that no client can add a series by inventing a key."""
        return self.key or "-"

    def waited(self, seconds: float) -> None:
        """The request left Sluice's queue after ``seconds``."""
        self.queue_wait += seconds

    def paused(self, seconds: float) -> None:
        """The request resumed after a pause of ``seconds``."""
        self.pauses += 1
        self.paused_seconds += seconds

    def emit(
        self,
        *,
        status: int,
        model: str,
        outcome: str,
        ended: float,
        ttft: float | None = None,
        events: int = 0,
    ) -> None:
        trace = self.trace
        if trace is not None:
            # The spans end with the line, whether or not the line is written.
            trace.end(status, outcome, model, ended)
        if not access_log.isEnabledFor(logging.INFO):
            return
        now = time.time()
        fields: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"),
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "model": model,
            "status": status,
            "duration_s": round(ended - self.started, 6),
            "ttft_s": None if ttft is None else round(ttft, 6),
            "events": events,
            "outcome": outcome,
            "client": self.client,
            "key": self.key,
            "trace_id": None if trace is None else trace.trace_id,
            "band": self.band,
            "queue_wait_s": round(self.queue_wait, 6),
            "deadline_s": None if self.deadline is None else round(self.deadline, 3),
            "pauses": self.pauses,
            "paused_s": round(self.paused_seconds, 6),
            "guard": self.guard,
            "guard_reason": self.guard_reason,
        }
        tokens = self.tokens
        if tokens is None:
            fields.update(
                input_tokens=None, output_tokens=None, for_nobody_tokens=None, input_estimated=None
            )
        else:
            fields.update(
                input_tokens=tokens[0],
                output_tokens=tokens[1],
                for_nobody_tokens=tokens[2],
                input_estimated=tokens[3],
            )
        access_log.info(json.dumps(fields, separators=(",", ":")))


class BareFormatter(logging.Formatter):
    """The message and nothing else: the access line is already a complete JSON object."""

    def format(self, record: logging.LogRecord) -> str:
        return record.getMessage()


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time (test runners replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_access_log(stream: TextIO | None = None) -> logging.Handler:
    """Send ``sluice.access`` lines, bare, to ``stream`` (default: the current stderr) instead
    of through the root logger's format. Idempotent: a second call replaces the handler."""
    for handler in list(access_log.handlers):
        if getattr(handler, "sluice_access", False):
            access_log.removeHandler(handler)
    handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(BareFormatter())
    handler.sluice_access = True  # type: ignore[attr-defined]
    access_log.addHandler(handler)
    access_log.propagate = False
    return handler
