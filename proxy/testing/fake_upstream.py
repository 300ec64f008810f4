"""A fake OpenAI-compatible upstream that behaves like vLLM's OpenAI server.

It exists for tests, benchmarks and demos: it streams deterministic tokens on a schedule,
injects failures on request, and records what it saw (above all, *when* it saw the client go
away). The proxy forwards the original request body, so a test steers the fake per request
with an extra ``"fake": {...}`` field in the JSON body.

HTTP/1.1 is written by hand on raw trio sockets rather than through h11 or a server library: at
benchmark time the fake must feed ~1000 concurrent streams at 20 ms/token from one core. So a
token is one precomputed ``bytes`` object written by one clock task (``_Ticker``) that wakes
once per due batch of tokens of all streams; a stream's own task only handles what can block.
Measured: about 14 us of CPU per token at 1000 streams, connection setup included.

Timing follows vLLM: a streaming response sends its headers at once (Starlette sends
``http.response.start`` before the first token exists), the first token ``ttft`` seconds after
the request was read, and token ``i`` at ``ttft + i * interval``. The schedule is absolute, so
a slow reader gets the tokens it missed in a burst, as from a real server that kept generating.

By default a connection lives as long as its client wants. Real servers are less patient, and a
client's pool must survive them, so the fake can take up their habits: close right after an
answer without saying ``Connection: close`` (legal, and common), close a connection idle for
``keepalive_timeout`` seconds (uvicorn, vLLM's server, does so after 5 s), or close ``late_close``
seconds after an answer without reading what arrived meanwhile: the keep-alive race, in which a
request written onto a connection the server has already given up meets EOF or a reset before
any byte of an answer.

It can serve HTTPS (``tls_cert``/``tls_key``, optionally requiring a client certificate signed
by ``tls_client_ca``), and with ``via_proxy`` it is the HTTP proxy in front of itself: it answers
``CONNECT`` (whatever the target's name, the tunnel leads to the fake) and absolute-form
requests, and refuses a client that bypassed the proxy, so a client's proxy settings can be
tested without a second server. Over TLS the ticker cannot write a token to the socket itself
(the bytes need encrypting), so it hands each token to the stream's task: TLS costs a task
switch per token, the plain path nothing.

Endpoints, each in the shape vLLM serves it (``POST`` unless said otherwise):

* ``/v1/chat/completions``, ``/v1/completions``: chunks as ``data:`` lines and ``data: [DONE]``
  when streamed, the completion object when not.
* ``/v1/responses`` (OpenAI Responses): ``input`` a string or a list of items. Streamed, typed
  events (``event: <type>`` and ``data:`` with ``type`` and ``sequence_number``, no
  ``[DONE]``): ``response.created`` and ``response.in_progress`` with the headers,
  ``response.output_item.added`` and ``response.content_part.added`` with token 0, one
  ``response.output_text.delta`` per token, then ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``;
  a ``max_output_tokens`` at or under the planned tokens stops there and ends with
  ``response.incomplete`` (``incomplete_details.reason`` ``max_output_tokens``).
* ``/v1/messages`` (Anthropic Messages; ``max_tokens`` required): ``message_start``,
  ``content_block_start`` and ``ping`` with token 0, one ``content_block_delta``
  (``text_delta``) per token, then ``content_block_stop``, ``message_delta`` (``stop_reason``
  ``end_turn`` or ``max_tokens``) and ``message_stop``. Its errors, ``mode=status`` included,
  are in Anthropic's shape, ``{"type": "error", "error": {"type": ..., "message": ...}}``.
* ``/v1/embeddings`` and ``/pooling``: ``embedding_vector(item)`` per input (8 floats from a
  SHA-256 of it, exact in float32), as floats or, with ``encoding_format: "base64"`` (the
  OpenAI SDK's default), little-endian float32 in base64.
* ``/tokenize``, ``/detokenize``: a word of the fake's vocabulary ``WORDS`` is its index, any
  other a CRC-32 of it; token ``t`` reads back as ``token_text(t)``.
* ``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``), ``/v1/score`` (also ``/score``):
  ``relevance_score(query, document)``, a number in [0, 1) from a SHA-256 of the pair.
* ``/v1/audio/transcriptions``: ``multipart/form-data`` with ``model``, ``file``, optional
  ``stream`` (and ``fake``, as JSON text); the answer carries ``sha256``/``bytes`` of the exact
  request body received and ``file_sha256`` of the file part, so a test can prove a proxy
  relayed the body intact. Streamed: ``transcription.chunk`` events, the digests on the last.
* ``GET /v1/models``, ``GET /health``; ``/_fake/requests`` lists the records as JSON.
* ``GET /metrics``: vLLM's load gauges in Prometheus text (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and its prefix-cache counters
  (``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, in blocks here);
  ``metrics_text`` replaces the body, ``metrics_status`` the status. Not recorded.

A serving model, when asked (each off by default, so every other test sees the plain fake):

* ``max_running``: at most that many requests generate at once; the others wait, in order
  (``num_requests_waiting``), and their TTFT counts from when they start.
* ``prefix_cache_size``: an LRU of that many prompt blocks (``prefix_block_bytes`` each, hashed
  as a chain, so a block stands for the whole prompt up to it, as vLLM's automatic prefix
  caching does). A prompt's TTFT is ``ttft_hit`` plus ``ttft_miss - ttft_hit`` times the
  fraction of its bytes not in the cache: a conversation's next turn on the replica that served
  the previous one is fast, anywhere else slow. The prompt is the chat messages (role and
  text), the prompt, or the input, and instructions or system. A request's own ``fake.ttft``
  still wins.

Every ``POST`` endpoint follows the schedule (a non-generating one answers at ``ttft``) and
takes the ``"fake"`` steering and its fault modes; each request gets a ``RequestRecord`` with
its ``path``, the ``model`` it named and, for a multipart body, its text fields (``form``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import enum
import hashlib
import heapq
import itertools
import json
import math
import os
import socket
import ssl
import struct
import sys
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from typing import Any, Final, Literal, Protocol

import trio
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

__all__ = [
    "MODES",
    "WORDS",
    "FakeSettings",
    "FakeUpstream",
    "NoRecordsYet",
    "Outcome",
    "PrefixCache",
    "Recorder",
    "RequestRecord",
    "add_arguments",
    "embedding_vector",
    "main",
    "prompt_bytes",
    "relevance_score",
    "run_from_args",
    "settings_from_args",
    "token_text",
]

# ASCII only, so a token is one byte sequence however a client splits or decodes it.
WORDS: Final[tuple[str, ...]] = (
    "The",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "seven",
    "wise",
    "owls",
    "watch",
    "from",
    "afar",
)

MODES: Final[frozenset[str]] = frozenset(
    {"ok", "refuse", "status", "reset", "eof", "stall", "stall_headers", "malformed"}
)

Outcome = Literal["pending", "completed", "client_disconnected", "failed_injected"]

MAX_HEADER_BYTES: Final = 64 * 1024
MAX_BODY_BYTES: Final = 8 * 1024 * 1024
# Bytes a client may pipeline behind a request in progress before the fake stops reading
# (and so stops noticing a disconnect): bounded like everything else.
MAX_PIPELINED_BYTES: Final = MAX_HEADER_BYTES + MAX_BODY_BYTES
RECEIVE_SIZE: Final = 64 * 1024
MALFORMED_EVENT: Final = b"this is not server-sent events\n\n"


async def _until_client_leaves(conn: Any) -> None:
    """Return once the client closes its side (what it sends meanwhile, up to a pipelining
    bound, stays in ``conn.buf`` for the next read); past the bound, wait to be cancelled."""
    try:
        while len(conn.buf) <= MAX_PIPELINED_BYTES:
            if not await conn._receive_more():
                return
        await trio.sleep_forever()
    except trio.BrokenResourceError:
        pass


_CHAT_PATH: Final = "/v1/chat/completions"
_COMPLETIONS_PATH: Final = "/v1/completions"
_RESPONSES_PATH: Final = "/v1/responses"
_MESSAGES_PATH: Final = "/v1/messages"
_TRANSCRIPTIONS_PATH: Final = "/v1/audio/transcriptions"
_OVERRIDABLE: Final = frozenset({"ttft", "interval", "tokens", "mode", "at", "status"})
_TOKEN_JSON: Final = tuple(json.dumps(word + " ").encode() for word in WORDS)
# What /tokenize reports as the context length.
MAX_MODEL_LEN: Final = 8192
# Token ids of words outside WORDS: a CRC-32 of the word, folded into a Llama-sized vocabulary.
VOCAB_SIZE: Final = 32_000
EMBEDDING_DIMENSIONS: Final = 8


def token_text(i: int) -> str:
    """The text of token ``i`` of every response."""
    return WORDS[i % len(WORDS)] + " "


def embedding_vector(
    item: str | Sequence[int], dimensions: int = EMBEDDING_DIMENSIONS
) -> list[float]:
    """The vector of one embedding (or pooling) input: a text or a list of token ids.

    Each value is ``(b - 128) / 128`` for a byte ``b`` of the input's SHA-256, so it survives a
    float32 round trip exactly (base64 answers are float32).
    """
    if isinstance(item, str):
        raw = b"text:" + item.encode()
    else:
        raw = b"tokens:" + json.dumps(list(item)).encode()
    digest = hashlib.sha256(raw).digest()
    return [(digest[k] - 128) / 128 for k in range(dimensions)]


def relevance_score(query: str, document: str) -> float:
    """The /rerank and /score answer for a pair: a number in [0, 1) from its SHA-256."""
    digest = hashlib.sha256(query.encode() + b"\0" + document.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


# --------------------------------------------------------------------------- settings


@dataclass
class FakeSettings:
    """Server-wide defaults; a request may override ttft, interval, tokens, mode, at and
    status with an extra ``"fake": {...}`` object in its JSON body (in a multipart body: a
    ``fake`` field holding that object as JSON text).

    ``mode``/``at``/``status`` apply to the model endpoints (every ``POST`` one) only: a proxy's
    health check or model listing must not turn a streaming test into a different test.

    With ``via_proxy`` the listener speaks plain HTTP, as a proxy does: TLS, if set, starts
    inside each CONNECT tunnel, and absolute-form requests are answered in plain HTTP. The
    fake's own ``/_fake/`` endpoints answer direct requests either way.
    """

    ttft: float = 0.05
    interval: float = 0.02
    tokens: int = 50
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    mode: str = "ok"
    at: int = 0
    status: int = 500
    sndbuf: int | None = None
    max_records: int = 100_000
    # Connection habits of real servers; at most one of the three applies.
    close_after_response: bool = False
    keepalive_timeout: float | None = None
    late_close: float | None = None
    # HTTPS: PEM files; with a client CA, a client must present a certificate it signed.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    via_proxy: bool = False
    # The serving model (module doc): 0 turns each off.
    max_running: int = 0
    prefix_cache_size: int = 0
    prefix_block_bytes: int = 256
    ttft_hit: float = 0.02
    ttft_miss: float = 0.3
    # GET /metrics: this body instead of the fake's own gauges, and this status.
    metrics_text: str | None = None
    metrics_status: int = 200
    # Hold each accepted plain-HTTP connection this many seconds before reading a request from
    # it: on loopback the kernel completes the TCP handshake at once, so this is how a slow
    # accept (or a handshake that stalls) looks to a client, still connecting as far as any
    # answer goes. A client that closes meanwhile is stamped in ``Recorder.closed_while_held``
    # (its bytes are kept, and served after the hold if it stays). 0: off.
    accept_delay: float = 0.0

    def __post_init__(self) -> None:
        _check_seconds("ttft", self.ttft)
        _check_seconds("interval", self.interval)
        _check_int("tokens", self.tokens, 0)
        _check_int("at", self.at, 0)
        _check_int("status", self.status, 200, 599)
        _check_int("max_records", self.max_records, 1)
        _check_mode(self.mode)
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise _Invalid("models must be a non-empty list of non-empty strings")
        if self.sndbuf is not None:
            _check_int("sndbuf", self.sndbuf, 1)
        _check_bool("close_after_response", self.close_after_response)
        _check_bool("via_proxy", self.via_proxy)
        if self.keepalive_timeout is not None:
            _check_seconds("keepalive_timeout", self.keepalive_timeout)
        if self.late_close is not None:
            _check_seconds("late_close", self.late_close)
        timers = (self.keepalive_timeout, self.late_close)
        if self.close_after_response + sum(t is not None for t in timers) > 1:
            # Each ends a kept-alive connection its own way: two would shadow each other.
            raise _Invalid("set at most one of close_after_response, keepalive_timeout, late_close")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            if not isinstance(getattr(self, name), str):
                raise _Invalid(f"{name} must be a path (a string)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise _Invalid("tls_cert and tls_key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise _Invalid("tls_client_ca needs tls_cert and tls_key")
        _check_int("max_running", self.max_running, 0)
        _check_int("prefix_cache_size", self.prefix_cache_size, 0)
        _check_int("prefix_block_bytes", self.prefix_block_bytes, 1)
        _check_seconds("ttft_hit", self.ttft_hit)
        _check_seconds("ttft_miss", self.ttft_miss)
        _check_int("metrics_status", self.metrics_status, 100, 599)
        _check_seconds("accept_delay", self.accept_delay)


class _Invalid(ValueError):
    """A bad setting or request field; a request gets it back as a 400 BadRequestError."""


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"{name} must be a number")
    if not math.isfinite(value) or value < 0:
        raise _Invalid(f"{name} must be a finite number >= 0")
    return float(value)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"{name} must be an integer")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _Invalid(f"{name} must be {bounds}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"{name} must be a boolean")
    return value


def _check_mode(value: object) -> str:
    if not isinstance(value, str) or value not in MODES:
        raise _Invalid(f"mode must be one of {sorted(MODES)}")
    return value


@dataclass(frozen=True, slots=True)
class _Plan:
    """The effective fake parameters of one request: settings plus its ``"fake"`` override."""

    ttft: float
    interval: float
    tokens: int
    mode: str
    at: int
    status: int

    @classmethod
    def build(cls, settings: FakeSettings, body: dict[str, Any]) -> _Plan:
        """Raise _Invalid on a malformed override."""
        fake = body.get("fake")
        if fake is None:
            fake = {}
        if not isinstance(fake, dict):
            raise _Invalid('"fake" must be an object')
        unknown = set(fake) - _OVERRIDABLE
        if unknown:
            raise _Invalid(f'unknown "fake" fields: {sorted(unknown)}')
        return cls(
            ttft=_check_seconds("fake.ttft", fake.get("ttft", settings.ttft)),
            interval=_check_seconds("fake.interval", fake.get("interval", settings.interval)),
            tokens=_check_int("fake.tokens", fake.get("tokens", settings.tokens), 0),
            mode=_check_mode(fake.get("mode", settings.mode)),
            at=_check_int("fake.at", fake.get("at", settings.at), 0),
            status=_check_int("fake.status", fake.get("status", settings.status), 200, 599),
        )


# --------------------------------------------------------------------------- recording


class NoRecordsYet(LookupError):
    """``Recorder.last()`` before any request arrived; ``wait_for`` treats it as "not yet"."""


@dataclass(eq=False)
class RequestRecord:
    """What the fake saw of one request. Times are ``trio.current_time()``; each has a
    ``*_mono`` twin from ``time.monotonic()`` for comparison across processes.

    ``finished_at`` is stamped when the last ``send_all`` returns, and a client in the same
    process may be scheduled before that and already hold every byte: to assert on a final
    outcome, ``await recorder.wait_for(lambda r: r.last().outcome != "pending")`` first.
    """

    id: int
    connection: int
    method: str
    path: str
    # The JSON body; None for another body (multipart: see ``form``) or none.
    body: dict[str, Any] | None
    headers: dict[str, str]
    received_at: float
    received_at_mono: float
    # The model the request named (JSON ``model``, or the multipart field); None if none.
    model: str | None = None
    # The text fields of a multipart/form-data body.
    form: dict[str, str] | None = None
    mode: str = "ok"
    first_token_at: float | None = None
    first_token_at_mono: float | None = None
    # When the fake's side ended as planned: response fully sent, or the injected fault done.
    finished_at: float | None = None
    finished_at_mono: float | None = None
    # When the client left (EOF or reset) before the fake was done; None otherwise.
    disconnected_at: float | None = None
    disconnected_at_mono: float | None = None
    tokens_sent: int = 0
    outcome: Outcome = "pending"
    # How it arrived. ``client_cert_cn``: the subject common name of the client certificate
    # (mTLS only). ``via_proxy``: through the fake as a proxy, as an absolute-form request or
    # inside a CONNECT tunnel; ``tunnel`` is then that tunnel's target, None for absolute-form.
    tls: bool = False
    client_cert_cn: str | None = None
    via_proxy: bool = False
    tunnel: str | None = None
    # With a prefix cache: the prompt's full blocks, and how many of them were cached.
    prefix_blocks: int | None = None
    prefix_hit_blocks: int | None = None
    # With max_running: seconds it waited for a running slot.
    queued_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Recorder:
    """Records of the requests the fake served, and a way to wait for a condition on them.

    Every change goes through a method here, and every change wakes ``wait_for``. The state
    transitions are synchronous, so two observers (the response task and the disconnect
    watcher) can race without leaving a record half-updated: the first final outcome wins.
    """

    def __init__(self, max_records: int = 100_000) -> None:
        self.records: list[RequestRecord] = []
        self.max_records = max_records
        self.open_connections = 0
        self.connections_accepted = 0
        # CONNECT targets ("host:port") in arrival order, bounded like the records.
        self.proxy_tunnels: list[str] = []
        # Handshakes that did not complete: a refused client certificate, a client that does
        # not trust the fake's, a client that left.
        self.tls_handshake_failures = 0
        # With ``accept_delay``: connections held now, and the ``time.monotonic()`` at which
        # each client that closed during its hold was seen to go.
        self.held_connections = 0
        self.closed_while_held: list[float] = []
        self._next_id = 0
        self._lot = trio.lowlevel.ParkingLot()

    def last(self, path: str | None = None) -> RequestRecord:
        """The newest record (with this ``path``, if given)."""
        for record in reversed(self.records):
            if path is None or record.path == path:
                return record
        raise NoRecordsYet("no matching request recorded yet")

    async def wait_for(self, predicate: Callable[[Recorder], object]) -> None:
        """Return once ``predicate(self)`` is true, re-checking after every change.

        There is no timeout argument: wrap the call in ``trio.fail_after``.
        """
        while True:
            try:
                if predicate(self):
                    return
            except NoRecordsYet:
                pass
            await self._lot.park()

    def _changed(self) -> None:
        # Called once per token at benchmark rates: skip the wake-up when nobody waits.
        if self._lot:
            self._lot.unpark_all()

    def _connection_opened(self) -> int:
        self.connections_accepted += 1
        self.open_connections += 1
        self._changed()
        return self.connections_accepted

    def _connection_closed(self) -> None:
        self.open_connections -= 1
        self._changed()

    def _new_record(
        self, conn: _Connection, request: _Request, body: dict[str, Any] | None
    ) -> RequestRecord:
        record = RequestRecord(
            id=self._next_id,
            connection=conn.id,
            method=request.method,
            path=request.path,
            body=body,
            headers=request.headers,
            received_at=trio.current_time(),
            received_at_mono=time.monotonic(),
            model=_named_model(body),
            tls=conn.tls,
            client_cert_cn=conn.client_cert_cn,
            via_proxy=request.absolute or conn.tunnel is not None,
            tunnel=conn.tunnel,
        )
        self._next_id += 1
        self._append(self.records, record)
        self._changed()
        return record

    def _append(self, history: list[Any], item: object) -> None:
        history.append(item)
        if len(history) > self.max_records:
            # Trim in batches so that a long benchmark does not pay O(n) per request.
            del history[: len(history) - self.max_records + self.max_records // 8]

    def _held(self, change: int) -> None:
        self.held_connections += change
        self._changed()

    def _closed_during_hold(self) -> None:
        self._append(self.closed_while_held, time.monotonic())
        self._changed()

    def _tunnel_opened(self, target: str) -> None:
        self._append(self.proxy_tunnels, target)
        self._changed()

    def _tls_failed(self) -> None:
        self.tls_handshake_failures += 1
        self._changed()

    def _form_parsed(self, record: RequestRecord, form: dict[str, str]) -> None:
        record.form = form
        record.model = _named_model(form)
        self._changed()

    def _planned(self, record: RequestRecord, mode: str) -> None:
        record.mode = mode
        self._changed()

    def _token_sent(self, record: RequestRecord, count: int = 1) -> None:
        # count=0 stamps first_token_at for an answer without tokens (its first content).
        if record.first_token_at is None:
            record.first_token_at = trio.current_time()
            record.first_token_at_mono = time.monotonic()
        record.tokens_sent += count
        self._changed()

    def _finish(self, record: RequestRecord, outcome: Outcome) -> None:
        if record.outcome != "pending":
            return
        record.outcome = outcome
        record.finished_at = trio.current_time()
        record.finished_at_mono = time.monotonic()
        self._changed()

    def _disconnected(self, record: RequestRecord) -> None:
        if record.outcome != "pending":
            return
        record.outcome = "client_disconnected"
        record.disconnected_at = trio.current_time()
        record.disconnected_at_mono = time.monotonic()
        self._changed()


# --------------------------------------------------------------------------- HTTP/1.1


class _HTTPError(Exception):
    """A request the fake refuses to parse; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _End(enum.Enum):
    """How a connection continues after a response."""

    KEEP = "keep"
    CLOSE = "close"
    RESET = "reset"


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    # The request line carried a whole URL, as a client sends it to a proxy.
    absolute: bool

    @property
    def chunked(self) -> bool:
        return self.version == "HTTP/1.1"


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _error_type(status: int) -> str:
    named = {
        400: "BadRequestError",
        401: "AuthenticationError",
        403: "PermissionDeniedError",
        404: "NotFoundError",
        409: "ConflictError",
        422: "UnprocessableEntityError",
        429: "RateLimitError",
        503: "ServiceUnavailableError",
    }
    if status in named:
        return named[status]
    return "InternalServerError" if status >= 500 else "BadRequestError"


