"""hypercorn's per-connection server (``hypercorn.trio.tcp_server.TCPServer``), with Sluice's
changes. hypercorn builds one per accepted connection from a module global of its trio worker,
which :func:`install` points here (logged and skipped if that global is not the class we know).

* **A client's leaving reaches the relay as soon as it is seen.** hypercorn turns the EOF into
  an ``http.disconnect`` for the app, which a later scheduler turn delivers to the request's
  message task, which then cancels the relay. On a saturated loop each turn waits behind a batch
  of other streams' events. While a relay streams (``relay_started`` .. ``relay_ended``, called
  by asgi), its disconnect hook runs from whichever sees the client go first: the loop's
  :mod:`~proxy.hangup` watcher (between task steps), or the read loop (hypercorn 0.18's, with
  one addition) before it hands the EOF on. The upstream connection is shut down at once; the
  cancellation follows as before.
* **The keep-alive timer costs no scheduler round trips.** hypercorn restarts it with
  ``nursery.start`` (the connection's task waits for the timer's task to start) under a
  ``trio.Lock`` (a checkpoint), and stops it under the lock again: two or three round trips on
  every request's way in, each a wait behind every other ready task on a busy loop.
  :class:`IdleTimer` does the same with ``start_soon`` and a cancel scope made beforehand.
* **No linger after the client closed.** hypercorn's keep-alive timer kept running once the
  client had gone, holding the connection's task and socket (CLOSE_WAIT) for keep_alive_timeout.
  Reading over, the timer goes too, and a response that finishes later does not re-arm it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import weakref
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from math import inf
from typing import Any

import h11
import trio

from proxy.protocol.errors import bad_request
from proxy.protocol.http1 import request_framing_error
from proxy.server import adapters, hangup
from proxy.server.adapters.hypercorn_adapter import (
    MAX_RECV,
    Closed,
    Event,
    H11Protocol,
    RawData,
    TCPServer,
    Updated,
    hypercorn_protocol,
    hypercorn_trio_run,
)

log = logging.getLogger("sluice.connection_server")


class IdleTimer:
    """hypercorn's TrioSingleTask (restart, stop) without a checkpoint: the timer's cancel
    scope is made before its task is spawned, so it can be cancelled before the task has run
    (the task then ends at its first checkpoint). Only its connection's tasks call it, one
    step at a time, so nothing needs the lock hypercorn takes."""

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: trio.CancelScope | None = None

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        if self._scope is not None:
            self._scope.cancel()
        scope = self._scope = trio.CancelScope()
        task_group.spawn(_run_in_scope, scope, action)

    async def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None


async def _run_in_scope(scope: trio.CancelScope, action: Callable[[], Awaitable[None]]) -> None:
    with scope:
        await action()


class ConnectionServer(TCPServer):
    # The relay streaming on this connection now, if any: called once the client is gone.
    on_client_gone: Callable[[], None] | None = None
    _reading_done = False
    # The socket registered with the loop's hangup watcher while a relay streams.
    _watched: tuple[hangup.HangupWatcher, int] | None = None

    def relay_started(self, on_client_gone: Callable[[], None]) -> None:
        """``on_client_gone`` is to be called once the client leaves, as early as that is
        seen: by the loop's hangup watcher between task steps, or by the read task."""
        self.on_client_gone = on_client_gone
        watcher = hangup.current()
        sock = client_socket(self)
        if watcher is None or sock is None or self._reading_done:
            return
        fd = sock.fileno()
        try:
            watcher.watch(fd, self._client_gone)
        except OSError as error:
            # The kernel's epoll limits (max_user_watches: ENOSPC, ENOMEM): the read task still
            # sees the client go, a scheduler turn later. Not worth failing the request over.
            _warn_once(f"client sockets are not watched for hangups: {error}")
            return
        self._watched = (watcher, fd)

    def relay_ended(self) -> None:
        self.on_client_gone = None
        self._unwatch()

    def _unwatch(self) -> None:
        if self._watched is not None:
            watcher, fd = self._watched
            self._watched = None
            watcher.unwatch(fd, self._client_gone)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_task = IdleTimer()  # type: ignore[assignment]
        connections = getattr(self.config, "sluice_connections", None)
        if isinstance(connections, ConnectionSet):
            connections.add(self)

    async def _read_data(self) -> None:
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            if not data:
                self._client_gone()
            await self.protocol.handle(RawData(bytes(data)))
            if not data:
                break
        self._client_gone()
        self._reading_done = True
        await self.idle_task.stop()
        await self.protocol.handle(Closed())

    def _client_gone(self) -> None:
        self._unwatch()
        callback, self.on_client_gone = self.on_client_gone, None
        if callback is not None:
            callback()

    async def protocol_send(self, event: Event) -> None:
        if self._reading_done and isinstance(event, Updated) and event.idle:
            # A response finishing after the client reset the connection would re-arm the
            # timer just stopped: nothing more can arrive to be idle for.
            return
        await super().protocol_send(event)


