"""hypercorn's per-connection server (``hypercorn.trio.tcp_server.TCPServer``), with Sluice's
changes. hypercorn builds one per accepted connection from a module global of its trio worker,
which :func:`install` points here (logged and skipped if that global is not the class we know).
What Sluice gives it (:class:`Seam`) comes with the app hypercorn hands every connection.

* **One connection state.** Its count of requests, head deadline and closing are one
  :class:`~proxy.protocol.connection_state.ConnectionState`, which the fast path (a subclass)
  and hypercorn's protocol (:class:`FramingCheckedProtocol`, counting each request it reads)
  both move: the keep-alive timer waits on its head deadline, and every answer's head says
  ``connection: close`` by it (``keep_alive_max_requests``, a drain, the client's asking).
* **A client's leaving reaches the relay as soon as it is seen.** hypercorn turns the EOF into
  an ``http.disconnect`` for the app, which a later scheduler turn delivers to the request's
  message task, which then cancels the relay. On a saturated loop each turn waits behind a batch
  of other streams' events. While a relay streams (``relay_started`` .. ``relay_ended``, called
  by the writer's wire), its disconnect hook runs from whichever sees the client go first: the
  loop's :mod:`~proxy.server.hangup` watcher, or the read loop (hypercorn 0.18's, with one
  addition) before it hands the EOF on. The upstream connection is shut down at once; the
  cancellation follows as before.
* **Every write within the stall limit.** hypercorn's own writes are shielded and have no
  deadline: a client that stops reading held a handler, and the server's shutdown, forever.
  Here each write keeps its shield but has the stall limit for a deadline.
* **The close RFC 9112 9.6 asks for.** After a connection's last answer our side is shut down
  first, and what the client still sends is read and discarded (bounded) before the socket
  closes: closing with unread input sends an RST, and the client loses the end of its answer.
  What a client sends after a request that closes the connection is not read as requests
  (h11 would fail it, and hypercorn answer 400 instead of the answer in progress).
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
from dataclasses import dataclass
from http import HTTPStatus
from math import inf
from typing import Any

import h11
import trio

from proxy.protocol.connection_state import ConnectionState
from proxy.protocol.errors import bad_request
from proxy.protocol.http1 import request_framing_error
from proxy.protocol.http1_server import header_block, keeps_alive
from proxy.server import adapters
from proxy.server import hangup as hangup_watch
from proxy.server.adapters.hypercorn_adapter import (
    MAX_RECV,
    ASGIWrapper,
    Closed,
    Event,
    H11Protocol,
    RawData,
    TCPServer,
    Updated,
    hypercorn_protocol,
    hypercorn_trio_run,
)
from proxy.server.call import Responder

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


@dataclass(frozen=True)
class Seam:
    """What Sluice gives the server of every connection, explicitly: it rides on the app that
    hypercorn's worker hands to each connection's server (:class:`SeamApp`), never on
    hypercorn's own config."""

    # The server's live connections: drained and dropped together.
    connections: ConnectionSet
    # The bound on every write to a client ([relay] stall_timeout).
    stall_timeout: float
    # The app's one way in, for the requests the fast path reads; None: hypercorn and Quart
    # serve every request.
    responder: Responder | None = None
    # The loop's hangup watcher, while the server serves (None where there is none).
    hangup: hangup_watch.HangupWatcher | None = None


class SeamApp(ASGIWrapper):
    """The app as hypercorn's worker is handed it, with the :class:`Seam` beside it: hypercorn
    passes its app to the server of every connection it accepts, which is how the seam
    reaches them."""

    def __init__(self, app: Any, seam: Seam) -> None:
        super().__init__(app)
        self.seam = seam


# How long a connection being closed reads and discards what its client still sends, after
# its last answer and the shutdown of our side (RFC 9112 9.6), before it closes anyway.
LINGER_SECONDS = 2.0


