"""Pausing in the batch engine, over the tiny random Llama (float32) with the real SmolLM2
tokenizer, stepped by hand: a paused sequence frees its slot, and once resumed it makes token for
token what it makes uninterrupted; its notice comes once and is not a token; a pause asked after
a resume the engine has not taken yet gets a notice of its own; a pause no step has taken yet can
be withdrawn; it can be cancelled or shut down while paused; and the KV kept for paused
sequences stays under its bound, the oldest pause prefilling again when it resumes."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from inference.batching import BatchEngine, Generation, Piece
from inference.detokenize import IncrementalDetokenizer
from inference.generation import Generator
from inference.loading import LoadedModel
from inference.prefix_cache import PrefixCache
from inference.sampling import SamplingParams
from tests.inference.test_batching import PROMPTS, Harness
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


class Rig(Harness):
    """An engine stepped by hand: each sequence's pieces, its pause notices (not counted as
    read, as a reader must not count them), its result and its leaving."""

    run_limit = 300

    def __init__(
        self,
        generator: Generator,
        *,
        max_batch: int = 4,
        prefill_chunk: int = 8,
        paused_bytes: int = 1 << 30,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.notices: dict[Generation, int] = {}
        super().__init__(
            generator,
            max_batch,
            prefill_chunk,
            paused_bytes=paused_bytes,
            prefix_cache=prefix_cache,
        )

    def deliver(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        made = []
        for sequence, piece in pieces:
            assert piece.error is None, piece.error
            if piece.paused:
                assert sequence.paused  # set before the notice is handed over
                assert piece.text == "" and piece.result is None
                self.notices[sequence] = self.notices.get(sequence, 0) + 1
                continue
            made.append((sequence, piece))
        super().deliver(made, gone)

    def start(self, prompt: str, **kwargs: Any) -> Generation:
        sequence = Generation(self.generator.text_prompt(prompt), GREEDY, **kwargs)
        self.engine.add(sequence)
        return sequence

    def tokens(self, sequence: Generation) -> int:
        return len(self.texts.get(sequence, []))

    def until(self, condition: Any, limit: int = 100) -> None:
        for _ in range(limit):
            if condition():
                return
            self.engine.step()
        raise AssertionError("never")


@pytest.fixture(scope="module")
def generator(tiny_loaded_model: LoadedModel) -> Generator:
    return Generator(tiny_loaded_model)


@pytest.fixture(scope="module")
def reference(generator: Generator) -> dict[str, tuple[list[int], str]]:
    """Each prompt's token ids and text, uninterrupted, all in one batch."""
    rig = Rig(generator)
    sequences = {prompt: rig.start(prompt) for prompt in PROMPTS}
    rig.run(list(sequences.values()))
    return {prompt: (seq.generated, rig.text(seq)) for prompt, seq in sequences.items()}


def text_of(generator: Generator, ids: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(generator.decode)
    return "".join(detokenizer.push(token) for token in ids) + detokenizer.flush()


def same_as_uninterrupted(
    rig: Rig, sequence: Generation, prompt: str, reference: dict[str, tuple[list[int], str]]
) -> None:
    assert (sequence.generated, rig.text(sequence)) == reference[prompt]
    result = rig.results[sequence].result
    assert result is not None and result.finish_reason == "length"
    assert result.usage.prompt_tokens == len(sequence.prompt_ids)
    assert result.usage.completion_tokens == GREEDY.max_tokens
    assert sequence.produced == GREEDY.max_tokens == rig.tokens(sequence)


def test_a_paused_sequence_frees_its_slot_and_resumes_where_it_stopped(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=1)
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 5)
    rig.engine.pause(first)
    rig.engine.step()
    assert first.paused and rig.notices[first] == 1
    assert rig.engine.batch_size == 0 and rig.engine.sequences == 1
    assert rig.engine.paused_kv_bytes == first.kept_bytes > 0
    # With max_batch=1, another sequence runs while the first is paused.
    second = rig.start(PROMPTS[1])
    for _ in range(6):
        rig.engine.step()
    assert rig.tokens(second) == 6 and rig.tokens(first) == 5
    assert rig.engine.batch_size == 1 and rig.engine.sequences == 2
    rig.engine.resume(first)
    rig.run([second])
    # It waited for the slot, then came back ahead of a newcomer.
    third = rig.start(PROMPTS[2])
    rig.engine.step()
    assert not first.paused and rig.engine.paused_kv_bytes == 0
    assert rig.tokens(third) == 0
    rig.run([first, third])
    for sequence, prompt in ((first, PROMPTS[0]), (second, PROMPTS[1]), (third, PROMPTS[2])):
        same_as_uninterrupted(rig, sequence, prompt, reference)
    assert rig.notices == {first: 1}
    assert rig.engine.paused_dropped == 0


