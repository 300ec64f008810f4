"""The fairness bench's figures per policy, the checks, and its section in docs/benchmarks.md
(also what it prints)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from proxy.bench.fairness.load import longest_input
from proxy.bench.fairness.run import PREEMPT, FairnessRun, Phase
from proxy.bench.fairness.settings import (
    FLOODER,
    INTERACTIVE,
    KEYS,
    POLICIES,
    PREEMPT_VARIANTS,
    URGENT,
)
from proxy.bench.fairness.stats import (
    CANCEL_TARGET_S,
    CPU_LIMIT,
    THROUGHPUT_FLOOR,
    TTFT_SLACK,
    BatchFigures,
    DeadlineFigures,
    KeyFigures,
    PairFigure,
    PreemptCheck,
    ThroughputCheck,
    TtftCheck,
    batch_figures,
    batch_tokens,
    cpu_passed,
    cpu_ratio,
    deadline_figures,
    key_figures,
    outcome,
    pair_figures,
    running_seconds,
    throughput,
)
from proxy.bench.summary import percentile
from proxy.protocol.scheduling import SchedulingSettings, vtc_bound
from proxy.testing.fake_upstream import token_text


@dataclass(frozen=True)
class Bound:
    """The VTC bound the service differences are held to, and what it is made of."""

    w_in: float
    w_out: float
    longest_input: int
    batch_tokens: int

    @property
    def value(self) -> float:
        return vtc_bound(self.w_in, self.longest_input, self.w_out, self.batch_tokens)


def bound_of(run: FairnessRun) -> Bound:
    """``L_in``: the flood phases' longest input (as Sluice estimates it); ``M``: every slot
    running the longest answer; the weights Sluice runs with (the defaults: the bench's
    config sets none)."""
    flood = [r for p in run.phases if p.name == "flood" for r in p.requests]
    scheduling = SchedulingSettings()
    longest_answer = max((r.tokens for r in flood), default=0)
    return Bound(
        scheduling.w_in,
        scheduling.w_out,
        longest_input(flood),
        batch_tokens(run.settings.slots, longest_answer),
    )


@dataclass
class PolicyFigures:
    policy: str
    flood: dict[str, KeyFigures]
    baseline: dict[str, KeyFigures]
    pairs: list[PairFigure]
    throughput: float | None
    cpu_us_per_event: float | None
    cpu_s: float | None
    events: int
    a_duration_s: float | None
    checks: list[TtftCheck]
    deadline: DeadlineFigures
    errors: dict[str, int]  # baseline and flood requests that did not end as planned, by kind
    queue_outcomes: dict[str, dict[str, float]] = field(default_factory=dict)
    upstream_queued_max_s: float | None = None  # the longest wait in the fake's own queue
    # Under the flood: the pauses Sluice counted (sluice_preemptions_total), and the requests
    # the upstream received past each flood request's first (its continuations).
    pauses: float = 0.0
    continuations: int = 0
    # With --fair-preempt-after: B's and C's TTFT p99 under the flood against that
    # preempt_after plus twice their p99 with no flood through the same process (for FIFO
    # too, with the fair process's preempt_after: the same bound, for comparison).
    band_checks: list[PreemptCheck] = field(default_factory=list)


def _phases(run: FairnessRun, name: str, policy: str) -> list[Phase]:
    return [p for p in run.phases if p.name == name and p.policy == policy]


def _requests(phases: Sequence[Phase]) -> list[Any]:
    return [r for p in phases for r in p.requests]


def _pooled_pairs(per_phase: Sequence[list[PairFigure]]) -> list[PairFigure]:
    """Over rounds: the time backlogged together summed, the largest difference."""
    if not per_phase:
        return []
    out = []
    for i, first in enumerate(per_phase[0]):
        each = [pairs[i] for pairs in per_phase]
        out.append(
            PairFigure(
                first.keys,
                sum(p.seconds for p in each),
                max(p.max_difference for p in each),
                first.bound,
            )
        )
    return out


def policy_figures(run: FairnessRun, policy: str, bound: Bound) -> PolicyFigures:
    scheduling = SchedulingSettings()
    floods = _phases(run, "flood", policy)
    flood = _requests(floods)
    baselines = _requests(_phases(run, "baseline", policy))
    weights = dict.fromkeys(KEYS, 1.0)
    pairs = _pooled_pairs(
        [
            pair_figures(
                p.requests,
                KEYS,
                w_in=scheduling.w_in,
                w_out=scheduling.w_out,
                weights=weights,
                bound=bound.value,
            )
            for p in floods
        ]
    )
    cpu = [p.proxy_cpu_s for p in floods]
    cpu_s = None if any(c is None for c in cpu) else sum(c for c in cpu if c is not None)
    events = sum(p.events for p in floods)
    measured = running_seconds(flood, FLOODER)
    a_duration = measured if measured is not None else run.settings.flood_duration
    base = {key: key_figures(baselines, key) for key in INTERACTIVE}
    keyed = {key: key_figures(flood, key, "" if key == FLOODER else FLOODER) for key in KEYS}
    checks = [
        TtftCheck(key, keyed[key].ttft_p99_s, base[key].ttft_p99_s, a_duration, run.settings.slots)
        for key in INTERACTIVE
    ]
    errors: dict[str, int] = {}
    for request in [*baselines, *flood]:
        kind = outcome(request)
        if kind != "served":
            errors[kind] = errors.get(kind, 0) + 1
    deadline_requests = [
        r
        for r in _requests(_phases(run, "deadline", policy))
        if r.read_timeout is not None or r.deadline is not None
    ]
    throughputs = [t for t in (throughput(p.requests) for p in floods) if t is not None]
    preempt_after = run.settings.fair_preempt_after
    band_checks = (
        []
        if preempt_after is None
        else [
            PreemptCheck(keyed[key].ttft_p99_s, base[key].ttft_p99_s, preempt_after, key)
            for key in INTERACTIVE
        ]
    )
    queued = [r.upstream_queued_s for r in flood if r.upstream_queued_s is not None]
    outcomes: dict[str, dict[str, float]] = {}
    for phase in run.phases:
        if phase.policy == policy:
            mine = outcomes.setdefault(phase.name, {})
            for name, count in phase.queue_outcomes.items():
                mine[name] = mine.get(name, 0.0) + count
    return PolicyFigures(
        policy=policy,
        flood=keyed,
        baseline=base,
        pairs=pairs,
        throughput=sum(throughputs) / len(throughputs) if throughputs else None,
        cpu_us_per_event=cpu_s / events * 1e6 if cpu_s is not None and events else None,
        cpu_s=cpu_s,
        events=events,
        a_duration_s=a_duration,
        checks=checks,
        deadline=deadline_figures(deadline_requests),
        errors=errors,
        queue_outcomes=outcomes,
        upstream_queued_max_s=max(queued) if queued else None,
        pauses=sum(p.pause_metrics.get("preemptions_total", 0.0) for p in floods),
        continuations=sum(max(0, r.upstream_records - 1) for r in flood),
        band_checks=band_checks,
    )


@dataclass
class PreemptFigures:
    """The preemption phase through one process (preemption off or on), pooled over rounds."""

    variant: str
    idle: KeyFigures  # the interactive key alone
    urgent: KeyFigures  # the interactive key while the batch held every slot
    # Its TTFT at the fake (receipt to first token): what of its TTFT is not Sluice's wait.
    urgent_upstream_ttft_p50_s: float | None
    urgent_upstream_ttft_p99_s: float | None
    urgent_upstream_queued_max_s: float | None  # the longest wait in the fake's own queue
    batch: BatchFigures
    preemptions: float  # sluice_preemptions_total over the phase
    pauses_resumed: float  # sluice_pause_seconds_count
    pause_seconds: float  # sluice_pause_seconds_sum
    access_pauses: int  # the batch's access lines' pauses, summed
    longest_paused_s: float | None  # the most one batch stream was paused, all its pauses
    continuations: int  # batch requests the fake received past each stream's first
    errors: dict[str, int]  # requests that did not end as planned, by kind

    @property
    def mean_pause_s(self) -> float | None:
        if not self.pauses_resumed:
            return None
        return self.pause_seconds / self.pauses_resumed


def _upstream_ttfts(requests: Sequence[Any]) -> list[float]:
    return [
        r.upstream_first_token - r.upstream_received
        for r in requests
        if r.upstream_first_token is not None and r.upstream_received is not None
    ]


def preempt_figures(run: FairnessRun, variant: str) -> PreemptFigures:
    phases = _phases(run, PREEMPT, variant)
    requests = _requests(phases)
    idle = [r for r in requests if r.kind == "idle"]
    urgent = [r for r in requests if r.kind == "urgent"]
    batches = [[r for r in p.requests if r.kind == "batch"] for p in phases]
    expected = "".join(token_text(i) for i in range(run.settings.batch_tokens))
    upstream = _upstream_ttfts(urgent)
    queued = [r.upstream_queued_s for r in urgent if r.upstream_queued_s is not None]
    lines = [line for p in phases for line in p.access_pauses]
    errors: dict[str, int] = {}
    for request in requests:
        kind = outcome(request)
        if kind != "served":
            errors[kind] = errors.get(kind, 0) + 1

    def metric(name: str) -> float:
        return sum(p.pause_metrics.get(name, 0.0) for p in phases)

    return PreemptFigures(
        variant=variant,
        idle=key_figures(idle, URGENT),
        urgent=key_figures(urgent, URGENT),
        urgent_upstream_ttft_p50_s=percentile(upstream, 50),
        urgent_upstream_ttft_p99_s=percentile(upstream, 99),
        urgent_upstream_queued_max_s=max(queued) if queued else None,
        batch=batch_figures(batches, expected),
        preemptions=metric("preemptions_total"),
        pauses_resumed=metric("pause_seconds_count"),
        pause_seconds=metric("pause_seconds_sum"),
        access_pauses=sum(pauses for pauses, _ in lines),
        longest_paused_s=max((paused for _, paused in lines), default=None),
        continuations=sum(max(0, r.upstream_records - 1) for b in batches for r in b),
        errors=errors,
    )


def idle_p99(run: FairnessRun) -> float | None:
    """The interactive key's TTFT p99 alone on the upstream, through both processes."""
    ttfts = [
        t
        for p in run.phases
        if p.name == PREEMPT
        for r in p.requests
        if r.kind == "idle" and (t := r.ttft_s) is not None
    ]
    return percentile(ttfts, 99)


