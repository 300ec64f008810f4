"""``--versus-tracing``: what tracing costs Sluice. Two proxies, the same but for tracing, take
the same load alternately; the traced one exports every request's spans (sampler always on)
over OTLP/HTTP to a receiver in a thread of this process (proxy/testing/otlp_receiver.py), and
this module counts what it got: one SERVER span per chat request, or the figures are not those
of tracing every request."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final

import trio

from proxy.bench.client import http_get
from proxy.bench.procfs import _process_tree, parse_cpu_seconds, read_text_or_none

if TYPE_CHECKING:
    from proxy.bench.summary import RunData
    from proxy.testing.otlp_receiver import Receiver

# The load's requests (the readiness probes and /metrics are traced too: not counted).
CHAT_PATH: Final = "/v1/chat/completions"
# The SDK's batch processor exports every 500 ms: after a run, how long its last spans may
# take to reach the receiver before the count is what it is.
SETTLE_TIMEOUT: Final = 10.0
SETTLE_POLL: Final = 0.05
# The target for CPU per event, traced over untraced.
TARGET_RATIO: Final = 1.25
_DROPPED: Final = re.compile(r"^sluice_trace_spans_dropped_total(?:\{[^}]*\})? (\S+)$", re.M)


def traced_env(receiver_url: str) -> dict[str, str]:
    """The traced proxy's environment: every trace sampled, exported to the receiver."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver_url + "/v1/traces",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_SDK_DISABLED": "",
    }


def untraced_env() -> dict[str, str]:
    """The untraced proxy's: no endpoint, whatever the bench's own environment says."""
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "",
    }


@contextmanager
def collector() -> Iterator[Receiver]:
    """The OTLP receiver for one bench (imported here: only this A/B needs opentelemetry-proto)."""
    from proxy.testing.otlp_receiver import otlp_receiver

    with otlp_receiver() as receiver:
        yield receiver


def chat_server_spans(receiver: Receiver) -> int:
    """The SERVER spans of chat requests the receiver holds."""
    from proxy.testing.otlp_receiver import KIND_SERVER

    with receiver.lock:
        return sum(
            1
            for span in receiver.spans
            if span.kind == KIND_SERVER and span.attributes.get("url.path") == CHAT_PATH
        )


@dataclass
class TracingTally:
    """What the traced proxy was sent and what reached the receiver, over the whole bench."""

    requests: int = 0  # chat requests the traced proxy got (the warm-up's included)
    spans: int = 0  # SERVER spans of chat requests the receiver got
    exports: int = 0  # export requests (batches) the receiver got
    all_spans: int = 0  # every span it got (server, operation, attempt, probes)
    # The longest wait after a run for its last span (what the batch processor held back).
    settle_max_s: float = 0.0
    # sluice_trace_spans_dropped_total from the traced proxy's /metrics at the end (None: not read).
    dropped: float | None = None
    runs: list[tuple[int, int]] = field(default_factory=list)  # (requests, spans) per run
    # CPU per event, traced over untraced, of each repeat's pair of runs: how far the pooled
    # ratio is from noise on this machine.
    repeat_ratios: list[float] = field(default_factory=list)
    # The traced proxy's CPU in threads other than its event loop's (the SDK's batch export),
    # and the events of the runs it was read over (None: not read).
    threads_cpu_s: float | None = None
    threads_events: int = 0

    @property
    def complete(self) -> bool:
        return self.spans == self.requests and not self.dropped

    async def settle(self, receiver: Receiver, sent: int) -> None:
        """Count ``sent`` more requests, and wait until the receiver has a SERVER span for each
        (or ``SETTLE_TIMEOUT``): the proxy's export of them is part of the run's cost."""
        before = self.spans
        self.requests += sent
        started = trio.current_time()
        deadline = started + SETTLE_TIMEOUT
        # The receiver's thread gives no event to wait on: poll it, as the fake's records are.
        while True:
            if chat_server_spans(receiver) >= self.requests or trio.current_time() >= deadline:
                break
            await trio.sleep(SETTLE_POLL)
        self.settle_max_s = max(self.settle_max_s, trio.current_time() - started)
        self.spans = chat_server_spans(receiver)
        with receiver.lock:
            self.exports, self.all_spans = receiver.requests, len(receiver.spans)
        self.runs.append((sent, self.spans - before))

    def add_threads(self, cpu_s: float, events: int) -> None:
        self.threads_cpu_s = (self.threads_cpu_s or 0.0) + cpu_s
        self.threads_events += events

    def pair_ratios(self, traced: list[RunData], untraced: list[RunData]) -> None:
        """``repeat_ratios`` from the runs of each mode, in the order they ran."""

        def per_event(run: RunData) -> float | None:
            events = sum(result.events for result in run.results)
            return run.proxy_cpu_s / events if run.proxy_cpu_s is not None and events else None

        for a, b in zip(traced, untraced, strict=False):
            x, y = per_event(a), per_event(b)
            if x is not None and y:
                self.repeat_ratios.append(x / y)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"complete": self.complete}


