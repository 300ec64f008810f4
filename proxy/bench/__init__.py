"""``sluice bench``: a reproducible load generator that measures what the proxy promises.

It starts the fake upstream and the proxy as subprocesses (so that their CPU time and memory are
measured apart from the load generator's), opens N concurrent streaming chat requests ramped
over R seconds, makes a seeded fraction of the clients leave mid-stream (and another read
slowly), and reports:

* time to first token and the gaps between tokens, as the clients saw them;
* cancel propagation: from a client's ``close()`` to the moment the fake upstream saw its own
  connection go (both ``time.monotonic()``, which is one clock for every process on the
  machine), and how many tokens the upstream generated for nobody;
* the proxy's CPU time per relayed event and its peak RSS, read from ``/proc``, and its RSS
  (and the fake's) sampled every 50 ms over the run;
* for slow readers: whether they finished, and how far backpressure held the upstream back.

With ``--direct`` the identical load also runs straight at the fake upstream, and every figure
is printed for proxy, direct and proxy/direct. With ``--baseline`` the same load also runs
through the same proxy with the slow readers reading at full speed (proxy/baseline): the
proxy's memory with and without clients that stop reading. With ``--peer auto`` (or ``--peer
URL --peer-pid PID``) the same load also runs through the peer to beat, a FastAPI + httpx
gateway (``shared/peers/``) relaying to the same fake upstream, alternating with Sluice, and
every figure is printed for both and proxy/peer: above all CPU per relayed event, the figure
that survives a noisy machine. ``--plots DIR`` (on by default
next to ``--markdown``) draws with matplotlib the latency CDFs, p50 and p99 marked, and each
relay's RSS as growth over its run's start (and per stream), in files named by the load's
settings that differ from the defaults (``bench-100-streams-vs-direct-latency.png``), so
that a rerun replaces its own.

Sluice reaches its upstream through one of two transports, ``--transport auto|lean|httpx``
(written as ``[upstream] transport`` into the config the bench gives the proxy; auto is lean
here, since the config also says ``proxy = "none"``: the bench's upstream is never reached
through the environment's proxy). With ``--versus-transport lean|httpx`` a second Sluice
process, identical but for its transport, runs the same load alternating with the first,
exactly as the peer does (A, B; then B, A; ``--repeat`` rounds); every figure is printed for
both, in columns labelled by transport (``proxy (lean)``, ``proxy (httpx)``) with the ratio
``lean/httpx`` (``--transport`` over ``--versus-transport``; an ``auto`` ``--transport`` is
then the other of the two). It combines with ``--peer``, ``--direct`` and ``--baseline``,
whose ratios stay those of the first proxy.

``--upstream-habit close-after-response|keepalive-timeout|late-close`` (with
``--upstream-habit-seconds S``, 0.05 by default, for the two timed ones) gives the fake
upstream a real server's way of ending kept-alive connections: close after every answer, close
one idle S seconds, or close S seconds after an answer without reading a request written
meanwhile (the keep-alive race). The proxy's pool must survive each with 0 errors; any
error is counted by kind, for each proxy, below the table.

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
import importlib
import json
import math
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
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
    "RssGrowth",
    "RssStats",
    "RunData",
    "RunSummary",
    "Samples",
    "StreamResult",
    "add_arguments",
    "all_ratios",
    "assign_roles",
    "cdf_points",
    "classify",
    "collect_samples",
    "column_labels",
    "format_table",
    "latency_figure",
    "latency_series",
    "load_name",
    "load_pyplot",
    "main",
    "markdown_section",
    "merge_runs",
    "minor_tick_label",
    "ms_text",
    "parse_cpu_seconds",
    "parse_meminfo_total",
    "parse_schedstat_wait",
    "parse_vm_hwm",
    "parse_vm_rss",
    "per_stream_kib",
    "percentile",
    "plot_labels",
    "plots_dir",
    "pooled_rss",
    "process_rss",
    "ratios",
    "relative_link",
    "rss_figure",
    "rss_growth",
    "rss_series",
    "rss_stats",
    "run_bench",
    "run_from_args",
    "run_stoppable",
    "sample_rss",
    "settings_from_args",
    "summarize",
    "upsert_section",
    "upstream_held",
    "write_plots",
]

Role = Literal["normal", "drop", "slow"]
_E = TypeVar("_E", bound=BaseException)
# "baseline": the proxy again, with every slow reader reading at full speed. "peer": the same
# load through the peer to beat (another relay in front of the same fake upstream). "versus":
# a second Sluice process, the same but for its upstream transport (--versus-transport).
Mode = Literal["proxy", "versus", "peer", "direct", "baseline"]
MODES: Final[tuple[Mode, ...]] = ("proxy", "versus", "peer", "direct", "baseline")
# Sluice's upstream transports (``[upstream] transport``), as proxy.config knows them.
TRANSPORTS: Final = ("auto", "lean", "httpx")
# The fake upstream's connection habits (its flag of the same name, "none": no flag).
HABITS: Final = ("none", "close-after-response", "keepalive-timeout", "late-close")
TIMED_HABITS: Final = ("keepalive-timeout", "late-close")
DEFAULT_HABIT_SECONDS: Final = 0.05
# One run's RSS samples per process ("proxy", "fake_upstream"): (seconds since the run
# began, bytes).
RssTrace = dict[str, list[tuple[float, int]]]

RECV_SIZE: Final = 64 * 1024
MAX_HEAD_BYTES: Final = 64 * 1024
# A chunk-size line is a few hex digits (plus rare extensions); anything longer is garbage.
MAX_CHUNK_LINE: Final = 1024
READY_TIMEOUT: Final = 30.0
# The peer's first start builds its own venv with pip: minutes, not seconds.
PEER_READY_TIMEOUT: Final = 600.0
# Where ``--peer auto`` finds the peer's starter: ``shared/peers`` beside the repository.
PEERS_DIR: Final = Path(__file__).resolve().parents[3] / "shared" / "peers"
PEER_SCRIPT: Final = "run-fastapi-gateway"
# How long a child gets to exit after SIGTERM before SIGKILL. The proxy's own graceful shutdown
# is set to 1 s in the config we write, so this is rarely reached.
STOP_TIMEOUT: Final = 5.0
RECORDS_POLL: Final = 0.2
RSS_PERIOD: Final = 0.05
# Points per CDF line in a plot: enough to be smooth, few enough for a small PNG.
CDF_POINTS: Final = 2000

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
    ended_at: float | None = None  # the socket closed, for whatever reason


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
    slow_rcvbuf: int = 0,
    slow_mss: int = 0,
    progress: _Progress | None = None,
) -> None:
    """Run one client at ``start_at`` (trio clock), filling ``result`` as it goes.

    Never raises for what the server did: a refused connection or a garbled response is the
    result's ``error``; only cancellation leaves (with ``ended`` False).

    A slow reader's ``slow_rcvbuf`` (SO_RCVBUF) and ``slow_mss`` (TCP_MAXSEG) are set before
    connect, where they shape the connection: a small receive window fills after a few events,
    and an MSS like a real network's keeps the proxy's send buffer at the size it would have
    there (on loopback's 64 KiB MSS the kernel grows it to ~4 MiB, which absorbs a whole
    stream before the proxy ever sees a full socket).
    """
    await trio.sleep_until(start_at)
    if progress is not None:
        progress.started += 1
    parser = ResponseParser()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # The request is one small write; without NODELAY it could wait for a delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if result.role == "slow":
            if slow_rcvbuf:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, slow_rcvbuf)
            if slow_mss:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, slow_mss)
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
        result.ended_at = time.monotonic()
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


def process_rss(pid: int) -> int | None:
    """Sum of VmRSS over the tree (pages shared between workers count once per worker)."""
    sizes = [parse_vm_rss(_read(f"/proc/{each}/status") or "") for each in _process_tree(pid)]
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


@dataclass(frozen=True)
class RssStats:
    """One process's RSS over a run, from its samples, in bytes."""

    start: int
    peak: int
    end: int
    samples: int

    @property
    def growth(self) -> int:
        """How far above its level at the start the process went: what the run cost."""
        return self.peak - self.start


def rss_stats(samples: Sequence[tuple[float, int]]) -> RssStats | None:
    """First, largest and last of (time, bytes) samples in time order; None for none."""
    if not samples:
        return None
    sizes = [size for _, size in samples]
    return RssStats(start=sizes[0], peak=max(sizes), end=sizes[-1], samples=len(sizes))


