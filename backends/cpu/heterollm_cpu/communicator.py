"""Collectives over a gloo process group; with one rank every call is a no-op."""
from __future__ import annotations

import torch
import torch.distributed as dist

from heterollm.interfaces import Communicator


class GlooCommunicator(Communicator):
    platforms = ("cpu",)
    backend = "gloo"

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def __init__(self, rank: int, world_size: int, init_method: str | None) -> None:
        self._rank, self._world_size = rank, world_size
        self._owns_group = False
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(self.backend, init_method=init_method, rank=rank, world_size=world_size)
            self._owns_group = True

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

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
