"""Attempts before the first byte: which failures retry on another replica, and which count
against the replica that failed.

As Tower's ``retry/policy.rs``: a :class:`RetryPolicy` answers the questions, an
:class:`Attempt` is the service it retries (one try on one replica, with its health verdict),
and :class:`Retry` is the loop that composes them. Retries go to another replica and happen
only before anything has been sent to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from proxy.backends.upstream.exchange import UpstreamExchange
from proxy.backends.upstream.replica import UpstreamReplica
from proxy.backends.upstream.routing import LeastBusyRouter, ReplicaLoad
from proxy.protocol.continuation import StreamSplice
from proxy.protocol.errors import ApiError
from proxy.protocol.openai import CompletionRequest
from proxy.protocol.scheduling import Ticket
from proxy.protocol.token_usage import CURRENT_METER, UsageMeter
from proxy.relay.admission import Admission, Lease, Room
from proxy.relay.body import Sink
from proxy.relay.state import Phase

log = logging.getLogger("sluice.upstream")

# The proxy's own queue refusing a request: not the replica's fault.
_QUEUE_REFUSALS = frozenset({"queue_full", "queue_timeout", "deadline_unmeetable"})

# The router's pick among replicas that have room (for a request's affinity key), or None.
Choose = Callable[[Sequence[ReplicaLoad], bytes], ReplicaLoad | None]


@dataclass(frozen=True)
class RetryPolicy:
    """One model's answers to a failed attempt: try again elsewhere? blame the replica?"""

    max_attempts: int

    def attempts(self, replicas: int) -> int:
        """How many replicas a request may try, one after the other."""
        return min(self.max_attempts, replicas)

    @staticmethod
    def retries(error: ApiError, sink: Sink) -> bool:
        """Another replica may fix ``error``: nothing has reached the client, the error says
        so, and the client is still there."""
        return error.retryable and not sink.started and not sink.client_gone

    @staticmethod
    def refused_by_queue(error: ApiError) -> bool:
        """``error`` is Sluice's own queue refusing the attempt: it reached no replica."""
        return error.code in _QUEUE_REFUSALS

    @staticmethod
    def blames_replica(error: ApiError, sink: Sink) -> bool:
        """``error`` is a failure verdict on its replica: not the proxy's own queue being full
        or too slow, and not a failure seen after the client left (what the cancellation
        broke says nothing about the server)."""
        return error.code not in _QUEUE_REFUSALS and not sink.client_gone

    @staticmethod
    def counts(error: ApiError, sink: Sink) -> bool:
        """``error`` goes into ``sluice_upstream_errors_total``: a failure the replica is
        blamed for (the queue's refusals are counted where they happen)."""
        return not sink.client_gone


