"""The serving forward (inference/llama_forward.py) against transformers' own, the weights'
layouts (inference/layouts.py), torch's 4-bit kernel behind its adapter
(inference/torch_kernels.py), and the KV cache that grows in place (cache_rows.append).

All over the tiny random Llama: what it computes, not how well (tests/inference/
test_quality_gate.py judges the real model's numerics)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch

from inference import cache_rows, layouts, torch_kernels
from inference.generation import Generator
from inference.llama_forward import LlamaForward, serving_forward, supports
from inference.loading import LoadedModel
from inference.sampling import SamplingParams
from tests.model_fixtures import smol_tokenizer, tiny_loaded_model
from tests.support import decode_to_the_end

__all__ = ["smol_tokenizer", "tiny_loaded_model"]

PROMPTS = [
    "The lighthouse keeper walked up the stairs",
    "Bonjour",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "One, two, three, four, five, six, seven, eight, nine,",
]


def on_grid(model: Any) -> Any:
    """A copy of ``model`` whose linear layers' weights are snapped to a 4-bit grid per 32
    inputs, as a Q4_1 GGUF's are once read back in float32."""
    snapped = copy.deepcopy(model)
    with torch.no_grad():
        for module in snapped.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight
                grouped = weight.reshape(weight.shape[0], -1, torch_kernels.INT4_GROUP)
                low = grouped.amin(-1, keepdim=True)
                step = (grouped.amax(-1, keepdim=True) - low) / 15
                codes = torch.round((grouped - low) / step)
                weight.copy_((codes * step + low).reshape_as(weight))
    return snapped


def ids_of(loaded: LoadedModel, text: str) -> list[int]:
    return list(loaded.tokenizer.encode(text, add_special_tokens=False))


def test_float32_matches_transformers_prefill_chunks_and_a_left_padded_batch(
    tiny_loaded_model: LoadedModel,
) -> None:
    model = tiny_loaded_model.model
    forward = LlamaForward(model, "float32")
    assert forward.weights == "float32"
    ids = ids_of(tiny_loaded_model, PROMPTS[2])
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        whole = forward(torch.tensor([ids])).logits[0]
        assert torch.allclose(whole, expected, atol=1e-5)
        # In chunks through the cache, as a prompt is prefilled beside running streams.
        cache, pieces = None, []
        for start in range(0, len(ids), 5):
            output = forward(input_ids=torch.tensor([ids[start : start + 5]]), cache=cache)
            cache = output.cache
            pieces.append(output.logits[0])
        assert torch.allclose(torch.cat(pieces), expected, atol=1e-5)
        # Two rows of different lengths, the shorter padded on the left, one decode step.
        short, long = ids_of(tiny_loaded_model, PROMPTS[1]), ids
        pad = len(long) - len(short)
        mask = torch.ones(2, len(long) + 1, dtype=torch.long)
        mask[1, :pad] = 0
        padded = forward(
            input_ids=torch.tensor([long, [0] * pad + short]),
            position_ids=torch.tensor(
                [list(range(len(long))), [0] * pad + list(range(len(short)))]
            ),
            attention_mask=mask[:, :-1],
        )
        step = forward(
            input_ids=torch.tensor([[long[0]], [short[0]]]),
            position_ids=torch.tensor([[len(long)], [len(short)]]),
            attention_mask=mask,
            cache=padded.cache,
            logits_to_keep=1,
        )
        for row, prompt in enumerate([long, short]):
            alone = model(input_ids=torch.tensor([[*prompt, prompt[0]]]), use_cache=False)
            assert torch.allclose(step.logits[row, -1], alone.logits[0, -1], atol=1e-5)


def test_only_a_plain_llama_gets_the_serving_forward(tiny_loaded_model: LoadedModel) -> None:
    model = tiny_loaded_model.model
    assert supports(model) is None
    biased = copy.deepcopy(model)
    biased.config.attention_bias = True
    assert "attention_bias" in (supports(biased) or "")
    forward, described = serving_forward(biased, "auto")
    assert forward is biased and "transformers' own forward" in described
    other = copy.deepcopy(model)
    other.config.model_type = "mistral"
    assert "mistral" in (supports(other) or "")


