"""The body-rewrite step and the answers' renaming, without sockets: a request with no edits
is the client's bytes, an edited JSON body is the same object but for its edits, a form keeps
every byte but the edited field's, and a renamed answer differs only in its "model" members."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

from proxy.protocol.api_request import parse_api_request
from proxy.protocol.openai import Endpoint
from proxy.protocol.rewrite import (
    RenamingSplitter,
    edit_form,
    edit_json,
    model_renamer,
    rewrite_body,
)
from proxy.protocol.sse import SSESplitter

CHAT = {"model": "public", "messages": [{"role": "user", "content": "héllo \U0001f600"}]}


AUDIO = b"RIFF\x00\x01--not-a-boundary"


def form(fields: dict[str, str], audio: bytes = AUDIO) -> tuple[bytes, str]:
    request = httpx.Request(
        "POST", "http://x/", data=fields, files={"file": ("a.wav", audio, "audio/wav")}
    )
    return request.read(), request.headers["content-type"]


def parts(raw: bytes, content_type: str) -> list[tuple[str, str | None, bytes]]:
    """Each part of a form, as werkzeug reads it: (name, filename, data)."""
    boundary = parse_options_header(content_type)[1]["boundary"]
    decoder = MultipartDecoder(boundary.encode())
    decoder.receive_data(raw)
    decoder.receive_data(None)
    found: list[tuple[str, str | None, bytes]] = []
    while True:
        event = decoder.next_event()
        if isinstance(event, NeedData | Epilogue):
            return found
        if isinstance(event, File):
            found.append((event.name, event.filename, b""))
        elif isinstance(event, Field):
            found.append((event.name, None, b""))
        elif isinstance(event, Data):
            name, filename, data = found[-1]
            found[-1] = (name, filename, data + event.data)


def test_no_edits_is_the_client_s_bytes_themselves() -> None:
    raw = b'{ "model" : "public", "messages": [{"role":"user","content":"hi"}] }'
    request = parse_api_request(raw, Endpoint.CHAT)
    assert rewrite_body(request, {}) is raw


@pytest.mark.parametrize(
    "endpoint",
    [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES],
)
def test_a_json_endpoint_s_model_is_replaced_and_nothing_else(endpoint: Endpoint) -> None:
    body: dict[str, Any] = {
        Endpoint.CHAT: CHAT,
        Endpoint.COMPLETIONS: {"model": "public", "prompt": "hi", "max_tokens": 3},
        Endpoint.RESPONSES: {"model": "public", "input": "hi"},
        Endpoint.MESSAGES: {
            "model": "public",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
        },
    }[endpoint]
    raw = json.dumps(body, indent=2).encode()
    request = parse_api_request(raw, endpoint)
    sent = rewrite_body(request, {"model": "org/served-name"})
    assert json.loads(sent) == {**body, "model": "org/served-name"}
    # The parsed body is the request's, for every attempt: untouched.
    assert request.body == body


def test_embeddings_and_a_json_pass_through_are_rewritten_too() -> None:
    embeddings = parse_api_request(b'{"model":"public","input":["a","b"]}', Endpoint.EMBEDDINGS)
    tokenize = parse_api_request(
        b'{"model":"public","prompt":"hi"}', Endpoint.PASSTHROUGH, path="/tokenize"
    )
    assert json.loads(rewrite_body(embeddings, {"model": "up"})) == {
        "model": "up",
        "input": ["a", "b"],
    }
    assert json.loads(rewrite_body(tokenize, {"model": "up"})) == {"model": "up", "prompt": "hi"}


def test_an_untyped_pass_through_body_is_never_edited() -> None:
    raw = b"model=public"
    request = parse_api_request(
        raw, Endpoint.PASSTHROUGH, path="/x", content_type="application/octet-stream"
    )
    assert rewrite_body(request, {"model": "up"}) is raw


def test_nested_edits_create_or_merge_objects_without_touching_the_original() -> None:
    # What the token-budget issue needs: stream_options.include_usage, whatever was there.
    options = {"include_usage": False, "continuous_usage_stats": True}
    body = {"model": "m", "stream": True, "stream_options": options}
    edited = json.loads(edit_json(body, {"stream_options.include_usage": True, "model": "up"}))
    assert edited == {
        "model": "up",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert options == {"include_usage": False, "continuous_usage_stats": True}
    assert json.loads(edit_json({"stream_options": None}, {"stream_options.include_usage": True}))
    assert json.loads(edit_json({}, {"a.b.c": 1})) == {"a": {"b": {"c": 1}}}


def test_an_edited_body_keeps_its_key_order_and_its_text() -> None:
    sent = edit_json(CHAT, {"model": "up"})
    assert list(json.loads(sent)) == ["model", "messages"]
    assert json.loads(sent) == {**CHAT, "model": "up"}
    # A lone surrogate (valid escaped JSON, not encodable as UTF-8) is sent escaped.
    lone = json.loads('{"model": "m", "prompt": "\\ud800"}')
    assert json.loads(edit_json(lone, {"model": "up"})) == {"model": "up", "prompt": "\ud800"}


def test_a_form_s_model_field_is_replaced_and_every_other_byte_kept() -> None:
    raw, content_type = form({"model": "public", "stream": "true"})
    request = parse_api_request(
        raw, Endpoint.PASSTHROUGH, path="/v1/audio/transcriptions", content_type=content_type
    )
    sent = rewrite_body(request, {"model": "org/served-name"})
    before, after = parts(raw, content_type), parts(sent, content_type)
    assert after == [
        ("model", None, b"org/served-name"),
        ("stream", None, b"true"),
        ("file", "a.wav", b"RIFF\x00\x01--not-a-boundary"),
    ]
    assert before[1:] == after[1:]
    assert sent == raw.replace(b"\r\n\r\npublic\r\n", b"\r\n\r\norg/served-name\r\n", 1)
    reparsed = parse_api_request(
        sent, Endpoint.PASSTHROUGH, path="/v1/audio/transcriptions", content_type=content_type
    )
    assert (reparsed.model, reparsed.stream) == ("org/served-name", True)


def test_a_file_part_named_like_the_field_is_not_a_field() -> None:
    request = httpx.Request(
        "POST",
        "http://x/",
        data={"model": "public"},
        files={"model": ("model.bin", b"weights", "application/octet-stream")},
    )
    raw, content_type = request.read(), request.headers["content-type"]
    boundary = parse_options_header(content_type)[1]["boundary"]
    sent = edit_form(raw, boundary, {"model": "up"})
    assert parts(sent, content_type) == [
        ("model", None, b"up"),
        ("model", "model.bin", b"weights"),
    ]


def test_a_missing_form_field_is_added_before_the_closing_delimiter() -> None:
    raw, content_type = form({"stream": "false"})
    boundary = parse_options_header(content_type)[1]["boundary"]
    sent = edit_form(raw, boundary, {"model": "up", "language": "en"})
    assert [(name, data) for name, _, data in parts(sent, content_type)] == [
        ("stream", b"false"),
        ("file", b"RIFF\x00\x01--not-a-boundary"),
        ("model", b"up"),
        ("language", b"en"),
    ]


def test_a_form_with_a_preamble_keeps_it() -> None:
    raw, content_type = form({"model": "public"})
    boundary = parse_options_header(content_type)[1]["boundary"]
    sent = edit_form(b"a preamble\r\n" + raw, boundary, {"model": "up"})
    assert sent.startswith(b"a preamble\r\n--" + boundary.encode())
    assert parts(sent, content_type)[0] == ("model", None, b"up")


@pytest.mark.parametrize(
    ("path", "value"), [("stream_options.include_usage", "true"), ("model", True)]
)
def test_a_form_takes_top_level_text_fields_only(path: str, value: Any) -> None:
    raw, content_type = form({"model": "public"})
    boundary = parse_options_header(content_type)[1]["boundary"]
    with pytest.raises(ValueError, match="top-level text field"):
        edit_form(raw, boundary, {path: value})


def test_no_alias_no_renamer() -> None:
    assert model_renamer("same", "same") is None


@pytest.mark.parametrize(
    "answer",
    [
        # The compact JSON of vLLM (pydantic), Python's default separators, any whitespace.
        {"separators": (",", ":")},
        {"separators": (", ", ": ")},
        {"indent": 2},
        {"ensure_ascii": True},
        {"ensure_ascii": False},
    ],
)
def test_every_model_member_is_renamed_however_the_server_writes_it(answer: Any) -> None:
    upstream, public = 'org/Llamá-3 "8b"', "llama"
    rename = model_renamer(upstream, public)
    assert rename is not None
    body = {
        "id": "x",
        "model": upstream,
        "response": {"model": upstream, "output": []},
        "choices": [{"delta": {"content": f'"model": "{upstream}" said {upstream}'}}],
        "other_model": upstream,
    }
    renamed = json.loads(rename(json.dumps(body, **answer).encode()))
    assert renamed == {
        **body,
        "model": public,
        "response": {"model": public, "output": []},
    }


def test_a_name_that_only_starts_like_the_upstream_s_is_not_renamed() -> None:
    rename = model_renamer("m", "public")
    assert rename is not None
    assert rename(b'{"model":"m2","x":{"model":"m"}}') == b'{"model":"m2","x":{"model":"public"}}'


def test_a_renaming_splitter_renames_whole_events_split_anywhere() -> None:
    rename = model_renamer("upstream-name", "public")
    assert rename is not None
    events = [
        b'data: {"id":"1","model":"upstream-name","choices":[]}\n\n',
        b"event: message_start\n"
        b'data: {"type":"message_start","message":{"model":"upstream-name"}}\n\n',
        b"data: [DONE]\n\n",
    ]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        splitter = RenamingSplitter(1 << 20, rename)
        out = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert out == [event.replace(b"upstream-name", b"public") for event in events]
    plain = SSESplitter()
    assert plain.feed(stream) == events


def test_an_unfinished_last_event_is_renamed_too() -> None:
    rename = model_renamer("up", "public")
    assert rename is not None
    splitter = RenamingSplitter(1 << 20, rename)
    assert splitter.renamed_pending == b""
    assert splitter.feed(b'data: {"model":"up"}\n\ndata: {"model":"up"') == [
        b'data: {"model":"public"}\n\n'
    ]
    assert splitter.renamed_pending == b'data: {"model":"public"'
