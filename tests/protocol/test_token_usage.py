"""What a request used, sans-IO: the metered splitter's count and its usage chunk, the charge's
sources in order, the cap's edits and the input estimate."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.api_request import parse_api_request
from proxy.protocol.openai import Endpoint
from proxy.protocol.rewrite import model_renamer
from proxy.protocol.token_usage import (
    MeteredSplitter,
    UsageMeter,
    cap_edits,
    estimate_input_tokens,
    usage_edits,
)


def chat_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def delta(text: str) -> bytes:
    return chat_event({"model": "up", "choices": [{"index": 0, "delta": {"content": text}}]})


ROLE = chat_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
FINISH = chat_event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
USAGE = chat_event(
    {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
)
DONE = b"data: [DONE]\n\n"


def meter(endpoint: Endpoint = Endpoint.CHAT, **settings: Any) -> UsageMeter:
    return UsageMeter(endpoint, streamed=True, estimated_input=5, **settings)


@pytest.mark.parametrize("strip", [True, False])
def test_a_chat_stream_is_counted_and_its_usage_chunk_kept_from_who_did_not_ask(
    strip: bool,
) -> None:
    counting = meter(strip_usage=strip)
    splitter = MeteredSplitter(1 << 20, counting)
    stream = ROLE + delta("a") + delta("b") + delta("c") + FINISH + USAGE + DONE
    out: list[bytes] = []
    # Cut anywhere, even inside the markers: only whole events are counted.
    for start in range(0, len(stream), 7):
        out += splitter.feed(stream[start : start + 7])
    assert counting.deltas == 3
    assert (counting.facts.input_tokens, counting.facts.output_tokens) == (7, 3)
    expected = [ROLE, delta("a"), delta("b"), delta("c"), FINISH, USAGE, DONE]
    if strip:
        expected.remove(USAGE)
    assert out == expected


def test_a_read_of_deltas_only_is_passed_on_as_it_is_and_renamed_when_aliased() -> None:
    counting = meter()
    splitter = MeteredSplitter(1 << 20, counting, model_renamer("up", "public"))
    events = splitter.feed(delta("x") + delta("y"))
    assert counting.deltas == 2
    assert all(b'"model":"public"' in event for event in events)


@pytest.mark.parametrize("spaced", [False, True])
def test_an_empty_content_is_no_token_unless_beside_text(spaced: bool) -> None:
    """vLLM's and the local model's opening delta is ``{"role": "assistant", "content": ""}``;
    a reasoning model's deltas carry ``"content": ""`` beside ``"reasoning_content"``."""
    separators = (", ", ": ") if spaced else (",", ":")

    def event(delta: dict[str, str]) -> bytes:
        payload = {"choices": [{"index": 0, "delta": delta}]}
        return b"data: " + json.dumps(payload, separators=separators).encode() + b"\n\n"

    opening = event({"role": "assistant", "content": ""})
    thinking = event({"content": "", "reasoning_content": "hm"})
    counting = meter()
    splitter = MeteredSplitter(1 << 20, counting)
    splitter.feed(opening)  # alone in its read: the fast path
    assert counting.deltas == 0
    splitter.feed(opening + thinking + event({"content": "a"}))
    assert counting.deltas == 2
    splitter.feed(thinking)
    assert counting.deltas == 3


def test_spaced_json_is_counted_too() -> None:
    counting = meter()
    splitter = MeteredSplitter(1 << 20, counting)
    spaced = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    splitter.feed(spaced * 3)
    assert counting.deltas == 3


def test_responses_and_messages_streams_are_counted_and_read() -> None:
    responses = meter(Endpoint.RESPONSES)
    splitter = MeteredSplitter(1 << 20, responses)
    splitter.feed(
        b'event: response.created\ndata: {"type":"response.created","response":'
        b'{"object":"response","status":"in_progress","usage":null}}\n\n'
        + b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"delta":"hi"}\n\n'
        * 4
        + b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"object":"response","status":"completed","usage":{"input_tokens":9,'
        b'"output_tokens":4,"total_tokens":13}}}\n\n'
    )
    assert responses.deltas == 4
    assert (responses.facts.input_tokens, responses.facts.output_tokens) == (9, 4)
    messages = meter(Endpoint.MESSAGES)
    splitter = MeteredSplitter(1 << 20, messages)
    splitter.feed(
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":11,"output_tokens":1}}}\n\n'
        + b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
        b'{"type":"text_delta","text":"x"}}\n\n' * 2
    )
    assert messages.deltas == 2
    # The stream was cut before message_delta: message_start's output_tokens (the count at
    # the start) is not the answer's, so the deltas count (the sweep found it charged 0).
    assert messages.facts.input_tokens == 11
    assert messages.facts.output_tokens is None
    assert messages.output_so_far() == 2
    usage = messages.usage(64, client_left=True, failed=None)
    assert (usage.input, usage.output) == (11, 2)