def _error_body(status: int, message: str) -> bytes:
    error = {"message": message, "type": _error_type(status), "code": status}
    return json.dumps({"error": error}).encode()


def _response(
    status: int,
    body: bytes,
    *,
    keep_alive: bool,
    content_type: str | None = "application/json",
    content_length: int | None = None,
) -> bytes:
    lines = [
        f"HTTP/1.1 {status} {_reason(status)}",
        "server: sluice-fake-upstream",
        f"content-length: {len(body) if content_length is None else content_length}",
    ]
    if content_type is not None:
        lines.append(f"content-type: {content_type}")
    lines.append("connection: keep-alive" if keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _json_response(status: int, obj: object, *, keep_alive: bool) -> bytes:
    return _response(status, json.dumps(obj).encode(), keep_alive=keep_alive)


def _error_response(status: int, message: str, *, keep_alive: bool) -> bytes:
    return _response(status, _error_body(status, message), keep_alive=keep_alive)


_ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _anthropic_error_body(status: int, message: str) -> bytes:
    """Anthropic's error shape, which vLLM's /v1/messages answers in too."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()


def _stream_head(request: _Request) -> bytes:
    lines = [
        "HTTP/1.1 200 OK",
        "server: sluice-fake-upstream",
        "content-type: text/event-stream; charset=utf-8",
        "cache-control: no-cache",
    ]
    if request.chunked:
        lines.append("transfer-encoding: chunked")
    lines.append("connection: keep-alive" if request.keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _parse_head(head: bytes) -> tuple[str, str, str, str, dict[str, str], bool]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise _HTTPError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if version.startswith("HTTP/"):
            raise _HTTPError(505, f"unsupported version {version}")
        raise _HTTPError(400, "malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        # Whitespace before the colon or a folded line is how request smuggling starts.
        if not sep or not name or name != name.strip() or " " in name or "\t" in name:
            raise _HTTPError(400, "malformed header line")
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    absolute = target[0] != "/" and "://" in target
    if absolute:
        target = _origin_form(target)
    path, _, query = target.partition("?")
    return method, path, query, version, headers, absolute


def _origin_form(target: str) -> str:
    """The path and query of an absolute-form target (RFC 9112 §3.2.2)."""
    scheme, _, rest = target.partition("://")
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    if scheme.lower() not in ("http", "https") or cut == 0:
        raise _HTTPError(400, "malformed absolute-form request target")
    origin = rest[cut:]
    return origin if origin.startswith("/") else "/" + origin


def _content_length(method: str, headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _HTTPError(411, "request bodies must have a Content-Length")
    raw = headers.get("content-length")
    if raw is None:
        if method in ("POST", "PUT", "PATCH"):
            raise _HTTPError(411, "request bodies must have a Content-Length")
        return 0
    values = {v.strip() for v in raw.split(",")}
    if len(values) != 1:
        raise _HTTPError(400, "conflicting Content-Length")
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise _HTTPError(400, "invalid Content-Length")
    length = int(value)
    if length > MAX_BODY_BYTES:
        raise _HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return length


def _common_name(cert: Mapping[str, Any] | None) -> str | None:
    """The subject CN of a certificate as ``getpeercert()`` decodes it."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


class _Connection:
    """One accepted socket and the bytes read from it but not consumed yet."""

    __slots__ = ("buf", "client_cert_cn", "fd", "id", "stream", "tcp", "tls", "tunnel")

    def __init__(self, tcp: trio.SocketStream, conn_id: int) -> None:
        # Socket options (SO_SNDBUF, SO_LINGER) go on `tcp`; HTTP goes through `stream`.
        self.tcp = tcp
        self.stream: trio.abc.Stream = tcp
        # Where the ticker writes tokens itself; -1 once TLS stands between.
        self.fd = tcp.socket.fileno()
        self.id = conn_id
        self.buf = bytearray()
        self.tls = False
        self.client_cert_cn: str | None = None
        self.tunnel: str | None = None

    def secured(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        """From now on HTTP goes through this TLS stream over ``tcp``."""
        self.stream = stream
        self.fd = -1
        self.tls = True
        self.client_cert_cn = _common_name(stream.getpeercert())

    async def _receive_more(self) -> bool:
        data = await self.stream.receive_some(RECEIVE_SIZE)
        self.buf += data
        return bool(data)

    async def read_request(self) -> _Request | None:
        """The next request, or None if the client closed the connection first."""
        buf = self.buf
        searched = 0
        while True:
            # Robustness (RFC 9112 §2.2): ignore empty lines before a request line.
            while buf.startswith(b"\r\n"):
                del buf[:2]
            end = buf.find(b"\r\n\r\n", searched)
            if end >= 0:
                break
            if len(buf) > MAX_HEADER_BYTES:
                raise _HTTPError(431, f"request head over {MAX_HEADER_BYTES} bytes")
            searched = max(0, len(buf) - 3)
            if not await self._receive_more():
                return None
        if end > MAX_HEADER_BYTES:
            raise _HTTPError(431, f"request head over {MAX_HEADER_BYTES} bytes")
        method, path, query, version, headers, absolute = _parse_head(bytes(buf[:end]))
        length = _content_length(method, headers)
        body_end = end + 4 + length
        while len(buf) < body_end:
            if not await self._receive_more():
                return None
        body = bytes(buf[end + 4 : body_end])
        del buf[:body_end]
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        # HTTP/1.0 keep-alive is an opt-in extension that no client here needs.
        keep_alive = version == "HTTP/1.1" and "close" not in tokens
        return _Request(method, path, query, version, headers, body, keep_alive, absolute)


# --------------------------------------------------------------------------- OpenAI shapes


@dataclass(frozen=True, slots=True)
class _Completion:
    """What one completion request asks for, decided before any byte is sent."""

    chat: bool
    stream: bool
    model: str
    tokens: int
    finish_reason: str
    include_usage: bool
    prompt_tokens: int
    response_id: str
    created: int

    @classmethod
    def build(
        cls, body: dict[str, Any], plan: _Plan, *, chat: bool, default_model: str, number: int
    ) -> _Completion:
        """Raise _Invalid on what vLLM would reject with a 400."""
        model = body.get("model", default_model)
        if not isinstance(model, str):
            raise _Invalid('"model" must be a string')
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _Invalid('"stream" must be a boolean')
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        tokens, finish_reason = plan.tokens, "stop"
        for name in ("max_tokens", "max_completion_tokens"):
            limit = body.get(name)
            if limit is None:
                continue
            _check_int(name, limit, 0)
            # vLLM says "length" whenever the limit ended generation, even at exactly the
            # natural length: the end-of-sequence token would have been one more.
            if limit <= tokens:
                tokens, finish_reason = limit, "length"
        if chat:
            if not isinstance(body.get("messages"), list):
                raise _Invalid('"messages" must be a list')
        elif "prompt" not in body:
            raise _Invalid('"prompt" is required')
        return cls(
            chat=chat,
            stream=stream,
            model=model,
            tokens=tokens,
            finish_reason=finish_reason,
            include_usage=include_usage,
            prompt_tokens=_count_prompt_tokens(body),
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{number}",
            created=int(time.time()),
        )

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def whole_body(self) -> bytes:
        text = "".join(token_text(i) for i in range(self.tokens))
        choice: dict[str, Any]
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice["finish_reason"] = self.finish_reason
        obj = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
        return json.dumps(obj, separators=(",", ":")).encode()

    def frames(self, *, chunked: bool) -> _Frames:
        return _StreamFrames(self, chunked=chunked)


def _message_texts(messages: object) -> list[str]:
    """The text of chat-style messages: string contents and the ``text`` of content parts
    (OpenAI's ``text``/``input_text`` parts, Anthropic's text blocks alike)."""
    texts: list[str] = []
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
    return texts


def _count_prompt_tokens(body: dict[str, Any]) -> int:
    """Whitespace-separated words of the prompt: deterministic, and cheap to check in a test."""
    texts = _message_texts(body.get("messages"))
    count = 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, int):
                count += 1  # a pre-tokenized prompt
            elif isinstance(item, list):
                count += len(item)
    return count + sum(len(text.split()) for text in texts)


def _count_words(texts: Sequence[str]) -> int:
    return sum(len(text.split()) for text in texts)


def _named_model(fields: Mapping[str, Any] | None) -> str | None:
    model = fields.get("model") if fields is not None else None
    return model if isinstance(model, str) else None


def _model(body: Mapping[str, Any], default_model: str) -> str:
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise _Invalid('"model" must be a string')
    return model


def _stream_flag(body: Mapping[str, Any]) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _Invalid('"stream" must be a boolean')
    return stream


def _limit(body: Mapping[str, Any], name: str, planned: int) -> tuple[int, bool]:
    """Tokens to generate under the limit ``name``, and whether the limit ended generation.

    As vLLM: a limit at exactly the natural length still ends it (the end-of-sequence token
    would have been one more).
    """
    limit = body.get(name)
    if limit is None:
        return planned, False
    _check_int(name, limit, 0)
    return (limit, True) if limit <= planned else (planned, False)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _sse(kind: str, obj: object) -> bytes:
    """One typed server-sent event, as vLLM writes the Responses and Messages streams."""
    return f"event: {kind}\ndata: {_dumps(obj)}\n\n".encode()


class _Frames:
    """Every byte of one stream but the tokens' own, decided before the first is sent.

    ``head`` goes with the response head, ``extra[i]`` right before token ``i`` (``extra[n]``
    before the tail), ``tail`` after the last token. Each SSE event is one HTTP chunk.
    """

    __slots__ = ("extra", "frame", "head", "tail")

    def __init__(self, *, chunked: bool) -> None:
        self.frame: Callable[[bytes], bytes] = _chunk if chunked else bytes
        self.extra: dict[int, bytes] = {}
        self.head = b""
        self.tail = b""

    def _framed(self, events: Sequence[bytes]) -> bytes:
        return b"".join(self.frame(e) for e in events)

    def _set_tail(self, events: Sequence[bytes]) -> None:
        tail = self._framed(events)
        if self.frame is _chunk:
            tail += b"0\r\n\r\n"
        self.tail = tail

    def insert_before(self, i: int, frame: bytes) -> None:
        self.extra[i] = frame + self.extra.get(i, b"")

    def before(self, i: int) -> bytes:
        return self.extra.get(i, b"")

    def token(self, i: int) -> bytes:
        """Token ``i`` with whatever must precede it."""
        raise NotImplementedError


class _StreamFrames(_Frames):
    """A chat or text completion stream, precomputed once per request so a token costs one
    lookup."""

    __slots__ = ("tokens",)

    def __init__(self, c: _Completion, *, chunked: bool) -> None:
        super().__init__(chunked=chunked)
        ident = json.dumps(c.response_id)
        model = json.dumps(c.model)
        kind = "chat.completion.chunk" if c.chat else "text_completion"
        prefix = f'data: {{"id":{ident},"object":"{kind}","created":{c.created},"model":{model},'
        choice = (prefix + '"choices":[{"index":0,').encode()
        open_field = b'"delta":{"content":' if c.chat else b'"text":'
        close_field = b"}" if c.chat else b""
        pending = b',"logprobs":null,"finish_reason":null}]}\n\n'
        self.tokens = tuple(
            self.frame(choice + open_field + word + close_field + pending)
            for word in _TOKEN_JSON[: max(1, min(c.tokens, len(_TOKEN_JSON)))]
        )
        # The role chunk goes with token 0, as vLLM sends it with the first output.
        if c.chat:
            role = b'"delta":{"role":"assistant","content":""}'
            self.extra[0] = self.frame(choice + role + pending)
        empty = b'"delta":{}' if c.chat else b'"text":""'
        finish = f',"logprobs":null,"finish_reason":"{c.finish_reason}"}}]}}\n\n'.encode()
        tail = [choice + empty + finish]
        if c.include_usage:
            usage = _dumps(c.usage())
            tail.append(f'{prefix}"choices":[],"usage":{usage}}}\n\n'.encode())
        tail.append(b"data: [DONE]\n\n")
        self._set_tail(tail)

    def token(self, i: int) -> bytes:
        data = self.tokens[i % len(self.tokens)]
        extra = self.extra.get(i)
        return data if extra is None else extra + data


class _EventFrames(_Frames):
    """A stream whose token ``i`` is ``before + <its text as JSON> + after``, or, numbered,
    ``before + text + middle + <first + i> + after`` (a Responses ``sequence_number``)."""

    __slots__ = ("_after", "_before", "_cycle", "_first", "_middle")

    def __init__(
        self,
        *,
        chunked: bool,
        head: Sequence[bytes],
        first: Sequence[bytes],
        before: bytes,
        after: bytes,
        tail: Sequence[bytes],
        numbered: tuple[bytes, int] | None = None,
    ) -> None:
        super().__init__(chunked=chunked)
        self.head = self._framed(head)
        if first:
            self.extra[0] = self._framed(first)
        self._set_tail(tail)
        self._before, self._after = before, after
        self._middle, self._first = numbered if numbered is not None else (b"", -1)
        self._cycle = (
            ()
            if numbered is not None
            else tuple(self.frame(before + word + after) for word in _TOKEN_JSON)
        )

    def token(self, i: int) -> bytes:
        if self._cycle:
            data = self._cycle[i % len(self._cycle)]
        else:
            word = _TOKEN_JSON[i % len(_TOKEN_JSON)]
            seq = b"%d" % (self._first + i)
            data = self.frame(self._before + word + self._middle + seq + self._after)
        extra = self.extra.get(i)
        return data if extra is None else extra + data


class _Answer(Protocol):
    """What a model endpoint will answer, decided before any byte is sent."""

    @property
    def stream(self) -> bool: ...

    @property
    def tokens(self) -> int: ...

    def whole_body(self) -> bytes: ...

    def frames(self, *, chunked: bool) -> _Frames: ...


@dataclass(frozen=True, slots=True)
class _Static:
    """A whole JSON answer of an endpoint that generates nothing (embeddings, tokenize, ...)."""

    body: bytes
    stream: bool = False
    tokens: int = 0

    def whole_body(self) -> bytes:
        return self.body

    def frames(self, *, chunked: bool) -> _Frames:
        raise AssertionError("a static answer is never streamed")


def _generated_text(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


@dataclass(frozen=True, slots=True)
class _Responses:
    """An OpenAI Responses API answer (``POST /v1/responses``)."""

    stream: bool
    model: str
    tokens: int
    incomplete: bool
    prompt_tokens: int
    number: int
    created: int
    max_output_tokens: int | None
    instructions: str | None

    @classmethod
    def build(
        cls, body: dict[str, Any], plan: _Plan, default_model: str, number: int
    ) -> _Responses:
        model = _model(body, default_model)
        stream = _stream_flag(body)
        items = body.get("input")
        if isinstance(items, str):
            texts = [items]
        elif isinstance(items, list):
            texts = _message_texts(items)
        else:
            raise _Invalid('"input" must be a string or a list of items')
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _Invalid('"instructions" must be a string')
        if instructions:
            texts.append(instructions)
        tokens, incomplete = _limit(body, "max_output_tokens", plan.tokens)
        return cls(
            stream=stream,
            model=model,
            tokens=tokens,
            incomplete=incomplete,
            prompt_tokens=_count_words(texts),
            number=number,
            created=int(time.time()),
            max_output_tokens=body.get("max_output_tokens"),
            instructions=instructions,
        )

    @property
    def item_id(self) -> str:
        return f"msg_{self.number}"

    @property
    def status(self) -> str:
        return "incomplete" if self.incomplete else "completed"

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": self.tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.tokens,
        }

    def response(self, *, final: bool) -> dict[str, Any]:
        """The response object: as it ends, or (not ``final``) as it starts."""
        if final:
            status = self.status
            output = [self._item(status, [self._part(_generated_text(self.tokens))])]
        else:
            status, output = "in_progress", []
        details = {"reason": "max_output_tokens"} if final and self.incomplete else None
        return {
            "id": f"resp_{self.number}",
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": details,
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": None,
            "metadata": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "auto",
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_logprobs": None,
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": self._usage() if final else None,
            "user": None,
        }

    def whole_body(self) -> bytes:
        return _dumps(self.response(final=True)).encode()

    def frames(self, *, chunked: bool) -> _Frames:
        n = self.tokens
        text = _generated_text(n)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            return _sse(kind, {"type": kind, "sequence_number": next(seq), **fields})

        start = self.response(final=False)
        head = [
            event("response.created", response=start),
            event("response.in_progress", response=start),
        ]
        first = [
            event(
                "response.output_item.added",
                output_index=0,
                item=self._item("in_progress", []),
            ),
            event("response.content_part.added", **where, part=self._part("")),
        ]
        delta = "response.output_text.delta"
        ids = _dumps(where)[1:-1]
        before = f'event: {delta}\ndata: {{"type":"{delta}",{ids},"logprobs":[],"delta":'
        # The deltas take the numbers from here on; `event` numbers the tail after them.
        first_delta = next(seq)
        seq = itertools.count(first_delta + n)
        final = self.response(final=True)
        ending = "response.incomplete" if self.incomplete else "response.completed"
        tail = [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=self._part(text)),
            event("response.output_item.done", output_index=0, item=final["output"][0]),
            event(ending, response=final),
        ]
        return _EventFrames(
            chunked=chunked,
            head=head,
            first=first,
            before=before.encode(),
            after=b"}\n\n",
            tail=tail,
            numbered=(b',"sequence_number":', first_delta),
        )


