"""How a linear layer's weight is held for the product a decode step computes, and the choice
among the layouts.

A decode step multiplies a few rows by every weight of the model, so it is bound by reading
the weights; each layout reads them differently:

* ``float32``: the weight stored transposed (``x @ W_t`` reads it in the order the product
  walks it: 2x faster than ``F.linear`` on SmolLM2's 49,152 x 576 output layer here);
* ``bfloat16``: half the bytes; the input and the result are rounded to bfloat16;
* ``int4``: the weight as 4-bit codes with a scale and a zero per 32 inputs, Q4_1's own form,
  through torch's 4-bit kernel (:mod:`inference.torch_kernels`): an eighth of the bytes.

The output layer's logits decide the next token, and bfloat16 rounds a logit of 15 to a
multiple of 1/16, which flips near-ties: there a cheap layout ranks the vocabulary, and the
:data:`REFINED` likeliest logits of each row are computed again exactly, in float32, from the
float32 weight's rows (a gather of 64 rows, against a pass over 49,152).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from . import torch_kernels

log = logging.getLogger("sluice.inference")

# What `weights` may say in a local model's table: "auto" picks one of the others.
CHOICES = ("auto", "float32", "bfloat16", "int4")
# An int4 weight this close to its 4-bit grid (in steps) lost nothing to the codes: the GGUF
# held it in 4 bits already.
ON_GRID = 1e-3
# Logits of each row computed again in float32 after a cheap layout ranked them: at least the
# 20 top_logprobs a request may ask for, and far more than the near-ties a rounding can swap.
REFINED = 64


class Dense32:
    """float32, stored transposed."""

    name = "float32"

    def __init__(self, weight: Any) -> None:
        self.transposed = weight.detach().float().t().contiguous()

    def __call__(self, x: Any) -> Any:
        return x @ self.transposed


class DenseBF16:
    name = "bfloat16"

    def __init__(self, weight: Any) -> None:
        import torch

        self.weight = weight.detach().to(torch.bfloat16).contiguous()

    def __call__(self, x: Any) -> Any:
        import torch
        import torch.nn.functional as F

        return F.linear(x.to(torch.bfloat16), self.weight).float()


class Int4:
    name = "int4"

    def __init__(self, weight: Any) -> None:
        self.weight = torch_kernels.pack_int4(weight.detach())

    @property
    def error(self) -> float:
        return self.weight.error

    def __call__(self, x: Any) -> Any:
        import torch

        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch_kernels.matmul_int4(rows, self.weight)
        return out.float().reshape(*x.shape[:-1], self.weight.out_features)


class OutputLayer:
    """Logits from the last hidden states: ``ranking`` (a layout) over the whole vocabulary,
    then, unless it is float32 already, the :data:`REFINED` best of each row again in float32
    from ``weight`` (the float32 rows, shared with the embedding when tied)."""

    def __init__(self, ranking: Any, weight: Any) -> None:
        self.ranking = ranking
        self.weight = weight
        self.exact = isinstance(ranking, Dense32)

    def __call__(self, hidden: Any) -> Any:
        logits = self.ranking(hidden)
        if self.exact:
            return logits
        top = logits.topk(min(REFINED, logits.shape[-1]), dim=-1).indices
        exact = (self.weight[top] * hidden[..., None, :]).sum(-1)
        return logits.scatter(-1, top, exact)


def build(choice: str, weight: Any) -> Any:
    if choice == "float32":
        return Dense32(weight)
    if choice == "bfloat16":
        return DenseBF16(weight)
    if choice == "int4":
        return Int4(weight)
    raise ValueError(f"unknown weights {choice!r}: use one of {', '.join(CHOICES)}")


def build_layers(choice: str, weights: Sequence[Any]) -> tuple[str, list[Any], str]:
    """The layers' weights in the layout ``choice`` names: (the layout used, the built
    layers, why, for the log). "auto" is int4 when every weight is on a 4-bit grid already
    (a Q4_0/Q4_1 GGUF) and the kernel works here, otherwise float32; an explicit "int4"
    falls back to bfloat16 where the kernel does not work."""
    if choice in ("auto", "int4"):
        unusable = torch_kernels.check()
        if unusable is not None:
            fallback = "float32" if choice == "auto" else "bfloat16"
            log.warning("4-bit weights are unavailable (%s); using %s", unusable, fallback)
            return fallback, [build(fallback, w) for w in weights], unusable
        layers = []
        for weight in weights:
            layer = Int4(weight)
            if choice == "auto" and layer.error > ON_GRID:
                return (
                    "float32",
                    [build("float32", w) for w in weights],
                    "the weights are not on a 4-bit grid",
                )
            layers.append(layer)
        if choice == "auto":
            return "int4", layers, "the file's 4-bit weights, as stored"
        worst = max(layer.error for layer in layers)
        return "int4", layers, f"4-bit, {worst:.2f} of a step from the weights at most"
    return choice, [build(choice, w) for w in weights], "as configured"


def output_layer(choice: str, weight: Any) -> OutputLayer:
    """The output layer for layers held as ``choice``: float32 beside float32 layers,
    otherwise a bfloat16 ranking refined in float32 (a 4-bit ranking moved the corpus's
    perplexity by 0.9%, a bfloat16 one by 0.04%)."""
    ranking = Dense32(weight) if choice == "float32" else DenseBF16(weight)
    return OutputLayer(ranking, weight.detach().float())
