"""A conversation's earlier prompts' tokens, sans-IO: a chat request named by a chain over its
messages, the longest remembered beginning recalled, bounded by the bytes held."""

from __future__ import annotations

import pytest

from proxy.protocol.kv_cache import token_key
from proxy.protocol.prompt_memory import PromptMemory, message_chain

HEAD = {"model": "m"}
SYSTEM = {"role": "system", "content": "be brief"}


def turn(count: int) -> list[dict[str, str]]:
    """A conversation after ``count`` questions (each answered but the last)."""
    messages = [SYSTEM]
    for i in range(count):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i - 1}"})
        messages.append({"role": "user", "content": f"question {i}"})
    return messages


def test_a_next_turns_chain_begins_with_the_last_ones() -> None:
    first, second = message_chain(HEAD, turn(1)), message_chain(HEAD, turn(2))
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first
    # Key order in a message does not matter; its text, the head's fields and the order do.
    reordered = [{"content": m["content"], "role": m["role"]} for m in turn(1)]
    assert message_chain(HEAD, reordered) == first
    assert message_chain({"model": "m", "tools": []}, turn(1))[0] != first[0]
    assert message_chain(HEAD, [turn(1)[1], SYSTEM])[-1] != first[-1]
    assert message_chain(HEAD, []) == []


def test_the_longest_remembered_beginning_is_recalled() -> None:
    memory = PromptMemory(1024)
    assert memory.recall(message_chain(HEAD, turn(1))) is None
    memory.remember(message_chain(HEAD, turn(1)), token_key([1, 2, 3]))
    memory.remember(message_chain(HEAD, turn(2)), token_key([1, 2, 3, 4, 5]))
    exact = memory.recall(message_chain(HEAD, turn(2)))
    assert exact is not None and exact.exact and exact.key == token_key([1, 2, 3, 4, 5])
    later = memory.recall(message_chain(HEAD, turn(4)))
    assert later is not None and not later.exact and later.key == token_key([1, 2, 3, 4, 5])
    # Another conversation behind the same system prompt: only whole requests are remembered.
    other = [SYSTEM, {"role": "user", "content": "something else"}]
    assert memory.recall(message_chain(HEAD, other)) is None


def test_bounded_by_bytes_least_recently_used_first() -> None:
    memory = PromptMemory(28)  # 7 tokens
    a, b, c = (message_chain({"model": name}, turn(1)) for name in "abc")
    memory.remember(a, token_key([1, 2, 3]))
    memory.remember(b, token_key([4, 5, 6]))
    assert memory.recall(a) is not None  # a is now the most recently used
    memory.remember(c, token_key([7, 8]))
    assert (memory.recall(a), memory.recall(b), memory.recall(c)) != (None, None, None)
    assert memory.recall(b) is None and len(memory) == 2 and memory.held_bytes == 20
    assert memory.recall(a) is not None and memory.recall(c) is not None
    # Remembered again under the same name: replaced, not counted twice.
    memory.remember(c, token_key([9]))
    assert memory.held_bytes == 16
    # Larger than the whole memory: not kept, nothing dropped for it.
    memory.remember(b, token_key(list(range(9))))
    assert memory.recall(b) is None and len(memory) == 2
    with pytest.raises(ValueError):
        PromptMemory(0)