@dataclass(frozen=True, slots=True)
class _Messages:
    """An Anthropic Messages answer (``POST /v1/messages``)."""

    stream: bool
    model: str
    tokens: int
    stop_reason: str
    prompt_tokens: int
    number: int

    @classmethod
    def build(cls, body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Messages:
        model = _model(body, default_model)
        stream = _stream_flag(body)
        if body.get("max_tokens") is None:
            raise _Invalid('"max_tokens" is required')
        _check_int("max_tokens", body["max_tokens"], 1)
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _Invalid('"messages" must be a list')
        texts = _message_texts(messages)
        system = body.get("system")
        if isinstance(system, str):
            texts.append(system)
        elif isinstance(system, list):
            texts.extend(_message_texts([{"content": system}]))
        tokens, capped = _limit(body, "max_tokens", plan.tokens)
        return cls(
            stream=stream,
            model=model,
            tokens=tokens,
            stop_reason="max_tokens" if capped else "end_turn",
            prompt_tokens=_count_words(texts),
            number=number,
        )

    def message(self, *, final: bool) -> dict[str, Any]:
        """The message object: whole, or (not ``final``) as ``message_start`` carries it."""
        content = [{"type": "text", "text": _generated_text(self.tokens)}] if final else []
        return {
            "id": f"msg_{self.number}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": self.stop_reason if final else None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.tokens if final else 0,
            },
        }

    def whole_body(self) -> bytes:
        return _dumps(self.message(final=True)).encode()

    def frames(self, *, chunked: bool) -> _Frames:
        def event(kind: str, **fields: Any) -> bytes:
            return _sse(kind, {"type": kind, **fields})

        first = [
            event("message_start", message=self.message(final=False)),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            event("ping"),
        ]
        delta = "content_block_delta"
        before = f'event: {delta}\ndata: {{"type":"{delta}","index":0,'
        before += '"delta":{"type":"text_delta","text":'
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": self.tokens}
        tail = [
            event("content_block_stop", index=0),
            event(
                "message_delta",
                delta={"stop_reason": self.stop_reason, "stop_sequence": None},
                usage=usage,
            ),
            event("message_stop"),
        ]
        return _EventFrames(
            chunked=chunked,
            head=[],
            first=first,
            before=before.encode(),
            after=b"}}\n\n",
            tail=tail,
        )


