"""The fairness bench's load: each phase's requests planned (who sends what, when, with which
deadline), the bytes each sends, and the client that sends one and records what it saw.

The client is the load bench's kind (one request per connection on a raw trio socket, the
response read with ``protocol/http1.py``, SSE events counted with ``bytes.find``), and it also
keeps when each read's tokens came (the key's service over time) and the code of an error,
in a JSON body or an in-band event."""

from __future__ import annotations

import json
import math
import re
import socket
import time
from collections.abc import Iterable
from typing import Any, Final

import trio

from proxy.bench.client import EventCounter
from proxy.bench.fairness.settings import (
    BATCH,
    DEADLINE_BACKLOG_PER_SLOT,
    FLOODER,
    IDLE_SPACING,
    READ_TIMEOUTS,
    RUNNING_DEADLINE,
    RUNNING_FIRST_TOKEN,
    RUNNING_READ_TIMEOUT,
    URGENT,
    URGENT_LEAD,
    FairnessSettings,
)
from proxy.bench.fairness.stats import Request, stream_text
from proxy.protocol import http1
from proxy.protocol.token_usage import estimate_input_tokens

RECV_SIZE: Final = 64 * 1024
_CODE: Final = re.compile(rb'"code":\s*"([^"]+)"')
# What an error body or the tail of a stream keeps, to find an error's code in.
_KEEP: Final = 8 * 1024


def api_key(key: str) -> str:
    """The client API key the bench gives key ``key`` (its ``[[keys]]`` name)."""
    return f"sk-fairness-{key.lower()}"


def request_body(settings: FairnessSettings, request: Request) -> dict[str, Any]:
    """A streaming chat request; ``fake`` pins the fake's schedule, ``user`` is the tag that
    matches it with the fake's record."""
    return {
        "model": settings.model,
        "stream": True,
        "messages": [{"role": "user", "content": f"Tell me about foxes. ({request.tag})"}],
        "user": request.tag,
        "fake": {"ttft": request.ttft, "interval": request.interval, "tokens": request.tokens},
    }


def request_bytes(settings: FairnessSettings, request: Request, address: tuple[str, int]) -> bytes:
    """The request's bytes (one per connection), its key and deadlines in its headers; sets
    its ``input_tokens`` as Sluice estimates them."""
    body = request_body(settings, request)
    request.input_tokens = estimate_input_tokens(body)
    data = json.dumps(body, separators=(",", ":")).encode()
    host, port = address
    headers = [
        (b"Host", f"{host}:{port}".encode()),
        (b"Content-Type", b"application/json"),
        (b"Accept", b"text/event-stream"),
        (b"Content-Length", b"%d" % len(data)),
        (b"Connection", b"close"),
        (b"Authorization", f"Bearer {api_key(request.key)}".encode()),
    ]
    if request.read_timeout is not None:
        headers.append((b"x-stainless-read-timeout", f"{request.read_timeout:g}".encode()))
    if request.deadline is not None:
        headers.append((b"x-sluice-deadline", f"{request.deadline:g}".encode()))
    return http1.encode_request(b"POST", b"/v1/chat/completions", headers, data)


# --------------------------------------------------------------------------- the phases' plans


def _steady(
    settings: FairnessSettings,
    key: str,
    kind: str,
    rate: float,
    seconds: float,
    offset: float,
    tokens: int,
    label: str,
) -> list[Request]:
    """``key``'s requests at ``rate`` per second, evenly, from ``offset`` for ``seconds``."""
    count = max(1, math.floor(seconds * rate))
    return [
        Request(
            key=key,
            kind=kind,
            tag=f"{label}-{key}{i}",
            at=offset + i / rate,
            tokens=tokens,
            ttft=settings.ttft,
            interval=settings.interval,
        )
        for i in range(count)
    ]


def interactive(settings: FairnessSettings, seconds: float, label: str) -> list[Request]:
    """B's and C's short requests, each at ``rate``, C half a period after B."""
    period = 1 / settings.rate
    tokens = settings.short_tokens
    b = _steady(settings, "B", "interactive", settings.rate, seconds, 0.0, tokens, label)
    c = _steady(settings, "C", "interactive", settings.rate, seconds, period / 2, tokens, label)
    return [*b, *c]


