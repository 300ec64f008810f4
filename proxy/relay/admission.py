"""Admission: a fixed number of slots, a bounded queue with a deadline, and honest refusals.

Excess requests wait in order for a slot; when the queue is full they get 429 at once, and when
they have waited ``queue_timeout`` they get 503, both with ``Retry-After`` estimated from how
long slots have recently been held. A client that leaves while queued frees its place at once
(the wait is cancelled with it).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from proxy.protocol.errors import RATE_LIMIT, SERVER_ERROR, ApiError

# Weight of the newest observation in the moving average of slot hold times.
_EWMA_WEIGHT = 0.2


class Admission:
    def __init__(
        self,
        name: str,
        *,
        slots: int | trio.CapacityLimiter,
        max_queue: int,
        queue_timeout: float,
        on_leave: Callable[[float, str], None] | None = None,
        retryable: bool = False,
    ) -> None:
        self.name = name
        # Called once per request as it leaves the queue, with the seconds it waited and how
        # it left: "admitted", "queue_timeout", "cancelled", or "queue_full" (never queued).
        self.on_leave = on_leave
        # A limiter shared with other queues (an upstream replica's connection slots, which
        # every model it serves queues for) or this queue's own.
        self.limiter = (
            slots if isinstance(slots, trio.CapacityLimiter) else trio.CapacityLimiter(slots)
        )
        # Whether a refusal may be retried elsewhere (another replica).
        self.retryable = retryable
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self._waiting = 0
        self.average_hold = 1.0
        self._changed = trio.Event()

    @property
    def waiting(self) -> int:
        return self._waiting

    def _set_waiting(self, value: int) -> None:
        self._waiting = value
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_queued(self, count: int) -> None:
        """Return once exactly ``count`` requests are queued (tests, diagnostics)."""
        while self._waiting != count:
            await self._changed.wait()

    async def wait_free(self) -> None:
        """Return once no slot is in use."""
        while self.limiter.borrowed_tokens:
            await self._changed.wait()

    def retry_after(self) -> int:
        """Seconds until a place is likely free: queue ahead * typical hold time / slots."""
        estimate = self.average_hold * (self.waiting + 1) / self.limiter.total_tokens
        return max(1, math.ceil(estimate))

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        borrower = object()
        if self.limiter.available_tokens == 0 and self.waiting >= self.max_queue:
            if self.on_leave is not None:
                self.on_leave(0.0, "queue_full")
            raise ApiError(
                429,
                f"{self.name} is busy: {self.limiter.total_tokens} slot(s) in use and "
                f"{self.waiting} request(s) queued; retry later.",
                type=RATE_LIMIT,
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
                retryable=self.retryable,
            )
        self._set_waiting(self._waiting + 1)
        entered = trio.current_time()
        outcome = "cancelled"
        try:
            with trio.move_on_after(self.queue_timeout):
                await self.limiter.acquire_on_behalf_of(borrower)
            admitted = borrower in self.limiter.statistics().borrowers
            outcome = "admitted" if admitted else "queue_timeout"
        finally:
            self._set_waiting(self._waiting - 1)
            if self.on_leave is not None:
                self.on_leave(trio.current_time() - entered, outcome)
        if not admitted:
            raise ApiError(
                503,
                f"{self.name} had no free slot within queue_timeout={self.queue_timeout:g}s; "
                "retry later.",
                type=SERVER_ERROR,
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after())},
                retryable=self.retryable,
            )
        started = trio.current_time()
        try:
            yield
        finally:
            held = trio.current_time() - started
            self.average_hold += _EWMA_WEIGHT * (held - self.average_hold)
            self.limiter.release_on_behalf_of(borrower)
            self._notify()
