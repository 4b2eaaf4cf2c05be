"""Collectives over NCCL (torch.distributed)."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator


class NcclCommunicator(TorchDistributedCommunicator):
    backend = "nccl"
