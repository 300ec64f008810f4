"""``/v1/ws``: chat over a WebSocket, through the same request pipeline as HTTP.

The client sends a chat request as JSON (the body of ``POST /v1/chat/completions``; ``stream``
is implied). The server answers with ``{"type": "token", "content": ...}`` messages, then
``{"type": "done", "finish_reason", "usage"}``. ``{"type": "cancel"}`` stops the current
generation and keeps the socket open for the next request; closing the socket cancels
whatever runs. Bad input, a refusal (401 at the handshake, 429 from the key's limits) or a
failure gets ``{"type": "error", "error": {...}, "status": N}`` with the codes HTTP uses, and
the socket stays usable. One generation at a time per socket.

This module is the transport only: its reading of messages and its event shapes. Each message
is answered by the one responder (``responder.py``), as an HTTP request is: authenticated with
the handshake's credentials, parsed by the pipeline (``parse``, as a WebSocket message), and
relayed by a :class:`~proxy.relay.RelayBody` (limits, metrics, access line, drain tracking, the
relay's lifetime), iterated here into WebSocket messages. Every write to the client goes
through one :class:`StallGuard`: a reader that takes nothing for ``stall_timeout`` is cut off
and its connection dropped, since the server's writes cannot be cancelled.

The loop that reads the client's messages never waits on a write. When a write fails (the
client reset the connection, or the stall guard dropped it), the server hands the app its
``websocket.disconnect`` from inside that write, under the connection's send lock, through the
app's bounded inbound queue: a reader blocked in a write of its own (a ``request_in_progress``
reply to a client that floods without reading) would never drain that queue, and the write,
the generation waiting on the lock, and its relay would wait forever. So those replies go
through a short backlog written by a task of their own, and a client that does not read them
is not sent more. After a stall everything the session runs is cancelled: nothing may go on
waiting on a connection that has been dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

import trio
from quart import websocket

from proxy.api.responder import WS_METHOD, WS_PATH, Responder
from proxy.ops.logs import AccessRecord
from proxy.protocol.errors import UPSTREAM_ERROR, ApiError, internal_error
from proxy.protocol.sse import SSESplitter, is_done
from proxy.relay.body import DETACHED, RelayBody
from proxy.relay.stall import StallGuard
from proxy.server.asgi import WebSocketConnection, websocket_connection
from proxy.server.call import Answer, Call, HeaderLookup

log = logging.getLogger("sluice.ws")

# The close code after a refused handshake (no valid key): an application code, like 401.
UNAUTHORIZED_CLOSE = 4401
# Replies to messages sent while a generation runs, waiting to be written: a client that sends
# more without reading them is not answered for the rest (see the module's docstring).
NOTICE_BACKLOG = 8


def message(kind: str, request_id: str, **fields: Any) -> str:
    return json.dumps({"type": kind, "id": request_id, **fields}, ensure_ascii=False)


def trace_fields(trace_id: str | None) -> dict[str, str]:
    """What a ``done`` or ``error`` message adds to name its trace: nothing with tracing off."""
    return {} if trace_id is None else {"trace_id": trace_id}


def error_message(request_id: str, error: ApiError, trace_id: str | None = None) -> str:
    return message(
        "error",
        request_id,
        error=error.to_dict()["error"],
        status=error.status,
        **trace_fields(trace_id),
    )


def trace_id_of(access: AccessRecord) -> str | None:
    """The message's trace (tracing on), named in its ``done`` or ``error``."""
    return None if access.trace is None else access.trace.trace_id


def upstream_event_error(detail: str) -> ApiError:
    return ApiError(
        502, f"The upstream sent {detail}.", type=UPSTREAM_ERROR, code="upstream_protocol_error"
    )