@dataclass
class FairnessReport:
    run: FairnessRun
    bound: Bound
    policies: dict[str, PolicyFigures]
    preemption: dict[str, PreemptFigures] = field(default_factory=dict)
    preempt_check: PreemptCheck | None = None

    @property
    def pauses_passed(self) -> bool:
        """Only the process that preempts paused anything, and it did."""
        on, off = self.preemption["preempt-on"], self.preemption["preempt-off"]
        return on.preemptions > 0 and off.preemptions == 0 and off.continuations == 0

    @property
    def cpu_ratio(self) -> float | None:
        return cpu_ratio(
            self.policies["fair"].cpu_us_per_event, self.policies["fifo"].cpu_us_per_event
        )

    @property
    def within_band(self) -> bool:
        """Whether the fair process of the comparison preempts (--fair-preempt-after)."""
        return self.run.settings.fair_preempt_after is not None

    @property
    def throughput_check(self) -> ThroughputCheck:
        return ThroughputCheck(self.policies["fair"].throughput, self.policies["fifo"].throughput)

    def throughput_rounds(self) -> list[float | None]:
        """Fair over FIFO, throughput under the flood, round by round."""
        out = []
        for round_ in range(self.run.settings.repeat):
            by = {
                p.policy: throughput(p.requests)
                for p in self.run.phases
                if p.name == "flood" and p.round == round_
            }
            out.append(ThroughputCheck(by.get("fair"), by.get("fifo")).ratio)
        return out

    def cpu_rounds(self) -> list[float | None]:
        """Fair over FIFO, CPU per event, round by round."""
        out = []
        for round_ in range(self.run.settings.repeat):
            by = {
                p.policy: p.cpu_us_per_event
                for p in self.run.phases
                if p.name == "flood" and p.round == round_
            }
            out.append(cpu_ratio(by.get("fair"), by.get("fifo")))
        return out

    def to_json(self) -> dict[str, Any]:
        run = self.run
        return {
            "command": run.command,
            "date": run.date,
            "commit": run.commit,
            "machine": run.machine,
            "settings": asdict(run.settings),
            "seconds": run.seconds,
            "bound": asdict(self.bound) | {"value": self.bound.value},
            "cpu_ratio": self.cpu_ratio,
            "cpu_rounds": self.cpu_rounds(),
            "phases": [
                {
                    "name": p.name,
                    "policy": p.policy,
                    "round": p.round,
                    "seconds": p.seconds,
                    "proxy_cpu_s": p.proxy_cpu_s,
                    "events": p.events,
                    "cpu_us_per_event": p.cpu_us_per_event,
                    "queue_outcomes": p.queue_outcomes,
                    "pause_metrics": p.pause_metrics,
                }
                for p in run.phases
            ],
            "policies": {
                name: asdict(figures)
                | {
                    "checks": [
                        asdict(c) | {"limit_s": c.limit_s, "passed": c.passed}
                        for c in figures.checks
                    ],
                    "pairs": [asdict(p) | {"within": p.within} for p in figures.pairs],
                    "band_checks": [
                        asdict(c) | {"limit_s": c.limit_s, "passed": c.passed}
                        for c in figures.band_checks
                    ],
                    "deadline": asdict(figures.deadline)
                    | {
                        "close_p50_s": figures.deadline.close_p50_s,
                        "close_p99_s": figures.deadline.close_p99_s,
                        "passed": figures.deadline.passed,
                    },
                }
                for name, figures in self.policies.items()
            },
            "preemption": {
                name: asdict(figures)
                | {"mean_pause_s": figures.mean_pause_s, "batch_passed": figures.batch.passed}
                for name, figures in self.preemption.items()
            },
            "preempt_check": None
            if self.preempt_check is None
            else asdict(self.preempt_check)
            | {"limit_s": self.preempt_check.limit_s, "passed": self.preempt_check.passed},
            "pauses_passed": self.pauses_passed if self.preemption else None,
            "within_band": None
            if not self.within_band
            else {
                "preempt_after": run.settings.fair_preempt_after,
                "throughput_ratio": self.throughput_check.ratio,
                "throughput_rounds": self.throughput_rounds(),
                "throughput_passed": self.throughput_check.passed,
            },
        }


