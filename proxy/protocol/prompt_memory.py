"""A conversation's earlier prompts as their engine tokenized them, sans-IO: so that
``cache_aware`` routes a conversation's next turn without first waiting for its tokens.

The rule this module owns: a chat request is named by a **chain over its messages**
(:func:`message_chain`): name ``k`` stands for the request's other tokenizing fields (model,
tools, template settings) and its first ``k + 1`` messages, so two requests share name ``k``
exactly when they agree on all of that. A request's token ids are remembered under the last
name of its chain (:meth:`PromptMemory.remember`).

A conversation's next turn repeats the earlier messages and adds an answer and a question, so
the longest remembered request whose messages begin this one's (:meth:`PromptMemory.recall`)
has tokens that begin this one's: routed by them, the turn goes to the replica holding its
conversation at once, and its own tokens can be learnt beside it, off its path to the first
token. Where a chat template renders an earlier turn differently once more follow (one that
drops earlier reasoning, say), the recalled tokens match fewer of the replicas' blocks: the
routing is worse, what is served is the same.

Bounded: past ``max_bytes`` of remembered tokens (4 bytes each) the least recently used go
first.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_NAME_BYTES = 16


def message_chain(head: Mapping[str, Any], messages: Sequence[Any]) -> list[bytes]:
    """The chain of names of a chat request: ``head`` (its tokenizing fields other than the
    messages) and each of ``messages`` in turn (JSON values, as parsed)."""
    parent = _name(b"", head)
    names: list[bytes] = []
    for message in messages:
        parent = _name(parent, message)
        names.append(parent)
    return names


def _name(parent: bytes, value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(
        parent + text.encode("utf-8", "surrogatepass"), digest_size=_NAME_BYTES
    ).digest()


@dataclass(frozen=True, slots=True)
class Recalled:
    """Remembered token ids (as :func:`~proxy.protocol.kv_cache.token_key` bytes) of this
    request (``exact``) or of the longest earlier one whose messages begin this one's."""

    key: bytes
    exact: bool


class PromptMemory:
    """Token ids of recent chat requests by the last name of their :func:`message_chain`; an
    LRU bounded by the bytes it holds."""

    __slots__ = ("_held", "_keys", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.max_bytes = max_bytes
        self._keys: OrderedDict[bytes, bytes] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def held_bytes(self) -> int:
        return self._held

    def recall(self, chain: Sequence[bytes]) -> Recalled | None:
        """The tokens remembered under the longest name of ``chain`` (the whole request's
        first, then ever shorter beginnings of its messages); None when none is."""
        keys = self._keys
        for depth in range(len(chain) - 1, -1, -1):
            key = keys.get(chain[depth])
            if key is not None:
                keys.move_to_end(chain[depth])
                return Recalled(key, depth == len(chain) - 1)
        return None

    def remember(self, chain: Sequence[bytes], key: bytes) -> None:
        """A request of this ``chain`` was tokenized to ``key``. A key larger than the whole
        memory is not kept."""
        if not chain or not key or len(key) > self.max_bytes:
            return
        name = chain[-1]
        old = self._keys.pop(name, None)
        if old is not None:
            self._held -= len(old)
        self._keys[name] = key
        self._held += len(key)
        while self._held > self.max_bytes:
            _, dropped = self._keys.popitem(last=False)
            self._held -= len(dropped)
