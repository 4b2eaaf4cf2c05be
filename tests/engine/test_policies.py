"""--priority_strategy (fcfs, priority, deadline), priority preemption, starvation prevention and
TTFT deadline reporting, on the scheduler alone with a fake clock."""
from __future__ import annotations

import pytest
from helpers import build_tiny_model

from heterollm.config import load_config
from heterollm.config.checks import check_flag_combinations
from heterollm.scheduler.request import Request
from heterollm.interfaces import RunnerOutput
from heterollm.kv_cache import KVCacheManager
from heterollm.sampling import SamplingParams
from heterollm.scheduler import Scheduler
from heterollm.scheduler.policy import SchedulingPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock, num_blocks=64, max_global_ttft_ms=2**31 - 1, **flags):
    cfg = load_config([], overrides=flags).config
    policy = SchedulingPolicy(cfg.scheduler, max_global_ttft_ms)
    return Scheduler(cfg.scheduler, KVCacheManager(num_blocks, 4), 256, policy=policy, clock=clock)


def req(clock, rid, n=3, max_tokens=3, **kw):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=clock(), **kw)


def step(s):
    """One step with every sampled token 7; requests reaching max_tokens finish. Returns the ids run."""
    so = s.schedule()
    ids = [r.request_id for r in so.requests]
    s.update(so, RunnerOutput(ids, [[7] if r.sample else [] for r in so.requests], [None] * len(ids),
                              [None] * len(ids)))
    for rid in ids:
        r = s.requests[rid]
        if len(r.output_token_ids) >= r.params.max_tokens:
            s.finish(rid, "length")
    return ids


def test_priority_orders_the_waiting_queue_and_ties_go_by_arrival():
    clock = Clock()
    s = make(clock, priority_strategy="priority", max_seqs_per_batch=1)
    for rid, prio in [("low", 5), ("high-1", 0), ("mid", 2), ("high-2", 0)]:
        s.add(req(clock, rid, max_tokens=1, priority=prio))
        clock.now += 0.001
    assert [step(s)[0] for _ in range(4)] == ["high-1", "high-2", "mid", "low"]


def test_fcfs_keeps_arrival_order_whatever_the_priority_field():
    clock = Clock()
    s = make(clock, max_seqs_per_batch=1)
    for rid, prio in [("a", 5), ("b", 0)]:
        s.add(req(clock, rid, max_tokens=1, priority=prio))
    assert [step(s)[0] for _ in range(2)] == ["a", "b"]


def test_high_priority_preempts_running_low_priority_work():
    clock = Clock()
    s = make(clock, priority_strategy="priority", max_seqs_per_batch=1)
    s.add(req(clock, "low", max_tokens=10, priority=9))
    step(s), step(s)  # low prefilled and decoding
    s.add(req(clock, "high", max_tokens=2, priority=0))
    assert step(s) == ["high"]
    low = s.requests["low"]
    assert low.num_preemptions == 1 and low.num_computed_tokens == 0 and low.output_token_ids == [7, 7]
    assert step(s) == ["high"]  # high finishes, then low recomputes and carries on
    assert step(s) == ["low"] and s.requests["low"].num_computed_tokens == 5


def test_equal_priority_does_not_preempt():
    clock = Clock()
    s = make(clock, priority_strategy="priority", max_seqs_per_batch=1)
    s.add(req(clock, "first", max_tokens=4, priority=1))
    step(s)
    s.add(req(clock, "second", max_tokens=1, priority=1))
    assert step(s) == ["first"] and s.num_preemptions == 0


def test_out_of_blocks_preempts_the_worst_priority_not_the_newest():
    clock = Clock()
    s = make(clock, num_blocks=4, priority_strategy="priority", max_tokens_per_batch=64)
    s.add(req(clock, "urgent", n=7, max_tokens=10, priority=0))
    s.add(req(clock, "batch", n=7, max_tokens=10, priority=3))
    step(s), step(s)  # both hold 2 blocks; the next decode needs a third block each
    step(s)
    assert s.requests["batch"].num_preemptions == 1 and s.requests["urgent"].num_preemptions == 0


def run_high_priority_stream(starve_prevent: bool) -> tuple[int | None, int]:
    """One low-priority request against a high-priority one arriving every second (one slot, each
    high one needs 2 steps of 1 s). Returns the step at which 'low' finished (None: never) and the
    preemptions."""
    clock = Clock()
    s = make(clock, priority_strategy="priority", max_seqs_per_batch=1, enable_starve_prevent=starve_prevent,
             starve_threshold=3.0)
    s.add(req(clock, "low", max_tokens=3, priority=10))
    for i in range(60):
        s.add(req(clock, f"high-{i}", max_tokens=2, priority=0))
        step(s)
        if "low" not in s.requests:
            return i, s.num_preemptions
        clock.now += 1.0
    return None, s.num_preemptions


def test_starvation_prevention_lets_a_low_priority_request_finish():
    done_at, _ = run_high_priority_stream(starve_prevent=True)
    # starving after 3 x 10 s (the reference time without a TTFT target); then admitted and never preempted
    assert done_at is not None and 30 <= done_at <= 36
    assert run_high_priority_stream(starve_prevent=False)[0] is None