def pooled_rss(traces: Sequence[RssTrace], process: str) -> RssStats | None:
    """Over repeats: the lowest start, the highest peak, the last end; the samples summed."""
    stats = [s for s in (rss_stats(trace.get(process, [])) for trace in traces) if s]
    if not stats:
        return None
    return RssStats(
        start=min(s.start for s in stats),
        peak=max(s.peak for s in stats),
        end=stats[-1].end,
        samples=sum(s.samples for s in stats),
    )


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
    rss: list[RssTrace] = field(default_factory=list)  # one trace per pooled run
    # The upstream's seconds per token, to tell a fake held back by backpressure from one on
    # schedule; None: unknown (not ours, or pooled over different settings).
    interval: float | None = None


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
        rss=[trace for run in runs for trace in run.rss],
        interval=first.interval if all(r.interval == first.interval for r in runs) else None,
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
    # From the RSS samples: the proxy's RSS as the run began and how far it rose above that;
    # the fake's highest.
    proxy_rss_start_mib: float | None = None
    proxy_rss_growth_mib: float | None = None
    upstream_peak_rss_mib: float | None = None
    # Slow readers (None where the load has none).
    slow_streams: int | None = None
    slow_completed: int | None = None  # got [DONE], no error
    slow_read_p50_s: float | None = None  # request written to [DONE]
    slow_read_max_s: float | None = None
    # How much later than its own schedule the upstream finished a slow reader's answer:
    # ~0 when everything was buffered somewhere on the way, seconds when a full socket held
    # the upstream back (backpressure reached it).
    slow_upstream_held_min_s: float | None = None
    slow_upstream_held_p50_s: float | None = None
    slow_upstream_held_max_s: float | None = None
    # The same for every other stream that completed: what "on schedule" looks like here.
    other_upstream_held_p99_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _per_event_us(cpu_s: float | None, events: int) -> float | None:
    return None if cpu_s is None or not events else cpu_s * 1e6 / events


@dataclass
class Samples:
    """Every measured value of one run, before percentiles: what summaries and plots share.

    Latencies are seconds. ``cancels`` and ``wasted`` cover the dropped streams whose upstream
    record was found; ``held`` the slow readers whose upstream record says when it finished.
    """

    connects: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    cancels: list[float] = field(default_factory=list)
    wasted: list[int] = field(default_factory=list)
    slow_reads: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    other_held: list[float] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    dropped: int = 0
    unseen: int = 0
    unmatched: int = 0
    slow: int = 0
    slow_completed: int = 0


def upstream_held(record: dict[str, Any], interval: float) -> float | None:
    """Seconds the upstream finished an answer after its own schedule (first token, then one
    every ``interval``); None when the record lacks the times."""
    first, finished = record.get("first_token_at_mono"), record.get("finished_at_mono")
    tokens = int(record.get("tokens_sent", 0))
    if first is None or finished is None or tokens < 1:
        return None
    return float(finished) - float(first) - (tokens - 1) * interval


def collect_samples(run: RunData) -> Samples:
    out = Samples()
    for result in run.results:
        kind = classify(result)
        if kind is not None:
            out.kinds[kind] += 1
        if result.role == "slow":
            out.slow += 1
        if result.started is not None and result.connected is not None:
            out.connects.append(result.connected - result.started)
        if result.sent is not None and result.first_token is not None:
            out.ttfts.append(result.first_token - result.sent)
        out.gaps.extend(result.gaps)
        if kind is not None:
            continue
        record = run.records.get(result.tag)
        if result.role != "drop":
            out.completed += 1
            slow = result.role == "slow"
            if slow:
                out.slow_completed += 1
                if result.sent is not None and result.ended_at is not None:
                    out.slow_reads.append(result.ended_at - result.sent)
            if record is not None and run.interval is not None:
                held = upstream_held(record, run.interval)
                if held is not None:
                    (out.held if slow else out.other_held).append(held)
            continue
        out.dropped += 1
        assert result.closed_at is not None  # classify() said it left as planned
        if record is None:
            out.unmatched += 1
            continue
        seen = record.get("disconnected_at_mono")
        if seen is None:
            out.unseen += 1
        else:
            out.cancels.append(float(seen) - result.closed_at)
        out.wasted.append(int(record.get("tokens_sent", 0)) - result.content)
    return out


def _mib(size: int | None) -> float | None:
    return None if size is None else size / 2**20


def summarize(run: RunData) -> RunSummary:
    results = run.results
    samples = collect_samples(run)
    cancels, wasted, kinds = samples.cancels, samples.wasted, samples.kinds
    events = sum(result.events for result in results)
    known = run.records_known
    proxy_rss = pooled_rss(run.rss, "proxy")
    upstream_rss = pooled_rss(run.rss, "fake_upstream")
    slow = samples.slow or None
    return RunSummary(
        streams=len(results),
        completed=samples.completed,
        dropped=samples.dropped,
        errors=sum(kinds.values()),
        error_kinds=dict(kinds),
        wall_s=run.wall_s,
        events=events,
        tokens=sum(result.content for result in results),
        events_per_s=events / run.wall_s if run.wall_s > 0 else None,
        connect_p50_ms=_ms(percentile(samples.connects, 50)),
        connect_p99_ms=_ms(percentile(samples.connects, 99)),
        ttft_p50_ms=_ms(percentile(samples.ttfts, 50)),
        ttft_p99_ms=_ms(percentile(samples.ttfts, 99)),
        gap_p50_ms=_ms(percentile(samples.gaps, 50)),
        gap_p99_ms=_ms(percentile(samples.gaps, 99)),
        cancel_p50_ms=_ms(percentile(cancels, 50)),
        cancel_p99_ms=_ms(percentile(cancels, 99)),
        cancel_max_ms=_ms(max(cancels)) if cancels else None,
        cancel_unseen=samples.unseen if known else None,
        cancel_unmatched=samples.unmatched if known else None,
        wasted_tokens_mean=_mean(wasted),
        wasted_tokens_max=max(wasted) if wasted else None,
        proxy_cpu_s=run.proxy_cpu_s,
        proxy_cpu_wait_s=run.proxy_cpu_wait_s,
        proxy_cpu_us_per_event=_per_event_us(run.proxy_cpu_s, events),
        proxy_peak_rss_mib=_mib(run.proxy_peak_rss),
        upstream_cpu_us_per_event=_per_event_us(run.upstream_cpu_s, events),
        client_cpu_us_per_event=_per_event_us(run.client_cpu_s, events),
        proxy_rss_start_mib=_mib(proxy_rss.start) if proxy_rss else None,
        proxy_rss_growth_mib=_mib(proxy_rss.growth) if proxy_rss else None,
        upstream_peak_rss_mib=_mib(upstream_rss.peak) if upstream_rss else None,
        slow_streams=slow,
        slow_completed=samples.slow_completed if slow else None,
        slow_read_p50_s=percentile(samples.slow_reads, 50),
        slow_read_max_s=max(samples.slow_reads) if samples.slow_reads else None,
        slow_upstream_held_min_s=min(samples.held) if samples.held else None,
        slow_upstream_held_p50_s=percentile(samples.held, 50),
        slow_upstream_held_max_s=max(samples.held) if samples.held else None,
        other_upstream_held_p99_s=percentile(samples.other_held, 99),
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
    ("proxy_rss_start_mib", "proxy RSS as the run began (MiB)", ".1f"),
    ("proxy_rss_growth_mib", "proxy RSS rise during the run (MiB)", ".1f"),
    ("upstream_peak_rss_mib", "fake upstream peak RSS (MiB)", ".1f"),
    ("upstream_cpu_us_per_event", "fake upstream CPU per event (µs)", ".1f"),
    ("client_cpu_us_per_event", "load generator CPU per event (µs)", ".1f"),
    ("slow_streams", "slow readers", "d"),
    ("slow_completed", "slow readers completed", "d"),
    ("slow_read_p50_s", "slow reader's read time p50 (s)", ".2f"),
    ("slow_read_max_s", "slow reader's read time max (s)", ".2f"),
    ("slow_upstream_held_min_s", "upstream held back by a slow reader, min (s)", ".2f"),
    ("slow_upstream_held_p50_s", "upstream held back by a slow reader, p50 (s)", ".2f"),
    ("slow_upstream_held_max_s", "upstream held back by a slow reader, max (s)", ".2f"),
    ("other_upstream_held_p99_s", "upstream held back, other streams, p99 (s)", ".2f"),
)
# Counts of the load itself: the same on both sides by construction, no ratio.
_NO_RATIO: Final = frozenset({"streams", "completed", "dropped", "slow_streams"})
# Rows of a load with slow readers only.
_SLOW_ROWS: Final = frozenset(
    name for name, _, _ in FIGURES if name.startswith(("slow_", "other_upstream"))
)
# Rows about dropped streams: nothing to say where none left as planned (a load without drops).
_DROP_ROWS: Final = frozenset(
    name for name, _, _ in FIGURES if name.startswith(("cancel_", "wasted_"))
)
# Modes a proxy run is compared with, in the order of their ratio columns.
_REFERENCES: Final[tuple[Mode, ...]] = ("versus", "peer", "direct", "baseline")