def test_two_of_three_paused_and_resumed_each_make_what_they_make_uninterrupted(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=3)
    sequences = [rig.start(prompt) for prompt in PROMPTS[:3]]
    rig.until(lambda: rig.engine.batch_size == 3)
    rig.engine.step()
    rig.engine.pause(sequences[1])
    rig.engine.step()
    rig.engine.step()
    rig.engine.pause(sequences[0])
    rig.engine.step()
    assert rig.engine.batch_size == 1
    newcomer = rig.start(PROMPTS[3])  # a long prompt: its chunks run beside the batch
    rig.until(lambda: rig.tokens(newcomer) > 0)
    assert rig.engine.batch_size == 2 and rig.engine.sequences == 4
    rig.engine.resume(sequences[1])
    rig.engine.resume(sequences[0])
    rig.engine.step()
    # The one paused first had room at once; the other waits for it.
    assert rig.engine.batch_size == 3 and not sequences[1].paused and sequences[0].paused
    rig.run([*sequences, newcomer])
    for sequence, prompt in zip([*sequences, newcomer], PROMPTS, strict=True):
        same_as_uninterrupted(rig, sequence, prompt, reference)
    assert rig.notices == {sequences[1]: 1, sequences[0]: 1}


def test_a_sequence_paused_part_way_through_its_prefill_goes_on_from_there(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=2, prefill_chunk=8)
    running = rig.start(PROMPTS[0])
    rig.engine.step()
    long = rig.start(PROMPTS[3])
    rig.engine.step()
    rig.engine.step()
    done = long.prefilled
    assert 0 < done < len(long.prompt_ids)
    rig.engine.pause(long)
    rig.engine.step()
    assert long.paused and long.kept_bytes > 0 and rig.notices[long] == 1
    # Its slot goes to a newcomer, prefilled at once beside the running one.
    newcomer = rig.start(PROMPTS[2])
    rig.engine.step()
    assert rig.engine.batch_size == 2 and long.prefilled == done
    rig.engine.resume(long)
    rig.run([running, newcomer, long])
    # Its prefill went on from where it stopped: no chunk was fed twice (once alone, the rest
    # of this prompt goes in one larger chunk).
    chunks = -(-len(long.prompt_ids) // 8)
    assert long.prefilled == len(long.prompt_ids)
    assert long.forward_passes <= chunks + GREEDY.max_tokens - 1
    for sequence, prompt in ((running, PROMPTS[0]), (newcomer, PROMPTS[2]), (long, PROMPTS[3])):
        same_as_uninterrupted(rig, sequence, prompt, reference)


def test_the_notice_comes_once_and_is_not_a_token(generator: Generator) -> None:
    rig = Rig(generator)
    slow = rig.start(PROMPTS[0], window=4)
    other = rig.start(PROMPTS[2])
    rig.reading = lambda sequence: sequence is not slow
    rig.until(lambda: slow.parked)
    assert slow.unread == 4
    # Paused while parked: it leaves the parked list, and capacity.
    rig.engine.pause(slow)
    rig.engine.step()
    produced, progress = slow.produced, slow.progress
    for _ in range(4):
        rig.engine.step()
    assert rig.notices[slow] == 1
    assert (slow.produced, slow.unread, slow.progress) == (produced, 4, progress)
    assert rig.engine._room() and rig.engine.batch_size == 1
    # Resumed while its reader is still behind: parked again, as before the pause.
    rig.engine.resume(slow)
    rig.engine.step()
    assert slow.parked and not slow.paused and slow.produced == produced
    slow.consumed = slow.produced
    rig.reading = lambda _: True
    rig.run([slow, other])
    assert slow.produced == rig.tokens(slow) == GREEDY.max_tokens
    assert rig.notices == {slow: 1}


def test_a_pause_withdrawn_before_the_step_or_asked_after_the_end_does_nothing(
    generator: Generator,
) -> None:
    rig = Rig(generator)
    sequence = rig.start(PROMPTS[2])
    rig.engine.step()
    rig.engine.pause(sequence)
    rig.engine.resume(sequence)
    rig.run([sequence])
    rig.engine.pause(sequence)  # it has left
    rig.engine.step()
    assert rig.notices == {} and rig.engine.sequences == 0


def test_a_pause_can_be_withdrawn_until_a_step_has_taken_it(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=1)
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 3)
    # Asked, then withdrawn before the next step: no pause, no notice.
    rig.engine.pause(first)
    assert rig.engine.withdraw_pause(first)
    rig.until(lambda: rig.tokens(first) == 5, limit=3)
    assert rig.notices == {} and not first.paused
    # Asked, and taken by a step: too late, it is paused and its notice comes.
    rig.engine.pause(first)
    rig.engine.step()
    assert not rig.engine.withdraw_pause(first)
    assert rig.notices == {first: 1} and first.paused
    # Resumed, then asked again before the engine has taken the resume: withdrawn, the
    # resume goes ahead, with no notice of its own.
    rig.engine.resume(first)
    rig.engine.pause(first)
    assert rig.engine.withdraw_pause(first)
    rig.run([first])
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    assert rig.notices == {first: 1}
    assert not rig.engine.withdraw_pause(first)  # it has left


