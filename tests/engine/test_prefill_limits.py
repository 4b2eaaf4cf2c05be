"""When new prefills may start (scheduler/prefill_limits.py): xLLM's
--prefill_scheduling_memory_usage_threshold, FastDeploy's --kv_cache_ratio with
--static_decode_blocks, and --max_num_partial_prefills / --max_long_partial_prefills with
--long_prefill_token_threshold. Expected batches are worked out by hand (block size 4; a fresh pool
hands out blocks 0, 1, 2, ... in order)."""
from __future__ import annotations

import pytest

from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm.kv_cache import KVCacheManager
from heterollm.scheduler import Scheduler
from heterollm.scheduler.prefill_limits import PrefillLimits, prefill_limits
from heterollm.scheduler.request import Request, RequestStatus

from helpers import ADMIT_ALL


def make(num_blocks: int, limits: PrefillLimits, **flags) -> Scheduler:
    cfg = load_config([], overrides=flags).config
    return Scheduler(cfg.scheduler, KVCacheManager(num_blocks, 4), 256, limits=limits)


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50))


def running(s: Scheduler, rid: str, n: int) -> Request:
    """A request whose n-token prompt is computed and whose first token is out (decoding)."""
    r = req(rid, n)
    r.output_token_ids, r.num_computed_tokens, r.status = [7], n, RequestStatus.RUNNING
    assert s.kv.allocate(rid, n) is not None
    s.requests[rid] = r
    s.running.append(r)
    return r


def scheduled(s: Scheduler) -> dict[str, tuple[int, int]]:
    return {it.request_id: (it.num_computed_tokens, len(it.new_token_ids)) for it in s.schedule().requests}


def test_memory_usage_threshold_holds_new_prefills():
    # 10 blocks, threshold 0.5. d holds 5 blocks (20 tokens; its decode fits the 5th): usage 0.5 -> w waits
    s = make(10, PrefillLimits(memory_usage_threshold=0.5))
    running(s, "d", 19)
    s.add(req("w", 4))
    assert scheduled(s) == {"d": (19, 1)}
    # with d holding 4 blocks (usage 0.4) w starts
    s = make(10, PrefillLimits(memory_usage_threshold=0.5))
    running(s, "d", 15)
    s.add(req("w", 4))
    assert scheduled(s) == {"d": (15, 1), "w": (0, 4)}


def test_a_lone_request_is_never_held():
    s = make(2, PrefillLimits(memory_usage_threshold=0.1, prefill_block_ratio=0.1, static_decode_blocks=5))
    s.add(req("w", 8))
    assert scheduled(s) == {"w": (0, 8)}


def test_prefill_share_and_static_decode_blocks():
    # 20 blocks, share 0.5 (10 blocks), 2 blocks set aside per request. a runs with 2 blocks (8 tokens;
    # held 2 <= its footprint 2 + 2): counts 2. b (20 tokens: 5 + 2 = 7): 2 + 7 = 9 <= 10, starts;
    # c (8 tokens: 2 + 2 = 4): 9 + 4 = 13 > 10, waits
    s = make(20, PrefillLimits(prefill_block_ratio=0.5, static_decode_blocks=2))
    running(s, "a", 7)
    s.add(req("b", 20)), s.add(req("c", 8))
    assert scheduled(s) == {"a": (7, 1), "b": (0, 20)}
    assert [r.request_id for r in s.waiting] == ["c"]
    # without the set-aside, c's 2 blocks fit: 2 + 5 + 2 = 9
    s = make(20, PrefillLimits(prefill_block_ratio=0.5))
    running(s, "a", 7)
    s.add(req("b", 20)), s.add(req("c", 8))
    assert scheduled(s) == {"a": (7, 1), "b": (0, 20), "c": (0, 8)}


def test_a_long_request_exceeds_the_threshold():
    """FastDeploy: a request whose token count exceeds long_prefill_token_threshold is long; one of
    exactly the threshold is not."""
    lim = PrefillLimits(max_partial=1, max_long_partial=1, long_threshold=8)
    assert [lim.is_long(n) for n in (7, 8, 9)] == [False, False, True]


def test_partial_prefills_pass_over_to_shorter_requests():
    # chunks of 4: a (10 tokens, long over 8) starts part way (4 of 10); b (3) completes in its step;
    # c (12, long) would be a second partial prefill: passed over; d (6, short) too (limit 1)
    lim = PrefillLimits(max_partial=1, max_long_partial=1, long_threshold=8)
    s = make(64, lim, max_tokens_per_chunk_for_prefill=4)
    for rid, n in (("a", 10), ("b", 3), ("c", 12), ("d", 6)):
        s.add(req(rid, n))
    assert scheduled(s) == {"a": (0, 4), "b": (0, 3)}
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    # two partial prefills, one of them long: c (long) is passed over, d (short) starts
    lim = PrefillLimits(max_partial=2, max_long_partial=1, long_threshold=8)
    s = make(64, lim, max_tokens_per_chunk_for_prefill=4)
    for rid, n in (("a", 10), ("b", 3), ("c", 12), ("d", 6)):
        s.add(req(rid, n))
    assert scheduled(s) == {"a": (0, 4), "b": (0, 3), "d": (0, 4)}
    assert [r.request_id for r in s.waiting] == ["c"]


