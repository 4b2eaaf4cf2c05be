"""The int8 KV cache (--kv_cache_dtype int8): per-token, per-KV-head symmetric absmax quantization.

Each (token, KV head) row of `head_dim` K (or V) values is stored as `row_bytes(head_dim)` int8
bytes: the values q = round(x / s), s = max|x| / 127, then the 4 bytes of s as float32 (after zero
padding to a multiple of 4, so s is aligned). Values and scales share one int8 tensor per layer:
the block zeroing, the gather plans, the graph runner's dynamic block dimension and the runner's
byte count work on it as on a float cache, and a zeroed row reads back as zeros (s = 0.0).
Dequantization is x' = q * s, within s / 2 = max|x| / 254 of x per value.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4
"""A float32 scale per row."""


def row_bytes(head_dim: int) -> int:
    """Bytes of one quantized row: the int8 values, padding to a multiple of 4, the scale."""
    return head_dim + (-head_dim % SCALE_BYTES) + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) float -> (..., row_bytes(D)) int8 rows, one scale per row (its last dim)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127  # (..., 1)
    values = torch.round(x / scale.clamp(min=torch.finfo(torch.float32).tiny)).clamp_(-127, 127).to(torch.int8)
    pad = values.new_zeros(*x.shape[:-1], -x.shape[-1] % SCALE_BYTES)
    return torch.cat([values, pad, scale.view(torch.int8)], -1)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(..., row_bytes(head_dim)) int8 rows -> (..., head_dim) values of `dtype` (computed in fp32)."""
    scale = rows[..., -SCALE_BYTES:].view(torch.float32)  # (..., 1)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """(..., row_bytes) int8 rows -> (...) their float32 scales."""
    return rows[..., -SCALE_BYTES:].view(torch.float32).squeeze(-1)
