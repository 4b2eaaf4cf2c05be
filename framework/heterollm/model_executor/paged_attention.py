"""Paged attention in plain torch ops for device backends, written so a decode step can be captured
in a device graph (CUDA graph, ACL graph, MLU graph). Backends subclass it and name their
platforms; one with a fused paged-attention kernel overrides `decode` and `forward`.

Cache layout per layer: (2, num_blocks + 1, block_size, num_kv_heads, head_dim), K then V. The
extra last block is scratch: padded rows of a replayed graph write their K/V there and read only
it, so no real sequence's slot is touched.

- Decode-only steps (every sequence adds one token) run batched with fixed shapes and no host
  synchronization: each sequence's blocks are gathered through its (padded) block table, keys past
  its length are masked, and values there are zeroed (an uninitialized slot may hold NaN, which
  a zero weight does not cancel). This is the path the graph runner captures.
- Steps with a prefill chunk attend per sequence with torch's scaled_dot_product_attention (flash
  or memory-efficient kernels on CUDA) over its cached context plus its new tokens, with a causal
  offset mask. A fused varlen kernel (flash-attention's paged varlen, torch_npu's fused attention)
  is the next step for speed.
The code is device-neutral torch, so its correctness is tested on CPU as well.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


@dataclass
class PagedMetadata(AttentionMetadata):
    block_size: int = 1
    decode_only: bool = False
    """Every sequence adds exactly one token: the batched, graph-capturable path."""


class TorchPagedAttention(AttentionBackend):
    """Not registered itself: a backend registers a subclass that sets `platforms`."""

    platforms = ()

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks + 1, block_size, num_kv_heads, head_dim)

    @staticmethod
    def scratch_block(kv_cache: torch.Tensor) -> int:
        return kv_cache.shape[1] - 1

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> PagedMetadata:
        bs = inputs.block_size
        slots, starts = [], [0]
        for q, ctx, table in zip(inputs.query_lens, inputs.context_lens, inputs.block_tables):
            slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
            starts.append(starts[-1] + q)
        width = max((len(t) for t in inputs.block_tables), default=1)
        tables = [t + [t[-1] if t else 0] * (width - len(t)) for t in inputs.block_tables]
        seq_lens = [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        return PagedMetadata(
            num_tokens=starts[-1], slot_mapping=tensor(slots), query_start_loc=tensor(starts),
            seq_lens=tensor(seq_lens), block_tables=tensor(tables).view(len(tables), width),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs,
            decode_only=all(q == 1 for q in inputs.query_lens))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: PagedMetadata, scale: float) -> torch.Tensor:
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # (2, slots, KV, D)
        flat[0].index_copy_(0, metadata.slot_mapping, key)
        flat[1].index_copy_(0, metadata.slot_mapping, value)
        if metadata.decode_only:
            return self.decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, scale)
        return self._per_sequence(query, flat, metadata, scale)

    @staticmethod
    def decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float) -> torch.Tensor:
        """One query token per sequence, fixed shapes: (B, H, D) over (B, W * block_size) keys."""
        b, h, d = query.shape
        kv = kv_cache.shape[3]
        k = kv_cache[0][block_tables].flatten(1, 2)  # (B, L, KV, D)
        v = kv_cache[1][block_tables].flatten(1, 2)
        valid = torch.arange(k.shape[1], device=query.device)[None, :] < seq_lens[:, None]  # (B, L)
        v = v.masked_fill(~valid[:, :, None, None], 0)
        q = query.view(b, kv, h // kv, d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, k).float() * scale
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(b, h, d)

    @staticmethod
    def _per_sequence(query: torch.Tensor, flat: torch.Tensor, metadata: PagedMetadata,
                      scale: float) -> torch.Tensor:
        out = torch.empty_like(query)
        groups = query.shape[1] // flat.shape[2]
        bs = metadata.block_size
        starts = metadata.query_start_loc.tolist()
        for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens)):
            total = ctx + q_len
            pos = torch.arange(total, device=query.device)
            slots = metadata.block_tables[i][pos // bs] * bs + pos % bs
            k = flat[0, slots].transpose(0, 1).repeat_interleave(groups, 0)  # (H, total, D)
            v = flat[1, slots].transpose(0, 1).repeat_interleave(groups, 0)
            q = query[starts[i]:starts[i + 1]].transpose(0, 1)  # (H, q_len, D)
            if ctx == 0:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                mask = pos[None, :] <= torch.arange(ctx, total, device=query.device)[:, None]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[starts[i]:starts[i + 1]] = o.transpose(0, 1)
        return out