@dataclass(frozen=True, slots=True)
class _Upload:
    """A multipart/form-data body, parsed: its text fields and its file parts' contents."""

    fields: dict[str, str]
    files: dict[str, bytes]

    @classmethod
    def parse(cls, content_type: str, body: bytes) -> _Upload:
        kind, options = parse_options_header(content_type)
        boundary = options.get("boundary")
        if kind != "multipart/form-data" or not boundary:
            raise _Invalid("the body must be multipart/form-data with a boundary")
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        decoder = MultipartDecoder(boundary.encode("latin-1"))
        decoder.receive_data(body)
        decoder.receive_data(None)
        part: Field | File | None = None
        data = bytearray()
        try:
            while True:
                event = decoder.next_event()
                if isinstance(event, Field | File):
                    part, data = event, bytearray()
                elif isinstance(event, Data):
                    data += event.data
                    if not event.more_data and part is not None:
                        if isinstance(part, File):
                            files[part.name] = bytes(data)
                        else:
                            fields[part.name] = data.decode()
                        part = None
                elif isinstance(event, Epilogue | NeedData):
                    break
        except Exception as exc:  # noqa: BLE001 - any parser failure is the client's: a 400
            raise _Invalid(f"malformed multipart/form-data body: {exc}") from None
        return cls(fields, files)


