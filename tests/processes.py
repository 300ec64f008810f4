"""The test session's process tree, read from ``/proc`` (Linux): what a test started, and what
it left behind.

The session becomes a subreaper (:func:`become_subreaper`), so a process whose parent died
without it (a worker whose supervisor was SIGKILLed, a daemon that double-forked) is re-parented
to the session instead of PID 1, where no check of the session's children could see it. At the
end, :func:`kill_left_behind` names, kills and reaps whatever still descends from the session.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import time
from pathlib import Path

import trio

_PR_SET_CHILD_SUBREAPER = 36
PROC = Path("/proc")


def become_subreaper() -> bool:
    """Orphans among this process's descendants become its children (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid, or None once it has gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may itself hold spaces and parentheses.
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def is_alive(pid: int) -> bool:
    """Running (or stopped): not gone, and not a zombie waiting to be reaped."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    found = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before their children."""
    found: list[int] = []
    below = children(pid)
    while below:
        found.extend(below)
        below = [grandchild for child in below for grandchild in children(child)]
    return found


def cmdline(pid: int) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def reap(pid: int | None = None) -> None:
    """Collect zombies: ``pid`` if it is (now) our child, or, without one, every zombie child
    (only where nothing else waits for its own children: at session end)."""
    with contextlib.suppress(ChildProcessError):
        while True:
            reaped, _ = os.waitpid(-1 if pid is None else pid, os.WNOHANG)
            if reaped == 0 or pid is not None:
                return


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Waits until none of ``pids`` is alive (reaping those that were left to us); returns
    those still alive after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in pids:
            reap(pid)
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


async def trio_wait_gone(pids: list[int], within: float) -> list[int]:
    """:func:`wait_gone`, sleeping in trio."""
    deadline = trio.current_time() + within
    while True:
        for pid in pids:
            reap(pid)
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or trio.current_time() >= deadline:
            return alive
        await trio.sleep(0.05)


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def kill_left_behind(root: int | None = None, keep: frozenset[int] = frozenset()) -> list[str]:
    """Every process still descending from ``root`` (this process by default) but those in
    ``keep``, killed and reaped: each as ``pid: cmdline``, as it was found."""
    root = os.getpid() if root is None else root
    reap()
    found = [pid for pid in descendants(root) if pid not in keep]
    named = [f"{pid}: {cmdline(pid)}" for pid in found]
    kill_all(found)
    wait_gone(found, 5.0)
    reap()
    return named
