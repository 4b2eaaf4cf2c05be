"""Attention data parallelism's KV cache (DataParallelKVCacheManager), by hand: the engine's pool split
into one range of block ids per DP rank; a request joins the rank whose prefix cache holds its prompt,
then the least loaded one, and stays in its range; gauges and counters over the ranks; preemption
picks a victim on the rank that is short (the scheduler over this manager)."""
from __future__ import annotations

import pytest

from heterollm.kv_cache import DataParallelKVCacheManager
from heterollm.sampling import SamplingParams

def test_requests_spread_over_the_ranks_and_keep_to_their_range():
    kv = DataParallelKVCacheManager(2, 9, 4)  # 4 blocks per rank; the ninth is not used
    assert (kv.per_rank, kv.pool.num_blocks, kv.num_free_blocks) == (4, 8, 8)
    a = kv.allocate("a", 8)  # 2 blocks on rank 0
    b = kv.allocate("b", 4)  # the least loaded rank: 1
    c = kv.allocate("c", 4)  # a tie on requests: the rank with more free blocks, 1
    assert a == [0, 1] and b == [4] and c == [5]
    assert kv.tables["a"] == [0, 1] and dict(kv.tables) == {"a": [0, 1], "b": [4], "c": [5]}
    assert kv.usage == pytest.approx(0.5)
    assert kv.allocate("b", 12) == [4, 6, 7]  # grows on its own rank only
    assert kv.allocate("c", 8) is None  # rank 1 is full though rank 0 has room
    assert kv.can_allocate("d", 8) and kv.allocate("d", 8) == [2, 3]  # a new request goes where it fits
    assert not kv.can_allocate("e", 1) and kv.allocate("e", 1) is None and "e" not in kv.rank_of
    # preemption frees blocks of the rank that is short
    assert kv.same_pool("c", "b") and not kv.same_pool("c", "a")
    kv.trim("b", 4)
    assert kv.tables["b"] == [4] and kv.allocate("c", 8) == [5, 6]
    for r in "abcd":
        kv.free(r)
    assert kv.num_free_blocks == 8 and not kv.rank_of and not dict(kv.tables)


def test_a_prompt_follows_its_cached_prefix():
    kv = DataParallelKVCacheManager(2, 12, 4, enable_prefix_cache=True)  # 6 blocks per rank
    prompt = list(range(13))
    kv.allocate("x", 4)  # rank 0 busy
    assert kv.match_prefix("p", prompt) == 0 and kv.rank_of["p"] == 1  # no hit anywhere: the idle rank
    assert kv.allocate("p", 13) == [6, 7, 8, 9]
    kv.commit("p", prompt, 13)
    kv.free("p")
    kv.allocate("y", 4)  # rank 1 now holds one request, rank 0 one
    kv.free("x")  # rank 0 is now the less loaded one; rank 1 caches the prompt
    assert kv.match_prefix("q", prompt) == 12 and kv.rank_of["q"] == 1
    assert kv.allocate("q", 13)[:3] == [6, 7, 8]
    assert kv.queries == 26 and kv.hits == 12
    assert kv.ranks[0].match_prefix("z", prompt) == 0  # the other rank never saw it
    events = DataParallelKVCacheManager(2, 8, 4, enable_prefix_cache=True, record_events=True)
    events.allocate("p", 13)
    events.commit("p", prompt, 13)
    assert [e[0] for e in events.take_events()] == ["stored"] and events.take_events() == []


def test_preemption_frees_blocks_of_the_rank_that_is_short():
    """y (rank 0) outgrows its rank's 4 blocks while x (rank 1) has room: y is preempted, not x, whose
    blocks would not make room for it."""
    from heterollm.config import load_config
    from heterollm.interfaces import RunnerOutput
    from heterollm.scheduler import Scheduler
    from heterollm.scheduler.request import Request

    s = Scheduler(load_config([], overrides={}).config.scheduler, DataParallelKVCacheManager(2, 8, 4), 256)
    y = Request("y", list(range(1, 8)), SamplingParams(max_tokens=100))
    x = Request("x", list(range(1, 4)), SamplingParams(max_tokens=100))
    s.add(y)
    s.add(x)
    for _ in range(20):
        so = s.schedule()
        ids = [r.request_id for r in so.requests]
        s.update(so, RunnerOutput(ids, [[5] if r.sample else [] for r in so.requests], [None] * len(ids),
                                  [None] * len(ids)))
        if s.num_preemptions:
            break
    assert s.kv.rank_of.get("x") == 1 and (y.num_preemptions, x.num_preemptions) == (1, 0)


def test_construction_splits_the_pool_and_passes_the_flags_down():
    kv = DataParallelKVCacheManager(2, 10, 4, enable_prefix_cache=True, hash_seed=7, idle_limit=5)
    assert kv.enable_prefix_cache and [r.pool.num_blocks for r in kv.ranks] == [5, 5]
    assert [r.hash_seed for r in kv.ranks] == [7, 7] and [r.pool.idle_limit for r in kv.ranks] == [2, 2]
    assert all(r.enable_prefix_cache and r.pool.events is None for r in kv.ranks)
    assert [r.pool.idle_limit for r in DataParallelKVCacheManager(2, 4, 4, idle_limit=1).ranks] == [1, 1]
    assert [r.pool.idle_limit for r in DataParallelKVCacheManager(2, 4, 4).ranks] == [None, None]
    assert DataParallelKVCacheManager(2, 2, 4).per_rank == 1  # one block a rank is enough
    with pytest.raises(ValueError, match="at least one block per attention DP rank, got 1 blocks for 2 ranks"):
        DataParallelKVCacheManager(2, 1, 4)


