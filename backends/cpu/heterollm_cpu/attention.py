"""Paged attention on CPU with torch's scaled_dot_product_attention.

Cache layout per layer: (2, num_kv_heads, num_blocks, block_size, head_dim), K then V: head-major,
so one index_select of whole blocks along dim 2 yields, per KV head, every decode's keys as one
contiguous (B, L, D) batch. A step's new K/V are scattered into their slots first; then all decodes
(one query token each) are attended together with two batched matmuls: the query heads are folded
onto their KV head as (KV, B, H/KV, D), so GQA needs no repeated K/V; padding past each length is
masked with -inf and the softmax runs in fp32. (For these shapes, 3 query rows per KV head and a
few hundred keys, torch's SDPA on CPU is 3-10x slower than two bmm calls.) Where the backend's C++
kernel is built (kernels.py, by scripts/setup.sh), decodes of fp32 / bf16 models without a sliding
window, soft-capping or draft tree go through it instead: it reads each key and value once, straight
from the blocks, where the gather above copies them first (bf16 dot-product instructions for a bf16
model where the CPU has them). Each prefill chunk
attends over its cached context plus its own tokens through SDPA with a causal offset mask (a draft
tree being verified: an ancestor mask among its new tokens); in a bf16 model with head dim 64 or 128
on a CPU with AVX512_BF16, every chunk without a draft tree, sliding window or soft-capping goes
through the C++ prefill kernel in one call instead (flash-style over tiles of 16 keys read from the
cache, bf16 dot-product instructions; 2.4-3x SDPA's speed at 128-512-token prompts, 1.6x at 2,048). The
gather plans are built once per step in `build_metadata` and shared by every layer. A layer's sliding
window masks the keys before it (decode bias, prefill mask); the cache still holds them. Capped
scores (Gemma 2's tanh soft-capping) run prefill chunks through explicit matmuls instead of SDPA.

With --kv_cache_dtype int8 the layout is the same with each row of head_dim values replaced by its
int8 bytes and float32 scale (kv_int8.py: one scale per token and KV head), about half a bf16
cache's bytes: new K/V are quantized as they are written, cached K/V dequantized to the model dtype
as they are gathered, and every step runs the torch path (the C++ kernels read float caches only).
A chunk with no cached context attends to its own unquantized K/V.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from heterollm.interfaces import AttentionBackend, AttentionInputs, AttentionMetadata
from heterollm_cpu import kernels, kv_int8

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""What the C++ decode kernel reads and writes (the torch path serves the rest)."""


def slot_mapping(tables: torch.Tensor, context_lens: torch.Tensor, query_lens: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, slots) of every new token, vectorized: token t of sequence i sits at position
    context_lens[i] + t, in slot tables[i, pos // block_size] * block_size + pos % block_size."""
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    starts = torch.cumsum(query_lens, 0) - query_lens
    pos = torch.arange(int(query_lens.sum())) - starts[seq] + context_lens[seq]
    return pos, tables[seq, pos // block_size] * block_size + pos % block_size


def _write_kv(kv_cache: torch.Tensor, fresh_blocks: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor) -> None:
    """Zero the step's fresh blocks, then store its new K/V (T, KV, D) in their slots, in place
    (quantized into int8 rows in an int8 cache)."""
    num_kv_heads, head_dim = kv_cache.shape[1], kv_cache.shape[-1]
    if kv_cache.dtype == torch.int8:
        key, value = kv_int8.quantize(key), kv_int8.quantize(value)
    if len(fresh_blocks):
        kv_cache.index_fill_(2, fresh_blocks, 0)
    # (KV, slots, D) views; the new tokens' (T, KV, D) go in as (KV, T, D)
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, key.transpose(0, 1).to(kv_cache.dtype))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slots, value.transpose(0, 1).to(kv_cache.dtype))


def _gather(plane: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, ...], head_dim: int,
            dtype: torch.dtype) -> torch.Tensor:
    """`blocks` of one cache plane (K or V, (KV, blocks, block_size, row)) as (*shape, head_dim):
    an int8 plane's rows dequantized to `dtype`, a float plane's as stored."""
    rows = plane.index_select(1, blocks).view(*shape, plane.shape[-1])
    return kv_int8.dequantize(rows, head_dim, dtype) if plane.dtype == torch.int8 else rows


def _write_latent(kv_cache: torch.Tensor, fresh_blocks: torch.Tensor, slots: torch.Tensor,
                  latent: torch.Tensor) -> None:
    """MLA: zero the step's fresh blocks, then store its new latents (T, D) in their slots, in place."""
    if len(fresh_blocks):
        kv_cache.index_fill_(2, fresh_blocks, 0)
    kv_cache[0].view(1, -1, kv_cache.shape[-1]).index_copy_(1, slots, latent.unsqueeze(0).to(kv_cache.dtype))