def ratios(proxy: RunSummary, direct: RunSummary) -> dict[str, float | None]:
    """proxy / reference (direct or baseline) for every figure both sides measured (None
    where the reference is 0)."""
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


def all_ratios(summaries: dict[str, RunSummary]) -> dict[str, dict[str, float | None]]:
    """``{"proxy/versus": ..., "proxy/peer": ..., "proxy/direct": ..., "proxy/baseline": ...}``
    for the references present."""
    if "proxy" not in summaries:
        return {}
    return {
        f"proxy/{ref}": ratios(summaries["proxy"], summaries[ref])
        for ref in _REFERENCES
        if ref in summaries
    }


def table_rows(
    summaries: dict[str, RunSummary], labels: dict[str, str] | None = None
) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows; ``labels`` (see :func:`column_labels`) rename the columns
    of modes and ratios."""
    labels = labels or {}
    modes = list(summaries)
    rates = all_ratios(summaries)
    header = ["figure", *(labels.get(m, m) for m in modes), *(labels.get(r, r) for r in rates)]
    slow = any(summary.slow_streams for summary in summaries.values())
    dropped = any(summary.dropped for summary in summaries.values())
    rows = []
    for name, label, spec in FIGURES:
        if (name in _SLOW_ROWS and not slow) or (name in _DROP_ROWS and not dropped):
            continue
        values = [getattr(summaries[mode], name) for mode in modes]
        row = [label, *(_fmt(value, spec) for value in values)]
        for rate in rates.values():
            value = rate.get(name)
            row.append("—" if value is None else f"{value:.2f}x")
        rows.append(row)
    return header, rows


def format_table(summaries: dict[str, RunSummary], labels: dict[str, str] | None = None) -> str:
    header, rows = table_rows(summaries, labels)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _errors_line(summaries: dict[str, RunSummary], labels: dict[str, str] | None = None) -> str:
    """Every error by kind, per mode (its column's label); "" when there were none."""
    labels = labels or {}
    parts = []
    for mode, summary in summaries.items():
        if summary.error_kinds:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(summary.error_kinds.items()))
            parts.append(f"{labels.get(mode, mode)}: {kinds}")
    return "errors by kind — " + "; ".join(parts) if parts else ""


def column_labels(settings: BenchSettings) -> dict[str, str]:
    """Column names for modes and ratios that say more than the mode: with
    ``--versus-transport``, ``proxy (lean)``, ``proxy (httpx)`` and ``lean/httpx`` (and
    ``lean/peer`` and so on for the first proxy's other ratios); with ``--transport`` alone,
    ``proxy (httpx)``."""
    a, b = settings.transport, settings.versus_transport
    if b is None:
        return {"proxy": f"proxy ({a})"} if a != "auto" else {}
    labels = {"proxy": f"proxy ({a})", "versus": f"proxy ({b})", "proxy/versus": f"{a}/{b}"}
    for ref in ("peer", "direct", "baseline"):
        labels[f"proxy/{ref}"] = f"{a}/{ref}"
    return labels


# --------------------------------------------------------------------------- markdown


def _title(report: BenchReport, relay: str = "proxy") -> str:
    """What the load is, in words; ``relay`` names Sluice ("proxy" in the markdown, whose
    columns say so, "Sluice" on the plots)."""
    settings = report.settings
    title = f"{settings.streams} streams"
    if settings.workers > 1:
        title += f", {relay} with {settings.workers} workers"
    if settings.pin:
        title += (
            f", {relay} on a core of its own"
            if settings.workers == 1
            else f", {relay} on its own cores"
        )
    if settings.slow:
        title += f", {settings.slow:.0%} slow readers"
    if settings.versus_transport is not None:
        title += f", transport {settings.transport} vs {settings.versus_transport}"
    elif settings.transport != "auto":
        title += f", {settings.transport} transport"
    if settings.upstream_habit != "none":
        title += ", upstream " + settings.habit_text()
    others = [mode for mode in report.summaries if mode not in ("proxy", "versus")]
    if "proxy" in report.summaries and others:
        title += f", {relay} vs " + " and ".join(others)
    return title


def markdown_section(report: BenchReport, plots: Sequence[tuple[str, str]] = ()) -> str:
    """The section of one load; ``plots`` are (description, link relative to the file)."""
    settings = report.settings
    machine = report.machine
    ram = machine.get("ram_bytes")
    ram_text = f"{ram / 2**30:.1f} GiB RAM" if ram else "RAM unknown"
    labels = column_labels(settings)
    header, rows = table_rows(report.summaries, labels)
    lines = [
        f"## {_title(report)}",
        "",
        f"- Machine: {machine.get('cores')} cores ({machine.get('cpu') or 'unknown CPU'}), "
        f"{ram_text}, {machine.get('system')}, Python {machine.get('python')}; "
        f"load average {machine.get('loadavg_1m')} as it began",
        f"- Date: {report.date}; commit: {report.commit or 'unknown'}",
        f"- Command: `{report.command}`",
        f"- Load: {settings.describe()}",
    ]
    if "baseline" in report.summaries:
        lines.append(
            "- baseline: the same load through the same proxy, run just before, with the slow "
            "readers reading at full speed"
        )
    if "versus" in report.summaries:
        a, b = settings.transport, settings.versus_transport
        lines.append(
            f"- {labels['versus']}: a second Sluice process, identical to {labels['proxy']} but "
            f'for `transport = "{b}"` in its `[upstream]`, relaying to the same fake upstream '
            f"and alternating with it run by run; {a}/{b} is {labels['proxy']} over "
            f"{labels['versus']}"
        )
    if "peer" in report.summaries:
        how = "started by the bench" if report.settings.peer == "auto" else "already running"
        lines.append(
            "- peer: the FastAPI + httpx gateway on uvicorn/uvloop/httptools "
            f"(`shared/peers/fastapi_gateway.py`, {how}), relaying to the same fake upstream, "
            "alternating with the proxy; its CPU and RSS rows are the peer's process tree"
        )
    if report.cpus:
        where = "; ".join(
            f"{name.replace('_', ' ')} on CPU {','.join(map(str, cpus))}"
            for name, cpus in report.cpus.items()
        )
        lines.append(f"- Pinned (`--pin`): {where}")
    if report.env:
        env = " ".join(f"{k}={v}" for k, v in sorted(report.env.items()))
        lines.append(f"- Environment: `{env}`")
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    errors = _errors_line(report.summaries, labels)
    if errors:
        lines += ["", errors]
    if plots:
        lines.append("")
        lines += [f"![{alt}]({link})" for alt, link in plots]
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
        rest = text[stop + len(end) :].lstrip("\n")
        # A blank line before whatever follows (another section, bench_local's), as appended.
        return text[:start] + block + ("\n" + rest if rest else "")
    return text.rstrip("\n") + "\n\n" + block


# --------------------------------------------------------------------------- plots


def cdf_points(
    values: Iterable[float], max_points: int = CDF_POINTS
) -> tuple[list[float], list[float]]:
    """An empirical CDF as a step line's points: sorted values, and the fraction of values at
    or below each. More than ``max_points`` values are thinned to evenly spaced ranks (the
    first and the last always kept), so a line of 50,000 gaps costs what one of 2,000 does."""
    data = sorted(values)
    n = len(data)
    if not n:
        return [], []
    if n <= max_points:
        ranks = list(range(n))
    else:
        step = (n - 1) / (max(max_points, 2) - 1)
        ranks = sorted({round(i * step) for i in range(max(max_points, 2))})
    return [data[r] for r in ranks], [(r + 1) / n for r in ranks]


def latency_series(run: RunData) -> dict[str, list[float]]:
    """What the latency CDF plot draws for one mode, in milliseconds."""
    samples = collect_samples(run)
    return {
        "ttft": [v * 1000 for v in samples.ttfts],
        "gap": [v * 1000 for v in samples.gaps],
        "cancel": [v * 1000 for v in samples.cancels],
    }


@dataclass(frozen=True)
class RssGrowth:
    """One process's RSS over one run as growth over the run's own start: what the run cost,
    whatever the process held before it began."""

    seconds: list[float]  # since the run began
    mib: list[float]  # MiB above the first sample
    start_mib: float  # the first sample, in MiB

    @property
    def peak_mib(self) -> float:
        return max(self.mib)


def rss_growth(samples: Sequence[tuple[float, int]]) -> RssGrowth | None:
    """(seconds, bytes) samples in time order as MiB above the first; None for none."""
    if not samples:
        return None
    start = samples[0][1]
    return RssGrowth(
        seconds=[t for t, _ in samples],
        mib=[(size - start) / 2**20 for _, size in samples],
        start_mib=start / 2**20,
    )


