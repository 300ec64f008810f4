"""The fairness bench's settings, checked once; the key that names its section in
docs/benchmarks.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from proxy.bench.settings import BenchError

POLICIES: Final = ("fifo", "fair")
# The keys of the load: A floods, B and C are interactive.
FLOODER: Final = "A"
INTERACTIVE: Final = ("B", "C")
KEYS: Final = (FLOODER, *INTERACTIVE)
# The deadline phase. Queued: B's requests, each with one of these SDK read timeouts in turn,
# behind A's backlog. Running: C's, each dispatched at once and cancelled at its deadline:
# the first byte's (a read timeout shorter than the fake's TTFT) or the whole answer's
# (x-sluice-deadline shorter than the answer).
READ_TIMEOUTS: Final = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
RUNNING_READ_TIMEOUT: Final = 0.3
RUNNING_FIRST_TOKEN: Final = 2.0
RUNNING_DEADLINE: Final = 0.5
RUNNING_ANSWER_SECONDS: Final = 2.0
# A's backlog in the queued step: this many requests per slot, sent at once.
DEADLINE_BACKLOG_PER_SLOT: Final = 3
# The preemption phase: a batch key, of a less urgent band, holds every slot with one long
# stream each while an interactive key's short requests arrive. Their [[keys]] priority (band).
BATCH: Final = "batch"
URGENT: Final = "urgent"
PREEMPT_BANDS: Final = {URGENT: 0, BATCH: 5}
# The two Sluice processes it runs through, both fair: preemption off, and on.
PREEMPT_VARIANTS: Final = ("preempt-off", "preempt-on")
# The interactive requests arrive from this long after the batch streams are sent (they hold
# every slot by then) until this long before a batch stream's planned end, so that each one
# finds the slots held whether or not the batch is paused.
URGENT_LEAD: Final = 0.5
URGENT_TAIL: Final = 1.0
# Their idle step: the same requests alone, this far apart (each alone on the upstream).
IDLE_SPACING: Final = 0.25


@dataclass(frozen=True)
class FairnessSettings:
    slots: int = 4  # S: the fake's max_running, and Sluice's max_connections for it
    rate: float = 1.0  # B's requests per second, and C's
    flood_factor: float = 8.0  # A's rate over B's
    flood_seconds: float = 20.0  # how long requests arrive in a flood phase
    baseline_seconds: float = 8.0  # how long B's and C's arrive with no flood
    ttft: float = 0.05
    interval: float = 0.0025  # the fake's seconds per token
    flood_tokens: int = 300  # A's answers
    short_tokens: int = 16  # B's and C's answers
    deadline_requests: int = 24  # B's requests with a read timeout behind A's backlog
    running_requests: int = 16  # C's requests cancelled at their deadline while running
    # Rounds, each every phase through both policies, the order reversed in every other:
    # two cancel a drift of the machine's speed that is linear over the run.
    repeat: int = 2
    # The preemption phase: [scheduling] preempt_after and max_preemptions of the process
    # that preempts; the batch streams (one per slot, each this long upstream uninterrupted);
    # the interactive requests' rate while they run.
    preempt_after: float = 0.5
    max_preemptions: int = 2
    batch_seconds: float = 6.0
    batch_tokens: int = 300
    urgent_rate: float = 1.5
    timeout: float = 120.0  # seconds a phase may run after its last request is sent
    model: str = "fake-model"
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("slots", "flood_tokens", "short_tokens", "repeat", "batch_tokens"):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("deadline_requests", "running_requests"):
            if getattr(self, name) < 0:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("max_preemptions",):
            if getattr(self, name) < 1:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("rate", "flood_factor", "flood_seconds", "timeout", "preempt_after"):
            if not (0 < getattr(self, name) < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number > 0")
        for name in ("urgent_rate",):
            if not (0 < getattr(self, name) < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number > 0")
        for name in ("baseline_seconds", "ttft", "interval"):
            if not (0 <= getattr(self, name) < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if not (URGENT_LEAD + URGENT_TAIL < self.batch_seconds < math.inf):
            raise BenchError(
                f"--batch-seconds must be a finite number > {URGENT_LEAD + URGENT_TAIL:g} "
                "(the interactive requests arrive while the batch runs)"
            )

    @property
    def flood_rate(self) -> float:
        return self.rate * self.flood_factor

    @property
    def flood_duration(self) -> float:
        """A's planned request duration upstream: its TTFT, then a token every interval."""
        return self.ttft + self.flood_tokens * self.interval

    @property
    def short_duration(self) -> float:
        return self.ttft + self.short_tokens * self.interval

    @property
    def offered_load(self) -> float:
        """Slots the flood phase's arrivals ask for, over the slots there are (> 1: the
        upstream saturates and a queue builds)."""
        busy = self.flood_rate * self.flood_duration + 2 * self.rate * self.short_duration
        return busy / self.slots

    @property
    def running_tokens(self) -> int:
        """The answer of a running request cut at its deadline: longer than the deadline."""
        return max(1, math.ceil(RUNNING_ANSWER_SECONDS / max(self.interval, 1e-3)))

    @property
    def batch_interval(self) -> float:
        """The fake's seconds per token of a batch stream."""
        return self.batch_seconds / self.batch_tokens

    @property
    def urgent_requests(self) -> int:
        """Interactive requests sent while the batch holds the slots (and in the idle step)."""
        window = self.batch_seconds - URGENT_LEAD - URGENT_TAIL
        return max(1, math.floor(window * self.urgent_rate))

    def key(self) -> str:
        """The markers' key of its section in docs/benchmarks.md."""
        return (
            f"bench=fairness slots={self.slots} rate={self.rate:g} flood={self.flood_factor:g}x "
            f"seconds={self.flood_seconds:g} tokens={self.flood_tokens}/{self.short_tokens} "
            f"interval={self.interval:g} repeat={self.repeat}"
        )

    def describe(self) -> str:
        return (
            f"{self.slots} slots (the fake's max_running, Sluice's max_connections); A sends "
            f"{self.flood_rate:g} requests/s of {self.flood_tokens} tokens, B and C "
            f"{self.rate:g}/s each of {self.short_tokens} tokens, for {self.flood_seconds:g} s; "
            f"TTFT {self.ttft * 1000:g} ms, a token every {self.interval * 1000:g} ms "
            f"(offered load {self.offered_load:.2f}x the slots)"
        )

    def describe_preemption(self) -> str:
        return (
            f"the batch key (band {PREEMPT_BANDS[BATCH]}) holds the {self.slots} slots with one "
            f"stream each of {self.batch_tokens} tokens ({self.batch_seconds:g} s upstream "
            f"uninterrupted); the interactive key (band {PREEMPT_BANDS[URGENT]}) sends "
            f"{self.urgent_requests} requests of {self.short_tokens} tokens meanwhile, "
            f"{self.urgent_rate:g}/s; preempt_after = {self.preempt_after:g} s, max_preemptions "
            f"= {self.max_preemptions} (at most {self.slots * self.max_preemptions} pauses)"
        )