class Attempt:
    """One try on one replica, with its health verdict: a slot in Sluice's queue on one of the
    replicas not yet tried (the first to have room for it in the queue's order; among several
    with room, the router's choice), the exchange, and the router told how it went.

    A stream that can be continued (``resumable``, and :meth:`StreamSplice.of` says so) may be
    paused for a more urgent request: its exchange is cancelled at an event boundary (the
    upstream closed as for a client that left), its slot given up, and once it holds one again
    (on any replica of the model, the one it left first if it has room) its continuation goes
    out and is spliced into the client's stream. Its client sees one answer with a pause.
    Only while the queue preempts: otherwise nothing of the answer is kept."""

    def __init__(
        self,
        exchange: UpstreamExchange,
        router: LeastBusyRouter,
        admission: Admission,
        replicas: Sequence[UpstreamReplica],
        policy: RetryPolicy,
        count_error: Callable[[ApiError], None],
        choose: Choose,
        *,
        resumable: bool = False,
        no_replica: Callable[[], ApiError] | None = None,
    ) -> None:
        self._resumable = resumable
        # The refusal of a paused stream none of whose replicas can take it again.
        self._no_replica = no_replica
        self._exchange = exchange
        self._policy = policy
        self._router = router
        self._admission = admission
        self._replicas = list(replicas)
        self._by_room = {replica.room: replica for replica in self._replicas}
        self._count_error = count_error
        self._choose = choose

    def _replica(self, room: Room) -> UpstreamReplica:
        """The replica behind ``room``: this backend's, or (a room it did not know: a paused
        stream continued after a reload) the one the config now served built for it."""
        replica = self._by_room.get(room)
        if replica is None:
            assert isinstance(room.owner, UpstreamReplica)
            replica = room.owner
        return replica

    def _healthy_rooms(self) -> list[Room]:
        """The rooms of the model as the config now served has it (a reload may have changed
        its replicas) whose replica is not ejected: where a paused stream may go on."""
        now = trio.current_time()
        return [
            room
            for room in self._admission.rooms
            if not room.retired
            and isinstance(room.owner, UpstreamReplica)
            and not room.owner.load.ejected(now)
        ]

    def _unservable(self) -> ApiError | None:
        """Why a paused stream can never go on (every replica of the model ejected, or gone),
        or None: checked at each look while it waits, so that it fails at once rather than
        sending comments until a timeout."""
        if self._no_replica is None or self._healthy_rooms():
            return None
        return self._no_replica()

    def candidates(self, tried: Sequence[ReplicaLoad]) -> list[UpstreamReplica]:
        """The replicas an attempt may still go to: not tried, and not ejected."""
        now = trio.current_time()
        return [
            replica
            for replica in self._replicas
            if replica.load not in tried and not replica.load.ejected(now)
        ]

    async def __call__(
        self,
        tried: list[ReplicaLoad],
        key: bytes,
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        ticket: Ticket,
    ) -> None:
        """Try once, as ``ticket`` (the request's, kept across its attempts); the replica it
        went to is appended to ``tried`` as it is dispatched."""
        candidates = self.candidates(tried)
        by_room = self._by_room

        def choose(open_rooms: Sequence[Room]) -> Room | None:
            load = self._choose([by_room[room].load for room in open_rooms], key)
            return None if load is None else next(r for r in open_rooms if by_room[r].load is load)

        sink.set_phase(Phase.QUEUED)
        meter = CURRENT_METER.get()
        preempts = self._admission.dispatcher.queue.settings.preempts
        splice = (
            StreamSplice.of(request)
            if self._resumable and preempts and meter is not None and ticket.may_preempt
            else None
        )
        try:
            lease = self._admission.lease(ticket, [replica.room for replica in candidates], choose)
            async with lease as held:
                assert held.room is not None
                if splice is None or meter is None:
                    if meter is not None:
                        # Its tokens counted for its key's fair share as they stream.
                        self._admission.dispatcher.track(
                            ticket, meter.output_so_far, room=held.room
                        )
                    await self._on(self._replica(held.room), tried, request, request_id, sink)
                    return
                await self._pausable(held, tried, request, request_id, sink, splice, meter)
        except ApiError as error:
            if error.code in _QUEUE_REFUSALS:
                self._count_error(error)
            raise

    async def _pausable(
        self,
        lease: Lease,
        tried: list[ReplicaLoad],
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        splice: StreamSplice,
        meter: UsageMeter,
    ) -> None:
        """The exchange of a stream that may be paused, and its continuations, each in the
        slot the lease holds then, until one runs to its end."""
        ticket = lease.ticket
        dispatcher = self._admission.dispatcher
        outgoing = request
        while True:
            assert lease.room is not None
            pause = _PauseAtBoundary(splice)
            dispatcher.track(
                ticket,
                meter.output_so_far,
                room=lease.room,
                pause=pause,
                counted=meter.output_so_far() if splice.pieces else 0,
            )
            continuing = splice.pieces > 0 and sink.started
            with pause.scope:
                await self._on(
                    self._replica(lease.room),
                    tried,
                    outgoing,
                    request_id,
                    _Continuing(sink) if continuing else sink,
                    splice,
                )
            if not pause.scope.cancelled_caught:
                return
            splice.paused()
            sink.set_phase(Phase.PAUSED)
            # Its own replica first when it has room (its prefix cache holds the answer so
            # far), else whichever of the model's replicas (not ejected) has room first.
            left = lease.room
            healthy = self._healthy_rooms()
            if not healthy and self._no_replica is not None:
                # Every replica ejected: waiting for a slot would only send comments until a
                # timeout; the client hears why now, in-band.
                lease.give_up()
                raise self._no_replica()
            rooms = [
                *([left] if not left.retired else []),
                *(room for room in healthy if room is not left),
            ]
            # Comments only into a stream that has begun: before its head, a failure may still
            # answer with a JSON error, which nothing may precede.
            # Its prompt is prefilled again on resuming, the answer so far with it: its key's
            # counter is charged for that, as for any input.
            await lease.pause(
                rooms,
                sink.offer if sink.started else _nothing,
                input_tokens=request.schedule.input_tokens + splice.tokens,
                fail_if=self._unservable,
            )
            if splice.started:
                sink.set_phase(Phase.MID_STREAM)
            outgoing = splice.continuation()

    async def _on(
        self,
        replica: UpstreamReplica,
        tried: list[ReplicaLoad],
        request: CompletionRequest,
        request_id: str,
        sink: Sink,
        splice: StreamSplice | None = None,
    ) -> None:
        load = replica.load
        tried.append(load)
        if load.half_open(trio.current_time()):
            load.probing = True  # its one probe
        load.in_flight += 1
        verdict = False
        try:
            sink.set_phase(Phase.CONNECTING)
            await self._exchange(replica, request, request_id, sink, splice)
            self._router.success(load)
            verdict = True
        except ApiError as error:
            if self._policy.blames_replica(error, sink):
                self._router.failure(load, trio.current_time())
                load.last_failure = f"{error.code}: {error.message}"
                verdict = True
                log_failure(request_id, load, error, started=sink.started)
            if self._policy.counts(error, sink):
                self._count_error(error)
            raise
        finally:
            load.in_flight -= 1
            if not verdict:
                # Cancelled (client left, lost a hedge race) or stalled: says nothing about
                # the replica, but a probe slot it held must be released.
                self._router.release_probe(load)


