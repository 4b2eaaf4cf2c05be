"""Who this worker is in tensor and expert parallelism; models reach collectives only through this."""
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
    ep_size: int = 1
    """Expert parallelism (--ep_size): 1, or tp_size x dp_size, the ranks each holding whole experts,
    a 1 / ep_size share of them, instead of a slice of every expert."""
    redundant_experts: int | None = None
    """EPLB (--enable_eplb): the extra expert slots per rank (--redundant_experts_num) that hold
    replicas of hot experts; None without EPLB."""
    dp_size: int = 1
    """Attention data parallelism (--dp_size with --ep_size = dp_size): the ranks each run attention
    and the dense layers whole (tp_size 1), on their own requests' tokens; only the experts' layers
    exchange tokens, through `all_to_all` over the `communicator`'s ep_size ranks."""
    dp_rank: int = 0

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank if self.ep_size > 1 else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_size == 1 else self.communicator.all_reduce(x)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        if self.ep_size == 1:
            return x, send_counts
        return self.communicator.all_to_all(x, send_counts, recv_counts)

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