def test_aging_raises_a_waiting_requests_priority():
    clock = Clock()
    cfg = load_config([], overrides={"priority_strategy": "priority", "aggressive_coeff": 2.0}).config
    policy = SchedulingPolicy(cfg.scheduler)
    old = req(clock, "old", priority=3)
    clock.now = 10.0  # one reference time: aged by 2 levels
    new = req(clock, "new", priority=2)
    assert policy.waiting_key(old, clock.now) < policy.waiting_key(new, clock.now)
    assert policy.waiting_key(req(clock, "newer", priority=0), clock.now) < policy.waiting_key(old, clock.now)


def test_deadline_is_earliest_first_and_requests_without_one_go_last():
    clock = Clock()
    s = make(clock, priority_strategy="deadline", max_seqs_per_batch=1)
    s.add(req(clock, "none", max_tokens=1))
    s.add(req(clock, "slack", max_tokens=1, ttft_slo_ms=5000))
    s.add(req(clock, "tight", max_tokens=1, ttft_slo_ms=200))
    assert [step(s)[0] for _ in range(3)] == ["tight", "slack", "none"]


def test_global_ttft_target_gives_requests_without_one_a_deadline():
    clock = Clock()
    s = make(clock, max_global_ttft_ms=1000, priority_strategy="deadline", max_seqs_per_batch=1)
    s.add(req(clock, "global", max_tokens=1))  # due at 1.0 s
    s.add(req(clock, "own", max_tokens=1, ttft_slo_ms=3000))  # due at 3.0 s
    assert [step(s)[0] for _ in range(2)] == ["global", "own"]


def test_missed_deadlines_are_reported_once():
    clock = Clock()
    s = make(clock, max_seqs_per_batch=1)
    s.add(req(clock, "busy", max_tokens=5))
    s.add(req(clock, "hurry", max_tokens=1, ttft_slo_ms=1500))
    for _ in range(4):
        step(s)
        clock.now += 1.0
    assert s.requests["hurry"].ttft_slo_missed and s.num_deadline_missed == 1


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_fcfs_refuses_starvation_knobs_and_the_engine_refuses_priorities(tiny_llama):
    cfg = load_config([], overrides={"model": "x", "starve_threshold": 2.0}).config
    assert any("--starve_threshold=2.0" in p and "fcfs" in p for p in check_flag_combinations(cfg))
    assert check_flag_combinations(load_config([], overrides={"model": "x", "starve_threshold": 2.0,
                                                              "priority_strategy": "priority"}).config) == []
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.scheduler.request import RequestRejected

    engine = LLMEngine(load_config([], overrides={"model": str(tiny_llama), "max_cache_size": 2**22}).config)
    try:
        with pytest.raises(RequestRejected, match="--priority_strategy=priority") as info:
            engine.add_request([1, 2, 3], priority=1)
        assert info.value.field == "priority"
        with pytest.raises(RequestRejected) as info:
            engine.add_request([1, 2, 3], ttft_slo_ms=0)
        assert info.value.field == "ttft_slo_ms"
        assert not engine.has_unfinished()
    finally:
        engine.shutdown()


def test_launch_names_the_flag():
    from heterollm.plugins.launch import launch_selection
    from heterollm.plugins.resolver import LaunchError

    with pytest.raises(LaunchError, match="--aggressive_coeff=3.0"):
        launch_selection(load_config([], overrides={"model": "x", "aggressive_coeff": 3.0}).config)


def test_a_better_chunked_prefill_takes_blocks_from_a_worse_decode_not_from_itself():
    clock = Clock()
    s = make(clock, num_blocks=12, priority_strategy="priority", max_tokens_per_chunk_for_prefill=8)
    s.add(req(clock, "worse", n=18, max_tokens=30, priority=5))
    for _ in range(4):
        step(s)  # prefilled in 3 chunks (5 blocks), then decoding
    better = req(clock, "better", n=40, max_tokens=2, priority=0)  # 10 of the 12 blocks
    s.add(better)
    while "better" in s.requests:
        step(s)
    assert better.num_preemptions == 0 and len(better.output_token_ids) == 2
    assert s.requests["worse"].num_preemptions >= 1


def test_a_stale_prefix_match_is_forgotten_on_a_miss():
    kv = KVCacheManager(4, 4, enable_prefix_cache=True)
    tokens = list(range(1, 10))
    kv.allocate("a", 8)
    kv.commit("a", tokens, 8)
    kv.free("a")  # two cached blocks
    assert kv.match_prefix("w", tokens) == 8  # held for w's next allocate, which does not come yet
    kv.allocate("x", 16)  # takes every block, evicting the cached ones
    kv.free("x")
    assert kv.match_prefix("w", tokens) == 0
    table = kv.allocate("w", 9)
    assert table is not None and len(set(table)) == 3 and all(kv.pool.ref[b] == 1 for b in table)
