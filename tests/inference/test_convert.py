"""GGUF to a Hugging Face directory (what vLLM needs): when a directory is reconverted.

The conversion itself, compared with the GGUF (template, special tokens, logits, greedy tokens,
"Paris"), is tests/inference/test_fidelity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference import convert as converting
from inference.convert import STAMP, is_current, main, stamp_of


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF not really")
    return path


def converted_dir(root: Path, gguf: Path, dtype: str) -> Path:
    """A directory as a finished conversion leaves it (its weights stand in)."""
    out = root / "out"
    out.mkdir(exist_ok=True)
    (out / "model.safetensors").write_bytes(b"")
    (out / STAMP).write_text(json.dumps(stamp_of(gguf, dtype)))
    return out


def test_the_default_dtype_is_float32() -> None:
    assert converting.DEFAULT_DTYPE == "float32"


def test_a_directory_is_current_only_for_the_same_gguf_dtype_and_transformers(
    tmp_path: Path, gguf: Path
) -> None:
    out = converted_dir(tmp_path, gguf, "float32")
    assert is_current(gguf, out, "float32")
    assert not is_current(gguf, out, "bfloat16")
    stamp = json.loads((out / STAMP).read_text())
    (out / STAMP).write_text(json.dumps({**stamp, "transformers": "0.0"}))
    assert not is_current(gguf, out, "float32")
    (out / STAMP).write_text(json.dumps(stamp))
    gguf.write_bytes(b"GGUF, another one")
    assert not is_current(gguf, out, "float32")


def test_a_directory_without_a_stamp_or_weights_is_stale(tmp_path: Path, gguf: Path) -> None:
    # What the bf16 default left (no stamp), or a run stopped before its end.
    assert not is_current(gguf, tmp_path / "missing", "float32")
    out = converted_dir(tmp_path, gguf, "float32")
    (out / "model.safetensors").unlink()
    assert not is_current(gguf, out, "float32")
    (out / "model.safetensors").write_bytes(b"")
    (out / STAMP).write_text("{not json")
    assert not is_current(gguf, out, "float32")


def test_if_stale_converts_only_a_stale_directory(
    tmp_path: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[Path, Path, str]] = []

    def fake_convert(source: Path, out: Path, dtype: str) -> float:
        calls.append((source, out, dtype))
        return 0.0

    monkeypatch.setattr(converting, "convert", fake_convert)
    out = converted_dir(tmp_path, gguf, "float32")
    assert main([str(out), "--gguf", str(gguf), "--if-stale"]) == 0
    assert calls == []
    assert "already" in capsys.readouterr().out
    assert main([str(out), "--gguf", str(gguf), "--if-stale", "--dtype", "bfloat16"]) == 0
    assert calls == [(gguf, out, "bfloat16")]
    assert main([str(out), "--gguf", str(gguf)]) == 0  # without --if-stale: always
    assert calls[-1] == (gguf, out, "float32")
