"""The names a request's life is told in, and the rules by which it moves.

:class:`Phase`: the phases a client can leave in, shared by the relay, the access log
(``cancelled(<phase>)``), the ``sluice_cancellations_total`` label and the cancellation bench,
so that a cell of the scorecard and a line of the log say the same word.

:class:`RelayState` and :func:`step`: a relay's lifecycle, as h11 keeps a connection's: one
state per side (the producer's, the client's), and a table of which event moves which side
where. Pure and synchronous; :class:`~proxy.relay.body.RelayBody` holds the two states and
fires every event through :func:`step`, in one place.
"""

from __future__ import annotations

from enum import Enum, StrEnum


class Phase(StrEnum):
    """Where a request is, seen from the client, in the order it passes them."""

    # Waiting for an admission slot (the proxy's queue for the replica, or a local model slot).
    QUEUED = "queued"
    # Opening (or taking) the upstream connection and writing the request.
    CONNECTING = "connecting"
    # The request is written; the upstream's response head has not come.
    HEAD = "head"
    # The head has come (or the model is prefilling); no token yet.
    FIRST_TOKEN = "first_token"
    # Tokens are flowing: the first body chunk has been handed on.
    MID_STREAM = "mid_stream"
    # Paused for a more urgent request ([scheduling] preempt_after): its upstream closed, it
    # waits in Sluice's queue to be continued where it stopped.
    PAUSED = "paused"
    # The producer has handed on the last event; the client has not read it all yet.
    AFTER_LAST = "after_last"


class RelayState(Enum):
    """A side's state. The producer: HEAD_PENDING -> SENDING -> DONE. The client: READING,
    then ABANDONED (the consumer ended the response itself) or GONE (it disconnected)."""

    # The producer is at work and has not decided the response head.
    HEAD_PENDING = "head_pending"
    # The head is decided; the producer is still handing chunks on.
    SENDING = "sending"
    # The producer returned: everything it had for the client is handed on (or failed in-band).
    DONE = "done"
    # The client is there, reading what it is handed.
    READING = "reading"
    # The consumer ended the response itself (a WebSocket's translator met an event it cannot
    # relay): not a cancellation by the client.
    ABANDONED = "abandoned"
    # The client disconnected while the producer was at work.
    GONE = "gone"


class RelayEvent(Enum):
    """What moves a side: the producer's events, then the client's."""

    HEAD = "head"  # the producer decided the response head
    FINISHED = "finished"  # the producer returned
    ABANDON = "abandon"  # the consumer ends the response (RelayBody.abandon)
    LEFT = "left"  # the client disconnected (RelayBody.client_disconnected)


class LifecycleError(RuntimeError):
    """An event the producer's state does not allow: a bug in a producer (a second head)."""


_PRODUCER_EVENTS = frozenset({RelayEvent.HEAD, RelayEvent.FINISHED})

# The producer's side. An event missing here is a bug, and raises.
PRODUCER_TRANSITIONS: dict[RelayState, dict[RelayEvent, RelayState]] = {
    RelayState.HEAD_PENDING: {
        RelayEvent.HEAD: RelayState.SENDING,
        # A producer fails before the head by deciding an error head first; only a stall
        # (ClientStalled before any head) ends it with none.
        RelayEvent.FINISHED: RelayState.DONE,
    },
    RelayState.SENDING: {RelayEvent.FINISHED: RelayState.DONE},
    RelayState.DONE: {},
}

# The client's side. An event missing here changes nothing: a late or repeated report (a
# second disconnect, one reported after the body closed, a consumer's abandon once the client
# has left first: the client's cancellation stands).
CLIENT_TRANSITIONS: dict[RelayState, dict[RelayEvent, RelayState]] = {
    RelayState.READING: {
        RelayEvent.ABANDON: RelayState.ABANDONED,
        RelayEvent.LEFT: RelayState.GONE,
    },
    RelayState.ABANDONED: {RelayEvent.LEFT: RelayState.GONE},
    RelayState.GONE: {},
}


def step(
    producer: RelayState, client: RelayState, event: RelayEvent
) -> tuple[RelayState, RelayState]:
    """The two sides' states after ``event``. Besides the tables, one rule across the sides:
    a client that leaves once the producer is DONE changes nothing (the producer has given its
    upstream connection back, maybe to another request by now: there is nothing to cancel)."""
    if event in _PRODUCER_EVENTS:
        try:
            return PRODUCER_TRANSITIONS[producer][event], client
        except KeyError:
            if event is RelayEvent.HEAD:
                raise LifecycleError("the response head was already decided") from None
            raise LifecycleError(f"{event.name} while the producer is {producer.name}") from None
    if event is RelayEvent.LEFT and producer is RelayState.DONE:
        return producer, client
    return producer, CLIENT_TRANSITIONS[client].get(event, client)
