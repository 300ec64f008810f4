"""The first-token race: after ``hedge_after`` without a first token another replica gets the
same request; the first to produce its response head wins, and the losers are cancelled (their
streams closed, so their servers abort the work).

As Tower's ``hedge/``: a layer around the same :class:`~retry.Attempt` that
:class:`~retry.Retry` drives, chosen instead of it when the model hedges.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

import trio

from proxy.backends.upstream.retry import Attempt, RetryPolicy, log_retry
from proxy.backends.upstream.routing import ReplicaLoad
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import CompletionRequest
from proxy.protocol.scheduling import Ticket
from proxy.relay.body import Sink
from proxy.relay.state import Phase

log = logging.getLogger("sluice.upstream")


class Hedge:
    """Attempts that may overlap, at most ``max_attempts`` of them: a hedge once the first
    waited ``hedge_after``, and a retry for a retryable failure while no attempt has won."""

    def __init__(
        self,
        attempt: Attempt,
        policy: RetryPolicy,
        hedge_after: float,
        no_replica: Callable[[], ApiError],
        on_loser: Callable[[CompletionRequest], None] | None = None,
    ) -> None:
        # Told of each attempt that lost the race after reaching its upstream (its prompt
        # read for nobody).
        self._on_loser = on_loser
        self._attempt = attempt
        self._policy = policy
        self._max_attempts = policy.max_attempts
        self._hedge_after = hedge_after
        self._no_replica = no_replica

    async def __call__(
        self, request: CompletionRequest, request_id: str, sink: Sink, key: bytes = b""
    ) -> None:
        max_attempts = self._max_attempts
        race = _Race(sink)
        # The replicas the attempts went to (each appended as it is dispatched), and the
        # attempts launched: a hedge waiting in the queue has tried nothing yet.
        tried: list[ReplicaLoad] = []
        launched = 0
        outcomes_send, outcomes = trio.open_memory_channel[ApiError | None](max_attempts)
        final_error: ApiError | None = None
        # The request's ticket, for its first attempt; a hedge, or a retry while another
        # attempt may still hold it, waits with a companion, which pauses nothing.
        ticket = request.schedule.ticket()
        async with trio.open_nursery() as nursery:
            running = 0

            def launch() -> bool:
                nonlocal running, launched
                if launched >= max_attempts or not self._attempt.candidates(tried):
                    return False
                entrant_ticket = ticket if launched == 0 else ticket.companion()
                launched += 1
                running += 1
                nursery.start_soon(
                    self._enter,
                    tried,
                    key,
                    request,
                    request_id,
                    race,
                    outcomes_send,
                    entrant_ticket,
                )
                return True

            if not launch():
                final_error = self._no_replica()
            hedge_at = trio.current_time() + self._hedge_after
            while running and final_error is None:
                with trio.move_on_at(hedge_at if race.winner is None else math.inf):
                    outcome = await outcomes.receive()
                    running -= 1
                    if outcome is None:
                        break  # the winner streamed to the end
                    if running and self._policy.refused_by_queue(outcome):
                        # An attempt that got no slot (a hedge, when every other replica is
                        # busy): a second chance that did not come, not a failure of the
                        # request, whose other attempt goes on (and answers, or fails, itself).
                        continue
                    if race.winner is not None or not outcome.retryable:
                        # Failed mid-stream, or in a way no other replica would fix.
                        final_error = outcome
                    elif running:
                        pass  # the other attempt is still in the race
                    elif launch():
                        log_retry(request_id)
                    else:
                        final_error = outcome
                    continue
                # No first token within hedge_after: hedge, once. The timer was set before the
                # wait began, and a winner found during the wait does not move it: a stream that
                # began in time and is still going must not be hedged (its hedge would take a
                # slot elsewhere, and a refusal of it would end the stream).
                hedge_at = math.inf
                if race.winner is None and launch():
                    log.info("request %s: hedging (attempt %d)", request_id, launched)
            if final_error is not None:
                nursery.cancel_scope.cancel()
        if final_error is not None:
            raise final_error

    async def _enter(
        self,
        tried: list[ReplicaLoad],
        key: bytes,
        request: CompletionRequest,
        request_id: str,
        race: _Race,
        outcomes: trio.MemorySendChannel[ApiError | None],
        ticket: Ticket,
    ) -> None:
        with trio.CancelScope() as scope:
            entrant = race.enter(scope)
            outcome: ApiError | None = None
            try:
                await self._attempt(tried, key, request, request_id, entrant, ticket)
            except ApiError as error:
                outcome = error
            # Capacity max_attempts: never blocks. A loser was cancelled and reports nothing.
            outcomes.send_nowait(outcome)
        if scope.cancelled_caught and entrant.lost and entrant.reached and self._on_loser:
            self._on_loser(request)


class _Race:
    """Hedged attempts racing for one client: the first to produce its response head wins."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.winner: _Entrant | None = None
        # The furthest phase an entrant has reached: the request's, which a hedge that
        # starts over (queued, connecting) does not move back.
        self.phase = Phase.QUEUED
        self.entrants: list[_Entrant] = []

    def enter(self, scope: trio.CancelScope) -> _Entrant:
        entrant = _Entrant(self, scope)
        self.entrants.append(entrant)
        return entrant

    def claim(self, entrant: _Entrant) -> bool:
        if self.winner is None:
            self.winner = entrant
            for other in self.entrants:
                if other is not entrant:
                    other.scope.cancel()
        return self.winner is entrant


class _Entrant:
    """The sink one hedged attempt sees: it forwards only once it has won the race."""

    def __init__(self, race: _Race, scope: trio.CancelScope) -> None:
        self.race = race
        self.scope = scope
        # Whether its attempt got past Sluice's queue to its upstream.
        self.reached = False

    @property
    def started(self) -> bool:
        return self.race.winner is self

    @property
    def client_gone(self) -> bool:
        return self.race.sink.client_gone

    @property
    def lost(self) -> bool:
        """Another attempt won the race (this one is cancelled for it)."""
        winner = self.race.winner
        return winner is not None and winner is not self

    def set_phase(self, phase: Phase) -> None:
        if phase is Phase.CONNECTING:
            self.reached = True
        # Until a winner is known, the furthest of the entrants' phases is the request's.
        race = self.race
        if race.winner is None and _PHASES.index(phase) > _PHASES.index(race.phase):
            race.phase = phase
            race.sink.set_phase(phase)

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        if self.race.claim(self):
            self.race.sink.begin(status, content_type, headers, content_length=content_length)
        else:
            self.scope.cancel()

    def offer(self, chunk: bytes) -> bool:
        return self.race.winner is self and self.race.sink.offer(chunk)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        # Every attempt works for the same client: each is shut down if it leaves.
        self.race.sink.on_disconnect(callback)

    async def send(self, chunk: bytes) -> None:
        if self.race.winner is self:
            await self.race.sink.send(chunk)
        else:
            await trio.lowlevel.checkpoint()  # lost: our scope is cancelled, this raises


# The phases an attempt passes, in order (the relay itself sets those after them).
_PHASES = (Phase.QUEUED, Phase.CONNECTING, Phase.HEAD, Phase.FIRST_TOKEN)