def per_stream_kib(mib: Any, streams: int) -> Any:
    """MiB of growth as KiB per concurrent stream (numbers or numpy arrays alike)."""
    return mib * 1024 / streams


def rss_series(run: RunData, process: str = "proxy") -> list[RssGrowth]:
    """The RSS growth of ``process`` in each pooled run in which it was sampled."""
    lines = [rss_growth(trace.get(process, [])) for trace in run.rss]
    return [line for line in lines if line is not None]


def load_pyplot(without: str = "pass --no-plots") -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), imported here and only
    here: the bench runs without matplotlib unless plots are asked for. ``without`` says how
    to do without them."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise BenchError(
            f"plots need matplotlib: pip install -e '.[bench]' (or {without})"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


LOG_FLOOR_MS: Final = 0.01
_PANELS: Final = (
    ("ttft", "time to first token (ms)"),
    ("gap", "inter-token gap (ms)"),
    ("cancel", "cancel propagation (ms)"),
)


def log_axis_left(lines: Sequence[Sequence[float]]) -> float | None:
    """Where a log axis for these lines should begin: half the lowest 0.5th percentile of
    their positive values (so one outlier near 0 does not squash the rest); None for none."""
    lows = [
        low
        for values in lines
        if (low := percentile((v for v in values if v > 0), 0.5)) is not None
    ]
    return max(min(lows) / 2, LOG_FLOOR_MS) if lows else None


def cdf_label(name: str, values: Sequence[float]) -> str:
    zeros = sum(1 for v in values if v <= 0)
    return f"{name}, n={len(values)}" + (f", {zeros} of them 0" if zeros else "")


_STYLE: Final[dict[str, dict[str, Any]]] = {
    "proxy": {"color": "tab:blue"},
    "direct": {"color": "tab:gray", "linestyle": "--"},
    "baseline": {"color": "tab:green", "linestyle": "--"},
    "peer": {"color": "tab:orange"},
    "versus": {"color": "tab:purple"},
}


def _log_axis(ax: Any, ticker: Any, left: float | None) -> None:
    """A log x axis from ``left``, labelled in plain numbers (50, not 5x10^1); within a decade
    and a half, the minor ticks get labels too, or a narrow axis would have none."""
    ax.set_xscale("log")
    plain = ticker.FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    if left is None:
        return
    ax.set_xlim(left=left)
    low, high = ax.get_xlim()
    if high / low < 10**1.5:
        ax.xaxis.set_minor_formatter(ticker.FuncFormatter(minor_tick_label))
    else:
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def minor_tick_label(value: float, _: object = None) -> str:
    """2, 3 and 5 times a power of ten get a label; the others would crowd the axis."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2, 3, 5) else ""


def plot_labels(settings: BenchSettings) -> dict[str, str]:
    """What each mode is called in the plots' legends: Sluice by name (and by transport where
    two run, or one was named), the peer by what it is."""
    a, b = settings.transport, settings.versus_transport
    sluice = "Sluice" if a == "auto" and b is None else f"Sluice ({a})"
    labels = {
        "proxy": sluice,
        "peer": "peer (FastAPI + httpx)",
        "direct": "direct to the fake upstream",
        "baseline": f"{sluice}, slow readers reading fast",
    }
    if b is not None:
        labels["versus"] = f"Sluice ({b})"
    return labels


def ms_text(value: float) -> str:
    """A latency in ms for a label: three significant digits, never an exponent."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


# The percentiles marked on every CDF line, with the fraction of samples at each.
_MARKS: Final = ((50, 0.5), (99, 0.99))


def _mark_percentiles(ax: Any, lines: Sequence[tuple[str, Sequence[float]]]) -> None:
    """A dot on each line at its p50 and p99 and a short label beside it in the line's colour;
    the labels of different lines are staggered, so that close ones stay legible. Room for
    them is made on the right of the (log) axis."""
    low, high = ax.get_xlim()
    high = high * (high / low) ** 0.2
    ax.set_xlim(low, high)
    for _, y in _MARKS:
        ax.axhline(y, color="0.6", linewidth=0.6, linestyle=":", zorder=1)
    for slot, (color, values) in enumerate(lines):
        for q, y in _MARKS:
            value = percentile(values, q)
            if value is None:
                continue
            # A value left of the axis (a gap of 0) is drawn at its edge, labelled as it is.
            at = min(max(value, low), high)
            ax.plot([at], [y], marker="o", markersize=4.5, color=color, linestyle="none", zorder=4)
            ax.annotate(
                f"p{q} {ms_text(value)} ms",
                (at, y),
                xytext=(5, -9 - 10 * slot),
                textcoords="offset points",
                color=color,
                fontsize=7.5,
                va="center",
                bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none"},
                zorder=5,
            )


def _latency_panels(series: dict[str, dict[str, list[float]]]) -> list[tuple[str, str]]:
    """A panel per latency that was measured (no drops: no cancel propagation)."""
    return [(k, label) for k, label in _PANELS if any(v[k] for v in series.values())]


def latency_figure(
    report: BenchReport, series: dict[str, dict[str, list[float]]] | None = None
) -> Any | None:
    """The latency CDFs, a panel per latency measured, p50 and p99 marked on every line; None
    when nothing was measured. ``series``: ``latency_series`` of each run, if at hand."""
    plt = load_pyplot()
    ticker = importlib.import_module("matplotlib.ticker")
    labels = plot_labels(report.settings)
    if series is None:
        series = {mode: latency_series(run) for mode, run in report.runs.items()}
    panels = _latency_panels(series)
    if not panels:
        return None
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4.4), layout="constrained", squeeze=False
    )
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        marked: list[tuple[str, Sequence[float]]] = []
        for mode, values in series.items():
            # Latencies span orders of magnitude: a log axis, left of which lie the gaps
            # of 0 (tokens that arrived in one read): the line starts at their share.
            xs, ys = cdf_points(max(v, LOG_FLOOR_MS) for v in values[key])
            if xs:
                name = cdf_label(labels.get(mode, mode), values[key])
                (line,) = ax.step(xs, ys, where="post", label=name, **_STYLE[mode])
                marked.append((line.get_color(), values[key]))
        _log_axis(ax, ticker, log_axis_left([values[key] for values in series.values()]))
        _mark_percentiles(ax, marked)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples ≤ x")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{_title(report, 'Sluice')}: latency CDFs, p50 and p99 marked")
    return fig


_REPEAT_DASHES: Final = ("-.", ":")


def rss_figure(report: BenchReport) -> Any | None:
    """Each relay's RSS as growth over its run's start (MiB, left) and per concurrent stream
    (KiB, right), one line per run; None when no relay's RSS was sampled."""
    plt = load_pyplot()
    labels = plot_labels(report.settings)
    streams = report.settings.streams
    lines = {mode: rss_series(run) for mode, run in report.runs.items()}
    if not any(lines.values()):
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    for mode, runs in lines.items():
        for i, line in enumerate(runs):
            shown = labels.get(mode, mode)
            name = shown if len(runs) == 1 else f"{shown} #{i + 1}"
            peak = line.peak_mib
            # A repeat in its mode's colour, told apart by its dashes.
            style = _STYLE[mode] | ({"linestyle": _REPEAT_DASHES[(i - 1) % 2]} if i else {})
            ax.plot(
                line.seconds,
                line.mib,
                label=f"{name}: {line.start_mib:.1f} MiB at start, peak +{peak:.1f} MiB "
                f"({per_stream_kib(peak, streams):.0f} KiB per stream)",
                **style,
            )
    values = [v for runs in lines.values() for line in runs for v in line.mib]
    # At least 1 MiB of height: a flat line must look flat, not like noise blown up.
    top = max(max(values) * 1.2, 1.0)
    ax.set_ylim(min(min(values) * 1.2, 0) - 0.04 * top, top)
    ax.axhline(0, color="0.4", linewidth=0.8)
    ax.set_xlabel("seconds since the run began")
    ax.set_ylabel("RSS growth over the run's start (MiB)")
    right = ax.secondary_yaxis(
        "right",
        functions=(partial(per_stream_kib, streams=streams), lambda kib: kib * streams / 1024),
    )
    right.set_ylabel(f"KiB per concurrent stream ({streams} streams)")
    ax.grid(True, alpha=0.3)
    entries = sum(len(runs) for runs in lines.values())
    fig.legend(loc="outside lower center", ncols=2 if entries > 3 else 1, fontsize=8)
    fig.suptitle(f"{_title(report, 'Sluice')}: RSS growth, sampled every {RSS_PERIOD * 1000:g} ms")
    return fig