def test_a_pause_asked_before_the_engine_takes_a_resume_gets_a_notice_of_its_own(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=1)
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 5)
    rig.engine.pause(first)
    rig.engine.step()
    # Asked again with no resume between: its one notice stands for both.
    rig.engine.pause(first)
    rig.engine.step()
    assert rig.notices == {first: 1}
    # Its request holds a slot again and asks to resume; a more urgent request's pause comes
    # before the engine's next step has taken that resume.
    rig.engine.resume(first)
    rig.engine.pause(first)
    assert rig.engine._has_work()  # an engine thread waiting for work wakes for it
    rig.until(lambda: rig.notices[first] == 2, limit=5)
    assert first.paused and rig.engine.batch_size == 0 and rig.tokens(first) == 5
    assert first.kept_bytes > 0 and rig.engine.paused_kv_bytes == first.kept_bytes
    # The resume was withdrawn: it stays out until asked again, its notice not repeated.
    for _ in range(3):
        rig.engine.step()
    assert not rig.engine._has_work()
    assert rig.notices == {first: 2} and rig.tokens(first) == 5
    rig.engine.resume(first)
    rig.run([first])
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    assert rig.notices == {first: 2} and rig.engine.sequences == 0


def test_a_resume_waiting_for_room_is_withdrawn_by_a_pause_with_a_notice(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=1)
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 3)
    rig.engine.pause(first)
    rig.engine.step()
    second = rig.start(PROMPTS[2])
    rig.until(lambda: rig.tokens(second) == 2)
    # max_batch=1: its resume waits for the second one's row.
    rig.engine.resume(first)
    rig.engine.step()
    assert first.paused and rig.tokens(first) == 3
    rig.engine.pause(first)
    rig.until(lambda: rig.notices[first] == 2, limit=5)
    rig.run([second])
    # The row is free now, but its resume was withdrawn: it stays out.
    for _ in range(3):
        rig.engine.step()
    assert first.paused and rig.tokens(first) == 3 and rig.engine.sequences == 1
    rig.engine.resume(first)
    rig.run([first])
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    same_as_uninterrupted(rig, second, PROMPTS[2], reference)
    assert rig.notices == {first: 2}


def test_a_sequence_resumed_then_paused_again_gets_one_notice_a_pause(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator, max_batch=2)
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 2)
    for pauses in (1, 2, 3):
        rig.engine.pause(first)
        rig.engine.step()
        assert rig.notices[first] == pauses and first.paused
        made = rig.tokens(first)
        rig.engine.resume(first)
        rig.until(lambda made=made: rig.tokens(first) > made, limit=5)
        assert not first.paused
    rig.run([first])
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    assert rig.notices == {first: 3}


