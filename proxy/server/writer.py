"""The one way out: every answer, relayed or plain, on either server, is written here.

A server hands :func:`write_answer` the :class:`~proxy.server.call.Answer` and a :class:`Wire`,
its own way of putting bytes on the client's connection (the fast path's: Sluice's HTTP/1.1
framing on the socket; hypercorn's: h11's framing on the same socket, or ASGI ``send`` where
that is all there is). What every answer gets is decided here, once:

* its head, made by ``protocol.http1_server.header_block`` alone (the answer's headers, a
  relay's, the framing, the server's, and ``connection: close`` when the connection's state
  says the answer is its last: the client asked, ``keep_alive_max_requests``, a drain);
* a relayed stream's head leaves with its first event, in one write (the body asks for it as
  its producer decides a streamed 200 head: :meth:`RelayBody.set_head`);
* the stall limit on every write: a wire's writes are bounded by ``[relay] stall_timeout``, a
  plain answer's as a stream's, and a client that takes nothing for that long is dropped;
* the departure of the client, heard as early as the server can hear it (the loop's hangup
  watcher, the server's read task), which tells the relay (its upstream connection is shut
  down in that step) and cancels the writing;
* a relay's end written after its body has closed, so that what the request held (a key's
  concurrent-stream lease) is released before the client can see its answer end.

How the connection is then closed (RFC 9112 9.6) is the connection server's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from proxy.protocol.http1_server import header_block
from proxy.relay.body import DETACHED, ClientStalled, DirectWriter, RelayBody
from proxy.server.call import Answer

log = logging.getLogger("sluice.writer")


class Wire(Protocol):
    """One answer's way to its client, as one server offers it. Every write it makes is
    bounded by the stall limit and raises :class:`ClientStalled` past it."""

    @property
    def last_answer(self) -> bool:
        """Whether this answer is the connection's last (its head says so)."""
        ...

    def server_headers(self) -> list[tuple[bytes, bytes]]:
        """The server's own response headers (date, server)."""
        ...

    def gone_at(self) -> float | None:
        """When the server saw the client leave; None while it has not."""
        ...

    def abort(self) -> None:
        """Drop the connection (RST): after a stall, or an answer that cannot be finished."""
        ...

    def watching(self, on_gone: Callable[[], bool]) -> AbstractAsyncContextManager[None]:
        """For its duration, call ``on_gone`` as soon as the server sees the client leave
        (once); it returns whether the departure cancels the answer."""
        ...

    def chunked_writer(
        self, status: int, headers: list[tuple[bytes, bytes]]
    ) -> DirectWriter | None:
        """A writer for a chunked body with this head held in it, to leave with the first
        chunk; None where the server frames bodies itself (then :meth:`start`)."""
        ...

    async def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes) -> None:
        """Write the head and the first bytes of the body (b"": none yet)."""
        ...

    async def send(self, chunk: bytes) -> None:
        """Write more of the body."""
        ...

    async def end(self) -> None:
        """Write the end of the answer (a chunked body's last chunk)."""
        ...


async def write_answer(wire: Wire, answer: Answer) -> bool:
    """Write ``answer``; whether all of it went out to a client that is still there (False:
    the connection is not to carry another request)."""
    body = answer.body
    try:
        if isinstance(body, RelayBody):
            return await _write_relay(wire, answer.headers, body)
        return await _write_plain(wire, answer.status, answer.headers, body)
    except Exception as error:
        # As a server does for an app that fails mid-answer: logged, and the connection
        # dropped (an answer begun cannot be taken back). Cancellation passes through.
        log.exception("writing an answer failed", exc_info=error)
        wire.abort()
        return False


async def _write_plain(
    wire: Wire, status: int, headers: list[tuple[str, str]], body: bytes
) -> bool:
    head = header_block(
        status,
        headers,
        None,
        length=len(body),
        closes=wire.last_answer,
        server=wire.server_headers(),
    )
    try:
        await wire.start(status, head, body)
        await wire.end()
    except ClientStalled:
        log.warning("client took nothing of a %d answer; dropped", status)
        wire.abort()
        return False
    return True


