"""The MLU components: the core's graph-capturable torch paged attention on MLU tensors, MLU graph
capture through torch_mlu's MLUGraph (the CUDA-graph-style API), CNCL collectives, and the core's
in-process executor."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator
from heterollm.model_executor.executor import InProcessExecutor
from heterollm.model_executor.graph_capture import DeviceGraphRunner, GraphOps, StreamGraphOps
from heterollm.model_executor.paged_attention import TorchPagedAttention


class MluPagedAttention(TorchPagedAttention):
    platforms = ("mlu",)


class MluGraphRunner(DeviceGraphRunner):
    platforms = ("mlu",)

    def make_ops(self) -> GraphOps:
        import torch
        import torch_mlu  # noqa: F401  (adds torch.mlu)

        return StreamGraphOps(torch.mlu, "MLUGraph")


class CnclCommunicator(TorchDistributedCommunicator):
    platforms = ("mlu",)
    backend = "cncl"


class MluExecutor(InProcessExecutor):
    platforms = ("mlu",)