# The same write as an op torch.compile treats as one in-place call (the CPU graph runner): traced
# as plain index_copy_ calls, the cache (a graph input) would be written functionally, i.e. copied
# whole on every step.
torch.library.custom_op("heterollm_cpu::write_kv", _write_kv, mutates_args=("kv_cache",))
torch.library.custom_op("heterollm_cpu::write_latent", _write_latent, mutates_args=("kv_cache",))


PREFILL_HEAD_DIMS = (64, 128)
"""Head dims the C++ prefill kernel takes (bf16 model and cache; others run SDPA)."""

ROW_WISE_MAX_TOKENS = 16
"""Sequences adding at most this many tokens to a cached context attend as rows of the batched decode."""


def _ancestors(parents: list[int]) -> torch.Tensor:
    """(n, n) boolean: row t is True at t and at every ancestor of t (parents[t] < t, -1: none)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for t, parent in enumerate(parents):
        if parent >= 0:
            mask[t] |= mask[parent]
    return mask


def _window_mask(num_queries: int, mask: torch.Tensor | None, window: int, device: torch.device) -> torch.Tensor:
    """A prefill chunk's (q, seq_len) boolean mask, causal (`mask`, or a square one when the chunk has
    no cached context) and limited to the last `window` keys of each query."""
    total = num_queries if mask is None else mask.shape[1]
    query_pos = torch.arange(total - num_queries, total, device=device).unsqueeze(1)
    key_pos = torch.arange(total, device=device).unsqueeze(0)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                softcap: float) -> torch.Tensor:
    """Attention with tanh-capped scores (Gemma 2), which SDPA cannot do: q (H, q, D), k/v (KV, k, D),
    mask (q, k) boolean. Returns (q, H, D)."""
    heads, num_kv_heads = q.shape[0], k.shape[0]
    qg = q.reshape(num_kv_heads, heads // num_kv_heads, *q.shape[1:])  # (KV, G, q, D)
    scores = torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2)).float().mul_(scale)  # (KV, G, q, k)
    scores = scores.div_(softcap).tanh_().mul_(softcap).masked_fill_(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v.dtype), v.unsqueeze(1))  # (KV, G, q, D)
    return out.reshape(heads, *q.shape[1:]).transpose(0, 1)


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    """Adds the per-step gather plans every layer reuses: which cache slots each decode and each
    prefill-with-context reads, so no layer gathers padding or unwritten slots."""

    fresh_blocks: torch.Tensor | None = None
    """Blocks whose first slot, but not every slot, is written this step: zeroed first, so the unwritten tail a decode
    reads (and masks) holds no stale NaN/inf from uninitialized memory (NaN survives a -inf mask)."""
    decode_rows: torch.Tensor | None = None
    """(B,) indices of the decode sequences; their query rows are query_start_loc[decode_rows]."""
    decode_blocks: torch.Tensor | None = None
    """(B * nb,) block ids of the decodes, each table padded to the longest one's nb blocks."""
    decode_bias: torch.Tensor | None = None
    """(1, B, 1, nb * block_size) fp32: 0 for real keys, -inf for padding."""
    decode_lens: torch.Tensor | None = None
    """(B,) context length of each decode after this step (a sliding window ends at its last key)."""
    all_decode: bool = False
    """`decode_only`, fixed when the metadata is built: forward reads this bool, so a compiled step
    guards on True/False rather than on the step's token counts (a recompile per batch size)."""
    decode_causal: bool = True
    """Every decode row attends to the keys before its own end, none masked among them (no draft
    tree): what the C++ kernel computes (kernels.py)."""
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    """(start, end, block ids covering positions 0..seq_len, causal mask (q, seq_len)); both None
    when the chunk has no cached context and attends to its own K/V."""
    prefill_chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The prefill entries without a draft tree, for the C++ prefill kernel: (starts, context lengths,
    query lengths, block tables (C, W)); their keys are read from the cache after this step's write."""
    tree_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    """For a prefill entry verifying a draft tree (AttentionInputs.tree_parents): the position of each
    of its keys (context, then each new token at its depth), which a sliding window is measured in."""

    def dynamic_dims(self) -> list[tuple[torch.Tensor, int]]:
        """The dimensions that change from one decode-only step to the next (batch, context blocks):
        the CPU graph runner compiles them as symbols, everything else as constants."""
        return [(self.slot_mapping, 0), (self.fresh_blocks, 0), (self.decode_rows, 0), (self.decode_blocks, 0),
                (self.decode_bias, 1), (self.decode_bias, 3), (self.decode_lens, 0)]


