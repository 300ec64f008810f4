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
# The long run (--long): one fair Sluice with preemption, for minutes. A floods in the batch
# band; B is interactive in the same band (served against A by the fair share, and by a pause
# of A's within the band); C is interactive in a more urgent band (served first, and by a pause).
LONG: Final = "long"
LONG_BANDS: Final = {FLOODER: 5, "B": 5, "C": 0}
# A's flood in the long run is a closed loop: this many requests per slot always outstanding,
# each sent as the one before it ends. A fixed rate above the slots would grow Sluice's queue
# for the whole run and leave minutes of backlog at its end; this one keeps the upstream
# saturated and about S of A's requests waiting in Sluice's queue, from the first minute to
# the last.
LONG_FLOOD_PER_SLOT: Final = 2
# A bucket of the long run's figures: a minute.
MINUTE: Final = 60.0


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
    # The fair process of the FIFO/fair comparison: its [scheduling] preempt_after (None: not
    # set, so it never preempts). Every key of that comparison is in band 0, so what it
    # measures is preemption within one band; its other [scheduling] settings stay Sluice's
    # defaults.
    fair_preempt_after: float | None = None
    timeout: float = 120.0  # seconds a phase may run after its last request is sent
    model: str = "fake-model"
    progress: bool = True
    # --long: run the long bench instead, for this many minutes, its figures per bucket of
    # bucket_seconds (a minute; less only so that a test can run it in seconds).
    long_minutes: float | None = None
    bucket_seconds: float = MINUTE

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
        if self.fair_preempt_after is not None and not (0 < self.fair_preempt_after < math.inf):
            raise BenchError("--fair-preempt-after must be a finite number > 0")
        if not (0 < self.bucket_seconds < math.inf):
            raise BenchError("--bucket-seconds must be a finite number > 0")
        if self.long_minutes is not None and not (
            self.bucket_seconds < self.long_seconds < math.inf
        ):
            raise BenchError(
                f"--long must be finite and longer than one bucket ({self.bucket_seconds:g} s): "
                "its check compares the first bucket with the last"
            )
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

    @property
    def long_seconds(self) -> float:
        """The long run's load, in seconds (0 when it is not one)."""
        return (self.long_minutes or 0.0) * MINUTE

    @property
    def long_flood_outstanding(self) -> int:
        return self.slots * LONG_FLOOD_PER_SLOT

    def key(self) -> str:
        """The markers' key of its section in docs/benchmarks.md (the long run's its own)."""
        if self.long_minutes is not None:
            return (
                f"bench=fairness-long minutes={self.long_minutes:g} slots={self.slots} "
                f"rate={self.rate:g} tokens={self.flood_tokens}/{self.short_tokens} "
                f"interval={self.interval:g} preempt_after={self.preempt_after:g}"
                + ("" if self.bucket_seconds == MINUTE else f" bucket={self.bucket_seconds:g}")
            )
        return (
            f"bench=fairness slots={self.slots} rate={self.rate:g} flood={self.flood_factor:g}x "
            f"seconds={self.flood_seconds:g} tokens={self.flood_tokens}/{self.short_tokens} "
            f"interval={self.interval:g} repeat={self.repeat}"
            + (
                ""
                if self.fair_preempt_after is None
                else f" fair_preempt_after={self.fair_preempt_after:g}"
            )
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

    def describe_long(self) -> str:
        bands = LONG_BANDS
        return (
            f"{self.slots} slots (the fake's max_running, Sluice's max_connections); A (band "
            f"{bands[FLOODER]}) keeps {self.long_flood_outstanding} requests of "
            f"{self.flood_tokens} tokens outstanding for the whole run, each sent as the one "
            f"before it ends; B (band {bands['B']}, A's) and C (band {bands['C']}) send "
            f"{self.rate:g}/s each of {self.short_tokens} tokens, C half a period "
            f"after B; for {self.long_minutes:g} minutes; TTFT {self.ttft * 1000:g} ms, a "
            f"token every {self.interval * 1000:g} ms"
        )
