"""What each replica's KV cache holds, and where a prompt is cheapest, sans-IO.

The rule this module owns: **a block is named by the tokens of the whole prompt up to its end**
(a chain: :func:`block_keys`), never by vLLM's own block hash. vLLM seeds its hashes from
``PYTHONHASHSEED`` or ``os.urandom`` (``NONE_HASH``) and may hash with Python's ``hash``, so
no other process can compute them; but each ``BlockStored`` event carries the stored blocks'
token ids and its parent's hash, so a subscriber that saw the parent can name the children by
their tokens. A :class:`BlockIndex` keeps, per replica, vLLM's hash -> that chain key (a
``BlockRemoved`` names only hashes) and the set of chain keys held; a prompt's match on a
replica is the number of its leading blocks the replica holds (:meth:`BlockIndex.matched`).

A block whose parent this process never saw (stored before it subscribed, or during a gap it
could not replay) cannot be named, and neither can its children: they are skipped (counted in
``unlinked``). Nor are blocks of a LoRA adapter, of another cache tier (``medium`` other than
the GPU's), of another KV cache group (hybrid models), or with extra keys (images, cache salt):
the same tokens there are a different cache, and no plain prompt would hit it.

The index is bounded: past ``max_blocks`` the oldest stored block is forgotten first (counted
in ``evicted``); vLLM's own evictions arrive as ``BlockRemoved``.

A replica that publishes no events (llama.cpp, another Sluice, vLLM without the flag), or
whose events are not flowing, is judged by a :class:`RoutedIndex` instead: the blocks of the
prompts this process routed there, the last routed kept longest, bounded, and each forgotten a
``ttl`` after it was last routed, since the engine evicts what is not used again. It guesses
(another instance's requests, and what the engine evicted sooner, are unknown to it), and the
router says when a choice rests on it (``cache_approx``).

:func:`cache_aware_pick` is the choice: each candidate scored by the prompt tokens it holds
against its load, a candidate over the load bound credited with no cache at all, and a prefix
still being prefilled somewhere credited only where no replica holds it stored.
:class:`SequenceCheck` says what an event batch's sequence number means (the next one, a gap,
the publisher restarted).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from proxy.protocol.affinity import overloaded

# vLLM's ExternalBlockHash: bytes (sha256, sha256_cbor) or int (builtin hash, older releases).
BlockHash = bytes | int

# The GPU tier, as vLLM's events name it (None before the field existed).
GPU_MEDIUM = "GPU"
# The prompt tokens that :func:`cache_aware_pick` weighs as ``cache_weight`` requests of load.
TOKENS_PER_WEIGHT = 1000

_KEY_BYTES = 16


@dataclass(frozen=True, slots=True)
class BlockStored:
    """``BlockStored``: ``block_hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``;
    the first block's parent is ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: vLLM's ``KVEventBatch``."""

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


def token_key(tokens: Sequence[int]) -> bytes:
    """A prompt's token ids as a routing key (4 bytes each): how the cache_aware router is
    given them through the attempts' ``key``. Raises OverflowError for an id outside
    0..2**32-1."""
    return array("I", tokens).tobytes()


def key_tokens(key: bytes) -> Sequence[int]:
    """:func:`token_key`'s tokens back; none for a key that is not one."""
    if not key or len(key) % 4:
        return ()
    tokens = array("I")
    tokens.frombytes(key)
    return tokens