def test_a_paused_sequence_cancelled_leaves_at_once(generator: Generator) -> None:
    rig = Rig(generator)
    leaving = rig.start(PROMPTS[0])
    staying = rig.start(PROMPTS[2])
    rig.until(lambda: rig.tokens(leaving) == 3)
    rig.engine.pause(leaving)
    rig.engine.step()
    assert rig.engine.paused_kv_bytes > 0
    made = rig.tokens(leaving)
    leaving.cancelled = True
    rig.engine.wake()
    rig.engine.step()
    assert leaving in rig.gone and rig.tokens(leaving) == made
    assert leaving.parked_rows is None and leaving.cache is None
    assert rig.engine.paused_kv_bytes == 0
    rig.run([staying])
    assert rig.engine.sequences == 0


def test_shutdown_hands_back_paused_sequences(generator: Generator) -> None:
    rig = Rig(generator)
    paused = rig.start(PROMPTS[0])
    running = rig.start(PROMPTS[2])
    rig.until(lambda: rig.tokens(paused) == 2)
    rig.engine.pause(paused)
    rig.engine.step()
    rig.engine.stop()
    rig.engine.run()  # stopped already: every sequence still inside leaves
    assert set(rig.gone) == {paused, running}
    assert rig.engine.sequences == 0 and rig.engine.paused_kv_bytes == 0


