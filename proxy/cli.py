"""``sluice``: serve the proxy, or run the fake upstream."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from inference.loading import ModelLoadError

from .config import Config, ConfigError, load_config

DEFAULT_CONFIG = "conf/local.toml"


async def _wait_for_signal() -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


async def load_local_models(config: Config) -> dict[str, Any]:
    models = [model for model in config.models if model.backend == "local"]
    if not models:
        return {}  # torch is never imported for a proxy without local models
    from inference import load_model

    loaded = {}
    for model in models:
        loaded[model.name] = await trio.to_thread.run_sync(load_model, model.path, model.name)
    return loaded


async def _serve(args: argparse.Namespace) -> None:
    from .app import create_app
    from .server import serve

    config = load_config(args.config, host=args.host, port=args.port)
    # Local models load before the server binds, so a missing or broken model ends start-up
    # with one clear line instead of a server that cannot answer.
    local_models = await load_local_models(config)
    app = create_app(config, local_models=local_models)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=_wait_for_signal))
        names = ", ".join(model.name for model in config.models) or "(none configured)"
        print(f"sluice serving {names} on {' '.join(binds)} (config: {config.source})", flush=True)


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("serve", help="serve the proxy")
    parser.add_argument(
        "--config", "-c", help=f"TOML config file (default: {DEFAULT_CONFIG} when present)"
    )
    parser.add_argument("--host", help="bind address (overrides config and environment)")
    parser.add_argument("--port", type=int, help="bind port (overrides config and environment)")
    parser.set_defaults(handler=_serve)


def _add_fake_upstream(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import fake_upstream

    parser = subparsers.add_parser(
        "fake-upstream", help="run a fake OpenAI-compatible upstream (vLLM-like) for tests"
    )
    fake_upstream.add_arguments(parser)
    parser.set_defaults(handler=fake_upstream.run_from_args)


def _add_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from . import bench

    parser = subparsers.add_parser(
        "bench", help="load-test the proxy against a fake upstream (and, with --direct, without)"
    )
    bench.add_arguments(parser)
    parser.set_defaults(handler=bench.run_from_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_fake_upstream(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every upstream request at INFO: a synchronous write per request on the hot path.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.command == "serve" and args.config is None and os.path.exists(DEFAULT_CONFIG):
        args.config = DEFAULT_CONFIG
    try:
        trio.run(args.handler, args)
    except ConfigError as error:
        print(f"sluice: configuration error: {error}", file=sys.stderr)
        return 2
    except ModelLoadError as error:
        print(f"sluice: model error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
