"""A plain (unpaged-math) reference attention: gathers each sequence's K/V from the paged cache
and computes softmax(QK^T)V explicitly, one sequence at a time. Slow, but independent of SDPA,
which makes it a useful cross-check of the CPU backend's kernel."""
from __future__ import annotations

import torch

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


class ExampleAttention(AttentionBackend):
    """Explicit softmax(QK^T)V per sequence in fp32 (a cross-check of the CPU kernel)."""

    @classmethod
    def validate(cls, config) -> list[str]:
        reasons = []
        if config.kv_cache.block_size > 1024:
            reasons.append(f"block_size {config.kv_cache.block_size} > 1024 is not supported by this example")
        return reasons

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks * block_size, num_kv_heads, head_dim)

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> AttentionMetadata:
        bs = inputs.block_size
        starts = [0]
        for q in inputs.query_lens:
            starts.append(starts[-1] + q)
        width = max((len(t) for t in inputs.block_tables), default=1) or 1
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inputs.block_tables], dtype=torch.long)
        new_slots = []
        for ctx, q, table in zip(inputs.context_lens, inputs.query_lens, inputs.block_tables):
            new_slots += [table[p // bs] * bs + p % bs for p in range(ctx, ctx + q)]
        return AttentionMetadata(
            num_tokens=starts[-1], slot_mapping=torch.tensor(new_slots, dtype=torch.long),
            query_start_loc=torch.tensor(starts), block_tables=tables,
            seq_lens=torch.tensor([c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs,
            num_prefill_tokens=inputs.num_prefill_tokens, num_decode_tokens=inputs.num_decode_tokens)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache[metadata.slot_mapping] = key.to(k_cache.dtype)
        v_cache[metadata.slot_mapping] = value.to(v_cache.dtype)
        num_heads, num_kv = query.shape[1], key.shape[1]
        out = torch.empty_like(query)
        starts = metadata.query_start_loc.tolist()
        for i, (ctx, q_len) in enumerate(zip(metadata.context_lens, metadata.query_lens)):
            total = ctx + q_len
            table = metadata.block_tables[i]
            bs = metadata.block_size
            pos = torch.arange(total)
            slots = table[pos // bs] * bs + pos % bs
            k = k_cache[slots].float().repeat_interleave(num_heads // num_kv, dim=1)  # (total, H, D)
            v = v_cache[slots].float().repeat_interleave(num_heads // num_kv, dim=1)
            q = query[starts[i]:starts[i + 1]].float()  # (q, H, D)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            causal = torch.arange(total)[None, :] > (ctx + torch.arange(q_len))[:, None]
            scores.masked_fill_(causal[None], float("-inf"))
            out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
        return out
