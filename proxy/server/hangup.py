"""Seeing a client leave between task steps, not a scheduler turn later.

hypercorn's read task learns that a client has gone when the scheduler runs it: trio runs every
task that was ready when a batch began before it asks the OS what happened since, so on a
saturated loop (1000 streams, a backlog of events on every upstream socket) a client's FIN waits
for the rest of the batch it arrived in, and then for its read task's place in the next one:
tens of milliseconds at the tail, while the upstream keeps generating for nobody.

A :class:`HangupWatcher` keeps its own epoll set of the client sockets whose relays are
streaming, interested only in the peer's FIN (``EPOLLRDHUP``) and in resets (``EPOLLHUP``,
``EPOLLERR``), and polls it (one ``epoll_wait`` that does not wait) at most once per
``interval``: after trio's own waits for I/O and, while the loop is saturated, between task
steps. A task also waits on that epoll set itself, so that a hangup wakes an idle loop: a
client that pipelined a byte after its request and then left while its relay waited for a
first token was otherwise heard only when something else woke the loop (seconds, measured),
since nothing reads a socket whose reader is paused behind the answer in progress. A hangup
runs that socket's callback (the relay's disconnect hook, which shuts the upstream
connection) at once; the read task still reads the EOF in its turn, and the cancellation
follows as before. All of it on the trio thread, so the callbacks need no locks.

Measured at 1000 streams (``python -m proxy.bench --streams 1000``, five runs each way):
cancel propagation p50 4.1 -> 0.76 ms, p99 10-20 -> 2-3.2 ms, for ~4% more CPU per event
(the per-step hook, installed only while saturated); polling after I/O waits alone gave p99
8-10 ms. At 100 streams: no difference in CPU per event or TTFT (four A/B rounds).

A client's half-close (``shutdown(SHUT_WR)``, a FIN while it still reads) counts as leaving,
as hypercorn's EOF does when its read task gets to it, and so does a client that pipelined a
second request and then half-closed, though its reader is paused behind the first response:
such clients are rare (browsers and SDKs neither pipeline nor half-close), and one that cannot
be told apart from a client that has gone is treated as gone, since the upstream's work is what
this protects.

Each server has its own watcher (:func:`watching`, for as long as it serves). Linux only
(epoll); elsewhere :func:`watching` yields None and the read task's turn is the earliest word,
as before.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import trio

log = logging.getLogger("sluice.hangup")

_HANGUP = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0)
_HANGUP |= getattr(select, "EPOLLERR", 0)
DEFAULT_INTERVAL = 0.001
# The per-step hook stays in until batches have been short for this long: installing it
# (trio walks the instrument's attributes) costs more than many task steps, and a lightly
# loaded loop has a long batch now and then (profiled: 1% of an idle-ish proxy's CPU went to
# installing and removing it).
STEPPING_HOLD = 0.05


class HangupWatcher(trio.abc.Instrument):
    """A trio instrument: :func:`watching` adds it to the running loop and removes it.

    It polls at most once per ``interval``: after trio's waits for I/O (once per scheduler
    batch), and, while batches run longer than ``busy_batch``, between task steps too. A
    per-step hook costs every task step a call, so it is only installed once a batch runs that
    long, and taken out after ``STEPPING_HOLD`` of short ones."""

    def __init__(
        self, interval: float = DEFAULT_INTERVAL, busy_batch: float = DEFAULT_INTERVAL
    ) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._interval = interval
        self._busy_batch = busy_batch
        self._next_poll = 0.0
        self._batch_began = time.perf_counter()
        self._stepper = _StepPoller(self)
        self._stepping = False
        self._last_long_batch = 0.0

    def watch(self, fd: int, on_hangup: Callable[[], None]) -> None:
        """Call ``on_hangup`` (once) when the peer of socket ``fd`` closes or resets it, until
        :meth:`unwatch` (fd, on_hangup). A socket closed while watched leaves the epoll set by
        itself; its number may then come back as another socket's, which replaces it here."""
        try:
            self._epoll.register(fd, _HANGUP)
        except FileExistsError:
            self._epoll.modify(fd, _HANGUP)
        self._callbacks[fd] = on_hangup

    def unwatch(self, fd: int, on_hangup: Callable[[], None]) -> None:
        if self._callbacks.get(fd) != on_hangup:
            return  # fired already, or the number now belongs to another socket
        del self._callbacks[fd]
        self._forget(fd)

    def _forget(self, fd: int) -> None:
        # Closed while watched: the kernel dropped it from the set already.
        with suppress(OSError):
            self._epoll.unregister(fd)

    @property
    def watched(self) -> int:
        return len(self._callbacks)

    def after_io_wait(self, timeout: float) -> None:
        # At most once per interval here too: a lightly loaded loop waits for I/O thousands
        # of times a second, and its read tasks are not kept waiting long anyway.
        self._batch_began = now = time.perf_counter()
        if self._callbacks:
            self._poll_if_due(now)

    def before_io_wait(self, timeout: float) -> None:
        now = time.perf_counter()
        if now - self._batch_began > self._busy_batch and self._callbacks:
            self._last_long_batch = now
            if not self._stepping:
                self._stepping = True
                trio.lowlevel.add_instrument(self._stepper)
        elif self._stepping and now - self._last_long_batch > STEPPING_HOLD:
            self._stepping = False
            # trio drops an instrument whose hook raised; this one must not take the watcher
            # with it by raising KeyError here in turn.
            with suppress(KeyError):
                trio.lowlevel.remove_instrument(self._stepper)

    def step(self) -> None:
        if self._callbacks:
            self._poll_if_due(time.perf_counter())

    def _poll_if_due(self, now: float) -> None:
        if now >= self._next_poll:
            self._next_poll = now + self._interval
            self.poll()

    async def wake_for_hangups(self) -> None:
        """Wait on the watcher's own epoll set (readable once a watched socket hangs up: pending
        data alone does not count), and poll it: a hangup wakes the loop, idle or not."""
        while True:
            await trio.lowlevel.wait_readable(self._epoll.fileno())
            self.poll()

    def poll(self) -> None:
        """Run the callbacks of the sockets hung up since the last poll."""
        for fd, _ in self._epoll.poll(0):
            callback = self._callbacks.pop(fd, None)
            if callback is None:
                continue
            self._forget(fd)
            try:
                callback()
            except Exception:
                # A synchronous hook on the trio thread: nothing here can raise Cancelled. A
                # failing callback is a bug to log; trio would disable the whole watcher.
                log.exception("hangup callback failed")

    def remove(self) -> None:
        """Out of the running loop (both instruments), and closed."""
        for instrument in (self._stepper, self):
            # Not installed (the stepper, in a quiet loop), or removed by trio.
            with suppress(KeyError):
                trio.lowlevel.remove_instrument(instrument)
        self.close()

    def close(self) -> None:
        self._callbacks.clear()
        self._epoll.close()


class _StepPoller(trio.abc.Instrument):
    """The per-step hook, apart so that it can come and go on its own."""

    def __init__(self, watcher: HangupWatcher) -> None:
        self._watcher = watcher

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._watcher.step()


def available() -> bool:
    from proxy.server import adapters

    return bool(_HANGUP) and hasattr(select, "epoll") and adapters.usable("hangup")


@asynccontextmanager
async def watching(
    interval: float | None = None, busy_batch: float | None = None
) -> AsyncIterator[HangupWatcher | None]:
    """A server's watcher, for the duration: added to the running loop as an instrument, with
    its task waiting for hangups in a nursery of its own, and removed and closed at the end.
    None where epoll is missing. Both bounds default to DEFAULT_INTERVAL, read now."""
    if not available():
        yield None
        return
    interval = DEFAULT_INTERVAL if interval is None else interval
    watcher = HangupWatcher(interval, DEFAULT_INTERVAL if busy_batch is None else busy_batch)
    trio.lowlevel.add_instrument(watcher)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watcher.wake_for_hangups, name="hangup watcher")
            yield watcher
            nursery.cancel_scope.cancel()
    finally:
        watcher.remove()
