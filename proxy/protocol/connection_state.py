"""One client connection's state as Sluice's HTTP/1.1 server keeps it, sans-IO: how many
requests it has carried, until when it may wait for the next request's head, and whether the
answer being written is its last.

The rule, as h11's ``_state.py`` has it: every field of :class:`ConnectionState` changes in a
method of that class, here, and nowhere else; the servers only call those methods and read.

Two servers carry a connection in turn: the fast path's own loop, then (from the first request
it does not serve) the HTTP server of record's, through Sluice's connection server. Both move
this one object, so a connection handed from the first to the second keeps its count of
requests, its head deadline and its closing, and nothing is kept in step by hand. One clock for
the whole wait for a head (a keep-alive timer that runs until a whole head has come) means a
head that is slow to come is closed at the same moment whoever is reading it.
"""

from __future__ import annotations

from math import inf


class ConnectionState:
    """See the module's docstring. Times are the event loop's clock."""

    __slots__ = (
        "_client_closes",
        "_draining",
        "head_deadline",
        "keep_alive_timeout",
        "max_requests",
        "requests",
    )

    def __init__(self, keep_alive_timeout: float, max_requests: int, now: float) -> None:
        self.keep_alive_timeout = keep_alive_timeout
        self.max_requests = max_requests
        # Requests whose head has come, on either server.
        self.requests = 0
        # The connection is closed at this time unless a whole request head has come by then:
        # armed when it begins to wait (accepted, or its last answer written), disarmed (inf)
        # when the head's blank line arrives.
        self.head_deadline = now + keep_alive_timeout
        self._client_closes = False
        self._draining = False

    # -- what moves it ----------------------------------------------------------------------

    def request_received(self, client_keeps_alive: bool) -> None:
        """A whole request head has come: the wait for it is over, and the request counts
        towards ``max_requests``. ``client_keeps_alive``: False when the client asked to close
        after it (``Connection: close``, or HTTP/1.0 without keep-alive)."""
        self.requests += 1
        self.head_deadline = inf
        self._client_closes = not client_keeps_alive

    def waiting(self, now: float) -> None:
        """The answer is written and the connection stays open: it waits for the next head
        for at most ``keep_alive_timeout`` from now."""
        self.head_deadline = now + self.keep_alive_timeout

    def drain(self) -> None:
        """The server's graceful shutdown has begun: a connection waiting for a head closes
        now, a busy one once its answer is written (an answer whose head is made from now on
        says so)."""
        self._draining = True

    # -- what the servers read ----------------------------------------------------------------

    @property
    def last_answer(self) -> bool:
        """Whether the answer being made is the connection's last: the client asked to close,
        the connection has carried ``max_requests``, or the server is draining. Its head says
        ``connection: close``, and the connection is closed once it is written."""
        return self._client_closes or self._draining or self.requests >= self.max_requests

    @property
    def draining(self) -> bool:
        return self._draining
