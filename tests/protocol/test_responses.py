"""The Responses API shapes (proxy/protocol/responses.py), sans-IO: request validation, the
mapping to chat-completions terms for the local model, and every event and body held against
the official openai SDK's own models, both one by one and through its real client and stream
helper (over an in-memory transport, no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from proxy.protocol.errors import ApiError
from proxy.protocol.responses import (
    ResponsesStream,
    is_terminal_event,
    parse_responses_request,
    whole_response,
)

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
BASE: dict[str, Any] = {"model": "m", "input": "hi"}


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
    deltas: list[str], finish_reason: str = "stop", error: ApiError | None = None
) -> bytes:
    stream = ResponsesStream(model="local-model", response_id="resp_abc", created_at=1700000000)
    wire = stream.start()
    for delta in deltas:
        wire += stream.text(delta)
    if error is not None:
        return wire + stream.error(error)
    return wire + stream.finish(finish_reason, prompt_tokens=7, completion_tokens=len(deltas))


def sdk_client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    transport = httpx2.MockTransport(handler)
    return openai.OpenAI(
        base_url="http://sluice.test/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def serving(body: bytes, content_type: str) -> Callable[[httpx2.Request], httpx2.Response]:
    def handler(request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/responses"
        return httpx2.Response(200, headers={"content-type": content_type}, content=body)

    return handler


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": None}, "model"),
        ({"model": ""}, "model"),
        ({"model": 3}, "model"),
        ({"stream": "yes"}, "stream"),
        ({"input": None}, "input"),
        ({"input": 5}, "input"),
        ({"input": {"role": "user", "content": "hi"}}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"type": 5}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"text": "x"}]}]}, "input[0].content[0]"),
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "input_text"}]},
                ]
            },
            "input[1].content[0].text",
        ),
        ({"instructions": 5}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": -3}, "max_output_tokens"),
        ({"max_output_tokens": True}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"max_output_tokens": 2.5}, "max_output_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": True}, "top_p"),
    ],
)
def test_invalid_requests_name_their_param(change: dict[str, Any], param: str) -> None:
    body = {**BASE, **change}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(ApiError) as caught:
        parse_responses_request(body)
    error = caught.value
    assert error.status == 400
    assert error.param == param
    assert error.to_dict()["error"]["type"] == "invalid_request_error"


def test_valid_request_keeps_the_whole_body() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
        ],
        "stream": True,
        "tools": [{"type": "function", "name": "f"}],
        "max_output_tokens": 16,
        "temperature": 0,
        "top_p": 0.5,
    }
    request = parse_responses_request(body)
    # Items a local model cannot take still pass: the upstream relay forwards them.
    assert (request.model, request.stream, request.body) == ("m", True, body)
    assert parse_responses_request({**BASE, "stream": None}).stream is False
    assert parse_responses_request(BASE).stream is False


# --- mapping for the local model ----------------------------------------------------------


def test_chat_messages_from_a_string() -> None:
    request = parse_responses_request({**BASE, "instructions": "Be brief."})
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert parse_responses_request(BASE).chat_messages() == [{"role": "user", "content": "hi"}]


def test_chat_messages_from_items() -> None:
    request = parse_responses_request(
        {
            "model": "m",
            "instructions": "rules",
            "input": [
                {"role": "developer", "content": "dev"},
                {"type": "message", "role": "system", "content": "sys"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "one"},
                        {"type": "input_text", "text": "two"},
                    ],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "answer"}],
                },
                {"role": "user", "content": "again"},
            ],
        }
    )
    assert request.chat_messages() == [
        {"role": "system", "content": "rules"},
        {"role": "system", "content": "dev"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "answer"},
        {"role": "user", "content": "again"},
    ]


@pytest.mark.parametrize(
    ("items", "param", "named"),
    [
        (
            [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
            ],
            "input[1]",
            "function_call_output",
        ),
        (
            [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
            "input[0]",
            "function_call",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "look"},
                        {"type": "input_image", "image_url": "https://x/y.png"},
                    ],
                }
            ],
            "input[0].content[1]",
            "input_image",
        ),
        (
            [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
            "input[0].content[0]",
            "input_file",
        ),
    ],
)
def test_chat_messages_refuse_what_a_text_model_cannot_take(
    items: list[dict[str, Any]], param: str, named: str
) -> None:
    request = parse_responses_request({"model": "m", "input": items})
    with pytest.raises(ApiError) as caught:
        request.chat_messages()
    assert caught.value.status == 400
    assert caught.value.param == param
    assert named in caught.value.message


def test_sampling_body() -> None:
    request = parse_responses_request(
        {**BASE, "max_output_tokens": 32, "temperature": 0.2, "top_p": 0.9, "store": False}
    )
    assert request.sampling_body() == {"max_tokens": 32, "temperature": 0.2, "top_p": 0.9}
    assert parse_responses_request(BASE).sampling_body() == {}
    assert parse_responses_request({**BASE, "temperature": None}).sampling_body() == {}


# --- the stream ---------------------------------------------------------------------------


def test_stream_events_are_the_sdks_own() -> None:
    deltas = ["Hel", "lo, ", 'wörld "quoted"\n', "🙂"]
    events = events_of(full_stream(deltas))
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    for kind, data in events:
        assert data["type"] == kind
        assert EVENTS.validate_python(data).type == kind
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert [data["delta"] for kind, data in events if kind.endswith(".delta")] == deltas

    text = "".join(deltas)
    done = {kind: data for kind, data in events}
    assert done["response.output_text.done"]["text"] == text
    assert done["response.content_part.done"]["part"]["text"] == text
    assert done["response.output_item.done"]["item"]["status"] == "completed"
    response = Response.model_validate(done["response.completed"]["response"])
    assert response.status == "completed"
    assert response.id == "resp_abc"
    assert response.model == "local-model"
    assert response.created_at == 1700000000
    assert response.output_text == text
    assert response.incomplete_details is None
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (7, 4)
    assert response.usage.total_tokens == 11
    created = Response.model_validate(done["response.created"]["response"])
    assert (created.status, created.output, created.usage) == ("in_progress", [], None)
    # Every event that names the message names the same one.
    ids = {data.get("item_id") or data.get("item", {}).get("id") for _, data in events[2:-1]}
    assert ids == {response.output[0].id}


def test_stream_through_the_sdk_client_and_stream_helper() -> None:
    deltas = ["Once", " upon", " a time"]
    wire = full_stream(deltas)
    with sdk_client(serving(wire, "text/event-stream")) as client:
        seen = [event.type for event in client.responses.create(model="m", input="hi", stream=True)]
        assert seen[0] == "response.created"
        assert seen[-1] == "response.completed"
        with client.responses.stream(model="m", input="hi") as stream:
            streamed = "".join(
                event.delta for event in stream if event.type == "response.output_text.delta"
            )
            final = stream.get_final_response()
    assert streamed == "Once upon a time"
    assert final.output_text == "Once upon a time"
    assert final.status == "completed"


def test_length_ends_incomplete() -> None:
    events = events_of(full_stream(["a", "b"], finish_reason="length"))
    kind, data = events[-1]
    assert kind == "response.incomplete"
    response = Response.model_validate(EVENTS.validate_python(data).response.model_dump())
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "ab"
    assert events[-2][1]["item"]["status"] == "incomplete"
    assert is_terminal_event(split_events(full_stream(["a"], finish_reason="length"))[-1])


def test_incomplete_stream_through_the_sdk() -> None:
    wire = full_stream(["cut"], finish_reason="length")
    with sdk_client(serving(wire, "text/event-stream")) as client:
        last = list(client.responses.create(model="m", input="hi", stream=True))[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("status", "code"), [(500, "server_error"), (503, "server_error"), (429, "rate_limit_exceeded")]
)
def test_error_after_start_is_response_failed(status: int, code: str) -> None:
    wire = full_stream(["partial"], error=ApiError(status, "the model went away", code="x"))
    events = events_of(wire)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kind, data = events[-1]
    assert kind == "response.failed"
    event = EVENTS.validate_python(data)
    assert event.type == "response.failed"
    assert event.response.status == "failed"
    assert event.response.error is not None
    assert (event.response.error.code, event.response.error.message) == (
        code,
        "the model went away",
    )
    assert event.response.output_text == "partial"
    assert is_terminal_event(split_events(wire)[-1])


def test_error_before_start_still_opens_the_response() -> None:
    stream = ResponsesStream(model="m", response_id="resp_1")
    events = events_of(stream.error(ApiError(500, "boom")))
    assert events[0][0] == "response.created"
    assert events[-1][0] == "response.failed"
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for _, data in events:
        EVENTS.validate_python(data)


def test_failed_stream_through_the_sdk() -> None:
    wire = full_stream(["half"], error=ApiError(502, "upstream died"))
    with sdk_client(serving(wire, "text/event-stream")) as client:
        last = list(client.responses.create(model="m", input="hi", stream=True))[-1]
        assert last.type == "response.failed"
        with client.responses.stream(model="m", input="hi") as stream:
            assert list(stream)[-1].type == "response.failed"
            # The helper refuses to call a failed response final.
            with pytest.raises(RuntimeError):
                stream.get_final_response()


def test_text_event_is_cheap_and_identical_to_a_full_encoding() -> None:
    stream = ResponsesStream(model="m", response_id="resp_x", created_at=0)
    stream.start()
    wire = stream.text('a "b"')
    kind, data = events_of(wire)[0]
    assert kind == "response.output_text.delta"
    assert data == {
        "type": "response.output_text.delta",
        "item_id": "msg_x",
        "output_index": 0,
        "content_index": 0,
        "logprobs": [],
        "sequence_number": 4,
        "delta": 'a "b"',
    }
    assert events_of(stream.text("c"))[0][1]["sequence_number"] == 5


# --- the whole body -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("finish_reason", "status"), [("stop", "completed"), ("length", "incomplete")]
)
def test_whole_response(finish_reason: str, status: str) -> None:
    raw = whole_response(
        model="local-model",
        response_id="resp_w",
        text="Hello 🙂",
        finish_reason=finish_reason,
        prompt_tokens=3,
        completion_tokens=2,
        created_at=5,
    )
    response = Response.model_validate_json(raw)
    assert response.status == status
    assert response.output_text == "Hello 🙂"
    assert len(response.output) == 1
    assert response.output[0].type == "message"
    assert len(response.output[0].content) == 1
    assert response.created_at == 5
    assert response.usage is not None
    assert response.usage.total_tokens == 5
    if status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.incomplete_details is None


def test_whole_response_through_the_sdk() -> None:
    raw = whole_response(
        model="m",
        response_id="resp_w",
        text="fine",
        finish_reason="stop",
        prompt_tokens=1,
        completion_tokens=1,
    )
    with sdk_client(serving(raw, "application/json")) as client:
        response = client.responses.create(model="m", input="hi")
    assert response.output_text == "fine"
    assert response.usage is not None
    assert response.usage.output_tokens == 1


# --- terminal events (the upstream relay) -------------------------------------------------


def test_terminal_events_of_our_own_streams() -> None:
    events = split_events(full_stream(["a", "error", '"error"']))
    assert [is_terminal_event(event) for event in events] == [False] * (len(events) - 1) + [True]


@pytest.mark.parametrize(
    "event",
    [
        b'event: response.completed\ndata: {"type":"response.completed"}\n\n',
        b'event:response.incomplete\ndata: {"type":"response.incomplete"}\n\n',
        b'event: response.failed\ndata: {"type":"response.failed"}\n\n',
        b'event: error\ndata: {"type":"error","message":"x","sequence_number":3}\n\n',
        b'id: 7\nevent: response.completed\ndata: {"type":"response.completed"}\n\n',
        # Data-only events (no event: line) are read by their type.
        b'data: {"type":"response.completed","sequence_number":9,"response":{}}\n\n',
        b'data: {"type": "response.failed", "response": {}}\n\n',
        b'data: {"type":"error","code":"server_error","message":"m","param":null}\n\n',
        b'data: {"sequence_number":1,\ndata: "type":"response.incomplete"}\n\n',
    ],
)
def test_terminal(event: bytes) -> None:
    assert is_terminal_event(event)


@pytest.mark.parametrize(
    "event",
    [
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"response.completed"}\n\n',
        b'event: response.created\ndata: {"type":"response.created"}\n\n',
        b'event: response.output_item.done\ndata: {"type":"response.output_item.done"}\n\n',
        # A token that is exactly a terminal name, in a data-only delta: decoded, not terminal.
        b'data: {"type":"response.output_text.delta","delta":"error"}\n\n',
        b'data: {"type":"response.output_text.delta","delta":"response.failed"}\n\n',
        b'data: {"type":"response.output_text.delta","delta":"\\"error\\""}\n\n',
        b"data: [DONE]\n\n",
        b'data: not json "error"\n\n',
        b": keep-alive\n\n",
    ],
)
def test_not_terminal(event: bytes) -> None:
    assert not is_terminal_event(event)
