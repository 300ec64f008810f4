"""``sluice serve --workers N``: N server processes sharing one listening socket.

The parent binds the socket (so all workers share one port and the kernel spreads connections
among them), starts the workers with the ``spawn`` method (a fresh interpreter each: no trio
state or threads copied by fork), forwards SIGTERM/SIGINT, restarts a worker that dies on its
own, and exits 0 once every worker has drained. Each worker is a whole Sluice: its own
upstream pools, limits and, for local models, its own copy of the model (see the README).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from proxy.config import Config
from proxy.server.adapters.hypercorn_adapter import Sockets

log = logging.getLogger("sluice.workers")

# A worker that dies on its own this soon after starting is not restarted again and again.
_MIN_UPTIME = 5.0
# A worker's exit status when it cannot start at all (its model would not load, whenever that
# is found out): every worker would fail the same way, so none is restarted.
EXIT_CANNOT_START = 3


def serve_workers(
    config: Config,
    sockets: Sockets,
    *,
    worker_main: Callable[[str | None, str | None, int | None, str, Sockets], None],
    config_path: str | None,
    host: str | None,
    port: int | None,
    log_level: str,
) -> int:
    """Start ``config.server.workers`` processes and supervise them; returns the exit status."""
    context = multiprocessing.get_context("spawn")
    arguments = (config_path, host, port, log_level, sockets)
    workers: list[tuple[BaseProcess, float]] = []
    stopping = False

    def start() -> tuple[BaseProcess, float]:
        process = context.Process(target=worker_main, args=arguments, name="sluice worker")
        process.start()
        return process, time.monotonic()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        # Forwarded as it came: the workers drain on the first signal and stop at once on
        # the second, exactly like a single server.
        stopping = True
        for process, _ in workers:
            if process.is_alive() and process.pid is not None:
                signal_process(process.pid, signum)

    previous: dict[int, Any] = {
        signum: signal.signal(signum, on_signal) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        workers = [start() for _ in range(config.server.workers)]
        status = 0
        while workers:
            time.sleep(0.2)
            for index, (process, started) in enumerate(list(workers)):
                if process.is_alive():
                    continue
                process.join()
                if stopping:
                    workers.remove((process, started))
                    status = status or (process.exitcode or 0)
                elif (
                    process.exitcode == EXIT_CANNOT_START
                    or time.monotonic() - started < _MIN_UPTIME
                ):
                    log.error("worker %s exited with %s at start-up", process.pid, process.exitcode)
                    stopping = True
                    status = 1
                    on_signal(signal.SIGTERM, None)
                    workers.remove((process, started))
                else:
                    log.error("worker %s died (%s); restarting it", process.pid, process.exitcode)
                    workers[index] = start()
        return status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def signal_process(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.kill(pid, signum)
