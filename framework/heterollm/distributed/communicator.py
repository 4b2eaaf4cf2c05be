"""A Communicator over a torch.distributed process group: the collectives every backend whose
vendor library plugs into torch.distributed (gloo, nccl, hccl, cncl, ...) can share. A backend
subclasses it and names its `backend` and `platforms`."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist

from heterollm.interfaces import Communicator


COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""How long a collective waits for a rank before failing (torch's default is 30 minutes): a rank on
another node that died fails the step after this, instead of hanging it for half an hour."""


class TorchDistributedCommunicator(Communicator):
    backend: ClassVar[str] = "gloo"
    """The torch.distributed backend the process group is created with."""

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def __init__(self, rank: int, world_size: int, init_method: str | None,
                 device: torch.device | None = None) -> None:
        self._rank, self._world_size = rank, world_size
        self._owns_group = False
        self.seconds = 0.0
        """Wall time spent in collectives so far, waiting for the other ranks included (the runner
        reports each step's share as its "comm" timing)."""
        if world_size > 1 and not dist.is_initialized():
            # device_id binds the group to this rank's device (the vendor library then never guesses
            # it from the rank); none for host tensors
            bound = {} if device is None else {"device_id": device}
            dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=COLLECTIVE_TIMEOUT, **bound)
            self._owns_group = True

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size > 1:
            t = time.perf_counter()
            dist.all_reduce(tensor)
            self.seconds += time.perf_counter() - t
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        t = time.perf_counter()
        dist.all_gather(parts, tensor.contiguous())
        self.seconds += time.perf_counter() - t
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        if self._world_size == 1:
            return tensor, [tensor.shape[0]]
        if len(send_counts) != self._world_size or sum(send_counts) != tensor.shape[0]:
            raise ValueError(f"all_to_all: send_counts {send_counts} do not split {tensor.shape[0]} rows over "
                             f"{self._world_size} ranks")
        t = time.perf_counter()
        if recv_counts is None:
            recv = torch.empty(self._world_size, dtype=torch.long, device=tensor.device)
            dist.all_to_all_single(recv, torch.tensor(send_counts, dtype=torch.long, device=tensor.device))
            recv_counts = recv.tolist()
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), recv_counts, list(send_counts))
        self.seconds += time.perf_counter() - t
        return out, recv_counts

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._world_size > 1:
            dist.broadcast(tensor, src)
        return tensor

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()

    def destroy(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
