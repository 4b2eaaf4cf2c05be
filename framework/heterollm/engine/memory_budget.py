"""One memory budget per host: how many KV cache blocks an engine replica gets.

`--max_memory_utilization` is a fraction of each memory's TOTAL (as vLLM's gpu_memory_utilization
is), for all of heterollm's engine processes on it together: the weights, activation peaks and KV
caches of every tensor-parallel rank, every `--dp_size` replica and every independent instance.
The total, not the free figure, so that the share does not depend on what happened to be free
when a process started, nor on the order in which instances start; the free figure only feeds
a warning (a lazily committed CPU cache larger than what is free would run the host out of memory
as it fills).

The launcher (the engine, after its ranks loaded their weights) plans once from the ranks'
RankMemory reports; ranks never size their cache themselves. Per memory (a device, or the host
for the CPU, which every rank shares):

    budget    = max_memory_utilization x total
    share     = (budget - what other heterollm processes on this host reserved) / dp_size
    kv room   = share - sum over this replica's ranks on it of (weights + activation peak)
    blocks    = kv room // sum over those ranks of their bytes per block

and the replica's block count is the smallest over its memories (every rank holds every block).
`--max_cache_size` instead caps the KV cache of the whole instance in bytes (split over its
replicas, and over its ranks through their bytes per block); `--num_gpu_blocks_override` fixes
the block count. Either may exceed the budget: that is warned about, with the numbers. Whatever
the sizing, a replica whose kv room cannot hold one `max_model_len` sequence is refused.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from heterollm.config import ConfigError
from heterollm.interfaces.executor import RankMemory

MiB = 2**20


def mib(n: int | float) -> str:
    return f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class KVSizing:
    """The flags that size the cache."""

    max_memory_utilization: float
    max_cache_size: int = 0
    """Bytes of KV cache for the whole instance; 0: from the budget."""
    num_gpu_blocks_override: int | None = None
    dp_size: int = 1
    max_model_len: int = 1
    block_size: int = 1

    @property
    def flag(self) -> str:
        """The flag the block count comes from."""
        if self.num_gpu_blocks_override:
            return "--num_gpu_blocks_override"
        return "--max_cache_size" if self.max_cache_size > 0 else "--max_memory_utilization"

    @property
    def seq_blocks(self) -> int:
        """Blocks one max_model_len sequence needs."""
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class MemoryShare:
    """One memory (device or host) as this replica sees it."""

    device: str
    ranks: int
    """This replica's ranks drawing on it."""
    total: int
    free: int
    budget: int
    """max_memory_utilization x total: for every heterollm process on it."""
    others: int
    """Reserved on it by other heterollm processes (the host registry)."""
    share: int
    """This replica's part: (budget - others) / dp_size."""
    fixed: int
    """Weights plus activation peaks of this replica's ranks on it."""
    per_block: int
    """KV bytes one block takes over this replica's ranks on it."""

    @property
    def kv_room(self) -> int:
        return self.share - self.fixed

    def reserved(self, num_blocks: int) -> int:
        """What this replica holds on it with `num_blocks` blocks."""
        return self.fixed + num_blocks * self.per_block


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    sizing: KVSizing
    memories: tuple[MemoryShare, ...]

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block over all of this replica's ranks."""
        return sum(m.per_block for m in self.memories)

    @property
    def kv_bytes(self) -> int:
        """This replica's KV cache over all its ranks (what it reserves; pages may come later)."""
        return self.num_blocks * self.bytes_per_block

    def reserved(self) -> dict[str, int]:
        """Per memory, what this replica holds: weights, activation peaks and KV cache."""
        return {m.device: m.reserved(self.num_blocks) for m in self.memories}


def group_by_memory(ranks: Sequence[RankMemory]) -> dict[str, list[RankMemory]]:
    groups: dict[str, list[RankMemory]] = {}
    for r in ranks:
        groups.setdefault(r.device, []).append(r)
    return groups


