"""The CPU backend's op-registry entries: its linear methods (linear.py) and, where the C++ kernels
are built (kernels.py), fused `rms_norm`, `silu_and_mul` and `rotary_embedding`, and greedy sampling's
`argmax` on the logits' own dtype (csrc/argmax_rows.cpp).

Each fused op is one pass over memory and one dispatch where the registry's torch definition
(heterollm.model_executor.ops, the reference) runs 4-8 ops, each reading and writing the whole
tensor: at batch 1 the model's ~900 such small ops per step cost milliseconds of dispatch alone.
They compute what the torch definitions compute (fp32 math, the same bf16 roundings; csrc/fused_ops.cpp).
A call the kernel does not take (float16, another layout, a step torch.compile traces: inductor fuses
the torch definitions itself) goes to the torch definition."""
from __future__ import annotations

from typing import Any

import torch

from heterollm.model_executor import ops
from heterollm_cpu import kernels

DTYPES = (torch.float32, torch.bfloat16)


def _rows(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    return x.dim() in dims and x.dtype in DTYPES and x.stride(-1) == 1 and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _rows(x, (2, 3)) and weight.dtype == x.dtype:
        return torch.ops.heterollm_cpu.rms_norm(x, weight, eps)
    return ops.rms_norm(x, weight, eps)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _rows(gate, (2,)) and up.dtype == gate.dtype and up.stride(-1) == 1:
        return torch.ops.heterollm_cpu.silu_and_mul(gate, up)
    return ops.silu_and_mul(gate, up)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if _rows(x, (3,)) and cos.dtype == sin.dtype == torch.float32:
        return torch.ops.heterollm_cpu.rotary_embedding(x, cos, sin)
    return ops.rotary_embedding(x, cos, sin)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 2 and logits.dtype in DTYPES and logits.shape[1] > 0 and not torch.compiler.is_compiling():
        return torch.ops.heterollm_cpu.argmax_rows(logits)
    return ops.argmax(logits)


FUSED = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary_embedding": rotary_embedding,
         "argmax": argmax}


def register_ops(config: Any = None) -> None:
    """The backend's `register_ops` (its descriptor names it), family `cpu`."""
    from heterollm_cpu.linear import register_ops as register_linear

    register_linear(config)
    if kernels.available():
        for name, fn in FUSED.items():
            ops.register(name, family="cpu")(fn)
