"""Paged attention on CPU with torch's scaled_dot_product_attention.

Cache layout per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), K then V. A step's
new K/V are scattered into their slots first; then decodes (one query token each) are attended
together in one padded SDPA call over exactly the slots each one owns, and each prefill chunk
attends over its cached context plus its own tokens with a causal offset mask. The gather plans
are built once per step in `build_metadata` and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


def slot_mapping(tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, slots) of every new token, vectorized: token t of sequence i sits at position
    context_lens[i] + t, in slot tables[i, pos // block_size] * block_size + pos % block_size."""
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    pos = torch.arange(int(query_lens.sum())) - starts[seq] + context_lens[seq]
    return pos, tables[seq, pos // block_size] * block_size + pos % block_size


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """Adds the per-step gather plans every layer reuses: which cache slots each decode and each
    prefill-with-context reads, so no layer gathers padding or unwritten slots."""

    decode_rows: torch.Tensor | None = None
    """(B,) indices of the decode sequences; their query rows are query_start_loc[decode_rows]."""
    decode_slots: torch.Tensor | None = None
    """(B, L) cache slot of each key position; positions past a sequence's length repeat slot 0 of it."""
    decode_bias: torch.Tensor | None = None
    """(B, 1, 1, L) 0 for real keys, -inf for padding."""
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    """(start, end, slots of positions 0..seq_len, causal mask (q, seq_len)); both None when the
    chunk has no cached context and attends to its own K/V."""


class CpuPagedAttention(AttentionBackend):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> CpuAttentionMetadata:
        bs = inputs.block_size
        q_lens = torch.tensor(inputs.query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(inputs.context_lens, dtype=torch.long)
        width = max(max((len(t) for t in inputs.block_tables), default=1), 1)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inputs.block_tables], dtype=torch.long)
        _, slots = slot_mapping(tables, ctx_lens, q_lens, bs)
        seq_lens = ctx_lens + q_lens
        starts = torch.cumsum(q_lens, 0) - q_lens

        is_decode = (q_lens == 1) & (ctx_lens > 0)
        meta = CpuAttentionMetadata(
            num_tokens=int(q_lens.sum()), slot_mapping=slots.to(device),
            query_start_loc=torch.cat([starts, q_lens.sum().view(1)]).to(device),
            seq_lens=seq_lens.to(device), block_tables=tables.to(device),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens))
        if bool(is_decode.any()):
            rows = is_decode.nonzero().squeeze(1)
            lens = seq_lens[rows]
            pos = torch.arange(int(lens.max())).unsqueeze(0)
            valid = pos < lens.unsqueeze(1)
            pos = torch.where(valid, pos, 0)
            dslots = tables[rows].gather(1, pos // bs) * bs + pos % bs
            bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
            meta.decode_rows = starts[rows].to(device)
            meta.decode_slots = dslots.to(device)
            meta.decode_bias = bias.to(device)
        for i in (~is_decode & (q_lens > 0)).nonzero().squeeze(1).tolist():
            s, ctx, total = int(starts[i]), int(ctx_lens[i]), int(seq_lens[i])
            pslots = mask = None
            if ctx > 0:
                pos = torch.arange(total)
                pslots = (tables[i, pos // bs] * bs + pos % bs).to(device)
                mask = (pos.unsqueeze(0) <= torch.arange(ctx, total).unsqueeze(1)).to(device)
            meta.prefills.append((s, s + int(q_lens[i]), pslots, mask))
        return meta

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat_k = kv_cache[0].view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_v = kv_cache[1].view(num_blocks * block_size, num_kv_heads, head_dim)
        flat_k.index_copy_(0, metadata.slot_mapping, key.to(flat_k.dtype))
        flat_v.index_copy_(0, metadata.slot_mapping, value.to(flat_v.dtype))

        out = torch.empty_like(query)
        if metadata.decode_rows is not None:
            if metadata.decode_bias.dtype != query.dtype:  # once per step, not per layer
                metadata.decode_bias = metadata.decode_bias.to(query.dtype)
            q = query[metadata.decode_rows].unsqueeze(2)  # (B, H, 1, D)
            k = flat_k[metadata.decode_slots].transpose(1, 2)  # (B, KV, L, D)
            v = flat_v[metadata.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype),
                                               attn_mask=metadata.decode_bias, scale=scale,
                                               enable_gqa=True)
            out[metadata.decode_rows] = o.squeeze(2)
        for s, e, pslots, mask in metadata.prefills:
            q = query[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            if pslots is None:
                o = F.scaled_dot_product_attention(
                    q, key[s:e].transpose(0, 1).unsqueeze(0).to(q.dtype),
                    value[s:e].transpose(0, 1).unsqueeze(0).to(q.dtype), is_causal=True, scale=scale,
                    enable_gqa=True)
            else:
                k = flat_k[pslots].transpose(0, 1).unsqueeze(0)
                v = flat_v[pslots].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                                   enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
