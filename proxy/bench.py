"""``sluice bench``: a reproducible load generator that measures what the proxy promises.

It starts the fake upstream and the proxy as subprocesses (so that their CPU time and memory are
measured apart from the load generator's), opens N concurrent streaming chat requests ramped
over R seconds, makes a seeded fraction of the clients leave mid-stream (and another read
slowly), and reports:

* time to first token and the gaps between tokens, as the clients saw them;
* cancel propagation: from a client's ``close()`` to the moment the fake upstream saw its own
  connection go (both ``time.monotonic()``, which is one clock for every process on the
  machine), and how many tokens the upstream generated for nobody;
* the proxy's CPU time per relayed event and its peak RSS, read from ``/proc``.

With ``--direct`` the identical load also runs straight at the fake upstream, and every figure
is printed for proxy, direct and proxy/direct.

The client must stay cheap at 1000 streams on a 2-core machine, or it would measure itself: it
is a tiny HTTP/1.1 client on raw trio sockets (one request per connection, ``Connection:
close``), de-chunks by hand and counts SSE events with ``bytes.find``; no JSON is decoded per
token. Each request carries a unique ``"user": "bench-..."`` that the fake records with the
request, which is how a client's close is matched with what the upstream saw.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import resource
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Final, Literal, TextIO, TypeVar
from urllib.parse import urlsplit

import trio

__all__ = [
    "BenchError",
    "BenchReport",
    "BenchSettings",
    "Dechunker",
    "EventCounter",
    "ProtocolError",
    "ResponseParser",
    "RunData",
    "RunSummary",
    "StreamResult",
    "add_arguments",
    "assign_roles",
    "classify",
    "format_table",
    "main",
    "markdown_section",
    "merge_runs",
    "parse_cpu_seconds",
    "parse_meminfo_total",
    "parse_schedstat_wait",
    "parse_vm_hwm",
    "percentile",
    "ratios",
    "run_bench",
    "run_from_args",
    "settings_from_args",
    "summarize",
    "upsert_section",
]

Role = Literal["normal", "drop", "slow"]
_E = TypeVar("_E", bound=BaseException)
Mode = Literal["proxy", "direct"]

RECV_SIZE: Final = 64 * 1024
MAX_HEAD_BYTES: Final = 64 * 1024
# A chunk-size line is a few hex digits (plus rare extensions); anything longer is garbage.
MAX_CHUNK_LINE: Final = 1024
READY_TIMEOUT: Final = 30.0
# How long a child gets to exit after SIGTERM before SIGKILL. The proxy's own graceful shutdown
# is set to 1 s in the config we write, so this is rarely reached.
STOP_TIMEOUT: Final = 5.0
RECORDS_POLL: Final = 0.2

_DONE: Final = b"data: [DONE]"
_ERROR: Final = b'data: {"error"'
# A chat delta with text. The role chunk carries ``"content":""`` and is not a token; the byte
# after this marker tells them apart (34 is a double quote).
_CONTENT: Final = b'"content":"'
_QUOTE: Final = 34


class BenchError(Exception):
    """The bench could not run (bad settings, a child that failed to start or died)."""


class ProtocolError(ValueError):
    """The server sent bytes that are not the HTTP/1.1 the bench understands."""


# --------------------------------------------------------------------------- pure figures


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default).

    None for no values: a figure that could not be measured must not print as 0.
    """
    data = sorted(values)
    if not data:
        return None
    position = (len(data) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def assign_roles(streams: int, drop: float, slow: float, seed: int) -> list[Role]:
    """Which clients leave early and which read slowly: a seeded draw, identical for every run
    of one invocation (proxy and direct get the same load)."""
    if not (0 <= drop <= 1 and 0 <= slow <= 1 and drop + slow <= 1):
        raise BenchError("--drop and --slow must be fractions in [0, 1] with a sum <= 1")
    order = list(range(streams))
    random.Random(seed).shuffle(order)
    dropped = round(streams * drop)
    slowed = min(round(streams * slow), streams - dropped)
    roles: list[Role] = ["normal"] * streams
    for i in order[:dropped]:
        roles[i] = "drop"
    for i in order[dropped : dropped + slowed]:
        roles[i] = "slow"
    return roles


# --------------------------------------------------------------------------- HTTP, sans-IO


class Dechunker:
    """Incremental HTTP/1.1 chunked transfer decoding: ``feed`` bytes, get the payload so far."""

    __slots__ = ("_buffer", "_left", "_need_crlf", "_trailers", "done")

    def __init__(self) -> None:
        self._buffer = b""
        self._left = 0  # payload bytes still due in the current chunk
        self._need_crlf = False  # the CRLF that ends a chunk's data
        self._trailers = False  # after the last (zero-size) chunk
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos, end = 0, len(buffer)
        while pos < end and not self.done:
            if self._left:
                take = min(self._left, end - pos)
                out.append(buffer[pos : pos + take])
                pos += take
                self._left -= take
                self._need_crlf = not self._left
            elif self._need_crlf:
                if end - pos < 2:
                    break
                if buffer[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._need_crlf = False
            else:
                line_end = buffer.find(b"\r\n", pos)
                if line_end < 0:
                    if end - pos > MAX_CHUNK_LINE:
                        raise ProtocolError("chunk-size line too long")
                    break
                line = buffer[pos:line_end]
                pos = line_end + 2
                if self._trailers:
                    # An empty line ends the trailer section and the body.
                    self.done = not line
                    continue
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise ProtocolError(f"bad chunk-size line {line[:40]!r}") from None
                if size < 0:
                    raise ProtocolError(f"bad chunk-size line {line[:40]!r}")
                self._left = size
                self._trailers = size == 0
        self._buffer = buffer[pos:] if not self.done else b""
        return out[0] if len(out) == 1 else b"".join(out)


class EventCounter:
    """Count server-sent events in a payload stream without decoding them.

    ``events``: ``data:`` events of any kind; ``content``: those that carry a chat token (not
    the role chunk, the finish chunk, usage or ``[DONE]``); ``done``: ``data: [DONE]`` seen;
    ``errors``: in-band ``data: {"error"...}`` events. Events are delimited by a blank line
    (LF LF), which is how vLLM, the fake and the proxy frame them.
    """

    __slots__ = ("_buffer", "content", "done", "errors", "events")

    def __init__(self) -> None:
        self._buffer = b""
        self.events = 0
        self.content = 0
        self.errors = 0
        self.done = False

    def feed(self, data: bytes) -> int:
        """Return how many token events this data completed."""
        buffer = self._buffer + data if self._buffer else data
        start = 0
        new = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            if buffer.startswith(b"data:", start):
                self.events += 1
                mark = buffer.find(_CONTENT, start, end)
                if mark >= 0 and buffer[mark + len(_CONTENT)] != _QUOTE:
                    new += 1
                elif buffer.startswith(_DONE, start):
                    self.done = True
                elif buffer.startswith(_ERROR, start):
                    self.errors += 1
            start = end + 2
        self._buffer = buffer[start:] if start else buffer
        self.content += new
        return new


class ResponseParser:
    """One HTTP/1.1 response: status line and headers, then a chunked, sized or close-delimited
    body that goes to an :class:`EventCounter` (or, with ``collect``, into ``body``)."""

    __slots__ = (
        "_collect",
        "_dechunker",
        "_head",
        "_head_done",
        "_remaining",
        "body",
        "complete",
        "events",
        "headers",
        "status",
    )

    def __init__(self, *, collect: bool = False) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.complete = False  # the body ended as its framing said (not cut short)
        self.events = EventCounter()
        self.body = bytearray()
        self._collect = collect
        self._head = b""
        self._head_done = False
        self._dechunker: Dechunker | None = None
        self._remaining: int | None = None  # Content-Length left; None: until EOF

    def feed(self, data: bytes) -> int:
        """Return how many token events this data completed."""
        if not self._head_done:
            data = self._feed_head(data)
            if not data:
                return 0
        if self.complete:
            return 0
        if self._dechunker is not None:
            payload = self._dechunker.feed(data)
            self.complete = self._dechunker.done
        elif self._remaining is not None:
            payload = data[: self._remaining]
            self._remaining -= len(payload)
            self.complete = not self._remaining
        else:
            payload = data
        if self._collect:
            self.body += payload
            return 0
        return self.events.feed(payload) if payload else 0

    def feed_eof(self) -> None:
        """The server closed: that ends a body without framing, and nothing else."""
        if self._head_done and self._dechunker is None and self._remaining is None:
            self.complete = True

    def _feed_head(self, data: bytes) -> bytes:
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > MAX_HEAD_BYTES:
                raise ProtocolError("response head too large")
            self._head = head
            return b""
        lines = head[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {lines[0][:60]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self._head = b""
        self._head_done = True
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._dechunker = Dechunker()
        elif "content-length" in self.headers:
            try:
                self._remaining = int(self.headers["content-length"])
            except ValueError:
                raise ProtocolError("bad Content-Length") from None
            self.complete = self._remaining == 0
        return head[end + 4 :]


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\n"
        "Content-Type: application/json\r\n"
        "Accept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def chat_body(model: str, tag: str, ttft: float, interval: float, tokens: int) -> bytes:
    """A streaming chat request; ``fake`` pins the fake's schedule whatever it was started
    with, and ``user`` is the tag that matches the request with the fake's record."""
    body = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me about foxes."}],
        "user": tag,
        "fake": {"ttft": ttft, "interval": interval, "tokens": tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- one stream


@dataclass(slots=True)
class StreamResult:
    """What one client saw; times are ``time.monotonic()``."""

    index: int
    tag: str
    role: Role
    started: float | None = None  # before connect()
    connected: float | None = None
    sent: float | None = None  # request written
    first_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    closed_at: float | None = None  # a dropping client's close()
    status: int | None = None
    events: int = 0
    content: int = 0
    done: bool = False
    complete: bool = False
    error_events: int = 0
    error: str | None = None  # a socket or protocol failure
    ended: bool = False  # False: still running when the run's deadline hit


def classify(result: StreamResult) -> str | None:
    """Why this stream counts as an error, or None when it behaved as planned."""
    if result.error is not None:
        return result.error
    if not result.ended:
        return "timeout"
    if result.status != 200:
        return f"HTTP {result.status}" if result.status is not None else "no response"
    if result.error_events:
        return "in-band error event"
    if result.role == "drop":
        return None if result.closed_at is not None else "ended before its drop point"
    if not result.done:
        return "truncated (no [DONE])"
    return None


@dataclass
class _Progress:
    started: int = 0
    finished: int = 0
    failed: int = 0


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def run_stream(
    address: tuple[str, int],
    request: bytes,
    result: StreamResult,
    *,
    start_at: float,
    drop_at: int,
    slow_delay: float,
    progress: _Progress | None = None,
) -> None:
    """Run one client at ``start_at`` (trio clock), filling ``result`` as it goes.

    Never raises for what the server did: a refused connection or a garbled response is the
    result's ``error``; only cancellation leaves (with ``ended`` False).
    """
    await trio.sleep_until(start_at)
    if progress is not None:
        progress.started += 1
    parser = ResponseParser()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # The request is one small write; without NODELAY it could wait for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        result.started = time.monotonic()
        await sock.connect(address)
        result.connected = time.monotonic()
        await _send_all(sock, request)
        result.sent = last = time.monotonic()
        gaps = result.gaps
        dropping = result.role == "drop"
        slow = result.role == "slow"
        while True:
            data = await sock.recv(RECV_SIZE)
            now = time.monotonic()
            if not data:
                parser.feed_eof()
                break
            new = parser.feed(data)
            if new:
                if result.first_token is None:
                    result.first_token = now
                    new -= 1
                elif not slow:
                    # Tokens that arrive in one read arrived together: one real gap, then 0s.
                    gaps.append(now - last)
                    new -= 1
                if new and not slow:
                    gaps.extend([0.0] * new)
                last = now
            if parser.complete:
                break
            if dropping and parser.events.content >= drop_at:
                result.closed_at = time.monotonic()
                sock.close()
                break
            if slow and result.first_token is not None:
                # Slow from the first token on: its TTFT must not include its own sleep.
                await trio.sleep(slow_delay)
        result.ended = True
    except OSError as exc:
        # Refused, reset, or any other socket failure: part of what is measured.
        result.error = f"socket: {type(exc).__name__}"
        result.ended = True
    except ProtocolError as exc:
        result.error = f"protocol: {exc}"
        result.ended = True
    finally:
        sock.close()
        result.status = parser.status
        counter = parser.events
        result.events, result.content = counter.events, counter.content
        result.done, result.error_events = counter.done, counter.errors
        result.complete = parser.complete
        if progress is not None:
            progress.finished += 1
            if classify(result) is not None:
                progress.failed += 1


async def http_get(address: tuple[str, int], path: str) -> tuple[int, bytes]:
    """A GET with ``Connection: close``; raise OSError or ProtocolError on failure."""
    host, port = address
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    parser = ResponseParser(collect=True)
    with trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        await sock.connect(address)
        await _send_all(sock, request.encode("latin-1"))
        while not parser.complete:
            data = await sock.recv(RECV_SIZE)
            if not data:
                parser.feed_eof()
                break
            parser.feed(data)
    if parser.status is None or not parser.complete:
        raise ProtocolError(f"incomplete response to GET {path}")
    return parser.status, bytes(parser.body)


# --------------------------------------------------------------------------- /proc


def parse_cpu_seconds(stat: str, ticks_per_second: int) -> float:
    """utime + stime from the text of ``/proc/PID/stat``, in seconds."""
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    # Fields 14 and 15 of the whole line are 12 and 13 after pid and comm (0-based: 11, 12).
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def parse_vm_hwm(status: str) -> int | None:
    """Peak resident set size (VmHWM) in bytes from ``/proc/PID/status``."""
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def parse_meminfo_total(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


# /proc reads below are synchronous on purpose: they are served from kernel memory, never
# block on a disk, and happen only between runs.


def _read(path: str) -> str | None:
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
            children = _read(f"/proc/{current}/task/{tid}/children")
            if children:
                todo.extend(int(child) for child in children.split())
    return pids


def process_cpu_seconds(pid: int) -> float | None:
    ticks = os.sysconf("SC_CLK_TCK")
    total, found = 0.0, False
    for each in _process_tree(pid):
        stat = _read(f"/proc/{each}/stat")
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
            text = _read(f"/proc/{each}/task/{tid}/schedstat")
            if text:
                total += parse_schedstat_wait(text)
                found = True
    return total if found else None


def process_peak_rss(pid: int) -> int | None:
    """Sum of VmHWM over the tree: an upper bound of the peak when there are several."""
    peaks = [parse_vm_hwm(_read(f"/proc/{each}/status") or "") for each in _process_tree(pid)]
    known = [peak for peak in peaks if peak is not None]
    return sum(known) if known else None


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
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "ram_bytes": parse_meminfo_total(_read("/proc/meminfo") or ""),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        # The machine is not necessarily quiet: the 1-minute load average as the bench began.
        "loadavg_1m": float((_read("/proc/loadavg") or "nan").split()[0]),
    }


def _raise_fd_limit(needed: int) -> None:
    """Each stream costs the bench one descriptor, the proxy two and the fake one; children
    inherit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# --------------------------------------------------------------------------- aggregation


@dataclass
class RunData:
    """The raw material of one mode: every client's result and the upstream's records."""

    mode: Mode
    results: list[StreamResult]
    records: dict[str, dict[str, Any]]  # the fake's record per tag; empty: no fake to ask
    wall_s: float
    client_cpu_s: float
    proxy_cpu_s: float | None = None
    proxy_cpu_wait_s: float | None = None
    proxy_peak_rss: int | None = None
    upstream_cpu_s: float | None = None
    records_known: bool = True  # False: no fake upstream to match with (a --target alone)


def merge_runs(runs: Sequence[RunData]) -> RunData:
    """Pool the repeats of one mode: percentiles over all streams, costs summed."""

    def total(values: list[float | None]) -> float | None:
        return None if any(v is None for v in values) else sum(v for v in values if v)

    first = runs[0]
    records: dict[str, dict[str, Any]] = {}
    for run in runs:
        records.update(run.records)
    peaks = [run.proxy_peak_rss for run in runs if run.proxy_peak_rss is not None]
    return RunData(
        mode=first.mode,
        results=[result for run in runs for result in run.results],
        records=records,
        wall_s=sum(run.wall_s for run in runs),
        client_cpu_s=sum(run.client_cpu_s for run in runs),
        proxy_cpu_s=total([run.proxy_cpu_s for run in runs]),
        proxy_cpu_wait_s=total([run.proxy_cpu_wait_s for run in runs]),
        proxy_peak_rss=max(peaks) if peaks else None,
        upstream_cpu_s=total([run.upstream_cpu_s for run in runs]),
        records_known=all(run.records_known for run in runs),
    )


@dataclass
class RunSummary:
    """The figures of one mode. None: not measured here (not 0)."""

    streams: int
    completed: int  # non-dropping clients that got [DONE]
    dropped: int  # dropping clients that left as planned
    errors: int
    error_kinds: dict[str, int]
    wall_s: float
    events: int  # data events delivered to clients (tokens, role, finish, [DONE])
    tokens: int  # token events delivered
    events_per_s: float | None
    connect_p50_ms: float | None
    connect_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    gap_p50_ms: float | None
    gap_p99_ms: float | None
    cancel_p50_ms: float | None
    cancel_p99_ms: float | None
    cancel_max_ms: float | None
    cancel_unseen: int | None  # dropped, yet the upstream never saw its connection close
    cancel_unmatched: int | None  # dropped, and no upstream record of the request at all
    wasted_tokens_mean: float | None  # upstream tokens_sent - tokens the client received
    wasted_tokens_max: int | None
    proxy_cpu_s: float | None
    proxy_cpu_wait_s: float | None  # runnable, waiting for a core: contention, not cost
    proxy_cpu_us_per_event: float | None
    proxy_peak_rss_mib: float | None
    upstream_cpu_us_per_event: float | None
    client_cpu_us_per_event: float | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _per_event_us(cpu_s: float | None, events: int) -> float | None:
    return None if cpu_s is None or not events else cpu_s * 1e6 / events


def summarize(run: RunData) -> RunSummary:
    results = run.results
    kinds: Counter[str] = Counter()
    connects: list[float] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    cancels: list[float] = []
    wasted: list[int] = []
    completed = dropped = unseen = unmatched = 0
    for result in results:
        kind = classify(result)
        if kind is not None:
            kinds[kind] += 1
        if result.started is not None and result.connected is not None:
            connects.append(result.connected - result.started)
        if result.sent is not None and result.first_token is not None:
            ttfts.append(result.first_token - result.sent)
        gaps.extend(result.gaps)
        if kind is not None:
            continue
        if result.role != "drop":
            completed += 1
            continue
        dropped += 1
        assert result.closed_at is not None  # classify() said it left as planned
        record = run.records.get(result.tag)
        if record is None:
            unmatched += 1
            continue
        seen = record.get("disconnected_at_mono")
        if seen is None:
            unseen += 1
        else:
            cancels.append(float(seen) - result.closed_at)
        wasted.append(int(record.get("tokens_sent", 0)) - result.content)
    events = sum(result.events for result in results)
    known = run.records_known
    return RunSummary(
        streams=len(results),
        completed=completed,
        dropped=dropped,
        errors=sum(kinds.values()),
        error_kinds=dict(kinds),
        wall_s=run.wall_s,
        events=events,
        tokens=sum(result.content for result in results),
        events_per_s=events / run.wall_s if run.wall_s > 0 else None,
        connect_p50_ms=_ms(percentile(connects, 50)),
        connect_p99_ms=_ms(percentile(connects, 99)),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        gap_p50_ms=_ms(percentile(gaps, 50)),
        gap_p99_ms=_ms(percentile(gaps, 99)),
        cancel_p50_ms=_ms(percentile(cancels, 50)),
        cancel_p99_ms=_ms(percentile(cancels, 99)),
        cancel_max_ms=_ms(max(cancels)) if cancels else None,
        cancel_unseen=unseen if known else None,
        cancel_unmatched=unmatched if known else None,
        wasted_tokens_mean=_mean(wasted),
        wasted_tokens_max=max(wasted) if wasted else None,
        proxy_cpu_s=run.proxy_cpu_s,
        proxy_cpu_wait_s=run.proxy_cpu_wait_s,
        proxy_cpu_us_per_event=_per_event_us(run.proxy_cpu_s, events),
        proxy_peak_rss_mib=None if run.proxy_peak_rss is None else run.proxy_peak_rss / 2**20,
        upstream_cpu_us_per_event=_per_event_us(run.upstream_cpu_s, events),
        client_cpu_us_per_event=_per_event_us(run.client_cpu_s, events),
    )


# (field, label, format). Formats: "d" integer, ".Nf" fixed.
FIGURES: Final[tuple[tuple[str, str, str], ...]] = (
    ("streams", "streams", "d"),
    ("completed", "completed (not dropping)", "d"),
    ("dropped", "dropped as planned", "d"),
    ("errors", "errors", "d"),
    ("wall_s", "wall time (s)", ".2f"),
    ("events", "events delivered", "d"),
    ("events_per_s", "events/s", ".0f"),
    ("connect_p50_ms", "connect p50 (ms)", ".2f"),
    ("connect_p99_ms", "connect p99 (ms)", ".2f"),
    ("ttft_p50_ms", "TTFT p50 (ms)", ".1f"),
    ("ttft_p99_ms", "TTFT p99 (ms)", ".1f"),
    ("gap_p50_ms", "inter-token gap p50 (ms)", ".2f"),
    ("gap_p99_ms", "inter-token gap p99 (ms)", ".2f"),
    ("cancel_p50_ms", "cancel propagation p50 (ms)", ".2f"),
    ("cancel_p99_ms", "cancel propagation p99 (ms)", ".2f"),
    ("cancel_max_ms", "cancel propagation max (ms)", ".2f"),
    ("cancel_unseen", "dropped, upstream never saw close", "d"),
    ("cancel_unmatched", "dropped, no upstream record", "d"),
    ("wasted_tokens_mean", "wasted tokens/dropped stream, mean", ".1f"),
    ("wasted_tokens_max", "wasted tokens/dropped stream, max", "d"),
    ("proxy_cpu_s", "proxy CPU (s)", ".2f"),
    ("proxy_cpu_wait_s", "proxy waiting for a core (s)", ".2f"),
    ("proxy_cpu_us_per_event", "proxy CPU per event (µs)", ".0f"),
    ("proxy_peak_rss_mib", "proxy peak RSS (MiB)", ".1f"),
    ("upstream_cpu_us_per_event", "fake upstream CPU per event (µs)", ".1f"),
    ("client_cpu_us_per_event", "load generator CPU per event (µs)", ".1f"),
)
# Counts of the load itself: the same on both sides by construction, no ratio.
_NO_RATIO: Final = frozenset({"streams", "completed", "dropped"})


def ratios(proxy: RunSummary, direct: RunSummary) -> dict[str, float | None]:
    """proxy / direct for every figure both sides measured (None where direct is 0)."""
    out: dict[str, float | None] = {}
    for name, _, _ in FIGURES:
        if name in _NO_RATIO:
            continue
        a, b = getattr(proxy, name), getattr(direct, name)
        if a is None or b is None:
            continue
        out[name] = a / b if b else None
    return out


def _fmt(value: float | int | None, spec: str) -> str:
    if value is None:
        return "—"
    if spec == "d":
        return str(round(value))
    return format(value, spec)


def table_rows(summaries: dict[str, RunSummary]) -> tuple[list[str], list[list[str]]]:
    modes = list(summaries)
    header = ["figure", *modes]
    both = "proxy" in summaries and "direct" in summaries
    if both:
        header.append("proxy/direct")
        rate = ratios(summaries["proxy"], summaries["direct"])
    rows = []
    for name, label, spec in FIGURES:
        row = [label, *(_fmt(getattr(summaries[mode], name), spec) for mode in modes)]
        if both:
            value = rate.get(name)
            row.append("—" if value is None else f"{value:.2f}x")
        rows.append(row)
    return header, rows


def format_table(summaries: dict[str, RunSummary]) -> str:
    header, rows = table_rows(summaries)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _errors_line(summaries: dict[str, RunSummary]) -> str:
    parts = []
    for mode, summary in summaries.items():
        if summary.error_kinds:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(summary.error_kinds.items()))
            parts.append(f"{mode}: {kinds}")
    return "errors by kind — " + "; ".join(parts) if parts else ""


# --------------------------------------------------------------------------- markdown


def markdown_section(report: BenchReport) -> str:
    settings = report.settings
    machine = report.machine
    ram = machine.get("ram_bytes")
    ram_text = f"{ram / 2**30:.1f} GiB RAM" if ram else "RAM unknown"
    header, rows = table_rows(report.summaries)
    lines = [
        f"## {settings.streams} streams"
        + (", proxy vs direct" if "direct" in report.summaries else ""),
        "",
        f"- Machine: {machine.get('cores')} cores ({machine.get('cpu') or 'unknown CPU'}), "
        f"{ram_text}, {machine.get('system')}, Python {machine.get('python')}; "
        f"load average {machine.get('loadavg_1m')} as it began",
        f"- Date: {report.date}; commit: {report.commit or 'unknown'}",
        f"- Command: `{report.command}`",
        f"- Load: {settings.describe()}",
    ]
    if report.env:
        env = " ".join(f"{k}={v}" for k, v in sorted(report.env.items()))
        lines.append(f"- Environment: `{env}`")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    errors = _errors_line(report.summaries)
    if errors:
        lines += ["", errors]
    return "\n".join(lines) + "\n"


_MD_TITLE: Final = """# Benchmarks

Written by `python -m proxy.bench ... --markdown docs/benchmarks.md` (`make bench`). Each run
replaces its own section (same load settings), so re-running keeps this file current.
"""


def upsert_section(text: str, key: str, section: str) -> str:
    """Put ``section`` between markers named by ``key``: in place of the old one, or at the end."""
    begin, end = f"<!-- bench:begin {key} -->", f"<!-- bench:end {key} -->"
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if not text.strip():
        text = _MD_TITLE
    start = text.find(begin)
    stop = text.find(end, start) if start >= 0 else -1
    if start >= 0 and stop >= 0:
        return text[:start] + block + text[stop + len(end) :].lstrip("\n")
    return text.rstrip("\n") + "\n\n" + block


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class BenchSettings:
    streams: int = 100
    ramp: float = 1.0
    ttft: float = 0.05
    interval: float = 0.02
    tokens: int = 50
    drop: float = 0.3
    drop_at: int = 15
    slow: float = 0.0
    slow_delay: float = 0.2
    seed: int = 1
    direct: bool = False
    repeat: int = 1
    grace: float = 2.0
    timeout: float = 120.0
    target: str | None = None
    upstream: str | None = None
    proxy_pid: int | None = None
    model: str = "fake-model"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.streams < 1:
            raise BenchError("--streams must be >= 1")
        if self.tokens < 1:
            raise BenchError("--tokens must be >= 1")
        if self.repeat < 1:
            raise BenchError("--repeat must be >= 1")
        for name in ("ramp", "ttft", "interval", "slow_delay", "grace"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if not (0 < self.timeout < math.inf):
            raise BenchError("--timeout must be a finite number > 0")
        if self.drop > 0 and not 1 <= self.drop_at < self.tokens:
            raise BenchError("--drop-at must be in [1, --tokens) when --drop > 0")
        assign_roles(self.streams, self.drop, self.slow, self.seed)  # validates the fractions
        if self.direct and self.target is not None and self.upstream is None:
            raise BenchError("--direct with --target needs --upstream (the proxy's upstream)")
        for url in (self.target, self.upstream):
            if url is not None:
                _address(url)

    def describe(self) -> str:
        parts = [
            f"{self.streams} streams over a {self.ramp:g} s ramp",
            f"upstream TTFT {self.ttft * 1000:g} ms, {self.tokens} tokens "
            f"every {self.interval * 1000:g} ms",
            f"{self.drop:.0%} leave after token {self.drop_at}",
            f"{self.slow:.0%} read slowly ({self.slow_delay * 1000:g} ms between reads)",
            f"seed {self.seed}",
        ]
        if self.repeat > 1:
            parts.append(f"{self.repeat} repeats pooled")
        return "; ".join(parts)

    def key(self) -> str:
        """What identifies a load in the markdown file: the settings that shape it."""
        return (
            f"streams={self.streams} ramp={self.ramp:g} ttft={self.ttft:g} "
            f"interval={self.interval:g} tokens={self.tokens} drop={self.drop:g}@{self.drop_at} "
            f"slow={self.slow:g} seed={self.seed} direct={int(self.direct)} repeat={self.repeat}"
        )


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise BenchError(f"{url!r}: the bench speaks plain http://host:port only")
    return parts.hostname, parts.port or 80


@dataclass
class BenchReport:
    settings: BenchSettings
    summaries: dict[str, RunSummary]
    machine: dict[str, Any]
    command: str
    commit: str | None
    date: str
    env: dict[str, str]
    pids: dict[str, int]  # the children the bench started (gone once it returns)
    # The raw material, pooled per mode (not in the JSON: one entry per stream and token).
    runs: dict[str, RunData] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "command": self.command,
            "date": self.date,
            "commit": self.commit,
            "machine": self.machine,
            "env": self.env,
            "settings": dataclasses.asdict(self.settings),
            "runs": {mode: summary.to_json() for mode, summary in self.summaries.items()},
        }
        if "proxy" in self.summaries and "direct" in self.summaries:
            out["ratios"] = ratios(self.summaries["proxy"], self.summaries["direct"])
        return out


# --------------------------------------------------------------------------- children


class ChildExited(BenchError):
    def __init__(self, name: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(
            f"the {name} exited early (status {returncode}); its log ends:\n{log_tail}"
        )


def _free_port(host: str) -> int:
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
    text = _read(str(path)) or ""
    return "\n".join(text.splitlines()[-lines:]) or "(empty)"


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


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


async def _supervise(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own one child for as long as this task lives: a child that exits on its own is an
    error (it fails the bench at once instead of as a pile of refused connections)."""
    log = _open_log(log_path)
    try:
        process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl-C reaches the bench only, which then stops children in order.
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        log.close()  # the child has its own copy of the descriptor
    try:
        task_status.started(process)
        await process.wait()
        raise ChildExited(name, process.returncode, _log_tail(log_path))
    finally:
        await _stop_child(process)


async def _wait_ready(name: str, address: tuple[str, int], path: str, log: Path | None) -> None:
    """Poll ``path`` until it answers 200 (or, with no path, until a TCP connect succeeds)."""
    with trio.move_on_after(READY_TIMEOUT):
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
    raise BenchError(
        f"the {name} at {address[0]}:{address[1]} not ready in {READY_TIMEOUT} s{tail}"
    )


def _proxy_config(port: int, upstream: str, settings: BenchSettings) -> str:
    return (
        "# Written by proxy.bench for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        # Nothing of the bench's own load may queue in front of the pool.
        f"max_connections = {max(256, settings.streams + 16)}\n\n"
        f"[models.{json.dumps(settings.model)}]\n"
        f"upstreams = [{json.dumps(upstream)}]\n"
    )


# --------------------------------------------------------------------------- one run


async def _fetch_records(address: tuple[str, int], since: int) -> list[dict[str, Any]]:
    status, body = await http_get(address, f"/_fake/requests?since={since}")
    if status != 200:
        raise BenchError(f"fake upstream answered {status} to /_fake/requests")
    records = json.loads(body)
    if not isinstance(records, list):
        raise BenchError("fake upstream's /_fake/requests is not a list")
    return records


def _by_tag(records: list[dict[str, Any]], tags: set[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for record in records:
        body = record.get("body")
        tag = body.get("user") if isinstance(body, dict) else None
        if isinstance(tag, str) and tag in tags:
            out[tag] = record
    return out


async def _collect_records(
    address: tuple[str, int], since: int, results: list[StreamResult], grace: float
) -> tuple[dict[str, dict[str, Any]], int]:
    """The fake's records of this run, once every request it got is settled or ``grace``
    seconds have passed (what is still pending then is what the figures must show)."""
    expected = {result.tag for result in results if result.sent is not None}
    deadline = trio.current_time() + grace
    while True:
        fetched = await _fetch_records(address, since)
        records = _by_tag(fetched, expected)
        settled = len(records) == len(expected) and all(
            r.get("outcome") != "pending" for r in records.values()
        )
        if settled or trio.current_time() >= deadline:
            break
        await trio.sleep(RECORDS_POLL)
    cursor = max((int(r["id"]) + 1 for r in fetched), default=since)
    return records, cursor


async def _show_progress(label: str, progress: _Progress, total: int, out: TextIO) -> None:
    """One line on stderr, rewritten in place on a terminal; a line every 5 s in a log."""
    tty = out.isatty()
    started = time.monotonic()

    def show(final: bool = False) -> None:
        line = (
            f"[{label}] {time.monotonic() - started:5.1f} s  started {progress.started}/"
            f"{total}  finished {progress.finished}  failed {progress.failed}"
        )
        end = "\n" if final or not tty else ""
        print("\r" + line if tty else line, end=end, file=out, flush=True)

    try:
        while True:
            await trio.sleep(0.25 if tty else 5.0)
            show()
    finally:
        # Cancelled once the run is over: the final count, so the log ends with the truth.
        show(final=True)


@dataclass
class _Endpoints:
    proxy: tuple[str, int] | None
    upstream: tuple[str, int] | None
    proxy_pid: int | None
    upstream_pid: int | None


async def _run_once(
    mode: Mode,
    label: str,
    settings: BenchSettings,
    endpoints: _Endpoints,
    cursor: int,
) -> tuple[RunData, int]:
    address = endpoints.proxy if mode == "proxy" else endpoints.upstream
    assert address is not None
    roles = assign_roles(settings.streams, settings.drop, settings.slow, settings.seed)
    host, port = address
    results, requests = [], []
    for i, role in enumerate(roles):
        tag = f"{label}-{i}"
        results.append(StreamResult(index=i, tag=tag, role=role))
        body = chat_body(settings.model, tag, settings.ttft, settings.interval, settings.tokens)
        requests.append(build_request(host, port, "/v1/chat/completions", body))
    proxy_pid = endpoints.proxy_pid if mode == "proxy" else None
    if proxy_pid is not None:
        reset_peak_rss(proxy_pid)
    proxy_cpu0 = process_cpu_seconds(proxy_pid) if proxy_pid is not None else None
    proxy_wait0 = process_cpu_wait(proxy_pid) if proxy_pid is not None else None
    upstream_pid = endpoints.upstream_pid
    upstream_cpu0 = process_cpu_seconds(upstream_pid) if upstream_pid is not None else None
    client_cpu0 = own_cpu_seconds()
    progress = _Progress()
    step = settings.ramp / settings.streams
    # A short lead so that creating the tasks is not counted against the first streams.
    t0 = trio.current_time() + 0.05
    wall0 = time.monotonic() + 0.05
    async with trio.open_nursery() as nursery:
        if settings.progress:
            nursery.start_soon(_show_progress, mode, progress, settings.streams, sys.stderr)
        with trio.move_on_after(settings.ramp + settings.timeout):
            async with trio.open_nursery() as streams:
                for i, result in enumerate(results):
                    streams.start_soon(
                        partial(
                            run_stream,
                            address,
                            requests[i],
                            result,
                            start_at=t0 + i * step,
                            drop_at=settings.drop_at,
                            slow_delay=settings.slow_delay,
                            progress=progress,
                        )
                    )
        nursery.cancel_scope.cancel()
    wall = time.monotonic() - wall0
    client_cpu = own_cpu_seconds() - client_cpu0

    def delta(
        pid: int | None, before: float | None, read: Callable[[int], float | None]
    ) -> float | None:
        after = read(pid) if pid is not None else None
        return None if after is None or before is None else after - before

    run = RunData(
        mode=mode,
        results=results,
        records={},
        wall_s=wall,
        client_cpu_s=client_cpu,
        proxy_cpu_s=delta(proxy_pid, proxy_cpu0, process_cpu_seconds),
        proxy_cpu_wait_s=delta(proxy_pid, proxy_wait0, process_cpu_wait),
        proxy_peak_rss=process_peak_rss(proxy_pid) if proxy_pid is not None else None,
        upstream_cpu_s=delta(upstream_pid, upstream_cpu0, process_cpu_seconds),
        records_known=endpoints.upstream is not None,
    )
    if endpoints.upstream is not None:
        run.records, cursor = await _collect_records(
            endpoints.upstream, cursor, results, settings.grace
        )
    return run, cursor


async def _warm_up(address: tuple[str, int], settings: BenchSettings, tag: str) -> None:
    """One unmeasured stream, so that first-request costs (imports, pool set-up) are not
    counted as TTFT."""
    host, port = address
    body = chat_body(settings.model, tag, settings.ttft, settings.interval, min(settings.tokens, 3))
    result = StreamResult(index=-1, tag=tag, role="normal")
    request = build_request(host, port, "/v1/chat/completions", body)
    with trio.move_on_after(READY_TIMEOUT):
        await run_stream(
            address, request, result, start_at=trio.current_time(), drop_at=0, slow_delay=0
        )
    kind = classify(result)
    if kind is not None:
        raise BenchError(f"warm-up request to {host}:{port} failed: {kind}")


async def _git_commit() -> str | None:
    try:
        head = await trio.run_process(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        dirty = await trio.run_process(
            ["git", "status", "--porcelain", "--untracked-files=no"],
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


def _schedule(settings: BenchSettings) -> list[Mode]:
    """Alternate the modes across repeats, so that neither always runs on a cold machine."""
    if not settings.direct:
        return ["proxy"] * settings.repeat
    order: list[Mode] = []
    for rep in range(settings.repeat):
        order += ["direct", "proxy"] if rep % 2 == 0 else ["proxy", "direct"]
    return order


async def run_bench(settings: BenchSettings, *, command: str = "") -> BenchReport:
    """Start what is needed, run the load in every mode, stop the children, return figures."""
    machine = machine_info()  # first: its load average is the machine before our load
    _raise_fd_limit(settings.streams * 4 + 256)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    nonce = os.urandom(4).hex()  # tags unique even against an upstream reused across benches
    runs: dict[Mode, list[RunData]] = {}
    pids: dict[str, int] = {}
    try:
        async with trio.open_nursery() as nursery:
            upstream_pid: int | None = None
            if settings.upstream is not None:
                upstream: tuple[str, int] | None = _address(settings.upstream)
                upstream_url: str | None = settings.upstream.rstrip("/")
            elif settings.target is not None:
                upstream = upstream_url = None  # an outside proxy, upstream unknown
            else:
                upstream = ("127.0.0.1", _free_port("127.0.0.1"))
                upstream_url = f"http://127.0.0.1:{upstream[1]}"
                log = workdir / "fake-upstream.log"
                argv = [sys.executable, "-m", "proxy.cli", "fake-upstream"]
                argv += ["--host", "127.0.0.1", "--port", str(upstream[1])]
                argv += ["--ttft", str(settings.ttft), "--interval", str(settings.interval)]
                argv += ["--tokens", str(settings.tokens)]
                process = await nursery.start(_supervise, "fake upstream", argv, log)
                upstream_pid = pids["fake_upstream"] = process.pid
                await _wait_ready("fake upstream", upstream, "/health", log)
            if settings.target is not None:
                proxy = _address(settings.target)
                proxy_pid = settings.proxy_pid
                await _wait_ready("proxy", proxy, "", None)
            else:
                assert upstream_url is not None
                proxy = ("127.0.0.1", _free_port("127.0.0.1"))
                config = workdir / "proxy.toml"
                _write_text(config, _proxy_config(proxy[1], upstream_url, settings))
                log = workdir / "proxy.log"
                argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
                process = await nursery.start(_supervise, "proxy", argv, log)
                proxy_pid = pids["proxy"] = process.pid
                await _wait_ready("proxy", proxy, "/healthz", log)
            endpoints = _Endpoints(proxy, upstream, proxy_pid, upstream_pid)
            await _warm_up(proxy, settings, f"bench-{nonce}-warmup-proxy")
            if settings.direct:
                assert upstream is not None
                await _warm_up(upstream, settings, f"bench-{nonce}-warmup-direct")
            cursor = 0
            for n, mode in enumerate(_schedule(settings)):
                label = f"bench-{nonce}-{mode}{n}"
                run, cursor = await _run_once(mode, label, settings, endpoints, cursor)
                runs.setdefault(mode, []).append(run)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # A child that died or never came up, or Ctrl-C: raise that one error plainly, so
        # callers (and ``sluice``'s own ``except KeyboardInterrupt``) see it as it is. A mix,
        # or anything else (cancellation included), goes on as it came.
        for kind in (BenchError, KeyboardInterrupt):
            matched, rest = group.split(kind)
            if matched is not None and rest is None:
                raise _first_leaf(matched) from None
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    pooled: dict[str, RunData] = {
        mode: merge_runs(runs[mode]) for mode in ("proxy", "direct") if mode in runs
    }
    summaries: dict[str, RunSummary] = {mode: summarize(run) for mode, run in pooled.items()}
    return BenchReport(
        settings=settings,
        summaries=summaries,
        machine=machine,
        command=command,
        commit=await _git_commit(),
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        env={k: v for k, v in os.environ.items() if k.startswith("SLUICE_")},
        pids=pids,
        runs=pooled,
    )


def _first_leaf(group: BaseExceptionGroup[_E]) -> _E:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchSettings()
    add = parser.add_argument
    add("--streams", type=int, default=d.streams, help="concurrent streaming requests")
    add("--ramp", type=float, default=d.ramp, help="seconds over which streams start, evenly")
    add("--ttft", type=float, default=d.ttft, help="fake upstream: seconds to the first token")
    add("--interval", type=float, default=d.interval, help="fake upstream: seconds per token")
    add("--tokens", type=int, default=d.tokens, help="fake upstream: tokens per answer")
    add("--drop", type=float, default=d.drop, help="fraction of clients that leave mid-stream")
    add("--drop-at", type=int, default=d.drop_at, help="a leaving client closes after token K")
    add("--slow", type=float, default=d.slow, help="fraction of clients that read slowly")
    add("--slow-delay", type=float, default=d.slow_delay, help="a slow reader's sleep per read")
    add("--seed", type=int, default=d.seed, help="seed of who leaves and who reads slowly")
    add("--direct", action="store_true", help="also run the same load straight at the upstream")
    add("--repeat", type=int, default=d.repeat, help="runs per mode, alternating, pooled")
    add("--grace", type=float, default=d.grace, help="seconds to wait for upstream to see closes")
    add("--timeout", type=float, default=d.timeout, help="seconds a run may take after its ramp")
    add("--target", help="an already running proxy (http://host:port) instead of starting one")
    add("--upstream", help="an already running fake upstream (http://host:port)")
    add("--proxy-pid", type=int, help="with --target: its PID, for CPU and RSS figures")
    add("--model", default=d.model, help="model name to request")
    add("--json", type=Path, help="write every figure as JSON here")
    add("--markdown", type=Path, help="write (or replace) this load's section in this file")
    add("--quiet", action="store_true", help="no progress line on stderr")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(
        streams=args.streams,
        ramp=args.ramp,
        ttft=args.ttft,
        interval=args.interval,
        tokens=args.tokens,
        drop=args.drop,
        drop_at=args.drop_at,
        slow=args.slow,
        slow_delay=args.slow_delay,
        seed=args.seed,
        direct=args.direct,
        repeat=args.repeat,
        grace=args.grace,
        timeout=args.timeout,
        target=args.target,
        upstream=args.upstream,
        proxy_pid=args.proxy_pid,
        model=args.model,
        progress=not args.quiet,
    )


def _command_line(argv: Sequence[str] | None = None) -> str:
    if argv is not None:
        return shlex.join(["python", "-m", "proxy.bench", *argv])
    program = Path(sys.argv[0]).name
    if program in ("bench.py", "__main__.py"):
        program = "python -m proxy.bench"
    return " ".join([program, shlex.join(sys.argv[1:])]).strip()


async def run_from_args(args: argparse.Namespace) -> None:
    try:
        settings = settings_from_args(args)
        command = getattr(args, "bench_command", None) or _command_line()
        report = await run_bench(settings, command=command)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"sluice bench: {settings.describe()}")
    print(format_table(report.summaries))
    errors = _errors_line(report.summaries)
    if errors:
        print(errors)
    # Small local files, written once at the end: a blocking write is fine here.
    if args.json is not None:
        _write_text(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    if args.markdown is not None:
        old = _read(str(args.markdown)) or ""
        _write_text(args.markdown, upsert_section(old, settings.key(), markdown_section(report)))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.bench", description=(__doc__ or "").splitlines()[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.bench_command = _command_line(argv)
    try:
        trio.run(run_from_args, args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
