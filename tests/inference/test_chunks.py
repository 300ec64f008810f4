"""ChunkFormatter: every event is one SSE ``data:`` line of JSON in the exact OpenAI shape."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.chunks import DONE, ChunkFormatter, Usage

HEAD_CHAT = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700, "model": "m"}
HEAD_TEXT = {"id": "cmpl-1", "object": "text_completion", "created": 1700, "model": "m"}

# Any text the detokenizer can produce: all of Unicode but lone surrogates; quotes, backslashes,
# newlines, control characters, U+2028 and emoji included.
_texts = st.text(st.characters(exclude_categories=["Cs"])) | st.sampled_from(
    ['"', "\\", "\n\n", "\r\n", "data: x\n\n", "\u2028\u2029", "中文😀", "\x00\x1f"]
)


def chat() -> ChunkFormatter:
    return ChunkFormatter(chat=True, model="m", response_id="chatcmpl-1", created=1700)


def text() -> ChunkFormatter:
    return ChunkFormatter(chat=False, model="m", response_id="cmpl-1", created=1700)


def parse(event: bytes) -> Any:
    """One SSE event: ``data: <json>`` and a blank line, no other line break anywhere."""
    assert event.startswith(b"data: ")
    assert event.endswith(b"\n\n")
    payload = event[len(b"data: ") : -2]
    assert b"\n" not in payload
    assert b"\r" not in payload
    return json.loads(payload.decode())


@settings(max_examples=100, deadline=None)
@given(content=_texts)
def test_chat_text_chunk_round_trips(content: str) -> None:
    assert parse(chat().text(content)) == {
        **HEAD_CHAT,
        "choices": [
            {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}
        ],
    }


@settings(max_examples=100, deadline=None)
@given(content=_texts)
def test_completion_text_chunk_round_trips(content: str) -> None:
    assert parse(text().text(content)) == {
        **HEAD_TEXT,
        "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": None}],
    }


def test_role_chunk() -> None:
    assert parse(chat().role()) == {
        **HEAD_CHAT,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }


def test_chat_finish_chunk_has_an_empty_delta() -> None:
    for reason in ("stop", "length"):
        assert parse(chat().finish(reason)) == {
            **HEAD_CHAT,
            "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}],
        }


def test_completion_finish_chunk_has_empty_text() -> None:
    assert parse(text().finish("length")) == {
        **HEAD_TEXT,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
    }


def test_usage_chunk_has_no_choices_and_a_total() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    assert parse(chat().usage(Usage(7, 5))) == {**HEAD_CHAT, "choices": [], "usage": usage}
    assert parse(text().usage(Usage(7, 5))) == {**HEAD_TEXT, "choices": [], "usage": usage}


@settings(max_examples=50, deadline=None)
@given(content=_texts)
def test_whole_chat_body(content: str) -> None:
    body = json.loads(chat().whole(content, "stop", Usage(3, 4)).decode())
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


@settings(max_examples=50, deadline=None)
@given(content=_texts)
def test_whole_completion_body(content: str) -> None:
    body = json.loads(text().whole(content, "length", Usage(3, 4)).decode())
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700,
        "model": "m",
        "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def test_non_ascii_is_sent_as_utf8_not_escaped() -> None:
    event = chat().text("中文😀")
    assert "中文😀".encode() in event
    assert b"\\u" not in event


def test_head_fields_are_escaped() -> None:
    formatter = ChunkFormatter(chat=True, model='my "model"\n', response_id="id\\1", created=5)
    body = parse(formatter.text("x"))
    assert (body["model"], body["id"], body["created"]) == ('my "model"\n', "id\\1", 5)


def test_created_defaults_to_now() -> None:
    before = int(time.time())
    formatter = ChunkFormatter(chat=True, model="m", response_id="r")
    assert before <= parse(formatter.role())["created"] <= int(time.time())


def test_done_event() -> None:
    assert DONE == b"data: [DONE]\n\n"


def test_usage_to_dict() -> None:
    assert Usage(prompt_tokens=2, completion_tokens=0).to_dict() == {
        "prompt_tokens": 2,
        "completion_tokens": 0,
        "total_tokens": 2,
    }
