"""Paged attention in plain torch ops for device backends, written so a decode step can be captured
in a device graph (CUDA graph, ACL graph, MLU graph). Backends subclass it; one with a fused
paged-attention kernel overrides `decode` and `prefill`.

Cache layout per layer: (2, num_kv_heads, num_blocks + 1, block_size, head_dim), K then V,
head-major: gathering whole blocks along dim 2 yields every sequence's keys per KV head as one
contiguous (KV, B, L, D) tensor, K and V in a single index_select. The extra last block is scratch:
padded rows of a replayed graph write their K/V there and read only it, so no real sequence's slot
is touched.

No slot a query can read holds NaN, so masked keys need only a -inf score, never a zeroed copy of
V: a block is zeroed before its first slot (offset 0) is written, and block tables are padded with
a sequence's own blocks (the graph runner's padded rows use the scratch block, zeroed by their
position-0 write). Uninitialized memory is therefore never read, whatever it holds.

- Decode-only steps (every sequence adds one token) run batched with fixed shapes and no host
  synchronization: one gather of each sequence's blocks through its (padded) block table, then
  one scaled_dot_product_attention call with the query heads folded onto their KV head,
  (KV, B, G, D) over (KV, B, L, D) keys, so GQA needs no repeated K/V. The graph runner captures
  this path; it reads only slot_mapping, seq_lens and block_tables.
- Steps with a prefill chunk gather the cached context of every prefill in one index_select and
  attend per sequence with scaled_dot_product_attention on 4-D tensors with `enable_gqa` and a
  lower-right causal bias (flash or memory-efficient kernels on CUDA, no materialized fp32 score
  matrix); their decodes run through the batched decode path.
The code is device-neutral torch, so its correctness is tested on CPU as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata


def window_mask(num_queries: int, num_keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(q, k) boolean: query row j, at position num_keys - num_queries + j, sees the keys at most
    `window` - 1 positions before it, and none after."""
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    key_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


class Prefill(NamedTuple):
    """One non-decode sequence of a step: its query rows, and where its keys come from."""

    start: int
    end: int
    """Token rows start..end of the step."""
    kv_start: int | None
    kv_end: int | None
    """Its positions 0..seq_len in the step's `context_slots` gather; None when it has no cached
    context and attends to its own new K/V."""


@dataclass
class PagedMetadata(AttentionMetadata):
    """Adds the host-built plan of a step with prefills (decode-only steps leave it empty, so a
    graph runner's static buffers need not hold it)."""

    decode_rows: torch.Tensor | None = None
    """(num_decodes,) token rows of the decodes of a mixed step."""
    decode_seqs: torch.Tensor | None = None
    """(num_decodes,) their sequence indices (rows of block_tables and seq_lens)."""
    prefills: list[Prefill] = field(default_factory=list)
    context_slots: torch.Tensor | None = None
    """Cache slots of positions 0..seq_len of every prefill with cached context, concatenated."""


