"""The prefix cache's bookkeeping: hash chain, sharing, reference counts, eviction order, events."""
from __future__ import annotations

import pytest

from heterollm.kv_cache import KVCacheManager
from heterollm.kv_cache.manager import hash_block

BS = 4


def kv(num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_prefix_cache=True, record_events=True, **kw)


def run(m: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit `rid` as the scheduler does (match, allocate the rest) and mark all of it computed."""
    cached = m.match_prefix(rid, tokens)
    table = m.allocate(rid, len(tokens))
    assert table is not None
    m.commit(rid, tokens, len(tokens))
    return cached


def test_hash_chain_names_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4], seed=1024)
    assert a == hash_block(None, [1, 2, 3, 4], seed=1024)
    assert a != hash_block(None, [1, 2, 3, 5], seed=1024)
    assert a != hash_block(None, [1, 2, 3, 4], seed=7)
    assert a.bit_length() > 64  # 128-bit digests
    b = hash_block(a, [5, 6, 7, 8], seed=1024)
    assert b != hash_block(None, [5, 6, 7, 8], seed=1024), "a block's name depends on what precedes it"
    assert b != hash_block(hash_block(None, [0, 2, 3, 4], seed=1024), [5, 6, 7, 8], seed=1024)


def test_leading_full_blocks_are_shared_never_the_partial_one():
    m = kv()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    assert run(m, "a", prompt) == 0
    a = list(m.tables["a"])
    assert len(a) == 3 and m.pool.num_cached == 2
    assert run(m, "b", prompt[:8] + [99, 98, 97]) == 8
    b = m.tables["b"]
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [m.pool.ref[x] for x in a] == [2, 2, 1]
    assert (m.queries, m.hits) == (21, 8)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    m = kv()
    prompt = list(range(8))  # exactly 2 blocks
    run(m, "a", prompt)
    assert m.match_prefix("b", prompt) == 4, "block 2 holds the last token, which must be computed for logits"
    assert m.match_prefix("c", prompt + [8]) == 8


def test_different_prefix_different_blocks():
    m = kv()
    run(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert run(m, "b", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert not set(m.tables["a"]) & set(m.tables["b"])


def test_freed_blocks_stay_findable_until_the_pool_needs_them_then_lru():
    m = kv(num_blocks=6)
    run(m, "a", list(range(9)))          # blocks: 2 cached + 1 partial
    m.free("a")
    assert m.num_free_blocks == 6 and m.pool.num_cached == 2
    # plain blocks are handed out before cached ones
    m.allocate("x", 12)
    assert m.pool.num_cached == 2
    m.free("x")
    assert run(m, "b", list(range(9))) == 8, "still cached after x came and went"
    m.free("b")
    m.take_events()
    # big needs every block: the cached ones go, the tail block (later in the chain) first
    m.allocate("big", 6 * BS)
    removed = [e[1][0] for e in m.take_events() if e[0] == "removed"]
    chain = [hash_block(None, [0, 1, 2, 3], 1024)]
    chain.append(hash_block(chain[0], [4, 5, 6, 7], 1024))
    assert removed == [chain[1], chain[0]]
    assert m.pool.num_cached == 0


def test_reuse_refreshes_lru_position():
    m = kv(num_blocks=4)
    run(m, "a", [1, 2, 3, 4, 0])   # caches A=[1..4]
    run(m, "b", [5, 6, 7, 8, 0])   # caches B=[5..8]
    m.free("a")
    m.free("b")                      # LRU: A then B
    assert run(m, "a2", [1, 2, 3, 4, 9]) == 4
    m.free("a2")                     # A used again: LRU now B then A
    m.take_events()
    m.allocate("fill", 3 * BS)       # 2 plain + 1 eviction: B goes
    [(kind, [h])] = [e for e in m.take_events()]
    assert kind == "removed" and h == hash_block(None, [5, 6, 7, 8], 1024)
    assert m.match_prefix("q", [1, 2, 3, 4, 9]) == 4


def test_sharing_an_evictable_block_counts_against_the_free_list():
    m = kv(num_blocks=3)
    run(m, "a", [1, 2, 3, 4, 5])
    m.free("a")                      # 1 evictable (cached) + 2 plain free
    assert m.match_prefix("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == 4
    assert not m.can_allocate("b", 13), "4 blocks needed: 1 shared (taken off the free list) + 3 new > 3"
    assert m.allocate("b", 13) is None and "b" not in m.tables
    assert m.pool.num_cached == 1 and m.num_free_blocks == 3, "a refused allocation changes nothing"
    assert m.match_prefix("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    assert m.allocate("b", 9) is not None and m.num_free_blocks == 0


def test_shared_blocks_survive_one_owner_leaving():
    m = kv()
    run(m, "a", list(range(9)))
    run(m, "b", list(range(9)))
    shared = m.tables["a"][:2]
    m.free("a")
    assert all(m.pool.ref[x] == 1 for x in shared)
    run(m, "d", list(range(100, 109)))
    m.free("d")  # 2 cached blocks nobody holds: the only ones the pool may evict
    free = m.num_free_blocks
    assert free == 16 - 3, "a's shared blocks are still held by b, with b's own third block"
    assert m.allocate("big", (free + 1) * BS) is None, "one block more than the free ones"
    assert m.allocate("c", free * BS) is not None  # takes every free block: d's cached ones are evicted
    assert not set(m.tables["c"]) & set(m.tables["b"]), "in-use blocks are never handed out"
    assert m.tables["b"][:2] == shared and all(m.pool.ref[x] == 1 for x in shared)
    assert sorted(m.pool.cached.values()) == sorted(shared), "b's shared blocks stay cached, d's are evicted"
    m.free("b")
    m.free("c")
    assert m.num_free_blocks == 16


def test_generated_tokens_are_cached_too_and_trim_uncommits():
    m = kv()
    tokens = list(range(6))
    m.match_prefix("a", tokens)
    m.allocate("a", 6)
    m.commit("a", tokens, 6)
    assert m.pool.num_cached == 1
    tokens += [50, 51, 52]            # decode steps
    m.allocate("a", 9)
    m.commit("a", tokens, 9)
    assert m.pool.num_cached == 2
    m.take_events()
    m.trim("a", 5)
    assert len(m.tables["a"]) == 2 and m._committed["a"] == 1
    second = hash_block(hash_block(None, [0, 1, 2, 3], 1024), [4, 5, 50, 51], 1024)
    assert m.pool.num_cached == 1 and m.take_events() == [("removed", [second])]
    m.allocate("a", 7)
    m.commit("a", tokens[:5] + [60, 61, 62], 8)
    assert m.pool.num_cached == 2, "the rewritten block is named by its new contents"


def test_events_describe_residency():
    m = kv(num_blocks=4)
    run(m, "a", list(range(9)))
    [stored] = m.take_events()
    h0 = hash_block(None, [0, 1, 2, 3], 1024)
    h1 = hash_block(h0, [4, 5, 6, 7], 1024)
    assert stored == ("stored", [h0, h1], None, list(range(8)), BS)
    m.allocate("b", 4)
    m.commit("b", [0, 1, 2, 3], 4)   # same block computed twice: the first copy keeps the name, no event
    assert m.take_events() == []
    m.free("a")
    m.free("b")
    m.allocate("x", 4 * BS)
    assert sorted(e[1][0] for e in m.take_events()) == sorted([h0, h1])
    m.free("x")
    run(m, "c", list(range(5)))
    m.reset_prefix_cache()
    assert m.take_events()[-1] == ("cleared",) and m.pool.num_cached == 0


def test_off_means_no_matching_no_events():
    m = KVCacheManager(8, BS)
    assert m.match_prefix("a", list(range(20))) == 0
    m.allocate("a", 20)
    m.commit("a", list(range(20)), 20)
    assert m.pool.num_cached == 0 and m.take_events() == []


def test_matched_blocks_must_continue_a_committed_table():
    m = kv()
    run(m, "a", list(range(9)))
    m.allocate("b", 2)
    m.match_prefix("b", list(range(9)), start_block=1)
    with pytest.raises(RuntimeError, match="fully committed"):
        m.allocate("b", 9)


def test_idle_limit_evicts_before_touching_new_blocks():
    m = kv(num_blocks=16, idle_limit=2)
    run(m, "a", list(range(9)))       # touches blocks 0-2; 2 cached
    m.free("a")
    run(m, "b", [7] * 9)              # another 2 cached: now 4 idle-cached wanted, limit 2
    m.free("b")
    touched = {0, 1, 2}
    assert set(m.pool._fresh).isdisjoint(touched)
    assert m.pool.num_cached <= 4
    for i in range(20):              # a stream of unrelated prompts never walks the whole pool
        run(m, f"r{i}", [100 + i] * 9)
        m.free(f"r{i}")
    assert len(m.pool._evictable) <= 2 + 1
    assert len(m.pool._fresh) >= 16 - 6, "resident blocks stay at the working set plus the limit"
    # without a limit the cache keeps all it can
    m2 = kv(num_blocks=16)
    for i in range(6):
        run(m2, f"r{i}", [100 + i] * 9)
        m2.free(f"r{i}")
    assert m2.pool.num_cached == 12
