"""CpuPagedAttention against a dense reference: mixed batches over shuffled, shared-size block
tables, with the cache starting as NaN (as uninitialized memory may) so any read of an unwritten
or padding slot that escapes the mask shows up."""
import random

import pytest
import torch

from heterollm.interfaces import AttentionInputs
from heterollm_cpu.attention import CpuPagedAttention

H, KV, D = 6, 2, 8


def reference(q, k, v, ctx, scale):
    """q (n, H, D) new tokens at positions ctx..ctx+n-1 over k/v (ctx+n, KV, D) of one sequence."""
    k = k.repeat_interleave(H // KV, 1)
    v = v.repeat_interleave(H // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    n, total = q.shape[0], k.shape[0]
    causal = torch.arange(total)[None, :] <= torch.arange(ctx, ctx + n)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_steps_match_dense_reference(block_size):
    torch.manual_seed(0)
    rng = random.Random(block_size)
    backend = CpuPagedAttention()
    num_blocks = 200
    cache = torch.full(backend.kv_cache_shape(num_blocks, block_size, KV, D), float("nan"))
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (prompt length, chunk size); each sequence prefills in chunks then decodes
    seqs = [dict(plen=p, chunk=c, k=torch.randn(0, KV, D), v=torch.randn(0, KV, D), table=[])
            for p, c in [(5, 5), (17, 4), (1, 1), (33, 16), (2, 2)]]
    scale = D ** -0.5
    for _step in range(12):
        q_lens, ctx_lens = [], []
        for s in seqs:
            ctx = s["k"].shape[0]
            n = min(s["chunk"], s["plen"] - ctx) if ctx < s["plen"] else 1
            while len(s["table"]) * block_size < ctx + n:
                s["table"].append(free.pop())
            q_lens.append(n)
            ctx_lens.append(ctx)
        meta = backend.build_metadata(
            AttentionInputs(q_lens, ctx_lens, [list(s["table"]) for s in seqs], block_size), torch.device("cpu"))
        T = sum(q_lens)
        q, k, v = torch.randn(T, H, D), torch.randn(T, KV, D), torch.randn(T, KV, D)
        out = backend.forward(q, k, v, cache, meta, scale)
        start = 0
        for s, n, ctx in zip(seqs, q_lens, ctx_lens):
            s["k"] = torch.cat([s["k"], k[start:start + n]])
            s["v"] = torch.cat([s["v"], v[start:start + n]])
            want = reference(q[start:start + n], s["k"], s["v"], ctx, scale)
            torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)
            start += n
