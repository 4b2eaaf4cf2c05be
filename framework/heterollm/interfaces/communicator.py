"""Communicator: collectives for tensor and expert parallelism (a backend's `components["communicators"]`)."""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    import torch


class Communicator(Component):
    """Collectives over a torch.distributed process group of the platform's `dist_backend`.
    Models call only this, never torch.distributed. With world_size 1 every call is a no-op."""

    @abstractmethod
    def __init__(self, rank: int, world_size: int, init_method: str | None,
                 device: torch.device | None = None) -> None:
        """Join (or, for world_size 1, skip) the process group. `device`: the device this rank's
        collectives run on (bound by `Platform.set_device`); None where tensors live on the host."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` across ranks; returns the reduced tensor (may be `tensor`, reduced in place)."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""

    def all_to_all(self, tensor: torch.Tensor, send_counts: list[int],
                   recv_counts: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Expert parallelism's dispatch and combine: the first `send_counts[j]` rows of `tensor` after
        those of lower ranks go to rank j; returns the rows every rank sent here, in rank order, and
        how many came from each rank (so the reply travels back with `send_counts` = those counts).
        `recv_counts`, when the caller knows them (a reply), spares exchanging the counts.
        Optional: the default refuses, and a launch with --ep_size > 1 is refused naming it
        (`supports_all_to_all()`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement all_to_all")

    @classmethod
    def supports_all_to_all(cls) -> bool:
        """Whether `all_to_all` is implemented (expert parallelism needs it)."""
        return cls.all_to_all is not Communicator.all_to_all

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy `src`'s tensor to every rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches this call."""

    @abstractmethod
    def destroy(self) -> None:
        """Leave the process group."""
