"""A ``--workers`` process's watch on its supervisor: when the supervisor has gone, it goes too.

A worker whose supervisor died (SIGKILL, a crash, the OOM killer) would otherwise go on serving,
re-parented to PID 1, on the listening socket it inherited: a new supervisor could not bind the
port, and nothing would ever restart or stop it. Two ways of noticing, since either alone has a
gap:

- ``PR_SET_PDEATHSIG`` (Linux): the kernel sends the worker SIGTERM when its parent dies, which
  the server takes as any SIGTERM (it drains). It is armed as the worker starts; a supervisor
  that died before that is caught by comparing ``getppid()`` with its pid just after.
- A pipe whose write end only the supervisor holds (:class:`SupervisorLink`): the kernel closes
  it however the supervisor dies, and the worker's read end then reads EOF. Watched by a trio
  task (:func:`watch_supervisor`), it works where ``prctl`` does not, and it bounds the exit.

Once the supervisor is gone, nobody restarts a worker and its socket blocks the next start, so
the drain is short: in-flight requests get :data:`CANCEL_AFTER` to finish (not the configured
``graceful_timeout``), then a second SIGTERM cancels what is left (as a second signal always
does), and at :data:`HARD_EXIT_AFTER` the kernel ends the process whatever it is doing (the
default action of SIGALRM: a shielded clean-up or a native call holding the GIL cannot delay
it). Both bounds are well inside the 2 s an operator is promised.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

import trio

log = logging.getLogger("sluice.workers")

_PR_SET_PDEATHSIG = 1
CANCEL_AFTER = 1.0
HARD_EXIT_AFTER = 1.8


@dataclass(frozen=True)
class SupervisorLink:
    """What a worker is given to watch its supervisor by (picklable: it crosses ``spawn``)."""

    pid: int
    # The read end of a pipe nothing is ever written to; the supervisor alone holds the write
    # end, so it reads EOF once the supervisor has exited, however it exited.
    pipe: Connection


def open_link(context: BaseContext) -> tuple[SupervisorLink, Connection]:
    """In the supervisor: the link to hand every worker, and the write end to keep open (and
    never write to) for as long as the supervisor lives. ``context`` is the multiprocessing
    context the workers are started with."""
    reader, writer = context.Pipe(duplex=False)
    return SupervisorLink(os.getpid(), reader), writer


def arm_parent_death_signal(link: SupervisorLink) -> bool:
    """In a worker, first thing: SIGTERM from the kernel when the supervisor dies. Returns
    whether that is armed (Linux only). Exits at once if the supervisor has already gone."""
    # (The kernel means the thread that started us: the supervisor starts every worker from
    # its main thread, which lives as long as it does.)
    armed = _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # Armed after the supervisor died, it would never fire: our parent is then someone else
    # (PID 1, or a subreaper).
    if os.getppid() != link.pid:
        log.warning("supervisor %d had gone before this worker started; exiting", link.pid)
        sys.exit(0)
    return armed


@asynccontextmanager
async def watching_supervisor(
    link: SupervisorLink, *, parent_death_signal: bool
) -> AsyncIterator[None]:
    """A worker's body runs in this block, with :func:`watch_supervisor` beside it in the
    block's nursery. An error of the block comes out as itself, not in a group."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                partial(watch_supervisor, link, parent_death_signal=parent_death_signal)
            )
            yield
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def watch_supervisor(link: SupervisorLink, *, parent_death_signal: bool) -> None:
    """In a worker's nursery, beside the server: once the supervisor has gone, drain as on
    SIGTERM and be gone within :data:`HARD_EXIT_AFTER`. ``parent_death_signal`` says whether
    the kernel sends the first SIGTERM itself (then this one would be the second, which
    cancels at once)."""
    fd = link.pipe.fileno()
    while True:
        await trio.lowlevel.wait_readable(fd)
        if not os.read(fd, 4096):
            break  # EOF: nothing is ever written, so this is the only way it becomes readable
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, HARD_EXIT_AFTER)
    log.warning(
        "supervisor %d has gone: draining; in-flight requests have %gs, exit by %gs",
        link.pid,
        CANCEL_AFTER,
        HARD_EXIT_AFTER,
    )
    if not parent_death_signal:
        os.kill(os.getpid(), signal.SIGTERM)
    await trio.sleep(CANCEL_AFTER)
    os.kill(os.getpid(), signal.SIGTERM)  # the second signal: cancel what is still running


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return bool(libc.prctl(option, value, 0, 0, 0) == 0)
