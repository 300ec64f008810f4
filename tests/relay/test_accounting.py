"""What a streamed request's account reports: the time to its first token (not to an opening
event that carries none), and where it was when it ended. Sans sockets, on a fake clock."""

from __future__ import annotations

import json

import pytest

from proxy.protocol.sse import FIRST_TOKEN
from proxy.relay.accounting import RelayAccount
from proxy.relay.state import Phase


def event(payload: dict[str, object], name: str | None = None) -> bytes:
    head = b"" if name is None else f"event: {name}\n".encode()
    return head + b"data: " + json.dumps(payload).encode() + b"\n\n"


def account(endpoint: str | None) -> tuple[RelayAccount, list[float]]:
    clock = [10.0]
    kept = RelayAccount()
    kept.started_at = 10.0
    kept._now = lambda: clock[0]
    kept.phase = Phase.FIRST_TOKEN
    kept.opening = None if endpoint is None else FIRST_TOKEN[endpoint]
    return kept, clock


ROLE = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
TOKEN = event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})


def test_an_opening_write_is_no_first_token() -> None:
    kept, clock = account("chat")
    clock[0] = 10.002
    kept.wrote(ROLE)  # the role delta, before the prefill
    assert (kept.ttft, kept.phase) == (None, Phase.FIRST_TOKEN)
    clock[0] = 10.3
    kept.wrote(TOKEN)
    assert kept.ttft == pytest.approx(0.3)
    assert kept.phase == Phase.MID_STREAM
    clock[0] = 10.35
    kept.wrote(TOKEN)
    # Gaps are between token writes; both writes' events are counted.
    assert sum(kept.gap_counts) == 1 and kept.gap_sum == pytest.approx(0.05)
    assert kept.events_out == 3
    assert kept.first is ROLE


def test_without_an_opening_pattern_every_write_counts() -> None:
    kept, clock = account(None)
    clock[0] = 10.002
    kept.wrote(ROLE)
    assert kept.ttft == pytest.approx(0.002)


@pytest.mark.parametrize(
    ("endpoint", "opening", "token"),
    [
        ("chat", ROLE, TOKEN),
        (
            "chat",
            ROLE,
            event({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1"}]}}]}),
        ),
        ("chat", ROLE, event({"choices": [{"delta": {"reasoning_content": "Hmm"}}]})),
        (
            "completions",
            event({"choices": [{"text": "", "index": 0}]}),
            event({"choices": [{"text": "Hi", "index": 0}]}),
        ),
        (
            "responses",
            event({"type": "response.created", "response": {}}, "response.created")
            + event({"type": "response.in_progress"}, "response.in_progress"),
            event(
                {"type": "response.output_text.delta", "delta": "Hi"}, "response.output_text.delta"
            ),
        ),
        (
            "messages",
            event({"type": "message_start", "message": {"content": []}}, "message_start")
            + event({"type": "content_block_start"}, "content_block_start"),
            event({"type": "content_block_delta", "delta": {"text": "Hi"}}, "content_block_delta"),
        ),
    ],
)
def test_each_endpoints_first_token(endpoint: str, opening: bytes, token: bytes) -> None:
    pattern = FIRST_TOKEN[endpoint]
    assert pattern.search(opening) is None
    assert pattern.search(token) is not None
    # A write that holds the opening and a token (coalesced) holds the first token.
    assert pattern.search(opening + token) is not None