def test_the_charge_takes_the_best_source_there_is() -> None:
    told = meter()
    told.events([USAGE])
    told.deltas = 99
    usage = told.usage(100, client_left=True, failed=None)
    assert (usage.input, usage.output, usage.estimated) == (7, 3, False)
    assert usage.charge("total") == 10 and usage.charge("output") == 3
    # A stream that never began made nothing, whoever left.
    counted = meter()
    assert counted.usage(100, client_left=True, failed=None).charge("total") == 0
    # No usage block: the deltas received, the input estimated.
    MeteredSplitter(1 << 20, counted)  # the upstream answered with an event stream
    counted.deltas = 40
    usage = counted.usage(100, client_left=True, failed=None)
    assert (usage.input, usage.output, usage.estimated) == (5, 40, True)
    # A whole answer that never came: its reservation if the model may have been at work.
    whole = UsageMeter(Endpoint.CHAT, streamed=False, estimated_input=5)
    # No client had any of it: all of it is for nobody.
    for left, failed in ((True, None), (False, "upstream_total_timeout")):
        usage = whole.usage(100, client_left=left, failed=failed)
        assert (usage.input, usage.output, usage.for_nobody) == (5, 100, 100)
    assert whole.usage(100, client_left=False, failed="upstream_http_error").charge("total") == 0
    # A whole answer without usage: its text estimated.
    whole.whole(json.dumps({"choices": [{"message": {"content": "x" * 40}}]}).encode())
    assert whole.usage(100, client_left=False, failed=None).output == 10
    # A local model's own count, its tokens for nobody included.
    local = UsageMeter(Endpoint.CHAT, streamed=True, estimated_input=5, local=True)
    assert local.usage(100, client_left=True, failed=None).charge("total") == 0
    local.local_generation(12, 8, 2)
    usage = local.usage(100, client_left=True, failed=None)
    assert (usage.input, usage.output, usage.for_nobody, usage.estimated) == (12, 8, 2, False)


def request(endpoint: Endpoint, **body: Any) -> Any:
    base: dict[str, Any] = {"model": "m"}
    if endpoint in (Endpoint.CHAT, Endpoint.MESSAGES):
        base["messages"] = [{"role": "user", "content": "hello"}]
    elif endpoint is Endpoint.COMPLETIONS:
        base["prompt"] = "hello"
    else:
        base["input"] = "hello"
    if endpoint is Endpoint.MESSAGES:
        base["max_tokens"] = 1000
    return parse_api_request(json.dumps(base | body).encode(), endpoint)


def test_the_cap_lowers_each_endpoints_field_or_sets_it() -> None:
    assert cap_edits(request(Endpoint.CHAT), 50) == {"max_completion_tokens": 50}
    assert cap_edits(request(Endpoint.CHAT, max_tokens=10), 50) == {}
    assert cap_edits(request(Endpoint.CHAT, max_tokens=80, max_completion_tokens=9), 50) == {
        "max_tokens": 50
    }
    assert cap_edits(request(Endpoint.COMPLETIONS, max_tokens=99), 50) == {"max_tokens": 50}
    assert cap_edits(request(Endpoint.RESPONSES), 50) == {"max_output_tokens": 50}
    assert cap_edits(request(Endpoint.MESSAGES), 50) == {"max_tokens": 50}
    assert cap_edits(request(Endpoint.CHAT), 0) == {}


def test_usage_is_asked_for_only_where_the_client_did_not() -> None:
    assert usage_edits(request(Endpoint.CHAT, stream=True)) == {
        "stream_options.include_usage": True
    }
    asked = request(Endpoint.CHAT, stream=True, stream_options={"include_usage": True})
    assert usage_edits(asked) == {}
    assert usage_edits(request(Endpoint.CHAT)) == {}
    assert usage_edits(request(Endpoint.RESPONSES, stream=True)) == {}


def test_the_input_estimate_is_characters_over_four() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 37}], "system": "abc"}
    assert estimate_input_tokens(body) == 11  # 37 + 4 ("user") + 3 = 44 characters


def test_a_malformed_event_ends_the_count_where_it_is() -> None:
    """One read may bring good events on both sides of a bad one: those before it are the
    client's (handed back, counted), nothing after it is counted as made, since nothing after
    it is ever sent; the error waits for the caller to raise once it has relayed them."""
    counting = meter()
    splitter = MeteredSplitter(1 << 20, counting, checked=True)
    bad = b"this is not server-sent events\n\n"
    events = splitter.feed(ROLE + delta("a") + bad + delta("b") + delta("c"))
    assert events == [ROLE, delta("a")]
    assert counting.deltas == 1
    assert splitter.malformed is not None
    assert "malformed server-sent event" in str(splitter.malformed)
    # Whatever comes later is neither handed back nor counted.
    assert splitter.feed(delta("d") + DONE) == []
    assert counting.deltas == 1


def test_an_unchecked_splitter_passes_any_event() -> None:
    counting = meter()
    splitter = MeteredSplitter(1 << 20, counting)
    assert len(splitter.feed(b"not sse\n\n" + delta("a"))) == 2
    assert splitter.malformed is None


def test_a_losing_attempt_counts_nothing_until_its_stream_is_the_clients() -> None:
    """A hedged request's attempts share one meter: what an attempt reads before its head is
    decided counts only once it has won (begin_counting), else never."""
    counting = meter()
    loser = MeteredSplitter(1 << 20, counting, counting=False)
    winner = MeteredSplitter(1 << 20, counting, counting=False)
    assert loser.feed(ROLE + delta("a") + delta("b")) == [ROLE, delta("a"), delta("b")]
    first = winner.feed(ROLE + delta("a"))
    assert counting.deltas == 0
    assert winner.begin_counting(first) == [ROLE, delta("a")]
    winner.feed(delta("b") + DONE)
    assert counting.deltas == 2


def test_the_tokens_in_what_never_reached_the_client() -> None:
    counting = meter()
    # Written chunks: one event, or several coalesced; the opening and the end are no tokens.
    unsent = [ROLE, delta("a") + delta("b"), FINISH + USAGE + DONE]
    assert counting.tokens_in(unsent) == 2
    assert counting.tokens_in([]) == 0