def make_report(run: FairnessRun) -> FairnessReport:
    bound = bound_of(run)
    preemption = {v: preempt_figures(run, v) for v in PREEMPT_VARIANTS}
    check = PreemptCheck(
        preemption["preempt-on"].urgent.ttft_p99_s, idle_p99(run), run.settings.preempt_after
    )
    return FairnessReport(
        run, bound, {p: policy_figures(run, p, bound) for p in POLICIES}, preemption, check
    )


# --------------------------------------------------------------------------- text


def _ms(seconds: float | None, spec: str = ".0f") -> str:
    return "n/a" if seconds is None else format(seconds * 1000, spec)


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _verdict(ok: bool) -> str:
    return "**pass**" if ok else "**FAIL**"


def fair_label(report: FairnessReport) -> str:
    """The fair process's column: with its preempt_after when it preempts."""
    after = report.run.settings.fair_preempt_after
    return "fair" if after is None else f"fair, preempt_after {after:g} s"


def flood_table(report: FairnessReport) -> list[str]:
    fifo, fair = report.policies["fifo"], report.policies["fair"]
    rows = [f"| under A's flood | FIFO | {fair_label(report)} |", "|---|---:|---:|"]

    def row(label: str, fifo_value: str, fair_value: str) -> None:
        rows.append(f"| {label} | {fifo_value} | {fair_value} |")

    for key in KEYS:
        a, b = fifo.flood[key], fair.flood[key]
        row(
            f"{key}: TTFT p50 / p99 (ms)",
            f"{_ms(a.ttft_p50_s)} / {_ms(a.ttft_p99_s)}",
            f"{_ms(b.ttft_p50_s)} / {_ms(b.ttft_p99_s)}",
        )
    for key in INTERACTIVE:
        a, b = fifo.baseline[key], fair.baseline[key]
        row(
            f"{key} with no flood: TTFT p50 / p99 (ms)",
            f"{_ms(a.ttft_p50_s)} / {_ms(a.ttft_p99_s)}",
            f"{_ms(b.ttft_p50_s)} / {_ms(b.ttft_p99_s)}",
        )
    for key in INTERACTIVE:
        a, b = fifo.flood[key], fair.flood[key]
        row(
            f"{key}: wait in Sluice's queue p50 / p99 (ms)",
            f"{_ms(a.wait_p50_s)} / {_ms(a.wait_p99_s)}",
            f"{_ms(b.wait_p50_s)} / {_ms(b.wait_p99_s)}",
        )
        row(
            f"{key}: from the send to the next slot free upstream, p50 / p99 (ms)",
            f"{_ms(a.least_wait_p50_s)} / {_ms(a.least_wait_p99_s)}",
            f"{_ms(b.least_wait_p50_s)} / {_ms(b.least_wait_p99_s)}",
        )
        row(
            f"{key}: A's requests that went upstream while one of {key}'s waited",
            f"{a.passed_by:,}",
            f"{b.passed_by:,}",
        )
    for key in KEYS:
        a, b = fifo.flood[key], fair.flood[key]
        row(
            f"{key}: requests served / sent",
            f"{a.ok} / {a.requests}",
            f"{b.ok} / {b.requests}",
        )
    for key in KEYS:
        a, b = fifo.flood[key], fair.flood[key]
        row(
            f"{key}: seconds backlogged; tokens served meanwhile",
            f"{a.backlogged_s:.1f}; {a.tokens_backlogged}",
            f"{b.backlogged_s:.1f}; {b.tokens_backlogged}",
        )
    for i, pair in enumerate(fifo.pairs):
        other = fair.pairs[i]
        f, g = pair.keys
        row(
            f"{f} vs {g}: largest service difference while both backlogged (seconds together)",
            f"{pair.max_difference:,.0f} ({pair.seconds:.1f} s) "
            + ("within" if pair.within else "**over**"),
            f"{other.max_difference:,.0f} ({other.seconds:.1f} s) "
            + ("within" if other.within else "**over**"),
        )
    row(
        "A's request duration upstream, median (ms)",
        _ms(fifo.a_duration_s),
        _ms(fair.a_duration_s),
    )
    row(
        "throughput, all keys (tokens/s)",
        _num(fifo.throughput, ",.0f"),
        _num(fair.throughput, ",.0f"),
    )
    row(
        "proxy CPU per event (µs)",
        _num(fifo.cpu_us_per_event, ".1f"),
        _num(fair.cpu_us_per_event, ".1f"),
    )
    row("events relayed", f"{fifo.events:,}", f"{fair.events:,}")
    row(
        "longest wait in the fake's own queue (ms)",
        _ms(fifo.upstream_queued_max_s, ".1f"),
        _ms(fair.upstream_queued_max_s, ".1f"),
    )
    row(
        "requests not served as planned",
        _errors(fifo.errors),
        _errors(fair.errors),
    )
    return rows


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(errors.items())) or "0"


