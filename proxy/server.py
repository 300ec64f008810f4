"""Run the app under hypercorn's trio worker, on sockets we create (so we can tune them)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from .app import state_of
from .asgi import SluiceQuart
from .config import Config, check_public_bind

_CLEANUP_SECONDS = 5.0
_MAX_SOCKOPT_INT = 2**31 - 1


def hypercorn_config(config: Config) -> HypercornConfig:
    server = config.server
    hyper = HypercornConfig()
    host = f"[{server.host}]" if ":" in server.host else server.host
    hyper.bind = [f"{host}:{server.port}"]
    hyper.keep_alive_timeout = server.keep_alive_timeout
    hyper.graceful_timeout = server.graceful_timeout
    hyper.backlog = server.backlog
    # The access log would be one synchronous write per request on the event loop.
    hyper.accesslog = None
    # A Logger (not a path) makes hypercorn use it as it is, through our logging set-up,
    # instead of adding a second handler that prints every line twice.
    hyper.errorlog = logging.getLogger("hypercorn.error")
    return hyper


def listen_sockets(hyper: HypercornConfig, stall_timeout: float) -> Sockets:
    sockets = hyper.create_sockets()
    for sock in sockets.insecure_sockets:
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            # hypercorn shields its send_all and has no write timeout, so a client that stops
            # reading without closing would hold its connection forever. The relay cancels
            # such a client's work after stall_timeout; this makes the kernel drop the
            # connection too (accepted sockets inherit it; Linux applies it to a zero window).
            milliseconds = min(int(stall_timeout * 1000) + 1000, _MAX_SOCKOPT_INT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
        sock.listen(hyper.backlog)
    return sockets


async def serve(
    app: SluiceQuart,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled or ``shutdown_trigger`` returns; ``started`` gets the bound URLs.

    Raises :class:`ConfigError` before binding when the config would serve other machines
    without client keys (see :func:`check_public_bind`)."""
    check_public_bind(config)
    hyper = hypercorn_config(config)
    sockets = listen_sockets(hyper, config.relay.stall_timeout)
    try:
        await worker_serve(
            wrap_app(app, hyper.wsgi_max_body_size, "asgi"),
            hyper,
            sockets=sockets,
            shutdown_trigger=shutdown_trigger,
            task_status=task_status,
        )
    finally:
        # A cancelled serve skips the app's after_serving; the upstream pools must close
        # anyway, under a shield (we may be cancelled) with a bound (never hang shutdown).
        with trio.CancelScope(shield=True) as cleanup:
            cleanup.deadline = trio.current_time() + _CLEANUP_SECONDS
            await state_of(app).aclose()
