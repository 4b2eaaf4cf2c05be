"""Paged attention in plain torch ops: the simplest correct implementation of the contract, one
sequence at a time. A real backend calls its fused paged-attention kernel here, and adds what its
kernels need to a subclass of AttentionMetadata."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


class TemplateAttention(AttentionBackend):
    """One sequence at a time over a flat slot-per-row cache, no scratch block."""

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks * block_size, num_kv_heads, head_dim)  # K and V, one row per slot; no scratch block

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> AttentionMetadata:
        bs = inputs.block_size
        slots, starts = [], [0]
        for q, ctx, table in zip(inputs.query_lens, inputs.context_lens, inputs.block_tables):
            slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
            starts.append(starts[-1] + q)
        width = max((len(t) for t in inputs.block_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in inputs.block_tables]
        seq_lens = [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]
        return AttentionMetadata(
            num_tokens=starts[-1], slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, device=device), seq_lens=torch.tensor(seq_lens, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device).view(len(tables), width),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs,
            num_prefill_tokens=inputs.num_prefill_tokens, num_decode_tokens=inputs.num_decode_tokens)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        # every sequence's new K/V go in first: a sequence may read blocks another one writes now
        kv_cache[0].index_copy_(0, metadata.slot_mapping, key)
        kv_cache[1].index_copy_(0, metadata.slot_mapping, value)
        out = torch.empty_like(query)
        bs, start = metadata.block_size, 0
        for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens)):
            total = ctx + q_len
            pos = torch.arange(total, device=query.device)
            slots = metadata.block_tables[i][pos // bs] * bs + pos % bs
            k = kv_cache[0, slots].transpose(0, 1).unsqueeze(0)  # (1, KV, total, D)
            v = kv_cache[1, slots].transpose(0, 1).unsqueeze(0)
            q = query[start:start + q_len].transpose(0, 1).unsqueeze(0)  # (1, H, q_len, D)
            mask = pos[None, :] <= torch.arange(ctx, total, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out