def within_band_table(report: FairnessReport) -> list[str]:
    """With --fair-preempt-after: per system, B's and C's TTFT p99 under the flood against
    preempt_after plus twice their idle p99, the pauses, and the throughput."""
    if not report.within_band:
        return []
    fifo, fair = report.policies["fifo"], report.policies["fair"]
    rows = [
        f"| one band (every key in band 0) | FIFO | {fair_label(report)} |",
        "|---|---:|---:|",
    ]

    def row(label: str, pick: Any) -> None:
        rows.append(f"| {label} | {pick(fifo)} | {pick(fair)} |")

    for i, key in enumerate(INTERACTIVE):
        row(f"{key}: TTFT p99 under A's flood (ms)", lambda f, i=i: _ms(f.band_checks[i].p99_s))
        row(
            f"{key}: idle TTFT (no flood) p50 / p99 (ms)",
            lambda f, key=key: (
                f"{_ms(f.baseline[key].ttft_p50_s)} / {_ms(f.baseline[key].ttft_p99_s)}"
            ),
        )
        row(
            f"{key}: bound, preempt_after + 2 x idle p99 (ms); p99 within it",
            lambda f, i=i: (
                f"{_ms(f.band_checks[i].limit_s)}; "
                + ("within" if f.band_checks[i].passed else "**over**")
            ),
        )
    row("pauses under the flood (sluice_preemptions_total)", lambda f: f"{f.pauses:.0f}")
    row("continuations the upstream received", lambda f: f.continuations)
    row("throughput, all keys (tokens/s), mean of rounds", lambda f: _num(f.throughput, ",.0f"))
    check = report.throughput_check
    rounds = ", ".join(_num(r, ".3f") for r in report.throughput_rounds())
    rows.append(
        f"| throughput over FIFO's (round by round) | 1 | {_num(check.ratio, '.3f')} ({rounds}) |"
    )
    return rows


