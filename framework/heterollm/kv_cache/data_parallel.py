"""The KV cache of an engine with attention data parallelism (`--dp_size` D with `--ep_size` D).

Each DP rank holds the K/V of its own requests only, so the engine's pool of `num_blocks` blocks is
D pools of `num_blocks // D`, one per rank: rank r's blocks are r * per .. (r + 1) * per - 1 in the
ids the scheduler sees (ScheduledRequest.block_ids), and a request's blocks all lie in one range,
which tells the ranks whose request it is (ModelRunner._own_requests).

`DataParallelKVCacheManager` keeps one KVCacheManager per rank behind the interface the scheduler
and the engine use, so neither knows about ranks beyond `same_pool` (preemption frees blocks of the
rank that is short). A request joins a rank when it is admitted: the rank whose prefix cache holds
the longest part of its prompt, then the one holding the fewest requests, then the most free
blocks; it stays there until it finishes or is preempted (then it may be admitted to another).
Each rank's prefix cache is its own: the same prompt on two ranks is cached twice."""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from heterollm.kv_cache.manager import KVCacheManager, PoolGauges


class _Tables(Mapping):
    """Request id -> its block table in the engine's ids (a fresh list each time)."""

    def __init__(self, kv: DataParallelKVCacheManager) -> None:
        self.kv = kv

    def __getitem__(self, request_id: str) -> list[int]:
        rank = self.kv.rank_of.get(request_id)
        if rank is None or request_id not in self.kv.ranks[rank].tables:
            raise KeyError(request_id)
        return self.kv.global_ids(rank, self.kv.ranks[rank].tables[request_id])

    def __iter__(self) -> Iterator[str]:
        for kv in self.kv.ranks:
            yield from kv.tables

    def __len__(self) -> int:
        return sum(len(kv.tables) for kv in self.kv.ranks)


class _Pools:
    """The ranks' block pools counted together (what the engine's gauges read)."""

    def __init__(self, kv: DataParallelKVCacheManager) -> None:
        self.kv = kv

    @property
    def num_blocks(self) -> int:
        return sum(kv.pool.num_blocks for kv in self.kv.ranks)

    @property
    def num_free(self) -> int:
        return sum(kv.pool.num_free for kv in self.kv.ranks)

    @property
    def num_touched(self) -> int:
        return sum(kv.pool.num_touched for kv in self.kv.ranks)

    @property
    def num_cached(self) -> int:
        return sum(kv.pool.num_cached for kv in self.kv.ranks)


class DataParallelKVCacheManager(PoolGauges):
    def __init__(self, dp_size: int, num_blocks: int, block_size: int, enable_prefix_cache: bool = False,
                 hash_seed: int = 1024, record_events: bool = False, idle_limit: int | None = None) -> None:
        per = num_blocks // dp_size
        if per <= 0:
            raise ValueError(f"the KV cache needs at least one block per attention DP rank, got {num_blocks} "
                             f"blocks for {dp_size} ranks")
        self.per_rank = per
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        limit = None if idle_limit is None else max(1, idle_limit // dp_size)
        self.ranks = [KVCacheManager(per, block_size, enable_prefix_cache, hash_seed, record_events, limit)
                      for _ in range(dp_size)]
        self.rank_of: dict[str, int] = {}
        """Request id -> the DP rank holding (or about to hold) its blocks."""
        self.tables = _Tables(self)
        self.pool = _Pools(self)

    def global_ids(self, rank: int, blocks: Sequence[int]) -> list[int]:
        return [rank * self.per_rank + b for b in blocks]

    # -- counters and gauges ---------------------------------------------------------------
    @property
    def queries(self) -> int:
        return sum(kv.queries for kv in self.ranks)

    @property
    def hits(self) -> int:
        return sum(kv.hits for kv in self.ranks)

    host_hits = 0
    store_hits = 0

    def reset_counters(self) -> None:
        for kv in self.ranks:
            kv.reset_counters()

    def take_transfers(self) -> None:
        """No host tier under attention DP (refused at launch)."""
        return None


    # -- which rank ------------------------------------------------------------------------
    def _held(self, request_id: str) -> int | None:
        """The rank holding blocks of the request; None while it holds none."""
        rank = self.rank_of.get(request_id)
        return rank if rank is not None and self.ranks[rank].tables.get(request_id) else None

    def _least_loaded(self, candidates: Sequence[int]) -> int:
        return min(candidates, key=lambda r: (len(self.ranks[r].tables), -self.ranks[r].num_free_blocks, r))

    def same_pool(self, a: str, b: str) -> bool:
        """Whether freeing request `b`'s blocks can make room for request `a` (both on one rank)."""
        rank = self.rank_of.get(a)
        return rank is None or self.rank_of.get(b) == rank

    # -- prefix cache ----------------------------------------------------------------------
    host_blocks_past_limit = False
    """No host tier under attention DP (refused at launch): no host-tier limit ever cuts a match."""

    def pending_host_blocks(self, request_id: str) -> int:
        return 0

    def match_prefix(self, request_id: str, tokens: Sequence[int], start_block: int = 0,
                     host_limit: int | None = None) -> int:
        held = self._held(request_id)
        if held is not None:
            return self.ranks[held].match_prefix(request_id, tokens, start_block)
        found = [kv.match_prefix(request_id, tokens, start_block) for kv in self.ranks]
        best = max(found)
        rank = self._least_loaded([r for r, n in enumerate(found) if n == best])
        for r, kv in enumerate(self.ranks):
            if r != rank:
                kv.drop(request_id)
        self.rank_of[request_id] = rank
        return best

    def commit_due(self, request_id: str, num_computed: int) -> bool:
        rank = self.rank_of.get(request_id)
        return rank is not None and self.ranks[rank].commit_due(request_id, num_computed)

    def commit(self, request_id: str, tokens: Sequence[int], num_computed: int) -> None:
        rank = self.rank_of.get(request_id)
        if rank is not None:
            self.ranks[rank].commit(request_id, tokens, num_computed)

    def take_events(self) -> list[tuple]:
        return [event for kv in self.ranks for event in kv.take_events()]

    def reset_prefix_cache(self) -> None:
        for kv in self.ranks:
            kv.reset_prefix_cache()

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        rank = self.rank_of.get(request_id)
        if rank is not None:
            return self.ranks[rank].can_allocate(request_id, num_tokens)
        return any(kv.can_allocate(request_id, num_tokens) for kv in self.ranks)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        rank = self.rank_of.get(request_id)
        if rank is None:  # not matched (no prefix cache): the least loaded rank with room
            fits = [r for r, kv in enumerate(self.ranks) if kv.can_allocate(request_id, num_tokens)]
            rank = self._least_loaded(fits or range(len(self.ranks)))
            self.rank_of[request_id] = rank
        table = self.ranks[rank].allocate(request_id, num_tokens)
        if table is None:
            if not self.ranks[rank].tables.get(request_id):
                self.rank_of.pop(request_id, None)  # not admitted: the next attempt may go elsewhere
            return None
        return self.global_ids(rank, table)

    def trim(self, request_id: str, num_tokens: int) -> None:
        rank = self.rank_of.get(request_id)
        if rank is not None:
            self.ranks[rank].trim(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].free(request_id)

    def drop(self, request_id: str) -> None:
        rank = self.rank_of.pop(request_id, None)
        if rank is not None:
            self.ranks[rank].drop(request_id)