class UnrelayableEvent(Exception):
    """An upstream event the translator cannot turn into a message (valid JSON that is not
    an object, or an object of the wrong shape)."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class Translator:
    """SSE events (OpenAI chunks) in, WebSocket messages out. Sans-IO."""

    def __init__(self, request_id: str, max_event_bytes: int, trace_id: str | None = None) -> None:
        self.request_id = request_id
        self._traced = trace_fields(trace_id)
        self.splitter = SSESplitter(max_event_bytes)
        self.finish_reason: str | None = None
        self.usage: Any = None

    def messages(self, chunk: bytes) -> list[str]:
        out = []
        for event in self.splitter.feed(chunk):
            if is_done(event):
                out.append(
                    message(
                        "done",
                        self.request_id,
                        finish_reason=self.finish_reason,
                        usage=self.usage,
                        **self._traced,
                    )
                )
                continue
            if not event.startswith(b"data:"):
                continue
            try:
                payload = json.loads(event[5:])
            except (ValueError, RecursionError):
                raise UnrelayableEvent(upstream_event_error("an event that is not JSON")) from None
            if not isinstance(payload, dict):
                raise UnrelayableEvent(upstream_event_error("an event that is not a JSON object"))
            if "error" in payload:
                out.append(message("error", self.request_id, error=payload["error"]))
                continue
            usage = payload.get("usage")
            if usage:
                self.usage = usage
            choices = payload.get("choices") or []
            if not isinstance(choices, list):
                raise UnrelayableEvent(upstream_event_error("'choices' that is not an array"))
            for choice in choices:
                if not isinstance(choice, dict):
                    raise UnrelayableEvent(upstream_event_error("a choice that is not an object"))
                delta = choice.get("delta")
                content = (delta.get("content") if isinstance(delta, dict) else None) or choice.get(
                    "text"
                )
                if isinstance(content, str) and content:
                    out.append(message("token", self.request_id, content=content))
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        return out


def upstream_error_payload(body: bytes) -> Any:
    """The ``error`` object of an upstream's own error answer, or one made of its text."""
    try:
        passed = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return {"message": body.decode("utf-8", "replace"), "type": "upstream_error"}
    return passed


class WebSocketSession:
    """One client socket: its handshake's headers (each message is a request with them), its
    writes (all under one stall guard), and the generation running on it, if any."""

    def __init__(
        self,
        responder: Responder,
        connection: WebSocketConnection,
        headers: HeaderLookup,
        client: str,
        stall_timeout: float,
    ) -> None:
        self.responder = responder
        # The handshake's: its credentials authenticate every message (in the pipeline a
        # reload last installed), its traceparent is the parent of every message's span, and
        # a model routed by a session header reads it from here.
        self.headers = headers
        self.connection = connection
        self.client = client
        self.guard = StallGuard(stall_timeout, self._stalled)
        self.running: RelayBody | None = None
        self.scope: trio.CancelScope | None = None
        # The scope of everything the session runs (its nursery's), cancelled after a stall.
        self.session_scope: trio.CancelScope | None = None
        self._notices, self._pending_notices = trio.open_memory_channel[str](NOTICE_BACKLOG)

    def call(self, raw: bytes) -> Call:
        """A message, as the request it is. No request id of the client's: the handshake's
        would name every message alike."""
        return Call(WS_METHOD, WS_PATH, self.headers, self.client, body=raw)

    def _stalled(self) -> None:
        log.warning("websocket client took nothing for %.1fs; dropped", self.guard.stall_timeout)
        if self.running is not None:
            self.running.stall()  # its access line says so; it drops the connection
        else:
            self.connection.abort()
        if self.session_scope is not None:
            # A write the drop woke may be waiting to hand the app its disconnect (see the
            # module's docstring): cancelled, it lets the session and its relay end.
            self.session_scope.cancel()

    async def send(self, text: str) -> None:
        await self.guard.write(websocket.send, text)

    def notify(self, text: str) -> None:
        """Send ``text`` without waiting: into the backlog :meth:`write_notices` writes, or
        nowhere if it is full (the client has not read what it was sent)."""
        with contextlib.suppress(trio.WouldBlock):
            self._notices.send_nowait(text)

    async def write_notices(self) -> None:
        async for text in self._pending_notices:
            await self.send(text)

    def busy(self) -> None:
        """A message sent while a generation runs: a request of its own, refused."""
        error = ApiError(
            409,
            'A generation is already running on this socket; send {"type": "cancel"} first '
            'or wait for "done".',
            code="request_in_progress",
        )
        access = self.responder.refuse(self.call(b""), error).access
        assert access is not None
        self.notify(error_message(access.request_id, error, trace_id_of(access)))

    def cancel(self) -> None:
        """The client's ``{"type": "cancel"}``: the upstream is shut down now, as for a
        client that leaves, and the generation's scope is cancelled."""
        if self.running is not None:
            self.running.client_disconnected()
        if self.scope is not None:
            self.scope.cancel()

    async def generate(self, raw: bytes, *, task_status: trio.TaskStatus[None]) -> None:
        scope = self.scope = trio.CancelScope()
        task_status.started()
        access: AccessRecord | None = None
        try:
            with scope:
                # The one responder, as for HTTP: authenticated, parsed and relayed (or
                # refused) by the same pipeline. A message carries its body: no wait here.
                answer = await self.responder.respond(self.call(raw))
                access = answer.access
                assert access is not None
                try:
                    await self._write(answer, access)
                except Exception:
                    # The boundary of one request, as for HTTP: a bug is this request's error
                    # message, never a closed socket. trio.Cancelled passes through.
                    log.exception("websocket generation failed: %s", access.request_id)
                    await self.send(
                        error_message(access.request_id, internal_error(), trace_id_of(access))
                    )
            if scope.cancelled_caught and not self.guard.stalled and access is not None:
                await self.send(message("cancelled", access.request_id))
        finally:
            self.scope = None
            self.running = None

    async def _write(self, answer: Answer, access: AccessRecord) -> None:
        relay = answer.body
        if not isinstance(relay, RelayBody):
            assert answer.error is not None  # a refusal, before any relay
            await self.send(error_message(access.request_id, answer.error, trace_id_of(access)))
            return
        self.running = relay
        translator = Translator(access.request_id, self.max_event_bytes, trace_id_of(access))
        error_body = b""
        unrelayable: ApiError | None = None
        remove_hook = self.connection.on_client_gone(relay.client_disconnected)
        relay.attach(self.connection)
        try:
            async with relay:
                async for chunk in relay:
                    if relay.status != 200:
                        error_body += chunk  # a refusal (429) or an upstream's own 4xx
                        continue
                    try:
                        messages = translator.messages(chunk)
                    except UnrelayableEvent as error:
                        unrelayable = error.error
                        relay.abandon(error.error)
                        break
                    for text in messages:
                        await self.send(text)
        finally:
            remove_hook()
            relay.attach(DETACHED)
        if relay.stalled or self.guard.stalled:
            return
        if unrelayable is not None:
            await self.send(error_message(access.request_id, unrelayable, trace_id_of(access)))
        elif relay.status != 200:
            if relay.error is not None:
                await self.send(error_message(access.request_id, relay.error, trace_id_of(access)))
            else:
                passed = upstream_error_payload(error_body)
                await self.send(
                    message(
                        "error",
                        access.request_id,
                        error=passed,
                        status=relay.status,
                        **trace_fields(trace_id_of(access)),
                    )
                )

    @property
    def max_event_bytes(self) -> int:
        return self.responder.state.pipeline.config.relay.max_event_bytes