def test_a_request_keeps_to_its_rank_once_it_holds_blocks():
    """A held request's lookups, room and commits are its own rank's, even where another rank would
    answer better; one that holds nothing yet is nobody's."""
    kv = DataParallelKVCacheManager(2, 12, 4, enable_prefix_cache=True)  # 6 blocks a rank
    prompt = list(range(21))
    kv.allocate("warm", 21)  # rank 0 caches the whole prompt (5 blocks, ids 0-4)
    kv.commit("warm", prompt, 21)
    kv.allocate("other", 4)  # rank 1's block 0 (id 6)
    kv.free("warm")
    kv.ranks[1].allocate("x", 4)  # rank 1's block 1 (id 7)
    kv.rank_of["c"] = 1  # c's first chunk on rank 1, block 2 (id 8)
    assert kv.ranks[1].allocate("c", 4) == [2] and kv.tables["c"] == [8]
    # a chunked prefill continuing on rank 1 looks up only rank 1's cache, which holds none of it
    assert kv.match_prefix("c", prompt, start_block=1) == 0 and kv.rank_of["c"] == 1
    assert kv.tables["c"] == [8]  # its table on rank 1 is intact
    assert not kv.can_allocate("c", 4 * 5)  # rank 1 has 3 free blocks; rank 0's 6 do not count
    assert kv.can_allocate("c", 4 * 4) and kv.can_allocate("new", 4 * 6)  # a new request may go to rank 0
    assert not kv.commit_due("c", 3) and kv.commit_due("c", 4) and not kv.commit_due("nobody", 4)
    assert kv.allocate("c", 8) == [8, 9]  # rank 1's next block, 3
    kv.commit("c", prompt, 8)
    assert kv.ranks[1].pool.num_cached == 2 and len(kv.tables) == 3
    with pytest.raises(KeyError, match="nobody"):
        kv.tables["nobody"]
    assert kv.match_prefix("d", prompt) == 20 and kv.rank_of["d"] == 0  # found: rank 0 holds the prompt
    with pytest.raises(KeyError, match="'d'"):
        kv.tables["d"]  # matched, not yet allocated
    kv.drop("d")
    assert "d" not in kv.rank_of and not kv.ranks[0]._hits and kv.allocate("d", 4) is not None
    kv.free("never-admitted")  # an abort before admission frees nothing, and is no error
    kv.drop("never-admitted")


def test_a_new_request_skips_the_least_loaded_rank_when_it_has_no_room():
    kv = DataParallelKVCacheManager(2, 8, 4)  # 4 blocks a rank
    kv.allocate("big", 16)  # rank 0 full, one request
    kv.allocate("s1", 4)
    kv.allocate("s2", 4)  # rank 1: two requests, 2 blocks free
    assert [kv.rank_of[r] for r in ("big", "s1", "s2")] == [0, 1, 1]
    assert kv.allocate("new", 8) == [6, 7] and kv.rank_of["new"] == 1


def test_defaults_are_the_single_pool_managers():
    from heterollm.kv_cache import KVCacheManager

    one, split = KVCacheManager(4, 4), DataParallelKVCacheManager(2, 8, 4)
    assert (split.enable_prefix_cache, split.ranks[0].hash_seed) == (one.enable_prefix_cache, one.hash_seed)
    assert split.match_prefix("r", list(range(9))) == 0  # no prefix cache: nothing is looked up


def test_a_continuing_prefill_shares_its_own_ranks_cached_blocks():
    kv = DataParallelKVCacheManager(2, 12, 4, enable_prefix_cache=True)  # 6 blocks a rank
    prompt = list(range(13))
    kv.allocate("x", 4)  # rank 0 busy: the prompt goes to rank 1
    assert kv.match_prefix("p", prompt) == 0 and kv.allocate("p", 13) == [6, 7, 8, 9]
    kv.commit("p", prompt, 13)
    assert not kv.commit_due("p", 12) and kv.commit_due("p", 16)  # 3 full blocks registered already
    kv.free("p")
    kv.allocate("y", 4)  # rank 1's block 3 (the freed tail; the cached ones wait)
    # q (same prompt) matched elsewhere first, its first chunk written on rank 1 without the cache
    kv.rank_of["q"] = 1
    assert kv.ranks[1].allocate("q", 4) == [4]  # rank 1's first untouched block (id 10)
    kv.commit("q", prompt, 4)
    # its next chunk: rank 1's cached blocks 1 and 2 continue its table from block 1
    assert kv.match_prefix("q", prompt, start_block=1) == 8
    assert kv.allocate("q", 13) == [10, 7, 8, 11]
    # the other rank kept nothing of a lookup it lost
    kv.match_prefix("n", prompt)
    loser = kv.ranks[1 - kv.rank_of["n"]]
    assert "n" not in loser._hashes and "n" not in loser._lookups and "n" not in loser._hits


def test_an_unadmitted_request_is_placed_again_at_its_next_lookup():
    kv = DataParallelKVCacheManager(2, 12, 4, enable_prefix_cache=True)
    prompt = list(range(13))
    assert kv.match_prefix("late", prompt) == 0 and kv.rank_of["late"] == 0  # not admitted (yet)
    kv.allocate("busy", 4)  # rank 0
    kv.allocate("p", 13)  # rank 1, which then caches the prompt
    kv.commit("p", prompt, 13)
    assert kv.match_prefix("late", prompt) == 12 and kv.rank_of["late"] == 1
