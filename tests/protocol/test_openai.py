"""OpenAI request parsing, sans-IO: what is accepted, and the 400 body of what is not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.api_request import parse_api_request
from proxy.protocol.errors import ApiError, bad_request, internal_error, model_not_found
from proxy.protocol.openai import Endpoint, models_list, parse_completion_request

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "Once", **fields}).encode()


def assert_bad_request(raw: bytes, endpoint: Endpoint, param: str | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_completion_request(raw, endpoint)
    error = info.value
    assert error.status == 400
    body = error.to_dict()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert json.loads(error.body()) == body
    return error


def test_minimal_chat_request() -> None:
    raw = chat()
    request = parse_completion_request(raw, CHAT)
    assert request.endpoint is CHAT
    assert request.model == "m"
    assert request.stream is False
    assert request.include_usage is False
    assert request.raw is raw
    assert request.body == {"model": "m", "messages": MESSAGES}


@pytest.mark.parametrize("prompt", ["Once", "", ["a", "b"], [1, 2, 3]])
def test_completion_prompts(prompt: Any) -> None:
    request = parse_completion_request(completion(prompt=prompt), COMPLETIONS)
    assert request.endpoint is COMPLETIONS
    assert request.body["prompt"] == prompt


@pytest.mark.parametrize(
    ("fields", "stream", "include_usage"),
    [
        ({"stream": True}, True, False),
        ({"stream": None}, False, False),
        ({"stream": True, "stream_options": {}}, True, False),
        ({"stream": True, "stream_options": None}, True, False),
        ({"stream": True, "stream_options": {"include_usage": True}}, True, True),
        ({"stream": True, "stream_options": {"include_usage": False}}, True, False),
    ],
)
def test_stream_flags(fields: dict[str, Any], stream: bool, include_usage: bool) -> None:
    request = parse_completion_request(chat(**fields), CHAT)
    assert (request.stream, request.include_usage) == (stream, include_usage)


def test_valid_optionals_and_unknown_fields_pass_through() -> None:
    fields = {
        "max_tokens": 1,
        "max_completion_tokens": 5,
        "temperature": 0,
        "top_p": 0.9,
        "presence_penalty": -1.5,
        "frequency_penalty": None,
        "seed": -3,
        "stop": ["\n", "END"],
        "logit_bias": {"50256": -100},
    }
    request = parse_completion_request(completion(**fields), COMPLETIONS)
    assert request.body == {"model": "m", "prompt": "Once", **fields}
    parse_completion_request(chat(stop="x", max_tokens=None, seed=None), CHAT)


def test_utf8_bom_and_non_ascii_are_accepted() -> None:
    raw = "\ufeff".encode() + chat(messages=[{"role": "user", "content": "你好 😀"}])
    assert parse_completion_request(raw, CHAT).body["messages"][0]["content"] == "你好 😀"


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"", "invalid_request"),
        (b"{not json", "invalid_json"),
        (b'{"model": "\xff"}', "invalid_json"),
        (b"[]", "invalid_request"),
        (b'"chat"', "invalid_request"),
        (b"null", "invalid_request"),
    ],
)
def test_body_that_is_not_a_json_object(raw: bytes, code: str) -> None:
    assert assert_bad_request(raw, CHAT, None).code == code


@pytest.mark.parametrize(
    ("raw", "endpoint", "param"),
    [
        (json.dumps({"messages": MESSAGES}).encode(), CHAT, "model"),
        (chat(model=None), CHAT, "model"),
        (chat(model=""), CHAT, "model"),
        (chat(model=7), CHAT, "model"),
        (chat(stream="true"), CHAT, "stream"),
        (chat(stream=1), CHAT, "stream"),
        (json.dumps({"model": "m"}).encode(), CHAT, "messages"),
        (chat(messages=[]), CHAT, "messages"),
        (chat(messages="hi"), CHAT, "messages"),
        (chat(messages=[{"content": "hi"}]), CHAT, "messages[0]"),
        (chat(messages=[*MESSAGES, "hi"]), CHAT, "messages[1]"),
        (chat(messages=[{"role": 1}]), CHAT, "messages[0]"),
        (chat(), COMPLETIONS, "prompt"),
        (completion(prompt=None), COMPLETIONS, "prompt"),
        (completion(prompt=5), COMPLETIONS, "prompt"),
        (completion(prompt={"text": "x"}), COMPLETIONS, "prompt"),
        (completion(max_tokens=0), COMPLETIONS, "max_tokens"),
        (completion(max_tokens=-1), COMPLETIONS, "max_tokens"),
        (completion(max_tokens=1.5), COMPLETIONS, "max_tokens"),
        (completion(max_tokens=True), COMPLETIONS, "max_tokens"),
        (completion(max_tokens="10"), COMPLETIONS, "max_tokens"),
        (chat(max_completion_tokens=0), CHAT, "max_completion_tokens"),
        (chat(temperature="hot"), CHAT, "temperature"),
        (chat(temperature=True), CHAT, "temperature"),
        (chat(top_p=[1]), CHAT, "top_p"),
        (chat(presence_penalty="0"), CHAT, "presence_penalty"),
        (chat(frequency_penalty=False), CHAT, "frequency_penalty"),
        (chat(seed=1.5), CHAT, "seed"),
        (chat(seed=True), CHAT, "seed"),
        (chat(stop=5), CHAT, "stop"),
        (chat(stop=["a", 1]), CHAT, "stop"),
        (chat(stream=True, stream_options="usage"), CHAT, "stream_options"),
        (chat(stream_options={"include_usage": True}), CHAT, "stream_options"),
        (chat(stream=False, stream_options={}), CHAT, "stream_options"),
        (
            chat(stream=True, stream_options={"include_usage": "yes"}),
            CHAT,
            "stream_options.include_usage",
        ),
    ],
)
def test_invalid_request_names_the_param(raw: bytes, endpoint: Endpoint, param: str) -> None:
    error = assert_bad_request(raw, endpoint, param)
    assert param.split(".")[0].split("[")[0] in error.message


def test_deeply_nested_json_is_a_400() -> None:
    depth = 100_000  # 200 kB: well under the default 4 MiB body limit
    content = b"[" * depth + b"]" * depth
    raw = b'{"model": "m", "messages": [{"role": "user", "content": ' + content + b"}]}"
    assert_bad_request(raw, CHAT, None)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_number_literals_are_rejected(literal: bytes) -> None:
    raw = b'{"model": "m", "prompt": "x", "temperature": ' + literal + b"}"
    assert assert_bad_request(raw, COMPLETIONS, None).code == "invalid_json"


def test_error_helpers() -> None:
    error = bad_request("nope", param="x")
    assert (error.status, error.code, error.param) == (400, "invalid_request", "x")
    missing = model_not_found("gpt-9")
    assert missing.status == 404 and missing.to_dict()["error"]["code"] == "model_not_found"
    assert "gpt-9" in missing.message and missing.param == "model"
    internal = internal_error()
    assert internal.status == 500 and internal.to_dict()["error"]["type"] == "server_error"


def test_models_list() -> None:
    assert models_list([]) == {"object": "list", "data": []}
    listing = models_list(["a", "b/c"])
    assert [model["id"] for model in listing["data"]] == ["a", "b/c"]
    assert all(model["object"] == "model" for model in listing["data"])
    json.dumps(listing)


def test_a_websocket_message_is_a_streamed_chat_request_with_its_usage() -> None:
    """A chat message sent on the WebSocket: its own ``type`` dropped, always streamed, the
    usage asked for unless it says otherwise; parsed as every request is, with the same 400s."""
    request = parse_api_request(
        b'{"type": "chat", "model": "m", "messages": [{"role": "user", "content": "hi"}]}',
        Endpoint.CHAT,
        message=True,
    )
    assert (request.endpoint, request.model, request.stream) == (Endpoint.CHAT, "m", True)
    assert request.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert json.loads(request.raw) == request.body
    chosen = parse_api_request(
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
        b'"stream": false, "stream_options": {"include_usage": false}}',
        Endpoint.CHAT,
        message=True,
    )
    assert chosen.stream and chosen.body["stream_options"] == {"include_usage": False}
    with pytest.raises(ApiError) as refused:
        parse_api_request(b"[1]", Endpoint.CHAT, message=True)
    assert refused.value.status == 400 and "Message" in refused.value.message
