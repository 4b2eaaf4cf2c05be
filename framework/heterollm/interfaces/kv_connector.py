"""KVConnector: moves KV cache blocks between a rank's cache and another place: host memory (the
host tier), another instance (prefill/decode disaggregation) or a KV store.

A connector is registered by name in a backend descriptor's `kv_connectors` mapping ("host": the
host tier's block copies), like a model architecture: the launch takes the first of the
`--extension_impl` family, the platform's default family and the core's that registers that name
for the platform. A vendor ships its own (pinned host memory and copy streams, an HCCS or RDMA
transport) in its wheel.

The engine side decides what moves: the KV cache manager names blocks by prefix hash and keeps the
bookkeeping of what the other place holds; each step's `SchedulerOutput.kv_transfers` lists the
moves per connector, which every rank runs on its own shard of the cache before the step's forward
(pushes after it). Pulls and pushes between instances may run asynchronously (`asynchronous`): the
scheduler then keeps the request waiting for its K/V, and the engine steps on while it moves.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from collections.abc import Collection
from typing import TYPE_CHECKING

from heterollm.interfaces.component import Component

if TYPE_CHECKING:
    import torch

    from heterollm.model_executor.runner import LaunchContext


@dataclass(frozen=True)
class PeerRank:
    """Where one rank of another instance keeps its KV cache, as its "mooncake_transfer" connector
    describes it (`KVConnector.info`): the transfer endpoint and each layer tensor's address."""

    addr: str
    """host:port of the rank's transfer engine."""
    ptrs: tuple[int, ...]
    """Each layer's cache tensor's address in that process."""
    shape: tuple[int, ...]
    """One layer's cache shape (the attention backend's layout)."""
    dtype: str
    """The cache's torch dtype, e.g. "torch.bfloat16"."""


@dataclass(frozen=True)
class KVPull:
    """Copy a request's prompt blocks from another instance's ranks into this one's (prefill/decode
    disaggregation, PULL): remote block i goes to local block i."""

    request_id: str
    peers: tuple[PeerRank, ...]
    """The prefill instance's ranks, in rank order."""
    remote_blocks: tuple[int, ...]
    local_blocks: tuple[int, ...]
    expires_at: float = float("inf")
    """time.time() after which the prefill instance may have freed the blocks: no read may start near
    it, and a read that ends after it is dropped (the connector keeps a margin)."""


@dataclass(frozen=True)
class KVPush:
    """Write a request's prompt blocks into blocks another instance reserved for it (prefill/decode
    disaggregation, PUSH): local block i goes to remote block i. Runs after the step's forward, which
    computed them."""

    request_id: str
    peers: tuple[PeerRank, ...]
    """The decode instance's ranks, in rank order."""
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    expires_at: float = float("inf")
    """time.time() after which the decode instance may have freed the blocks: no write may start near
    it (the connector keeps a margin), and a write that ends after it fails the request."""


@dataclass
class KVTransfers:
    """One step's block moves for one connector. Every rank runs them before the step's forward (the
    pushes after it), all of `save` before any of `load` (a block saved this step may be reused as a
    load's destination)."""

    save: list[tuple[int, int]] = field(default_factory=list)
    """(cache block, key): copy the block's K/V out under `key` (the host tier's slot; the KV store's
    prefix hash)."""
    load: list[tuple[int, int]] = field(default_factory=list)
    """(key, cache block): copy `key` back into a cache block the step is about to read."""
    data: dict[int, list[bytes]] = field(default_factory=dict)
    """key -> the bytes of each rank's share (rank order), for a connector whose engine side fetched
    them (the KV store: a fetch that fails is a cache miss there, never a half-loaded block here)."""
    pulls: list[KVPull] = field(default_factory=list)
    """Requests whose prompt blocks come from another instance (the "mooncake_transfer" connector)."""
    pushes: list[KVPush] = field(default_factory=list)
    """Requests whose prompt blocks go to another instance once this step's forward wrote them
    (`KVConnector.after_forward`)."""

    def __bool__(self) -> bool:
        return bool(self.save or self.load or self.pulls or self.pushes)


