"""Prefix KV reuse: the KV of sequences the engine has computed, kept so that a new prompt that
begins with the same token ids prefills only what follows them.

Like llama.cpp's ``cache_prompt`` and vLLM's automatic prefix caching, a hit is the *longest
common prefix* of token ids with any entry, not an exact match: a chat's next turn sends the
whole history again, and the chat template re-tokenizes the previous answer, whose ids can
differ from the ones generated from some point on; everything before that point is reused.

Owned by the engine thread (:class:`inference.batching.BatchEngine`), like the batch's cache;
other threads read only its plain counters (``bytes``, ``entries``), for ``/healthz`` and the
metrics. An entry is only ever inserted whole (a finished prompt's KV, or a finished
sequence's), copied out of the cache that computed it, so nothing a later request reads can be
half-written or edited by the batch; a sequence cancelled mid-prefill inserts nothing.

Memory is bounded by ``limit_bytes``: least recently used entries are evicted first, and an
entry that is a prefix of another (a prompt's KV once its answer is stored) is dropped, being
worth nothing beside the longer one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cache_rows import Rows

# Events reported to ``on_event`` (the metrics): a lookup that reused something, one that did
# not, and an entry evicted for room.
HIT, MISS, EVICTION = "hit", "miss", "eviction"


@dataclass(slots=True)
class Entry:
    ids: tuple[int, ...]
    rows: Rows  # per layer (keys, values), [1, kv_heads, len(ids), head_dim], its own tensors
    nbytes: int


def common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    """How many leading ids ``left`` and ``right`` share (both lists, or both tuples: their
    slices are compared)."""
    limit = min(len(left), len(right))
    if left[:limit] == right[:limit]:
        return limit
    # Halving on slice equality: each comparison runs in C, log2(limit) of them.
    low, high = 0, limit  # left[:low] == right[:low]; left[:high] != right[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if left[low:middle] == right[low:middle]:
            low = middle
        else:
            high = middle
    return low


def rows_nbytes(rows: Rows) -> int:
    return sum(int(keys.nbytes) + int(values.nbytes) for keys, values in rows)


class PrefixCache:
    def __init__(self, limit_bytes: int, on_event: Callable[[str], None] | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.on_event = on_event
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def entries(self) -> int:
        return len(self._entries)

    def _event(self, kind: str) -> None:
        if self.on_event is not None:
            self.on_event(kind)

    def lookup(self, prompt_ids: Sequence[int]) -> tuple[int, Rows | None]:
        """The KV of the longest prefix of ``prompt_ids`` held (views of the entry's tensors,
        which the caller copies before writing), and its length; at most all but the last id,
        whose logits the prefill must still compute. (0, None) when nothing is shared."""
        best: Entry | None = None
        shared = 0
        usable = len(prompt_ids) - 1
        prompt = tuple(prompt_ids)
        for entry in self._entries.values():
            length = common_prefix(entry.ids, prompt)
            if length > shared:
                best, shared = entry, length
                if shared >= usable:
                    break
        shared = min(shared, usable)
        if best is None or shared <= 0:
            self.misses += 1
            self._event(MISS)
            return 0, None
        self._entries.move_to_end(best.ids)
        self.hits += 1
        self._event(HIT)
        return shared, [(keys[:, :, :shared], values[:, :, :shared]) for keys, values in best.rows]

    def store(self, ids: Sequence[int], rows: Rows) -> None:
        """Keep ``rows``, the KV of exactly ``ids``, as an entry, evicting the least recently
        used for room. The tensors become the entry's: the caller hands over a copy that no
        cache holds (a prompt's is cloned, a finished row is taken out of the batch by
        :func:`inference.cache_rows.take_row`, which copies)."""
        key = tuple(ids)
        if not key or int(rows[0][0].shape[2]) != len(key):
            return
        nbytes = rows_nbytes(rows)
        if nbytes > self.limit_bytes:
            return
        for held in list(self._entries.values()):
            shared = common_prefix(held.ids, key)
            if shared == len(key):
                # Already held, or a prefix of what is held: that entry serves it.
                self._entries.move_to_end(held.ids)
                return
            if shared == len(held.ids):
                self._remove(held)
        while self._entries and self.bytes + nbytes > self.limit_bytes:
            self._remove(next(iter(self._entries.values())))
            self.evictions += 1
            self._event(EVICTION)
        self._entries[key] = Entry(key, rows, nbytes)
        self.bytes += nbytes

    def _remove(self, entry: Entry) -> None:
        del self._entries[entry.ids]
        self.bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def describe(self) -> dict[str, int]:
        return {
            "limit_bytes": self.limit_bytes,
            "bytes": self.bytes,
            "entries": self.entries,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
