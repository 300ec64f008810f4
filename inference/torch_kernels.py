"""The one module that calls torch's private weight-only kernels: the 4-bit matmul and its
weight packing, which torch ships for its own quantization libraries but does not document.

They are what makes a 4-bit weight fast on CPU: the product reads half a byte per weight
instead of four, and a decode step is bound by reading the weights. What this relies on
(torch 2.13):

* ``torch._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles)``: ``q`` int32 ``[N, K]``
  holding values 0..15, packed into the kernel's layout (``inner_k_tiles`` is ignored on CPU);
* ``torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``: ``x`` bfloat16
  ``[M, K]``; ``scales_and_zeros`` bfloat16 ``[K / group, N, 2]``; each weight is
  ``(q - 8) * scale + zero`` of its group of ``group`` along K; the result is bfloat16 ``[M, N]``.

:func:`check` runs when a model is loaded with 4-bit weights: it multiplies a small weight
both ways (the kernel, and the same weight dequantized in float32) and compares. A torch
without these operators, or whose result is wrong, is reported (the caller falls back to
dense weights and logs why).
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("sluice.inference")

# The torch releases this module was tested with (pyproject.toml pins the same).
TESTED_RANGE = ">=2.13,<2.14"
# Along K, one scale and one zero per this many weights: GGUF's Q4_0/Q4_1 block size, so a
# block of the file is a group of the kernel.
INT4_GROUP = 32

_checked: str | bool | None = False  # False: not yet; None: fine; str: why not


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def in_tested_range(installed: str) -> bool:
    floor, below = re.findall(r"[\d.]+", TESTED_RANGE)
    return _release(floor) <= _release(installed) < _release(below)


def check() -> str | None:
    """None when the 4-bit kernel is usable here; otherwise why not. Probed once a process."""
    global _checked
    if _checked is False:
        _checked = _probe()
    return _checked if isinstance(_checked, str) else None


def _probe() -> str | None:
    import torch

    if not in_tested_range(torch.__version__):
        log.warning(
            "torch %s is outside the range the 4-bit kernel is tested with (%s); it is "
            "checked by a trial product",
            torch.__version__,
            TESTED_RANGE,
        )
    for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
        if not hasattr(torch, name):
            return f"torch {torch.__version__} has no torch.{name}"
    # A weight already on a 4-bit grid whose scale and zero bfloat16 holds exactly, and an
    # input bfloat16 holds exactly: the kernel's only rounding is its bfloat16 result.
    generator = torch.Generator().manual_seed(0)
    step = 2.0**-7
    codes = torch.randint(0, 16, (64, 2 * INT4_GROUP), generator=generator)
    # Every group spans the whole range, so that its scale and minimum are the step and -8.
    codes[:, ::INT4_GROUP] = 0
    codes[:, 1::INT4_GROUP] = 15
    weight = (codes - 8).float() * step
    x = torch.randn(3, 2 * INT4_GROUP, generator=generator).to(torch.bfloat16)
    try:
        got = matmul_int4(x, pack_int4(weight)).float()
    except Exception as failure:  # noqa: BLE001 - loading runs in a worker thread: no Cancelled
        return f"torch's 4-bit kernel failed a trial product ({type(failure).__name__}: {failure})"
    expected = x.float() @ weight.t()
    off = float((got - expected).abs().max() / expected.abs().max())
    if off > 0.01:
        return f"torch's 4-bit kernel is off by {off:.1%} on a trial product"
    return None


class Int4Weight:
    """A weight ``[N, K]`` in the kernel's layout: 4-bit codes, and per group a scale and a
    zero in bfloat16. ``error`` is the largest difference from the float32 weight it came
    from, as a fraction of that group's step (0 when the weight was already on a 4-bit grid)."""

    __slots__ = ("error", "in_features", "out_features", "packed", "scales_and_zeros")

    def __init__(
        self, packed: Any, scales_and_zeros: Any, shape: tuple[int, int], error: float
    ) -> None:
        self.packed = packed
        self.scales_and_zeros = scales_and_zeros
        self.out_features, self.in_features = shape
        self.error = error


def pack_int4(weight: Any, group: int = INT4_GROUP) -> Int4Weight:
    """``weight`` (float32 ``[N, K]``) as 4-bit codes with a scale and a minimum per group, the
    way Q4_1 stores it, in the kernel's layout. Its ``error`` says whether that lost anything:
    a GGUF Q4_1 (or Q4_0) weight read back in float32 is on its grid already (about 1e-6 of a
    step, float32's rounding of the dequantization); any other weight is up to half a step
    off, a real quantization."""
    import torch

    rows, columns = weight.shape
    if columns % group:
        raise ValueError(f"a 4-bit weight needs K divisible by {group}, not {columns}")
    grouped = weight.float().reshape(rows, columns // group, group)
    low = grouped.amin(-1)
    scale = ((grouped.amax(-1) - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    # Each weight in steps above its group's minimum: a whole number on the grid.
    steps = (grouped - low[..., None]) / scale[..., None]
    codes = torch.round(steps)
    error = float((steps - codes).abs().max())
    # The kernel computes (q - 8) * scale + zero, so its zero is the group's level 8.
    scales_and_zeros = torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1)
    packed = torch._convert_weight_to_int4pack_for_cpu(
        codes.clamp(0, 15).to(torch.int32).reshape(rows, columns), 1
    )
    return Int4Weight(
        packed, scales_and_zeros.to(torch.bfloat16).contiguous(), (int(rows), int(columns)), error
    )


def matmul_int4(x: Any, weight: Int4Weight, group: int = INT4_GROUP) -> Any:
    """``x @ weight.T`` for bfloat16 ``x`` ``[M, K]``, in bfloat16."""
    import torch

    return torch._weight_int4pack_mm_for_cpu(x, weight.packed, group, weight.scales_and_zeros)
