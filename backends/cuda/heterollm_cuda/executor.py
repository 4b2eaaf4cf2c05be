"""The CUDA executor: the core's in-process model runner on the current CUDA device (tensor
parallelism runs one per rank, each on device rank % device_count)."""
from __future__ import annotations

from heterollm.model_executor.executor import InProcessExecutor


class CudaExecutor(InProcessExecutor):
    platforms = ("cuda",)
