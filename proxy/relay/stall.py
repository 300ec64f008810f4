"""A deadline for writes that cannot be cancelled.

The server's socket writes are shielded from cancellation and have no deadline of their own
(the HTTP server's ``send_all``), so a ``move_on_after`` around one returns only when the client
reads. A :class:`StallGuard` puts a watchdog beside such writes instead: one that is still
running ``stall_timeout`` after it began calls ``on_stall``, which drops the client's
connection; the dropped socket wakes the write (it fails, and the server closes its side).

Writes may overlap (a WebSocket's generation and its replies to other messages, each in its own
task, through one guard): the limit then runs from the first write's start, and again from
each end of one while others still wait, so that a write is never left without one.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import ParamSpec

import trio

Params = ParamSpec("Params")


class StallGuard:
    """Bounds every write made through :meth:`write` by ``stall_timeout``; the watchdog
    (:meth:`watch`) runs in a nursery its owner opens, and ends once it has fired."""

    __slots__ = ("_deadline", "_scope", "_writing", "on_stall", "stall_timeout", "stalled")

    def __init__(self, stall_timeout: float, on_stall: Callable[[], None]) -> None:
        self.stall_timeout = stall_timeout
        self.on_stall = on_stall
        self.stalled = False
        self._deadline = math.inf
        # Writes running now: the deadline is disarmed only when none is left.
        self._writing = 0
        self._scope: trio.CancelScope | None = None

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            # The scope's deadline is the running write's; it only expires when a write has
            # been running for stall_timeout. A write that ends first moves it back to inf.
            with trio.CancelScope(deadline=self._deadline) as scope:
                self._scope = scope
                await trio.sleep_forever()
            self._scope = None
            if trio.current_time() >= self._deadline:
                self.stalled = True
                self.on_stall()
                return

    def _set(self, deadline: float) -> None:
        self._deadline = deadline
        if self._scope is not None:
            self._scope.deadline = deadline

    async def write(
        self,
        write: Callable[Params, Awaitable[None]],
        *args: Params.args,
        **kwargs: Params.kwargs,
    ) -> None:
        """``await write(*args, **kwargs)``, with the stall limit on it. After a stall the
        write is skipped: the connection is gone."""
        if self.stalled:
            return
        if not self._writing:
            self._set(trio.current_time() + self.stall_timeout)
        self._writing += 1
        try:
            await write(*args, **kwargs)
        finally:
            self._writing -= 1
            # Another write still waits: this one is over, so the limit runs again from now.
            self._set(trio.current_time() + self.stall_timeout if self._writing else math.inf)
