"""A paused stream's continuation, sans-IO (proxy.protocol.continuation): what can be paused,
the request that carries the answer on, and its events as the client's one stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.api_request import parse_api_request
from proxy.protocol.continuation import PENDING_BYTES, StreamSplice
from proxy.protocol.openai import CompletionRequest, Endpoint

MESSAGES = [{"role": "user", "content": "tell me a story"}]


def request(endpoint: Endpoint = Endpoint.CHAT, **body: Any) -> CompletionRequest:
    base: dict[str, Any] = {"model": "m", "stream": True}
    if endpoint is Endpoint.CHAT:
        base["messages"] = MESSAGES
    else:
        base["prompt"] = "Once upon a time"
    return parse_api_request(json.dumps(base | body).encode(), endpoint)


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk(
    delta: dict[str, Any], *, ident: str = "chatcmpl-1", created: int = 100, **more: Any
) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None} | more
    return event(
        {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": "m",
            "choices": [choice],
        }
    )


def text_chunk(text: str, **more: Any) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None} | more
    return event(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 100,
            "model": "m",
            "choices": [choice],
        }
    )


def payloads(events: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(e[len(b"data: ") :]) for e in events if not e.startswith(b"data: [DONE]")]


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.CHAT, {"stream": False}),
        (Endpoint.CHAT, {"n": 2}),
        (Endpoint.CHAT, {"response_format": {"type": "json_object"}}),
        (Endpoint.CHAT, {"guided_json": {"type": "object"}}),
        (Endpoint.CHAT, {"continue_final_message": True, "add_generation_prompt": False}),
        (Endpoint.COMPLETIONS, {"echo": True}),
        (Endpoint.COMPLETIONS, {"prompt": ["one", "two"]}),
        (Endpoint.COMPLETIONS, {"prompt": [1, 2, 3]}),
        (Endpoint.COMPLETIONS, {"best_of": 3}),
    ],
)
def test_what_cannot_be_continued_is_never_paused(endpoint: Endpoint, body: dict[str, Any]) -> None:
    assert StreamSplice.of(request(endpoint, **body)) is None


def test_a_plain_stream_can_be_paused_until_its_last_event() -> None:
    splice = StreamSplice.of(request(response_format={"type": "text"}))
    assert splice is not None
    assert splice.pausable()  # nothing sent yet
    splice.delivered(chunk({"role": "assistant", "content": ""}) + chunk({"content": "Once"}))
    assert splice.pausable()
    splice.delivered(chunk({}, finish_reason="stop"))
    assert not splice.pausable()


def test_a_tool_call_or_reasoning_is_not_paused() -> None:
    for delta in ({"tool_calls": [{"index": 0, "id": "t"}]}, {"reasoning_content": "hmm"}):
        splice = StreamSplice.of(request())
        assert splice is not None
        splice.delivered(chunk({"role": "assistant", "content": ""}) + chunk(delta))
        assert not splice.pausable()


def test_the_chat_continuation_sends_the_answer_so_far_as_the_final_assistant_message() -> None:
    splice = StreamSplice.of(request(max_tokens=50, max_completion_tokens=40, temperature=0))
    assert splice is not None
    splice.delivered(chunk({"role": "assistant", "content": ""}))
    splice.delivered(chunk({"content": "Once"}) + chunk({"content": " upon"}))
    splice.paused()
    assert (splice.text, splice.tokens) == ("Once upon", 2)
    body = splice.continuation().body
    assert body["messages"] == [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert (body["max_tokens"], body["max_completion_tokens"]) == (48, 38)
    assert body["temperature"] == 0 and body["stream"] is True


def test_the_completions_continuation_appends_the_text_to_the_prompt() -> None:
    splice = StreamSplice.of(request(Endpoint.COMPLETIONS, max_tokens=10))
    assert splice is not None
    splice.delivered(text_chunk(" there") + text_chunk(" was"))
    splice.paused()
    body = splice.continuation().body
    assert body["prompt"] == "Once upon a time there was"
    assert body["max_tokens"] == 8
    assert "continue_final_message" not in body


def test_with_no_text_sent_the_continuation_is_the_original_request() -> None:
    original = request()
    splice = StreamSplice.of(original)
    assert splice is not None
    splice.paused()
    assert splice.continuation() is original
    # Nothing reached the client: the continuation's events are its stream from the start.
    events = [chunk({"role": "assistant", "content": ""}, ident="other")]
    assert splice.events(events) == events


def test_a_continuation_s_events_carry_the_client_s_stream_on() -> None:
    splice = StreamSplice.of(request(stream_options={"include_usage": True}))
    assert splice is not None
    splice.delivered(chunk({"role": "assistant", "content": ""}) + chunk({"content": "A"}))
    splice.delivered(chunk({"content": "B"}))
    splice.paused()
    later = [
        chunk({"role": "assistant", "content": ""}, ident="chatcmpl-2", created=200),
        chunk({"content": "C"}, ident="chatcmpl-2", created=200),
        chunk({}, ident="chatcmpl-2", created=200, finish_reason="stop"),
        event(
            {
                "id": "chatcmpl-2",
                "object": "chat.completion.chunk",
                "created": 200,
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
            }
        ),
        b"data: [DONE]\n\n",
    ]
    out = splice.events(later)
    # The opening role delta is gone (it carried nothing else); the rest keep the first
    # piece's id and created.
    assert len(out) == 4 and out[-1] == b"data: [DONE]\n\n"
    spliced = payloads(out)
    assert {(p["id"], p["created"]) for p in spliced} == {("chatcmpl-1", 100)}
    assert "role" not in spliced[0]["choices"][0]["delta"]
    # The continuation's prompt held the 2 tokens sent before: the client's prompt is 10, its
    # completion all 5 tokens, and the total the engine's.
    assert spliced[-1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_a_role_delta_with_text_keeps_its_text() -> None:
    splice = StreamSplice.of(request())
    assert splice is not None
    splice.delivered(chunk({"role": "assistant", "content": ""}) + chunk({"content": "A"}))
    splice.paused()
    (out,) = payloads(splice.events([chunk({"role": "assistant", "content": "B"})]))
    assert out["choices"][0]["delta"] == {"content": "B"}


def test_a_second_pause_counts_every_token_sent_before_it() -> None:
    splice = StreamSplice.of(request())
    assert splice is not None
    splice.delivered(chunk({"role": "assistant", "content": ""}) + chunk({"content": "A"}))
    splice.paused()
    splice.events([chunk({"role": "assistant", "content": ""})])
    splice.delivered(chunk({"content": "B"}) + chunk({"content": "C"}))
    splice.paused()
    assert splice.continuation().body["messages"][-1]["content"] == "ABC"
    usage = {"prompt_tokens": 13, "completion_tokens": 2, "total_tokens": 15}
    (out,) = payloads(splice.events([event({"id": "x", "choices": [], "usage": usage})]))
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    assert out["id"] == "chatcmpl-1"


def test_a_long_answer_is_kept_as_its_text_within_a_stated_bound() -> None:
    # 10,000 events of one token each: the splice holds the text (10,000 characters) plus at
    # most PENDING_BYTES of events not read yet, never the events themselves (~1.5 MB).
    splice = StreamSplice.of(request())
    assert splice is not None
    splice.delivered(chunk({"role": "assistant", "content": ""}))
    sent = 0
    most = 0
    for _ in range(10_000):
        one = chunk({"content": "x"})
        sent += len(one)
        splice.delivered(one)
        most = max(most, splice.kept_bytes)
    assert sent > 1_000_000
    assert most <= PENDING_BYTES + 10_000 + 200
    assert splice.pausable()
    splice.paused()
    assert splice.tokens == 10_000
    assert splice.continuation().body["messages"][-1]["content"] == "x" * 10_000
    assert splice.kept_bytes == 10_000


def test_usage_on_every_event_gives_the_exact_count_where_an_event_holds_several_tokens() -> None:
    # An upstream with continuous usage stats that sends three tokens per event: the count is
    # its usage's, so the continuation never asks for more than max_tokens allows.
    splice = StreamSplice.of(request(max_tokens=30))
    assert splice is not None
    for n in range(1, 5):
        usage = {"prompt_tokens": 10, "completion_tokens": 3 * n, "total_tokens": 10 + 3 * n}
        splice.delivered(
            event(
                {
                    "id": "chatcmpl-1",
                    "created": 100,
                    "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "abc"}, "finish_reason": None}],
                    "usage": usage,
                }
            )
        )
    splice.paused()
    assert splice.tokens == 12
    assert splice.continuation().body["max_tokens"] == 18
    # Without usage, one token per content event: 4 here, and the bound the docs state.
    counted = StreamSplice.of(request(max_tokens=30))
    assert counted is not None
    for _ in range(4):
        counted.delivered(chunk({"content": "abc"}))
    counted.paused()
    assert counted.continuation().body["max_tokens"] == 26
