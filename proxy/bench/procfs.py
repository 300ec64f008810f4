"""What ``/proc`` says about the processes the bench measures: CPU time and run-queue wait of a
process tree, its RSS now and at its peak, the machine's cores and memory; and the RSS sampler
that runs beside a load."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import time
from collections.abc import Callable
from typing import Any, Final

import trio

# One run's RSS samples per process ("proxy", "fake_upstream"): (seconds since the run
# began, bytes).
RssTrace = dict[str, list[tuple[float, int]]]
RSS_PERIOD: Final = 0.05


def parse_cpu_seconds(stat: str, ticks_per_second: int) -> float:
    """utime + stime from the text of ``/proc/PID/stat``, in seconds."""
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    # Fields 14 and 15 of the whole line are 12 and 13 after pid and comm (0-based: 11, 12).
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def _status_kib(status: str, name: str) -> int | None:
    prefix = name + ":"
    for line in status.splitlines():
        if line.startswith(prefix):
            return int(line.split()[1]) * 1024
    return None


def parse_vm_hwm(status: str) -> int | None:
    """Peak resident set size (VmHWM) in bytes from ``/proc/PID/status``."""
    return _status_kib(status, "VmHWM")


def parse_vm_rss(status: str) -> int | None:
    """Resident set size now (VmRSS) in bytes from ``/proc/PID/status``; None for a zombie
    or a kernel thread, which have no such line."""
    return _status_kib(status, "VmRSS")


def parse_meminfo_total(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


# /proc reads below are synchronous on purpose: they are served from kernel memory, never
# block on a disk, and happen only between runs.


def read_text_or_none(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (a proxy run with several workers forks them)."""
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for tid in os.listdir(f"/proc/{current}/task") if os.path.isdir(f"/proc/{current}") else []:
            children = read_text_or_none(f"/proc/{current}/task/{tid}/children")
            if children:
                todo.extend(int(child) for child in children.split())
    return pids


def process_cpu_seconds(pid: int) -> float | None:
    ticks = os.sysconf("SC_CLK_TCK")
    total, found = 0.0, False
    for each in _process_tree(pid):
        stat = read_text_or_none(f"/proc/{each}/stat")
        if stat is not None:
            total += parse_cpu_seconds(stat, ticks)
            found = True
    return total if found else None


def parse_schedstat_wait(schedstat: str) -> float:
    """Seconds a thread spent runnable but waiting for a CPU, from ``/proc/.../schedstat``."""
    return int(schedstat.split()[1]) / 1e9


def process_cpu_wait(pid: int) -> float | None:
    """Run-queue wait of every thread in the tree: CPU the process wanted and did not get,
    because the bench, the fake or anything else on the machine had it."""
    total, found = 0.0, False
    for each in _process_tree(pid):
        tasks = os.listdir(f"/proc/{each}/task") if os.path.isdir(f"/proc/{each}") else []
        for tid in tasks:
            text = read_text_or_none(f"/proc/{each}/task/{tid}/schedstat")
            if text:
                total += parse_schedstat_wait(text)
                found = True
    return total if found else None


def process_peak_rss(pid: int) -> int | None:
    """Sum of VmHWM over the tree: an upper bound of the peak when there are several."""
    peaks = [
        parse_vm_hwm(read_text_or_none(f"/proc/{each}/status") or "") for each in _process_tree(pid)
    ]
    known = [peak for peak in peaks if peak is not None]
    return sum(known) if known else None


def process_rss(pid: int) -> int | None:
    """Sum of VmRSS over the tree (pages shared between workers count once per worker)."""
    sizes = [
        parse_vm_rss(read_text_or_none(f"/proc/{each}/status") or "") for each in _process_tree(pid)
    ]
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


async def sample_rss(
    pids: dict[str, int],
    trace: RssTrace,
    *,
    since: float,
    period: float = RSS_PERIOD,
    read: Callable[[int], int | None] = process_rss,
) -> None:
    """Append ``(time.monotonic() - since, RSS)`` for each process tree every ``period``
    seconds until cancelled. A sample is stamped when taken: a busy bench takes them late,
    never at the wrong time."""
    for name in pids:
        trace.setdefault(name, [])
    next_at = trio.current_time()
    while True:
        now = time.monotonic() - since
        for name, pid in pids.items():
            size = read(pid)
            if size is not None:
                trace[name].append((now, size))
        next_at += period
        current = trio.current_time()
        if next_at <= current:
            # Behind schedule (the load generator is busy): skip ahead rather than burst.
            next_at = current + period
        await trio.sleep_until(next_at)


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM afresh (``clear_refs`` 5), so each run reports its own peak."""
    for each in _process_tree(pid):
        with contextlib.suppress(OSError), open(f"/proc/{each}/clear_refs", "w") as file:
            file.write("5")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_info() -> dict[str, Any]:
    model = None
    for line in (read_text_or_none("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "ram_bytes": parse_meminfo_total(read_text_or_none("/proc/meminfo") or ""),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        # The machine is not necessarily quiet: the 1-minute load average as the bench began.
        "loadavg_1m": float((read_text_or_none("/proc/loadavg") or "nan").split()[0]),
    }


def _raise_fd_limit(needed: int) -> None:
    """Each stream costs the bench one descriptor, the proxy two and the fake one; children
    inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