async def serve_websocket(responder: Responder, socket: Any) -> None:
    """The handler of one WebSocket connection (``socket``: Quart's ``websocket``)."""
    connection = websocket_connection(socket.scope)
    client = socket.remote_addr or "-"
    headers = socket.headers
    stall_timeout = responder.state.pipeline.config.relay.stall_timeout
    session = WebSocketSession(responder, connection, headers, client, stall_timeout)
    handshake, refusal = await responder.authenticate_session(
        Call(WS_METHOD, WS_PATH, headers, client)
    )
    if refusal is not None:
        await socket.accept()
        async with trio.open_nursery() as nursery:
            session.session_scope = nursery.cancel_scope
            nursery.start_soon(session.guard.watch)
            # Read (and dropped) while the refusal is written, as a session's reader does.
            nursery.start_soon(_discard_messages)
            await session.send(error_message(handshake.request_id, refusal))
            await session.guard.write(socket.close, UNAUTHORIZED_CLOSE)
            nursery.cancel_scope.cancel()
        return
    await socket.accept()
    async with trio.open_nursery() as nursery:
        session.session_scope = nursery.cancel_scope
        nursery.start_soon(session.guard.watch)
        nursery.start_soon(session.write_notices)
        while not session.guard.stalled:
            received = await socket.receive()
            raw = received.encode() if isinstance(received, str) else received
            if session.scope is not None and _is_cancel(raw):
                session.cancel()
                continue
            if session.scope is not None:
                session.busy()
                continue
            if _is_cancel(raw):
                continue  # nothing to cancel
            await nursery.start(session.generate, raw)
        nursery.cancel_scope.cancel()


async def _discard_messages() -> None:
    while True:
        await websocket.receive()


def _is_cancel(raw: bytes) -> bool:
    # Cheap before a full parse: a cancel is a small object with "type": "cancel".
    if len(raw) > 256 or b"cancel" not in raw:
        return False
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and value.get("type") == "cancel"
