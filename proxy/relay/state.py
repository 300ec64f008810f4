"""The names a request's life is told in: the phases a client can leave in, shared by the relay,
the access log (``cancelled(<phase>)``), the ``sluice_cancellations_total`` label and the
cancellation bench, so that a cell of the scorecard and a line of the log say the same word."""

from __future__ import annotations

from enum import StrEnum


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
    # Tokens are flowing.
    MID_STREAM = "mid_stream"
    # The producer has handed on the last event; the client has not read it all yet.
    AFTER_LAST = "after_last"