def baseline_plan(settings: FairnessSettings, label: str) -> list[Request]:
    return interactive(settings, settings.baseline_seconds, label)


def flood_plan(settings: FairnessSettings, label: str) -> list[Request]:
    """A's flood at ``flood_factor`` times B's rate, a quarter of its period in, beside B's
    and C's steady requests."""
    seconds = settings.flood_seconds
    a_period = 1 / settings.flood_rate
    tokens = settings.flood_tokens
    rate = settings.flood_rate
    flood = _steady(settings, FLOODER, "flood", rate, seconds, a_period / 4, tokens, label)
    return sorted([*flood, *interactive(settings, seconds, label)], key=lambda r: r.at)


def queued_deadline_plan(settings: FairnessSettings, label: str) -> list[Request]:
    """A's backlog (``DEADLINE_BACKLOG_PER_SLOT`` per slot, at once, no deadline), then B's
    requests with a read timeout each, spread over a second: many wait longer than that."""
    backlog = [
        Request(
            FLOODER,
            "backlog",
            f"{label}-A{i}",
            0.0,
            settings.flood_tokens,
            settings.ttft,
            settings.interval,
        )
        for i in range(settings.slots * DEADLINE_BACKLOG_PER_SLOT)
    ]
    count = settings.deadline_requests
    timed = [
        Request(
            "B",
            "read-timeout",
            f"{label}-B{i}",
            0.2 + i / max(1, count),
            settings.short_tokens,
            settings.ttft,
            settings.interval,
            read_timeout=READ_TIMEOUTS[i % len(READ_TIMEOUTS)],
        )
        for i in range(count)
    ]
    return [*backlog, *timed]


def running_deadline_waves(settings: FairnessSettings, label: str) -> list[list[Request]]:
    """C's requests that start at once (a wave of at most ``slots``, the upstream otherwise
    idle) and pass a deadline while running: every other one's first byte (a read timeout
    shorter than the fake's TTFT), the others' whole answer (``x-sluice-deadline`` shorter
    than it: cut after the head)."""
    out: list[list[Request]] = []
    for i in range(settings.running_requests):
        if i % settings.slots == 0:
            out.append([])
        first_byte = i % 2 == 0
        out[-1].append(
            Request(
                "C",
                "first-byte" if first_byte else "mid-stream",
                f"{label}-C{i}",
                0.0,
                settings.short_tokens if first_byte else settings.running_tokens,
                RUNNING_FIRST_TOKEN if first_byte else settings.ttft,
                settings.interval,
                read_timeout=RUNNING_READ_TIMEOUT if first_byte else None,
                deadline=None if first_byte else RUNNING_DEADLINE,
            )
        )
    return out


def idle_plan(settings: FairnessSettings, label: str) -> list[Request]:
    """The interactive key's requests alone, ``IDLE_SPACING`` apart: its TTFT on an idle
    upstream."""
    return [
        Request(
            URGENT,
            "idle",
            f"{label}-idle-{URGENT}{i}",
            i * IDLE_SPACING,
            settings.short_tokens,
            settings.ttft,
            settings.interval,
        )
        for i in range(settings.urgent_requests)
    ]


def preempt_plan(settings: FairnessSettings, label: str) -> list[Request]:
    """One batch stream per slot, sent at once (each keeps its text, to be checked whole),
    then the interactive key's requests at ``urgent_rate`` from ``URGENT_LEAD`` on, while
    the batch holds every slot."""
    batch = [
        Request(
            BATCH,
            "batch",
            f"{label}-{BATCH}{i}",
            0.0,
            settings.batch_tokens,
            settings.ttft,
            settings.batch_interval,
            keep_text=True,
        )
        for i in range(settings.slots)
    ]
    urgent = [
        Request(
            URGENT,
            "urgent",
            f"{label}-{URGENT}{i}",
            URGENT_LEAD + i / settings.urgent_rate,
            settings.short_tokens,
            settings.ttft,
            settings.interval,
        )
        for i in range(settings.urgent_requests)
    ]
    return [*batch, *urgent]