def test_past_the_bound_the_oldest_paused_kv_is_dropped_and_prefilled_again(
    generator: Generator,
    reference: dict[str, tuple[list[int], str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(generator, max_batch=3)
    oldest = rig.start(PROMPTS[0], request_id="req-oldest")
    newer = rig.start(PROMPTS[1], request_id="req-newer")
    other = rig.start(PROMPTS[2])
    rig.until(lambda: rig.tokens(oldest) == 6)
    rig.engine.pause(oldest)
    rig.engine.step()
    kept = oldest.kept_bytes
    # Room for the newer one's KV alone, not for both.
    per_position = kept // (len(oldest.prompt_ids) + len(oldest.generated) - 1)
    newer_bytes = per_position * (len(newer.prompt_ids) + len(newer.generated) - 1)
    rig.engine.paused_bytes = newer_bytes + kept // 2
    rig.engine.pause(newer)
    with caplog.at_level(logging.WARNING, logger="sluice.inference"):
        rig.engine.step()
    assert rig.engine.paused_dropped == 1
    assert oldest.kept_bytes == 0 and newer.kept_bytes > 0
    assert rig.engine.paused_kv_bytes == newer.kept_bytes == newer_bytes
    [warning] = [record for record in caplog.records if record.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "req-oldest" in message and str(kept) in message
    assert str(rig.engine.paused_bytes) in message and "prefilled again" in message
    made = rig.tokens(oldest)
    rig.engine.resume(oldest)
    rig.engine.resume(newer)
    rig.run([oldest, newer, other])
    for sequence in (oldest, newer):
        result = rig.results[sequence].result
        assert result is not None
        assert result.usage.prompt_tokens == len(sequence.prompt_ids)
        assert result.usage.completion_tokens == GREEDY.max_tokens == rig.tokens(sequence)
        assert sequence.produced == len(sequence.generated) == GREEDY.max_tokens
    # Up to the pause it is the uninterrupted answer; after it, its text is the text of its
    # tokens, neither repeated nor lost (its detokenizer went on).
    assert oldest.generated[:made] == reference[PROMPTS[0]][0][:made]
    assert rig.text(oldest) == text_of(generator, oldest.generated)
    # Kept KV is exact: the newer one makes what it makes uninterrupted.
    same_as_uninterrupted(rig, newer, PROMPTS[1], reference)
    same_as_uninterrupted(rig, other, PROMPTS[2], reference)


def test_a_pause_alone_over_the_bound_drops_its_own_kv(
    generator: Generator, caplog: pytest.LogCaptureFixture
) -> None:
    cache = PrefixCache(1 << 26)
    rig = Rig(generator, max_batch=2, prefill_chunk=8, paused_bytes=1, prefix_cache=cache)
    running = rig.start(PROMPTS[0])
    rig.engine.step()
    # One paused decoding, one paused part-way through its prefill: both keep nothing.
    decoding = rig.start(PROMPTS[1], request_id="req-decoding")
    rig.until(lambda: rig.tokens(decoding) == 4)
    prefilling = rig.start(PROMPTS[3], request_id="req-prefilling")
    rig.until(lambda: prefilling.prefilled > 0)
    with caplog.at_level(logging.WARNING, logger="sluice.inference"):
        rig.engine.pause(decoding)
        rig.engine.step()
        rig.engine.pause(prefilling)
        rig.engine.step()
    assert rig.engine.paused_dropped == 2 and rig.engine.paused_kv_bytes == 0
    named = [record.getMessage() for record in caplog.records]
    assert any("req-decoding" in message for message in named)
    assert any("req-prefilling" in message for message in named)
    hits = cache.hits
    rig.engine.resume(decoding)
    rig.engine.resume(prefilling)
    rig.run([running, decoding, prefilling])
    assert cache.hits > hits  # the re-prefill started from the stored prompt
    for sequence in (decoding, prefilling):
        result = rig.results[sequence].result
        assert result is not None
        assert result.usage.prompt_tokens == len(sequence.prompt_ids)
        assert result.usage.completion_tokens == GREEDY.max_tokens == rig.tokens(sequence)


def test_a_resumed_sequence_whose_kv_was_dropped_is_prefilled_again_in_chunks(
    generator: Generator,
) -> None:
    rig = Rig(generator, max_batch=1, paused_bytes=1)
    rig.engine.prefill_chunk_alone = 16
    sequence = rig.start(PROMPTS[3])
    rig.until(lambda: rig.tokens(sequence) == 4)
    rig.engine.pause(sequence)
    rig.engine.step()
    assert sequence.paused and sequence.kept_bytes == 0 and rig.engine.paused_dropped == 1
    rig.engine.resume(sequence)
    passes = sequence.forward_passes
    rig.engine.step()
    # Its prompt and answer but the last token, a chunk a step, alone as it is.
    again = len(sequence.prompt_ids) + 3
    assert again > 2 * 16
    assert sequence.forward_passes == passes + 1 and rig.tokens(sequence) == 4
    rig.until(lambda: rig.tokens(sequence) == 5)
    assert sequence.forward_passes - passes == -(-again // 16) + 1
    rig.run([sequence])
    assert rig.results[sequence].result is not None
    assert rig.tokens(sequence) == GREEDY.max_tokens


def test_without_cache_editing_a_pause_keeps_the_sequences_own_cache(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    rig = Rig(generator)
    rig.engine = BatchEngine(
        generator, max_batch=4, batching=False, deliver=rig.deliver, paused_bytes=1 << 30
    )
    first = rig.start(PROMPTS[0])
    rig.until(lambda: rig.tokens(first) == 4)
    rig.engine.pause(first)
    rig.engine.step()
    assert first.cache is not None and first.kept_bytes > 0
    second = rig.start(PROMPTS[2])
    rig.until(lambda: rig.tokens(second) == 3)
    rig.engine.resume(first)
    rig.run([first, second])
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    same_as_uninterrupted(rig, second, PROMPTS[2], reference)


def test_pause_and_resume_from_another_thread_wake_the_engine(
    generator: Generator, reference: dict[str, tuple[list[int], str]]
) -> None:
    import threading

    rig = Rig(generator, max_batch=1)
    events = {name: threading.Event() for name in ("paused", "second", "first")}
    first = Generation(generator.text_prompt(PROMPTS[0]), GREEDY)
    second = Generation(generator.text_prompt(PROMPTS[2]), GREEDY)
    recorded = rig.deliver

    def deliver(pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        recorded(pieces, gone)
        if rig.tokens(first) == 3 and not events["paused"].is_set():
            rig.engine.pause(first)  # asked between steps, as the requests' side would
        if first.paused:
            events["paused"].set()
        for sequence, name in ((first, "first"), (second, "second")):
            if sequence in gone:
                events[name].set()

    rig.engine.deliver = deliver
    engine = threading.Thread(target=rig.engine.run)
    engine.start()
    try:
        rig.engine.submit(first)
        assert events["paused"].wait(10)
        rig.engine.submit(second)  # max_batch=1: it runs only because the first is paused
        assert events["second"].wait(10)
        assert not events["first"].is_set() and rig.tokens(first) == 3
        rig.engine.resume(first)
        assert events["first"].wait(10)
    finally:
        rig.engine.stop()
        engine.join(10)
    assert not engine.is_alive()
    same_as_uninterrupted(rig, first, PROMPTS[0], reference)
    same_as_uninterrupted(rig, second, PROMPTS[2], reference)
    assert rig.notices == {first: 1}