def within_band_check_lines(report: FairnessReport) -> list[str]:
    if not report.within_band:
        return []
    fifo, fair = report.policies["fifo"], report.policies["fair"]
    label = fair_label(report)
    lines = []
    for check, versus in zip(fair.band_checks, fifo.band_checks, strict=True):
        lines.append(
            f"One band, {label}, key {check.key}: TTFT p99 {_ms(check.p99_s)} ms under A's "
            f"flood <= preempt_after {_ms(check.preempt_after)} ms + 2 x "
            f"{_ms(check.idle_p99_s)} ms (its p99 with no flood) = {_ms(check.limit_s)} ms: "
            + _verdict(check.passed)
            + f" (FIFO: {_ms(versus.p99_s)} ms)"
        )
    ratio = report.throughput_check
    rounds = ", ".join(_num(r, ".3f") for r in report.throughput_rounds())
    lines.append(
        f"Throughput under the flood, {label} / FIFO: {_num(ratio.ratio, '.3f')} (round by "
        f"round: {rounds}) >= {THROUGHPUT_FLOOR:g}: " + _verdict(ratio.passed)
    )
    return lines


def check_lines(report: FairnessReport) -> list[str]:
    settings = report.run.settings
    lines = []
    for policy in POLICIES:
        figures = report.policies[policy]
        for check in figures.checks:
            lines.append(
                f"TTFT target, {policy}, key {check.key}: p99 {_ms(check.flood_p99_s)} ms under "
                f"the flood <= {TTFT_SLACK:g} x ({_ms(check.a_duration_s)} ms / {settings.slots}"
                f") + {_ms(check.baseline_p99_s)} ms with no flood = {_ms(check.limit_s)} ms: "
                + _verdict(check.passed)
            )
    for policy in POLICIES:
        for pair in report.policies[policy].pairs:
            f, g = pair.keys
            lines.append(
                f"VTC bound, {policy}, {f} vs {g}: {pair.max_difference:,.0f} <= "
                f"{pair.bound:,.0f} over {pair.seconds:.1f} s backlogged together: "
                + _verdict(pair.within)
            )
    for policy in POLICIES:
        figures = report.policies[policy]
        passed = sum(figures.flood[key].passed_by for key in INTERACTIVE)
        lines.append(
            f"Order, {policy}: {passed} of A's requests went upstream while one of B's or C's "
            "waited (0: each took the next slot to free): " + _verdict(passed == 0)
        )
    lines += within_band_check_lines(report)
    ratio = report.cpu_ratio
    rounds = ", ".join(_num(r, ".3f") for r in report.cpu_rounds())
    lines.append(
        f"CPU per event, fair / FIFO: {_num(ratio, '.3f')} (round by round: {rounds}) <= "
        f"{CPU_LIMIT:g}: " + _verdict(cpu_passed(ratio))
    )
    for policy in POLICIES:
        d = report.policies[policy].deadline
        lines.append(
            f"Deadlines, {policy}: {d.started_late} started after their deadline, "
            f"{d.expired_queued} expired in the queue with 504 (not 503 deadline_unmeetable), "
            f"{sum(d.other.values())} ended otherwise, {d.close_unseen} cancelled unseen "
            f"upstream, close p99 {_ms(d.close_p99_s, '.1f')} ms <= "
            f"{CANCEL_TARGET_S * 1000:g} ms: " + _verdict(d.passed)
        )
    return lines + preempt_check_lines(report)