def _form_flag(fields: Mapping[str, str], name: str) -> bool:
    value = fields.get(name, "false").strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off", ""):
        return False
    raise _Invalid(f'"{name}" must be a boolean')


@dataclass(frozen=True, slots=True)
class _Transcription:
    """A transcription (``POST /v1/audio/transcriptions``): deterministic text, and digests of
    what arrived so a test can prove the body was relayed intact."""

    stream: bool
    model: str
    tokens: int
    number: int
    created: int
    digests: dict[str, Any]

    @classmethod
    def build(
        cls, upload: _Upload, raw: bytes, plan: _Plan, default_model: str, number: int
    ) -> _Transcription:
        audio = upload.files.get("file")
        if audio is None:
            raise _Invalid('"file" is required (a file part)')
        digests = {
            "sha256": hashlib.sha256(raw).hexdigest(),
            "bytes": len(raw),
            "file_sha256": hashlib.sha256(audio).hexdigest(),
        }
        return cls(
            stream=_form_flag(upload.fields, "stream"),
            model=upload.fields.get("model") or default_model,
            tokens=plan.tokens,
            number=number,
            created=int(time.time()),
            digests=digests,
        )

    def whole_body(self) -> bytes:
        return _dumps({"text": _generated_text(self.tokens), **self.digests}).encode()

    def frames(self, *, chunked: bool) -> _Frames:
        ident = _dumps(f"trsc-{self.number}")
        prefix = (
            f'data: {{"id":{ident},"object":"transcription.chunk","created":{self.created},'
            f'"model":{_dumps(self.model)},"choices":[{{'
        )
        finish = _dumps({"delta": {}, "finish_reason": "stop", "stop_reason": None})
        last = f"{prefix}{finish[1:]}],{_dumps(self.digests)[1:]}\n\n"
        return _EventFrames(
            chunked=chunked,
            head=[],
            first=[],
            before=(prefix + '"delta":{"content":').encode(),
            after=b'},"finish_reason":null,"stop_reason":null}]}\n\n',
            tail=[last.encode(), b"data: [DONE]\n\n"],
        )


