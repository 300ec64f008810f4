"""Counting a request's checkpoints, and cutting at one of them.

A :class:`CheckpointCounter` is a trio instrument. Armed for one request, it counts the task
steps of the request's tasks: every task spawned under Sluice's serving task (``serve``) from
the moment the client starts to connect, and every task those spawn, wherever their nursery
(an ``after`` hook in the server's nursery works for the request too). Each step ends at an
await: a checkpoint, the place where a cancellation can land. After each step it names the
place (:func:`cut_point`: the innermost frame of the parked task that is neither trio's nor
the standard library's, as ``path:line``), and on the step it was told to cut at it calls the
cut (the client leaves) right there, in the trio thread, before any other task runs.

After the cut it goes on counting every step of every task under ``serve`` (those that were
there before the request too: the hangup watcher, the HTTP server's reader), so that the sweep can
say within how many steps the upstream was let go. Where each task of the request was spawned
(the frame that called ``start_soon``) is kept, so that a task left behind is named by the
line that started it.

The bookkeeping is synchronous and cheap (a set lookup per step, a frame walk per request
step); nothing here awaits.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType

import trio

_TRIO_DIR = os.path.dirname(trio.__file__) + os.sep
_NUMBERS = re.compile(r"\d+")
_TRIO_CORE = _TRIO_DIR + "_core" + os.sep
# The frame below every task's own: trio's run loop, which steps the task.
_RUN_LOOP = trio._core._run.unrolled_run.__code__
_STDLIB_DIRS = tuple(
    os.path.realpath(sysconfig.get_paths()[name]) + os.sep for name in ("stdlib", "platstdlib")
)
# Modules whose frames are plumbing of a checkpoint, never its place: trio's, the standard
# library's (contextlib, asyncio's never), and this package's own.
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ROOTS = tuple(
    sorted(
        {os.path.realpath(p) + os.sep for p in sys.path if p and os.path.isdir(p)},
        key=len,
        reverse=True,
    )
)


def is_plumbing(filename: str) -> bool:
    """Whether a frame of ``filename`` is trio's or the standard library's: never a place a
    cut is named by."""
    if filename.startswith((_TRIO_DIR, _HERE)):
        return True
    if "site-packages" in filename:
        return False
    real = os.path.realpath(filename)
    return real.startswith(_STDLIB_DIRS) or filename.startswith("<")


def short_path(filename: str) -> str:
    """``filename`` relative to the import root it was found under (``proxy/relay/body.py``,
    ``h11/_connection.py``)."""
    real = os.path.realpath(filename)
    for root in _ROOTS:
        if real.startswith(root):
            return real[len(root) :]
    return real


def frames_of(task: trio.lowlevel.Task) -> Iterator[tuple[FrameType, int]]:
    """The frames a parked task waits in, outermost first (its coroutine's await chain)."""
    return task.iter_await_frames()


def cut_point(task: trio.lowlevel.Task) -> str:
    """Where ``task`` is parked: ``path:line function`` of its innermost frame that is not
    plumbing. A task that has just ended has no frames: ``(exit) <its name>``."""
    place = innermost = ""
    for frame, line in frames_of(task):
        filename = frame.f_code.co_filename
        innermost = f"{short_path(filename)}:{line} {frame.f_code.co_name}"
        if not is_plumbing(filename):
            place = innermost
    # A task parked in trio alone (trio.sleep_forever) is named by trio's frame; one that has
    # ended by its name, less the numbers that name its request ("relay producer sweep-N").
    return place or innermost or f"(exit) {_NUMBERS.sub('N', task.name)}"


def spawn_site() -> str:
    """Where the running task spawned a task: the innermost frame of its own stack that is not
    plumbing (``nursery.start_soon`` is trio's; its caller is named), or, where trio itself
    spawned it (``serve_listeners``' handler), trio's frame that did."""
    frame: FrameType | None = sys._getframe(1)
    fallback = "(unknown)"
    while frame is not None:
        code = frame.f_code
        if code is _RUN_LOOP:
            break  # below it: the run loop and whoever called trio.run, not the task
        if not is_plumbing(code.co_filename):
            return f"{short_path(code.co_filename)}:{frame.f_lineno} {code.co_name}"
        if code.co_filename.startswith(_TRIO_DIR) and not code.co_filename.startswith(_TRIO_CORE):
            fallback = f"trio/{code.co_filename[len(_TRIO_DIR) :]}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return fallback


@dataclass
class Step:
    """One counted step of the request: its number, its task, and where it parked."""

    number: int
    task: str
    place: str


@dataclass
class Armed:
    """What one armed request's run counted."""

    cut_at: int | None
    on_cut: Callable[[Step], None] | None
    steps: list[Step] = field(default_factory=list)
    # Where each task of the request was spawned (kept after it exits, by id of the task).
    spawned_at: dict[int, str] = field(default_factory=dict)
    cut: Step | None = None
    # Every step of a task under serve after the cut, with its task's name.
    after_cut: int = 0
    # The first step after the cut (counted as ``after_cut``) at which ``released`` said yes,
    # and the scheduler batches (I/O waits) begun after the cut until then.
    released_at: int | None = None
    batches_after_cut: int = 0
    released_batches: int | None = None
    released: Callable[[], bool] | None = None

    @property
    def count(self) -> int:
        return len(self.steps)


class CheckpointCounter(trio.abc.Instrument):
    """See the module's docstring. Added to the run once (:meth:`install`), armed per request."""

    def __init__(self, serving: trio.lowlevel.Task) -> None:
        self.serving = serving
        # Every live task under ``serving``; those of the armed request.
        self._server: set[trio.lowlevel.Task] = set()
        self._request: set[trio.lowlevel.Task] = set()
        self.armed: Armed | None = None
        # Where every task under ``serving`` that is still alive was spawned, armed or not.
        self._sites: dict[trio.lowlevel.Task, str] = {}

    def install(self) -> None:
        stack = [self.serving]
        while stack:
            task = stack.pop()
            self._server.add(task)
            for nursery in task.child_nurseries:
                stack.extend(nursery.child_tasks)
        trio.lowlevel.add_instrument(self)

    def uninstall(self) -> None:
        trio.lowlevel.remove_instrument(self)

    def arm(
        self,
        cut_at: int | None = None,
        on_cut: Callable[[Step], None] | None = None,
        released: Callable[[], bool] | None = None,
    ) -> Armed:
        """Count the request that starts now; at step ``cut_at`` (1-based) call ``on_cut``.
        ``released``: asked after every step that follows the cut, until it says yes."""
        self._request.clear()
        self.armed = Armed(cut_at, on_cut, released=released)
        return self.armed

    def disarm(self) -> Armed | None:
        armed, self.armed = self.armed, None
        self._request.clear()
        return armed

    def site_of(self, task: trio.lowlevel.Task) -> str | None:
        """Where a live task was spawned: one under ``serve`` since the instrument was added,
        or any spawned while a request was armed (None: neither)."""
        return self._sites.get(task)

    # -- trio's hooks ---------------------------------------------------------------------

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        nursery = task.parent_nursery
        armed = self.armed
        if nursery is None or nursery.parent_task not in self._server:
            if armed is not None:
                # Outside serve (a system task, the fake's): not the request's, but where it
                # was spawned names it if it is left behind.
                self._sites[task] = spawn_site()
            return
        self._server.add(task)
        site = spawn_site()
        self._sites[task] = site
        if armed is not None:
            self._request.add(task)
            armed.spawned_at[id(task)] = site

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._server.discard(task)
        self._sites.pop(task, None)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        armed = self.armed
        if armed is None:
            return
        if armed.cut is not None:
            if task in self._server or task in self._request:
                armed.after_cut += 1
                if armed.released_at is None and armed.released is not None and armed.released():
                    armed.released_at = armed.after_cut
                    armed.released_batches = armed.batches_after_cut
            return
        if task not in self._request:
            return
        step = Step(len(armed.steps) + 1, task.name, cut_point(task))
        armed.steps.append(step)
        if step.number == armed.cut_at:
            armed.cut = step
            if armed.on_cut is not None:
                armed.on_cut(step)
            if armed.released is not None and armed.released():
                armed.released_at = armed.released_batches = 0

    def after_io_wait(self, timeout: float) -> None:
        armed = self.armed
        if armed is not None and armed.cut is not None and armed.released_at is None:
            armed.batches_after_cut += 1