def write_plots(report: BenchReport, directory: Path) -> list[tuple[str, Path]]:
    """Draw the latency CDFs and the relays' RSS growth as PNGs in ``directory``, named by
    the load (``BenchSettings.slug``: a rerun of a load replaces its own files); return
    (description, path) of each file written."""
    plt = load_pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"bench-{report.settings.slug()}"
    written: list[tuple[str, Path]] = []
    series = {mode: latency_series(run) for mode, run in report.runs.items()}
    fig = latency_figure(report, series)
    if fig is not None:
        path = directory / f"{stem}-latency.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        names = ", ".join(label.split(" (")[0] for _, label in _latency_panels(series))
        written.append((f"Latency CDFs with p50 and p99: {names}", path))
    fig = rss_figure(report)
    if fig is not None:
        path = directory / f"{stem}-rss.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(("RSS growth over each run's start, and per stream", path))
    return written


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
    slow_rcvbuf: int = 0  # SO_RCVBUF of slow readers' sockets; 0: the OS default
    slow_mss: int = 0  # TCP_MAXSEG of slow readers' sockets; 0: the OS default
    upstream_sndbuf: int = 0  # the fake's SO_SNDBUF; 0: the OS default
    proxy_rcvbuf: int = 0  # the proxy's SO_RCVBUF towards the upstream; 0: the OS default
    event_pad: int = 0  # bytes added to every event (through the model name, which each repeats)
    seed: int = 1
    direct: bool = False
    baseline: bool = False
    repeat: int = 1
    grace: float = 2.0
    timeout: float = 120.0
    target: str | None = None
    upstream: str | None = None
    proxy_pid: int | None = None
    peer: str | None = None  # "auto": start the FastAPI peer; else a running one's URL
    peer_pid: int | None = None
    model: str = "fake-model"
    progress: bool = True
    workers: int = 1  # worker processes of the proxy the bench starts
    # The proxy (and the peer) on CPUs of their own, the load generator and the fake on the
    # others: latency figures then show the relay's cost, not a wait for a core it shares.
    pin: bool = False
    # The proxy's ``[upstream] transport``; with ``versus_transport``, a second proxy with
    # that one runs the same load, alternating (an "auto" ``transport`` becomes the other).
    transport: str = "auto"
    versus_transport: str | None = None
    # How the fake upstream ends kept-alive connections (HABITS); the seconds of a timed one
    # (None: DEFAULT_HABIT_SECONDS for those, and nothing for the others).
    upstream_habit: str = "none"
    upstream_habit_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.streams < 1:
            raise BenchError("--streams must be >= 1")
        if self.tokens < 1:
            raise BenchError("--tokens must be >= 1")
        if self.repeat < 1:
            raise BenchError("--repeat must be >= 1")
        if self.workers < 1:
            raise BenchError("--workers must be >= 1")
        if self.workers > 1 and self.target is not None:
            raise BenchError("--workers applies to the proxy the bench starts, not --target")
        for name in ("ramp", "ttft", "interval", "slow_delay", "grace"):
            value = getattr(self, name)
            if not (0 <= value < math.inf):
                raise BenchError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        if not (0 < self.timeout < math.inf):
            raise BenchError("--timeout must be a finite number > 0")
        for name in ("slow_rcvbuf", "slow_mss", "upstream_sndbuf", "proxy_rcvbuf", "event_pad"):
            if getattr(self, name) < 0:
                raise BenchError(f"--{name.replace('_', '-')} must be >= 0")
        if self.slow_mss and not 88 <= self.slow_mss <= 65535:
            raise BenchError("--slow-mss must be in [88, 65535] (or 0 for the OS default)")
        if self.baseline and self.slow == 0:
            raise BenchError("--baseline compares with the slow readers reading fast: needs --slow")
        if self.upstream_sndbuf and (self.upstream is not None or self.target is not None):
            raise BenchError("--upstream-sndbuf applies to the fake upstream the bench starts")
        if (self.proxy_rcvbuf or self.event_pad) and self.target is not None:
            raise BenchError("--proxy-rcvbuf and --event-pad need the proxy the bench starts")
        if self.drop > 0 and not 1 <= self.drop_at < self.tokens:
            raise BenchError("--drop-at must be in [1, --tokens) when --drop > 0")
        assign_roles(self.streams, self.drop, self.slow, self.seed)  # validates the fractions
        if self.direct and self.target is not None and self.upstream is None:
            raise BenchError("--direct with --target needs --upstream (the proxy's upstream)")
        if self.peer_pid is not None and (self.peer is None or self.peer == "auto"):
            raise BenchError("--peer-pid goes with --peer URL (a peer already running)")
        if self.peer is not None and self.peer != "auto" and self.upstream is None:
            raise BenchError(
                "--peer URL needs --upstream: the fake upstream that peer relays to, so that "
                "both relays stream the same answers"
            )
        if self.peer == "auto" and self.target is not None and self.upstream is None:
            raise BenchError("--peer auto with --target needs --upstream (the proxy's upstream)")
        peer_url = self.peer if self.peer != "auto" else None
        if self.pin:
            if not hasattr(os, "sched_setaffinity"):
                raise BenchError("--pin needs sched_setaffinity (Linux)")
            if self.target is not None or self.upstream is not None or peer_url is not None:
                raise BenchError(
                    "--pin places the processes the bench starts: not with --target, "
                    "--upstream or --peer URL"
                )
            cpu_layout(os.sched_getaffinity(0), self.workers)  # enough CPUs, or an error now
        for url in (self.target, self.upstream, peer_url):
            if url is not None:
                _address(url)
        self._check_transports()
        self._check_habit()

    def _check_transports(self) -> None:
        if self.transport not in TRANSPORTS:
            raise BenchError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        versus = self.versus_transport
        if versus is not None:
            if versus not in ("lean", "httpx"):
                raise BenchError("--versus-transport must be lean or httpx")
            if self.transport == "auto":
                # auto is lean here (plain http://, proxy = "none"): compare with the other.
                other = "httpx" if versus == "lean" else "lean"
                object.__setattr__(self, "transport", other)
            if self.transport == versus:
                raise BenchError(
                    f"--versus-transport {versus} is --transport already: name the other one"
                )
        if self.target is not None and (self.transport != "auto" or versus is not None):
            raise BenchError(
                "--transport and --versus-transport configure the proxy the bench starts, "
                "not --target"
            )

    def _check_habit(self) -> None:
        habit, seconds = self.upstream_habit, self.upstream_habit_seconds
        if habit not in HABITS:
            raise BenchError(f"--upstream-habit must be one of {', '.join(HABITS)}")
        if habit in TIMED_HABITS:
            if seconds is None:
                object.__setattr__(self, "upstream_habit_seconds", DEFAULT_HABIT_SECONDS)
            elif not (0 <= seconds < math.inf):
                raise BenchError("--upstream-habit-seconds must be a finite number >= 0")
        elif seconds is not None:
            raise BenchError(
                "--upstream-habit-seconds goes with --upstream-habit " + " or ".join(TIMED_HABITS)
            )
        if habit != "none" and (self.upstream is not None or self.target is not None):
            raise BenchError("--upstream-habit applies to the fake upstream the bench starts")

    def habit_text(self) -> str:
        """The fake upstream's habit in words ("" for none)."""
        seconds = (self.upstream_habit_seconds or 0) * 1000
        return {
            "none": "",
            "close-after-response": "closes each connection after its answer",
            "keepalive-timeout": f"closes a connection idle for {seconds:g} ms",
            "late-close": f"closes {seconds:g} ms after each answer, leaving what came unread",
        }[self.upstream_habit]

    def habit_argv(self) -> list[str]:
        """The fake upstream's command-line flags for the habit."""
        if self.upstream_habit == "none":
            return []
        flag = "--" + self.upstream_habit
        if self.upstream_habit in TIMED_HABITS:
            return [flag, str(self.upstream_habit_seconds)]
        return [flag]

    def describe(self) -> str:
        parts = [
            f"{self.streams} streams over a {self.ramp:g} s ramp",
            f"upstream TTFT {self.ttft * 1000:g} ms, {self.tokens} tokens "
            f"every {self.interval * 1000:g} ms",
            f"{self.drop:.0%} leave after token {self.drop_at}",
            f"{self.slow:.0%} read slowly ({self.slow_delay * 1000:g} ms between reads"
            + "".join(
                f", {label} {value} B"
                for label, value in (("SO_RCVBUF", self.slow_rcvbuf), ("MSS", self.slow_mss))
                if value
            )
            + ")",
            f"seed {self.seed}",
        ]
        buffers = [
            f"{label} {value} B"
            for label, value in (
                ("fake's SO_SNDBUF", self.upstream_sndbuf),
                ("proxy's upstream SO_RCVBUF", self.proxy_rcvbuf),
            )
            if value
        ]
        if buffers:
            parts.append(", ".join(buffers))
        if self.event_pad:
            parts.append(f"events padded by {self.event_pad} B")
        if self.versus_transport is not None:
            parts.append(
                f"Sluice's upstream transport {self.transport} vs {self.versus_transport} "
                "(two proxies, alternating)"
            )
        elif self.transport != "auto":
            parts.append(f"Sluice's upstream transport {self.transport}")
        if self.upstream_habit != "none":
            parts.append(f"the fake upstream {self.habit_text()}")
        if self.workers > 1:
            parts.append(f"proxy with {self.workers} workers")
        if self.pin:
            parts.append("proxy (and peer) pinned to CPUs of their own")
        if self.repeat > 1:
            parts.append(f"{self.repeat} repeats pooled")
        return "; ".join(parts)

    @property
    def model_name(self) -> str:
        """The model requested: ``model``, ``event_pad`` bytes longer. Every event repeats the
        model name, so this is how events get the size of real ones with logprobs."""
        if not self.event_pad:
            return self.model
        return self.model + "-" + "p" * (self.event_pad - 1)

    def key(self) -> str:
        """What identifies a load in the markdown file: the settings that shape it."""
        return (
            f"streams={self.streams} ramp={self.ramp:g} ttft={self.ttft:g} "
            f"interval={self.interval:g} tokens={self.tokens} drop={self.drop:g}@{self.drop_at} "
            f"slow={self.slow:g} seed={self.seed} direct={int(self.direct)} repeat={self.repeat}"
            + self._key_extra()
        )

    def _key_extra(self) -> str:
        # Only what is not at its default, so that the keys of older sections stay valid.
        extra = [f"delay={self.slow_delay:g}"] if self.slow else []
        for name, short in (
            ("slow_rcvbuf", "rcvbuf"),
            ("slow_mss", "mss"),
            ("upstream_sndbuf", "usndbuf"),
            ("proxy_rcvbuf", "prcvbuf"),
            ("event_pad", "pad"),
        ):
            if getattr(self, name):
                extra.append(f"{short}={getattr(self, name)}")
        if self.baseline:
            extra.append("baseline=1")
        if self.workers > 1:
            extra.append(f"workers={self.workers}")
        if self.peer is not None:
            extra.append("peer=1")
        if self.pin:
            extra.append("pin=1")
        if self.transport != "auto":
            extra.append(f"transport={self.transport}")
        if self.versus_transport is not None:
            extra.append(f"versus={self.versus_transport}")
        if self.upstream_habit in TIMED_HABITS:
            extra.append(f"habit={self.upstream_habit}@{self.upstream_habit_seconds:g}")
        elif self.upstream_habit != "none":
            extra.append(f"habit={self.upstream_habit}")
        return "".join(" " + part for part in extra)

    def slug(self) -> str:
        """A file-name part for this load, the same on every rerun of it: readable, and
        unique per key (``load_name``)."""
        return load_name(self.key())


def _key_parts(key: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split())


def _percent(fraction: str) -> str:
    """A fraction as the key writes it ("0.3", six digits at most) in percent ("30"): the
    same digits, so two fractions never give one percent."""
    return f"{float(fraction) * 100:g}"


def _drop_words(value: str, default: str) -> str:
    fraction, _, at = value.partition("@")
    word = f"drop{_percent(fraction)}"
    return word + (f"-at{at}" if at != default.partition("@")[2] else "")


def _habit_words(value: str, default: str) -> str:
    habit, _, seconds = value.partition("@")
    return habit + (f"-{seconds}s" if seconds else "")


# How each part of a load's key reads in its file name (from its value and the default's),
# in the order the name gives them: what the load compares first, then the knobs that shape
# it. A part the key gains later and this table lacks still makes the name, as name+value.
_NAME_WORDS: Final[tuple[tuple[str, Callable[[str, str], str]], ...]] = (
    ("workers", lambda v, d: f"{v}-workers"),
    ("pin", lambda v, d: "pinned"),
    ("slow", lambda v, d: f"slow{_percent(v)}"),
    ("transport", lambda v, d: f"{v}-transport"),
    ("versus", lambda v, d: f"vs-{v}"),
    ("direct", lambda v, d: "vs-direct"),
    ("peer", lambda v, d: "vs-peer"),
    ("baseline", lambda v, d: "vs-baseline"),
    ("habit", _habit_words),
    ("repeat", lambda v, d: f"{v}-repeats"),
    ("ramp", lambda v, d: f"ramp{v}s"),
    ("ttft", lambda v, d: f"ttft{v}s"),
    ("interval", lambda v, d: f"interval{v}s"),
    ("tokens", lambda v, d: f"{v}-tokens"),
    ("drop", _drop_words),
    ("seed", lambda v, d: f"seed{v}"),
    ("delay", lambda v, d: f"delay{v}s"),
    ("rcvbuf", lambda v, d: f"rcvbuf{v}"),
    ("mss", lambda v, d: f"mss{v}"),
    ("usndbuf", lambda v, d: f"usndbuf{v}"),
    ("prcvbuf", lambda v, d: f"prcvbuf{v}"),
    ("pad", lambda v, d: f"pad{v}"),
)


def load_name(key: str) -> str:
    """A load's file-name part from its key (``BenchSettings.key``, as in the markdown's
    markers): the streams, then every part of the key that differs from the default load's,
    in words, with no digest: ``100-streams-vs-direct``, ``1000-streams-2-workers-vs-peer``,
    ``100-streams-lean-vs-httpx-3-repeats``. Each part reads as its own word and keeps its
    value, so two keys that differ get two names, and a rerun of a load gets its old one."""
    default = BenchSettings()
    # The slow readers' delay is in the key whenever there are slow readers: at its default
    # it says nothing the name needs.
    defaults = _key_parts(default.key()) | {"delay": f"{default.slow_delay:g}"}
    parts = _key_parts(key)
    differ = {name: value for name, value in parts.items() if defaults.get(name) != value}
    words = [f"{parts.pop('streams', '?')}-streams"]
    differ.pop("streams", None)
    if "versus" in differ and "transport" in differ:
        # Two transports side by side read as one word: "lean-vs-httpx".
        differ["versus"] = f"{differ.pop('transport')}-vs-{differ['versus']}"
        words_for = dict(_NAME_WORDS) | {"versus": lambda v, d: v}
    else:
        words_for = dict(_NAME_WORDS)
    for name, word in words_for.items():
        if name in differ:
            words.append(word(differ.pop(name), defaults.get(name, "")))
    words += [f"{name}{value}" for name, value in differ.items()]
    # Whatever a value holds, the name stays a plain file name.
    return "".join(c if c.isalnum() or c in ".+-" else "_" for c in "-".join(words))


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
    # The raw material, pooled per mode (in the JSON only its RSS samples: the rest is one
    # entry per stream and token).
    runs: dict[str, RunData] = field(default_factory=dict)
    # With --pin: the CPUs each process ran on ("load_generator" is this one).
    cpus: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "command": self.command,
            "date": self.date,
            "commit": self.commit,
            "machine": self.machine,
            "env": self.env,
            "settings": dataclasses.asdict(self.settings),
            "cpus": self.cpus,
            "runs": {mode: summary.to_json() for mode, summary in self.summaries.items()},
        }
        rates = all_ratios(self.summaries)
        if "proxy/direct" in rates:
            out["ratios"] = rates["proxy/direct"]
        if "proxy/baseline" in rates:
            out["ratios_baseline"] = rates["proxy/baseline"]
        if "proxy/peer" in rates:
            out["ratios_peer"] = rates["proxy/peer"]
        if "proxy/versus" in rates:
            out["ratios_versus"] = rates["proxy/versus"]
        # What the columns are called in the table (the transports, with --versus-transport).
        out["labels"] = column_labels(self.settings)
        # RSS over time, per mode and run: [seconds since the run began, bytes].
        out["rss_samples"] = {
            mode: [
                {
                    name: [[round(at, 3), size] for at, size in samples]
                    for name, samples in trace.items()
                }
                for trace in run.rss
            ]
            for mode, run in self.runs.items()
        }
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


