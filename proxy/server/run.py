"""Run the app under hypercorn's trio worker, on sockets we create (so we can tune them)."""

from __future__ import annotations

import gc
import logging
import signal
import warnings
from collections.abc import Awaitable, Callable

import trio

from proxy.config import Config, check_public_bind
from proxy.server import adapters, connection_server, fast_path, hangup, ws_buffer
from proxy.server.adapters import httpcore_adapter
from proxy.server.adapters.hypercorn_adapter import HypercornConfig, worker_serve
from proxy.server.adapters.hypercorn_adapter import Sockets as Sockets
from proxy.server.asgi import SluiceQuart

_CLEANUP_SECONDS = 5.0
# After hypercorn's graceful deadline, the connections still open are dropped this much later
# (hypercorn's own cancellation ends the others first).
_DROP_AFTER_GRACE = 0.25
# The requests still at work this long before the grace ends (at most half of it) are stopped
# and their clients told, in the time left, before hypercorn cancels what remains.
_GRACE_NOTICE = 0.5
log = logging.getLogger("sluice.server")

# Young-generation collections every 20,000 net allocations instead of CPython's 700: a relay
# allocates short-lived objects per event (bytes, trio task state, outcome objects) that
# refcounting frees anyway, so most of those collections found nothing (GC was ~5% of the
# proxy's CPU in the hot-path profile; this recovers it). Cyclic garbage still goes, later.
_GC_THRESHOLDS = (20_000, 50, 100)


def tune_gc() -> None:
    """For a serving process, once start-up is done: everything allocated so far (modules,
    config, a loaded model's Python objects) is moved out of the collector's sight, and young
    collections run less often. Not for library use (tests): it changes the whole process."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


def hypercorn_config(config: Config) -> HypercornConfig:
    server = config.server
    hyper = HypercornConfig()
    host = f"[{server.host}]" if ":" in server.host else server.host
    hyper.bind = [f"{host}:{server.port}"]
    hyper.keep_alive_timeout = server.keep_alive_timeout
    hyper.graceful_timeout = server.graceful_timeout
    hyper.backlog = server.backlog
    # WebSocket messages share the request body's limit: a message is buffered whole, within
    # it (ws_buffer.py).
    hyper.websocket_max_message_size = server.max_body_bytes
    # The access log would be one synchronous write per request on the event loop.
    hyper.accesslog = None
    # A Logger (not a path) makes hypercorn use it as it is, through our logging set-up,
    # instead of adding a second handler that prints every line twice.
    hyper.errorlog = logging.getLogger("hypercorn.error")
    return hyper


def bind(config: Config) -> Sockets:
    """The listening sockets for ``config`` (bound before a model loads, and before the
    workers start: they share them). An OSError says why not (its errno: in use...)."""
    try:
        return listen_sockets(hypercorn_config(config))
    except OSError as caught:
        error = caught
    # hypercorn's create_sockets drops the socket whose bind failed without closing it, and
    # the traceback's frames hold it: let go of them and collect it now, quietly, rather than
    # be warned about it at some later collection.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        error.__traceback__ = None
        gc.collect()
    raise error


def listen_sockets(hyper: HypercornConfig) -> Sockets:
    # No TCP_USER_TIMEOUT here: on a zero window Linux applies it even to a client that is
    # still reading, slowly (measured: reads of 4 KiB every 0.45 s were reset after the
    # timeout). A stalled client's connection is dropped by the stall limit on every write
    # instead (server/writer.py).
    sockets = hyper.create_sockets()
    for sock in sockets.insecure_sockets:
        sock.listen(hyper.backlog)
    return sockets


async def serve(
    app: SluiceQuart,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    sockets: Sockets | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or ``shutdown_trigger`` returns; ``started`` gets the bound URLs.

    Raises :class:`ConfigError` before binding when the config would serve other machines
    without client keys (see :func:`check_public_bind`)."""
    check_public_bind(config)
    adapters.check_all()
    hyper = hypercorn_config(config)
    if sockets is None:
        sockets = listen_sockets(hyper)
    connection_server.install(fast_path.FastPathServer)
    ws_buffer.install()
    httpcore_adapter.install()
    connections = connection_server.ConnectionSet()
    served = trio.Event()

    async def drop_stuck_connections(deadline: float) -> None:
        # hypercorn cancels what is left at its graceful deadline, but a write the client
        # does not take is shielded and outlives that: dropped here, just after.
        await trio.sleep_until(deadline)
        if not served.is_set():
            dropped = connections.drop_all()
            log.warning("graceful timeout: dropped %d connection(s) stuck in a write", dropped)

    async def tell_clients_before_the_cut(grace_end: float) -> None:
        await trio.sleep_until(grace_end - min(_GRACE_NOTICE, hyper.graceful_timeout / 2))
        stopped = app.served_state.end_grace()
        if stopped:
            log.warning("graceful timeout: stopped %d request(s) still at work", stopped)

    async def drop_connections_if_cancelled() -> None:
        # Cancelled (a second signal, or our caller): stop now, whatever the clients do.
        try:
            await trio.sleep_forever()
        finally:
            if not served.is_set():
                connections.drop_all()

    async with trio.open_nursery() as nursery:

        async def shutdown() -> None:
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger()
            grace_end = trio.current_time() + hyper.graceful_timeout
            app.served_state.begin_drain(grace_end)
            nursery.start_soon(tell_clients_before_the_cut, grace_end)
            nursery.start_soon(drop_stuck_connections, grace_end + _DROP_AFTER_GRACE)
            # Both servers' idle connections close now; busy ones after their answer, which
            # says so.
            connections.drain()

        nursery.start_soon(drop_connections_if_cancelled)
        try:
            async with hangup.watching() as watcher:
                seam = connection_server.Seam(
                    connections,
                    config.relay.stall_timeout,
                    responder=app.responder if config.server.fast_path else None,
                    hangup=watcher,
                )
                await worker_serve(
                    connection_server.SeamApp(app, seam),
                    hyper,
                    sockets=sockets,
                    shutdown_trigger=shutdown,
                    task_status=task_status,
                )
        finally:
            served.set()
            # A cancelled serve skips the app's after_serving; the upstream pools must close
            # anyway, under a shield (we may be cancelled) with a bound (never hang shutdown).
            with trio.CancelScope(shield=True) as cleanup:
                cleanup.deadline = trio.current_time() + _CLEANUP_SECONDS
                await app.served_state.aclose()
        nursery.cancel_scope.cancel()


