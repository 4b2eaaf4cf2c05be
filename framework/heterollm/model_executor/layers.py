"""The layer API models are written against: tensor-parallel linear layers, embeddings, RMSNorm,
rotary embedding, and attention through the selected AttentionBackend.

Each parameter carries a `weight_loader(param, full_tensor)` that takes the checkpoint's full
tensor and keeps this rank's shard."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from heterollm.interfaces.step import ForwardContext
from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import LinearBase
from heterollm.model_executor.parallel import ParallelContext


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _shard_loader(dim: int, pctx: ParallelContext):
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        if pctx.tp_size > 1:
            size = loaded.shape[dim] // pctx.tp_size
            loaded = loaded.narrow(dim, pctx.tp_rank * size, size)
        _copy(param, loaded)
    return load


class ReplicatedLinear(LinearBase):
    """y = x W^T + b with the whole W on every rank (MLA's down-projections into its latents)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = _copy
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W split by output rows; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        out = pctx.shard(out_features, "output features")
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.weight.weight_loader = _shard_loader(0, pctx)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out), requires_grad=False)
            self.bias.weight_loader = _shard_loader(0, pctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input in one GEMM (q/k/v, gate/up).

    The checkpoint keeps them apart; `weight_loader(param, tensor, shard)` writes part `shard`
    (its tensor-parallel slice) at its offset. `param.num_shards` lets the loader check that
    every part arrived. `partitions[i]` (default tp_size) splits part i into fewer slices than
    ranks: rank r then holds slice r * partitions[i] // tp_size (replicated K/V heads)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, pctx: ParallelContext,
                 partitions: list[int] | None = None) -> None:
        super().__init__()
        self.pctx = pctx
        self.partitions = partitions or [pctx.tp_size] * len(out_sizes)
        self.sizes = [ParallelContext(0, p).shard(o, "output features") for o, p in zip(out_sizes, self.partitions)]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        total = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load
                param.num_shards = len(self.sizes)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        size, parts = self.sizes[shard], self.partitions[shard]
        if loaded.shape[0] != size * parts:
            raise ValueError(f"shape mismatch: part {shard} has {size * parts} rows, checkpoint {loaded.shape[0]}")
        part = loaded.narrow(0, self.pctx.tp_rank * parts // self.pctx.tp_size * size, size)
        _copy(param.data.narrow(0, self.offsets[shard], size), part)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x, self.bias).split(self.sizes, dim=-1)


