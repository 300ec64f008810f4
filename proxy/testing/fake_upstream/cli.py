"""The fake upstream's command line: ``sluice fake-upstream`` and
``python -m proxy.testing.fake_upstream``. ``add_arguments`` and ``settings_from_args`` are
shared with the bench, which starts the fake with the flags of the habit under test.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from typing import Final

import trio

from proxy.testing.fake_upstream.behaviours import MODES, FakeSettings
from proxy.testing.fake_upstream.server import FakeUpstream

DESCRIPTION: Final = "A fake OpenAI-compatible upstream that behaves like vLLM's OpenAI server."


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
    parser.add_argument(
        "--prefix-block-tokens",
        type=int,
        default=defaults.prefix_block_tokens,
        metavar="N",
        help="the prefix cache in blocks of N tokens (as /tokenize makes them); TTFT is "
        "--ttft-hit plus --prefill-token-seconds per uncached token, one prefill at a time",
    )
    parser.add_argument(
        "--prefill-token-seconds",
        type=float,
        default=defaults.prefill_token_seconds,
        help="prefill time per uncached prompt token (with --prefix-block-tokens)",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=defaults.kv_events_port,
        help="publish vLLM's KV events of the token-block cache on this ZeroMQ port (0: any)",
    )
    parser.add_argument(
        "--kv-replay-port",
        type=int,
        default=defaults.kv_replay_port,
        help="the KV events' replay (ROUTER) port (0: any)",
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
        prefix_block_tokens=getattr(args, "prefix_block_tokens", 0),
        prefill_token_seconds=getattr(args, "prefill_token_seconds", 0.0),
        kv_events_port=getattr(args, "kv_events_port", None),
        kv_replay_port=getattr(args, "kv_replay_port", 0),
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
        if fake.kv_events_endpoint:
            print(f"KV events on {fake.kv_events_endpoint}", flush=True)


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m proxy.testing.fake_upstream"
) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        trio.run(run_from_args, args)
    except KeyboardInterrupt:
        sys.exit(130)