async def serve_until_signalled(
    app: SluiceQuart,
    config: Config,
    *,
    sockets: Sockets | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: /readyz turns 503 at once, the listeners close
    after ``drain_delay``, in-flight requests get ``graceful_timeout`` to finish and the rest
    are cancelled (hypercorn's graceful shutdown, with our relays inside it). A second signal
    cancels everything at once. SIGHUP reloads the config file (the state's reload_config:
    what it applies and what needs a restart is api/reload.py's), draining or not."""
    stop_accepting = trio.Event()
    server = config.server

    async with trio.open_nursery() as nursery:

        async def run_server(task_status: trio.TaskStatus[list[str]]) -> None:
            await serve(
                app,
                config,
                shutdown_trigger=stop_accepting.wait,
                sockets=sockets,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # served and drained: stop watching signals

        async def stop_if_a_model_fails() -> None:
            # A local model loads while the port answers; if it cannot load, the server has
            # nothing to serve it with: stop, and say why (below).
            await app.served_state.failed.wait()
            nursery.cancel_scope.cancel()

        async def close_listeners_later() -> None:
            await trio.sleep(server.drain_delay)
            stop_accepting.set()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
                # A worker is born with SIGHUP blocked (proxy/server/workers.py): one passed on
                # while it started waits, pending, for this receiver.
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        # Beside the signals, not in their way: a reload waits for its new
                        # upstreams' start, and a SIGTERM meanwhile must drain at once.
                        nursery.start_soon(app.served_state.reload_config)
                        continue
                    if app.served_state.draining:
                        log.warning("second signal: cancelling in-flight requests now")
                        nursery.cancel_scope.cancel()
                        return
                    app.served_state.begin_drain(
                        trio.current_time() + server.drain_delay + server.graceful_timeout
                    )
                    log.info(
                        "%s: draining; listeners close in %gs, in-flight requests then have %gs",
                        signal.Signals(signum).name,
                        server.drain_delay,
                        server.graceful_timeout,
                    )
                    nursery.start_soon(close_listeners_later)

        nursery.start_soon(watch_signals)
        nursery.start_soon(stop_if_a_model_fails)
        task_status.started(await nursery.start(run_server))
    if app.served_state.load_error is not None:
        raise app.served_state.load_error
