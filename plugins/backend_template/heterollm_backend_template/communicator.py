"""Collectives for tensor parallelism. A vendor whose collective library plugs into
torch.distributed (as HCCL and CNCL do) only names its backend; one that does not implements the
Communicator contract's five calls itself."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator


class TemplateCommunicator(TorchDistributedCommunicator):
    backend = "gloo"
