"""Continuous batching: the running sequences of a local model are decoded together, one token
each per forward pass, and join and leave between steps.

Owns nothing async: the engine runs in one worker thread (``proxy/backends/local.py`` owns it)
and meets the requests' side only through each :class:`Generation`'s flags (``cancelled``,
``consumed``, set from the other side, then :meth:`BatchEngine.wake`; a pause or resume asked
with :meth:`BatchEngine.pause` / :meth:`BatchEngine.resume`) and the ``deliver`` callback,
called once per step with every sequence's new piece and the sequences that left.

The batch is one KV cache whose rows are the running sequences, right-aligned: every row's
positions end at the cache's last column, a shorter row is padded on the left, the padding is
masked out, and each row has its own position ids, so a row computes what it would alone.
Rows are added (a prefilled newcomer, a resumed sequence), removed (finished, cancelled,
parked) and their common padding trimmed by :mod:`inference.cache_rows`.

Per sequence:

* **leaving**: a cancelled sequence is removed before the next step starts, so it costs at
  most the step already running;
* **a slow reader**: a sequence whose reader is ``window`` pieces behind is *parked*: its row is
  taken out of the batch (its cache kept aside) and it is not stepped, so it neither grows
  memory nor slows the others; it rejoins when its reader has caught up to half the window.
  The request pipeline's stall limit is what finally evicts one whose client stops reading;
* **a joining prompt** is always prefilled in chunks, one chunk per step, so that every step is
  short: a cancel lands within one chunk, and a request that arrives meanwhile is prefilled
  between two chunks. Beside others (a running stream, a parked one, another prompt waiting)
  a chunk is ``prefill_chunk`` tokens, so their next token or chunk waits for a short one; alone,
  ``prefill_chunk_alone`` (larger: a forward pass has a fixed cost, and small chunks alone would
  give up prefill throughput for no one's sake). Waiting prompts are prefilled in the order
  they got their slots, except that one with more left than a chunk alone is passed over for
  those with less: a short prompt that arrives while a long one is being prefilled gets its
  first token within a few chunks (the long one still gets one turn in
  ``_MAX_PASSED_OVER + 1``). A resumed sequence whose KV was dropped is prefilled again the
  same way;
* **a shared prefix**: with a :class:`inference.prefix_cache.PrefixCache`, a joining prompt
  starts from the KV of the longest prefix it shares with a prompt or a sequence the engine
  finished before, and prefills only the rest. A prompt's KV is stored when its prefill is
  complete, a sequence's (prompt and answer) when it finishes; a cancelled one stores nothing
  more, so an entry is never half-written;
* **pausing**: so that an urgent request can take a running one's slot, :meth:`BatchEngine.pause`
  takes a sequence out wherever it is (decoding, parked, or part-way through its prefill) and
  keeps its KV aside; unlike a parked one, a paused sequence does not count toward capacity.
  :meth:`BatchEngine.resume` puts it back, ahead of waiting newcomers (first in the waiting
  line, when its prefill is not done), where it left off, so its client sees one answer with
  a gap in it. Every pause asked gets one notice (or the sequence ends): one asked after a
  resume the engine has not taken yet withdraws that resume.
  The KV kept for paused sequences is bounded (``paused_bytes``): past it, the KV of those
  paused longest ago is dropped (logged), and such a sequence is prefilled again (its prompt
  and answer so far) when it resumes, without drawing a token, so no text is repeated or lost;
  a recomputed KV is not bit-identical to the one decoding built, so its answer may differ
  from an uninterrupted one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Ids
from dataclasses import dataclass
from typing import Any, Protocol

from . import cache_rows
from .chunks import Usage
from .detokenize import IncrementalDetokenizer
from .prefix_cache import PrefixCache
from .sampling import GenerationResult, SamplingParams, penalize, sample
from .stops import StopMatcher

log = logging.getLogger("sluice.inference")

# How far (in pieces, one per token) a sequence may run ahead of its reader before it is
# parked. Small enough that a parked sequence holds little; large enough that an event loop
# busy for a few steps never parks anyone.
DEFAULT_WINDOW = 8

# A prefill chunk when nothing else runs or waits. Measured on SmolLM2-135M (int4, AMD EPYC, two
# threads; docs/local-model.md has the table): 128-token chunks prefill a 3,000-token prompt at
# 411 tokens/s, where the curve flattens (64: 392, 256: 402, 512: about 4% more; one pass over
# the whole prompt: 291), and each takes 0.20 s at the prompt's start, 0.34 s 2,000 tokens in.
# A larger chunk is a longer wait for a cancel or a newcomer (256: 0.41 to 0.68 s).
DEFAULT_PREFILL_CHUNK_ALONE = 128
# Prefill turns the first in the waiting line may be passed over in a row for shorter prompts
# (BatchEngine._next_to_prefill): a long prompt still gets one chunk in this many and one.
_MAX_PASSED_OVER = 4

# The KV kept for paused sequences, all together: SmolLM2-135M's KV is 30 layers x 2 x 3 heads
# x 64 x 4 bytes = 45 KiB a position in float32, so this keeps about 5,800 positions (a few
# long answers, or dozens of short ones) before the oldest pause is made to prefill again.
DEFAULT_PAUSED_BYTES = 256 * 2**20


@dataclass(slots=True)
class Piece:
    """What one step made for one sequence: its new text (possibly ""), the logprob entries of
    the tokens that text came from, and on its last piece the result (or the error)."""

    text: str = ""
    logprobs: list[dict[str, Any]] | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None
    # A notice, not a token: the sequence has just been paused (it made no text, and is not
    # counted in ``Generation.produced``, so a reader must not count it as consumed).
    paused: bool = False


class Generation:
    """One generation inside the engine. The requests' side sets ``cancelled`` and counts
    ``consumed``; everything else belongs to the engine thread."""

    def __init__(
        self,
        prompt_ids: Ids[int],
        params: SamplingParams,
        *,
        request_id: str = "",
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.request_id = request_id
        self.window = window
        # The requests' side writes these two (each is written by one thread only).
        self.cancelled = False
        self.consumed = 0
        # The engine's.
        self.produced = 0
        # Forward passes this sequence took part in (prefill chunks and decode steps).
        self.forward_passes = 0
        # (forward_passes, produced) as of the last pass the engine finished with this
        # sequence: one attribute, written at once, so that the requests' side reads both
        # counters from the same moment (reading the two fields could fall between a pass's
        # increments).
        self.progress = (0, 0)
        self.parked = False
        # Out of the batch by BatchEngine.pause, not counted toward capacity; the engine writes
        # it (True before the pause notice is delivered, False once the sequence is back).
        self.paused = False
        # What pause()/resume() last asked for, written under the engine's lock.
        self._pause_wanted = False
        # Whether resume() was asked since this sequence's last pause notice (under the
        # engine's lock): a pause asked after it is owed a notice of its own.
        self._resume_asked = False
        # Whether the pause last asked has been taken by a step (under the engine's lock):
        # from then on it can no longer be withdrawn (see BatchEngine.withdraw_pause).
        self._pause_taken = False
        # Bytes of the KV kept aside while paused (0 when none is kept or it was dropped).
        self.kept_bytes = 0
        # A paused sequence whose KV was dropped is prefilled again: these ids (its prompt and
        # its answer but the last token, which the next decode step feeds), up to _refilled.
        self._refill: list[int] | None = None
        self._refilled = 0
        # Prefill turns that went to another while this one was first in the waiting line.
        self._passed_over = 0
        self.generated: list[int] = []
        self.completion_tokens = 0
        self.step_seconds: list[float] = []
        self.slow_steps = 0
        self.prefilled = 0
        # Prompt tokens whose KV came from the prefix cache (not prefilled).
        self.reused = 0
        self.cache: Any = None  # its own, while prefilling, or parked or paused alone
        # Its rows taken out of a batch, while parked or paused.
        self.parked_rows: cache_rows.Rows | None = None
        self.started_prefill = 0.0
        self._detokenizer: IncrementalDetokenizer | None = None
        self._stops = StopMatcher(params.stop)
        self._rng: Any = None

    @property
    def unread(self) -> int:
        return self.produced - self.consumed

    @property
    def last_token(self) -> int:
        return self.generated[-1]


class Decoder(Protocol):
    """What the engine needs of a model's :class:`inference.generation.Generator`: the model,
    its end tokens, the text of ids, and a token's logprob entry."""

    model: Any
    eos_token_ids: frozenset[int]
    slow_step_seconds: float

    def decode(self, ids: Ids[int]) -> str: ...

    def logprob_entry(self, logits: Any, token: int, top: int) -> dict[str, Any]: ...


