"""Paged attention on CUDA: the core's graph-capturable torch implementation
(model_executor/paged_attention.py), with every step that holds a prefill going through ONE call of
torch's FlashAttention varlen kernel per layer (`torch.nn.attention.varlen.varlen_attn`, torch >=
2.13) when it can run: fp16 / bf16, head_dim a multiple of 8 and at most 256.

Such a step's sequences (prompts, chunks over cached context, and the decodes mixed in with them)
are described by cumulative query and key lengths; each sequence's keys, positions 0..seq_len, are
gathered from the cache in one index_select into a packed (T_k, KV, D) tensor (a strided view of
the head-major cache gather), and the kernel's causal mask is bottom-right aligned, so a chunk's
queries see its whole cached context. Grouped K/V heads go to the kernel as they are (enable_gqa).
Decode-only steps keep the core's batched torch decode, which the CUDA graph runner captures (a
paged varlen decode reads the cache in place but FlashAttention-2 kernels need block_size % 256 == 0
for it). Without the kernel (an older torch, fp32, another head size) every step takes the core's
torch path.

UNVERIFIED ON A GPU: no CUDA device was available when this was written. The packing, lengths and
masking are tested on CPU against the float64 reference with a reference implementation of
varlen_attn's documented semantics standing in for the kernel (tests/backends/test_cuda_attention.py);
the kernel call itself (its stride handling for the packed view, its causal alignment) has not run.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from heterollm.interfaces import AttentionInputs
from heterollm.model_executor.paged_attention import PagedMetadata, TorchPagedAttention


def _has_varlen() -> bool:
    try:
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ImportError:
        return False


def varlen_attn(*args, **kwargs) -> torch.Tensor:
    """torch's `varlen_attn` (torch >= 2.13), imported at its first call: the module imports dynamo,
    ~1.7 s an API server (which loads every backend's entry points) need not spend."""
    from torch.nn.attention.varlen import varlen_attn as kernel

    return kernel(*args, **kwargs)

VARLEN_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class CudaMetadata(PagedMetadata):
    """Adds the varlen description of a step with a prefill (None for decode-only steps)."""

    kv_slots: torch.Tensor | None = None
    """(T_k,) cache slots of positions 0..seq_len of every sequence, concatenated in batch order."""
    cu_seqlens_q: torch.Tensor | None = None
    """(num_seqs + 1,) int32 start of each sequence's query rows."""
    cu_seqlens_k: torch.Tensor | None = None
    """(num_seqs + 1,) int32 start of each sequence's keys in the kv_slots gather."""
    max_query_len: int = 0
    max_seq_len: int = 0


def packed_slots(tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    """(sum(seq_lens),) the slot of every position 0..seq_len of every sequence, on the host."""
    lens = torch.tensor(seq_lens, dtype=torch.long)
    width = max((len(t) for t in tables), default=1)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), lens)
    pos = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[seq]
    return table[seq, pos // block_size] * block_size + pos % block_size


def cumulative(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


class CudaPagedAttention(TorchPagedAttention):
    """The core's torch paged attention on CUDA tensors, steps with a prefill through varlen_attn."""

    varlen: Callable[..., torch.Tensor] | None = staticmethod(varlen_attn) if _has_varlen() else None
    """The varlen kernel (torch's), or None where this torch has none."""

    def uses_varlen(self, query: torch.Tensor) -> bool:
        """Whether the varlen kernel can run this step's attention."""
        return (self.varlen is not None and query.is_cuda and query.dtype in VARLEN_DTYPES
                and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256)

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> CudaMetadata:
        base = super().build_metadata(inputs, device)
        meta = CudaMetadata(**vars(base))
        if meta.decode_only or self.varlen is None:
            return meta
        seq_lens = [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]
        meta.kv_slots = packed_slots(inputs.block_tables, seq_lens, inputs.block_size).to(device, non_blocking=True)
        meta.cu_seqlens_q = cumulative(inputs.query_lens).to(device, non_blocking=True)
        meta.cu_seqlens_k = cumulative(seq_lens).to(device, non_blocking=True)
        meta.max_query_len, meta.max_seq_len = max(inputs.query_lens), max(seq_lens)
        return meta

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """Not yet: the varlen path would pass window_size=(W - 1, 0), untested on a GPU so far."""
        return False

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: CudaMetadata, scale: float) -> torch.Tensor:
        if metadata.kv_slots is None or not self.uses_varlen(query):
            return super().forward(query, key, value, kv_cache, metadata, scale)
        self.write(kv_cache, metadata.slot_mapping, key, value)
        num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
        kv = kv_cache.view(2, num_kv_heads, -1, head_dim).index_select(2, metadata.kv_slots)  # (2, KV, T_k, D)
        return self.varlen(query, kv[0].transpose(0, 1), kv[1].transpose(0, 1), metadata.cu_seqlens_q,
                           metadata.cu_seqlens_k, metadata.max_query_len, metadata.max_seq_len, scale=scale,
                           window_size=(-1, 0), enable_gqa=True)
