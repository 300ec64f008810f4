"""The Llama forward pass as the engine calls it, written in torch over the model's own weights.

transformers' forward spends about 13 ms of a SmolLM2 decode step (on this machine) in about
1,000 small operations and their Python dispatch, around products that read every weight.
This one does the same arithmetic with fewer, larger operations, and holds the weights in the
layouts of :mod:`inference.layouts`:

* q, k and v are one product, and gate and up another (their weights stacked);
* the rotary tables are computed once for every position, and looked up;
* the norms are ``F.rms_norm``, attention ``F.scaled_dot_product_attention`` (its GQA);
* the output layer computes only the positions asked for.

It is called as the engine calls a transformers model (``input_ids``, ``position_ids``,
``attention_mask`` over the cache's columns, ``cache``, ``logits_to_keep``) and returns the
logits and the same ``DynamicCache``, grown by :func:`inference.cache_rows.append`, so that
batching, parking and the prefix cache edit its rows as before.

:func:`supports` says which models it can run: a Llama with no biases, SiLU, default rotary
positions and no sliding window. Any other model is served by transformers' own forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from . import cache_rows, layouts

log = logging.getLogger("sluice.inference")


@dataclass(slots=True)
class ForwardOutput:
    logits: Any
    cache: Any


def supports(model: Any) -> str | None:
    """None when :class:`LlamaForward` computes what ``model`` computes; otherwise why not."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "llama":
        return f"it is a {getattr(config, 'model_type', type(model).__name__)} model, not llama"
    rope = getattr(config, "rope_parameters", None) or {}
    checks = {
        "attention_bias": not getattr(config, "attention_bias", False),
        "mlp_bias": not getattr(config, "mlp_bias", False),
        "hidden_act": getattr(config, "hidden_act", None) == "silu",
        "rope_type": rope.get("rope_type", "default") == "default" and "rope_theta" in rope,
        "sliding_window": not getattr(config, "sliding_window", None),
        "pretraining_tp": getattr(config, "pretraining_tp", 1) == 1,
    }
    unusual = [name for name, fine in checks.items() if not fine]
    if unusual:
        return f"its config sets {', '.join(unusual)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "it has no model.layers and lm_head"
    return None


class LlamaForward:
    """A Llama's forward over ``model``'s weights held as ``weights`` says (see
    :func:`inference.layouts.build_layers`); ``model`` itself is not kept."""

    def __init__(self, model: Any, weights: str = "auto") -> None:
        import torch

        config = model.config
        self.config = config
        self.eps = float(config.rms_norm_eps)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.intermediate = int(config.intermediate_size)
        inner = model.model
        self.embedding = inner.embed_tokens.weight.detach()
        stacked = []
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            stacked.append(
                torch.cat(
                    [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
                ).detach()
            )
            stacked.append(attention.o_proj.weight.detach())
            stacked.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach())
            stacked.append(mlp.down_proj.weight.detach())
        self.weights, built, self.weights_reason = layouts.build_layers(weights, stacked)
        self.layers = [
            (
                layer.input_layernorm.weight.detach(),
                built[4 * index],
                built[4 * index + 1],
                layer.post_attention_layernorm.weight.detach(),
                built[4 * index + 2],
                built[4 * index + 3],
            )
            for index, layer in enumerate(inner.layers)
        ]
        self.norm = inner.norm.weight.detach()
        self.output = layouts.output_layer(self.weights, model.lm_head.weight)
        rope = config.rope_parameters
        half = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        inverse = 1.0 / (float(rope["rope_theta"]) ** half)
        positions = torch.arange(int(config.max_position_embeddings), dtype=torch.float32)
        angles = torch.outer(positions, inverse)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos()
        # rotate_half(x) * sin is roll(x, half) * [-sin, sin]: one roll instead of two slices,
        # a negation and a concatenation.
        sin = angles.sin()
        self.signed_sin = torch.cat(
            [-sin[:, : self.head_dim // 2], sin[:, self.head_dim // 2 :]], -1
        )

    def describe(self) -> str:
        return f"{self.weights} weights ({self.weights_reason})"

    def __call__(
        self,
        input_ids: Any,
        position_ids: Any = None,
        attention_mask: Any = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> ForwardOutput:
        import torch
        import torch.nn.functional as F

        rows, width = input_ids.shape
        if cache is None:
            cache = cache_rows.empty(self.config)
        past = cache_rows.length(cache)
        if position_ids is None:
            position_ids = torch.arange(past, past + width).expand(rows, width)
        cos = self.cos[position_ids][:, None]  # [rows, 1, width, head_dim]
        sin = self.signed_sin[position_ids][:, None]
        mask = None
        if width > 1 or attention_mask is not None:
            columns = past + width
            causal = torch.arange(columns)[None, :] <= torch.arange(past, columns)[:, None]
            mask = causal[None, None]
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, None, :].bool()
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        half = dim // 2
        hidden = self.embedding[input_ids]
        for index, (norm_in, qkv, out, norm_post, gate_up, down) in enumerate(self.layers):
            x = F.rms_norm(hidden, (hidden.shape[-1],), norm_in, self.eps)
            projected = qkv(x).view(rows, width, heads + 2 * kv_heads, dim).transpose(1, 2)
            rotated = projected[:, : heads + kv_heads]
            rotated = rotated * cos + rotated.roll(half, dims=-1) * sin
            q, k = rotated.split([heads, kv_heads], dim=1)
            v = projected[:, heads + kv_heads :]
            k, v = cache_rows.append(cache, index, k, v)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            hidden = hidden + out(attended.transpose(1, 2).reshape(rows, width, heads * dim))
            x = F.rms_norm(hidden, (hidden.shape[-1],), norm_post, self.eps)
            gate, up = gate_up(x).split([self.intermediate, self.intermediate], dim=-1)
            hidden = hidden + down(F.silu(gate) * up)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), self.norm, self.eps)
        return ForwardOutput(self.output(hidden), cache)


def serving_forward(model: Any, weights: str = "auto") -> tuple[Any, str]:
    """What serving calls for ``model``: a :class:`LlamaForward` where :func:`supports` allows
    it, else the model itself (float32, as transformers computes); and a line for the log."""
    reason = supports(model)
    if reason is not None:
        if weights not in ("auto", "float32"):
            log.warning("weights = %r needs a Llama model (%s); using float32", weights, reason)
        return model, f"transformers' own forward, float32 ({reason})"
    forward = LlamaForward(model, weights)
    return forward, forward.describe()