def preempt_table(report: FairnessReport) -> list[str]:
    off, on = report.preemption["preempt-off"], report.preemption["preempt-on"]
    rows = ["| preemption (fair) | off | on |", "|---|---:|---:|"]

    def row(label: str, pick: Any) -> None:
        rows.append(f"| {label} | {pick(off)} | {pick(on)} |")

    def p50_p99(a: float | None, b: float | None) -> str:
        return f"{_ms(a)} / {_ms(b)}"

    row(
        "interactive, idle upstream: TTFT p50 / p99 (ms)",
        lambda f: p50_p99(f.idle.ttft_p50_s, f.idle.ttft_p99_s),
    )
    row(
        "interactive, the batch holding every slot: TTFT p50 / p99 (ms)",
        lambda f: p50_p99(f.urgent.ttft_p50_s, f.urgent.ttft_p99_s),
    )
    row(
        "of which its wait in Sluice's queue, p50 / p99 (ms)",
        lambda f: p50_p99(f.urgent.wait_p50_s, f.urgent.wait_p99_s),
    )
    row(
        "and its TTFT at the upstream, p50 / p99 (ms)",
        lambda f: p50_p99(f.urgent_upstream_ttft_p50_s, f.urgent_upstream_ttft_p99_s),
    )
    row(
        "its longest wait in the fake's own queue (ms)",
        lambda f: _ms(f.urgent_upstream_queued_max_s, ".1f"),
    )
    row("interactive requests served / sent", lambda f: f"{f.urgent.ok} / {f.urgent.requests}")
    row(
        "batch streams whole (the uninterrupted text) / sent",
        lambda f: f"{f.batch.whole} / {f.batch.streams}",
    )
    row("batch: first send to last end, mean of rounds (s)", lambda f: _s(f.batch.makespan_s))
    row("batch: a stream's send to end, mean (s)", lambda f: _s(f.batch.mean_s))
    row("pauses (sluice_preemptions_total)", lambda f: f"{f.preemptions:.0f}")
    row(
        "pauses in the batch's access lines; streams that saw `: paused`",
        lambda f: f"{f.access_pauses}; {f.batch.paused_seen}",
    )
    row("continuations the upstream received", lambda f: f.continuations)
    row(
        "pause length, mean (sluice_pause_seconds) (ms)",
        lambda f: _ms(f.mean_pause_s),
    )
    row("the most one stream was paused, in all (ms)", lambda f: _ms(f.longest_paused_s))
    row("requests not served as planned", lambda f: _errors(f.errors))
    return rows


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}"


