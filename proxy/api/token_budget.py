"""Per-key token budgets (``[[keys]] tokens_per_minute``, ``tokens_per_day``): what a request
reserves when it is admitted, what it is charged when it ends, and how a refusal reads.

A request is admitted while each of its key's windows has room (less used than the limit),
and reserves at once its input (estimated) and its output maximum: what it asks for, lowered
to ``max_tokens_cap``, or the cap, or :data:`~proxy.protocol.token_usage.DEFAULT_RESERVED_OUTPUT`
(a local model: its ``default_max_tokens``). When it ends, the reservation settles to what it
used (:class:`~proxy.protocol.token_usage.UsageMeter`). A charge counts at its admission's
time: it leaves a window ``period`` seconds after the request was admitted.

In memory (this module's :class:`TokenWindow`, sans-IO: times are arguments) or through Redis
(:mod:`proxy.api.limits`, on the server's clock). A reservation whose worker died is never
settled: it stays charged in full. That is the conservative choice, and it closes the dodge
of a client that kills what serves it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.config import KeyConfig
from proxy.protocol.errors import RATE_LIMIT, ApiError
from proxy.protocol.openai import CompletionRequest
from proxy.protocol.rewrite import with_edits
from proxy.protocol.token_usage import (
    CURRENT_METER,
    DEFAULT_RESERVED_OUTPUT,
    Usage,
    UsageMeter,
    cap_edits,
    estimate_input_tokens,
    generates,
    meters,
    requested_output,
    usage_edits,
)

if TYPE_CHECKING:
    from proxy.ops.logs import AccessRecord
    from proxy.ops.metrics import Metrics
    from proxy.relay.body import Producer, RelayBody, RelaySink

MINUTE = 60.0
DAY = 86_400.0
# OpenAI's header names, which the SDKs read (exposed to browsers too: CORS_EXPOSED_HEADERS).
LIMIT_HEADER = "x-ratelimit-limit-tokens"
REMAINING_HEADER = "x-ratelimit-remaining-tokens"
RESET_HEADER = "x-ratelimit-reset-tokens"


class Charge:
    """One request's tokens in its key's windows: its reservation, then what it used."""

    __slots__ = ("at", "tokens")

    def __init__(self, at: float, tokens: int) -> None:
        self.at = at
        self.tokens = tokens


class TokenWindow:
    """At most ``limit`` tokens charged in any ``period`` seconds, exactly (a sliding log of
    charges, one per request still inside the window)."""

    def __init__(self, limit: int, period: float) -> None:
        self.limit = limit
        self.period = period
        self.used = 0
        self._charges: deque[Charge] = deque()
        # Charges at or before this time have left (and been subtracted): a settlement of one
        # of them changes nothing here.
        self._cut = -math.inf

    def _expire(self, now: float) -> None:
        cut = now - self.period
        charges = self._charges
        while charges and charges[0].at <= cut:
            self.used -= charges.popleft().tokens
        self._cut = max(self._cut, cut)

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the window has room; 0.0 when it has room now."""
        self._expire(now)
        if self.used < self.limit:
            return 0.0
        need, freed = self.used - self.limit + 1, 0
        for charge in self._charges:
            freed += charge.tokens
            if freed >= need:
                return charge.at + self.period - now
        return self.period

    def remaining(self, now: float) -> int:
        self._expire(now)
        return max(0, self.limit - self.used)

    def add(self, charge: Charge) -> None:
        self._charges.append(charge)
        self.used += charge.tokens

    def settle(self, charge: Charge, tokens: int) -> None:
        """``charge`` becomes ``tokens`` here, if it is still inside the window."""
        if charge.at > self._cut:
            self.used += tokens - charge.tokens


