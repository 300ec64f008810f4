"""One replica's vLLM KV events, received: a ZeroMQ SUB socket on its publisher, each batch
decoded (:mod:`proxy.protocol.kv_events`) and applied to the replica's
:class:`~proxy.protocol.kv_cache.BlockIndex`.

ZeroMQ on trio (:mod:`proxy.zmq_trio`): the socket is non-blocking and polled on the event
loop, not read in a thread, so a cancelled subscriber is gone at once, with its socket. Each
batch is followed by a checkpoint, so a busy publisher never starves the loop.

A gap in the sequence numbers (the SUB socket dropped what it could not hold, the network
lost a connection) asks the replay endpoint for the missing batches (a DEALER socket, one per
replay, so that no late answer of an earlier one is ever read); without one, or when it no
longer holds them, the replica's index is emptied, and that is logged and counted. A number
that does not follow the last (the engine restarted) empties it too. Anything malformed, or a
socket error, restarts the subscription after a backoff (:func:`backoff_seconds`), the index
emptied, since events were lost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import trio
import zmq

from proxy.ops.metrics import Metrics
from proxy.protocol.kv_cache import Applied, BlockIndex, EventBatch, SequenceCheck
from proxy.protocol.kv_events import (
    END_SEQ,
    KvEventsError,
    decode_batch,
    decode_frames,
    decode_seq,
    encode_seq,
)
from proxy.zmq_trio import close, receive

log = logging.getLogger("sluice.upstream")

# A replay's answers (every buffered batch since the gap, then the end marker) must all come
# within this many seconds; past it the gap is handled as one that cannot be replayed.
REPLAY_SECONDS = 2.0
# Backoff between two subscriptions of one replica after a failure: doubled from the first,
# up to the last.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 30.0
# A subscription that ran this long before it failed was a healthy one: the next failure's
# backoff starts again from BACKOFF_FIRST.
HEALTHY_SECONDS = 60.0

GapOutcome = Literal["replayed", "dropped", "restart"]


def backoff_seconds(failures: int) -> float:
    """The wait before the next subscription after ``failures`` in a row (1 or more)."""
    return min(BACKOFF_MAX, BACKOFF_FIRST * 2.0 ** max(0, failures - 1))


class KvEventsObserver(Protocol):
    """What a subscriber reports (the metrics behind it); every call is cheap and sync."""

    def batch(self, applied: Applied, indexed: int) -> None:
        """A batch applied; ``indexed``: the blocks the index holds after it."""

    def gap(self, outcome: GapOutcome) -> None:
        """A gap in the sequence numbers: replayed, dropped (the index emptied), or the
        publisher restarted (emptied too)."""

    def restart(self) -> None:
        """The subscription failed and will be made again after a backoff."""


class MetricsObserver:
    """:class:`KvEventsObserver` into the sluice_kv_* metrics of one model's replica."""

    def __init__(self, metrics: Metrics, model: str, replica: str) -> None:
        self._batches = metrics.kv_event_batches.labels(model, replica)
        self._indexed = metrics.kv_indexed_blocks.labels(model, replica)
        self._restarts = metrics.kv_subscriber_restarts.labels(model, replica)
        self._blocks = {
            change: metrics.kv_blocks.labels(model, replica, change)
            for change in ("stored", "removed", "skipped", "evicted")
        }
        self._gaps = {
            outcome: metrics.kv_event_gaps.labels(model, replica, outcome)
            for outcome in ("replayed", "dropped", "restart")
        }

    def batch(self, applied: Applied, indexed: int) -> None:
        self._batches.inc()
        for change in ("stored", "removed", "skipped", "evicted"):
            count = getattr(applied, change)
            if count:
                self._blocks[change].inc(count)
        self._indexed.set(indexed)

    def gap(self, outcome: GapOutcome) -> None:
        self._gaps[outcome].inc()

    def restart(self) -> None:
        self._restarts.inc()
        self._indexed.set(0)


