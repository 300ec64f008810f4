"""``/v1/ws``: chat over a WebSocket, through the same backends as the HTTP relay.

The client sends a chat request as JSON (the body of ``POST /v1/chat/completions``; ``stream``
is implied). The server answers with ``{"type": "token", "content": ...}`` messages, then
``{"type": "done", "finish_reason", "usage"}``. ``{"type": "cancel"}`` stops the current
generation and keeps the socket open for the next request; closing the socket cancels
whatever runs. Bad input gets ``{"type": "error", "error": {...}}`` and the socket stays
usable. One generation at a time per socket.

Each generation runs in its own nursery under a cancel scope owned by the socket's handler: the
producer (upstream stream or local worker thread) writes SSE events into a bounded channel
exactly as for HTTP, and a consumer turns them into WebSocket messages. A slow reader fills the
channel and pauses the producer; one that stays stalled for ``stall_timeout`` is cut off.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio
from quart import websocket

from proxy.protocol.errors import ApiError, bad_request, model_not_found
from proxy.protocol.openai import Endpoint, parse_completion_request
from proxy.protocol.sse import SSESplitter, is_done
from proxy.relay.body import ClientStalled, offer_to, send_within

if TYPE_CHECKING:
    from proxy.api.app import SluiceState
    from proxy.config import Config

log = logging.getLogger("sluice.ws")

# The close code for a client cut off for not reading (RFC 6455 "policy violation").
_STALLED_CLOSE = 1008


def _message(kind: str, request_id: str, **fields: Any) -> str:
    return json.dumps({"type": kind, "id": request_id, **fields}, ensure_ascii=False)


def _error_message(request_id: str, error: ApiError) -> str:
    return _message("error", request_id, error=error.to_dict()["error"], status=error.status)


class WebSocketSink:
    """The Sink a producer writes to for a WebSocket client: the same contract as RelaySink
    (head once, then chunks into a bounded channel with a stall limit)."""

    def __init__(self, capacity: int, stall_timeout: float) -> None:
        self.send_channel, self.receive_channel = trio.open_memory_channel[bytes](capacity)
        self.stall_timeout = stall_timeout
        self.status: int | None = None
        self.close_callbacks: list[Any] = []

    @property
    def started(self) -> bool:
        return self.status is not None

    @property
    def client_gone(self) -> bool:
        return False  # a WebSocket's close (or cancel message) cancels the producer directly

    def set_phase(self, phase: str) -> None:
        pass

    def on_close(self, callback: Any) -> None:
        self.close_callbacks.append(callback)

    def begin(
        self,
        status: int,
        content_type: str,
        headers: Mapping[str, str] | None = None,
        *,
        content_length: int | None = None,
    ) -> None:
        self.status = status

    def offer(self, chunk: bytes) -> bool:
        return offer_to(self.send_channel, chunk)

    def on_disconnect(self, callback: Any) -> None:
        pass  # a WebSocket's close (or cancel message) cancels the producer directly

    async def send(self, chunk: bytes) -> None:
        await send_within(self.send_channel, chunk, self.stall_timeout)


class _Translator:
    """SSE events (OpenAI chunks) in, WebSocket messages out."""

    def __init__(self, request_id: str, max_event_bytes: int) -> None:
        self.request_id = request_id
        self.splitter = SSESplitter(max_event_bytes)
        self.finish_reason: str | None = None
        self.usage: Any = None

    def messages(self, chunk: bytes) -> list[str]:
        out = []
        for event in self.splitter.feed(chunk):
            if is_done(event):
                out.append(
                    _message(
                        "done",
                        self.request_id,
                        finish_reason=self.finish_reason,
                        usage=self.usage,
                    )
                )
                continue
            if not event.startswith(b"data:"):
                continue
            try:
                payload = json.loads(event[5:])
            except ValueError:
                continue
            if "error" in payload:
                out.append(_message("error", self.request_id, error=payload["error"]))
                continue
            if payload.get("usage"):
                self.usage = payload["usage"]
            for choice in payload.get("choices") or ():
                delta = choice.get("delta") or {}
                content = delta.get("content") or choice.get("text")
                if content:
                    out.append(_message("token", self.request_id, content=content))
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        return out


async def serve_websocket(state: SluiceState) -> None:
    """The handler of one WebSocket connection (``state`` is the app's SluiceState)."""
    if state.keys.enabled:
        try:
            state.keys.identify(websocket.headers.get("Authorization"))
        except ApiError as error:
            await websocket.accept()
            await websocket.send(_error_message("", error))
            await websocket.close(4401)
            return
    await websocket.accept()
    config = state.config
    async with trio.open_nursery() as nursery:
        current: list[trio.CancelScope] = []  # the running generation's scope, if any
        while True:
            raw = await websocket.receive()
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            try:
                message = json.loads(text)
            except ValueError:
                await websocket.send(
                    _error_message("", bad_request("Message is not JSON.", code="invalid_json"))
                )
                continue
            if isinstance(message, dict) and message.get("type") == "cancel":
                for scope in current:
                    scope.cancel()
                continue
            if current:
                await websocket.send(
                    _error_message(
                        "",
                        ApiError(
                            409,
                            "A generation is already running on this socket; send "
                            '{"type": "cancel"} first or wait for "done".',
                            code="request_in_progress",
                        ),
                    )
                )
                continue
            scope = trio.CancelScope()
            current.append(scope)
            nursery.start_soon(_generate, state, config, text, scope, current)


async def _generate(
    state: SluiceState,
    config: Config,
    text: str,
    scope: trio.CancelScope,
    current: list[trio.CancelScope],
) -> None:
    request_id = uuid.uuid4().hex
    try:
        with scope:
            await _run_generation(state, config, text, request_id)
        if scope.cancelled_caught:
            await websocket.send(_message("cancelled", request_id))
    finally:
        current.remove(scope)


async def _run_generation(state: SluiceState, config: Config, text: str, request_id: str) -> None:
    try:
        body = json.loads(text)
        if isinstance(body, dict):
            body.pop("type", None)
            body["stream"] = True
            body.setdefault("stream_options", {"include_usage": True})
        raw = json.dumps(body).encode()
        request = parse_completion_request(raw, Endpoint.CHAT)
        backend = state.backends.get(request.model)
        if backend is None:
            raise model_not_found(request.model)
    except ApiError as error:
        await websocket.send(_error_message(request_id, error))
        return
    sink = WebSocketSink(config.relay.channel_capacity, config.relay.stall_timeout)
    translator = _Translator(request_id, config.relay.max_event_bytes)
    failure: ApiError | None = None
    stalled = False

    async def produce() -> None:
        nonlocal failure, stalled
        async with sink.send_channel:
            try:
                await backend.produce(request, request_id, sink)
            except ApiError as error:
                failure = error
            except ClientStalled:
                stalled = True

    error_body = b""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            async with sink.receive_channel:
                async for chunk in sink.receive_channel:
                    if sink.status != 200:
                        error_body += chunk  # an upstream's own 4xx, passed through
                        continue
                    for message in translator.messages(chunk):
                        await websocket.send(message)
    finally:
        for callback in sink.close_callbacks:
            callback()
    if stalled:
        log.warning("websocket client stalled for %.1fs; closing", sink.stall_timeout)
        await websocket.close(_STALLED_CLOSE)
    elif failure is not None:
        await websocket.send(_error_message(request_id, failure))
    elif sink.status is not None and sink.status != 200:
        try:
            passed: Any = json.loads(error_body)["error"]
        except (ValueError, KeyError, TypeError):
            passed = {"message": error_body.decode("utf-8", "replace"), "type": "upstream_error"}
        await websocket.send(_message("error", request_id, error=passed, status=sink.status))