def _nothing(_: bytes) -> None:
    pass


class _PauseAtBoundary:
    """How the dispatcher pauses one upstream exchange (a :class:`Pausable`): its scope is
    cancelled, which is at an event boundary by construction (what the client was handed is
    recorded only once handed, and a cancelled hand-off hands nothing)."""

    __slots__ = ("scope", "splice")

    def __init__(self, splice: StreamSplice) -> None:
        self.splice = splice
        self.scope = trio.CancelScope()

    def ask(self) -> bool:
        if not self.splice.pausable():
            return False
        self.scope.cancel("paused for a more urgent request")
        return True

    def withdraw(self) -> bool:
        # The ask cancelled the exchange at once: it is stopping within a few task steps.
        return False


class _Continuing:
    """A paused stream's sink while its continuation runs: the client's stream is in its
    middle, whatever the continuation's own exchange goes through (connecting, its first
    token), so the phase it reports stays where it is."""

    __slots__ = ("_sink",)

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    @property
    def started(self) -> bool:
        return self._sink.started

    @property
    def client_gone(self) -> bool:
        return self._sink.client_gone

    def set_phase(self, phase: Phase) -> None:
        pass

    def offer(self, chunk: bytes) -> bool:
        return self._sink.offer(chunk)

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        self._sink.on_disconnect(callback)

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        self._sink.begin(status, content_type, headers, content_length=content_length)

    async def send(self, chunk: bytes) -> None:
        await self._sink.send(chunk)


class Retry:
    """Attempts one after the other, each on a replica not yet tried, while the policy says
    another may fix what failed; the client hears of every replica that was tried."""

    def __init__(
        self,
        attempt: Attempt,
        policy: RetryPolicy,
        replicas: int,
        no_replica: Callable[[], ApiError],
    ) -> None:
        self._attempt = attempt
        self._policy = policy
        self._attempts = policy.attempts(replicas)
        self._no_replica = no_replica

    async def __call__(
        self, request: CompletionRequest, request_id: str, sink: Sink, key: bytes = b""
    ) -> None:
        tried: list[ReplicaLoad] = []
        failures: list[str] = []
        last_error: ApiError | None = None
        attempts = self._attempts
        # One ticket for all its attempts: a retry keeps its age and its pauses.
        ticket = request.schedule.ticket()
        for _ in range(attempts):
            if not self._attempt.candidates(tried):
                break
            before = len(tried)
            try:
                await self._attempt(tried, key, request, request_id, sink, ticket)
                return
            except ApiError as error:
                # Refused by Sluice's own queue (no replica reached): nothing to retry.
                if len(tried) == before or not self._policy.retries(error, sink):
                    raise
                last_error = error
                failures.append(error.message)  # it names the replica (never by address)
                if len(tried) < attempts:
                    log_retry(request_id)
        if last_error is None:
            raise self._no_replica()
        if len(failures) > 1:
            # The client hears of every replica that was tried, not just the last one.
            last_error.message = "every replica tried failed: " + "; ".join(failures)
            last_error.args = (last_error.message,)
        raise last_error


def log_failure(request_id: str, load: ReplicaLoad, error: ApiError, *, started: bool) -> None:
    """Every failure an attempt's replica is blamed for, retried or not. The client's error
    names the replica by its place in the model's table, never by its address: the address is
    the operator's, here (the access line of the request id has the rest)."""
    log.warning(
        "request %s: upstream %s failed %s (%s)",
        request_id,
        load.url,
        "mid-stream" if started else "before the first byte",
        error.code,
    )


def log_retry(request_id: str) -> None:
    # The failure is logged already, with its replica (log_failure).
    log.info("request %s: trying another replica", request_id)