StepHook = Callable[[int, float], None]
Deliver = Callable[[list[tuple["Generation", Piece]], list["Generation"]], None]


class BatchEngine:
    def __init__(
        self,
        generator: Decoder,
        *,
        max_batch: int,
        deliver: Deliver,
        prefill_chunk: int = 32,
        prefill_chunk_alone: int = DEFAULT_PREFILL_CHUNK_ALONE,
        batching: bool = True,
        on_step: StepHook | None = None,
        on_prefill: Callable[[float], None] | None = None,
        prefix_cache: PrefixCache | None = None,
        paused_bytes: int = DEFAULT_PAUSED_BYTES,
    ) -> None:
        self.generator = generator
        self.model = generator.model
        self.max_batch = max_batch
        # Without cache editing (cache_rows.check failed) one sequence runs at a time.
        self.batching = batching
        self.capacity = max_batch if batching else 1
        self.prefill_chunk = max(1, prefill_chunk)
        self.prefill_chunk_alone = max(self.prefill_chunk, prefill_chunk_alone)
        self.deliver = deliver
        self.on_step = on_step
        self.on_prefill = on_prefill
        self.prefix_cache = prefix_cache
        self._prefix_checked = False
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._inbox: list[Generation] = []
        self._stopping = False
        # The engine thread's own state.
        self._waiting: deque[Generation] = deque()
        self._rows: list[Generation] = []
        self._starts: list[int] = []  # each row's first real column (left padding)
        self._cache: Any = None
        self._parked: list[Generation] = []
        # Oldest pause first: the order in which their KV is dropped past paused_bytes.
        self._paused: list[Generation] = []
        self.paused_bytes = paused_bytes
        self.paused_kv_bytes = 0
        # Paused sequences whose KV was dropped to stay within paused_bytes.
        self.paused_dropped = 0
        self.steps = 0
        # Decode steps slower than the generator's slow_step_seconds.
        self.slow_steps = 0

    # --- called from any thread ------------------------------------------------------------

    def submit(self, sequence: Generation) -> None:
        with self._wakeup:
            self._inbox.append(sequence)
            self._wakeup.notify()

    def wake(self) -> None:
        """A sequence's flags changed (cancelled, or its reader caught up)."""
        with self._wakeup:
            self._wakeup.notify()

    def pause(self, sequence: Generation) -> None:
        """Take ``sequence`` out of the batch at the start of the next step, keeping its KV
        aside and its slot free; ``deliver`` then hands over a ``Piece(paused=True)`` for it.
        Asked after :meth:`resume`, it gets a notice of its own even while that resume is
        still pending (the sequence then stays out, the resume withdrawn). A sequence that
        finishes in the step already running when this is called finishes (it gets no notice);
        one that has left, or is paused with no resume asked since its notice, is left as it
        is."""
        with self._wakeup:
            sequence._pause_wanted = True
            self._wakeup.notify()

    def withdraw_pause(self, sequence: Generation) -> bool:
        """Withdraw the pause last asked of ``sequence``, if no step has taken it yet: True,
        and no notice comes for it (it goes on as if it had not been asked, or it ends, or has
        left, as it would have anyway); False, and its notice comes (a step took the pause),
        or there was no pause to withdraw."""
        with self._wakeup:
            if not sequence._pause_wanted or sequence._pause_taken:
                return False
            sequence._pause_wanted = False
            return True

    def resume(self, sequence: Generation) -> None:
        """Put a paused ``sequence`` back as soon as there is room, ahead of waiting
        newcomers; asked before its pause took effect, the pause does not happen."""
        with self._wakeup:
            sequence._pause_wanted = False
            sequence._resume_asked = True
            sequence._pause_taken = False
            self._wakeup.notify()

    def unbatched(self) -> None:
        """Before :meth:`run`: the model's cache cannot be batched, so its sequences run one
        at a time, with no prefix cache (which takes rows out of a batch's cache)."""
        self.batching = False
        self.capacity = 1
        self.prefix_cache = None

    def stop(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def sequences(self) -> int:
        """Every sequence inside: decoding, parked, paused, or waiting for its prefill."""
        return (
            len(self._rows)
            + len(self._parked)
            + len(self._paused)
            + len(self._waiting)
            + len(self._inbox)
        )

    # --- the engine thread ---------------------------------------------------------------------

    def run(self) -> None:
        """Step until :meth:`stop`; then every sequence still inside leaves."""
        while True:
            with self._wakeup:
                while not self._stopping and not self._inbox and not self._has_work():
                    self._wakeup.wait()
                if self._stopping:
                    break
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            self.step()
        with self._lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()
        everyone = [*self._rows, *self._parked, *self._paused, *self._waiting]
        for sequence in self._paused:
            sequence.cache = sequence.parked_rows = None
        self._rows, self._starts, self._parked, self._paused, self._cache = [], [], [], [], None
        self.paused_kv_bytes = 0
        self._waiting.clear()
        if everyone:
            self.deliver([], everyone)

    def add(self, sequence: Generation) -> None:
        """For a caller that steps the engine itself (no thread): queue a sequence."""
        self._waiting.append(sequence)

    def _has_work(self) -> bool:
        inside = (*self._rows, *self._parked, *self._waiting)
        if any(sequence.cancelled or sequence._pause_wanted for sequence in inside):
            return True
        for sequence in self._paused:
            if sequence.cancelled:
                return True
            if sequence._pause_wanted:
                if sequence._resume_asked:
                    return True  # paused again before its resume was taken: a notice is due
            elif self._prefills(sequence) or self._room():
                return True
        if self._waiting and self._room():
            return True
        if self._rows:
            return True
        return any(self._may_resume(sequence) for sequence in self._parked)

    def _room(self) -> bool:
        return len(self._rows) + len(self._parked) < self.capacity

    @staticmethod
    def _may_resume(sequence: Generation) -> bool:
        return sequence.unread <= sequence.window // 2

    def step(self) -> None:
        """One iteration: drop the cancelled, park and resume, one decode step of the batch,
        then one prefill chunk of the waiting sequence whose turn it is; deliver what it
        made."""
        pieces: list[tuple[Generation, Piece]] = []
        gone: list[Generation] = []
        self._drop_cancelled(gone)
        notices = self._pause_and_resume()
        if gone or notices:
            # Their slots are free now, not after this step's forward pass.
            self.deliver(notices, gone)
            gone = []
        self._park_and_resume()
        if self._rows:
            self._decode(pieces, gone)
        if self._waiting and self._room():
            self._prefill(pieces, gone)
        if pieces or gone:
            self.deliver(pieces, gone)

    def _drop_cancelled(self, gone: list[Generation]) -> None:
        cancelled = [index for index, seq in enumerate(self._rows) if seq.cancelled]
        if cancelled:
            gone.extend(self._rows[index] for index in cancelled)
            self._remove_rows(set(cancelled))
        for holder in (self._parked, self._paused, self._waiting):
            for sequence in [seq for seq in holder if seq.cancelled]:
                holder.remove(sequence)
                sequence.cache = sequence.parked_rows = None
                sequence.kept_bytes = 0
                gone.append(sequence)
        self._count_paused()

    # --- pausing -----------------------------------------------------------------------------

    def _pause_and_resume(self) -> list[tuple[Generation, Piece]]:
        """Pause every sequence asked to pause (its notice returned), then put back those asked
        to resume, oldest pause first, while there is room."""
        notices: list[tuple[Generation, Piece]] = []
        # The asks, read at one moment. A pause asked after a resume is owed a notice even
        # when the resume is still pending here: whoever asked to resume has taken its slot
        # back already, and only a notice makes it give the slot up again. Answering it here,
        # rather than refusing such a pause on the requests' side, keeps where a paused
        # sequence stands known to this thread alone, and every pause asked is answered (a
        # notice, or the sequence's end).
        with self._lock:
            taking = {
                seq for seq in (*self._rows, *self._parked, *self._waiting) if seq._pause_wanted
            }
            again = [seq for seq in self._paused if seq._pause_wanted and seq._resume_asked]
            resuming = [seq for seq in self._paused if not seq._pause_wanted]
            for sequence in (*taking, *again):
                sequence._resume_asked = False
                sequence._pause_taken = True
        pausing = [index for index, seq in enumerate(self._rows) if seq in taking]
        for index in pausing:
            sequence = self._rows[index]
            if self.batching:
                sequence.parked_rows = cache_rows.take_row(self._cache, index, self._starts[index])
            else:
                # Without cache editing the batch is this one sequence: its cache is its own.
                sequence.cache = self._cache
            notices.append(self._paused_now(sequence))
        if pausing:
            self._remove_rows(set(pausing))
        for holder in (self._parked, self._waiting):
            for sequence in [seq for seq in holder if seq in taking]:
                holder.remove(sequence)
                if sequence.cache is not None and self.batching:
                    # Its rows, copied: exactly its KV (a cache's buffer has spare columns).
                    sequence.parked_rows = cache_rows.take_row(sequence.cache, 0, 0)
                    sequence.cache = None
                notices.append(self._paused_now(sequence))
        # Out already, its KV kept as it is: only the notice.
        notices.extend((sequence, Piece(paused=True)) for sequence in again)
        to_prefill: list[Generation] = []
        for sequence in resuming:
            if not self._prefills(sequence) and not self._room():
                continue
            self._paused.remove(sequence)
            sequence.paused = False
            sequence.kept_bytes = 0
            rows, sequence.parked_rows = sequence.parked_rows, None
            if self._prefills(sequence):
                if rows is not None:
                    sequence.cache = cache_rows.cache_from_rows(self.model.config, rows)
                to_prefill.append(sequence)
            elif sequence.unread >= sequence.window or (
                sequence.parked and not self._may_resume(sequence)
            ):
                # Its reader is still behind: it waits as any parked sequence does.
                sequence.parked = True
                sequence.parked_rows = rows
                self._parked.append(sequence)
            else:
                sequence.parked = False
                if rows is not None:
                    self._join(sequence, rows=rows)
                else:
                    cache, sequence.cache = sequence.cache, None
                    self._join(sequence, cache=cache)
        # Ahead of the waiting newcomers, in the order they were paused.
        self._waiting.extendleft(reversed(to_prefill))
        self._count_paused()
        return notices

    def _paused_now(self, sequence: Generation) -> tuple[Generation, Piece]:
        sequence.paused = True
        sequence.kept_bytes = _bytes_held(sequence)
        self._paused.append(sequence)
        self._count_paused()
        if self.paused_kv_bytes > self.paused_bytes:
            self._drop_paused_kv(sequence)
        return sequence, Piece(paused=True)

    def _drop_paused_kv(self, newest: Generation) -> None:
        """Back within paused_bytes: the newest pause's KV alone when it alone is over the
        bound, else the KV of those paused longest ago, until the rest fits."""
        if newest.kept_bytes > self.paused_bytes:
            dropping = [newest]
        else:
            dropping = []
            total = self.paused_kv_bytes
            for sequence in self._paused:
                if total <= self.paused_bytes:
                    break
                if sequence.kept_bytes:
                    dropping.append(sequence)
                    total -= sequence.kept_bytes
        for sequence in dropping:
            log.warning(
                "request %s: the %d bytes of KV kept for its pause are dropped (paused "
                "sequences may keep %d bytes together); it will be prefilled again when it "
                "resumes, and its output may differ from an uninterrupted run",
                sequence.request_id,
                sequence.kept_bytes,
                self.paused_bytes,
            )
            self.paused_dropped += 1
            sequence.kept_bytes = 0
            sequence.cache = sequence.parked_rows = None
            if sequence._refill is not None:
                sequence._refilled = 0
            elif sequence.generated:
                sequence._refill = [*sequence.prompt_ids, *sequence.generated[:-1]]
                sequence._refilled = 0
            else:
                # Part-way through its prompt: it starts that prefill again.
                sequence._detokenizer = None
                sequence.prefilled = sequence.reused = 0
        self._count_paused()

    @staticmethod
    def _prefills(sequence: Generation) -> bool:
        """Whether a paused sequence goes back to the waiting line (its prompt not prefilled
        yet, or its KV to be prefilled again) rather than into the batch."""
        return not sequence.generated or sequence._refill is not None

    def _count_paused(self) -> None:
        self.paused_kv_bytes = sum(sequence.kept_bytes for sequence in self._paused)

    def _park_and_resume(self) -> None:
        behind = [index for index, seq in enumerate(self._rows) if seq.unread >= seq.window]
        for index in behind:
            sequence = self._rows[index]
            sequence.parked = True
            if len(self._rows) == 1:
                sequence.cache = self._cache
            else:
                sequence.parked_rows = cache_rows.take_row(self._cache, index, self._starts[index])
            self._parked.append(sequence)
        if behind:
            self._remove_rows(set(behind))
        for sequence in [seq for seq in self._parked if self._may_resume(seq)]:
            self._parked.remove(sequence)
            sequence.parked = False
            if sequence.parked_rows is not None:
                rows, sequence.parked_rows = sequence.parked_rows, None
                self._join(sequence, rows=rows)
            else:
                cache, sequence.cache = sequence.cache, None
                self._join(sequence, cache=cache)

    def _remove_rows(self, indices: set[int]) -> None:
        if len(indices) == len(self._rows):
            self._rows, self._starts, self._cache = [], [], None
            return
        keep = cache_rows.remove_rows(self._cache, sorted(indices), len(self._rows))
        self._rows = [self._rows[index] for index in keep]
        self._starts = [self._starts[index] for index in keep]
        trim = min(self._starts)
        if trim:
            cache_rows.drop_left(self._cache, trim)
            self._starts = [start - trim for start in self._starts]

    def _join(
        self, sequence: Generation, *, cache: Any = None, rows: cache_rows.Rows | None = None
    ) -> None:
        """Add a sequence's cache (its own object, or rows taken out of a batch) as a row."""
        if self._cache is None:
            if cache is None:
                assert rows is not None
                cache = cache_rows.cache_from_rows(self.model.config, rows)
            self._cache = cache
            self._rows, self._starts = [sequence], [0]
            return
        added = rows if rows is not None else cache_rows.rows_of(cache)
        old_pad, new_pad = cache_rows.append_rows(self._cache, added)
        self._starts = [start + old_pad for start in self._starts] + [new_pad]
        self._rows.append(sequence)

    def _decode(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        import torch

        rows = self._rows
        started = time.perf_counter()
        try:
            width = cache_rows.length(self._cache)
            mask = None
            if any(self._starts):
                mask = torch.ones(len(rows), width + 1, dtype=torch.long)
                for index, start in enumerate(self._starts):
                    mask[index, :start] = 0
            with torch.inference_mode():
                output = self.model(
                    input_ids=torch.tensor([[seq.last_token] for seq in rows], dtype=torch.long),
                    position_ids=torch.tensor(
                        [[width - start] for start in self._starts], dtype=torch.long
                    ),
                    attention_mask=mask,
                    cache=self._cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                self._cache = output.cache
                logits = output.logits[:, -1]
                finished = set()
                made = []
                for index, sequence in enumerate(rows):
                    piece = self._advance(sequence, logits[index])
                    made.append((sequence, piece))
                    if piece.result is not None:
                        finished.add(index)
        except Exception as error:  # noqa: BLE001 - the engine thread: no trio.Cancelled here
            self._fail(rows, error, pieces, gone)
            self._rows, self._starts, self._cache = [], [], None
            return
        elapsed = time.perf_counter() - started
        self.steps += 1
        if elapsed > self.generator.slow_step_seconds:
            self.slow_steps += 1
        for sequence, piece in made:
            sequence.forward_passes += 1
            sequence.progress = (sequence.forward_passes, sequence.produced)
            self._timed(sequence, elapsed)
            if piece.result is not None:
                piece.result.step_seconds = sequence.step_seconds
                piece.result.slow_steps = sequence.slow_steps
            pieces.append((sequence, piece))
        if finished:
            gone.extend(rows[index] for index in sorted(finished))
            self._store_finished(finished)
            self._remove_rows(finished)
        if self.on_step is not None:
            self.on_step(len(rows), elapsed)

    def _store_finished(self, finished: set[int]) -> None:
        """Each finished row's KV (its prompt and its answer but the last token, which was
        never fed back) into the prefix cache, copied out before the rows are removed."""
        if self.prefix_cache is None:
            return
        for index in sorted(finished):
            sequence = self._rows[index]
            ids = [*sequence.prompt_ids, *sequence.generated[:-1]]
            self.prefix_cache.store(
                ids, cache_rows.take_row(self._cache, index, self._starts[index])
            )

    def _cache_checked(self, cache: Any) -> bool:
        """Whether the prefix cache may keep this model's caches: with batching, checked at
        start-up (:func:`inference.cache_rows.check`); alone, on the first prompt's cache."""
        if self.batching and self.capacity > 1:
            return True
        if not self._prefix_checked:
            self._prefix_checked = True
            reason = cache_rows.check_cache(cache)
            if reason is not None:
                log.warning("the prefix cache is off: %s", reason)
                self.prefix_cache = None
                return False
        return True

    def _start_prefill(self, sequence: Generation) -> None:
        """A waiting sequence's first chunk is next: its detokenizer and draw, and the KV of
        the prefix it shares with an entry of the prefix cache (copied by the first chunk's
        update, so the entry stays as it is)."""
        import torch

        sequence.started_prefill = time.perf_counter()
        sequence._detokenizer = IncrementalDetokenizer(self.generator.decode)
        if sequence.params.seed is not None:
            sequence._rng = torch.Generator().manual_seed(sequence.params.seed)
        if self.prefix_cache is None:
            return
        shared, rows = self.prefix_cache.lookup(sequence.prompt_ids)
        if rows is not None:
            sequence.cache = cache_rows.cache_from_rows(self.model.config, rows)
            sequence.prefilled = sequence.reused = shared

    def _timed(self, sequence: Generation, elapsed: float) -> None:
        sequence.step_seconds.append(elapsed)
        limit = self.generator.slow_step_seconds
        if elapsed > limit:
            sequence.slow_steps += 1
            if sequence.slow_steps == 1:
                # Once per request: a slow step is the symptom (memory pressure, swapping, a
                # noisy neighbour), not something to log per token.
                log.warning(
                    "request %s: decode step took %.2fs (threshold %.2fs, batch of %d)",
                    sequence.request_id,
                    elapsed,
                    limit,
                    len(self._rows),
                )

    def _chunk_size(self) -> int:
        """The next prefill chunk's tokens: larger when no other sequence waits for this step
        (none decoding, parked or waiting for its own prefill)."""
        if self._rows or self._parked or len(self._waiting) > 1:
            return self.prefill_chunk
        return self.prefill_chunk_alone

    def _next_to_prefill(self) -> Generation:
        """The waiting sequence whose chunk is next. The waiting line is in the order the
        requests got their slots (the scheduler's), and its first goes on, unless it has more
        left to prefill than one chunk alone: then the one with the least left (the first among
        equals), so that a short prompt arriving while a long one is being prefilled goes
        between two of its chunks rather than after them all. The first is passed over at most
        ``_MAX_PASSED_OVER`` turns in a row, so that short prompts arriving one after another
        cannot hold a long one back for ever."""
        waiting = self._waiting
        first = waiting[0]
        if (
            _left_to_prefill(first) <= self.prefill_chunk_alone
            or first._passed_over >= _MAX_PASSED_OVER
        ):
            chosen = first
        else:
            chosen = min(waiting, key=_left_to_prefill)
        first._passed_over = 0 if chosen is first else first._passed_over + 1
        return chosen

    def _prefill(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        import torch

        sequence = self._next_to_prefill()
        if sequence._refill is not None:
            self._prefill_again(sequence, gone, pieces)
            return
        prompt = sequence.prompt_ids
        if sequence._detokenizer is None:
            self._start_prefill(sequence)
        chunk = prompt[sequence.prefilled : sequence.prefilled + self._chunk_size()]
        try:
            with torch.inference_mode():
                output = self._forward_chunk(sequence, chunk)
                sequence.cache = output.cache
                sequence.prefilled += len(chunk)
                sequence.forward_passes += 1
                if sequence.prefilled < len(prompt):
                    sequence.progress = (sequence.forward_passes, sequence.produced)
                    return
                self._waiting.remove(sequence)
                piece = self._advance(sequence, output.logits[0, -1])
                sequence.progress = (sequence.forward_passes, sequence.produced)
        except Exception as error:  # noqa: BLE001 - the engine thread: no trio.Cancelled here
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            sequence.cache = None
            self._fail([sequence], error, pieces, gone)
            return
        seconds = time.perf_counter() - sequence.started_prefill
        sequence.step_seconds.append(seconds)
        if self.on_prefill is not None:
            self.on_prefill(seconds)
        pieces.append((sequence, piece))
        cache, sequence.cache = sequence.cache, None
        if self.prefix_cache is not None and self._cache_checked(cache):
            self.prefix_cache.store(
                prompt,
                [(keys.clone(), values.clone()) for keys, values in cache_rows.rows_of(cache)],
            )
        if piece.result is not None:
            piece.result.step_seconds = sequence.step_seconds
            gone.append(sequence)
            return
        self._join(sequence, cache=cache)

    def _prefill_again(
        self, sequence: Generation, gone: list[Generation], pieces: list[tuple[Generation, Piece]]
    ) -> None:
        """One chunk of prefilling again a resumed sequence whose KV was dropped. Nothing is
        drawn at its end: the sequence's last token is not in that KV, and its next decode
        step feeds it, as it would have without the pause."""
        import torch

        ids = sequence._refill
        assert ids is not None
        if sequence._refilled == 0 and sequence.cache is None and self.prefix_cache is not None:
            shared, rows = self.prefix_cache.lookup(ids)
            if rows is not None:
                sequence.cache = cache_rows.cache_from_rows(self.model.config, rows)
                sequence._refilled = shared
        chunk = ids[sequence._refilled : sequence._refilled + self._chunk_size()]
        try:
            with torch.inference_mode():
                output = self._forward_chunk(sequence, chunk)
        except Exception as error:  # noqa: BLE001 - the engine thread: no trio.Cancelled here
            self._waiting.remove(sequence)
            sequence.cache = None
            self._fail([sequence], error, pieces, gone)
            return
        sequence.cache = output.cache
        sequence._refilled += len(chunk)
        sequence.forward_passes += 1
        sequence.progress = (sequence.forward_passes, sequence.produced)
        if sequence._refilled < len(ids):
            return
        self._waiting.remove(sequence)
        sequence._refill, sequence._refilled = None, 0
        cache, sequence.cache = sequence.cache, None
        self._join(sequence, cache=cache)

    def _forward_chunk(self, sequence: Generation, chunk: Ids[int]) -> Any:
        """One prefill chunk of ``sequence`` on its own cache (under inference mode)."""
        import torch

        return self.model(
            input_ids=torch.tensor([list(chunk)], dtype=torch.long),
            cache=sequence.cache,
            use_cache=True,
            logits_to_keep=1,
        )

    def _fail(
        self,
        sequences: list[Generation],
        error: Exception,
        pieces: list[tuple[Generation, Piece]],
        gone: list[Generation],
    ) -> None:
        log.error("local generation failed: %s: %s", type(error).__name__, error)
        for sequence in sequences:
            sequence.produced += 1
            sequence.progress = (sequence.forward_passes, sequence.produced)
            pieces.append((sequence, Piece(error=error)))
            gone.append(sequence)

    def _advance(self, sequence: Generation, logits: Any) -> Piece:
        """Sample this sequence's next token from its logits; its piece (the last one, with
        the result, when the sequence ends here)."""
        params = sequence.params
        generator = self.generator
        if params.penalized:
            logits = penalize(logits, params, sequence.prompt_ids, sequence.generated)
        token = sample(logits, params, sequence._rng)
        sequence.generated.append(token)
        sequence.produced += 1
        piece = Piece()
        if params.logprobs is not None:
            piece.logprobs = [generator.logprob_entry(logits, token, params.logprobs)]
        detokenizer = sequence._detokenizer
        assert detokenizer is not None
        stops = sequence._stops
        if token in generator.eos_token_ids and not params.ignore_eos:
            finish = "stop"
        else:
            sequence.completion_tokens += 1
            piece.text, stopped = stops.push(detokenizer.push(token))
            if stopped:
                finish = "stop"
            elif sequence.completion_tokens >= params.max_tokens:
                finish = "length"
            else:
                return piece
        stop_hit = stops.matched is not None
        if not stop_hit:
            # The detokenizer may hold the bytes of an unfinished character (dropped), and
            # the matcher text that could have begun a stop string; neither is coming now.
            tail, stop_hit = stops.push(detokenizer.flush())
            if stop_hit:
                finish = "stop"
            else:
                tail += stops.flush()
            piece.text += tail
        piece.result = GenerationResult(
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=len(sequence.prompt_ids),
                completion_tokens=sequence.completion_tokens,
            ),
            stop_sequence=stops.matched if stop_hit else None,
        )
        return piece


def _left_to_prefill(sequence: Generation) -> int:
    if sequence._refill is not None:
        return len(sequence._refill) - sequence._refilled
    return len(sequence.prompt_ids) - sequence.prefilled


def _bytes_held(sequence: Generation) -> int:
    """The bytes of the KV a sequence holds aside: its rows, or its own cache's tensors (each
    storage once: a cache's layers are views of buffers with spare columns)."""
    if sequence.parked_rows is not None:
        tensors = [tensor for pair in sequence.parked_rows for tensor in pair]
    elif sequence.cache is not None:
        tensors = [
            tensor
            for layer in getattr(sequence.cache, "layers", ())
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if tensor is not None and hasattr(tensor, "untyped_storage")
        ]
    else:
        return 0
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage() for tensor in tensors}
    return sum(storage.nbytes() for storage in storages.values())


def run_alone(
    generator: Decoder,
    prompt_ids: Ids[int],
    params: SamplingParams,
    *,
    emit: Callable[[str], None],
    checkpoint: Callable[[], None],
    request_id: str = "",
    on_logprob: Callable[[dict[str, Any]], None] | None = None,
) -> GenerationResult:
    """One sequence through the engine's steps, in the calling thread: ``checkpoint`` before
    each model step (it raises to stop), ``emit`` with each piece of text."""
    made: list[Piece] = []
    engine = BatchEngine(
        generator,
        max_batch=1,
        batching=False,
        deliver=lambda pieces, _: made.extend(piece for _, piece in pieces),
    )
    engine.add(Generation(prompt_ids, params, request_id=request_id, window=1 << 62))
    while True:
        checkpoint()
        engine.step()
        for piece in made:
            if piece.error is not None:
                raise piece.error
            if piece.logprobs and on_logprob is not None:
                for entry in piece.logprobs:
                    on_logprob(entry)
            if piece.text:
                emit(piece.text)
            if piece.result is not None:
                return piece.result
        made.clear()
