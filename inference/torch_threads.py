"""Which threads run a model's torch work in a server: its engine's thread, and for loading, a
thread of its own that ends with the load.

torch's CPU kernels run their parallel regions on OpenMP. With GNU libgomp (the one torch's Linux
wheels ship), every OS thread that runs a parallel region keeps a team of worker threads of its
own for as long as it lives. Between two regions a team's workers spin for a while, so that the
next region starts at once; once the threads of all the teams outnumber the cores, libgomp cuts
that spin to almost nothing, and every worker sleeps on a futex after each region and is woken
for the next one. A decode step of SmolLM2 is some 280 regions. Measured through ``sluice serve``
(one stream, 64 tokens, 8 slots, 2 threads, a 2-core AMD EPYC): when the event loop's thread had
run one forward pass at start-up (the check of the model's cache), the engine's worker slept and
was woken 262 times a token and the engine thread was preempted 215 times a token; with that
check in a thread of its own, 0.06 and 3.

So the server runs every forward pass of a model in the engine's thread (the start-up check
included: ``proxy/backends/local.py``), and the load, which must happen before the engine runs,
in :func:`in_own_thread`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_own_thread(work: Callable[[], T], name: str = "sluice torch") -> T:
    """``work()`` in a new thread, joined: the OpenMP team it makes ends with the thread, so it
    does not outlive the call (see the module's docstring). Its result, or its exception."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