@dataclass(frozen=True, slots=True)
class CpuLayout:
    """Where --pin puts each process: CPU numbers as os.sched_setaffinity takes them."""

    proxy: frozenset[int]  # the proxy's workers (and the peer, which runs alternately)
    load: frozenset[int]  # the load generator (this process) and the fake upstream


def cpu_layout(available: Iterable[int], workers: int) -> CpuLayout:
    """The last ``workers`` of ``available`` CPUs for the proxy, the rest for the load."""
    cpus = sorted(available)
    if len(cpus) < workers + 1:
        raise BenchError(
            f"--pin needs {workers + 1} CPUs (one per proxy worker, one or more for the load "
            f"generator and the fake upstream); this process may use {len(cpus)}"
        )
    return CpuLayout(frozenset(cpus[-workers:]), frozenset(cpus[:-workers]))


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


async def _supervise(
    name: str,
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Own one child for as long as this task lives: a child that exits on its own is an
    error (it fails the bench at once instead of as a pile of refused connections). ``env``
    is added to this process's environment."""
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
        )
    finally:
        log.close()  # the child has its own copy of the descriptor
    try:
        task_status.started(process)
        await process.wait()
        raise ChildExited(name, process.returncode, _log_tail(log_path))
    finally:
        await _stop_child(process)


