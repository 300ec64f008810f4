"""A real upstream's server and every process it starts (vLLM's engine cores), run as one tree
that is always stopped whole: when its owner stops it, and when its owner dies however it died.

The owner (:class:`ServerTree`, in the test runner) does not start the server itself but a
*keeper*: this file run as a script, in a session of its own, holding the read end of a pipe
whose write end only the owner has. The keeper

- starts the server in a process group of its own (``posix_spawn``: no ``preexec_fn``);
- is a subreaper, so that whatever the server starts and then loses (an engine whose parent
  died first, a daemon that double-forked) is re-parented to the keeper, not to PID 1;
- ends the tree when the pipe reads EOF (the owner closed it, or the kernel did because the
  owner died, SIGKILL included), on SIGTERM, SIGINT or SIGHUP, on its parent's death
  (``PR_SET_PDEATHSIG``, a second notice), or when the server exits on its own;
- ends it bounded and escalating: SIGTERM to the server's group and to every process below the
  keeper, up to ``grace`` seconds for all of them to leave, then SIGKILL to all that remain,
  named in the log; it exits once nothing below it runs.

A server started straight from the runner would outlive a runner that was SIGKILLed, and its
engine processes could outlive the server.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import IO

if __package__:
    from tests import processes
else:  # run as the keeper, by path: its own folder comes first on sys.path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests import processes

# SIGTERM to SIGKILL: vLLM's CPU server and its engine cores leave within a few seconds.
GRACE = 30.0
# After SIGKILL, only the kernel's reaping is left; still bounded.
KILL_WAIT = 10.0
_PR_SET_PDEATHSIG = 1
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class ServerTree:
    """The owner's side: ``argv`` run under a keeper, its output (and the keeper's) in ``log``.
    :meth:`stop` ends the whole tree within ``grace`` plus :data:`KILL_WAIT` seconds, and is
    idempotent. Start it from a thread that lives as long as the tree should (the main one):
    the kernel's parent-death signal follows the thread that started the keeper."""

    def __init__(
        self, argv: list[str], *, log: IO[bytes], env: dict[str, str], grace: float = GRACE
    ) -> None:
        self.grace = grace
        self.keeper = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                str(os.getpid()),
                str(grace),
                "--",
                *argv,
            ],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            # A terminal's Ctrl-C reaches the runner only, which then stops the tree in order.
            start_new_session=True,
        )

    def poll(self) -> int | None:
        """None while the server runs; its exit status (as the keeper's) once it has ended."""
        return self.keeper.poll()

    def stop(self) -> list[str]:
        """Ends the tree: the keeper's own escalation, bounded; should the keeper itself be
        stuck, every process of the tree is SIGKILLed here. Returns those (``pid: cmdline``),
        empty when the keeper did its job."""
        if self.keeper.stdin is not None and not self.keeper.stdin.closed:
            self.keeper.stdin.close()  # EOF: the keeper's notice to end the tree
        try:
            self.keeper.wait(timeout=self.grace + KILL_WAIT + 5.0)
        except subprocess.TimeoutExpired:
            pass
        else:
            return []
        below = processes.descendants(self.keeper.pid)
        named = [f"{pid}: {processes.cmdline(pid)}" for pid in [self.keeper.pid, *below]]
        processes.kill_all([self.keeper.pid, *below])
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.keeper.wait(timeout=KILL_WAIT)
        # Re-parented to this process when it is a subreaper (a test session), else to PID 1.
        processes.wait_gone(below, KILL_WAIT)
        return named


class _Keeper:
    def __init__(self, argv: list[str]) -> None:
        self.stopping = False
        for signum in _STOP_SIGNALS:
            signal.signal(signum, self._stop)
        # Not the keeper's stdin: the server has no business with the owner's pipe.
        self.server = os.posix_spawnp(
            argv[0],
            argv,
            os.environ,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
            setpgroup=0,
        )
        self.status: int | None = None

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def reap(self) -> None:
        """Collect every child that has ended (re-parented orphans too), keeping the server's
        exit status."""
        with contextlib.suppress(ChildProcessError):
            while True:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    return
                if pid == self.server:
                    self.status = os.waitstatus_to_exitcode(status)

    def run(self) -> None:
        """Until the owner, a signal or the server itself says the tree must end."""
        while not self.stopping and self.status is None:
            # A signal's handler only sets the flag: select goes on (PEP 475) and returns
            # within its timeout.
            readable, _, _ = select.select([sys.stdin.fileno()], [], [], 0.2)
            if readable and not os.read(sys.stdin.fileno(), 4096):
                return  # EOF: the owner closed the pipe, or it has died
            self.reap()

    def signal_tree(self, signum: int) -> list[int]:
        """``signum`` to the server's group and to every live process below the keeper (one
        that left the group too); returns the latter."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.server, signum)
        below = processes.descendants(os.getpid())
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return below

    def wait_empty(self, within: float) -> list[int]:
        """Reaps until nothing runs below the keeper; those still running after ``within``."""
        deadline = time.monotonic() + within
        while True:
            self.reap()
            left = processes.descendants(os.getpid())
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    def end_tree(self, grace: float) -> None:
        try:
            self._end_tree(grace)
        finally:
            self.reap()  # one that became a zombie since the last look

    def _end_tree(self, grace: float) -> None:
        self.signal_tree(signal.SIGTERM)
        started = time.monotonic()
        left = self.wait_empty(grace)
        if not left:
            return
        named = ", ".join(f"{pid}: {processes.cmdline(pid)}" for pid in left)
        print(
            f"keeper: still running {time.monotonic() - started:.1f}s after SIGTERM, "
            f"killed: {named}",
            file=sys.stderr,
            flush=True,
        )
        self.signal_tree(signal.SIGKILL)
        if left := self.wait_empty(KILL_WAIT):
            print(f"keeper: still running after SIGKILL: {left}", file=sys.stderr, flush=True)


def _arm_parent_death_signal() -> None:
    # Linux only; elsewhere the pipe's EOF is the only notice, and it is enough.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def keep(argv: list[str]) -> int:
    """The keeper: ``OWNER_PID GRACE -- SERVER_ARGV...``. Exits with the server's status
    (128 + signal, as a shell says it, when a signal ended it)."""
    owner, grace, separator, *command = argv
    if separator != "--" or not command:
        print("usage: server_tree.py OWNER_PID GRACE -- COMMAND...", file=sys.stderr)
        return 2
    processes.become_subreaper()
    _arm_parent_death_signal()
    if os.getppid() != int(owner):
        return 1  # the owner died before the signal was armed: nothing to serve
    keeper = _Keeper(command)
    try:
        keeper.run()
    finally:
        keeper.end_tree(float(grace))
    status = keeper.status if keeper.status is not None else 0
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(keep(sys.argv[1:]))
