"""Loading paths other than the packaged SmolLM2: a Hugging Face directory, a broken GGUF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference import Generator, ModelLoadError, SamplingParams, load_model


def test_hugging_face_directory_loads_and_generates(tmp_path: Path, tiny_loaded_model: Any) -> None:
    tiny_loaded_model.model.save_pretrained(tmp_path)
    tiny_loaded_model.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "tiny-dir")
    assert loaded.source == f"hf_dir {tmp_path}"
    assert loaded.load_seconds > 0
    generator = Generator(loaded)
    pieces: list[str] = []
    result = generator.generate(
        generator.text_prompt("Hello"),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        emit=pieces.append,
        checkpoint=lambda: None,
    )
    assert result.usage.completion_tokens == 4
    assert "".join(pieces)


def test_broken_gguf_fails_with_a_message(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"could not load gguf .*broken\.gguf"):
        load_model(str(broken), "broken")


def test_int8_weights_quantize_every_linear_layer_and_still_generate(
    tiny_loaded_model: Any,
) -> None:
    import copy
    import dataclasses

    import torch

    from inference.loading import quantize_int8

    model = quantize_int8(copy.deepcopy(tiny_loaded_model.model))
    assert not any(type(module) is torch.nn.Linear for module in model.modules())
    generator = Generator(dataclasses.replace(tiny_loaded_model, model=model, forward=None))
    pieces: list[str] = []
    result = generator.generate(
        generator.text_prompt("Hello"),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        emit=pieces.append,
        checkpoint=lambda: None,
    )
    assert result.usage.completion_tokens == 4


def test_a_load_parses_the_gguf_once_and_leaves_the_gguf_module_as_it_was() -> None:
    import gguf

    from inference import gguf_reading
    from inference.loading import locate_smollm2_gguf

    path = locate_smollm2_gguf()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_reading.read_once() as in_effect:
        assert in_effect
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first  # the same file, however named: parsed once
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert isinstance(first, reader)
    assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 2)


def test_without_the_attributes_it_relies_on_a_load_reads_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gguf

    from inference import gguf_reading

    monkeypatch.delattr(gguf, "get_tensor_name_map")
    reader = gguf.GGUFReader
    with gguf_reading.read_once() as in_effect:
        assert not in_effect
        assert gguf.GGUFReader is reader
