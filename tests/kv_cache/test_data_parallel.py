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
