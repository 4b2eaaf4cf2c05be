"""Collectives over a gloo process group; with one rank every call is a no-op."""
from __future__ import annotations

from heterollm.distributed.communicator import TorchDistributedCommunicator


class GlooCommunicator(TorchDistributedCommunicator):
    backend = "gloo"
