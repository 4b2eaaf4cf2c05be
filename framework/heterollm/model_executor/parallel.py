"""Who this worker is in tensor parallelism; models reach collectives only through this."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from heterollm.interfaces import Communicator


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    communicator: Communicator | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else self.communicator.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x if self.tp_size == 1 else self.communicator.all_gather(x, dim)

    def shard(self, size: int, what: str) -> int:
        if size % self.tp_size:
            raise ValueError(f"{what}={size} is not divisible by tp_size={self.tp_size}; pick a tp_size that "
                             f"divides it")
        return size // self.tp_size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(KV heads on this rank, partitions of the KV heads). With fewer KV heads than ranks, each
        rank holds one, replicated over tp_size / total ranks."""
        if total % self.tp_size == 0:
            return total // self.tp_size, self.tp_size
        if self.tp_size % total == 0:
            return 1, total
        raise ValueError(f"num_key_value_heads={total} is neither divisible by tp_size={self.tp_size} nor a "
                         f"divisor of it")
