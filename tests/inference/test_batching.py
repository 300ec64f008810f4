"""The batch engine over a tiny random Llama with the real SmolLM2 tokenizer, stepped by hand
(no thread): sequences that share a batch each produce what they produce alone; one that leaves,
or whose reader falls behind, leaves the others untouched; a character cut by max_tokens is
dropped, not sent as U+FFFD."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from inference import cache_rows
from inference.batching import BatchEngine, Generation, Piece
from inference.detokenize import REPLACEMENT
from inference.generation import Generator
from inference.loading import LoadedModel
from inference.sampling import SamplingParams
from tests.contracts.test_utf8_boundary import byte_token
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

PROMPTS = [
    "Once upon a time",
    "The river flows into the sea, and then the water",
    "Hello",
    "中文 " * 25,  # longer than a prefill chunk: prefilled over several steps
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class Harness:
    """An engine stepped by hand, recording each sequence's pieces and its leaving
    (``engine``: more of the engine's settings)."""

    # The steps run() takes at most for the sequences to finish.
    run_limit = 500

    def __init__(
        self, generator: Generator, max_batch: int = 4, prefill_chunk: int = 8, **engine: Any
    ) -> None:
        self.generator = generator
        self.texts: dict[Generation, list[str]] = {}
        self.results: dict[Generation, Piece] = {}
        self.gone: list[Generation] = []
        self.steps: list[int] = []
        self.reading: Callable[[Generation], bool] = lambda _: True
        self.engine = BatchEngine(
            generator,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            deliver=self.deliver,
            on_step=lambda size, _: self.steps.append(size),
            **engine,
        )

    def deliver(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        for sequence, piece in pieces:
            self.texts.setdefault(sequence, []).append(piece.text)
            if piece.result is not None or piece.error is not None:
                self.results[sequence] = piece
            if self.reading(sequence):
                sequence.consumed += 1
        self.gone.extend(gone)

    def text(self, sequence: Generation) -> str:
        return "".join(self.texts.get(sequence, []))

    def run(self, sequences: list[Generation]) -> None:
        for _ in range(self.run_limit):
            if all(sequence in self.gone for sequence in sequences):
                return
            self.engine.step()
        raise AssertionError("the sequences did not finish")


def alone(generator: Generator, prompt: str, params: SamplingParams = GREEDY) -> str:
    pieces: list[str] = []
    generator.generate(
        generator.text_prompt(prompt), params, emit=pieces.append, checkpoint=lambda: None
    )
    return "".join(pieces)


@pytest.fixture
def generator(tiny_loaded_model: LoadedModel) -> Generator:
    return Generator(tiny_loaded_model)


def test_the_tiny_model_can_be_batched(tiny_loaded_model: LoadedModel) -> None:
    assert cache_rows.check(tiny_loaded_model.serving) is None


def test_four_sequences_together_each_equal_what_it_makes_alone(generator: Generator) -> None:
    expected = [alone(generator, prompt) for prompt in PROMPTS]
    harness = Harness(generator)
    sequences = [Generation(generator.text_prompt(p), GREEDY) for p in PROMPTS]
    # They join at different steps, so rows of different lengths share the batch.
    for sequence in sequences:
        harness.engine.add(sequence)
        harness.engine.step()
    harness.run(sequences)
    assert [harness.text(sequence) for sequence in sequences] == expected
    assert max(harness.steps) == 4  # they did share the batch
    assert all(harness.results[s].result.finish_reason == "length" for s in sequences)  # type: ignore[union-attr]


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(generator: Generator) -> None:
    harness = Harness(generator, prefill_chunk=8)
    running = Generation(generator.text_prompt(PROMPTS[0]), GREEDY)
    harness.engine.add(running)
    harness.engine.step()  # running's prefill, alone: at once
    joining = Generation(generator.text_prompt(PROMPTS[3]), GREEDY)
    chunks = -(-len(joining.prompt_ids) // 8)
    assert chunks >= 3
    harness.engine.add(joining)
    for _ in range(chunks):
        before = len(harness.texts[running])
        harness.engine.step()
        # Each step: one token for the running stream, one chunk of the joining prompt.
        assert len(harness.texts[running]) == before + 1
    assert joining.prefilled == len(joining.prompt_ids)
    assert len(harness.texts[joining]) == 1  # its first token came with its last chunk
    harness.run([running, joining])
    assert harness.text(joining) == alone(generator, PROMPTS[3])


def test_a_prompt_alone_is_prefilled_in_chunks_and_a_cancel_lands_after_one(
    generator: Generator,
) -> None:
    harness = Harness(generator, prefill_chunk=4, prefill_chunk_alone=16)
    long = Generation(generator.text_prompt(PROMPTS[3]), GREEDY)
    assert len(long.prompt_ids) > 3 * 16
    harness.engine.add(long)
    harness.engine.step()
    harness.engine.step()
    # Two steps, two chunks of the larger size: no token yet.
    assert long.prefilled == 32 and long.forward_passes == 2 and long not in harness.texts
    long.cancelled = True
    harness.engine.step()
    assert harness.gone == [long] and long.forward_passes == 2
    assert harness.engine.sequences == 0


def test_a_short_prompt_arriving_mid_prefill_is_let_in_between_two_chunks(
    generator: Generator,
) -> None:
    harness = Harness(generator, prefill_chunk=4, prefill_chunk_alone=16)
    long = Generation(generator.text_prompt(PROMPTS[3]), GREEDY)
    harness.engine.add(long)
    harness.engine.step()
    short = Generation(generator.text_prompt(PROMPTS[2]), GREEDY)
    assert len(short.prompt_ids) <= 4
    harness.engine.add(short)
    harness.engine.step()
    # The newcomer had the next chunk, and its first token, before the long prompt's next.
    assert len(harness.texts[short]) == 1 and harness.engine.batch_size == 1
    assert long.prefilled == 16 and long.produced == 0
    harness.engine.step()
    # Beside a running stream the long prompt goes on, a smaller chunk a step.
    assert long.prefilled == 16 + 4 and len(harness.texts[short]) == 2
    harness.run([long, short])
    assert harness.text(long) == alone(generator, PROMPTS[3])
    assert harness.text(short) == alone(generator, PROMPTS[2])


def test_shorter_prompts_arriving_one_after_another_do_not_hold_a_long_one_back(
    generator: Generator,
) -> None:
    harness = Harness(generator, max_batch=8, prefill_chunk=4, prefill_chunk_alone=16)
    long = Generation(generator.text_prompt(PROMPTS[3]), GREEDY)
    harness.engine.add(long)
    harness.engine.step()
    shorts = [Generation(generator.text_prompt(PROMPTS[2]), GREEDY) for _ in range(6)]
    for short in shorts:
        harness.engine.add(short)
    prefilled = []
    for _ in range(6):
        harness.engine.step()
        prefilled.append(long.prefilled)
    # Four turns to the shorter ones, then one to the long prompt (first in the line), then
    # the shorter ones again.
    assert prefilled == [16, 16, 16, 16, 20, 20]
    assert [len(harness.texts.get(short, [])) > 0 for short in shorts] == [True] * 5 + [False]
    harness.run([long, *shorts])
    assert harness.text(long) == alone(generator, PROMPTS[3])


def test_a_cancelled_sequence_leaves_at_the_next_step_and_the_others_are_untouched(
    generator: Generator,
) -> None:
    expected = [alone(generator, prompt) for prompt in PROMPTS]
    harness = Harness(generator)
    sequences = [Generation(generator.text_prompt(p), GREEDY) for p in PROMPTS]
    for sequence in sequences:
        harness.engine.add(sequence)
    while harness.engine.batch_size < 4:
        harness.engine.step()
    harness.engine.step()
    leaving = sequences[1]
    assert harness.engine.batch_size == 4
    made = len(harness.texts[leaving])
    leaving.cancelled = True
    harness.engine.step()
    assert leaving in harness.gone
    assert len(harness.texts[leaving]) == made  # not one more token
    assert harness.engine.batch_size == 3
    assert harness.steps[-1] == 3  # the step after the leave ran without it
    harness.run([s for s in sequences if s is not leaving])
    assert leaving not in harness.results
    for index, sequence in enumerate(sequences):
        if sequence is not leaving:
            assert harness.text(sequence) == expected[index]
    assert harness.engine.sequences == 0


def test_a_reader_that_falls_behind_parks_its_own_sequence_only(generator: Generator) -> None:
    expected = [alone(generator, prompt) for prompt in PROMPTS[:3]]
    harness = Harness(generator)
    slow = Generation(generator.text_prompt(PROMPTS[0]), GREEDY, window=4)
    others = [Generation(generator.text_prompt(p), GREEDY) for p in PROMPTS[1:3]]
    harness.reading = lambda sequence: sequence is not slow  # its reader takes nothing
    for sequence in (slow, *others):
        harness.engine.add(sequence)
    for _ in range(20):
        harness.engine.step()
    # Parked at a window's worth of unread pieces; the others went on without it.
    assert slow.parked and slow.unread == 4
    assert len(harness.texts[slow]) == 4
    assert harness.engine.batch_size == 2
    assert all(len(harness.texts[s]) > 10 for s in others)
    # Its reader catches up: it rejoins the batch, and its answer is what it is alone.
    slow.consumed = slow.produced
    harness.reading = lambda _: True
    harness.run([slow, *others])
    assert [harness.text(s) for s in (slow, *others)] == expected


def test_sampling_stops_and_seeds_are_per_sequence(generator: Generator) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    reference = alone(generator, PROMPTS[0], GREEDY)
    stop = reference[len(reference) // 2 : len(reference) // 2 + 3]
    stopped = dataclasses.replace(GREEDY, stop=(stop,))
    penalized = dataclasses.replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.5)
    cases = [
        (PROMPTS[0], seeded),
        (PROMPTS[0], stopped),
        (PROMPTS[1], penalized),
        (PROMPTS[2], GREEDY),
    ]
    expected = [alone(generator, prompt, params) for prompt, params in cases]
    harness = Harness(generator)
    sequences = [Generation(generator.text_prompt(p), params) for p, params in cases]
    for sequence in sequences:
        harness.engine.add(sequence)
    harness.run(sequences)
    assert [harness.text(s) for s in sequences] == expected
    assert stop not in expected[1] and expected[1] == reference[: reference.index(stop)]
    assert harness.results[sequences[1]].result.stop_sequence == stop  # type: ignore[union-attr]


def test_a_failing_step_fails_its_sequences_and_the_engine_goes_on(
    generator: Generator, tiny_loaded_model: LoadedModel
) -> None:
    calls = [0]

    def flaky(**kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom")
        return tiny_loaded_model.serving(**kwargs)

    flaky.config = tiny_loaded_model.model.config  # type: ignore[attr-defined]
    harness = Harness(Generator(dataclasses.replace(tiny_loaded_model, forward=flaky)))
    first = Generation(generator.text_prompt(PROMPTS[0]), GREEDY)
    harness.engine.add(first)
    harness.run([first])
    failed = harness.results[first]
    assert isinstance(failed.error, RuntimeError)
    second = Generation(generator.text_prompt(PROMPTS[0]), GREEDY)
    harness.engine.add(second)
    harness.run([second])
    assert harness.text(second) == alone(generator, PROMPTS[0])


def test_without_cache_editing_sequences_take_turns(generator: Generator) -> None:
    """The fallback when transformers' cache cannot be edited: one sequence at a time, each
    still right, the others waiting for their prefill."""
    expected = [alone(generator, prompt) for prompt in PROMPTS[:2]]
    harness = Harness(generator)
    harness.engine = BatchEngine(
        generator,
        max_batch=4,
        batching=False,
        deliver=harness.deliver,
        on_step=lambda size, _: harness.steps.append(size),
    )
    sequences = [Generation(generator.text_prompt(p), GREEDY) for p in PROMPTS[:2]]
    for sequence in sequences:
        harness.engine.add(sequence)
    harness.run(sequences)
    assert [harness.text(s) for s in sequences] == expected
    assert set(harness.steps) == {1}


def test_the_check_refuses_a_model_whose_cache_it_cannot_edit(
    tiny_loaded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import cache_utils

    class OtherLayer(cache_utils.DynamicLayer):
        pass

    monkeypatch.setattr(cache_utils, "DynamicLayer", OtherLayer)
    reason = cache_rows.check(tiny_loaded_model.model)
    assert reason is not None and "DynamicLayer" in reason


# --- a character cut by max_tokens -----------------------------------------------------------


class ScriptedModel:
    """A stand-in network that "generates" a fixed list of token ids, one per call."""

    def __init__(self, script: list[int], vocabulary: int) -> None:
        self.script = script
        self.vocabulary = vocabulary
        self.config = SimpleNamespace(max_position_embeddings=512)

    def __call__(self, *, input_ids: Any, cache: Any = None, **_: Any) -> Any:
        import torch

        cache = cache or SimpleNamespace(length=0, get_seq_length=lambda: 0)
        position = cache.length
        cache = SimpleNamespace(length=position + 1, get_seq_length=lambda: position + 1)
        logits = torch.zeros(input_ids.shape[0], 1, self.vocabulary)
        logits[:, -1, self.script[min(position, len(self.script) - 1)]] = 1.0
        return SimpleNamespace(logits=logits, cache=cache)


def cut_character_model(tokenizer: Any) -> tuple[LoadedModel, str, int]:
    """A model whose answer is "水的水" and then the first two bytes of another 水."""
    text = "水的水"
    script = tokenizer.encode(text, add_special_tokens=False)
    script += [byte_token(tokenizer, byte) for byte in "水".encode()[:2]]
    loaded = LoadedModel(
        name="scripted",
        model=ScriptedModel(script, len(tokenizer)),
        tokenizer=tokenizer,
        eos_token_ids=frozenset({int(tokenizer.eos_token_id)}),
    )
    return loaded, text, len(script)


def test_a_character_cut_by_max_tokens_is_dropped(smol_tokenizer: Any) -> None:
    loaded, text, tokens = cut_character_model(smol_tokenizer)
    generator = Generator(loaded)
    pieces: list[str] = []
    result = generator.generate(
        generator.text_prompt("请用中文写一句关于河流的话。"),
        SamplingParams(max_tokens=tokens, temperature=0),
        emit=pieces.append,
        checkpoint=lambda: None,
    )
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == tokens
    assert "".join(pieces) == text
    assert all(REPLACEMENT not in piece for piece in pieces)


def test_the_tested_range_is_the_one_pyproject_declares() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    requirements = [
        requirement
        for group in (
            project["project"]["dependencies"],
            *project["project"].get("optional-dependencies", {}).values(),
        )
        for requirement in group
    ]
    assert "transformers" + cache_rows.TESTED_RANGE in requirements
    assert cache_rows.in_tested_range("5.24.0")
    assert not cache_rows.in_tested_range("5.25.0")
    assert not cache_rows.in_tested_range("5.23.9")