class RowParallelLinear(LinearBase):
    """W split by input columns; partial outputs are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.weight = nn.Parameter(torch.empty(out_features, pctx.shard(in_features, "input features")),
                                   requires_grad=False)
        self.weight.weight_loader = _shard_loader(1, pctx)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pctx.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, pctx: ParallelContext) -> None:
        super().__init__()
        self.pctx = pctx
        self.vocab_size = vocab_size
        self.part = -(-vocab_size // pctx.tp_size)
        self.start = pctx.tp_rank * self.part
        self.weight = nn.Parameter(torch.empty(self.part, dim), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.start:self.start + self.part]
        param.data.zero_()
        param.data[: shard.shape[0]].copy_(shard)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pctx.tp_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.part)
        out = nn.functional.embedding(local.clamp(0, self.part - 1), self.weight) * inside.unsqueeze(-1)
        return self.pctx.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """The output projection; with tied embeddings it shares the embedding's weight (which the
    linear method then leaves in place for the lookup)."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.matmul(hidden, None)
        if self.pctx.tp_size > 1:
            out = self.pctx.all_gather(out, -1)
        return out[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.weight_loader = _copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.get("rms_norm")(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin table from transformers' own rope-parameter functions (default, linear, dynamic,
    yarn, longrope, llama3), so scaling types match the reference exactly.

    The table is computed in fp32 on the CPU (transformers' functions return `inv_freq` there)
    and then moved to the device the model is being built on (`torch.get_default_device()`,
    i.e. the enclosing `with torch.device(...)`), so every device gets the same table."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None) -> None:
        """`layer_type`: for configs whose rope_parameters are keyed by layer type (Gemma 3: its
        "sliding_attention" and "full_attention" layers turn at different bases)."""
        super().__init__()
        device = torch.get_default_device()
        with torch.device("cpu"):
            cos, sin = self._table(hf_config, head_dim, max_positions, layer_type)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    @staticmethod
    def _table(hf_config: Any, head_dim: int, max_positions: int,
               layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (max_positions, head_dim // 2) fp32, on the current default device."""
        params = getattr(hf_config, "rope_parameters", None) or {}
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"rope type {rope_type!r} is not supported")
            if rope_type == "dynamic":
                raise ValueError("rope type 'dynamic' depends on the running sequence length; not supported yet")
            by_type = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **by_type)
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq.float())
        return freqs.cos() * scaling, freqs.sin() * scaling

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rows for a step's positions, each (tokens, head_dim // 2); looked up once per
        step and shared by every layer."""
        return self.cos[positions], self.sin[positions]

    @staticmethod
    def apply(rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, head_dim); q and k heads may come in one tensor."""
        return ops.get("rotary_embedding")(x, *rope)


def sliding_window(hf_config: Any, layer_idx: int) -> int | None:
    """The attention window of a layer, as transformers reads the config: `sliding_window` on every
    layer (Mistral), or on the layers `layer_types` marks "sliding_attention" (Qwen2's
    use_sliding_window, Gemma 2/3); None: full attention."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if not window or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    return int(window)


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        options = (("sliding_window", window), ("logit_softcap", softcap))
        self.options: dict[str, int | float] = {name: value for name, value in options if value is not None}
        """The backend's optional arguments this layer needs: a sliding window in tokens, a score cap (the
        launch checked that the attention backend honours them; a backend is never asked for others)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale, **self.options)


class MlaAttention(nn.Module):
    """Multi-head latent attention through the backend's `forward_mla` (the launch checked that it
    `supports_mla()`): the heads' queries, already in the latent space, over one cached latent per
    token; returns each head's attention-weighted latent, (tokens, heads, value_dim)."""

    def __init__(self, layer_idx: int, num_heads: int, value_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx, self.num_heads, self.value_dim, self.scale = layer_idx, num_heads, value_dim, scale

    def forward(self, query: torch.Tensor, latent: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return ctx.backend.forward_mla(query, latent, ctx.kv_caches[self.layer_idx], ctx.metadata, self.scale,
                                       self.value_dim)


@dataclass(frozen=True)
class CacheLayout:
    """One model's KV cache on the selected attention backend: `num_layers` tensors of `shape` and `dtype`."""

    num_layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes_per_block: int
    """What one more block costs across every layer, scales of a quantized cache included."""


def cache_layout(model: Any, backend: Any, num_blocks: int, block_size: int, model_dtype: torch.dtype,
                 kv_cache_dtype: str = "auto") -> CacheLayout:
    """The cache of `model` on `backend`: K and V per KV head, or one latent per token where the model
    sets `kv_latent_dim` (MLA); in the model dtype, or quantized as --kv_cache_dtype says (the launch
    checked that the backend `supports_kv_cache_dtype` it and that the model is not MLA)."""
    layers, kv_heads, head_dim = model.kv_geometry
    latent = getattr(model, "kv_latent_dim", None)
    quantized = not latent and kv_cache_dtype != "auto"

    def shape_of(num: int) -> tuple[int, ...]:
        if latent:
            return backend.mla_cache_shape(num, block_size, latent)
        if quantized:
            return backend.quantized_kv_cache_shape(num, block_size, kv_heads, head_dim, kv_cache_dtype)
        return backend.kv_cache_shape(num, block_size, kv_heads, head_dim)

    dtype = getattr(torch, kv_cache_dtype) if quantized else model_dtype
    # a layout may hold scratch blocks beyond num_blocks: a block's cost is what one more adds
    per_block = math.prod(shape_of(2)) - math.prod(shape_of(1))
    element = torch.empty((), dtype=dtype).element_size()
    return CacheLayout(layers, tuple(shape_of(num_blocks)), dtype, layers * per_block * element)
