"""Block pool, per-request block tables and the prefix cache.

A request owning `n` tokens of KV holds ceil(n / block_size) blocks. `allocate` grows a table
to cover the tokens scheduled this step or refuses (the scheduler then preempts); `free` returns
all of a request's blocks; `trim` gives back tail blocks (speculative decoding's rejected tokens).

Prefix cache (`--enable_prefix_cache`, on by default). A full block is named by a hash chain:
hash(parent block's hash, the block's token ids, extra keys) with XXH3-128 seeded by
`--xxh3_128bits_seed`, so equal hashes mean equal prefixes up to and including the block. Once a
block's K/V is computed (`commit`) its hash is registered; `match_prefix` walks a new request's
chain and `allocate` shares every leading hit (reference counted). The last, partial block is
never shared, and at least one prompt token is always recomputed so the request has logits to
sample from. A block whose count drops to zero keeps its hash and stays findable until the pool
needs it; cached blocks are evicted least recently freed first (a request's tail blocks before
its head, as they are the least likely to be shared). See BlockPool for the order.

Events for `--kv_events_config` are recorded as plain tuples when `record_events` is set and
drained once per step with `take_events()`:
("stored", block_hashes, parent_hash, token_ids, block_size), ("removed", block_hashes), ("cleared",).
"""
from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

from heterollm.interfaces.kv_connector import KVTransfers
from heterollm.kv_cache.host_tier import HostTier
from heterollm.kv_cache.store_tier import StoreTier


def hash_block(parent: int | None, token_ids: Sequence[int], seed: int, extra: bytes = b"") -> int:
    """XXH3-128 of (parent hash, token ids, extra keys): one link of the prefix hash chain."""
    head = b"" if parent is None else parent.to_bytes(16, "little")
    return xxhash.xxh3_128_intdigest(head + array.array("q", token_ids).tobytes() + extra, seed=seed)


class BlockPool:
    """Blocks with reference counts. Free blocks fall in three sets: freed blocks that hold no
    cached prefix (a stack: the most recently freed go out first), blocks never used yet (in
    order), and freed blocks that hold a cached prefix (in LRU order, evicted when needed). Freed
    plain blocks always go first; then untouched blocks before any eviction, so the prefix cache
    keeps as much as the pool holds. With `idle_limit` (a cache whose pages are committed on first
    write, as on CPU) at most that many cached blocks wait unreferenced: beyond it the LRU one is
    evicted before an untouched block is touched, so resident memory levels off at the working
    set plus the limit instead of growing over a long run to the whole reservation."""

    def __init__(self, num_blocks: int, idle_limit: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.idle_limit = idle_limit
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        """hash -> the block holding that prefix."""
        self._free: list[int] = []
        self._fresh: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 on top
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.events: list[tuple] | None = None
        self.generation = [0] * num_blocks
        """Per block: how many times it stopped naming a prefix (a pending KV store put checks it)."""
        self.on_evict: Callable[[int, int], None] | None = None
        """Called with (block, hash) as the pool evicts a cached block for reuse (the host tier)."""

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._fresh) + len(self._evictable)

    def _next(self) -> int:
        if self._free:
            return self._free.pop()
        if self._fresh and (self.idle_limit is None or len(self._evictable) < self.idle_limit):
            return self._fresh.pop()
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block, self.block_hash[block])
            self.uncache(block)
            return block
        return self._fresh.pop()

    @property
    def num_touched(self) -> int:
        """Blocks ever handed out (the rest were never written: on CPU their pages are not committed)."""
        return self.num_blocks - len(self._fresh)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            block = self._next()
            self.ref[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Share cached blocks with one more request."""
        for block in blocks:
            if self.ref[block] == 0:
                del self._evictable[block]
            self.ref[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the tail is released first so it is evicted first."""
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def cache(self, block: int, block_hash: int) -> bool:
        """Register `block` as holding the prefix `block_hash`; False if another block already does."""
        if block_hash in self.cached or self.block_hash[block] is not None:
            return False
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        return True

    def uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
            self.generation[block] += 1
            if self.events is not None:
                self.events.append(("removed", [h]))

    def clear_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents, just not their names)."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.generation = [g + 1 for g in self.generation]
        if self.events is not None:
            self.events.append(("cleared",))


