"""The NPU's own components: ACL graph capture through torch_npu's NPUGraph (the CUDA-graph-style
API) and HCCL collectives. Attention is the core's graph-capturable torch paged attention and the
executor the core's in-process one, named directly in the descriptor; torch_npu's fused attention
kernels are the next step for speed."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator
from heterollm.model_executor.graph_capture import DeviceGraphRunner, GraphOps, StreamGraphOps


class AclGraphRunner(DeviceGraphRunner):
    def make_ops(self) -> GraphOps:
        import torch
        import torch_npu  # noqa: F401  (adds torch.npu)

        return StreamGraphOps(torch.npu, "NPUGraph")


class HcclCommunicator(TorchDistributedCommunicator):
    backend = "hccl"