def side_threads_cpu_seconds(pid: int) -> float | None:
    """The CPU seconds of ``pid``'s threads (and its workers') but each process's main one:
    in Sluice, the event loop runs in the main thread, the SDK exports from its own."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, found = 0.0, False
    for process in _process_tree(pid):
        tasks = f"/proc/{process}/task"
        for tid in os.listdir(tasks) if os.path.isdir(tasks) else []:
            stat = read_text_or_none(f"{tasks}/{tid}/stat")
            if stat is not None:
                found = True
                if int(tid) != process:
                    total += parse_cpu_seconds(stat, ticks)
    return total if found else None


def parse_dropped(metrics: str) -> float | None:
    """sluice_trace_spans_dropped_total in a Prometheus text exposition (None: absent)."""
    match = _DROPPED.search(metrics)
    return float(match.group(1)) if match else None


async def read_dropped(address: tuple[str, int]) -> float | None:
    """The traced proxy's dropped-span counter, or None where its /metrics does not say."""
    try:
        status, body = await http_get(address, "/metrics")
    except OSError:
        return None
    return parse_dropped(body.decode("utf-8", "replace")) if status == 200 else None


def markdown_lines(
    tally: TracingTally, cpu_ratio: float | None, cpu_per_request_us: float | None = None
) -> list[str]:
    """The section's lines on tracing: what was traced, what was dropped, the target;
    ``cpu_per_request_us``: the traced proxy's CPU per request over the untraced one's."""
    verdict = "every request was traced" if tally.complete else "NOT every request was traced"
    dropped = "not read" if tally.dropped is None else f"{tally.dropped:g}"
    lines = [
        f"- Traced: the receiver got {tally.spans} SERVER spans for the {tally.requests} chat "
        f"requests the traced proxy was sent (warm-up included): {verdict}; "
        f"{tally.all_spans} spans in all, in {tally.exports} exports; "
        f"`sluice_trace_spans_dropped_total` at the end: {dropped}; the last span of a run "
        f"arrived at most {tally.settle_max_s:.2f} s after it (the proxy's CPU is read then, "
        "so its exports count)"
    ]
    if cpu_ratio is not None:
        met = "met" if cpu_ratio <= TARGET_RATIO else "NOT met"
        # Tracing costs per request, not per event: longer answers dilute the ratio.
        extra = (
            f"; {cpu_per_request_us:+.0f} µs of proxy CPU per request"
            if cpu_per_request_us is not None
            else ""
        )
        if tally.threads_cpu_s is not None and tally.threads_events:
            per_event = tally.threads_cpu_s / tally.threads_events * 1e6
            extra += (
                f"; of the traced proxy's CPU, {per_event:.1f} µs per event was in threads "
                "other than the event loop's (the SDK's batch export)"
            )
        if len(tally.repeat_ratios) > 1:
            extra += "; repeat by repeat: " + ", ".join(f"{r:.2f}x" for r in tally.repeat_ratios)
        lines.append(
            f"- Proxy CPU per event, traced/untraced: {cpu_ratio:.2f}x "
            f"(target <= {TARGET_RATIO:g}x: {met}){extra}"
        )
    return lines