def _inputs(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The ``input`` of an embeddings or pooling request: a text, texts, or token arrays."""
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if all(isinstance(v, str) for v in value):
            return list(value)
        if all(
            isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
            for v in value
        ):
            return [list(v) for v in value]
    raise _Invalid('"input" must be a string, a list of strings, or token arrays')


def _pooled_usage(items: Sequence[str | list[int]]) -> dict[str, Any]:
    n = sum(len(item.split()) if isinstance(item, str) else len(item) for item in items)
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _vectors(body: Mapping[str, Any], items: Sequence[str | list[int]]) -> list[Any]:
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise _Invalid('"encoding_format" must be "float" or "base64"')
    dimensions = body.get("dimensions")
    if dimensions is None:
        dimensions = EMBEDDING_DIMENSIONS
    _check_int("dimensions", dimensions, 1, 32)
    vectors: list[Any] = []
    for item in items:
        vector = embedding_vector(item, dimensions)
        if encoding == "base64":
            packed = struct.pack(f"<{len(vector)}f", *vector)
            vectors.append(base64.b64encode(packed).decode())
        else:
            vectors.append(vector)
    return vectors


def _embeddings(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    model = _model(body, default_model)
    items = _inputs(body)
    data = [
        {"index": i, "object": "embedding", "embedding": vector}
        for i, vector in enumerate(_vectors(body, items))
    ]
    answer = {
        "id": f"embd-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _pooled_usage(items),
    }
    return _Static(_dumps(answer).encode())


def _pooling(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    model = _model(body, default_model)
    items = _inputs(body)
    data = [
        {"index": i, "object": "pooling", "data": vector}
        for i, vector in enumerate(_vectors(body, items))
    ]
    answer = {
        "id": f"pool-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _pooled_usage(items),
    }
    return _Static(_dumps(answer).encode())


def _token_id(word: str) -> int:
    try:
        return WORDS.index(word)
    except ValueError:
        return len(WORDS) + zlib.crc32(word.encode()) % (VOCAB_SIZE - len(WORDS))


def _tokenize(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    _model(body, default_model)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(body.get("messages"), list):
        texts = _message_texts(body["messages"])
    else:
        raise _Invalid('"prompt" (a string) or "messages" (a list) is required')
    tokens = [_token_id(word) for text in texts for word in text.split()]
    answer = {
        "count": len(tokens),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tokens,
        "token_strs": None,
    }
    return _Static(_dumps(answer).encode())


def _detokenize(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    _model(body, default_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise _Invalid('"tokens" must be a list of token ids')
    return _Static(_dumps({"prompt": "".join(token_text(t) for t in tokens)}).encode())


def _document_text(document: object) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return str(document["text"])
    raise _Invalid('each document must be a string or {"text": ...}')


def _rerank(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    model = _model(body, default_model)
    query = body.get("query")
    documents = body.get("documents")
    if not isinstance(query, str):
        raise _Invalid('"query" must be a string')
    if not isinstance(documents, list):
        raise _Invalid('"documents" must be a list')
    texts = [_document_text(d) for d in documents]
    top_n = body.get("top_n")
    if top_n is None or top_n == 0:
        top_n = len(texts)
    _check_int("top_n", top_n, 0)
    scores = [relevance_score(query, text) for text in texts]
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    results = [
        {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]} for i in order
    ]
    words = _count_words([query]) * len(texts) + _count_words(texts)
    answer = {
        "id": f"rerank-{number}",
        "model": model,
        "usage": {"total_tokens": words},
        "results": results[:top_n],
    }
    return _Static(_dumps(answer).encode())


def _score(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    model = _model(body, default_model)
    sides: list[list[str]] = []
    for name in ("text_1", "text_2"):
        value = body.get(name)
        if isinstance(value, str):
            sides.append([value])
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            sides.append(list(value))
        else:
            raise _Invalid(f'"{name}" must be a string or a non-empty list of strings')
    left, right = sides
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise _Invalid('"text_1" and "text_2" must pair up: one to many, or as many each')
    data = [
        {"index": i, "object": "score", "score": relevance_score(a, b)}
        for i, (a, b) in enumerate(zip(left, right, strict=True))
    ]
    words = _count_words(left) + _count_words(right)
    answer = {
        "id": f"score-{number}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": words,
            "total_tokens": words,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
    return _Static(_dumps(answer).encode())


def _chat(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    return _Completion.build(body, plan, chat=True, default_model=default_model, number=number)


def _text_completion(body: dict[str, Any], plan: _Plan, default_model: str, number: int) -> _Answer:
    return _Completion.build(body, plan, chat=False, default_model=default_model, number=number)


_Builder = Callable[[dict[str, Any], _Plan, str, int], _Answer]

# The model endpoints that take a JSON body; the transcription endpoint takes multipart.
_JSON_ENDPOINTS: Final[dict[str, _Builder]] = {
    _CHAT_PATH: _chat,
    _COMPLETIONS_PATH: _text_completion,
    _RESPONSES_PATH: _Responses.build,
    _MESSAGES_PATH: _Messages.build,
    "/v1/embeddings": _embeddings,
    "/pooling": _pooling,
    "/tokenize": _tokenize,
    "/detokenize": _detokenize,
    "/v1/rerank": _rerank,
    "/rerank": _rerank,
    "/v2/rerank": _rerank,
    "/v1/score": _score,
    "/score": _score,
}


# --------------------------------------------------------------------------- the clock

# Tokens due within this window go out in one wake-up of the ticker: at most this late, and
# ~25 tokens per wake-up instead of one task switch each at 1000 streams x 50 tokens/s.
TICK: Final = 0.0005


class _Job:
    """Tokens ``[0, stop)`` of one stream, on its schedule, handed to the ticker."""

    __slots__ = (
        "done",
        "fd",
        "frames",
        "i",
        "interval",
        "pending",
        "record",
        "recorder",
        "start",
        "stop",
        "stream",
        "withdrawn",
    )

    def __init__(
        self,
        stream: trio.abc.Stream,
        fd: int,
        record: RequestRecord,
        recorder: Recorder,
        frames: _Frames,
        start: float,
        interval: float,
        stop: int,
    ) -> None:
        self.stream = stream
        # -1: not a socket the ticker may write to (TLS); every token goes through `stream`.
        self.fd = fd
        self.record = record
        self.recorder = recorder
        self.frames = frames
        self.start = start
        self.interval = interval
        self.stop = stop
        self.i = 0
        # Bytes the ticker could not write without blocking: the stream's own task sends them.
        self.pending = b""
        self.withdrawn = False
        self.done = trio.Event()

    def due(self) -> float:
        return self.start + self.i * self.interval

    def sent(self) -> None:
        self.i += 1
        self.recorder._token_sent(self.record)


class _Ticker:
    """One task that writes every due token of every stream, so a token costs one write.

    A stream's own task would cost two scheduler round trips per token (its sleep and the
    checkpoint after ``send_all``); at 50,000 tokens/s that alone saturates a core. The ticker
    writes with a non-blocking ``os.write`` on the socket and hands a job back to its task
    for anything that could block (a full send buffer: backpressure) or fail (the task's
    ``send_all`` then raises ``BrokenResourceError`` as usual) or must be encrypted (TLS).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Job]] = []
        self._seq = itertools.count()
        self._lot = trio.lowlevel.ParkingLot()
        self._wake_at = -math.inf

    async def send_tokens(self, job: _Job) -> None:
        """Send the job's tokens on schedule; return when all are sent."""
        try:
            while job.i < job.stop:
                job.done = trio.Event()
                self._push(job)
                await job.done.wait()
                if job.pending:
                    data, job.pending = job.pending, b""
                    await job.stream.send_all(data)
                    job.sent()
        finally:
            # The socket closes after this returns; the ticker must never write to its fd.
            job.withdrawn = True

    def _push(self, job: _Job) -> None:
        due = job.due()
        heapq.heappush(self._heap, (due, next(self._seq), job))
        if due < self._wake_at and self._lot:
            self._lot.unpark_all()

    async def run(self) -> None:
        """Serve jobs until cancelled."""
        while True:
            self._flush(trio.current_time())
            self._wake_at = self._heap[0][0] if self._heap else math.inf
            with trio.move_on_at(self._wake_at + TICK):
                await self._lot.park()
            self._wake_at = -math.inf

    def _flush(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            job = heapq.heappop(heap)[2]
            if job.withdrawn:
                continue
            data = job.frames.token(job.i)
            fd = job.fd
            if fd < 0:
                # TLS: the bytes need encrypting, and only the stream's own task may do that.
                written = 0
            else:
                try:
                    written = os.write(fd, data)
                except OSError:
                    # A full buffer (BlockingIOError) or a dead peer: either way the job's task
                    # takes over, and meets the error, if any, through trio's own send path.
                    written = 0
            if written == len(data):
                job.sent()
                if job.i < job.stop:
                    heapq.heappush(heap, (job.due(), next(self._seq), job))
                    continue
            else:
                job.pending = data[written:]
            job.done.set()


# --------------------------------------------------------------------------- prefix cache


def prompt_bytes(body: Mapping[str, Any]) -> bytes:
    """The prompt as the prefix cache sees it: instructions or system, then each message's role
    and text (or the prompt, or the input), in order."""
    parts: list[str] = []
    for name in ("instructions", "system"):
        if isinstance(body.get(name), str):
            parts.append(f"system\x1f{body[name]}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = body.get("input")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                texts = _message_texts([message])
                parts.append(f"{message.get('role', '')}\x1f{''.join(texts)}")
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            parts.append(value)
    return "\x1e".join(parts).encode("utf-8", "replace")


class PrefixCache:
    """An LRU of prompt blocks, as vLLM's automatic prefix caching keeps KV blocks: each full
    block of ``block`` bytes is named by a hash of the prompt up to its end (a chain), so a
    block hits only when everything before it hit too. Counts blocks queried and hit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, prompt: bytes, block: int) -> tuple[int, int, float]:
        """Look ``prompt`` up and remember it: (its full blocks, how many were cached, the
        fraction of its bytes not cached)."""
        chain = b""
        names = []
        for start in range(0, len(prompt) - block + 1, block):
            chain = hashlib.blake2b(chain + prompt[start : start + block], digest_size=16).digest()
            names.append(chain)
        hit = 0
        for name in names:
            if name not in self._blocks:
                break
            hit += 1
        for name in names:
            self._blocks[name] = None
            self._blocks.move_to_end(name)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        self.queries += len(names)
        self.hits += hit
        uncached = 1.0 - (hit * block / len(prompt)) if prompt else 1.0
        return len(names), hit, uncached


# --------------------------------------------------------------------------- the server


class FakeUpstream:
    """An OpenAI-compatible server on raw trio TCP that records what it saw.

    ``settings`` is read at each request, so a test may change it between requests.
    """

    def __init__(self, settings: FakeSettings | None = None) -> None:
        self.settings = settings if settings is not None else FakeSettings()
        self.recorder = Recorder(max_records=self.settings.max_records)
        self._ticker = _Ticker()
        self._tls: tuple[tuple[str, str, str], ssl.SSLContext] | None = None
        self.cache = PrefixCache(self.settings.prefix_cache_size)
        self.running = 0
        self.waiting = 0
        self._slots = trio.CapacityLimiter(max(1, self.settings.max_running))

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen, report the bound port through ``task_status``, serve until cancelled."""
        # Unreadable certificate files fail here, before the caller believes it is serving.
        self._tls_context()
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound: int = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ticker.run)
            await nursery.start(
                partial(
                    trio.serve_listeners,
                    self._handle_connection,
                    listeners,
                    handler_nursery=nursery,
                )
            )
            task_status.started(bound)

    def _tls_context(self) -> ssl.SSLContext | None:
        """The server context of the current settings, None for plain HTTP."""
        settings = self.settings
        if not settings.tls_cert:
            return None
        files = (settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if self._tls is None or self._tls[0] != files:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(settings.tls_cert, settings.tls_key)
            context.set_alpn_protocols(["http/1.1"])
            if settings.tls_client_ca:
                # This CA alone: the system store must not vouch for a client.
                context.load_verify_locations(cafile=settings.tls_client_ca)
                context.verify_mode = ssl.CERT_REQUIRED
            self._tls = (files, context)
        return self._tls[1]

    async def _handle_connection(self, tcp: trio.SocketStream) -> None:
        conn = _Connection(tcp, self.recorder._connection_opened())
        ending = _End.CLOSE
        try:
            if self.settings.sndbuf is not None:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.sndbuf)
            held = self.settings.accept_delay > 0 and self._tls_context() is None
            if held and not await self._hold(conn):
                return
            # Behind the fake's own proxy, TLS starts inside the tunnel, after CONNECT.
            if not self.settings.via_proxy:
                await self._start_tls(conn)
            ending = await self._serve_connection(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client vanished between requests: nobody to answer and nothing to record.
            ending = _End.CLOSE
        finally:
            if ending is _End.RESET:
                # Linger on with timeout 0 makes close() send RST instead of FIN.
                linger = struct.pack("ii", 1, 0)
                with contextlib.suppress(OSError):
                    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            await trio.aclose_forcefully(conn.stream)
            self.recorder._connection_closed()

    async def _hold(self, conn: _Connection) -> bool:
        """Hold a fresh connection for ``accept_delay`` seconds, reading only to notice the
        client leave; False if it did (the caller then closes the connection)."""
        self.recorder._held(1)
        try:
            with trio.move_on_after(self.settings.accept_delay):
                await _until_client_leaves(conn)
                self.recorder._closed_during_hold()
                return False
            return True
        finally:
            self.recorder._held(-1)

    async def _start_tls(self, conn: _Connection) -> None:
        """Secure the connection if the settings say HTTPS; raise BrokenResourceError if the
        handshake fails."""
        context = self._tls_context()
        if context is None:
            return
        # https_compatible: an HTTP client may close without close_notify (RFC 9112 §9.8).
        stream = trio.SSLStream(conn.tcp, context, server_side=True, https_compatible=True)
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError:
            self.recorder._tls_failed()
            raise
        conn.secured(stream)

    async def _serve_connection(self, conn: _Connection) -> _End:
        answered = False
        while True:
            if answered and not await self._next_request_wanted(conn):
                return _End.CLOSE
            try:
                request = await conn.read_request()
            except _HTTPError as exc:
                response = _error_response(exc.status, exc.message, keep_alive=False)
                await conn.stream.send_all(response)
                return _End.CLOSE
            if request is None:
                return _End.CLOSE
            if request.method == "CONNECT":
                ending = await self._serve_connect(conn, request)
                # The tunnel is a fresh connection to its client: the habits start over.
                answered = False
            elif request.path.startswith("/_fake/"):
                ending = await self._serve_control(conn, request)
                answered = True
            elif request.path == "/metrics" and request.method == "GET":
                ending = await self._serve_metrics(conn, request)
                answered = True
            else:
                ending = await self._serve_request(conn, request)
                answered = True
            if ending is not _End.KEEP:
                return ending

    async def _next_request_wanted(self, conn: _Connection) -> bool:
        """Whether the fake reads another request after an answer, per its habits; a response
        that said keep-alive is no promise."""
        settings = self.settings
        if settings.close_after_response:
            return False
        if settings.late_close is not None:
            # Nothing reads meanwhile: a request written in these seconds meets the close.
            await trio.sleep(settings.late_close)
            return False
        if settings.keepalive_timeout is not None and not conn.buf:
            # Only the wait for a request's first byte is timed, as in uvicorn.
            with trio.move_on_after(settings.keepalive_timeout):
                return await conn._receive_more()
            return False
        return True

    async def _serve_connect(self, conn: _Connection, request: _Request) -> _End:
        """Open a tunnel to the requested origin, which is the fake whatever its name."""
        if not self.settings.via_proxy or conn.tunnel is not None:
            message = "the fake upstream is no proxy here (via_proxy is off, or in a tunnel)"
            await conn.stream.send_all(_error_response(405, message, keep_alive=False))
            return _End.CLOSE
        target = request.path
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit():
            message = f"CONNECT needs host:port, not {target!r}"
            await conn.stream.send_all(_error_response(400, message, keep_alive=False))
            return _End.CLOSE
        conn.tunnel = target
        self.recorder._tunnel_opened(target)
        await conn.stream.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if self.settings.tls_cert:
            if conn.buf:
                # A TLS client waits for the 200; what came before it is no handshake.
                return _End.CLOSE
            await self._start_tls(conn)
        return _End.KEEP

    def metrics_text(self) -> str:
        """What GET /metrics answers: vLLM's names, this fake's figures."""
        settings = self.settings
        if settings.metrics_text is not None:
            return settings.metrics_text
        label = f'{{model_name="{settings.models[0]}"}}'
        usage = self.running / settings.max_running if settings.max_running else 0.0
        lines = [
            ("vllm:num_requests_running", "gauge", self.running),
            ("vllm:num_requests_waiting", "gauge", self.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", usage),
            ("vllm:prefix_cache_queries", "counter", self.cache.queries),
            ("vllm:prefix_cache_hits", "counter", self.cache.hits),
        ]
        out = []
        for name, kind, value in lines:
            sample = f"{name}_total" if kind == "counter" else name
            out += [f"# TYPE {name} {kind}", f"{sample}{label} {float(value)}"]
        return "\n".join(out) + "\n"

    async def _serve_metrics(self, conn: _Connection, request: _Request) -> _End:
        keep = request.keep_alive
        body = self.metrics_text().encode()
        status = self.settings.metrics_status
        content_type = "text/plain; version=0.0.4; charset=utf-8"
        await conn.stream.send_all(
            _response(status, body, keep_alive=keep, content_type=content_type)
        )
        return _End.KEEP if keep else _End.CLOSE

    async def _serve_control(self, conn: _Connection, request: _Request) -> _End:
        """The fake's own endpoints: not recorded, never subject to fault injection."""
        keep = request.keep_alive
        if request.path == "/_fake/requests" and request.method == "GET":
            since = 0
            for pair in request.query.split("&"):
                name, _, value = pair.partition("=")
                if name == "since" and value.isdigit():
                    since = int(value)
            records = [r.to_json() for r in self.recorder.records if r.id >= since]
            response = _json_response(200, records, keep_alive=keep)
        else:
            response = _error_response(404, f"no such endpoint: {request.path}", keep_alive=keep)
        await conn.stream.send_all(response)
        return _End.KEEP if keep else _End.CLOSE

    async def _serve_request(self, conn: _Connection, request: _Request) -> _End:
        body = _parse_json_object(request.body)
        record = self.recorder._new_record(conn, request, body)
        ending = _End.CLOSE
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_client, conn, record, nursery.cancel_scope)
            try:
                ending = await self._respond(conn, request, record)
            except trio.BrokenResourceError:
                # A write failed before the watcher saw the EOF or reset.
                self.recorder._disconnected(record)
                ending = _End.CLOSE
            nursery.cancel_scope.cancel()
        if record.outcome == "client_disconnected":
            return _End.CLOSE
        return ending

    async def _watch_client(
        self, conn: _Connection, record: RequestRecord, scope: trio.CancelScope
    ) -> None:
        """Notice a client that leaves while the fake is busy, in any phase, without a write.

        Bytes read here (a pipelined next request) are kept for the next ``read_request``;
        cancelling ``receive_some`` loses nothing, since trio cancels only before a read.
        """
        await _until_client_leaves(conn)
        self.recorder._disconnected(record)
        scope.cancel()

    async def _respond(self, conn: _Connection, request: _Request, record: RequestRecord) -> _End:
        keep = request.keep_alive
        plain = _End.KEEP if keep else _End.CLOSE
        path, method = request.path, request.method
        settings = self.settings
        if settings.via_proxy and not record.via_proxy:
            message = "this fake upstream answers only through a proxy (it is one: use it)"
            response = _error_response(403, message, keep_alive=keep)
        elif path in _JSON_ENDPOINTS or path == _TRANSCRIPTIONS_PATH:
            errors = _anthropic_error_body if path == _MESSAGES_PATH else _error_body
            if method != "POST":
                response = _response(405, errors(405, f"use POST for {path}"), keep_alive=keep)
            else:
                try:
                    plan, answer = self._plan_answer(request, record)
                except _Invalid as exc:
                    response = _response(400, errors(400, str(exc)), keep_alive=keep)
                else:
                    self.recorder._planned(record, plan.mode)
                    return await self._serving(conn, request, record, plan, answer, errors)
        elif path == "/health" and method == "GET":
            response = _response(200, b"", keep_alive=keep, content_type=None)
        elif path == "/v1/models" and method == "GET":
            response = _json_response(200, self._models(), keep_alive=keep)
        elif path in ("/health", "/v1/models"):
            response = _error_response(405, f"use GET for {path}", keep_alive=keep)
        else:
            response = _error_response(404, f"no such endpoint: {path}", keep_alive=keep)
        await conn.stream.send_all(response)
        self.recorder._finish(record, "completed")
        return plain

    def _plan_answer(self, request: _Request, record: RequestRecord) -> tuple[_Plan, _Answer]:
        """The plan and the answer of a model endpoint's request; raise _Invalid for a 400."""
        settings = self.settings
        default_model = settings.models[0]
        if request.path == _TRANSCRIPTIONS_PATH:
            upload = _Upload.parse(request.headers.get("content-type", ""), request.body)
            self.recorder._form_parsed(record, upload.fields)
            steering: dict[str, Any] = {}
            if "fake" in upload.fields:
                fake = _parse_json_object(upload.fields["fake"].encode())
                if fake is None:
                    raise _Invalid('the "fake" field must be a JSON object')
                steering["fake"] = fake
            plan = _Plan.build(settings, steering)
            answer = _Transcription.build(upload, request.body, plan, default_model, record.id)
            return plan, answer
        if record.body is None:
            raise _Invalid("request body must be a JSON object")
        plan = _Plan.build(settings, record.body)
        build = _JSON_ENDPOINTS[request.path]
        return plan, build(record.body, plan, default_model, record.id)

    def _models(self) -> dict[str, Any]:
        created = int(time.time())
        models = [
            {"id": name, "object": "model", "created": created, "owned_by": "sluice-fake"}
            for name in self.settings.models
        ]
        return {"object": "list", "data": models}

    async def _serving(
        self,
        conn: _Connection,
        request: _Request,
        record: RequestRecord,
        plan: _Plan,
        answer: _Answer,
        errors: Callable[[int, str], bytes],
    ) -> _End:
        """The serving model around an answer: a running slot (waiting for one, in order),
        then the prefix cache's TTFT, counted from when the slot was had."""
        settings = self.settings
        async with contextlib.AsyncExitStack() as stack:
            if settings.max_running:
                self._slots.total_tokens = settings.max_running
                self.waiting += 1
                try:
                    await stack.enter_async_context(self._slots)
                finally:
                    self.waiting -= 1
                record.queued_seconds = trio.current_time() - record.received_at
            self.running += 1
            stack.callback(self._stopped_running)
            ttft = plan.ttft
            if settings.prefix_cache_size and record.body is not None:
                fake = record.body.get("fake")
                overridden = isinstance(fake, dict) and "ttft" in fake
                self.cache.capacity = settings.prefix_cache_size
                blocks, hit, uncached = self.cache.lookup(
                    prompt_bytes(record.body), settings.prefix_block_bytes
                )
                record.prefix_blocks, record.prefix_hit_blocks = blocks, hit
                if not overridden:
                    ttft = settings.ttft_hit + (settings.ttft_miss - settings.ttft_hit) * uncached
            waited = trio.current_time() - record.received_at
            if waited or ttft != plan.ttft:
                plan = dataclasses.replace(plan, ttft=waited + ttft)
            return await self._complete(conn, request, record, plan, answer, errors)
        raise AssertionError("unreachable")  # pragma: no cover (mypy: the with returns)

    def _stopped_running(self) -> None:
        self.running -= 1

    async def _complete(
        self,
        conn: _Connection,
        request: _Request,
        record: RequestRecord,
        plan: _Plan,
        answer: _Answer,
        errors: Callable[[int, str], bytes],
    ) -> _End:
        mode = plan.mode
        if mode == "refuse":
            self.recorder._finish(record, "failed_injected")
            return _End.CLOSE
        if mode == "stall_headers":
            await trio.sleep_forever()
        if mode == "status":
            await trio.sleep_until(record.received_at + plan.ttft)
            body = errors(plan.status, "fake upstream error")
            await conn.stream.send_all(_response(plan.status, body, keep_alive=request.keep_alive))
            self.recorder._finish(record, "failed_injected")
            return _End.KEEP if request.keep_alive else _End.CLOSE
        if answer.stream:
            return await self._stream(conn, request, record, plan, answer)
        return await self._whole(conn, request, record, plan, answer)

    async def _stream(
        self,
        conn: _Connection,
        request: _Request,
        record: RequestRecord,
        plan: _Plan,
        answer: _Answer,
    ) -> _End:
        frames = answer.frames(chunked=request.chunked)
        n = answer.tokens
        # The fault fires where token `at` would go; past the end, right before the tail.
        fault_at = min(plan.at, n)
        ends_early = plan.mode not in ("ok", "malformed")
        if plan.mode == "malformed":
            frames.insert_before(fault_at, frames.frame(MALFORMED_EVENT))
        start = record.received_at + plan.ttft
        # What a server sends before generating (the Responses API's response.created) goes
        # with the head.
        await conn.stream.send_all(_stream_head(request) + frames.head)
        stop = fault_at if ends_early else n
        if stop:
            job = _Job(
                conn.stream, conn.fd, record, self.recorder, frames, start, plan.interval, stop
            )
            await self._ticker.send_tokens(job)
        # Token k is due at start + k * interval; the tail goes with the last token.
        await trio.sleep_until(start + min(stop, max(n - 1, 0)) * plan.interval)
        if ends_early:
            return await self._inject(plan.mode, record)
        await conn.stream.send_all(frames.before(n) + frames.tail)
        if n == 0:
            self.recorder._token_sent(record, 0)
        self.recorder._finish(record, "completed" if plan.mode == "ok" else "failed_injected")
        return _End.KEEP if request.keep_alive else _End.CLOSE

    async def _inject(self, mode: str, record: RequestRecord) -> _End:
        """The fault that ends a response early: reset, clean EOF, or silence until it leaves."""
        if mode == "stall":
            await trio.sleep_forever()
        self.recorder._finish(record, "failed_injected")
        return _End.RESET if mode == "reset" else _End.CLOSE

    async def _whole(
        self,
        conn: _Connection,
        request: _Request,
        record: RequestRecord,
        plan: _Plan,
        answer: _Answer,
    ) -> _End:
        n = answer.tokens
        last = max(n - 1, 0)
        if plan.mode == "ok":
            await trio.sleep_until(record.received_at + plan.ttft + last * plan.interval)
            keep = request.keep_alive
            await conn.stream.send_all(_response(200, answer.whole_body(), keep_alive=keep))
            self.recorder._token_sent(record, n)
            self.recorder._finish(record, "completed")
            return _End.KEEP if keep else _End.CLOSE
        # Without a stream, a fault fires where token `at` would have been generated.
        fault_time = plan.ttft + min(plan.at, last) * plan.interval
        await trio.sleep_until(record.received_at + fault_time)
        if plan.mode == "eof":
            # A truncated body: the client has its headers, so a retry would not be safe.
            body = answer.whole_body()
            head = _response(200, b"", keep_alive=False, content_length=len(body))
            await conn.stream.send_all(head + body[: len(body) // 2])
        elif plan.mode == "malformed":
            await conn.stream.send_all(_response(200, MALFORMED_EVENT, keep_alive=False))
        return await self._inject(plan.mode, record)


def _parse_json_object(raw: bytes) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = FakeSettings()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=9000, help="port to bind (0: any free one)")
    parser.add_argument("--ttft", type=float, default=defaults.ttft, help="seconds to token 0")
    parser.add_argument(
        "--interval", type=float, default=defaults.interval, help="seconds between tokens"
    )
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="tokens per answer")
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        default=None,
        help=f"a served model name, repeatable (default: {defaults.models[0]})",
    )
    parser.add_argument("--mode", choices=sorted(MODES), default=defaults.mode)
    parser.add_argument("--at", type=int, default=defaults.at, help="token index of the fault")
    parser.add_argument("--status", type=int, default=defaults.status, help="status of mode=status")
    parser.add_argument(
        "--sndbuf", type=int, default=None, help="SO_SNDBUF of accepted sockets, in bytes"
    )
    habits = parser.add_mutually_exclusive_group()
    habits.add_argument(
        "--close-after-response",
        action="store_true",
        help="close each connection after its first answer, without saying Connection: close",
    )
    habits.add_argument(
        "--keepalive-timeout",
        type=float,
        default=None,
        metavar="S",
        help="close a keep-alive connection idle for S seconds after an answer (uvicorn: 5)",
    )
    habits.add_argument(
        "--late-close",
        type=float,
        default=None,
        metavar="S",
        help="close S seconds after an answer, leaving a request sent meanwhile unanswered",
    )
    parser.add_argument("--tls-cert", default="", metavar="FILE", help="serve HTTPS: PEM chain")
    parser.add_argument("--tls-key", default="", metavar="FILE", help="the PEM private key")
    parser.add_argument(
        "--tls-client-ca",
        default="",
        metavar="FILE",
        help="require a client certificate signed by this PEM CA (mTLS)",
    )
    parser.add_argument(
        "--via-proxy",
        action="store_true",
        help="be the HTTP proxy in front of itself: answer CONNECT and absolute-form "
        "requests, refuse direct ones with 403",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="requests generating at once; the rest wait in order (0: no limit)",
    )
    parser.add_argument(
        "--prefix-cache-size",
        type=int,
        default=defaults.prefix_cache_size,
        metavar="N",
        help="an LRU of N prompt blocks; TTFT from --ttft-hit to --ttft-miss by the "
        "uncached fraction (0: off, TTFT is --ttft)",
    )
    parser.add_argument(
        "--prefix-block-bytes",
        type=int,
        default=defaults.prefix_block_bytes,
        help="bytes of prompt per cached block",
    )
    parser.add_argument(
        "--ttft-hit", type=float, default=defaults.ttft_hit, help="TTFT of a fully cached prompt"
    )
    parser.add_argument(
        "--ttft-miss", type=float, default=defaults.ttft_miss, help="TTFT of an uncached prompt"
    )


def settings_from_args(args: argparse.Namespace) -> FakeSettings:
    models: Sequence[str] | None = args.models
    return FakeSettings(
        ttft=args.ttft,
        interval=args.interval,
        tokens=args.tokens,
        models=list(models) if models else ["fake-model"],
        mode=args.mode,
        at=args.at,
        status=getattr(args, "status", 500),
        sndbuf=args.sndbuf,
        close_after_response=args.close_after_response,
        keepalive_timeout=args.keepalive_timeout,
        late_close=args.late_close,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        via_proxy=args.via_proxy,
        max_running=getattr(args, "max_running", 0),
        prefix_cache_size=getattr(args, "prefix_cache_size", 0),
        prefix_block_bytes=getattr(args, "prefix_block_bytes", 256),
        ttft_hit=getattr(args, "ttft_hit", 0.02),
        ttft_miss=getattr(args, "ttft_miss", 0.3),
    )


async def run_from_args(args: argparse.Namespace) -> None:
    """Serve until cancelled, announcing the address once listening (scripts wait for it)."""
    settings = settings_from_args(args)
    fake = FakeUpstream(settings)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(fake.serve, args.host, args.port))
        host = f"[{args.host}]" if ":" in args.host else args.host
        # Behind its own proxy the listener speaks plain HTTP; TLS starts inside the tunnel.
        scheme = "https" if settings.tls_cert and not settings.via_proxy else "http"
        role = " (as an HTTP proxy: only through it)" if settings.via_proxy else ""
        print(f"fake upstream listening on {scheme}://{host}:{port}{role}", flush=True)


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m proxy.testing.fake_upstream"
) -> None:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        trio.run(run_from_args, args)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