class CpuPagedAttention(AttentionBackend):
    """The reference paged attention (layout and kernels in the module docstring)."""

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_logit_softcap(cls) -> bool:
        return True

    @classmethod
    def supports_tree_attention(cls) -> bool:
        return True

    @classmethod
    def supports_mla(cls) -> bool:
        return True

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        return kv_cache_dtype in ("auto", "int8")

    def __init__(self) -> None:
        self.kernel = kernels.available()
        """Whether the C++ decode kernel is loaded: asked here, once, not in `forward`, which the graph
        runner traces (the first lookup hashes the kernel's source, which torch.compile cannot trace)."""
        self.prefill_kernel = self.kernel and bool(torch.ops.heterollm_cpu.paged_prefill_supported())
        """Whether the C++ prefill kernel runs here (it needs AVX512_BF16)."""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def quantized_kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                                 kv_cache_dtype: str) -> tuple[int, ...]:
        """int8: `kv_cache_shape` with each row of head_dim values as its int8 bytes and scale (kv_int8.py)."""
        return (2, num_kv_heads, num_blocks, block_size, kv_int8.row_bytes(head_dim))

    def mla_cache_shape(self, num_blocks: int, block_size: int, latent_dim: int) -> tuple[int, ...]:
        """(1, 1, num_blocks, block_size, latent_dim): the K plane of one KV head, so the gather plans,
        the block zeroing and the graph runner's dynamic block dimension are those of `kv_cache_shape`."""
        return (1, 1, num_blocks, block_size, latent_dim)

    def build_metadata(self, inputs: AttentionInputs, device: torch.device) -> CpuAttentionMetadata:
        bs = inputs.block_size
        q_lens = torch.tensor(inputs.query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(inputs.context_lens, dtype=torch.long)
        width = max(max((len(t) for t in inputs.block_tables), default=1), 1)
        # pad each table with its own first block: padding then reads written, finite keys
        tables = torch.tensor([t + t[:1] * (width - len(t)) for t in inputs.block_tables], dtype=torch.long)
        pos, slots = slot_mapping(tables, ctx_lens, q_lens, bs)
        seq_lens = ctx_lens + q_lens
        starts = torch.cumsum(q_lens, 0) - q_lens

        trees = inputs.tree_parents or [None] * len(inputs.query_lens)
        is_decode = (q_lens == 1) & (ctx_lens > 0) & torch.tensor([t is None for t in trees], dtype=torch.bool)
        # a few new tokens over a cached context (speculative decoding's drafts, a short last chunk):
        # each token is one more row of the batched decode, over the keys up to itself (or its
        # ancestors, for a draft tree), instead of an SDPA call of its own
        row_wise = (ctx_lens > 0) & (q_lens <= ROW_WISE_MAX_TOKENS) & (q_lens > 0)
        meta = CpuAttentionMetadata(
            num_tokens=int(q_lens.sum()), slot_mapping=slots.to(device),
            query_start_loc=torch.cat([starts, q_lens.sum().view(1)]).to(device),
            seq_lens=seq_lens.to(device), block_tables=tables.to(device),
            query_lens=list(inputs.query_lens), context_lens=list(inputs.context_lens), block_size=bs,
            num_prefill_tokens=inputs.num_prefill_tokens, num_decode_tokens=inputs.num_decode_tokens)
        meta.all_decode = meta.decode_only
        blocks = slots // bs
        filled = torch.bincount(blocks, minlength=0)[blocks]  # new tokens landing in the same block
        meta.fresh_blocks = blocks[(pos % bs == 0) & (filled < bs)].to(device)
        if bool(row_wise.any()):
            seqs = row_wise.nonzero().squeeze(1)
            seq = torch.repeat_interleave(seqs, q_lens[seqs])  # the sequence of each row
            j = torch.arange(len(seq)) - (torch.cumsum(q_lens[seqs], 0) - q_lens[seqs]).repeat_interleave(q_lens[seqs])
            ends = ctx_lens[seq] + j + 1  # keys up to and including the row's own
            nb = (int(seq_lens[seqs].max()) + bs - 1) // bs
            keys = torch.arange(nb * bs).unsqueeze(0)
            valid = keys < ends.unsqueeze(1)
            lens = ends.clone()
            first = 0
            for i in seqs.tolist():  # a draft tree: among the new keys, the row's ancestors only
                q, ctx = int(q_lens[i]), int(ctx_lens[i])
                if trees[i] is not None:
                    ancestors = _ancestors(trees[i])
                    valid[first:first + q, ctx:ctx + q] = ancestors
                    lens[first:first + q] = ctx + ancestors.sum(1)  # window end: its position + 1
                first += q
            bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[None, :, None, :]
            meta.decode_rows = (starts[seq] + j).to(device)
            meta.decode_blocks = tables[seq, :nb].reshape(-1).to(device)
            meta.decode_causal = all(trees[i] is None for i in seqs.tolist())
            meta.decode_bias = bias.to(device)
            meta.decode_lens = lens.to(device)
        is_decode = row_wise
        for i in (~is_decode & (q_lens > 0)).nonzero().squeeze(1).tolist():
            s, ctx, total = int(starts[i]), int(ctx_lens[i]), int(seq_lens[i])
            blocks = mask = None
            if ctx > 0 or trees[i] is not None:
                blocks = tables[i, :(total + bs - 1) // bs].to(device)
                mask = torch.arange(total).unsqueeze(0) <= torch.arange(ctx, total).unsqueeze(1)
                if trees[i] is not None:  # among the new tokens: itself and its ancestors only
                    ancestors = _ancestors(trees[i])
                    mask[:, ctx:] = ancestors
                    # a key's position: its depth in the tree past the context (for sliding windows)
                    depth = ancestors.sum(1) - 1
                    meta.tree_positions[len(meta.prefills)] = torch.cat([torch.arange(ctx), ctx + depth]).to(device)
                mask = mask.to(device)
            meta.prefills.append((s, s + int(q_lens[i]), blocks, mask))
        plain = [i for i in (~is_decode & (q_lens > 0)).nonzero().squeeze(1).tolist() if trees[i] is None]
        if plain:
            idx = torch.tensor(plain)
            meta.prefill_chunks = (starts[idx].to(device), ctx_lens[idx].to(device), q_lens[idx].to(device),
                                   tables[idx].to(device))
        return meta

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: CpuAttentionMetadata, scale: float, sliding_window: int | None = None,
                logit_softcap: float | None = None) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[1], query.shape[-1]
        if self.kernel and key.dtype == kv_cache.dtype == value.dtype:  # the C++ store, a few microseconds a layer
            torch.ops.heterollm_cpu.store_kv(kv_cache, metadata.fresh_blocks, metadata.slot_mapping, key, value)
        elif torch.compiler.is_compiling():  # one opaque in-place op: a compiled step must not copy the cache
            torch.ops.heterollm_cpu.write_kv(kv_cache, metadata.fresh_blocks, metadata.slot_mapping, key, value)
        else:
            _write_kv(kv_cache, metadata.fresh_blocks, metadata.slot_mapping, key, value)
        bias = metadata.decode_bias
        if bias is not None and sliding_window is not None:  # keys before the window count as padding
            first = (metadata.decode_lens - sliding_window).unsqueeze(1)
            early = torch.arange(bias.shape[-1], device=bias.device) < first
            bias = bias.masked_fill(early[None, :, None], float("-inf"))  # (B, L) -> (1, B, 1, L)
        use_kernel = (bias is not None and sliding_window is None and logit_softcap is None and metadata.decode_causal
                      and query.dtype in KERNEL_DTYPES and kv_cache.dtype in KERNEL_DTYPES and self.kernel)

        def decode(q: torch.Tensor) -> torch.Tensor:
            if use_kernel:  # each key and value read once, straight from the paged cache
                return torch.ops.heterollm_cpu.paged_decode(q, kv_cache, metadata.decode_blocks, metadata.decode_lens,
                                                            scale)
            return self._decode(q, kv_cache, metadata.decode_blocks, bias, scale, logit_softcap)

        if metadata.all_decode:  # no scatter back
            return decode(query)
        out = torch.empty_like(query)
        if metadata.decode_rows is not None:
            rows = metadata.decode_rows
            out[rows] = decode(query[rows])
        prefill_kernel = (self.prefill_kernel and metadata.prefill_chunks is not None and sliding_window is None
                          and logit_softcap is None and query.dtype == kv_cache.dtype == torch.bfloat16
                          and head_dim in PREFILL_HEAD_DIMS)
        if prefill_kernel:  # every chunk without a draft tree, in one call
            torch.ops.heterollm_cpu.paged_prefill(query, kv_cache, *metadata.prefill_chunks, scale, out)
        for n, (s, e, blocks, mask) in enumerate(metadata.prefills):
            if prefill_kernel and n not in metadata.tree_positions:
                continue
            if sliding_window is not None:
                pos = metadata.tree_positions.get(n)
                if pos is None:
                    mask = _window_mask(e - s, mask, sliding_window, query.device)
                else:
                    mask = mask & (pos.unsqueeze(0) > pos[-(e - s):].unsqueeze(1) - sliding_window)
            q = query[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            if blocks is None:  # no cached context: the chunk's own K/V, plain causal
                k, v = key[s:e].transpose(0, 1), value[s:e].transpose(0, 1)
            else:
                shape = (num_kv_heads, len(blocks) * kv_cache.shape[3])
                k = _gather(kv_cache[0], blocks, shape, head_dim, q.dtype)[:, :mask.shape[1]]
                v = _gather(kv_cache[1], blocks, shape, head_dim, q.dtype)[:, :mask.shape[1]]
            if logit_softcap is not None:
                if mask is None:  # the chunk alone: an explicit causal mask (a window of the whole chunk)
                    mask = _window_mask(e - s, None, e - s, query.device)
                out[s:e] = _softcapped(q[0], k.to(q.dtype), v.to(q.dtype), mask, scale, logit_softcap)
                continue
            o = F.scaled_dot_product_attention(q, k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                                               attn_mask=mask, is_causal=mask is None, scale=scale,
                                               enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out

    def forward_mla(self, query: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: CpuAttentionMetadata, scale: float, value_dim: int) -> torch.Tensor:
        """Every head attends to the one latent per token (MQA with the value inside the key): decodes
        batched with two matmuls over their gathered latents, prefill chunks through SDPA with the
        latent as key and its first `value_dim` features as value."""
        if torch.compiler.is_compiling():  # one opaque in-place op: a compiled step must not copy the cache
            torch.ops.heterollm_cpu.write_latent(kv_cache, metadata.fresh_blocks, metadata.slot_mapping, latent)
        else:
            _write_latent(kv_cache, metadata.fresh_blocks, metadata.slot_mapping, latent)
        latent_dim = kv_cache.shape[-1]

        def decode(q: torch.Tensor) -> torch.Tensor:
            b, length = q.shape[0], metadata.decode_bias.shape[-1]
            keys = kv_cache[0].index_select(1, metadata.decode_blocks).view(b, length, latent_dim)
            scores = torch.matmul(q.to(keys.dtype), keys.transpose(1, 2)).float().mul_(scale)  # (B, H, L)
            probs = scores.add_(metadata.decode_bias[0]).softmax(-1).to(keys.dtype)
            return torch.matmul(probs, keys[..., :value_dim]).to(query.dtype)

        if metadata.all_decode:
            return decode(query)
        out = query.new_empty(query.shape[0], query.shape[1], value_dim)
        if metadata.decode_rows is not None:
            out[metadata.decode_rows] = decode(query[metadata.decode_rows])
        for s, e, blocks, mask in metadata.prefills:
            q = query[s:e].transpose(0, 1).unsqueeze(0)  # (1, H, q, D)
            if blocks is None:  # no cached context: the chunk's own latents, plain causal
                keys = latent[s:e].to(q.dtype)
            else:
                keys = kv_cache[0, 0].index_select(0, blocks).view(-1, latent_dim)[:mask.shape[1]].to(q.dtype)
            keys = keys.view(1, 1, -1, latent_dim)
            o = F.scaled_dot_product_attention(q, keys, keys[..., :value_dim], attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def _decode(query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor,
                scale: float, logit_softcap: float | None = None) -> torch.Tensor:
        """query (B, H, D), one token per sequence; blocks (B * nb,); bias (1, B, 1, L). -> (B, H, D)"""
        num_kv_heads, head_dim = kv_cache.shape[1], query.shape[-1]
        b, heads, length = query.shape[0], query.shape[1], bias.shape[-1]
        # explicit sizes, no -1: under torch.compile a batch of one then takes the same graph as any other
        k = _gather(kv_cache[0], blocks, (num_kv_heads, b, length), head_dim, query.dtype)  # (KV, B, L, D)
        v = _gather(kv_cache[1], blocks, (num_kv_heads, b, length), head_dim, query.dtype)
        q = query.reshape(b, num_kv_heads, heads // num_kv_heads, head_dim).transpose(0, 1).to(k.dtype)  # (KV, B, G, D)
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # (KV, B, G, L)
        if logit_softcap is not None:
            scores = scores.div_(logit_softcap).tanh_().mul_(logit_softcap)
        scores = scores.add_(bias)
        probs = scores.softmax(-1).to(v.dtype)
        return torch.matmul(probs, v).transpose(0, 1).reshape(b, heads, head_dim).to(query.dtype)
