"""What a process holds, counted so that two moments can be compared: its trio tasks, threads
and file descriptors; and the access lines it wrote. The lifetime matrix
(tests/contracts/test_lifetime_matrix.py) and the sweep read the same counts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable
from typing import Any

import trio

# An idle thread of trio's thread cache is called so until a job names it.
IDLE_TRIO_THREAD = "Trio thread "


def task_tree(root: trio.lowlevel.Task) -> set[trio.lowlevel.Task]:
    """``root`` and every task below it, through every nursery."""
    found = set()
    stack = [root]
    while stack:
        task = stack.pop()
        found.add(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found


def all_tasks() -> set[trio.lowlevel.Task]:
    """Every task of this trio run (the system nursery's included)."""
    root = trio.lowlevel.current_root_task()
    assert root is not None, "inside a trio run"
    return task_tree(root)


def tasks_running(code: object) -> list[trio.lowlevel.Task]:
    """The tasks of this run whose coroutine runs ``code`` (a function's ``__code__``)."""
    return [task for task in all_tasks() if getattr(task.coro, "cr_code", None) is code]


def open_fds() -> Counter[str]:
    """This process's open file descriptors, by what they point to (``socket:[inode]``, ...):
    a socket of the request that outlives it shows up as a target the baseline lacks."""
    targets: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        # The one descriptor that listdir itself used is closed by now: skipped.
        with contextlib.suppress(OSError):
            targets[os.readlink(f"/proc/self/fd/{name}")] += 1
    return targets


def busy_threads() -> Counter[str]:
    """This process's threads by name, less trio's idle cached workers (kept for reuse, not
    held by anything): a thread still running a request's job shows up by its job's name."""
    return Counter(
        thread.name
        for thread in threading.enumerate()
        if not thread.name.startswith(IDLE_TRIO_THREAD)
    )


def names(tasks: Iterable[trio.lowlevel.Task]) -> Counter[str]:
    return Counter(task.name for task in tasks)


class AccessLines(logging.Handler):
    """The access lines written while it is attached, parsed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line.get("request_id") == request_id]

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["trace_id"] == trace_id]