def _plan(inputs: AttentionInputs) -> tuple[list[int], list[int], list[Prefill], list[int]]:
    """(decode token rows, decode sequence indices, prefills, context slots) of a step."""
    bs = inputs.block_size
    rows, seqs, prefills, slots = [], [], [], []
    start = 0
    for i, (q, ctx, table) in enumerate(zip(inputs.query_lens, inputs.context_lens, inputs.block_tables)):
        if q == 1 and ctx > 0:
            rows.append(start)
            seqs.append(i)
        elif ctx == 0:
            prefills.append(Prefill(start, start + q, None, None))
        else:
            prefills.append(Prefill(start, start + q, len(slots), len(slots) + ctx + q))
            slots += [table[p // bs] * bs + p % bs for p in range(ctx + q)]
        start += q
    return rows, seqs, prefills, slots


class TorchPagedAttention(AttentionBackend):
    """Not registered itself: a backend registers a subclass."""


    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks + 1, block_size, head_dim)

    def scratch_block(self, kv_cache: torch.Tensor) -> int:
        return kv_cache.shape[2] - 1

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

        meta = PagedMetadata(
            num_tokens=starts[-1], slot_mapping=tensor(slots), query_start_loc=tensor(starts),
            seq_lens=tensor(seq_lens), block_tables=tensor(tables).view(len(tables), width),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs,
            num_prefill_tokens=inputs.num_prefill_tokens, num_decode_tokens=inputs.num_decode_tokens)
        if not meta.decode_only:
            rows, seqs, meta.prefills, context = _plan(inputs)
            if rows:
                meta.decode_rows, meta.decode_seqs = tensor(rows), tensor(seqs)
            if context:
                meta.context_slots = tensor(context)
        return meta

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: PagedMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        self.write(kv_cache, metadata.slot_mapping, key, value)
        if metadata.decode_only:
            return self.decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, scale, sliding_window)
        out = torch.empty_like(query)
        if metadata.decode_rows is not None:
            seqs = metadata.decode_seqs
            out[metadata.decode_rows] = self.decode(query[metadata.decode_rows], kv_cache, metadata.block_tables[seqs],
                                                    metadata.seq_lens[seqs], scale, sliding_window)
        self.prefill(query, key, value, kv_cache, metadata, scale, out, sliding_window)
        return out

    def write(self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Zero each block a new token opens (offset 0), then store the new K/V (T, KV, D) in their
        slots; no host synchronization. A token at another offset "zeroes" the scratch block,
        which holds nothing that outlives a step."""
        num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape[1:]
        opened = torch.where(slots % block_size == 0, slots // block_size, num_blocks - 1)  # else: the scratch block
        kv_cache.index_fill_(2, opened, 0)
        flat = kv_cache.view(2, num_kv_heads, -1, head_dim)  # (2, KV, slots, D)
        flat[0].index_copy_(1, slots, key.transpose(0, 1).to(kv_cache.dtype))
        flat[1].index_copy_(1, slots, value.transpose(0, 1).to(kv_cache.dtype))

    @staticmethod
    def decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, sliding_window: int | None = None) -> torch.Tensor:
        """One query token per sequence, fixed shapes: query (B, H, D) over each sequence's W blocks
        (block_tables (B, W)); keys at or past seq_lens, and before the sliding window, are masked.
        Returns (B, H, D)."""
        b, heads, head_dim = query.shape
        num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[3]
        length = block_tables.shape[1] * block_size
        kv = kv_cache.index_select(2, block_tables.flatten()).view(2, num_kv_heads, b, length, head_dim)
        q = query.view(b, num_kv_heads, heads // num_kv_heads, head_dim).transpose(0, 1).to(kv.dtype)  # (KV, B, G, D)
        keys = torch.arange(length, device=query.device)
        valid = keys < seq_lens[:, None]  # (B, L)
        if sliding_window is not None:
            valid &= keys >= seq_lens[:, None] - sliding_window
        out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=valid[None, :, None, :], scale=scale)
        return out.transpose(0, 1).reshape(b, heads, head_dim).to(query.dtype)

    @staticmethod
    def prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: PagedMetadata, scale: float, out: torch.Tensor, sliding_window: int | None = None) -> None:
        """Each prefill's query rows over its context and new tokens, causal (and within the sliding
        window), into `out`; one gather serves every prefill with cached context."""
        context = None
        if metadata.context_slots is not None:
            num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
            context = kv_cache.view(2, num_kv_heads, -1, head_dim).index_select(2, metadata.context_slots)
        for p in metadata.prefills:
            q = query[p.start:p.end].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            if p.kv_start is None:  # keys are the chunk's own
                k, v = (t[p.start:p.end].transpose(0, 1).unsqueeze(0).to(q.dtype) for t in (key, value))
            else:  # (1, KV, seq_len, D); query row j sits at position seq_len - q_len + j
                k, v = (context[i, :, p.kv_start:p.kv_end].unsqueeze(0).to(q.dtype) for i in (0, 1))
            if sliding_window is not None:
                mask = window_mask(q.shape[2], k.shape[2], sliding_window, q.device)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            elif p.kv_start is None:  # plain causal
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right  # imports dynamo: not at an API server's start

                bias = causal_lower_right(q.shape[2], k.shape[2])
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
            out[p.start:p.end] = o[0].transpose(0, 1)