def test_auto_serves_weights_on_a_4bit_grid_as_4bit_and_others_in_float32(
    tiny_loaded_model: LoadedModel,
) -> None:
    assert torch_kernels.check() is None
    assert LlamaForward(tiny_loaded_model.model, "auto").weights == "float32"
    snapped = on_grid(tiny_loaded_model.model)
    forward = LlamaForward(snapped, "auto")
    assert forward.weights == "int4" and "as stored" in forward.describe()
    ids = ids_of(tiny_loaded_model, PROMPTS[0])
    with torch.inference_mode():
        expected = snapped(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        got = forward(torch.tensor([ids])).logits[0]
    # bfloat16 inputs, scales and results: close, and the same likeliest token.
    assert float((got - expected).abs().max()) < 0.05 * float(expected.abs().max())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # Asked for explicitly, weights off the grid are quantized, and the log line says how far.
    forced = LlamaForward(tiny_loaded_model.model, "int4")
    assert forced.weights == "int4" and "of a step" in forced.describe()


def test_without_the_4bit_kernel_auto_stays_float32_and_says_why(
    tiny_loaded_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.setattr(torch_kernels, "_checked", False)
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    caplog.set_level(logging.WARNING, "sluice.inference")
    snapped = on_grid(tiny_loaded_model.model)
    assert LlamaForward(snapped, "auto").weights == "float32"
    assert LlamaForward(snapped, "int4").weights == "bfloat16"
    assert "_weight_int4pack_mm_for_cpu" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(torch_kernels, "_checked", False)
    assert torch_kernels.check() is None


def test_the_output_layer_refines_the_likeliest_logits_in_float32() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5000, 64, generator=generator)
    hidden = torch.randn(3, 64, generator=generator)
    exact = hidden @ weight.t()
    rough = layouts.DenseBF16(weight)(hidden)
    assert not torch.equal(rough.topk(layouts.REFINED).values, exact.topk(layouts.REFINED).values)
    refined = layouts.output_layer("int4", weight)(hidden)
    top = exact.topk(layouts.REFINED)
    assert torch.allclose(refined.gather(-1, top.indices), top.values, atol=1e-4)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    # Beside float32 layers the output layer is float32 itself: nothing to refine.
    assert layouts.output_layer("float32", weight).exact


def test_the_cache_grows_in_place_and_survives_the_engines_row_edits(
    tiny_loaded_model: LoadedModel,
) -> None:
    cache = cache_rows.empty(tiny_loaded_model.model.config)
    step = torch.arange(2 * 1 * 1 * 16, dtype=torch.float32).reshape(2, 1, 1, 16)

    def append(keys: Any, values: Any) -> tuple[Any, Any]:
        for index in range(len(cache.layers)):
            added = cache_rows.append(cache, index, keys, values)
        return added

    keys, _ = append(step, -step)
    storage = keys.untyped_storage().data_ptr()
    for column in range(1, 10):
        keys, values = append(step + column, -step - column)
        assert keys.untyped_storage().data_ptr() == storage  # written in place
    assert keys.shape == (2, 1, 10, 16)
    assert torch.equal(keys[:, :, 9], (step + 9)[:, :, 0])
    assert torch.equal(values, -keys)
    # The engine's edits leave views (a row removed, padding dropped): still in place.
    cache_rows.remove_rows(cache, [0], 2)
    cache_rows.drop_left(cache, 3)
    keys, _ = append(step[:1] + 10, -step[:1] - 10)
    assert keys.untyped_storage().data_ptr() == storage
    assert keys.shape == (1, 1, 8, 16)
    assert torch.equal(keys[0, 0, 0], (step + 3)[1, 0, 0])
    assert torch.equal(keys[0, 0, -1], (step + 10)[0, 0, 0])
    # A row joined by concatenation is a new tensor: the next step moves to a new buffer.
    row = keys[:, :, -2:].clone()
    cache_rows.append_rows(cache, [(row, -row)] * len(cache.layers))
    keys, _ = append(step + 11, -step - 11)
    assert keys.untyped_storage().data_ptr() != storage
    assert keys.shape == (2, 1, 9, 16)
    assert torch.equal(keys[1, 0, -1], (step + 11)[1, 0, 0])
    # Past its spare columns a buffer is reallocated, keeping every column.
    before = keys.clone()
    for column in range(cache_rows.SPARE_COLUMNS + 1):
        keys, _ = append(step + column, -step - column)
    assert torch.equal(keys[:, :, : before.shape[2]], before)


def batched_and_alone(loaded: LoadedModel) -> tuple[list[list[int]], list[list[int]]]:
    generator = Generator(loaded)
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def run(prompts: list[str], max_batch: int) -> list[list[int]]:
        return decode_to_the_end(
            generator,
            [generator.text_prompt(prompt) for prompt in prompts],
            params,
            max_batch=max_batch,
            prefill_chunk=4,
        )

    alone = [run([prompt], 1)[0] for prompt in PROMPTS]
    return run(PROMPTS, len(PROMPTS)), alone


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int4"])
def test_each_layout_decodes_a_batch_as_each_sequence_alone(
    tiny_loaded_model: LoadedModel, weights: str
) -> None:
    forward = LlamaForward(on_grid(tiny_loaded_model.model), weights)
    assert forward.weights == weights
    loaded = LoadedModel(
        name="tiny",
        model=None,
        tokenizer=tiny_loaded_model.tokenizer,
        eos_token_ids=tiny_loaded_model.eos_token_ids,
        forward=forward,
    )
    batched, alone = batched_and_alone(loaded)
    assert all(alone)
    assert batched == alone