class KeyBudget:
    """A key's token windows in this process: the minute's and the day's, those it has."""

    __slots__ = ("day", "minute")

    def __init__(self, key: KeyConfig) -> None:
        self.minute = TokenWindow(key.tokens_per_minute, MINUTE) if key.tokens_per_minute else None
        self.day = TokenWindow(key.tokens_per_day, DAY) if key.tokens_per_day else None

    def windows(self) -> list[TokenWindow]:
        return [window for window in (self.minute, self.day) if window is not None]

    def check(self, key: KeyConfig, now: float) -> None:
        """Raise the 429 of the window that waits longest, if any is full."""
        full = [(window.wait(now), window) for window in self.windows()]
        wait, window = max(full, key=lambda pair: pair[0], default=(0.0, None))
        if window is not None and wait > 0:
            raise token_limited(key, window.limit, window.period, 0, wait)

    def reserve(self, now: float, tokens: int) -> Charge:
        charge = Charge(now, tokens)
        for window in self.windows():
            window.add(charge)
        return charge

    def settle(self, charge: Charge, tokens: int) -> None:
        for window in self.windows():
            window.settle(charge, tokens)
        charge.tokens = tokens

    def resized(self, key: KeyConfig) -> None:
        """After a reload: the new limits, the charges kept (a reload frees no tokens)."""
        for name, limit, period in (
            ("minute", key.tokens_per_minute, MINUTE),
            ("day", key.tokens_per_day, DAY),
        ):
            window = getattr(self, name)
            if not limit:
                setattr(self, name, None)
            elif window is None:
                setattr(self, name, TokenWindow(limit, period))
            else:
                window.limit = limit


def token_limited(
    key: KeyConfig, limit: int, period: float, remaining: int, wait: float
) -> ApiError:
    """The 429 of a key over a token budget; ``wait``: until the window has room."""
    per = "minute" if period <= MINUTE else "day"
    return ApiError(
        429,
        f"Token limit reached for key {key.name!r}: {limit} tokens per {per} "
        f"({key.tokens_counted} tokens counted). Retry in {wait:.1f}s.",
        type=RATE_LIMIT,
        code="token_limit_exceeded",
        headers={
            "Retry-After": str(max(1, math.ceil(wait))),
            LIMIT_HEADER: str(limit),
            REMAINING_HEADER: str(max(0, remaining)),
            RESET_HEADER: reset_text(wait),
        },
    )