class PoolGauges:
    """What the scheduler and the engine read of a manager's `pool` (num_free, num_blocks) and
    `block_size`."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class KVCacheManager(PoolGauges):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = False,
                 hash_seed: int = 1024, record_events: bool = False, idle_limit: int | None = None,
                 host_slots: int = 0, store: StoreTier | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, idle_limit)
        self.host: HostTier | None = None
        """The host tier (kv_cache/host_tier.py): evicted cached blocks spill there; None without one."""
        if host_slots:
            if not enable_prefix_cache:
                raise ValueError("the host tier keeps prefix-cache blocks: it needs the prefix cache")
            self.host = HostTier(host_slots)
            self.pool.on_evict = self.host.spill
        self.store = store
        """The KV cache store (kv_cache/store_tier.py): committed blocks are put there, and a prefix
        chain that runs past the device pool and the host tier is looked up there; None without one."""
        if store is not None and not enable_prefix_cache:
            raise ValueError("the KV cache store keeps prefix-cache blocks: it needs the prefix cache")
        self._store_hits: dict[str, tuple[int, list[int], dict[int, list[bytes]], Sequence[int]]] = {}
        """Per request: (first block index, hashes fetched from the store after its device and host
        hits, their bytes, its tokens), loaded into fresh blocks at its next allocate."""
        self._store_loads = KVTransfers()
        """Store blocks handed to requests, for the next step to copy in."""
        self.store_hits = 0
        """Of the prefix-cache hits, tokens fetched from the KV cache store."""
        self._host_hits: dict[str, tuple[int, list[int], Sequence[int]]] = {}
        """Per request: (first block index, hashes found in the host tier after its device hits, its
        tokens), loaded into fresh blocks at its next allocate."""
        self.host_hits = 0
        """Of the prefix-cache hits, tokens found in the host tier (loaded back)."""
        self.tables: dict[str, list[int]] = {}
        self.host_blocks_past_limit = False
        """The last `match_prefix` left host-tier blocks behind for its `host_limit`."""
        self.enable_prefix_cache = enable_prefix_cache
        self.hash_seed = hash_seed
        self._hashes: dict[str, list[int]] = {}
        """Per request: the chain hashes of its full blocks computed so far (a cache of hash_block)."""
        self._committed: dict[str, int] = {}
        """Per request: how many leading blocks of its table are known to be in the cache (or were offered to it)."""
        self._hits: dict[str, list[int]] = {}
        """Per request: blocks found by match_prefix, shared at its next allocate."""
        self._lookups: dict[str, tuple[int, int, int, int]] = {}
        """Per request: (tokens looked up, tokens found, of those in the host tier, of those in the KV
        store) by its last match_prefix, counted once it is admitted."""
        self.queries = 0
        """Prompt tokens looked up in the prefix cache (a Prometheus counter)."""
        self.hits = 0
        """Of those, tokens found."""
        if record_events:
            self.pool.events = []

    def reset_counters(self) -> None:
        """Forget the lookups so far (the engine's start-up profile is not traffic)."""
        self.queries = self.hits = self.host_hits = self.store_hits = 0


    def same_pool(self, a: str, b: str) -> bool:
        """Whether freeing request `b`'s blocks can make room for request `a` (one pool: always;
        attention DP's manager keeps one pool per rank)."""
        return True

    # -- prefix cache ----------------------------------------------------------------------
    def _chain(self, request_id: str, tokens: Sequence[int], num_blocks: int) -> list[int]:
        """The request's chain hashes for its first `num_blocks` full blocks (computed once each)."""
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs], self.hash_seed))
        return hashes

    def match_prefix(self, request_id: str, tokens: Sequence[int], start_block: int = 0,
                     host_limit: int | None = None, device_only: bool = False) -> int:
        """Find the cached blocks that continue the request's table from `start_block` (0 for a new
        request) and hold them for its next `allocate`; returns how many tokens they cover. At least
        the last token is left to compute. Of the host tier's blocks at most `host_limit` are taken
        (the rest of the prompt is computed); `host_blocks_past_limit` says whether that cut any.
        `device_only`: neither the host tier nor the store is looked at."""
        self.host_blocks_past_limit = False
        if not self.enable_prefix_cache:
            return 0
        limit = (len(tokens) - 1) // self.block_size
        hashes = self._chain(request_id, tokens, limit)
        hits = []
        for h in hashes[start_block:limit]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        found = []  # the chain goes on in the host tier
        if self.host is not None:
            first = start_block + len(hits)
            for h in hashes[first:limit]:
                if self.host.lookup(h) is None:
                    break
                found.append(h)
        if device_only:
            found = []
            self.host_blocks_past_limit = True  # the chain stops here: no store lookup either
        elif host_limit is not None and len(found) > host_limit:
            found = found[:max(host_limit, 0)]
            self.host_blocks_past_limit = True
        if found:
            self._host_hits[request_id] = (start_block + len(hits), found, tokens)
        else:
            self._host_hits.pop(request_id, None)
        # a chain cut short in the host tier does not go on in the store
        fetched = self._match_store(request_id, hashes, start_block + len(hits) + len(found),
                                    start_block + len(hits) + len(found) if self.host_blocks_past_limit else limit,
                                    tokens)
        total = (len(hits) + len(found) + fetched) * self.block_size
        if start_block == 0:
            self._lookups[request_id] = (len(tokens), total, len(found) * self.block_size, fetched * self.block_size)
        if hits:
            self._hits[request_id] = hits
        else:  # a match from an earlier, unadmitted attempt may point at blocks evicted since
            self._hits.pop(request_id, None)
        return total

    def _match_store(self, request_id: str, hashes: list[int], first: int, limit: int, tokens: Sequence[int]) -> int:
        """Fetch the blocks the store holds from block `first` on (once per request and position: a
        request that waits is not fetched for again); returns how many."""
        if self.store is None or first >= limit:
            self._store_hits.pop(request_id, None)
            return 0
        held = self._store_hits.get(request_id)
        if held is None or held[0] != first:
            found, data = self.store.fetch(hashes[first:limit])
            if not found:
                self._store_hits.pop(request_id, None)
                return 0
            held = self._store_hits[request_id] = (first, found, data, tokens)
        return len(held[1])

    def commit_due(self, request_id: str, num_computed: int) -> bool:
        """Whether `commit` would register anything (cheap: lets callers skip building the token list)."""
        return self.enable_prefix_cache and num_computed // self.block_size > self._committed.get(request_id, 0)

    def commit(self, request_id: str, tokens: Sequence[int], num_computed: int) -> None:
        """Register the request's full blocks among its first `num_computed` tokens (their K/V is
        written, or is being written this step) in the prefix cache."""
        if not self.enable_prefix_cache:
            return
        table = self.tables.get(request_id)
        done = self._committed.get(request_id, 0)
        full = min(num_computed // self.block_size, len(table) if table else 0)
        if full <= done:
            return
        hashes = self._chain(request_id, tokens, full)
        group: list[int] = []
        for i in range(done, full):
            if self.pool.cache(table[i], hashes[i]):
                group.append(i)
                if self.store is not None:
                    self.store.committed(table[i], hashes[i], self.pool.generation[table[i]])
            elif group:
                self._stored(hashes, tokens, group)
                group = []
        if group:
            self._stored(hashes, tokens, group)
        self._committed[request_id] = full

    def _stored(self, hashes: list[int], tokens: Sequence[int], idx: list[int]) -> None:
        if self.pool.events is None:
            return
        bs = self.block_size
        self.pool.events.append(("stored", [hashes[i] for i in idx], hashes[idx[0] - 1] if idx[0] else None,
                                 list(tokens[idx[0] * bs:(idx[-1] + 1) * bs]), bs))

    def take_events(self) -> list[tuple]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (and the matches not yet taken, which point at them)."""
        self.pool.clear_cache()
        self._hits.clear()
        for request_id in self._committed:
            self._committed[request_id] = len(self.tables.get(request_id, ()))
        self._host_hits.clear()
        self._store_hits.clear()
        if self.host is not None:
            self.host.clear()

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self._shortfall(request_id, num_tokens) <= 0

    def _shortfall(self, request_id: str, num_tokens: int) -> int:
        have = len(self.tables.get(request_id, ()))
        hits = self._hits.get(request_id, ())
        unheld = sum(1 for b in hits if self.pool.ref[b] == 0)  # sharing these takes them off the free list
        return max(self.blocks_for(num_tokens) - have - len(hits), 0) + unheld - self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens, first sharing the blocks its last
        `match_prefix` found; None (nothing changed, matched blocks dropped) if short."""
        if self._shortfall(request_id, num_tokens) > 0:
            self._hits.pop(request_id, None)
            self._host_hits.pop(request_id, None)
            self._lookups.pop(request_id, None)  # its store fetch stays: the request retries
            if not self.tables.get(request_id):
                self.tables.pop(request_id, None)
            return None
        table = self.tables.setdefault(request_id, [])
        lookup = self._lookups.pop(request_id, None)
        if lookup:
            self.queries += lookup[0]
            self.hits += lookup[1]
            self.host_hits += lookup[2]
            self.store_hits += lookup[3]
        hits = self._hits.pop(request_id, None)
        if hits:
            if len(table) != self._committed.get(request_id, 0):
                raise RuntimeError(f"{request_id}: matched blocks must continue a fully committed table")
            self.pool.touch(hits)
            table.extend(hits)
            self._committed[request_id] = len(table)
        host_hits = self._host_hits.pop(request_id, None)
        if host_hits:
            self._load_from_host(request_id, table, *host_hits)
        store_hits = self._store_hits.pop(request_id, None)
        if store_hits:
            self._load_from_store(request_id, table, *store_hits)
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.take(need))
        return table

    def _load_from_host(self, request_id: str, table: list[int], first: int, found: list[int],
                        tokens: Sequence[int]) -> None:
        """Give the request fresh blocks for the prefix blocks its match found in the host tier, have
        the next step copy them in, and cache them on the device again."""
        if len(table) != first or self._committed.get(request_id, 0) != first:
            raise RuntimeError(f"{request_id}: host-tier blocks must continue a fully committed table")
        self.host.pin(found)  # taking blocks may spill others to the host: not into these slots
        blocks = self.pool.take(len(found))  # a spilled block's save runs before these loads
        for h, block in zip(found, blocks):
            self.host.load(h, block)
            self.pool.cache(block, h)  # False when another block holds it already: this one is a copy
        table.extend(blocks)
        self._committed[request_id] = len(table)
        self._stored(self._hashes[request_id], tokens, list(range(first, len(table))))

    def _load_from_store(self, request_id: str, table: list[int], first: int, found: list[int],
                         data: dict[int, list[bytes]], tokens: Sequence[int]) -> None:
        """Give the request fresh blocks for the prefix blocks fetched from the store; the next step
        copies the bytes in. They are cached on the device from now on."""
        if len(table) != first or self._committed.get(request_id, 0) != first:
            raise RuntimeError(f"{request_id}: store blocks must continue a fully committed table")
        blocks = self.pool.take(len(found))
        for h, block in zip(found, blocks):
            self._store_loads.load.append((h, block))
            self._store_loads.data[h] = data[h]
            self.pool.cache(block, h)
        table.extend(blocks)
        self._committed[request_id] = len(table)
        self._stored(self._hashes[request_id], tokens, list(range(first, len(table))))

    def _still_named(self, block: int, block_hash: int, generation: int) -> bool:
        return self.pool.block_hash[block] == block_hash and self.pool.generation[block] == generation

    def take_transfers(self) -> dict[str, KVTransfers] | None:
        """The block moves the next step must make before its forward, by KV connector (None: none)."""
        out = {}
        if self.host is not None and (moves := self.host.take_transfers()) is not None:
            out["host"] = moves
        if self.store is not None:
            moves, self._store_loads = self._store_loads, KVTransfers()
            moves.save = self.store.take_puts(self._still_named)
            if moves:
                out["mooncake_store"] = moves
        return out or None

    def trim(self, request_id: str, num_tokens: int) -> None:
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.pool.release(table[keep:])
            del table[keep:]
        full = num_tokens // self.block_size
        if self._committed.get(request_id, 0) > full:
            # the kept block that is no longer full will be written again: it must stop naming its old contents
            if full < len(table):
                block = table[full]
                if self.pool.ref[block] > 1:
                    raise RuntimeError(f"{request_id}: cannot rewrite block {block}, another request shares it")
                self.pool.uncache(block)
            self._committed[request_id] = full
            del self._hashes.get(request_id, [])[full:]

    def pending_host_blocks(self, request_id: str) -> int:
        """Host-tier blocks the request's last `match_prefix` found (copied back at its `allocate`)."""
        held = self._host_hits.get(request_id)
        return len(held[1]) if held else 0

    def rename(self, old: str, new: str) -> None:
        """Give request `old`'s blocks and their bookkeeping to `new` (which has none)."""
        if new in self.tables:
            raise RuntimeError(f"{new} already has blocks")
        for books in (self.tables, self._hashes, self._committed):
            if old in books:
                books[new] = books.pop(old)
        self._hits.pop(old, None)
        self._lookups.pop(old, None)

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table:
            self.pool.release(table)
        self.drop(request_id)

    def drop(self, request_id: str) -> None:
        """Forget the request's bookkeeping (its blocks, if any, must already be released)."""
        self.tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._committed.pop(request_id, None)
        self._hits.pop(request_id, None)
        self._host_hits.pop(request_id, None)
        self._store_hits.pop(request_id, None)
        self._lookups.pop(request_id, None)
