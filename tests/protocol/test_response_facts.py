"""What an answer says of itself, read from the bytes a client was sent, without sockets: every
endpoint's shape, streamed and whole, cut events, and the captured text (opt-in)."""

from __future__ import annotations

import json
from typing import Any

from proxy.protocol import response_facts
from proxy.protocol.response_facts import (
    MAX_CAPTURED_CHARS,
    body_facts,
    input_messages,
    output_messages,
    sse_payloads,
    stream_facts,
)


def sse(*events: dict[str, Any], name: str | None = None) -> bytes:
    prefix = b"" if name is None else f"event: {name}\n".encode()
    return b"".join(prefix + b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def chunk(index: int, reason: str | None, text: str = "") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "model": "served-name",
        "choices": [{"index": index, "delta": {"content": text}, "finish_reason": reason}],
    }


def test_a_chat_stream_from_its_first_write_and_its_last_three() -> None:
    first = sse(chunk(0, None, "Hel"))
    finish = sse(chunk(1, "length"), chunk(0, "stop"))
    usage = sse(
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}
    )
    facts = stream_facts(first, finish, usage, b"data: [DONE]\n\n")
    assert facts.attributes() == {
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.model": "served-name",
        # By choice index, whatever order they finished in.
        "gen_ai.response.finish_reasons": ["stop", "length"],
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 9,
    }


def test_the_same_write_passed_twice_is_read_once() -> None:
    only = sse(chunk(0, "stop"))
    facts = stream_facts(only, only, only, only)
    assert facts.finish_reasons == ["stop"]


def test_a_stream_cut_mid_event_says_what_its_whole_events_say() -> None:
    whole = sse(chunk(0, None, "a"))
    cut = b'data: {"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reas'
    facts = stream_facts(whole, cut)
    assert facts.response_id == "chatcmpl-1"
    assert facts.finish_reasons == []
    assert facts.attributes().keys() == {"gen_ai.response.id", "gen_ai.response.model"}
    # Not even an event: nothing known, nothing claimed.
    assert stream_facts(b"", b": keep-alive\n\n").attributes() == {}


def test_an_anthropic_stream() -> None:
    start = sse(
        {
            "type": "message_start",
            "message": {"id": "msg_1", "model": "claude-ish", "usage": {"input_tokens": 12}},
        },
        name="message_start",
    )
    delta = sse(
        {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"output_tokens": 5},
        },
        name="message_delta",
    )
    stop = sse({"type": "message_stop"}, name="message_stop")
    assert stream_facts(start, delta, stop).attributes() == {
        "gen_ai.response.id": "msg_1",
        "gen_ai.response.model": "claude-ish",
        "gen_ai.response.finish_reasons": ["max_tokens"],
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5,
    }


def test_a_responses_stream_that_ended_incomplete() -> None:
    created = sse(
        {
            "type": "response.created",
            "response": {
                "object": "response",
                "id": "resp_1",
                "model": "m",
                "status": "in_progress",
            },
        }
    )
    done = sse(
        {
            "type": "response.incomplete",
            "response": {
                "object": "response",
                "id": "resp_1",
                "model": "m",
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "usage": {"input_tokens": 3, "output_tokens": 8},
            },
        }
    )
    facts = stream_facts(created, done)
    assert facts.finish_reasons == ["max_output_tokens"]
    assert (facts.input_tokens, facts.output_tokens) == (3, 8)


def test_whole_answers_of_every_endpoint() -> None:
    chat = {
        "id": "c",
        "model": "m",
        "choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2},
    }
    message = {
        "type": "message",
        "id": "msg",
        "model": "m",
        "content": [{"type": "text", "text": "x"}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 4, "output_tokens": 6},
    }
    response = {"object": "response", "id": "r", "model": "m", "status": "completed"}
    embeddings = {"object": "list", "model": "e", "data": [], "usage": {"prompt_tokens": 3}}
    assert body_facts(json.dumps(chat).encode()).finish_reasons == ["stop"]
    assert body_facts(json.dumps(message).encode()).output_tokens == 6
    assert body_facts(json.dumps(response).encode()).finish_reasons == ["completed"]
    assert body_facts(json.dumps(embeddings).encode()).attributes() == {
        "gen_ai.response.model": "e",
        "gen_ai.usage.input_tokens": 3,
    }
    # Not JSON, or not an object: nothing.
    assert body_facts(b"<html>").attributes() == {}
    assert body_facts(b"[1, 2]").attributes() == {}


def test_wrong_types_are_ignored_never_raised() -> None:
    odd = {"id": 5, "model": None, "choices": [7, {"finish_reason": 3}], "usage": "many"}
    assert response_facts.facts_of([odd]).attributes() == {}
    assert list(sse_payloads(b'data: [1]\n\ndata: nope\n\ndata: {"a": 1}\n\n')) == [{"a": 1}]
    # Nesting too deep for the parser is not JSON here either: nothing, never a RecursionError.
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert list(sse_payloads(b"data: " + deep + b"\n\n")) == []
    assert body_facts(deep).attributes() == {}


def test_the_prompt_of_each_endpoint() -> None:
    def texts(body: dict[str, Any]) -> list[tuple[str, str]]:
        return [(m["role"], m["parts"][0]["content"]) for m in input_messages(body)]

    chat = {
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    }
    assert texts(chat) == [("system", "be brief"), ("user", "hi")]
    anthropic = {
        "system": [{"type": "text", "text": "be brief"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert texts(anthropic) == [("system", "be brief"), ("user", "hi")]
    assert texts({"instructions": "be brief", "input": "hi"}) == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    assert texts({"prompt": ["a", "b"]}) == [("user", "a"), ("user", "b")]
    (long,) = input_messages({"prompt": "x" * (MAX_CAPTURED_CHARS + 10)})
    assert len(long["parts"][0]["content"]) == MAX_CAPTURED_CHARS + 1


def test_the_answer_text_of_each_shape() -> None:
    def text(answers: list[dict[str, Any]]) -> str:
        (message,) = output_messages(answers)
        assert message["role"] == "assistant"
        return str(message["parts"][0]["content"])

    assert text([chunk(0, None, "Hel"), chunk(0, "stop", "lo")]) == "Hello"
    assert text([{"choices": [{"text": "Hel"}]}, {"choices": [{"text": "lo"}]}]) == "Hello"
    responses = [
        {"type": "response.created", "response": {"object": "response", "output": []}},
        {"type": "response.output_text.delta", "delta": "Hel"},
        {"type": "response.output_text.delta", "delta": "lo"},
        {
            "type": "response.completed",
            "response": {"object": "response", "output": [{"content": [{"text": "Hello"}]}]},
        },
    ]
    assert text(responses) == "Hello"
    anthropic = [
        {"type": "message_start", "message": {"content": []}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"}},
    ]
    assert text(anthropic) == "Hello"
    assert text([{"type": "message", "content": [{"type": "text", "text": "Hello"}]}]) == "Hello"
    assert text([{"object": "response", "output": [{"content": [{"text": "Hello"}]}]}]) == "Hello"
    assert output_messages([chunk(0, "stop")]) == []
