"""CUDA graphs for decode steps (`--enable_graph`), on the core's device-graph bookkeeping."""
from __future__ import annotations

import torch

from heterollm.model_executor.graph_capture import DeviceGraphRunner, GraphOps, StreamGraphOps


class CudaGraphRunner(DeviceGraphRunner):
    """The core's device-graph bookkeeping over torch.cuda.CUDAGraph."""

    def make_ops(self) -> GraphOps:
        return StreamGraphOps(torch.cuda, "CUDAGraph")
