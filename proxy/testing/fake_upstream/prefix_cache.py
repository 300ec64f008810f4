"""The simulated prefix cache of a serving model, for the balance and KV-routing benches: an
LRU of prompt blocks named as a chain, as vLLM's automatic prefix caching names KV blocks, and
the prompt as it sees it. A conversation's next turn on the replica that served the previous
one hits.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.testing.fake_upstream.content import message_texts


def prompt_bytes(body: Mapping[str, Any]) -> bytes:
    """The prompt as the prefix cache sees it: instructions or system, then each message's role
    and text (or the prompt, or the input), in order."""
    parts: list[str] = []
    for name in ("instructions", "system"):
        if isinstance(body.get(name), str):
            parts.append(f"system\x1f{body[name]}")
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = body.get("input")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                texts = message_texts([message])
                parts.append(f"{message.get('role', '')}\x1f{''.join(texts)}")
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            parts.append(value)
    return "\x1e".join(parts).encode("utf-8", "replace")


class PrefixCache:
    """An LRU of prompt blocks, as vLLM's automatic prefix caching keeps KV blocks: each full
    block is named by a hash of the prompt up to its end (a chain), so a block hits only when
    everything before it hit too. A prompt's blocks are used tail first, so that the least
    recently used go tail first too (vLLM frees a request's blocks in reverse, and evicts the
    least recently freed): a shared beginning outlives the prompts that grew from it. Counts
    blocks queried and hit.

    Bytes (:meth:`lookup`: blocks of ``block`` bytes) for the balance bench; named blocks
    (:meth:`match`, then :meth:`store`) for the token-block cache, whose names are vLLM's
    hashes of token blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self._blocks

    def lookup(self, prompt: bytes, block: int) -> tuple[int, int, float]:
        """Look ``prompt`` up and remember it: (its full blocks, how many were cached, the
        fraction of its bytes not cached)."""
        chain = b""
        names = []
        for start in range(0, len(prompt) - block + 1, block):
            chain = hashlib.blake2b(chain + prompt[start : start + block], digest_size=16).digest()
            names.append(chain)
        hit = self.match(names)
        self.store(names)
        uncached = 1.0 - (hit * block / len(prompt)) if prompt else 1.0
        return len(names), hit, uncached

    def match(self, names: Sequence[bytes]) -> int:
        """How many of the leading ``names`` are cached (counted as queried and hit)."""
        hit = 0
        for name in names:
            if name not in self._blocks:
                break
            hit += 1
        self.queries += len(names)
        self.hits += hit
        return hit

    def store(self, names: Sequence[bytes]) -> tuple[list[int], list[bytes]]:
        """Use ``names`` (a prompt's blocks, computed or cached): (the indexes of those that
        were not cached, the names evicted to stay within the capacity)."""
        blocks = self._blocks
        new = [i for i, name in enumerate(names) if name not in blocks]
        for name in reversed(names):
            blocks[name] = None
            blocks.move_to_end(name)
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return new, evicted
