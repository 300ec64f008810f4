"""GGUF to a Hugging Face directory (what vLLM needs), checked by loading the result back."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference import Generator, SamplingParams, load_model
from inference.convert import convert
from inference.loading import locate_smollm2_gguf


@pytest.mark.slow
def test_smollm2_gguf_converts_to_a_directory_that_still_knows_paris(tmp_path: Path) -> None:
    convert(locate_smollm2_gguf(), tmp_path, "bfloat16")
    assert (tmp_path / "model.safetensors").is_file()
    assert (tmp_path / "config.json").is_file()
    loaded = load_model(str(tmp_path), "converted")
    generator = Generator(loaded)
    pieces: list[str] = []
    generator.generate(
        generator.chat_prompt([{"role": "user", "content": "What is the capital of France?"}]),
        SamplingParams(max_tokens=12, temperature=0.0),
        emit=pieces.append,
        checkpoint=lambda: None,
    )
    assert "Paris" in "".join(pieces)
