"""The Anthropic Messages shapes (proxy/protocol/anthropic.py), sans-IO: request validation,
the mapping to chat-completions terms for the local model, the Anthropic error shape, and every
event and body held against the official anthropic SDK's own models, one by one and through its
real client and stream helper (over an in-memory transport, no sockets)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

from proxy.protocol.anthropic import (
    MessagesStream,
    anthropic_error_body,
    anthropic_error_type,
    is_terminal_event,
    parse_messages_request,
    stop_reason,
    whole_message,
)
from proxy.protocol.errors import ApiError

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
BASE: dict[str, Any] = {
    "model": "m",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "hi"}],
}


def events_of(wire: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event field, data object) of each event, parsed as an SSE client would."""
    assert wire.endswith(b"\n\n")
    parsed = []
    for block in wire.split(b"\n\n")[:-1]:
        fields = dict(line.split(b": ", 1) for line in block.split(b"\n"))
        assert set(fields) == {b"event", b"data"}
        parsed.append((fields[b"event"].decode(), json.loads(fields[b"data"])))
    return parsed


def split_events(wire: bytes) -> list[bytes]:
    """Each event with its delimiter, as the proxy's SSESplitter hands them on."""
    return [block + b"\n\n" for block in wire.split(b"\n\n")[:-1]]


def full_stream(
    deltas: list[str],
    finish_reason: str = "stop",
    stop_sequence: str | None = None,
    error: ApiError | None = None,
) -> bytes:
    stream = MessagesStream(model="local-model", message_id="msg_abc")
    wire = stream.start(prompt_tokens=9)
    for delta in deltas:
        wire += stream.text(delta)
    if error is not None:
        return wire + stream.error(error)
    return wire + stream.finish(finish_reason, len(deltas), stop_sequence)


def sdk_client(body: bytes, content_type: str) -> anthropic.Anthropic:
    def handler(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/messages"
        return httpx2.Response(200, headers={"content-type": content_type}, content=body)

    return anthropic.Anthropic(
        base_url="http://sluice.test",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"model": ["m"]}, "model"),
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "64"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"messages": None}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [3]}]},
            "messages[1].content[0]",
        ),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
        ),
        ({"system": 5}, "system"),
        ({"system": ["x"]}, "system[0]"),
        ({"system": [{"type": "image", "source": {}}]}, "system[0]"),
        ({"system": [{"type": "text", "text": "a"}, {"type": "text"}]}, "system[1]"),
        ({"stream": "no"}, "stream"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": ["END", 3]}, "stop_sequences"),
        ({"temperature": "warm"}, "temperature"),
        ({"top_p": False}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
    ],
)
def test_invalid_requests_name_their_param(change: dict[str, Any], param: str) -> None:
    body = {**BASE, **change}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(ApiError) as caught:
        parse_messages_request(body)
    error = caught.value
    assert error.status == 400
    assert error.param == param
    # Rendered in the Anthropic shape by the endpoint.
    assert json.loads(anthropic_error_body(error))["error"]["type"] == "invalid_request_error"


def test_valid_request_keeps_the_whole_body() -> None:
    body = {
        **BASE,
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "url"}}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]},
        ],
        "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "stream": True,
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_p": 1,
        "top_k": 0,
        "tools": [{"name": "f", "input_schema": {}}],
    }
    request = parse_messages_request(body)
    assert (request.model, request.stream, request.body) == ("m", True, body)
    assert parse_messages_request(BASE).stream is False
    assert parse_messages_request({**BASE, "stream": None}).stream is False


# --- mapping for the local model ----------------------------------------------------------


def test_chat_messages() -> None:
    request = parse_messages_request(
        {
            **BASE,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
        }
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "a\nb"},
    ]
    blocks = parse_messages_request(
        {**BASE, "system": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}
    )
    assert blocks.chat_messages()[0] == {"role": "system", "content": "x\ny"}
    assert parse_messages_request(BASE).chat_messages() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("content", "named"),
    [
        ([{"type": "text", "text": "see"}, {"type": "image", "source": {}}], "image"),
        (
            [{"type": "text", "text": "r"}, {"type": "tool_result", "tool_use_id": "t"}],
            "tool_result",
        ),
        ([{"type": "text", "text": "d"}, {"type": "document", "source": {}}], "document"),
    ],
)
def test_chat_messages_refuse_what_a_text_model_cannot_take(
    content: list[dict[str, Any]], named: str
) -> None:
    request = parse_messages_request(
        {
            **BASE,
            "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": content}],
        }
    )
    with pytest.raises(ApiError) as caught:
        request.chat_messages()
    assert caught.value.status == 400
    assert caught.value.param == "messages[1].content[1]"
    assert named in caught.value.message


def test_sampling_body() -> None:
    request = parse_messages_request(
        {**BASE, "temperature": 0.3, "top_p": 0.8, "top_k": 5, "stop_sequences": ["END"]}
    )
    assert request.sampling_body() == {
        "max_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.8,
        "stop": ["END"],
    }
    assert parse_messages_request(BASE).sampling_body() == {"max_tokens": 64}


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
        (502, "api_error"),
        (504, "api_error"),
        (422, "invalid_request_error"),
    ],
)
def test_error_body_for_each_status(status: int, kind: str) -> None:
    body = anthropic_error_body(ApiError(status, "why it failed", code="some_code"))
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": kind, "message": "why it failed"},
    }
    assert anthropic_error_type(status) == kind
    if kind != "request_too_large":
        # The SDK's error union has no request_too_large (the API documents it for 413, sent
        # by its edge before any server), so that one is checked by value above only.
        parsed = ErrorResponse.model_validate_json(body)
        assert (parsed.error.type, parsed.error.message) == (kind, "why it failed")