class _RelayView:
    """What a relay's body sees of its connection (relay.ClientConnection): the wire, with
    the answer's own headers, so that a head the producer decides is made here too."""

    __slots__ = ("_headers", "_wire")

    def __init__(self, wire: Wire, headers: list[tuple[str, str]]) -> None:
        self._wire = wire
        self._headers = headers

    def head(
        self, status: int, relayed: Mapping[str, str], length: int | None
    ) -> list[tuple[bytes, bytes]]:
        wire = self._wire
        return header_block(
            status,
            self._headers,
            relayed,
            length=length,
            closes=wire.last_answer,
            server=wire.server_headers(),
        )

    def gone_at(self) -> float | None:
        return self._wire.gone_at()

    def abort(self) -> None:
        self._wire.abort()

    def start_stream(self, status: int, headers: Mapping[str, str]) -> DirectWriter | None:
        return self._wire.chunked_writer(status, self.head(status, headers, None))


class _HeldBack:
    """A body the server frames (a known length, or any body over ASGI alone): its head leaves
    with its first bytes, and a known length's last byte only once the body has closed, so
    that what the request held is released before the client can see the answer end. All the
    rest is written while the body is open, within its stall limit."""

    __slots__ = ("_head", "_hold", "_status", "_tail")

    def __init__(self, status: int, head: list[tuple[bytes, bytes]], *, hold: bool) -> None:
        self._status = status
        self._head: list[tuple[bytes, bytes]] | None = head
        self._hold = hold
        self._tail = b""

    async def push(self, wire: Wire, chunk: bytes) -> None:
        if self._hold:
            data = self._tail + chunk
            chunk, self._tail = data[:-1], data[-1:]
        await self._write(wire, chunk)

    async def flush(self, wire: Wire) -> None:
        tail, self._tail = self._tail, b""
        await self._write(wire, tail)

    async def _write(self, wire: Wire, data: bytes) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            await wire.start(self._status, head, data)
        elif data:
            await wire.send(data)


async def _write_relay(wire: Wire, headers: list[tuple[str, str]], body: RelayBody) -> bool:
    view = _RelayView(wire, headers)
    body.attach(view)
    ended = False
    try:
        with trio.CancelScope() as scope:

            def gone() -> bool:
                # Before the cancellation: the upstream connection is shut down in this
                # step, not when the producer's task gets its turn to unwind.
                body.client_disconnected()
                if body.answered:
                    return False  # closing now cancels nothing: what is left is written on
                scope.cancel()
                return True

            async with wire.watching(gone):
                ended, held = await _relay_body(wire, view, body)
                if ended:
                    # After the body has closed (its lease released), as a server writes it
                    # after the app returns.
                    if held is not None:
                        await held.flush(wire)
                    await wire.end()
    except ClientStalled:
        body.stall()
        return False
    finally:
        body.attach(DETACHED)
    return ended and not scope.cancelled_caught


async def _relay_body(
    wire: Wire, view: _RelayView, body: RelayBody
) -> tuple[bool, _HeldBack | None]:
    """Run the relay and write its body; whether its end is to be written (all of it went to
    a client still there), and what of it is held back until then."""
    held: _HeldBack | None = None
    async with body:
        # Set when set_head started the stream: its head is held in it (view.start_stream).
        writer = body.writer
        if writer is None:
            length = body.content_length
            head = view.head(body.status, body.headers, length)
            if length is None:
                writer = wire.chunked_writer(body.status, head)
            if writer is None:
                held = _HeldBack(body.status, head, hold=length is not None)
                # Inside the body: a stall raised out of it would reach the nursery's exit
                # (and come out as an exception group).
                try:
                    async for chunk in body:
                        await held.push(wire, chunk)
                except ClientStalled:
                    body.stall()
        if writer is not None:
            await body.write_through(writer)
    if body.client_gone or body.stalled:
        return False, None
    if body.content_length is not None and not body.complete:
        # A known length the producer did not fill (it failed after the head): the answer
        # cannot be ended, only cut.
        wire.abort()
        return False, None
    return True, held
