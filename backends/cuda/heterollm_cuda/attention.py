"""Paged attention on CUDA: the core's graph-capturable torch implementation (SDPA picks flash or
memory-efficient kernels on CUDA); decode steps run batched with fixed shapes."""
from __future__ import annotations

from heterollm.model_executor.paged_attention import TorchPagedAttention


class CudaPagedAttention(TorchPagedAttention):
    """The core's torch paged attention on CUDA tensors (the varlen kernel is the next step)."""