# --- the stream ---------------------------------------------------------------------------


def test_stream_events_are_the_sdks_own() -> None:
    deltas = ["Hel", "lo, ", 'wörld "quoted"\n', "🙂"]
    events = events_of(full_stream(deltas))
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * len(deltas),
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for kind, data in events:
        assert data["type"] == kind
        if kind == "ping":
            assert data == {"type": "ping"}  # not in the SDK's union: it skips pings
        else:
            assert EVENTS.validate_python(data).type == kind
    start = EVENTS.validate_python(events[0][1])
    assert start.message.id == "msg_abc"
    assert start.message.model == "local-model"
    assert start.message.usage.input_tokens == 9
    assert start.message.content == []
    assert [
        data["delta"]["text"] for kind, data in events if kind == "content_block_delta"
    ] == deltas
    delta = EVENTS.validate_python(events[-2][1])
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("end_turn", None)
    assert delta.usage.output_tokens == 4


def test_stream_through_the_sdk_client_and_stream_helper() -> None:
    wire = full_stream(["Once", " upon", " a time"])
    with sdk_client(wire, "text/event-stream") as client:
        raw = list(client.messages.create(model="m", max_tokens=8, messages=[], stream=True))
        assert raw[0].type == "message_start"
        assert raw[-1].type == "message_stop"
        with client.messages.stream(model="m", max_tokens=8, messages=[]) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert streamed == "Once upon a time"
    assert isinstance(final, Message)
    assert final.content[0].type == "text"
    assert final.content[0].text == "Once upon a time"
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 3)


@pytest.mark.parametrize(
    ("finish_reason", "stop_sequence", "reason", "sequence"),
    [
        ("length", None, "max_tokens", None),
        ("length", "END", "max_tokens", None),
        ("stop", "END", "stop_sequence", "END"),
        ("stop", None, "end_turn", None),
        ("abort", None, "end_turn", None),
    ],
)
def test_stop_reasons(
    finish_reason: str, stop_sequence: str | None, reason: str, sequence: str | None
) -> None:
    assert stop_reason(finish_reason, stop_sequence) == reason
    wire = full_stream(["x"], finish_reason, stop_sequence)
    delta = EVENTS.validate_python(events_of(wire)[-2][1])
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == (reason, sequence)
    with (
        sdk_client(wire, "text/event-stream") as client,
        client.messages.stream(model="m", max_tokens=8, messages=[]) as stream,
    ):
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == (reason, sequence)
    body = whole_message(
        model="m",
        message_id="msg_1",
        text="x",
        finish_reason=finish_reason,
        prompt_tokens=1,
        completion_tokens=1,
        stop_sequence=stop_sequence,
    )
    message = Message.model_validate_json(body)
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


def test_error_event() -> None:
    wire = full_stream(["partial"], error=ApiError(503, "the model is busy"))
    kind, data = events_of(wire)[-1]
    assert kind == "error"
    parsed = ErrorResponse.model_validate(data)
    assert (parsed.error.type, parsed.error.message) == ("overloaded_error", "the model is busy")
    assert is_terminal_event(split_events(wire)[-1])


def test_error_event_raises_in_the_sdk() -> None:
    wire = full_stream(["partial"], error=ApiError(500, "it broke"))
    with (
        sdk_client(wire, "text/event-stream") as client,
        client.messages.stream(model="m", max_tokens=8, messages=[]) as stream,
        pytest.raises(anthropic.APIStatusError) as caught,
    ):
        stream.get_final_message()
    assert "it broke" in str(caught.value)


def test_text_event_is_cheap_and_identical_to_a_full_encoding() -> None:
    wire = MessagesStream(model="m", message_id="msg_x").text('a "b"\n')
    assert events_of(wire) == [
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": 'a "b"\n'},
            },
        )
    ]


# --- the whole body -----------------------------------------------------------------------


def test_whole_message() -> None:
    body = whole_message(
        model="local-model",
        message_id="msg_w",
        text="Hello 🙂",
        finish_reason="length",
        prompt_tokens=4,
        completion_tokens=2,
    )
    message = Message.model_validate_json(body)
    assert message.id == "msg_w"
    assert message.role == "assistant"
    assert message.model == "local-model"
    assert len(message.content) == 1
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello 🙂"
    assert message.stop_reason == "max_tokens"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (4, 2)
    with sdk_client(body, "application/json") as client:
        through = client.messages.create(model="m", max_tokens=8, messages=[])
    assert through.content[0].type == "text"
    assert through.content[0].text == "Hello 🙂"


# --- terminal events (the upstream relay) -------------------------------------------------


def test_terminal_events_of_our_own_streams() -> None:
    events = split_events(full_stream(["a", "error", "message_stop"]))
    assert [is_terminal_event(event) for event in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize(
    "event",
    [
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
        b'event:message_stop\ndata:{"type":"message_stop"}\n\n',
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n',
        b'data: {"type":"message_stop"}\n\n',
        b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "x"}}\n\n',
    ],
)
def test_terminal(event: bytes) -> None:
    assert is_terminal_event(event)


@pytest.mark.parametrize(
    "event",
    [
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"}'
        b',"usage":{"output_tokens":1}}\n\n',
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n',
        b'event: ping\ndata: {"type": "ping"}\n\n',
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"message_stop"}}\n\n',
        b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"error"}}\n\n',
        b"data: [DONE]\n\n",
    ],
)
def test_not_terminal(event: bytes) -> None:
    assert not is_terminal_event(event)
