"""The NPU components: the core's graph-capturable torch paged attention on NPU tensors, ACL graph
capture through torch_npu's NPUGraph (the CUDA-graph-style API), HCCL collectives, and the core's
in-process executor. torch_npu's fused attention kernels are the next step for speed."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator
from heterollm.model_executor.executor import InProcessExecutor
from heterollm.model_executor.graph_capture import DeviceGraphRunner, GraphOps, StreamGraphOps
from heterollm.model_executor.paged_attention import TorchPagedAttention


class NpuPagedAttention(TorchPagedAttention):
    platforms = ("npu",)


class AclGraphRunner(DeviceGraphRunner):
    platforms = ("npu",)

    def make_ops(self) -> GraphOps:
        import torch
        import torch_npu  # noqa: F401  (adds torch.npu)

        return StreamGraphOps(torch.npu, "NPUGraph")


class HcclCommunicator(TorchDistributedCommunicator):
    platforms = ("npu",)
    backend = "hccl"


class NpuExecutor(InProcessExecutor):
    platforms = ("npu",)