def preempt_check_lines(report: FairnessReport) -> list[str]:
    check = report.preempt_check
    if check is None or not report.preemption:
        return []
    off = report.preemption["preempt-off"]
    lines = [
        f"Preemption, interactive TTFT p99: {_ms(check.p99_s)} ms with preemption <= "
        f"preempt_after {_ms(check.preempt_after)} ms + 2 x {_ms(check.idle_p99_s)} ms (its "
        f"p99 on an idle upstream) = {_ms(check.limit_s)} ms: "
        + _verdict(check.passed)
        + f" (without preemption: {_ms(off.urgent.ttft_p99_s)} ms, bounded only by a batch "
        "stream's end)"
    ]
    for variant in PREEMPT_VARIANTS:
        batch = report.preemption[variant].batch
        lines.append(
            f"Batch streams, {variant}: {batch.whole} of {batch.streams} completed with the "
            f"text of an uninterrupted answer ({batch.paused_seen} of them paused): "
            + _verdict(batch.passed)
        )
    on = report.preemption["preempt-on"]
    lines.append(
        f"Pauses: {on.preemptions:.0f} with preemption (0 < them), {off.preemptions:.0f} and "
        f"{off.continuations} continuations without (0): " + _verdict(report.pauses_passed)
    )
    return lines