def block_keys(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chain keys of the full blocks of ``tokens``: key ``i`` names the tokens
    ``[0, (i+1) * block_size)``. A partial last block has none (vLLM caches full blocks only)."""
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block of ``tokens`` whose parent's key is ``parent`` (b"" for none).
    Raises OverflowError for a token id outside 0..2**32-1."""
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=_KEY_BYTES).digest()


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch did to an index."""

    stored: int = 0
    removed: int = 0
    cleared: bool = False
    # Blocks not indexed: an unknown parent, another tier, group or adapter, malformed.
    skipped: int = 0
    # Blocks forgotten to stay within max_blocks.
    evicted: int = 0


class BlockIndex:
    """The blocks one replica holds, as its events said; mutated only by its subscriber's
    :meth:`apply` and :meth:`clear`, read by the router's :meth:`matched`."""

    __slots__ = (
        "_held",
        "_keys",
        "block_size",
        "complete_since",
        "evicted",
        "max_blocks",
        "unlinked",
    )

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        # Since when this index has seen every event of its replica (-inf: since before any
        # request was routed there; else since its subscriber connected again, or last emptied
        # it after events were lost); None while no subscription is up.
        # Set by the subscriber; the router reads it (:func:`events_complete`).
        self.complete_since: float | None = None
        # The engine's block size, from its first BlockStored; None until then.
        self.block_size: int | None = None
        # vLLM's hash -> chain key, oldest stored first.
        self._keys: OrderedDict[BlockHash, bytes] = OrderedDict()
        # Chain key -> how many of vLLM's hashes name it (one, unless the engine stored the
        # same tokens twice under two hashes).
        self._held: dict[bytes, int] = {}
        self.evicted = 0
        self.unlinked = 0

    def __len__(self) -> int:
        return len(self._keys)

    def matched(self, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` (:func:`block_keys`) this replica holds."""
        held = self._held
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def clear(self) -> None:
        """Forget everything (the cache was cleared, or events were lost)."""
        self._keys.clear()
        self._held.clear()

    def apply(self, batch: EventBatch) -> Applied:
        """One batch's events, in order."""
        stored = removed = skipped = evicted = 0
        cleared = False
        for event in batch.events:
            if isinstance(event, BlockStored):
                done, not_done, dropped = self._stored(event)
                stored, skipped, evicted = stored + done, skipped + not_done, evicted + dropped
            elif isinstance(event, BlockRemoved):
                if _ours(event.medium, event.group_idx):
                    removed += sum(self._forget(h) for h in event.block_hashes)
            elif event.medium in (None, GPU_MEDIUM):
                self.clear()
                cleared = True
        return Applied(stored, removed, cleared, skipped, evicted)

    def _stored(self, event: BlockStored) -> tuple[int, int, int]:
        """(blocks indexed, skipped, evicted)."""
        count = len(event.block_hashes)
        if (
            not _ours(event.medium, event.group_idx)
            or event.lora_id is not None
            or event.lora_name is not None
            or (event.extra_keys is not None and any(k is not None for k in event.extra_keys))
            or event.block_size < 1
            or len(event.token_ids) != count * event.block_size
        ):
            return 0, count, 0
        if event.block_size != self.block_size:
            # The first event, or an engine restarted with another block size: what was
            # indexed under the old size can never match again.
            self.clear()
            self.block_size = event.block_size
        if event.parent_block_hash is None:
            parent = b""
        else:
            known = self._keys.get(event.parent_block_hash)
            if known is None:
                self.unlinked += count
                return 0, count, 0
            parent = known
        size = event.block_size
        evicted = 0
        for i, block_hash in enumerate(event.block_hashes):
            try:
                parent = block_key(parent, event.token_ids[i * size : (i + 1) * size])
            except (OverflowError, TypeError):
                return i, count - i, evicted
            self._forget(block_hash)
            while len(self._keys) >= self.max_blocks:
                self._forget(next(iter(self._keys)))
                evicted += 1
            self._keys[block_hash] = parent
            self._held[parent] = self._held.get(parent, 0) + 1
        self.evicted += evicted
        return count, 0, evicted

    def _forget(self, block_hash: BlockHash) -> bool:
        key = self._keys.pop(block_hash, None)
        if key is None:
            return False
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]
        return True


class RoutedIndex:
    """The blocks of the prompts this process routed to one replica: the approximate index,
    for a replica whose events are not known. Named by :func:`block_keys` in ``block_size``.

    An LRU: :meth:`routed` marks a prompt's blocks used at ``now``, its first block last, so
    that past ``max_blocks`` a prompt's tail is forgotten before its head (vLLM frees a
    request's blocks tail first, and evicts the least recently freed); a block not routed
    again for ``ttl`` seconds is forgotten, as the engine will have evicted it under other
    prompts. Mutated by the router alone, at each choice."""

    __slots__ = ("_used", "block_size", "evicted", "max_blocks", "ttl")

    def __init__(self, max_blocks: int, ttl: float, block_size: int) -> None:
        if max_blocks < 1 or block_size < 1 or not ttl > 0:
            raise ValueError("max_blocks and block_size must be at least 1, ttl over 0")
        self.max_blocks = max_blocks
        self.ttl = ttl
        self.block_size = block_size
        # Chain key -> when it was last routed; least recently routed first.
        self._used: OrderedDict[bytes, float] = OrderedDict()
        # Blocks forgotten to stay within max_blocks (not those past the ttl).
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._used)

    def matched(self, keys: Sequence[bytes], now: float, within: float | None = None) -> int:
        """How many of the leading ``keys`` were routed here within the ttl (or ``within``
        seconds, when shorter)."""
        used = self._used
        since = now - (self.ttl if within is None else min(within, self.ttl))
        count = 0
        for key in keys:
            at = used.get(key)
            if at is None or at < since:
                break
            count += 1
        return count

    def routed(self, keys: Sequence[bytes], now: float) -> None:
        """A prompt of these blocks was routed here at ``now``."""
        used = self._used
        for key in reversed(keys[: self.max_blocks]):
            used[key] = now
            used.move_to_end(key)
        self.expire(now)
        while len(used) > self.max_blocks:
            used.popitem(last=False)
            self.evicted += 1

    def expire(self, now: float) -> None:
        """Forget what was last routed more than the ttl before ``now``."""
        used = self._used
        since = now - self.ttl
        while used and next(iter(used.values())) < since:
            used.popitem(last=False)

    def clear(self) -> None:
        self._used.clear()


def events_complete(index: BlockIndex | None, now: float, ttl: float) -> bool:
    """Whether ``index`` alone says what its replica holds: its events have flowed, with
    nothing lost, for at least ``ttl`` (the approximate index's; before that, the replica may
    still hold what was routed there while they were not flowing, which only a
    :class:`RoutedIndex` knows)."""
    since = None if index is None else index.complete_since
    return since is not None and now - since >= ttl


def _ours(medium: str | None, group: int | None) -> bool:
    """An event about the GPU tier's first (or only) KV cache group: what a prompt hits."""
    return medium in (None, GPU_MEDIUM) and group in (None, 0)


# ------------------------------------------------------------------------------- sequence


SequenceVerdict = Literal["first", "next", "gap", "restart"]


@dataclass(slots=True)
class SequenceCheck:
    """The publisher's sequence numbers (0, 1, 2, ... from its start), as one subscriber saw
    them: :meth:`see` says what the next one means; :meth:`accept` moves on."""

    last: int | None = None

    def see(self, seq: int) -> SequenceVerdict:
        """``first``: nothing seen yet; ``next``: ``last + 1``; ``gap``: batches
        ``last + 1 .. seq - 1`` were missed; ``restart``: a number not after ``last``, which
        a publisher only sends when it started again (its engine restarted, its cache empty)."""
        if self.last is None:
            return "first"
        if seq == self.last + 1:
            return "next"
        if seq > self.last:
            return "gap"
        return "restart"

    def accept(self, seq: int) -> None:
        self.last = seq


# ------------------------------------------------------------------------------- the choice


def fresh_load(in_flight: int, ours_at_scrape: int, running: float, waiting: float) -> float:
    """A replica's load for ``cache_aware``, in requests: this process's count in flight now,
    exact, plus what its last scrape says the others have (the scraped count of running and
    waiting requests less this process's at that scrape), each request waiting in its engine
    counted ``WAITING_WEIGHT`` times over (a waiting one has not begun its prefill).

    Not upstream_metrics' score, which takes the scraped running count for the present: a
    scrape is up to an interval old, and with answers shorter than that its running count
    still holds requests that have ended, so the replica that served most lately looks
    busiest, and a request leaves the replica whose cache holds its conversation for a stale
    number."""
    others = max(0.0, running + waiting - ours_at_scrape)
    return in_flight + others + (WAITING_WEIGHT - 1) * waiting


# A request waiting in an engine's own queue, against one running (as upstream_metrics').
WAITING_WEIGHT = 4.0


@dataclass(frozen=True, slots=True)
class CachePick:
    """The candidate chosen and why: ``cache`` (credited with cached tokens) or ``load``
    (no candidate holds any of the prompt, or the one holding it is over the bound)."""

    index: int
    reason: Literal["cache", "load"]
    cached_tokens: int


def cache_aware_pick(
    loads: Sequence[float],
    cached_tokens: Sequence[int],
    *,
    cache_weight: float,
    max_load: float,
    pending_tokens: Sequence[int] | None = None,
) -> CachePick:
    """The candidate with the highest

        cache_weight x credited tokens / TOKENS_PER_WEIGHT - load

    where ``load`` is in requests (in flight, or the scraped queue) and the credited tokens
    are the prompt's leading tokens the candidate holds: ``cached_tokens`` (stored), or
    ``pending_tokens`` (sent there, their prefill not known to be done) where that is more
    than any candidate within the bound holds stored. A pending prefix saves its prefill only
    after a wait for the prefill in progress; a replica that holds it stored serves it without
    that wait, and one that holds none starts at once, prefilling in parallel: following a
    pending prefix while a replica holds it stored would queue the request behind a prefill
    for nothing it could not have at once elsewhere.

    A candidate :func:`overloaded` (over ``max_load`` x the mean load + 1) is credited with no
    cache at all: it wins only as the least loaded, so a hot prefix spreads instead of piling
    onto one replica. Ties go to the lower load, then to the earlier candidate (callers order
    them by the pick longest ago)."""
    if not loads or len(loads) != len(cached_tokens):
        raise ValueError("one load and one cached count per candidate, at least one")
    if pending_tokens is not None and len(pending_tokens) != len(loads):
        raise ValueError("one pending count per candidate")
    within = [not overloaded(load, loads, max_load) for load in loads]
    stored = max((c for c, ok in zip(cached_tokens, within, strict=True) if ok), default=0)
    best = 0
    best_score = best_load = 0.0
    best_credit = 0
    for i, (load, cached) in enumerate(zip(loads, cached_tokens, strict=True)):
        credit = 0
        if within[i]:
            pending = 0 if pending_tokens is None else pending_tokens[i]
            credit = pending if pending > max(cached, stored) else cached
        score = cache_weight * credit / TOKENS_PER_WEIGHT - load
        if i == 0 or score > best_score or (score == best_score and load < best_load):
            best, best_score, best_load, best_credit = i, score, load, credit
    return CachePick(best, "cache" if best_credit > 0 else "load", best_credit)