class ConnectionServer(TCPServer):
    # The relay streaming on this connection now, if any: called once the client is gone.
    on_client_gone: Callable[[], object] | None = None
    _reading_done = False
    # The socket registered with the loop's hangup watcher while a relay streams.
    _watched: tuple[hangup_watch.HangupWatcher, int] | None = None
    # The read task while it runs; its receive's scope, and its hand-over to the protocol's.
    _reader: trio.lowlevel.Task | None = None
    _receiving: trio.CancelScope | None = None
    _feeding: trio.CancelScope | None = None
    # Set once the close has begun (our side shut down): the reader discards until then.
    _linger_until: float | None = None

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        super().__init__(app, config, context, state, stream)
        self.idle_task = IdleTimer()  # type: ignore[assignment]
        self.seam: Seam | None = app.seam if isinstance(app, SeamApp) else None
        self.connection_state = ConnectionState(
            config.keep_alive_timeout, config.keep_alive_max_requests, trio.current_time()
        )
        if self.seam is not None:
            self.seam.connections.add(self)

    def relay_started(self, on_client_gone: Callable[[], object]) -> None:
        """``on_client_gone`` is to be called once the client leaves, as early as that is
        seen: by the loop's hangup watcher (between task steps, or as soon as the loop wakes
        for it), or by the read task."""
        self.on_client_gone = on_client_gone
        watcher = None if self.seam is None else self.seam.hangup
        sock = client_socket(self)
        if watcher is None or sock is None or self._reading_done:
            return
        fd = sock.fileno()
        try:
            watcher.watch(fd, self.client_gone)
        except OSError as error:
            # The kernel's epoll limits (max_user_watches: ENOSPC, ENOMEM): the read task still
            # sees the client go, a scheduler turn later. Not worth failing the request over.
            _warn_once(f"client sockets are not watched for hangups: {error}")
            return
        self._watched = (watcher, fd)

    def relay_ended(self) -> None:
        self.on_client_gone = None
        self._unwatch()

    @property
    def watched(self) -> bool:
        """Whether the hangup watcher hears this client's departure."""
        return self._watched is not None

    def _unwatch(self) -> None:
        if self._watched is not None:
            watcher, fd = self._watched
            self._watched = None
            watcher.unwatch(fd, self.client_gone)

    def client_gone(self) -> None:
        """The client has left (its FIN or reset, seen by the hangup watcher or a read): the
        streaming relay's hook runs, once."""
        self._unwatch()
        callback, self.on_client_gone = self.on_client_gone, None
        if callback is not None:
            callback()

    async def _read_data(self) -> None:
        self._reader = trio.lowlevel.current_task()
        read_timeout = self.config.read_timeout or inf
        try:
            while self._linger_until is None:
                with trio.CancelScope(deadline=trio.current_time() + read_timeout) as receiving:
                    self._receiving = receiving
                    try:
                        data: bytes | bytearray | None = await self.stream.receive_some(MAX_RECV)
                    except (trio.ClosedResourceError, trio.BrokenResourceError):
                        data = None
                self._receiving = None
                if data is None or receiving.cancelled_caught or self._linger_until is not None:
                    break
                if not data:
                    self.client_gone()
                with trio.CancelScope() as self._feeding:
                    await self.protocol.handle(RawData(bytes(data)))
                self._feeding = None
                if not data:
                    break
            if self._linger_until is not None:
                await _discard_until(self.stream, self._linger_until)
        finally:
            self._reader = None
        self.client_gone()
        self._reading_done = True
        await self.idle_task.stop()
        await self.protocol.handle(Closed())

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData) and self.seam is not None:
            await self._send_within(event.data, self.seam.stall_timeout)
            return
        if isinstance(event, Updated) and event.idle:
            if self._reading_done:
                # A response finishing after the client reset the connection would re-arm
                # the timer just stopped: nothing more can arrive to be idle for.
                return
            self.connection_state.waiting(trio.current_time())
        await super().protocol_send(event)

    async def _send_within(self, data: bytes, stall_timeout: float) -> None:
        """hypercorn's write, with the stall limit every answer has: shielded from the app's
        cancellation (a frame half written would corrupt the connection), but not from its
        own deadline, past which the client is dropped."""
        async with self.send_lock:
            try:
                with trio.CancelScope(shield=True) as write:
                    write.deadline = trio.current_time() + stall_timeout
                    await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
                return
        if write.cancelled_caught:
            log.warning("client took nothing for %gs; dropped", stall_timeout)
            sock = client_socket(self)
            if sock is not None and sock.fileno() >= 0:
                reset_socket(sock)
            await self.protocol.handle(Closed())

    async def _idle_timeout(self) -> None:
        # hypercorn's, waiting on the connection's one head deadline (carried over from the
        # fast path) and on the drain of Sluice's connection set, not a fresh timer.
        seam = self.seam
        with trio.move_on_at(self.connection_state.head_deadline) as wait:
            if seam is None:
                await self.context.terminated.wait()
            elif seam.connections.add_idle(wait):
                try:
                    await trio.sleep_forever()
                finally:
                    seam.connections.discard_idle(wait)
        with trio.CancelScope(shield=True):
            await self._initiate_server_close()

    async def _close(self) -> None:
        """Close the connection as RFC 9112 9.6 says: our side first (the client reads the
        whole answer, then EOF), then what the client still sends is read and discarded, for
        at most LINGER_SECONDS, then the socket closes. Closing with unread input would send
        an RST, and the kernel would drop whatever of the answer the client had yet to read."""
        if self._reader is None or self._reading_done:
            await super()._close()  # reading is over: nothing is left unread
            return
        if self._linger_until is not None:
            return
        self._linger_until = trio.current_time() + LINGER_SECONDS
        async with self.send_lock:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.stream.send_eof()
        # The read task discards from now on, and closes when done (run's end calls here).
        if self._receiving is not None:
            self._receiving.deadline = self._linger_until
        if self._feeding is not None and trio.lowlevel.current_task() is not self._reader:
            # Paused inside the protocol (a pipelined request waiting): nothing more of the
            # client's is read as requests.
            self._feeding.cancel()