def shares(ranks: Sequence[RankMemory], sizing: KVSizing, others: Mapping[str, int]) -> tuple[MemoryShare, ...]:
    """This replica's share of each memory its ranks draw on."""
    out = []
    for device, group in group_by_memory(ranks).items():
        total = group[0].total
        budget = int(sizing.max_memory_utilization * total)
        held = others.get(device, 0)
        out.append(MemoryShare(device=device, ranks=len(group), total=total, free=min(r.free for r in group),
                               budget=budget, others=held, share=(budget - held) // sizing.dp_size,
                               fixed=sum(r.weights + r.activation_peak for r in group),
                               per_block=sum(r.kv_bytes_per_block for r in group)))
    return tuple(out)


def _num_blocks(memories: Sequence[MemoryShare], sizing: KVSizing) -> int:
    if sizing.num_gpu_blocks_override:
        return sizing.num_gpu_blocks_override
    if sizing.max_cache_size > 0:
        per_block = sum(m.per_block for m in memories)
        blocks = sizing.max_cache_size // sizing.dp_size // per_block
        if blocks < 1:
            raise ConfigError(f"--max_cache_size={sizing.max_cache_size}: smaller than one KV block per replica "
                              f"({per_block} bytes over the ranks, {sizing.dp_size} replica(s))")
        return blocks
    return min(max(0, m.kv_room) // m.per_block for m in memories)


def _too_small(m: MemoryShare, sizing: KVSizing) -> str:
    need = sizing.seq_blocks * m.per_block
    return (f"{m.device}: the budget is --max_memory_utilization={sizing.max_memory_utilization} x {mib(m.total)} = "
            f"{mib(m.budget)}; other heterollm processes on this host hold {mib(m.others)}, leaving this replica "
            f"{mib(m.share)} (of {sizing.dp_size} replica(s)); weights and activations take {mib(m.fixed)}, so "
            f"{mib(max(0, m.kv_room))} remain for the KV cache, less than one max_model_len={sizing.max_model_len} "
            f"sequence needs ({sizing.seq_blocks} blocks, {mib(need)}). Raise --max_memory_utilization, lower "
            f"--max_model_len, or give the other instances smaller --max_cache_size values")


def plan_kv_cache(ranks: Sequence[RankMemory], sizing: KVSizing, others: Mapping[str, int]) -> KVPlan:
    """The replica's block count, from its ranks' reports and what other processes on this host
    reserved (per memory). Raises ConfigError when what remains of the budget cannot hold one
    max_model_len sequence, naming the flags and the numbers."""
    if not ranks:
        raise ValueError("no rank reported its memory")
    memories = shares(ranks, sizing, others)
    short = [_too_small(m, sizing) for m in memories if m.kv_room < sizing.seq_blocks * m.per_block]
    if short:
        raise ConfigError("no room for the KV cache: " + "; ".join(short))
    return KVPlan(_num_blocks(memories, sizing), sizing, memories)


def plan_warnings(plan: KVPlan, held: Mapping[str, int]) -> list[str]:
    """Why this plan may overcommit: on a memory, all heterollm processes' reservations (this one's
    `held` by its other replicas, plus this replica's) above the budget; or this replica's KV cache
    larger than what is free there now."""
    out = []
    for m in plan.memories:
        mine = held.get(m.device, 0) + m.reserved(plan.num_blocks)
        if m.others + mine > m.budget:
            out.append(f"{m.device}: heterollm processes on this host reserve {mib(m.others + mine)} (others "
                       f"{mib(m.others)}, this one {mib(mine)}), more than the budget --max_memory_utilization="
                       f"{plan.sizing.max_memory_utilization} x {mib(m.total)} = {mib(m.budget)} "
                       f"({plan.sizing.flag} sizes this cache); if they all fill, the host runs out of memory")
        kv = plan.num_blocks * m.per_block
        if kv > m.free:
            out.append(f"{m.device}: this replica's KV cache ({mib(kv)}) is more than the {mib(m.free)} free there "
                       f"now; --max_memory_utilization counts total memory ({mib(m.total)}), including what other "
                       f"programs hold")
    return out