async def _wait_ready(
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


def peer_script(peers_dir: Path | None = None) -> Path:
    """The FastAPI peer's starter (``run-fastapi-gateway UPSTREAM_URL PORT``), or a clear
    error where this checkout has no ``shared/peers`` beside it."""
    script = (PEERS_DIR if peers_dir is None else peers_dir) / PEER_SCRIPT
    if not (script.is_file() and os.access(script, os.X_OK)):
        raise BenchError(
            f"--peer auto: no executable {script} on this machine (it lives in shared/peers/ "
            "beside the repository); start a peer yourself and pass --peer URL --peer-pid PID "
            "--upstream URL"
        )
    return script


def _proxy_config(
    port: int, upstream: str, settings: BenchSettings, transport: str | None = None
) -> str:
    """The config of a proxy the bench starts; ``transport``: its ``[upstream] transport``
    (None: ``settings.transport``; the versus proxy's is ``settings.versus_transport``)."""
    return (
        "# Written by proxy.bench for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        # Nothing of the bench's own load may queue in front of the pool.
        f"max_connections = {max(256, settings.streams + 16)}\n"
        f"transport = {json.dumps(transport or settings.transport)}\n"
        # The bench's upstream is on this machine: never through the environment's proxy
        # (which would also make auto mean httpx).
        'proxy = "none"\n'
        + (f"socket_rcvbuf = {settings.proxy_rcvbuf}\n" if settings.proxy_rcvbuf else "")
        + "\n"
        f"[models.{json.dumps(settings.model_name)}]\n"
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
    peer: tuple[str, int] | None = None
    peer_pid: int | None = None
    versus: tuple[str, int] | None = None  # the second Sluice, with --versus-transport
    versus_pid: int | None = None


async def _run_once(
    mode: Mode,
    label: str,
    settings: BenchSettings,
    endpoints: _Endpoints,
    cursor: int,
) -> tuple[RunData, int]:
    address = {
        "direct": endpoints.upstream,
        "peer": endpoints.peer,
        "versus": endpoints.versus,
    }.get(mode, endpoints.proxy)
    assert address is not None
    # The baseline's slow readers read at full speed: the same draw with slow = 0 gives the
    # same leavers, and everyone else normal.
    slow = 0.0 if mode == "baseline" else settings.slow
    roles = assign_roles(settings.streams, settings.drop, slow, settings.seed)
    host, port = address
    results, requests = [], []
    model = settings.model_name
    for i, role in enumerate(roles):
        tag = f"{label}-{i}"
        results.append(StreamResult(index=i, tag=tag, role=role))
        body = chat_body(model, tag, settings.ttft, settings.interval, settings.tokens)
        requests.append(build_request(host, port, "/v1/chat/completions", body))
    # The relay measured: the proxy, or the peer or the versus proxy in its place (their
    # figures fill the same rows).
    proxy_pid = {
        "direct": None,
        "peer": endpoints.peer_pid,
        "versus": endpoints.versus_pid,
    }.get(mode, endpoints.proxy_pid)
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
    watched = {"proxy": proxy_pid} if proxy_pid is not None else {}
    if upstream_pid is not None:
        watched["fake_upstream"] = upstream_pid
    trace: RssTrace = {}
    async with trio.open_nursery() as nursery:
        if settings.progress:
            shown = column_labels(settings).get(mode, mode)
            nursery.start_soon(_show_progress, shown, progress, settings.streams, sys.stderr)
        if watched:
            nursery.start_soon(partial(sample_rss, watched, trace, since=wall0))
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
                            slow_rcvbuf=settings.slow_rcvbuf,
                            slow_mss=settings.slow_mss,
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
        rss=[trace] if trace else [],
        # Only a fake we started is known to keep the bench's schedule.
        interval=settings.interval if upstream_pid is not None else None,
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
    body = chat_body(
        settings.model_name, tag, settings.ttft, settings.interval, min(settings.tokens, 3)
    )
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
    """Alternate direct, proxy, versus and peer across repeats (direct, proxy, versus, peer;
    then peer, versus, proxy, direct), so that none always runs first on a cold machine or last
    on a warm one. The
    baseline runs right before each proxy run: the proxy's memory is then at its lowest for
    the baseline, and whatever the slow readers add shows in the proxy run (the other way
    round, the baseline would inherit the slow run's heap)."""
    proxy: list[Mode] = ["baseline", "proxy"] if settings.baseline else ["proxy"]
    one: list[Mode] = ["direct"] if settings.direct else []
    one += proxy
    if settings.versus_transport is not None:
        one.append("versus")
    if settings.peer is not None:
        one.append("peer")
    order: list[Mode] = []
    for rep in range(settings.repeat):
        if rep % 2 == 0:
            order += one
        else:
            # Reversed, keeping the baseline right before its proxy run.
            back = [m for m in reversed(one) if m != "baseline"]
            order += [x for m in back for x in (proxy if m == "proxy" else [m])]
    return order


async def run_bench(settings: BenchSettings, *, command: str = "") -> BenchReport:
    """Start what is needed, run the load in every mode, stop the children, return figures."""
    machine = machine_info()  # first: its load average is the machine before our load
    _raise_fd_limit(settings.streams * 4 + 256)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    nonce = os.urandom(4).hex()  # tags unique even against an upstream reused across benches
    runs: dict[Mode, list[RunData]] = {}
    pids: dict[str, int] = {}
    # Before anything starts: no peer to start here is a plain error, not a half-run bench.
    peer_starter = peer_script() if settings.peer == "auto" else None
    layout = cpu_layout(os.sched_getaffinity(0), settings.workers) if settings.pin else None
    load_cpus = layout.load if layout is not None else None
    proxy_cpus = layout.proxy if layout is not None else None
    placed: dict[str, list[int]] = {}
    own_cpus = os.sched_getaffinity(0) if layout is not None else None
    try:
        if load_cpus is not None:
            set_own_cpus(load_cpus)
            _record_cpus(placed, "load_generator", 0)
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
                if settings.upstream_sndbuf:
                    argv += ["--sndbuf", str(settings.upstream_sndbuf)]
                argv += settings.habit_argv()
                argv = pinned_argv(argv, load_cpus)
                process = await nursery.start(_supervise, "fake upstream", argv, log)
                upstream_pid = pids["fake_upstream"] = process.pid
                await _wait_ready("fake upstream", upstream, "/health", log)
            if settings.target is not None:
                proxy = _address(settings.target)
                proxy_pid = settings.proxy_pid
                await _wait_ready("proxy", proxy, "", None)
            else:
                assert upstream_url is not None
                proxy, proxy_pid = await _start_proxy(
                    nursery,
                    "proxy",
                    settings.transport,
                    upstream_url,
                    settings,
                    workdir,
                    proxy_cpus,
                )
                pids["proxy"] = proxy_pid
            endpoints = _Endpoints(proxy, upstream, proxy_pid, upstream_pid)
            if settings.versus_transport is not None:
                # The same proxy but for its transport, alternating with the first (settings
                # refuse --versus-transport with --target, so upstream_url is ours).
                assert upstream_url is not None
                endpoints.versus, endpoints.versus_pid = await _start_proxy(
                    nursery,
                    "versus",
                    settings.versus_transport,
                    upstream_url,
                    settings,
                    workdir,
                    proxy_cpus,
                )
                pids["versus_proxy"] = endpoints.versus_pid
            if peer_starter is not None:
                assert upstream_url is not None  # settings refuse --peer auto without one
                endpoints.peer = ("127.0.0.1", _free_port("127.0.0.1"))
                log = workdir / "peer.log"
                argv = [str(peer_starter), upstream_url, str(endpoints.peer[1])]
                argv = pinned_argv(argv, proxy_cpus)
                process = await nursery.start(_supervise, "FastAPI peer", argv, log)
                endpoints.peer_pid = pids["peer"] = process.pid
                await _wait_ready(
                    "FastAPI peer", endpoints.peer, "/v1/models", log, PEER_READY_TIMEOUT
                )
            elif settings.peer is not None:
                endpoints.peer = _address(settings.peer)
                endpoints.peer_pid = settings.peer_pid
                await _wait_ready("peer", endpoints.peer, "", None)
            if layout is not None:
                # Read back once each is ready: its mask was set as it started (pinned_argv).
                for name, pid in pids.items():
                    _record_cpus(placed, name, pid)
            await _warm_up(proxy, settings, f"bench-{nonce}-warmup-proxy")
            if endpoints.versus is not None:
                await _warm_up(endpoints.versus, settings, f"bench-{nonce}-warmup-versus")
            if endpoints.peer is not None:
                await _warm_up(endpoints.peer, settings, f"bench-{nonce}-warmup-peer")
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
        if own_cpus is not None:
            set_own_cpus(own_cpus)
    pooled: dict[str, RunData] = {mode: merge_runs(runs[mode]) for mode in MODES if mode in runs}
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
        cpus=placed,
    )


async def _start_proxy(
    nursery: trio.Nursery,
    mode: Mode,
    transport: str,
    upstream_url: str,
    settings: BenchSettings,
    workdir: Path,
    cpus: frozenset[int] | None,
) -> tuple[tuple[str, int], int]:
    """Start a Sluice proxy with ``transport`` in front of ``upstream_url`` under ``nursery``,
    wait for it to be ready, return its address and PID. ``mode`` names its files and, for
    "versus", its transport the errors."""
    name = "proxy" if mode == "proxy" else f"proxy ({transport})"
    stem = "proxy" if mode == "proxy" else f"proxy-{mode}"
    address = ("127.0.0.1", _free_port("127.0.0.1"))
    config = workdir / f"{stem}.toml"
    _write_text(config, _proxy_config(address[1], upstream_url, settings, transport))
    log = workdir / f"{stem}.log"
    argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
    if settings.workers > 1:
        argv += ["--workers", str(settings.workers)]
    argv = pinned_argv(argv, cpus)
    process = await nursery.start(_supervise, name, argv, log)
    await _wait_ready(name, address, "/healthz", log)
    return address, process.pid


_T = TypeVar("_T")
# Signals that stop a bench the way Ctrl-C does (a service manager's stop, a closed terminal).
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


def run_stoppable(async_fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """``trio.run(async_fn, *args)``, except that SIGTERM or SIGHUP cancels the bench, so every
    child it started is stopped (``_supervise``) before it exits with BenchError; a bench
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
    add(
        "--slow-rcvbuf",
        type=int,
        default=d.slow_rcvbuf,
        help="SO_RCVBUF of slow readers' sockets, bytes (0: OS default)",
    )
    add(
        "--slow-mss",
        type=int,
        default=d.slow_mss,
        help="TCP_MAXSEG of slow readers' sockets, e.g. 1460 as on Ethernet (0: OS default)",
    )
    add(
        "--upstream-sndbuf",
        type=int,
        default=d.upstream_sndbuf,
        help="SO_SNDBUF of the fake upstream's sockets, bytes (0: OS default)",
    )
    add(
        "--proxy-rcvbuf",
        type=int,
        default=d.proxy_rcvbuf,
        help="the proxy's SO_RCVBUF towards the upstream, bytes (0: OS default)",
    )
    add(
        "--event-pad",
        type=int,
        default=d.event_pad,
        help="make every event this many bytes longer (via the model name)",
    )
    add("--seed", type=int, default=d.seed, help="seed of who leaves and who reads slowly")
    add("--direct", action="store_true", help="also run the same load straight at the upstream")
    add(
        "--baseline",
        action="store_true",
        help="also run the same load through the proxy with the slow readers reading fast",
    )
    add("--repeat", type=int, default=d.repeat, help="runs per mode, alternating, pooled")
    add("--grace", type=float, default=d.grace, help="seconds to wait for upstream to see closes")
    add("--timeout", type=float, default=d.timeout, help="seconds a run may take after its ramp")
    add("--target", help="an already running proxy (http://host:port) instead of starting one")
    add("--upstream", help="an already running fake upstream (http://host:port)")
    add("--proxy-pid", type=int, help="with --target: its PID, for CPU and RSS figures")
    add(
        "--peer",
        metavar="URL_OR_auto",
        help="also run the load through the FastAPI peer: 'auto' starts it (shared/peers/), a "
        "URL targets one already running (with --upstream, the fake it relays to)",
    )
    add("--peer-pid", type=int, help="with --peer URL: its PID, for CPU and RSS figures")
    add("--model", default=d.model, help="model name to request")
    add(
        "--workers",
        type=int,
        default=d.workers,
        help="worker processes of the proxy the bench starts (its CPU and RSS: all of them)",
    )
    add(
        "--pin",
        action="store_true",
        help="give the proxy (and peer) CPUs of their own, the load generator and the fake "
        "upstream the others (Linux; needs workers + 1 CPUs)",
    )
    add(
        "--transport",
        choices=TRANSPORTS,
        default=d.transport,
        help="the proxy's [upstream] transport (auto: lean here, the upstream being plain "
        "http:// with no proxy)",
    )
    add(
        "--versus-transport",
        choices=("lean", "httpx"),
        help="also run the load through a second proxy, the same but for this transport, "
        "alternating; ratios are --transport over it (an auto --transport is the other one)",
    )
    add(
        "--upstream-habit",
        choices=HABITS,
        default=d.upstream_habit,
        help="how the fake upstream ends kept-alive connections, as real servers do",
    )
    add(
        "--upstream-habit-seconds",
        type=float,
        metavar="S",
        help=f"the seconds of keepalive-timeout or late-close (default {DEFAULT_HABIT_SECONDS:g})",
    )
    add("--json", type=Path, help="write every figure as JSON here")
    add("--markdown", type=Path, help="write (or replace) this load's section in this file")
    add(
        "--plots",
        type=Path,
        metavar="DIR",
        help="write PNG plots here (default with --markdown: next to the markdown file)",
    )
    add("--no-plots", action="store_true", help="no plots, even with --markdown")
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
        slow_rcvbuf=args.slow_rcvbuf,
        slow_mss=args.slow_mss,
        upstream_sndbuf=args.upstream_sndbuf,
        proxy_rcvbuf=args.proxy_rcvbuf,
        event_pad=args.event_pad,
        seed=args.seed,
        direct=args.direct,
        baseline=args.baseline,
        repeat=args.repeat,
        grace=args.grace,
        timeout=args.timeout,
        target=args.target,
        upstream=args.upstream,
        proxy_pid=args.proxy_pid,
        peer=args.peer,
        peer_pid=args.peer_pid,
        model=args.model,
        workers=args.workers,
        pin=args.pin,
        transport=args.transport,
        versus_transport=args.versus_transport,
        upstream_habit=args.upstream_habit,
        upstream_habit_seconds=args.upstream_habit_seconds,
        progress=not args.quiet,
    )


def _command_line(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> str:
    if argv is not None:
        return shlex.join([*shlex.split(prog), *argv])
    program = Path(sys.argv[0]).name
    if program in ("bench.py", "__main__.py"):
        program = "python -m proxy.bench"
    return " ".join([program, shlex.join(sys.argv[1:])]).strip()


def relative_link(path: Path, base: Path) -> str:
    """``path`` as a markdown link from a file in ``base``."""
    return Path(os.path.relpath(path, base)).as_posix()


def plots_dir(args: argparse.Namespace) -> Path | None:
    """Where plots go: ``--plots``, else next to ``--markdown``; None with ``--no-plots``."""
    if getattr(args, "no_plots", False):
        return None
    plots: Path | None = getattr(args, "plots", None)
    if plots is not None:
        return plots
    markdown: Path | None = getattr(args, "markdown", None)
    return markdown.parent if markdown is not None else None


async def run_from_args(args: argparse.Namespace) -> None:
    plots = plots_dir(args)
    try:
        settings = settings_from_args(args)
        if plots is not None:
            load_pyplot()  # no matplotlib: say so now, not after minutes of load
        command = getattr(args, "bench_command", None) or _command_line()
        report = await run_bench(settings, command=command)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"sluice bench: {settings.describe()}")
    labels = column_labels(settings)
    print(format_table(report.summaries, labels))
    errors = _errors_line(report.summaries, labels)
    if errors:
        print(errors)
    # Small local files, written once at the end: a blocking write is fine here.
    if args.json is not None:
        _write_text(args.json, json.dumps(report.to_json(), indent=2) + "\n")
    # After the figures are out: a plot that fails must not take them along.
    written = write_plots(report, plots) if plots is not None else []
    for _, path in written:
        print(f"plot: {path}")
    if args.markdown is not None:
        base = args.markdown.parent
        links = [(alt, relative_link(path, base)) for alt, path in written]
        old = _read(str(args.markdown)) or ""
        section = markdown_section(report, links)
        _write_text(args.markdown, upsert_section(old, settings.key(), section))


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.bench_command = _command_line(argv, prog)
    try:
        run_stoppable(run_from_args, args)
    except BenchError as error:
        print(f"sluice bench: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        sys.exit(130)