async def _discard_until(stream: Any, deadline: float) -> None:
    with trio.move_on_at(deadline):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while await stream.receive_some(MAX_RECV):
                pass


async def close_gracefully(stream: Any, linger: float = LINGER_SECONDS) -> None:
    """Close ``stream`` after an answer as RFC 9112 9.6 says (see ConnectionServer._close),
    when nothing else reads it."""
    try:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_eof()
        await _discard_until(stream, trio.current_time() + linger)
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


class ConnectionSet:
    """The live client connections of one server: drained together when the graceful shutdown
    begins, and dropped at its deadline (a client that stops reading would otherwise hold its
    task, and the server's shutdown, until it reads)."""

    def __init__(self) -> None:
        self._servers: weakref.WeakSet[ConnectionServer] = weakref.WeakSet()
        # The connections waiting for a request's head (either server's wait), ended when
        # the drain begins.
        self._idle: set[trio.CancelScope] = set()
        self.draining = False

    def add(self, server: ConnectionServer) -> None:
        self._servers.add(server)
        if self.draining:
            server.connection_state.drain()

    def add_idle(self, scope: trio.CancelScope) -> bool:
        """A connection's wait for its next request, to be cancelled when the drain begins;
        False (nothing to wait for) if it has."""
        if self.draining:
            return False
        self._idle.add(scope)
        return True

    def discard_idle(self, scope: trio.CancelScope) -> None:
        self._idle.discard(scope)

    def drain(self) -> None:
        """The graceful shutdown has begun: idle connections close now, busy ones after their
        answer, which says ``connection: close``."""
        self.draining = True
        for server in list(self._servers):
            server.connection_state.drain()
        for scope in list(self._idle):
            scope.cancel()
        self._idle.clear()

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


class ClosingConnection(h11.Connection):
    """h11's server connection, except that nothing a client sends after a request that closes
    the connection (its own ``Connection: close``, or ours) is read: RFC 9112 9.6 says such
    bytes are not requests. h11 would fail on them (data after MUST_CLOSE), and hypercorn then
    answer 400 in place of the answer in progress, or cut it. The bytes are still taken off
    the socket (and dropped), so the close that follows sends no RST."""

    def receive_data(self, data: bytes) -> None:
        if data and self.their_state is h11.MUST_CLOSE:
            return
        super().receive_data(data)

    def next_event(self) -> Any:
        if self.their_state is h11.MUST_CLOSE and self.trailing_data[0]:
            # What came in the same read as the closing request.
            return h11.NEED_DATA
        return super().next_event()


class FramingCheckedProtocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, refusing requests whose framing RFC 9112 forbids: both
    Content-Length and Transfer-Encoding (a smuggling attempt; h11 accepts it), or chunked on
    HTTP/1.0. The answer is a 400 with ``Connection: close``, and nothing after it on the
    connection is read: bytes smuggled after such a request are never answered. Each request
    it reads counts in the connection's state (shared with the fast path), and nothing sent
    after a closing request is read (:class:`ClosingConnection`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if adapters.usable("closing_reads"):
            self.connection = ClosingConnection(
                h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size
            )
        # The connection's state, shared with the fast path (hypercorn's own
        # ``connection_state`` is another thing: the ASGI scope's state).
        server = getattr(self.send, "__self__", None)
        self._shared_state: ConnectionState | None = (
            server.connection_state if isinstance(server, ConnectionServer) else None
        )

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
            if self._shared_state is not None:
                # Before the app runs: its answer's head reads whether it is the last.
                self._shared_state.request_received(
                    keeps_alive(request.headers, request.http_version)
                )
            await super()._create_stream(request)
            return
        error = bad_request(f"Bad request framing: {problem}.", code="invalid_framing")
        body = error.body()
        headers = header_block(
            400,
            [("Content-Type", "application/json")],
            None,
            length=len(body),
            closes=True,
            server=self.config.response_headers("h11"),
        )
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
