"""The device backends' paged attention (model_executor/paged_attention.py), beyond matching the
dense reference (test_device_backends.py): what it asks of the device. A prefill attends through
SDPA on 4-D tensors with grouped K/V heads (never repeated to every query head, which on CUDA
forces the math kernel and its fp32 score matrices); a decode-only step gathers the cache once,
copies nothing V-sized besides, and never synchronizes with the host (it is captured in graphs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from heterollm.interfaces import AttentionInputs
from heterollm.model_executor.paged_attention import TorchPagedAttention

H, KV, D, BS = 8, 2, 16, 4


class DispatchLog(TorchDispatchMode):
    """Every aten op of the block with the element count of its (first) output, 0 for an output
    that is a view of, or written into, an input (no new memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        new = isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() not in inputs
        self.ops.append((str(func.overloadpacket.__name__), first.numel() if new else 0))
        return out


class SdpaLog(TorchFunctionMode):
    """(query shape, key shape, enable_gqa) of each SDPA call, and the name of every torch call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.names.append(getattr(func, "__name__", str(func)))
        if func is F.scaled_dot_product_attention:
            self.calls.append((tuple(args[0].shape), tuple(args[1].shape), kwargs.get("enable_gqa", False)))
        return func(*args, **kwargs)


def step(query_lens, context_lens, blocks_per_seq=8):
    backend = TorchPagedAttention()
    cache = torch.zeros(backend.kv_cache_shape(64, BS, KV, D))
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(query_lens))]
    meta = backend.build_metadata(AttentionInputs(query_lens, context_lens, tables, BS), torch.device("cpu"))
    n = sum(query_lens)
    q, k, v = torch.randn(n, H, D), torch.randn(n, KV, D), torch.randn(n, KV, D)
    return backend, cache, meta, (q, k, v)


def test_prefill_attends_on_4d_tensors_with_grouped_kv_heads():
    backend, cache, meta, (q, k, v) = step([7, 5, 1], [0, 9, 12])  # a prompt, a chunk over context, a decode
    with SdpaLog() as sdpa:
        backend.forward(q, k, v, cache, meta, D ** -0.5)
    prefill_calls = [c for c in sdpa.calls if c[0][0] == 1]
    assert len(prefill_calls) == 2
    for q_shape, k_shape, gqa in prefill_calls:
        assert len(q_shape) == 4 and q_shape[1] == H and k_shape[1] == KV and gqa
    assert "repeat_interleave" not in sdpa.names


def test_a_decode_step_gathers_once_and_never_syncs_with_the_host():
    batch, width = 3, 8
    backend, cache, meta, (q, k, v) = step([1] * batch, [9, 20, 30], blocks_per_seq=width)
    assert meta.decode_only
    with DispatchLog() as log:
        backend.forward(q, k, v, cache, meta, D ** -0.5)
    kv_sized = batch * width * BS * KV * D  # one of K or V, gathered for every sequence
    big = [name for name, numel in log.ops if numel >= kv_sized]
    assert big == ["index_select"], log.ops  # K and V in one gather; no masked or permuted copies
    assert not any(name in ("_local_scalar_dense", "item") for name, _ in log.ops)
