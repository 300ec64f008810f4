"""The processes the bench starts (the fake upstream, the proxy, the peer): each owned by a task
that stops it, shielded and bounded, however the bench ends; readiness polls; CPU pinning; and
``run_stoppable``, a ``trio.run`` that SIGTERM or SIGHUP cancel like Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import trio

from proxy.bench.client import ProtocolError, http_get
from proxy.bench.procfs import read_text_or_none
from proxy.bench.settings import BenchError

_E = TypeVar("_E", bound=BaseException)
READY_TIMEOUT: Final = 30.0
# A peer or a local model that starts slowly (LiteLLM imports for a minute on this machine).
PEER_READY_TIMEOUT: Final = 600.0
# How long a child gets to exit after SIGTERM before SIGKILL. The proxy's own graceful shutdown
# is set to 1 s in the config we write, so this is rarely reached.
STOP_TIMEOUT: Final = 5.0


class ChildExited(BenchError):
    def __init__(self, name: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(
            f"the {name} exited early (status {returncode}); its log ends:\n{log_tail}"
        )


def free_port(host: str) -> int:
    # Another process could take the port between close() and the child's bind; on a bench
    # machine that is a theoretical race, and the readiness check would report it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _open_log(path: Path) -> IO[bytes]:
    # A local temp file: opening it cannot block in any way that matters.
    return open(path, "wb")


def _log_tail(path: Path, lines: int = 20) -> str:
    text = read_text_or_none(str(path)) or ""
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


async def _stop_child(process: trio.Process) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT; shielded and bounded, so a bench that is
    being cancelled (Ctrl-C, an error) still never leaves a child behind or hangs on one."""
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.terminate()
            with trio.move_on_after(STOP_TIMEOUT):
                await process.wait()
        if process.returncode is None:
            process.kill()
            # After SIGKILL the wait is only the kernel reaping it; still bounded.
            with trio.move_on_after(STOP_TIMEOUT):
                await process.wait()


# Run by a child before it becomes the program: the mask is set before its exec, so every
# thread and process the program starts (the proxy's workers, uvicorn's) inherits it.
_PIN_THEN_EXEC: Final = (
    "import os, sys; "
    "os.sched_setaffinity(0, {int(cpu) for cpu in sys.argv[1].split(',')}); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def pinned_argv(argv: list[str], cpus: frozenset[int] | None) -> list[str]:
    """``argv``, to run on ``cpus`` (as it is with None)."""
    if cpus is None:
        return argv
    return [sys.executable, "-c", _PIN_THEN_EXEC, ",".join(map(str, sorted(cpus))), *argv]


def set_own_cpus(cpus: Iterable[int]) -> None:
    """Every thread of this process on ``cpus``: trio's cached worker threads too, since a
    child started from one (open_process runs Popen in one) would inherit its mask."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


def _record_cpus(placed: dict[str, list[int]], name: str, pid: int) -> None:
    """``pid``'s CPUs as the kernel reports them (0: this thread's)."""
    # A child that died at once is gone: its supervisor reports that, with its log.
    with contextlib.suppress(ProcessLookupError):
        placed[name] = sorted(os.sched_getaffinity(pid))


async def supervise(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own one child for as long as this task lives: a child that exits on its own is an
    error (it fails the bench at once instead of as a pile of refused connections). ``env``
    is added to this process's environment; ``cwd``: where it starts (None: here)."""
    log = _open_log(log_path)
    try:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C reaches the bench only, which then stops children in order.
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=cwd,
        )
    finally:
        log.close()  # the child has its own copy of the descriptor
    try:
        task_status.started(process)
        await process.wait()
        raise ChildExited(name, process.returncode, _log_tail(log_path))
    finally:
        await _stop_child(process)


async def wait_ready(
    name: str,
    address: tuple[str, int],
    path: str,
    log: Path | None,
    patience: float = READY_TIMEOUT,
) -> None:
    """Poll ``path`` until it answers 200 (or, with no path, until a TCP connect succeeds)."""
    with trio.move_on_after(patience):
        while True:
            try:
                if path:
                    status, _ = await http_get(address, path)
                    if status == 200:
                        return
                else:
                    with trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                        await sock.connect(address)
                    return
            except (OSError, ProtocolError):
                pass  # not listening yet: that is what we are waiting for
            await trio.sleep(0.05)
    tail = f"; its log ends:\n{_log_tail(log)}" if log is not None else ""
    raise BenchError(f"the {name} at {address[0]}:{address[1]} not ready in {patience:g} s{tail}")


async def git_commit() -> str | None:
    try:
        head = await trio.run_process(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        # The reports the benches write (docs/) are not the code measured: a run that
        # rewrites them one after another is still a run of HEAD.
        dirty = await trio.run_process(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    except OSError:
        return None  # no git here: the report just says "unknown"
    if head.returncode != 0:
        return None
    commit = head.stdout.decode().strip()
    return commit + (" (working tree modified)" if dirty.stdout.strip() else "")


_T = TypeVar("_T")
# Signals that stop a bench the way Ctrl-C does (a service manager's stop, a closed terminal).
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


def run_stoppable(async_fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``trio.run(async_fn, *args)``, except that SIGTERM or SIGHUP cancels the bench, so every
    child it started is stopped (``supervise``) before it exits with BenchError; a bench
    killed by the default handler would leave its children running."""

    async def guarded() -> _T:
        stopped_by: list[str] = []

        async def watch(scope: trio.CancelScope) -> None:
            with trio.open_signal_receiver(*STOP_SIGNALS) as signals:
                async for signum in signals:
                    stopped_by.append(signal.Signals(signum).name)
                    scope.cancel()
                    return

        try:
            with trio.CancelScope() as outer:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch, outer)
                    try:
                        return await async_fn(*args)
                    finally:
                        nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The nursery wraps whatever the bench raised: the bench's own error is the news.
            raise _first_leaf(group) from None
        raise BenchError(f"stopped by {stopped_by[0] if stopped_by else 'a signal'}")

    return trio.run(guarded)


def _first_leaf(group: BaseExceptionGroup[_E]) -> _E:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
