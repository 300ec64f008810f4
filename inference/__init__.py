"""Sluice's local model side: load a model, generate in a worker thread, detokenize safely.

Importable without quart, and without torch until a model is actually loaded: a proxy that
serves only upstreams never imports torch.
"""

from .chunks import DONE, ChunkFormatter, Usage
from .detokenize import IncrementalDetokenizer
from .generation import Generator
from .loading import LoadedModel, ModelLoadError, load_model, locate_smollm2_gguf, resolve_source
from .sampling import GenerationResult, PromptError, SamplingParams, sampling_from_body
from .stops import StopMatcher

__all__ = [
    "DONE",
    "ChunkFormatter",
    "GenerationResult",
    "Generator",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelLoadError",
    "PromptError",
    "SamplingParams",
    "StopMatcher",
    "Usage",
    "load_model",
    "locate_smollm2_gguf",
    "resolve_source",
    "sampling_from_body",
]