def reset_text(seconds: float) -> str:
    """A wait as OpenAI writes ``x-ratelimit-reset-tokens``: ``"20ms"``, ``"1.5s"``,
    ``"6m0s"``, ``"1h2m3s"``."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, secs = divmod(math.ceil(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


@dataclass
class Metered:
    """One metered request (every request that generates: its tokens are counted for its
    access line, its trace, and the scheduler's fair share): its meter, what it reserved
    (a key with a token budget), and (once it ended) what it used."""

    # Its key, when the key has a token budget or cap (the budget is charged); else None.
    key: KeyConfig | None
    model: str
    meter: UsageMeter
    reserved_output: int
    reservation: int
    usage: Usage | None = None
    # What the key is charged: the reservation until the producer ends.
    charged: int = 0

    def __post_init__(self) -> None:
        self.charged = self.reservation

    def ended(self, *, client_left: bool, failed: str | None) -> None:
        """The producer ended: what it used, and what the key is charged for it."""
        self.usage = self.meter.usage(self.reserved_output, client_left=client_left, failed=failed)
        self.charged = self.usage.charge("total" if self.key is None else self.key.tokens_counted)

    def closed(self, body: RelayBody, access: AccessRecord, metrics: Metrics) -> None:
        """The relay closed: the tokens in the access line and sluice_key_tokens_total. Of
        an upstream's stream, those for nobody are the events still queued for a client that
        left (the upstream itself is stopped at once)."""
        facts = self.meter.facts
        usage = self.usage
        trace = access.trace
        if trace is not None and not self.meter.local:
            if facts.output_tokens is not None:
                trace.reported_usage(facts.input_tokens, facts.output_tokens)
            elif usage is not None:
                # No usage block from the upstream: Sluice's own count (its deltas, the
                # prompt's estimate), so that every trace says what the request used.
                trace.reported_usage(usage.input, usage.output)
        if usage is None:
            return
        for_nobody = usage.for_nobody
        if access.guard_waste is not None:
            # Refused by a guard: what it held when it refused, and what the upstream made
            # after the verdict, before it stopped.
            for_nobody = min(usage.output, access.guard_waste)
        elif body.cancelled and not self.meter.streamed and not body.complete:
            # A whole answer not handed to its client's socket whole: none of it reached
            # anyone, whether it was made (by a local model, or an upstream's answer still
            # queued) or never came (its charged reservation).
            for_nobody = usage.output
        elif not self.meter.local and body.cancelled:
            # What was handed on but never reached the client: a stream's tokens in the events
            # still queued, and those its guards still held.
            unsent_tokens = self.meter.tokens_in(body.account.unsent)
            for_nobody = min(usage.output, unsent_tokens + access.guard_withheld)
        elif body.cut_in_prefill:
            # Cut at its deadline before a first byte: what was made for nobody is the prompt
            # the engine read (as for a hedge's loser), or a whole answer's charged reservation.
            for_nobody = max(usage.input, usage.for_nobody)
        access.tokens = (usage.input, usage.output, for_nobody, usage.estimated)
        if for_nobody:
            metrics.tokens_for_nobody.labels(access.key_label, self.model, waste_cause(body)).inc(
                for_nobody
            )
        if self.key is None:
            return  # no budget to show it against
        counter = metrics.key_tokens
        name = self.key.name
        for kind, tokens in (
            ("input", usage.input),
            ("output", usage.output),
            ("for_nobody", for_nobody),
        ):
            if tokens:
                counter.labels(name, self.model, kind).inc(tokens)


def waste_cause(body: RelayBody) -> str:
    """Why tokens of ``body``'s request went to nobody (sluice_tokens_for_nobody's cause)."""
    if body.access is not None and body.access.guard_waste is not None:
        return "guard"
    if body.stalled:
        return "stall"
    if body.deadline_passed:
        return "deadline"
    if body.client_gone:
        return "client_left"
    return "shutdown"


def metered_request(
    request: CompletionRequest,
    key: KeyConfig | None,
    *,
    upstream: bool,
    default_output: int = DEFAULT_RESERVED_OUTPUT,
) -> tuple[CompletionRequest, Metered | None]:
    """``request`` as it goes to its backend, and its :class:`Metered` (None: a pass-through,
    whose format is not Sluice's to read): for a key with a token budget or cap, held to
    ``max_tokens_cap``; upstream, a stream asked for its usage block (left out of what the
    client gets, unless it asked for it too). Through protocol.rewrite's edits of the body:
    one re-serialisation per request, none per event."""
    if not meters(request.endpoint):
        return request, None
    budgeted = key if key is not None and key.token_budgeted else None
    edits = cap_edits(request, 0 if budgeted is None else budgeted.max_tokens_cap)
    strip = False
    if upstream:
        usage = usage_edits(request)
        strip = bool(usage)
        edits.update(usage)
    request = with_edits(request, edits)
    asked = requested_output(request)
    cap = 0 if budgeted is None else budgeted.max_tokens_cap
    output = asked if asked is not None else (cap or default_output)
    if not generates(request.endpoint):
        output = 0  # embeddings: input only
    estimated_input = estimate_input_tokens(request.body)
    meter = UsageMeter(
        request.endpoint,
        streamed=request.stream,
        estimated_input=estimated_input,
        strip_usage=strip,
        local=not upstream,
    )
    if budgeted is None:
        reservation = 0
    elif budgeted.tokens_counted == "output":
        reservation = output
    else:
        reservation = estimated_input + output
    return request, Metered(budgeted, request.model, meter, output, reservation)


def metered_producer(produce: Producer, metered: Metered) -> Producer:
    """``produce`` with its meter set for its task and those it starts (the upstream exchange,
    the local model); however it ends, ``metered`` then knows what it used."""

    async def metering(sink: RelaySink) -> None:
        token = CURRENT_METER.set(metered.meter)
        failed: str | None = None
        try:
            await produce(sink)
        except ApiError as error:
            failed = error.code
            raise
        finally:
            CURRENT_METER.reset(token)
            metered.ended(client_left=sink.client_gone, failed=failed)

    return metering