def long_interactive_plan(settings: FairnessSettings, label: str) -> list[Request]:
    """The long run's interactive requests: B's and C's, each at ``rate``, C half a period
    after B, for the whole run (their bands are the long run's Sluice's: ``LONG_BANDS``)."""
    return interactive(settings, settings.long_seconds, label)


def flood_cap(settings: FairnessSettings, seconds: float) -> int:
    """The most requests one of A's closed-loop workers sends in ``seconds``: one per answer's
    duration (a failed one is followed by a pause as long), and one more."""
    return math.ceil(seconds / max(settings.flood_duration, 1e-3)) + 1


def longest_input(requests: Iterable[Request]) -> int:
    return max((r.input_tokens for r in requests), default=0)


# --------------------------------------------------------------------------- the client


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


def error_code(data: bytes) -> str | None:
    """The ``code`` of the last OpenAI-shaped error in ``data``."""
    found = _CODE.findall(data)
    return found[-1].decode("latin-1") if found else None


async def send(address: tuple[str, int], data: bytes, request: Request, *, start_at: float) -> None:
    """Send ``request`` at ``start_at`` (trio clock) and read its answer to the end, filling
    ``request`` as it goes. Never raises for what the server did (a failure is the request's
    ``error``); only cancellation leaves, and the caller marks what it cut short."""
    await trio.sleep_until(start_at)
    reader = http1.ResponseReader()
    counter = EventCounter()
    kept = b""
    body = bytearray()
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await sock.connect(address)
        await _send_all(sock, data)
        request.sent = time.monotonic()
        while not reader.complete:
            chunk = await sock.recv(RECV_SIZE)
            now = time.monotonic()
            if not chunk:
                reader.feed_eof()
                break
            payload = reader.feed(chunk)
            if request.status is None and reader.head is not None:
                request.status = reader.head.status
            if not payload:
                continue
            if request.status != 200:
                kept = (kept + payload)[:_KEEP]
                continue
            if request.keep_text:
                body += payload
            errors = counter.errors
            new = counter.feed(payload)
            if new:
                if request.first_token is None:
                    request.first_token = now
                request.arrivals.append((now, new))
            kept = (kept + payload)[-_KEEP:]
            if counter.errors > errors:
                request.error_code = error_code(kept)
    except trio.Cancelled:
        request.error = "timeout"  # still running when its phase's time was up
        raise
    except OSError as exc:
        request.error = f"socket: {type(exc).__name__}"
    except http1.ProtocolError as exc:
        request.error = f"protocol: {exc}"
    finally:
        sock.close()
        request.ended_at = time.monotonic()
        request.events, request.tokens_seen = counter.events, counter.content
        request.done = counter.done
        if request.keep_text:
            request.text, request.paused_comments = stream_text(bytes(body))
        if request.status not in (None, 200):
            request.error_code = error_code(kept)


async def closed_loop(
    settings: FairnessSettings,
    address: tuple[str, int],
    label: str,
    *,
    start_at: float,
    until: float,
    out: list[Request],
) -> None:
    """One of A's outstanding requests in the long run: from ``start_at`` (trio clock) each
    request sent as the one before it ends, until ``until``, at most ``flood_cap`` of them;
    each appended to ``out`` as it is sent."""
    await trio.sleep_until(start_at)
    for i in range(flood_cap(settings, until - start_at)):
        now = trio.current_time()
        if now >= until:
            return
        request = Request(
            FLOODER,
            "flood",
            f"{label}-{i}",
            now - start_at,
            settings.flood_tokens,
            settings.ttft,
            settings.interval,
        )
        out.append(request)
        await send(address, request_bytes(settings, request, address), request, start_at=now)
        # Each read's tokens are the service figures' material, which the long run has no
        # use for: thousands of A's answers would hold hundreds of thousands of them.
        request.arrivals.clear()
        if not request.ok:
            # Whatever went wrong may go wrong at once again: never a loop that spins.
            await trio.sleep(settings.flood_duration)
