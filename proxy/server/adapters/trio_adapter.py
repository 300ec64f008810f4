"""trio: the low-level hooks Sluice uses beyond trio's everyday API.

* ``hangup``: the hangup watcher is a trio instrument (``add_instrument`` /
  ``remove_instrument``, ``before_io_wait`` / ``after_io_wait`` / ``before_task_step``) over
  its own epoll set, which a task waits on (``lowlevel.wait_readable``). Without it: no
  watcher; a client's FIN is seen by its read task.
* required: ``CancelScope.cancel(reason)`` (trio 0.31+: says who cancelled a relay) and
  ``lowlevel.wait_writable`` / ``current_clock``, which the relay and chunk writer use.
"""

from __future__ import annotations

import inspect

import trio

from proxy.server.adapters.base import Adapter, Internal

__all__ = ["TRIO", "cancel_takes_a_reason"]


def cancel_takes_a_reason() -> bool:
    return "reason" in inspect.signature(trio.CancelScope.cancel).parameters


TRIO = Adapter(
    "trio",
    floor="0.31",
    below="",
    internals=[
        Internal("trio.CancelScope.cancel", check=cancel_takes_a_reason),
        Internal("trio.lowlevel.wait_writable"),
        Internal("trio.lowlevel.current_clock"),
        Internal("trio.lowlevel.add_instrument", "hangup"),
        Internal("trio.lowlevel.remove_instrument", "hangup"),
        Internal("trio.abc.Instrument.before_task_step", "hangup"),
        Internal("trio.abc.Instrument.after_io_wait", "hangup"),
        Internal("trio.lowlevel.wait_readable", "hangup"),
    ],
    fallbacks={
        "hangup": "no hangup watcher: a client's FIN is seen when its read task runs",
    },
)
