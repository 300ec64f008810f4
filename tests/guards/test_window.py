"""The guards' sans-IO part (proxy/guards/window.py): the text of each endpoint's events, the
windows an answer is cut into, what a passed window frees, the hold-back's bound, rewriting.
No trio, no sockets."""

from __future__ import annotations

import json

from proxy.guards.window import (
    ChunkText,
    OutputLedger,
    prompt_text,
    read_chunk,
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
    assert ledger.finish() is None


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
    assert last is None
    assert ledger.passed(second) == chunks[1:4]
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
