"""``sluice serve --workers N``: N server processes sharing one listening socket.

The parent binds the socket (so all workers share one port and the kernel spreads connections
among them), starts the workers with the ``spawn`` method (a fresh interpreter each: no trio
state or threads copied by fork), forwards SIGTERM/SIGINT (a drain) and SIGHUP (a reload, which
each worker does itself; the supervisor goes on), restarts a worker that dies on its own, and
exits 0 once every worker has drained. Each worker is a whole Sluice: its own upstream pools,
limits and, for local models, its own copy of the model (docs/operating.md). Workers never
outlive the supervisor: each watches it (``supervision.py``) and leaves within 2 s of its death.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from proxy.config import Config
from proxy.server.adapters.hypercorn_adapter import Sockets
from proxy.server.supervision import SupervisorLink, open_link

log = logging.getLogger("sluice.workers")

# A worker that dies on its own this soon after starting is not restarted again and again.
_MIN_UPTIME = 5.0
# A worker's exit status when it cannot start at all (its model would not load, whenever that
# is found out): every worker would fail the same way, so none is restarted.
EXIT_CANNOT_START = 3
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

WorkerMain = Callable[[str | None, str | None, int | None, str, Sockets, SupervisorLink], None]


def serve_workers(
    config: Config,
    sockets: Sockets,
    *,
    worker_main: WorkerMain,
    config_path: str | None,
    host: str | None,
    port: int | None,
    log_level: str,
) -> int:
    """Start ``config.server.workers`` processes and supervise them; returns the exit status."""
    context = multiprocessing.get_context("spawn")
    link, keep_open = open_link(context)
    supervisor = _Supervisor(context, worker_main, (config_path, host, port, log_level, sockets))
    # The handlers only note a signal and wake the loop (through the wakeup fd), which alone
    # touches the workers: a signal that came while a worker was being started still reaches it.
    wake_reader, wake_writer = os.pipe()
    os.set_blocking(wake_writer, False)
    previous_wakeup = signal.set_wakeup_fd(wake_writer)
    previous: dict[int, Any] = {
        signum: signal.signal(signum, supervisor.on_signal) for signum in _FORWARDED
    }
    # Held since `sluice serve` began (proxy/cli.py): one that came meanwhile is forwarded now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    try:
        return supervisor.run(config.server.workers, link, wake_reader)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(previous_wakeup)
        for fd in (wake_reader, wake_writer):
            os.close(fd)
        keep_open.close()  # every worker has exited by now


class _Supervisor:
    def __init__(self, context: SpawnContext, target: WorkerMain, arguments: tuple[Any, ...]):
        self.context = context
        self.target = target
        self.arguments = arguments
        self.workers: list[tuple[BaseProcess, float]] = []
        self.received: list[int] = []
        self.stopping = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def run(self, count: int, link: SupervisorLink, wake_reader: int) -> int:
        self.workers = [self.start(link) for _ in range(count)]
        status = 0
        while self.workers:
            ready = multiprocessing.connection.wait(
                [process.sentinel for process, _ in self.workers] + [wake_reader], timeout=1.0
            )
            if wake_reader in ready:
                os.read(wake_reader, 512)
            received, self.received = self.received, []
            for signum in received:
                self.forward(signum)
            gone: list[BaseProcess] = []
            for index, (process, started) in enumerate(self.workers):
                if process.is_alive():
                    continue
                process.join()
                if self.stopping:
                    gone.append(process)
                    status = status or (process.exitcode or 0)
                elif (
                    process.exitcode == EXIT_CANNOT_START
                    or time.monotonic() - started < _MIN_UPTIME
                ):
                    log.error("worker %s exited with %s at start-up", process.pid, process.exitcode)
                    gone.append(process)
                    status = 1
                    self.forward(signal.SIGTERM)  # the others would fail the same way: stop
                else:
                    log.error("worker %s died (%s); restarting it", process.pid, process.exitcode)
                    self.workers[index] = self.start(link)
            self.workers = [worker for worker in self.workers if worker[0] not in gone]
        return status

    def start(self, link: SupervisorLink) -> tuple[BaseProcess, float]:
        process = self.context.Process(
            target=self.target, args=(*self.arguments, link), name="sluice worker"
        )
        # A SIGHUP passed on while a worker starts must neither end it (SIGHUP's default
        # action, until the worker sets its own) nor be lost: blocked here, the worker is born
        # with it blocked (a signal mask survives fork and exec) and unblocks it once its
        # server's receiver is in place (proxy/server/run.py); here it waits, pending, until
        # the worker is started.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return process, time.monotonic()

    def forward(self, signum: int) -> None:
        if signum == signal.SIGHUP:
            if self.stopping:
                return  # draining: nothing left to reload for
            log.info("SIGHUP: passed to %d worker(s) to reload", len(self.workers))
        else:
            # Forwarded as it came: the workers drain on the first signal and stop at once on
            # the second, exactly like a single server.
            self.stopping = True
        for process, _ in self.workers:
            if process.is_alive() and process.pid is not None:
                signal_process(process.pid, signum)


def signal_process(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.kill(pid, signum)