def test_a_running_partial_prefill_counts_until_its_prompt_is_in():
    lim = PrefillLimits(max_partial=1, max_long_partial=1, long_threshold=100)
    s = make(64, lim, max_tokens_per_chunk_for_prefill=4)
    s.add(req("a", 10)), s.add(req("c", 9))
    so = s.schedule()  # a: 0-4 (partial); c would be a second one
    assert {it.request_id for it in so.requests} == {"a"}
    s.update(so, _none(so))
    so = s.schedule()  # a: 4-8, still partial; c still waits
    assert {it.request_id: it.num_computed_tokens for it in so.requests} == {"a": 4}
    s.update(so, _none(so))
    so = s.schedule()  # a: 8-10 completes its prompt in this step: c may start part way
    assert {it.request_id: (it.num_computed_tokens, len(it.new_token_ids)) for it in so.requests} == {
        "a": (8, 2), "c": (0, 4)}


def test_a_decoding_request_ahead_does_not_end_the_partial_count():
    """The count of partial prefills passes over decoding requests wherever they stand in the
    running list: here d decodes ahead of a, which is part way through its prompt, so c (a second
    partial prefill) still waits."""
    lim = PrefillLimits(max_partial=1, max_long_partial=1, long_threshold=100)
    s = make(64, lim, max_tokens_per_chunk_for_prefill=4)
    running(s, "d", 5)
    s.add(req("a", 10)), s.add(req("c", 9))
    so = s.schedule()  # d decodes; a: 0-4 (partial); c would be a second one
    assert {it.request_id: it.num_computed_tokens for it in so.requests} == {"d": 5, "a": 0}
    s.update(so, _none(so))
    assert [r.request_id for r in s.running] == ["d", "a"]
    so = s.schedule()  # d decodes; a: 4-8, still partial; c still waits
    assert {it.request_id: it.num_computed_tokens for it in so.requests} == {"d": 6, "a": 4}
    assert [r.request_id for r in s.waiting] == ["c"]


def _none(so):
    from heterollm.interfaces import RunnerOutput
    return RunnerOutput([it.request_id for it in so.requests], [[7] if it.sample else [] for it in so.requests],
                        [None] * len(so.requests), [None] * len(so.requests))


def test_flags_reach_the_scheduler():
    cfg = load_config([], overrides={"model": "m"}).config
    lim = prefill_limits(cfg, 1000)
    assert lim == PrefillLimits(0.95, 0.75, 2, 1, 1, 40)  # the tables' defaults; 4% of max_model_len
    cfg = load_config([], overrides={"model": "m", "kv_cache_ratio": 0.5, "static_decode_blocks": 0,
                                     "max_num_partial_prefills": 3, "max_long_partial_prefills": 2,
                                     "long_prefill_token_threshold": 64,
                                     "prefill_scheduling_memory_usage_threshold": 0.8}).config
    assert prefill_limits(cfg, 1000) == PrefillLimits(0.8, 0.5, 0, 3, 2, 64)
    cfg = load_config([], overrides={"model": "m", "enable_chunked_prefill": False}).config
    assert prefill_limits(cfg, 1000).max_partial is None  # no chunks, no partial prefills


def test_the_limits_spare_a_tight_cache_its_preemptions(tiny_llama):
    """The point of the limits: on a cache too small for the load, the defaults keep room for the
    running decodes, so far fewer requests are preempted and recomputed; the tokens are the same."""
    prompts = [list(range(5 + i, 45 + i)) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = {}
    for name, flags in (("limits", {}), ("none", ADMIT_ALL)):
        llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=24, max_model_len=128,
                  **flags)
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.shutdown()
        results[name] = ([o.outputs[0].token_ids for o in outs], sum(o.metrics.num_preemptions for o in outs))
    assert results["limits"][0] == results["none"][0]
    assert results["none"][1] > 0
    assert results["limits"][1] < results["none"][1]


def test_the_prefill_share_adds_up_the_running_and_the_admitted_footprints():
    # 20 blocks, share 0.5 (10 blocks), 2 set aside per request. a runs with 3 blocks (11 tokens;
    # 3 <= its footprint 3 + 2): counts 3. b (8 tokens: 2 + 2): 3 + 4 = 7, starts; c (4 tokens:
    # 1 + 2): 7 + 3 = 10, exactly the share: starts; d (1 token: 1 + 2): 10 + 3 = 13 > 10, waits
    s = make(20, PrefillLimits(prefill_block_ratio=0.5, static_decode_blocks=2))
    running(s, "a", 11)
    for rid, n in (("b", 8), ("c", 4), ("d", 1)):
        s.add(req(rid, n))
    assert scheduled(s) == {"a": (11, 1), "b": (0, 8), "c": (0, 4)}
    assert [r.request_id for r in s.waiting] == ["d"]


def test_partial_prefills_admitted_in_one_step_add_up():
    # chunks of 4, four 10-token prompts, each left part way (4 of 10). At most 3 partial prefills:
    # the 4th waits; at most 2 long ones (over 8 tokens), with no limit on all: the 3rd waits
    for lim, admitted in ((PrefillLimits(max_partial=3), 3),
                          (PrefillLimits(max_long_partial=2, long_threshold=8), 2)):
        s = make(64, lim, max_tokens_per_chunk_for_prefill=4)
        for i in range(4):
            s.add(req(f"w{i}", 10))
        assert scheduled(s) == {f"w{i}": (0, 4) for i in range(admitted)}
        assert [r.request_id for r in s.waiting] == [f"w{i}" for i in range(admitted, 4)]
