"""Paged attention in plain torch ops: the simplest correct implementation of the contract, one
sequence at a time. A real backend calls its fused paged-attention kernel here."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dataclasses import dataclass

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


@dataclass
class TemplateMetadata(AttentionMetadata):
    """A backend may add what its kernels need to the contract's metadata."""

    block_size: int = 1


class TemplateAttention(AttentionBackend):
    platforms = ("template",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks * block_size, num_kv_heads, head_dim)  # K and V, one row per slot

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> TemplateMetadata:
        bs = inputs.block_size
        slots, starts = [], [0]
        for q, ctx, table in zip(inputs.query_lens, inputs.context_lens, inputs.block_tables):
            slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
            starts.append(starts[-1] + q)
        width = max((len(t) for t in inputs.block_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in inputs.block_tables]
        seq_lens = [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]
        return TemplateMetadata(
            num_tokens=starts[-1], slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, device=device), seq_lens=torch.tensor(seq_lens, device=device),
            block_tables=torch.tensor(tables, dtype=torch.long, device=device),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TemplateMetadata, scale: float) -> torch.Tensor:
        # every sequence's new K/V go in first: a sequence may read blocks another one writes now
        kv_cache[0].index_copy_(0, metadata.slot_mapping, key)
        kv_cache[1].index_copy_(0, metadata.slot_mapping, value)
        out = torch.empty_like(query)
        groups = query.shape[1] // key.shape[1]
        starts = metadata.query_start_loc.tolist()
        for i, (q_len, ctx) in enumerate(zip(metadata.query_lens, metadata.context_lens)):
            total = ctx + q_len
            pos = torch.arange(total, device=query.device)
            slots = metadata.block_tables[i][pos // metadata.block_size] * metadata.block_size + pos % metadata.block_size
            k = kv_cache[0, slots].repeat_interleave(groups, 1).transpose(0, 1)  # (H, total, D)
            v = kv_cache[1, slots].repeat_interleave(groups, 1).transpose(0, 1)
            q = query[starts[i]:starts[i + 1]].transpose(0, 1)  # (H, q_len, D)
            mask = torch.arange(total, device=q.device)[None, :] <= torch.arange(ctx, total, device=q.device)[:, None]
            out[starts[i]:starts[i + 1]] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                          scale=scale).transpose(0, 1)
        return out