def deadline_table(report: FairnessReport) -> list[str]:
    fifo, fair = report.policies["fifo"].deadline, report.policies["fair"].deadline
    rows = [f"| deadlines | FIFO | {fair_label(report)} |", "|---|---:|---:|"]

    def row(label: str, pick: Any) -> None:
        rows.append(f"| {label} | {pick(fifo)} | {pick(fair)} |")

    row("requests with a deadline", lambda d: d.requests)
    row("served", lambda d: d.served)
    row(
        "refused, 503 deadline_unmeetable (of which at once)",
        lambda d: f"{d.refused} ({d.refused_at_once})",
    )
    row(
        "cancelled at the deadline while running (of which in-band, after the head)",
        lambda d: f"{d.cancelled} ({d.cancelled_in_band})",
    )
    row(
        "never reached the upstream, yet 504 deadline_exceeded (its deadline passed while queued)",
        lambda d: d.expired_queued,
    )
    row("ended otherwise", lambda d: _errors(d.other))
    row("reached the upstream", lambda d: d.reached_upstream)
    row("reached the upstream after its client's deadline", lambda d: d.started_late)
    row("least time left at the upstream's receipt (ms)", lambda d: _ms(d.least_margin_s, ".1f"))
    row(
        "deadline to the upstream seeing the close, p50 / p99 (ms)",
        lambda d: f"{_ms(d.close_p50_s, '.2f')} / {_ms(d.close_p99_s, '.2f')}",
    )
    row("cancelled, the upstream never saw the close", lambda d: d.close_unseen)
    return rows


def queue_lines(report: FairnessReport) -> list[str]:
    """What Sluice counted as leaving its queue, per phase and policy."""
    lines = []
    for policy in POLICIES:
        for phase, outcomes in report.policies[policy].queue_outcomes.items():
            counted = ", ".join(
                f"{name} {count:.0f}" for name, count in sorted(outcomes.items()) if count
            )
            lines.append(f"{policy}, {phase}: {counted or 'none'}")
    return lines


def markdown(report: FairnessReport) -> str:
    run, settings, bound = report.run, report.run.settings, report.bound
    machine = run.machine
    after = settings.fair_preempt_after
    title = (
        "FIFO vs fair"
        if after is None
        else f"FIFO vs fair with preemption within one band (preempt_after {after:g} s)"
    )
    lines = [
        f"## Fair share under a flood: {title}, {settings.slots} slots",
        "",
        f"- Machine: {machine.get('cores')} cores ({machine.get('cpu') or 'unknown CPU'}), "
        f"{machine.get('system')}, Python {machine.get('python')}; load average "
        f"{machine.get('loadavg_1m')} as it began",
        f"- Date: {run.date}; commit: {run.commit or 'unknown'}; the whole run took "
        f"{run.seconds:.0f} s",
        f"- Command: `{run.command}`",
        f"- Load: {settings.describe()}",
        "- Systems: one fake upstream (`--max-running "
        f"{settings.slots}`) and two Sluice processes in front of it, the same config "
        f"(`max_connections = {settings.slots}`, keys A, B and C of weight 1) but for "
        '`[scheduling] policy` ("fifo", "fair")'
        + (
            ""
            if after is None
            else f", and the fair one's `preempt_after = {after:g}` (every other `[scheduling]` "
            "setting Sluice's default; every key in band 0, so its pauses are within the band)"
        )
        + "; every phase ran through one and then the other"
        + (", the order reversed each round" if settings.repeat > 1 else "")
        + ", each phase's requests all served before the next began",
        f"- Bound: `2 * max(w_in * L_in, w_out * M)` with w_in = {bound.w_in:g}, w_out = "
        f"{bound.w_out:g}, L_in = {bound.longest_input} tokens (the longest input, as Sluice "
        f"estimates it), M = {settings.slots} slots x {bound.batch_tokens // settings.slots} "
        f"tokens (the longest answer) = {bound.batch_tokens}: **{bound.value:,.0f}**",
        "",
        *flood_table(report),
        "",
        *(line for line in (*within_band_table(report), "") if report.within_band),
        *deadline_table(report),
        "",
        f"Preemption: {settings.describe_preemption()}. Two more Sluice processes, both fair "
        "and the same config but for `preempt_after` (0, and the bench's); through each, the "
        "interactive requests first alone (the idle TTFT), then beside the batch"
        + (", the order reversed each round" if settings.repeat > 1 else "")
        + ".",
        "",
        *preempt_table(report),
        "",
        *(f"- {line}" for line in check_lines(report)),
        "",
        "Left Sluice's queue, as its `sluice_queue_wait_seconds` counted (by outcome):",
        "",
        *(f"- {line}" for line in queue_lines(report)),
    ]
    return "\n".join(lines) + "\n"
