"""The host KV tier (`--host_blocks_factor`, FastDeploy's `--swap_space`): a second, larger pool of
block-sized slots in host memory behind the prefix cache.

A cached block the device pool evicts (least recently freed first) is copied to a host slot
instead of being forgotten; a later request whose prefix chain reaches it gets a fresh device
block and the slot is copied back, before the step that reads it. Host slots are themselves
evicted least recently used. Preemption goes through the same path: a preempted request's full,
committed blocks stay cached; when the pool needs them they move to the host, and on resume the
request finds them (on the device or the host) and recomputes only its last, partial block.

Engine side (this module's `HostTier`) keeps the bookkeeping: which prefix hash each slot holds and
the moves the next step must make, which `SchedulerOutput.kv_transfers` carries to every rank. Rank
side, the `"host"` KV connector (`HostMemoryConnector` here, or a backend's own) holds the slots'
bytes and copies. On the CPU backend both pools are host memory: the tier still proves its logic
and accounting, and a device backend uses it unchanged.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from heterollm.interfaces.kv_connector import KVConnector, KVTransfers

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig
    from heterollm.model_executor.runner import LaunchContext


def host_slots_for(config: HeterollmConfig, num_blocks: int, bytes_per_block: int) -> int:
    """Host slots for a replica whose device pool has `num_blocks` blocks of `bytes_per_block` bytes
    (all ranks): `--host_blocks_factor` x the device blocks (xLLM), or as many as `--swap_space` GiB
    holds (FastDeploy); the larger when both are set."""
    by_factor = int(config.kv_cache_store.host_blocks_factor * num_blocks)
    swap = config.fastdeploy.swap_space or 0.0
    by_space = int(swap * 2**30 // bytes_per_block) if bytes_per_block > 0 else 0
    return max(by_factor, by_space)


def host_available_bytes() -> int:
    """Host memory available now (Linux's MemAvailable; else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_tier_flag(config: HeterollmConfig) -> str:
    """The flag that sized the tier, as a user would name it."""
    return "--host_blocks_factor" if config.kv_cache_store.host_blocks_factor > 0 else "--swap_space"


def host_tier_problems(config: HeterollmConfig) -> list[str]:
    """Why the host tier cannot serve this config (empty: it can)."""
    if not (config.kv_cache_store.host_blocks_factor > 0 or config.fastdeploy.swap_space):
        return []
    flag = host_tier_flag(config)
    out = []
    if not config.kv_cache.enable_prefix_cache:
        out.append(f"{flag}: the host tier keeps prefix-cache blocks (by hash): it needs --enable_prefix_cache")
    from heterollm.config.checks import attention_dp_size

    if attention_dp_size(config) > 1:
        out.append(f"{flag}: the host tier is not built for attention data parallelism (--dp_size with "
                   "--enable_attention_dp / MoE): each DP rank keeps its own pool")
    if config.speculative.draft_model:
        out.append(f"{flag}: a draft model keeps its own KV cache, which the host tier does not move: "
                   "not served with --draft_model")
    return out


class HostTier:
    """Engine-side bookkeeping of the host slots: hash -> slot in LRU order, the free slots, and the
    moves not yet handed to a step."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slots: OrderedDict[int, int] = OrderedDict()
        """hash -> slot, least recently used first."""
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        """Slots a pending load reads: not reused before that load is handed to a step."""
        self._orphans: set[int] = set()
        """Pinned slots whose hash `clear` forgot."""
        self._pending = KVTransfers()
        self.saved = 0
        """Blocks copied to the host so far."""
        self.loaded = 0
        """Blocks copied back."""
        self.dropped = 0
        """Evicted device blocks the tier had no unpinned slot for."""

    @property
    def num_used(self) -> int:
        return len(self.slots)

    def lookup(self, block_hash: int) -> int | None:
        return self.slots.get(block_hash)

    def spill(self, block: int, block_hash: int) -> None:
        """The device pool evicts `block`, which holds `block_hash`: keep a copy in a host slot."""
        slot = self.slots.get(block_hash)
        if slot is not None:  # already there (loaded back earlier, or saved twice): it is recent again
            self.slots.move_to_end(block_hash)
            return
        slot = self._take()
        if slot is None:
            self.dropped += 1
            return
        self.slots[block_hash] = slot
        self._pending.save.append((block, slot))
        self.saved += 1

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self.slots.items():  # least recently used first
            if slot not in self._pinned:
                del self.slots[h]
                return slot
        return None

    def pin(self, hashes: list[int]) -> None:
        """Keep the slots holding `hashes` until the next step is built (they are about to be loaded)."""
        self._pinned.update(self.slots[h] for h in hashes)

    def load(self, block_hash: int, block: int) -> None:
        """Copy the slot holding `block_hash` into the device block `block` before the next step."""
        slot = self.slots[block_hash]
        self.slots.move_to_end(block_hash)
        self._pinned.add(slot)
        self._pending.load.append((slot, block))
        self.loaded += 1

    def take_transfers(self) -> KVTransfers | None:
        """The moves since the last call, for the step being built (None when there are none)."""
        if not self._pending:
            return None
        out, self._pending = self._pending, KVTransfers()
        self._pinned.clear()
        if self._orphans:
            self._free.extend(sorted(self._orphans, reverse=True))
            self._orphans.clear()
        return out

    def clear(self) -> None:
        """Forget every cached prefix (`reset_prefix_cache`); pending moves still run."""
        self.slots.clear()
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in self._pinned]
        self._orphans |= self._pinned  # free again once their loads are handed out


class HostMemoryConnector(KVConnector):
    """The core's "host" connector: one host tensor per layer shaped like the layer's cache with
    `num_slots` blocks, copied to and from with index_select / index_copy_ (pinned memory when the
    cache is not itself in host memory, so the copies can overlap)."""

    @classmethod
    def validate(cls, config: HeterollmConfig) -> list[str]:
        return host_tier_problems(config)

    def __init__(self, launch: LaunchContext, caches: list[torch.Tensor], block_dim: int, num_slots: int) -> None:
        self.caches = caches
        self.block_dim = block_dim
        self.slots: list[torch.Tensor] = []
        for cache in caches:
            shape = list(cache.shape)
            shape[block_dim] = num_slots
            pin = cache.device.type != "cpu"
            self.slots.append(torch.empty(shape, dtype=cache.dtype, device="cpu", pin_memory=pin))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)

    layerwise = True

    def _move(self, src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        dim = self.block_dim
        src_ids = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst_ids = torch.tensor([b for _, b in pairs], dtype=torch.long)
        for s, d in zip(src, dst):
            rows = s.index_select(dim, src_ids.to(s.device))
            d.index_copy_(dim, dst_ids.to(d.device), rows.to(d.device, non_blocking=True))

    def save(self, pairs: list[tuple[int, int]]) -> None:
        self._move(self.caches, self.slots, pairs)

    def load(self, pairs: list[tuple[int, int]]) -> None:
        self._move(self.slots, self.caches, pairs)

    def load_layers(self, pairs: list[tuple[int, int]], layers: range) -> None:
        self._move([self.slots[i] for i in layers], [self.caches[i] for i in layers], pairs)

    def close(self) -> None:
        self.slots = []
        self.caches = []