class KVConnector(Component):
    """The worker half of a connector: one per rank, built after the rank's KV cache is allocated.

    `caches` is the rank's per-layer cache tensors (their layout is the attention backend's:
    `block_dim` is the dimension that indexes blocks, `AttentionBackend.cache_block_dim`), and
    `num_slots` the number of block-sized slots the engine sized for it (the host tier's
    `--host_blocks_factor` / `--swap_space`)."""

    @abstractmethod
    def __init__(self, launch: LaunchContext, caches: list[torch.Tensor], block_dim: int, num_slots: int) -> None:
        """Allocate the connector's own storage for `num_slots` blocks of every layer."""

    @abstractmethod
    def save(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (cache block, slot) out; done (or ordered before any later copy and forward) on return."""

    @abstractmethod
    def load(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (slot, cache block) in; the step's forward, which runs next, must see the data."""

    asynchronous = False
    """Whether `apply` and `after_forward` only start a step's pulls and pushes (the transfer runs while
    the engine goes on stepping) and `poll` says when each ended. A connector that moves them before
    returning keeps False: every move it was given has ended when the call returns."""

    def apply(self, transfers: KVTransfers) -> dict[str, str]:
        """Run one step's moves: saves first, then loads; start (or run) its pulls. Returns request id ->
        why, for requests whose blocks could not be brought in (a pull from a dead peer, found at once):
        the engine ends those requests with that error; the step's other requests are unaffected."""
        if transfers.save:
            self.save(transfers.save)
        if transfers.load:
            self.load(transfers.load)
        return {}

    layerwise = False
    """Whether `load_layers` is built: the runner then splits a step's loads into
    --layers_wise_copy_batchs groups of layers, copied while the forward runs (model_executor/layerwise.py)."""

    def load_layers(self, pairs: list[tuple[int, int]], layers: range) -> None:
        """`load` for only these layers' caches (called from another thread than the forward's, one
        group at a time; the forward reads a layer only after its group returned)."""
        raise NotImplementedError(f"{type(self).__name__} loads every layer at once")

    push_groups = 0
    """Layer-wise pushes: when > 0, a step whose forward completes prompts to push (an eager one: not a
    graph replay) hands each of that many groups of consecutive layers to `push_layers` as soon as the
    forward is past them, their K/V written (model_executor/layerwise.py, `PushingCaches`);
    `after_forward` then pushes the layers not handed over yet. 0: `after_forward` pushes every layer."""

    def push_layers(self, pushes: list[KVPush], layers: range) -> None:
        """Start pushing these layers' blocks of each push (called on the forward's thread, right after
        the last of them ran: a device connector records an event on the compute stream here)."""
        raise NotImplementedError(f"{type(self).__name__} pushes every layer after the forward")

    def after_forward(self, transfers: KVTransfers) -> dict[str, str]:
        """Start (or run) the step's moves that need its forward's K/V (`transfers.pushes`), after the
        forward. Returns request id -> why for the pushes that failed at once, as `apply` does."""
        return {}

    def poll(self, wait_for: Collection[str] = ()) -> dict[str, str | None]:
        """An asynchronous connector's pulls and pushes that ended since the last poll: request id ->
        None when its blocks arrived, or why not. `wait_for` names the pushes this step started: the
        connector may wait briefly for them to end (else the engine sees them end only at the next
        step, which may be a long prefill later). Called once per step on every rank; the engine keeps
        the blocks of a moving request (even one aborted meanwhile) until its move ended on every rank."""
        return {}

    def info(self) -> dict[str, object]:
        """What another instance needs to reach this rank's cache through this connector (the
        "mooncake_transfer" connector: a PeerRank's fields); empty when nothing."""
        return {}

    @property
    def nbytes(self) -> int:
        """Bytes of the connector's own storage on this rank (0 when it keeps none)."""
        return 0

    def close(self) -> None:
        """Release the connector's storage. Safe to call twice."""
