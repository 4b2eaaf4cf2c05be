"""The sanctioned override points: small ops that vendors commonly replace with a fused kernel.

Layers call `ops.get(name)`; a backend family registers its own implementation with
`@register("rms_norm", family="npu")`, and the model runner activates the selected family, then
the platform's default family, once (`activate(family, platform.default_impl)`). No
monkey-patching of the core."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_IMPLS: dict[str, dict[str, Callable]] = {}
_ACTIVE: dict[str, Callable] = {}
DEFAULT = "torch"


def register(name: str, family: str = DEFAULT) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _IMPLS.setdefault(name, {})[family] = fn
        if family == DEFAULT:
            _ACTIVE.setdefault(name, fn)
        return fn
    return deco


def activate(*families: str) -> dict[str, str]:
    """Use, for each op, the first of `families` that implements it (then the torch default); an
    op with none of them (a backend-only op such as a quantized GEMM) becomes unavailable.
    Returns op -> family chosen."""
    chosen = {}
    _ACTIVE.clear()
    for name, impls in _IMPLS.items():
        fam = next((f for f in (*families, DEFAULT) if f in impls), None)
        if fam is not None:
            _ACTIVE[name] = impls[fam]
            chosen[name] = fam
    return chosen


def get(name: str) -> Callable:
    return _ACTIVE[name]


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@register("silu_and_mul")
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@register("rotary_embedding")
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim // 2). Neox (rotate-half) layout."""
    half = x.shape[-1] // 2
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat(((x1 * c).addcmul_(x2, s, value=-1), (x2 * c).addcmul_(x1, s)), dim=-1).to(x.dtype)


@register("argmax")
def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's pick: (rows, vocab) logits in any float dtype -> (rows,) int64, each row's index
    of its largest value (the first of equal ones; a row with a NaN: its first NaN's), as
    `logits.float().argmax(-1)` gives it. A backend's version may read the logits in their own dtype."""
    return logits.argmax(-1)


@register("fused_moe")
def fused_moe(x: torch.Tensor, w13: Any, w2: Any, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              method: Any = None) -> torch.Tensor:
    """The routed experts of a mixture-of-experts block, SiLU-gated: for each token t and each of its
    top-k choices (expert e, weight w), out[t] += w * (silu(x[t] G_e^T) * (x[t] U_e^T)) D_e^T.

    x: (tokens, hidden); w13: (experts, 2 * inter, hidden), gate rows then up rows of each expert;
    w2: (experts, hidden, inter); topk_weights / topk_ids: (tokens, k). With `method` (a LinearMethod:
    `--quantization` on the experts), w13 and w2 are instead each expert's prepared states and every
    GEMM is `method.apply(state, rows, None)`. Returns (tokens, hidden) in x's dtype; each product is
    weighted in the dtype of `topk_weights` (x's, or fp32) and then cast, as transformers does. Under
    tensor parallelism `inter` is this rank's shard and the caller all-reduces.

    The (token, choice) pairs are sorted by expert, so each expert that received tokens runs one
    gate/up GEMM and one down GEMM over all of its tokens; one index_add sums the weighted rows back
    per token (in expert order)."""
    if method is None and torch.compiler.is_compiling():  # per-expert sizes are data: opaque to the graph
        return torch.ops.heterollm.fused_moe(x, w13, w2, topk_weights, topk_ids)
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    counts = torch.bincount(flat, minlength=len(w13)).tolist()
    xs = x[tokens]
    weights = topk_weights.reshape(-1)[order].unsqueeze(-1)
    ys = x.new_empty(n * k, x.shape[-1], dtype=torch.promote_types(x.dtype, topk_weights.dtype))
    linear = F.linear if method is None else (lambda rows, state: method.apply(state, rows, None))
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = linear(xs[rows], w13[expert]).chunk(2, dim=-1)
        ys[rows] = linear(F.silu(gate) * up, w2[expert]) * weights[rows]
        start += count
    return torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))


@torch.library.custom_op("heterollm::fused_moe", mutates_args=())
def _fused_moe_opaque(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe as one opaque op for a compiled step (`--enable_graph` on CPU): torch.compile cannot
    trace its loop over the experts that received tokens, so the graph calls it whole."""
    return fused_moe(x, w13, w2, topk_weights, topk_ids)


@_fused_moe_opaque.register_fake
def _fused_moe_shape(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)

def has(name: str) -> bool:
    return name in _ACTIVE


def names() -> list[str]:
    return sorted(_ACTIVE)
