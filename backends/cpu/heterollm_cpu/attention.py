"""Paged attention on CPU with torch's scaled_dot_product_attention.

Cache layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), K then V. A step's
new K/V are scattered into their slots first; then decodes (one query token each) are attended
together in one padded SDPA call, and each prefill chunk attends over its cached context plus
its own tokens with a causal offset mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


def slot_mapping_for(inputs: AttentionInputs) -> list[int]:
    bs = inputs.block_size
    slots: list[int] = []
    for ctx, q, table in zip(inputs.context_lens, inputs.query_lens, inputs.block_tables):
        for pos in range(ctx, ctx + q):
            slots.append(table[pos // bs] * bs + pos % bs)
    return slots


class CpuPagedAttention(AttentionBackend):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> AttentionMetadata:
        n = len(inputs.query_lens)
        starts = [0]
        for q in inputs.query_lens:
            starts.append(starts[-1] + q)
        max_blocks = max((len(t) for t in inputs.block_tables), default=0)
        tables = torch.zeros((n, max(max_blocks, 1)), dtype=torch.long)
        for i, table in enumerate(inputs.block_tables):
            if table:
                tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        seq_lens = [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]
        return AttentionMetadata(
            num_tokens=starts[-1],
            slot_mapping=torch.tensor(slot_mapping_for(inputs), dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=tables.to(device),
            query_lens=list(inputs.query_lens),
            context_lens=list(inputs.context_lens),
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(flat_v.dtype))

        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        decodes = [i for i, q in enumerate(metadata.query_lens) if q == 1 and metadata.context_lens[i] > 0]
        prefills = [i for i in range(len(metadata.query_lens)) if i not in set(decodes) and metadata.query_lens[i]]
        if decodes:
            idx = torch.tensor(decodes, dtype=torch.long)
            lens = metadata.seq_lens[idx]
            max_len = int(lens.max())
            nb = -(-max_len // block_size)
            blocks = metadata.block_tables[idx, :nb]  # (B, nb)
            k = k_cache[blocks].reshape(len(decodes), nb * block_size, num_kv_heads, head_dim)[:, :max_len]
            v = v_cache[blocks].reshape(len(decodes), nb * block_size, num_kv_heads, head_dim)[:, :max_len]
            mask = torch.arange(max_len).unsqueeze(0) < lens.unsqueeze(1)  # (B, L)
            # slots past a sequence's length may never have been written (the cache is allocated
            # empty): zero them so that garbage (even NaN) cannot leak through 0-weight products
            pad = ~mask[:, :, None, None]
            k, v = k.masked_fill(pad, 0), v.masked_fill(pad, 0)
            q_rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long)
            q = query[q_rows].unsqueeze(2)  # (B, H, 1, D)
            o = F.scaled_dot_product_attention(
                q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
            out[q_rows] = o.squeeze(2)
        for i in prefills:
            s, e = starts[i], starts[i + 1]
            ctx = metadata.context_lens[i]
            q = query[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            if ctx == 0:
                k, v = key[s:e], value[s:e]
                o = F.scaled_dot_product_attention(
                    q, k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype),
                    is_causal=True, scale=scale, enable_gqa=True)
            else:
                total = seq_lens[i]
                nb = -(-total // block_size)
                blocks = metadata.block_tables[i, :nb]
                k = k_cache[blocks].reshape(nb * block_size, num_kv_heads, head_dim)[:total]
                v = v_cache[blocks].reshape(nb * block_size, num_kv_heads, head_dim)[:total]
                q_pos = torch.arange(ctx, total).unsqueeze(1)
                mask = torch.arange(total).unsqueeze(0) <= q_pos  # (q, total)
                o = F.scaled_dot_product_attention(
                    q, k.transpose(0, 1).unsqueeze(0).to(q.dtype), v.transpose(0, 1).unsqueeze(0).to(q.dtype),
                    attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
