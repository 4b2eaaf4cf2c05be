"""CudaPagedAttention's varlen path, on CPU: a reference implementation of
`torch.nn.attention.varlen.varlen_attn`'s documented semantics stands in for the FlashAttention
kernel, so what the backend hands the kernel (which cache slots, cumulative and maximum lengths,
bottom-right causal masking, grouped K/V heads) is checked against the float64 dense reference.
The kernel itself needs a GPU: not run here."""
from __future__ import annotations

import pytest
import torch

from heterollm.testing.conformance import check_paged_attention
from heterollm_cuda.attention import CudaPagedAttention, cumulative, packed_slots


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """varlen_attn without paging: query (T_q, H, D), key/value (T_k, KV, D) packed by cu_seq_*;
    window (-1, 0) is causal, aligned to the bottom right (the last query sees every key)."""
    assert window_size == (-1, 0) and enable_gqa and block_table is None and seqused_k is None
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
    groups = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        q = query[q0:q1].double()
        k, v = (t[k0:k1].double().repeat_interleave(groups, 1) for t in (key, value))
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        causal = torch.arange(k1 - k0)[None, :] <= torch.arange(k1 - k0 - (q1 - q0), k1 - k0)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class VarlenOnCpu(CudaPagedAttention):
    varlen = staticmethod(reference_varlen)

    def __init__(self) -> None:
        self.varlen_calls = 0

    def uses_varlen(self, query: torch.Tensor) -> bool:
        self.varlen_calls += 1
        return True


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_varlen_path_matches_the_dense_reference(block_size):
    backend = VarlenOnCpu()
    check_paged_attention(backend, torch.device("cpu"), block_size, steps=12)
    assert backend.varlen_calls > 0  # every step with a prefill took it


def test_decode_only_steps_and_steps_the_kernel_cannot_run_take_the_torch_path():
    backend = VarlenOnCpu()
    from heterollm.interfaces import AttentionInputs

    meta = backend.build_metadata(AttentionInputs([1, 1], [3, 5], [[0], [1, 2]], 4), torch.device("cpu"))
    assert meta.decode_only and meta.kv_slots is None  # the graph-captured decode needs no varlen plan
    check_paged_attention(CudaPagedAttention(), torch.device("cpu"), 4, steps=6)  # CPU tensors: no kernel


def test_packed_slots_and_lengths():
    # block size 2; sequence 0 holds 3 positions in blocks 5, 1; sequence 1 holds 2 in block 7
    assert packed_slots([[5, 1], [7]], [3, 2], 2).tolist() == [10, 11, 2, 14, 15]
    assert cumulative([3, 2]).tolist() == [0, 3, 5] and cumulative([3, 2]).dtype == torch.int32
