"""The guards' sans-IO part (proxy/guards/window.py): the text of each endpoint's events, the
windows an answer is cut into, what a passed window frees, the hold-back's bound, rewriting.
No trio, no sockets."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from proxy.guards.window import (
    ChunkText,
    OutputLedger,
    TextReader,
    events_of,
    payload_text,
    prompt_text,
    read_chunk,
    rewrite_closing,
    rewrite_events,
    rewrite_whole,
    whole_text,
)


def chat(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"


def test_the_text_of_every_endpoints_events() -> None:
    messages = (
        b"event: content_block_delta\ndata: "
        + json.dumps({"type": "content_block_delta", "delta": {"text": "Hi"}}).encode()
        + b"\n\n"
    )
    responses = (
        b"event: response.output_text.delta\ndata: "
        + json.dumps({"type": "response.output_text.delta", "delta": "yo"}).encode()
        + b"\n\n"
    )
    completions = b'data: {"choices":[{"text":"ab"}]}\n\n'
    tool = (
        b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\\"k\\""}}]}}]}\n\n'
    )
    opening = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert read_chunk(messages) == ChunkText(1, 1, "Hi")
    assert read_chunk(responses) == ChunkText(1, 1, "yo")
    assert read_chunk(completions) == ChunkText(1, 1, "ab")
    assert read_chunk(tool) == ChunkText(1, 1, '{"k"')
    # The opening role delta, a comment, [DONE]: events, no tokens.
    assert read_chunk(opening + b": paused\n\n" + b"data: [DONE]\n\n") == ChunkText(3, 0, "")
    assert read_chunk(chat("a") + chat("b")) == ChunkText(2, 2, "ab")


def test_the_prompt_and_a_whole_answers_text() -> None:
    body = {
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "two"}]},
        ],
    }
    assert prompt_text(body) == "Be brief.\none\ntwo"
    assert prompt_text({"prompt": "p"}) == "p"
    assert prompt_text({"input": "i", "instructions": "s"}) == "s\ni"
    answer = {"choices": [{"message": {"role": "assistant", "content": "whole"}}]}
    assert whole_text(json.dumps(answer).encode()) == "whole"
    assert whole_text(b"not json") == ""


def test_windows_close_every_window_tokens_and_overlap_the_previous_one() -> None:
    ledger = OutputLedger(3, 1, 10, release_after=True)
    due = [ledger.take(chat(w), read_chunk(chat(w))) for w in ("a", "b", "c", "d", "e", "f")]
    first, second = due[2], due[5]
    assert [d is None for d in due] == [True, True, False, True, True, False]
    assert first is not None and second is not None
    assert (first.text, first.new_text, first.index) == ("abc", "abc", 0)
    # The second sees the first's last token again.
    assert (second.text, second.new_text, second.index) == ("cdef", "def", 1)
    # The end: a last window with no text of its own, for the overlap the second kept held.
    last = ledger.finish()
    assert last is not None and (last.text, last.new_text, last.final) == ("f", "", True)


def test_a_passed_window_keeps_its_overlap_held_until_the_next_one_passes() -> None:
    ledger = OutputLedger(3, 2, 10, release_after=True)
    chunks = [chat(w) for w in ("SEC", "RET", "-", "12", "3", "!")]
    windows = [ledger.take(c, read_chunk(c)) for c in chunks]
    first = windows[2]
    assert first is not None
    # "SEC" goes; "RET" and "-" (the overlap) stay held: seen again by the next window.
    assert ledger.passed(first) == chunks[:1]
    second = windows[5]
    assert second is not None and second.text == "RET-123!"
    last = ledger.finish()
    assert last is not None and last.new_text == "" and last.final
    assert ledger.passed(second) == chunks[1:4]
    # The end's window frees what the second kept: nothing stays held.
    assert ledger.passed(last) == chunks[4:]
    # The answer's last window frees everything.
    final = OutputLedger(3, 2, 10, release_after=True)
    for c in chunks[:2]:
        final.take(c, read_chunk(c))
    closing = final.finish()
    assert closing is not None and closing.final
    assert final.passed(closing) == chunks[:2]


def test_an_answer_without_text_cannot_wait_forever() -> None:
    ledger = OutputLedger(4, 0, 2, release_after=True)
    empty = b'data: {"choices":[{"delta":{}}]}\n\n'
    results = [ledger.take(empty, read_chunk(empty)) for _ in range(6)]
    # The bound (window 4 + hold-back 2 events) closes a window without its tokens.
    forced = [r for r in results if r is not None]
    assert forced and forced[0].text == ""
    assert ledger.full
    assert ledger.passed(forced[0]) and not ledger.full


def test_release_before_holds_nothing() -> None:
    ledger = OutputLedger(2, 1, 2, release_after=False)
    for w in ("a", "b", "c"):
        due = ledger.take(chat(w), read_chunk(chat(w)))
        if due is not None:
            assert ledger.passed(due) == []
    assert not ledger.held


def test_a_rewrite_puts_the_new_text_in_the_first_event_and_empties_the_others() -> None:
    chunks = [chat("mail bob@"), chat("example.com"), b": keep\n\n", chat(" now")]
    out = rewrite_events(chunks, "mail [email] now")
    texts = [read_chunk(event + b"\n\n").text for event in out.split(b"\n\n") if event]
    assert texts == ["mail [email] now", "", "", ""]
    assert b": keep\n\n" in out
    whole = json.dumps({"choices": [{"message": {"content": "a@b.c"}}]}).encode()
    assert whole_text(rewrite_whole(whole, "[email]")) == "[email]"


# -- the fast read: what the full parse gives, for less ---------------------------------------


def full_parse_text(event: bytes) -> str:
    """The text the guards read before the fast read: the first data line's JSON object,
    parsed whole (the reference every event below is held to)."""
    at = event.find(b"data:")
    if at < 0:
        return ""
    line = event[at + 5 :].split(b"\n", 1)[0].strip()
    if not line.startswith(b"{"):
        return ""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return ""
    return payload_text(value) if isinstance(value, dict) else ""


# The frames upstreams stream token by token, as the fake upstream, vLLM, OpenAI and Anthropic
# write them: each must take the fast way (no full parse).
FAST_FRAMES = [
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":" hi"},"logprobs":null,"finish_reason":null}]}',
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}',
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":" yo","logprobs":null,"finish_reason":null}]}',
    b'data: {"choices": [{"index": 0, "delta": {"content": "spaced"}}], "usage": null}',
    b'data: {"choices":[{"delta":{"reasoning_content":"think"}}]}',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"Hi"}}',
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"input_json_delta","partial_json":"{\\"k\\""}}',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"item_id":"msg_1","output_index":0,"content_index":0,"logprobs":[],"delta":"r",'
    b'"sequence_number":4}',
]

# Events whose shape the fast read must not be fooled by: each gives what the full parse
# gives (many by the full parse itself).
TRICKY_EVENTS = [
    # escapes and unicode
    b'data: {"choices":[{"delta":{"content":"a\\"b\\\\c\\/d\\n\\t\\u00e9"}}]}',
    b'data: {"choices":[{"delta":{"content":"\\ud83d\\ude00 emoji"}}]}',
    b'data: {"choices":[{"delta":{"content":"\\ud800 lone"}}]}',
    'data: {"choices":[{"delta":{"content":"直接 😀"}}]}'.encode(),
    b'data: {"choices":[{"delta":{"content":"bad \xff utf-8"}}]}',
    b'data: {"choices":[{"delta":{"content":"surrogate \xed\xa0\x80 bytes"}}]}',
    b'data: {"choices":[{"delta":{"content":"bad \\q escape"}}]}',
    b'data: {"choices":[{"delta":{"content":"raw \x01 control"}}]}',
    # a key that decodes to a read key, duplicates (json.loads keeps the last)
    b'data: {"choices":[{"delta":{"con\\u0074ent":"escaped key"}}]}',
    b'data: {"choices":[{"delta":{"content":"first","content":"last"}}]}',
    b'data: {"choices":[{"delta":{"content":"a"}}],"choices":[{"delta":{"content":"b"}}]}',
    b'data: {"x\\"content":"evil","choices":[{"delta":{"content":"good"}}]}',
    b'data: {"type":"ping","choices":[{"delta":{"content":"typed"}}]}',
    b'data: {"object":"response","choices":[{"delta":{"content":"whole?"}}]}',
    b'data: {"type":"content_block_delta","delta":{"text":"t","thinking":"th"}}',
    b'data: {"type":"content_block_delta","type":"ping","delta":{"text":"t"}}',
    b'data: {"type":"response.output_text.delta","delta":"a","delta":"b"}',
    # several choices, a reasoning and a content delta, tool calls, a null, nested values
    b'data: {"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}',
    b'data: {"choices":[{"delta":{"reasoning_content":"r","content":"c"}}]}',
    b'data: {"choices":[{"delta":{"content":null}}]}',
    b'data: {"choices":[{"delta":{"content":[{"type":"text","text":"parts"}]}}]}',
    b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}',
    b'data: {"choices":[{"delta":{"content":"x"},"logprobs":{"content":[{"t":1}]}}]}',
    # numbers: NaN, an int CPython refuses, a float
    b'data: {"n":NaN,"choices":[{"delta":{"content":"nan"}}]}',
    b'data: {"n":' + b"9" * 5000 + b',"choices":[{"delta":{"content":"big"}}]}',
    b'data: {"n":-1.5e3,"choices":[{"delta":{"content":"float"}}]}',
    # not JSON, not whole, not one object, not a data line
    b'data: {"choices":[{"delta":{"content":"cut"}}]',
    b'data: {"choices":[{"delta":{"content":"trail"}}]} x',
    b"data: [DONE]",
    b": a comment",
    b'event: x\ndata: {"choices":[{"delta":{"content":"2nd line"}}]}\ndata: more',
    b'data:{"choices":[{"delta":{"content":"no space"}}]}  ',
]


def test_the_fast_read_takes_the_frames_upstreams_stream() -> None:
    from proxy.guards import window

    for frame in FAST_FRAMES:
        line = frame[frame.find(b"data:") + 5 :].strip()
        assert window._DELTA_LINE.fullmatch(line) is not None, frame
        assert TextReader().event_text(frame) == full_parse_text(frame), frame


def test_the_fast_read_gives_what_the_full_parse_gives() -> None:
    for event in FAST_FRAMES + TRICKY_EVENTS:
        assert TextReader().event_text(event) == full_parse_text(event), event
        assert read_chunk(event + b"\n\n").text == full_parse_text(event), event


def test_a_readers_frame_is_used_only_around_one_json_string() -> None:
    """One reader remembers the bytes around the last text it found: an event in the same
    frame costs a string match; anything else in that frame takes the whole way."""
    head = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":'
    tail = b'},"finish_reason":null}]}'
    followers = [
        b'"plain"',
        b'"esc\\u00e9 \\"q\\""',
        b'"a"},"content":"b"',  # looks like a string, then a duplicate key
        b'"a","x":"y"',
        b'"unterminated',
        b"null",
        b"1",
        b'"bad \xff"',
        b'"raw \x02"',
        b'""',
    ]
    reader = TextReader()
    assert reader.event_text(head + b'"first"' + tail) == "first"
    for middle in followers:
        event = head + middle + tail
        assert reader.event_text(event) == full_parse_text(event), middle
        # and back in the frame, after whatever came between
        assert reader.event_text(head + b'"again"' + tail) == "again"
    # Another frame, and an event of another endpoint, between two of this one.
    other = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"m"}}'
    assert [reader.event_text(e) for e in (other, head + b'"x"' + tail, other)] == ["m", "x", "m"]


@given(st.text(), st.booleans(), st.sampled_from(FAST_FRAMES))
def test_any_text_in_any_frame_reads_back(text: str, ascii_only: bool, frame: bytes) -> None:
    """Any text, escaped or raw, in the place of a frame's own text, read by a reader that
    knows the frame: the full parse's text, whether the fast way or the whole way took it."""
    reader = TextReader()
    full_parse = full_parse_text(frame)
    assert reader.event_text(frame) == full_parse
    if not full_parse:
        return
    at = frame.rfind(json.dumps(full_parse).encode())
    string = json.dumps(text, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    event = frame[:at] + string + frame[at + len(json.dumps(full_parse)) :]
    assert reader.event_text(event) == full_parse_text(event) == text


def test_the_overlap_held_by_a_window_that_closed_on_the_last_event_is_released() -> None:
    """A window that closed on the answer's last event (here its last token; under load, the
    hold-back's bound on [DONE]) keeps its overlap's chunks for the next window: the end makes
    that window, with no text of its own, and everything is released (the bench's long streams
    lost their [DONE] under load: 15 of 500)."""
    ledger = OutputLedger(2, 1, 2, release_after=True)
    chunks = [chat("a"), chat("b")]
    (_, due) = [ledger.take(c, read_chunk(c)) for c in chunks]
    assert due is not None and not due.final
    final = ledger.finish()
    assert final is not None and final.final and final.new_text == "" and final.text == "b"
    assert ledger.passed(due) + ledger.passed(final) == chunks
    assert not ledger.held
    # Nothing held, nothing open: no window.
    before = OutputLedger(2, 1, 2, release_after=False)
    for c in chunks:
        before.take(c, read_chunk(c))
    assert before.finish() is None


def test_responses_closing_events_repeat_the_text_as_sent_after_a_rewrite() -> None:
    def event(payload: dict[str, object]) -> bytes:
        return b"event: x\ndata: " + json.dumps(payload).encode() + b"\n\n"

    whole = "mail bob@example.com"
    done = event({"type": "response.output_text.done", "sequence_number": 7, "text": whole})
    final = event(
        {
            "type": "response.completed",
            "sequence_number": 9,
            "response": {"output": [{"content": [{"type": "output_text", "text": whole}]}]},
        }
    )
    delta = event({"type": "response.output_text.delta", "sequence_number": 3, "delta": "x"})
    chat = b'data: {"choices":[{"delta":{"content":"bob@example.com"}}]}\n\n'
    out = rewrite_closing(delta + done + final + chat, "mail [email]", len(whole))
    parts = events_of(out)
    # The delta and a chat event as they were; the closing events with the text as sent,
    # each keeping its number.
    assert parts[0] == delta and parts[3] == chat
    assert json.loads(parts[1].split(b"data: ")[1])["text"] == "mail [email]"
    completed = json.loads(parts[2].split(b"data: ")[1])
    assert completed["sequence_number"] == 9
    assert completed["response"]["output"][0]["content"][0]["text"] == "mail [email]"
    # A text that is not the answer's whole (one of several parts): which part of the sent
    # text it became is not known, so it is emptied rather than sent as it was made.
    (partial,) = events_of(rewrite_closing(done, "mail [email]", len(whole) + 5))
    assert json.loads(partial.split(b"data: ")[1])["text"] == ""
