"""Every endpoint's request, parsed once into a :class:`CompletionRequest` (sans-IO).

The endpoints bring their own validation (openai.py, responses.py, anthropic.py); this is the
one place that picks it by endpoint, so the pipeline parses every request, over every
transport, the same way. A pass-through request is parsed only as far as routing needs: its
``model`` (from a JSON body, or a multipart form field) and whether it streams.
"""

from __future__ import annotations

import json
from typing import Any

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

from proxy.protocol.anthropic import parse_messages_request
from proxy.protocol.errors import bad_request
from proxy.protocol.json_body import parse_json_object
from proxy.protocol.openai import (
    UNLIMITED,
    CompletionRequest,
    Endpoint,
    completion_request,
    embeddings_request,
)
from proxy.protocol.responses import parse_responses_request

# Form fields read from a multipart pass-through body: what routing needs, no more.
_ROUTING_FIELDS = frozenset({"model", "stream"})


def parse_api_request(
    raw: bytes,
    endpoint: Endpoint,
    *,
    path: str = "",
    content_type: str = "application/json",
    max_bytes: int = UNLIMITED,
    message: bool = False,
) -> CompletionRequest:
    """Validate a request to ``endpoint``; a 400 :class:`ApiError` if it is not valid.
    ``message``: a WebSocket's chat message (:func:`socket_chat_request`)."""
    if message:
        return socket_chat_request(raw, max_bytes)
    if endpoint is Endpoint.PASSTHROUGH:
        return passthrough_request(raw, path, content_type, max_bytes)
    body = parse_json_object(raw, max_bytes)
    if endpoint in (Endpoint.CHAT, Endpoint.COMPLETIONS):
        return completion_request(body, raw, endpoint)
    if endpoint is Endpoint.EMBEDDINGS:
        return embeddings_request(body, raw)
    if endpoint is Endpoint.RESPONSES:
        responses = parse_responses_request(body)
        return CompletionRequest(
            endpoint, responses.model, responses.stream, False, body, raw, detail=responses
        )
    messages = parse_messages_request(body)
    return CompletionRequest(
        endpoint, messages.model, messages.stream, False, body, raw, detail=messages
    )


def socket_chat_request(raw: bytes, max_bytes: int = UNLIMITED) -> CompletionRequest:
    """A chat request sent as a WebSocket message: the body of ``POST /v1/chat/completions``,
    with a ``type`` of its own (dropped), always streamed, and with the usage in its last
    chunk unless it says otherwise (the socket's ``done`` message carries it)."""
    body = parse_json_object(raw, max_bytes, "Message")
    body.pop("type", None)
    body["stream"] = True
    body.setdefault("stream_options", {"include_usage": True})
    return completion_request(body, json.dumps(body).encode(), Endpoint.CHAT)


def passthrough_request(
    raw: bytes, path: str, content_type: str, max_bytes: int = UNLIMITED
) -> CompletionRequest:
    """A pass-through request: relayed as it came, routed by its ``model`` ("" when it names
    none: the pipeline then routes by the path alone, if one model serves it)."""
    media_type, options = parse_options_header(content_type)
    body: dict[str, Any] = {}
    fields: dict[str, str] = {}
    if media_type == "application/json" or media_type.endswith("+json"):
        body = parse_json_object(raw, max_bytes)
        fields = {name: body[name] for name in _ROUTING_FIELDS if isinstance(body.get(name), str)}
        stream = body.get("stream") is True
    elif media_type == "multipart/form-data":
        fields = _form_fields(raw, options.get("boundary", ""))
        stream = fields.get("stream", "").lower() in ("true", "1")
    else:
        stream = False
    return CompletionRequest(
        Endpoint.PASSTHROUGH,
        fields.get("model", ""),
        stream,
        False,
        body,
        raw,
        path=path,
        content_type=content_type,
    )


def _form_fields(raw: bytes, boundary: str) -> dict[str, str]:
    """The routing fields of a multipart/form-data body, through werkzeug's sans-IO parser."""
    if not boundary:
        raise bad_request("A multipart/form-data body needs a boundary in its Content-Type.")
    # The body is bounded already (max_body_bytes); the decoder only walks it.
    decoder = MultipartDecoder(boundary.encode("latin-1"))
    try:
        decoder.receive_data(raw)
        decoder.receive_data(None)
        fields: dict[str, str] = {}
        name: str | None = None
        parts: list[bytes] = []
        while True:
            event = decoder.next_event()
            if isinstance(event, NeedData | Epilogue):
                return fields
            if isinstance(event, Field):
                name, parts = (event.name if event.name in _ROUTING_FIELDS else None), []
            elif isinstance(event, File):
                name = None  # the payload: relayed, never read here
            elif isinstance(event, Data) and name is not None:
                parts.append(event.data)
                if not event.more_data:
                    fields[name] = b"".join(parts).decode("utf-8", "replace").strip()
    except ValueError as error:
        raise bad_request(f"The multipart/form-data body is malformed: {error}") from None
