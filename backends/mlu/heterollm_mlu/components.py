"""The MLU's own components: MLU graph capture through torch_mlu's MLUGraph (the CUDA-graph-style
API) and CNCL collectives. Attention is the core's graph-capturable torch paged attention and the
executor the core's in-process one, named directly in the descriptor."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator
from heterollm.model_executor.graph_capture import DeviceGraphRunner, GraphOps, StreamGraphOps


class MluGraphRunner(DeviceGraphRunner):
    def make_ops(self) -> GraphOps:
        import torch
        import torch_mlu  # noqa: F401  (adds torch.mlu)

        return StreamGraphOps(torch.mlu, "MLUGraph")


class CnclCommunicator(TorchDistributedCommunicator):
    backend = "cncl"
