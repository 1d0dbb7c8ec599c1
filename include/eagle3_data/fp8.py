"""Opt-in fp8 (e4m3) storage for aux hidden states: half the bytes of bf16.

One float32 scale per (token, layer) row of H values, so a layer with large activations does
not crush the resolution of the others and an outlier token costs only its own row. e4m3's
3 mantissa bits give ~2^-4 relative rounding error per value (bf16: 2^-8); measure the error on
your own model with `relative_error` before training on it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def quantize_rows(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, groups*H] -> (fp8 [T, groups*H], float32 scales [T, groups])."""
    t, width = x.shape
    rows = x.float().reshape(t, groups, width // groups)
    scale = rows.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (rows / scale.unsqueeze(-1)).to(FP8_DTYPE)
    return q.reshape(t, width), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    t, width = q.shape
    groups = scale.shape[1]
    rows = q.float().reshape(t, groups, width // groups) * scale.unsqueeze(-1)
    return rows.reshape(t, width).to(dtype)


def relative_error(x: torch.Tensor, groups: int) -> float:
    """||x - deq(q(x))|| / ||x|| over the whole tensor, in float32."""
    q, scale = quantize_rows(x, groups)
    back = dequantize_rows(q, scale, torch.float32)
    ref = x.float()
    return float((back - ref).norm() / ref.norm().clamp(min=1e-30))