class ConnectionSet:
    """The live client connections of one server, to drop at a deadline: hypercorn's writes are
    shielded and have none, so a client that stops reading would hold its task (and the
    server's shutdown) forever after hypercorn's own graceful deadline cancelled it."""

    def __init__(self) -> None:
        self._servers: weakref.WeakSet[ConnectionServer] = weakref.WeakSet()
        # The fast path's connections waiting for their next request (fast_path.py), ended
        # when a graceful shutdown begins, as hypercorn ends its idle ones; and whether it has.
        self._idle: set[trio.CancelScope] = set()
        self.closing = False

    def add_idle(self, scope: trio.CancelScope) -> bool:
        """A connection's wait for its next request, to be cancelled when the shutdown
        begins; False (nothing to wait for) if it has."""
        if self.closing:
            return False
        self._idle.add(scope)
        return True

    def discard_idle(self, scope: trio.CancelScope) -> None:
        self._idle.discard(scope)

    def close_idle(self) -> None:
        """The graceful shutdown has begun: idle connections close now, busy ones after
        their answer (``Connection: close``)."""
        self.closing = True
        for scope in list(self._idle):
            scope.cancel()
        self._idle.clear()

    def attach(self, hypercorn_config: Any) -> None:
        """Connections served under ``hypercorn_config`` join this set."""
        hypercorn_config.sluice_connections = self

    def add(self, server: ConnectionServer) -> None:
        self._servers.add(server)

    def drop_all(self) -> int:
        """Reset every live connection (RST, unsent bytes discarded); how many there were."""
        dropped = 0
        for server in list(self._servers):
            sock = client_socket(server)
            if sock is not None and sock.fileno() >= 0:
                reset_socket(sock)
                dropped += 1
        return dropped


def reset_socket(sock: Any) -> None:
    """Close a trio socket with an RST: a write blocked on it wakes with ClosedResourceError,
    and the kernel frees its buffers at once."""
    with contextlib.suppress(OSError):
        # Linger 0: close with RST, discarding the unsent bytes the client would not take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class FramingCheckedProtocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, refusing requests whose framing RFC 9112 forbids: both
    Content-Length and Transfer-Encoding (a smuggling attempt; h11 accepts it), or chunked on
    HTTP/1.0. The answer is a 400 with ``Connection: close``, and nothing after it on the
    connection is read: bytes smuggled after such a request are never answered."""

    async def _send_h11_event(self, event: Any) -> None:
        # hypercorn sends no reason phrase ("HTTP/1.1 404 "): legal, but curl -i and every
        # log then show a bare number.
        if isinstance(event, h11.Response) and not event.reason:
            event = h11.Response(
                status_code=event.status_code,
                headers=list(event.headers),
                http_version=event.http_version,
                reason=reason_phrase(event.status_code),
            )
        await super()._send_h11_event(event)

    async def _create_stream(self, request: h11.Request) -> None:
        problem = request_framing_error(request.headers, request.http_version)
        if problem is None:
            await super()._create_stream(request)
            return
        error = bad_request(f"Bad request framing: {problem}.", code="invalid_framing")
        body = error.body()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *self.config.response_headers("h11"),
        ]
        with contextlib.suppress(h11.LocalProtocolError):
            await self._send_h11_event(h11.Response(status_code=400, headers=headers))
            await self._send_h11_event(h11.Data(data=body))
            await self._send_h11_event(h11.EndOfMessage())
        # No stream: hypercorn's event loop stops at the request's body (its stream is None),
        # and Closed makes the connection server close the socket.
        await self.send(Closed())


_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def reason_phrase(status: int) -> bytes:
    return _REASONS.get(status, b"")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def client_socket(server: Any) -> Any:
    """The client's TCP socket under a connection server (its trio SocketStream's), or None
    where the layout differs (Sluice serves no TLS)."""
    return getattr(getattr(server, "stream", None), "socket", None)


def send_chain(send: Any) -> tuple[Any, Any, Any]:
    """hypercorn's objects behind an app's ASGI ``send``: the HTTPStream whose ``app_send`` it
    is, that stream's H11Protocol (``stream_send``), and the protocol's TCPServer
    (``protocol_send``); hypercorn 0.17/0.18, tested in test_lifetime. hypercorn offers no
    public way from the app to its connection; each is None where the layout differs."""
    stream = getattr(send, "__self__", None)
    protocol = getattr(getattr(stream, "send", None), "__self__", None)
    server = getattr(getattr(protocol, "send", None), "__self__", None)
    return stream, protocol, server


def install(server_class: type[ConnectionServer] = ConnectionServer) -> None:
    """hypercorn's trio worker builds ``server_class`` for each connection it accepts."""
    current = getattr(hypercorn_trio_run, "TCPServer", None)
    if not adapters.usable("connection_server"):
        pass  # logged by the adapter's start-up check
    elif current is not TCPServer and not (
        isinstance(current, type) and issubclass(current, ConnectionServer)
    ):
        log.warning("hypercorn's connection server is not the expected one; left as it is")
    else:
        setattr(hypercorn_trio_run, "TCPServer", server_class)  # noqa: B010
    if getattr(hypercorn_protocol, "H11Protocol", None) not in (
        H11Protocol,
        FramingCheckedProtocol,
    ):
        log.warning("hypercorn's HTTP/1.1 protocol is not the expected one; left as it is")
    else:
        setattr(hypercorn_protocol, "H11Protocol", FramingCheckedProtocol)  # noqa: B010