class NoObserver:
    def batch(self, applied: Applied, indexed: int) -> None:
        pass

    def gap(self, outcome: GapOutcome) -> None:
        pass

    def restart(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Publisher:
    """Where one replica publishes: its PUB endpoint, and its replay (ROUTER) endpoint or
    ""."""

    endpoint: str
    replay: str = ""


def publisher_of(
    root_url: str, port: int, replay_port: int, endpoint: str = "", replay_endpoint: str = ""
) -> Publisher:
    """A replica's publisher: ``endpoint`` when given, else ``port`` on its URL's host; its
    replay socket ``replay_endpoint`` when given, else ``replay_port`` (0: none) on the
    events' host."""
    import httpx

    host = httpx.URL(endpoint).host if endpoint else httpx.URL(root_url).host
    where = f"[{host}]" if ":" in host else host
    main = endpoint or f"tcp://{where}:{port}"
    if replay_endpoint:
        return Publisher(main, replay_endpoint)
    return Publisher(main, f"tcp://{where}:{replay_port}" if replay_port and host else "")


class KvEventSubscriber:
    """One replica's subscription, restarted after failures, for the server's life."""

    def __init__(
        self,
        name: str,
        publisher: Publisher,
        index: BlockIndex,
        observer: KvEventsObserver | None = None,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.name = name
        self.publisher = publisher
        self.index = index
        self.observer: KvEventsObserver = observer or NoObserver()
        self._context = context or zmq.Context.instance()
        self._clock = clock
        self.sequence = SequenceCheck()
        self._subscribed = False

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe until cancelled: a failed subscription is made again after
        :func:`backoff_seconds`, the index emptied (what came meanwhile is lost). Started
        (``task_status``) once the first socket is connected."""
        failures = 0
        while True:
            began = self._clock()
            problem = "ended"
            try:
                await self.subscribe(task_status)
            except (zmq.ZMQError, KvEventsError) as error:
                problem = f"{type(error).__name__}: {error}"
            task_status = trio.TASK_STATUS_IGNORED
            failures = 1 if self._clock() - began >= HEALTHY_SECONDS else failures + 1
            delay = backoff_seconds(failures)
            self.index.clear()
            # Until the next subscription is up, the router judges the replica by what was
            # routed there.
            self.index.complete_since = None
            self.sequence = SequenceCheck()
            self.observer.restart()
            log.warning(
                "%s: KV events from %s failed (%s); index emptied, subscribing again in %gs",
                self.name,
                self.publisher.endpoint,
                problem,
                delay,
            )
            await trio.sleep(delay)

    async def subscribe(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """One subscription: receive and apply batches until an error ends it."""
        socket = self._context.socket(zmq.SUB)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(self.publisher.endpoint)
            # The first subscription sees every block stored since this process could route
            # anything there; a later one follows a failure, after which the replica may still
            # hold what was routed there meanwhile.
            self.index.complete_since = self._clock() if self._subscribed else -math.inf
            self._subscribed = True
            task_status.started()
            while True:
                seq, payload = decode_frames(await receive(socket))
                await self._received(seq, decode_batch(payload))
                # A publisher that never pauses must not hold the loop.
                await trio.lowlevel.checkpoint()
        finally:
            close(socket)

    async def _received(self, seq: int, batch: EventBatch) -> None:
        verdict = self.sequence.see(seq)
        if verdict == "gap":
            assert self.sequence.last is not None
            missed = await self._replay(self.sequence.last + 1, seq)
            if missed is None:
                self._lost()
                self._gap("dropped", seq)
            else:
                for each in missed:
                    self._apply(each)
                self._gap("replayed", seq)
        elif verdict == "restart":
            self._lost()
            if seq == 0:
                # The engine started again and none of its events was missed: its cache is
                # exactly what the index will hold, and what was routed before is gone.
                self.index.complete_since = -math.inf
            self._gap("restart", seq)
        self.sequence.accept(seq)
        self._apply(batch)

    def _lost(self) -> None:
        """Events were lost: the index starts again from what arrives next, and until it has
        run unbroken for a while the router adds what was routed there."""
        self.index.clear()
        self.index.complete_since = self._clock()

    def _apply(self, batch: EventBatch) -> None:
        applied = self.index.apply(batch)
        self.observer.batch(applied, len(self.index))

    def _gap(self, outcome: GapOutcome, seq: int) -> None:
        self.observer.gap(outcome)
        said = {
            "replayed": "replayed the missed batches",
            "dropped": "could not replay them: index emptied until new blocks arrive",
            "restart": "the publisher started again: index emptied",
        }[outcome]
        log.warning(
            "%s: KV events from %s jumped from %s to %d; %s",
            self.name,
            self.publisher.endpoint,
            self.sequence.last,
            seq,
            said,
        )

    async def _replay(self, start: int, stop: int) -> list[EventBatch] | None:
        """The batches ``start .. stop - 1`` from the replay endpoint, or None when there is
        none, or it does not hold them all within REPLAY_SECONDS."""
        if not self.publisher.replay:
            return None
        wanted: dict[int, EventBatch] = {}
        socket = self._context.socket(zmq.DEALER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.publisher.replay)
            socket.send_multipart([b"", encode_seq(start)], zmq.NOBLOCK)
            with trio.move_on_after(REPLAY_SECONDS):
                while True:
                    frames = await receive(socket)
                    if len(frames) != 3:
                        raise KvEventsError(f"a replay answer has 3 frames, not {len(frames)}")
                    seq = decode_seq(frames[1])
                    if seq == END_SEQ or seq >= stop:
                        break
                    if seq >= start:
                        wanted[seq] = decode_batch(frames[2])
        except zmq.Again:
            return None
        finally:
            close(socket)
        if sorted(wanted) != list(range(start, stop)):
            return None
        return [wanted[seq] for seq in range(start, stop)]
