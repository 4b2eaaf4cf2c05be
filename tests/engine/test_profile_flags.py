"""xLLM's start-up profiling flags: --enable_profile_token_budget (the most tokens a step may carry
within --max_global_tpot_ms, found by binary search, becomes the scheduler's budget) and
--enable_profile_kv_blocks (the latency-aware profile includes prefills after cached context)."""
from __future__ import annotations

import pytest

from heterollm import LLM
from heterollm.config import ConfigError
from heterollm.config.checks import check_flag_combinations
from heterollm.config.loader import load_config
from heterollm.engine.latency_profile import profile_token_budget

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=200, max_model_len=512, max_tokens_per_batch=256)


class _Engine:
    """What profile_token_budget reads of an engine (the search itself is timed by `measure`)."""

    def __init__(self, tpot_ms: int, max_tokens: int = 4096, chunk: int = 4096, max_len: int = 8192,
                 blocks: int = 10_000) -> None:
        from types import SimpleNamespace as NS

        self.config = NS(scheduler=NS(max_tokens_per_batch=max_tokens), profile=NS(max_global_tpot_ms=tpot_ms))
        self.scheduler = NS(chunk_size=chunk)
        self.max_model_len, self.num_blocks = max_len, blocks
        self.kv = NS(block_size=16, enable_prefix_cache=False)


@pytest.mark.parametrize("tpot_ms,kwargs,want", [
    (10, {}, 800),               # 2 ms + 0.01 ms a token: 800 tokens take exactly 10 ms
    (11, {}, 900),
    (10, {"max_tokens": 512}, 512),  # every step fits: the configured budget is the ceiling
    (10, {"chunk": 300}, 300),
    (10, {"max_len": 101}, 100),     # a prompt needs a token left to generate
    (10, {"blocks": 5}, 79),         # 5 blocks of 16: 80 slots, one for the generated token
])
def test_the_budget_is_the_largest_step_within_the_target(tpot_ms, kwargs, want):
    asked = []

    def measure(n: int) -> float:
        asked.append(n)
        return (2 + 0.01 * n) / 1000

    assert profile_token_budget(_Engine(tpot_ms, **kwargs), measure) == want
    assert len(asked) <= 13  # a binary search, not a scan


def test_a_target_no_step_meets_is_a_launch_error():
    with pytest.raises(ConfigError, match="even a 1-token step takes longer than --max_global_tpot_ms=1"):
        profile_token_budget(_Engine(1), lambda n: 0.002)


def test_the_engine_schedules_within_the_profiled_budget(tiny_llama):
    llm = LLM(str(tiny_llama), **FLAGS, enable_profile_token_budget=True, max_global_tpot_ms=100_000)
    try:  # a target every step meets: the budget is the configured ceiling, and the scheduler runs on it
        assert llm.engine.token_budget == 256 == llm.engine.scheduler.config.max_tokens_per_batch
        assert llm.engine.kv.num_free_blocks == 200
    finally:
        llm.shutdown()


def _prefills_after_cached_context(llm: LLM) -> list[list[float]]:
    """Profile samples of one prefilling request whose attention pairs exceed a fresh prompt's."""
    out = []
    for (_, tokens, seqs, kpairs, prefill), _ in llm.engine.scheduler.latency.model.samples:
        if seqs == 1 and prefill == 1 and kpairs * 1000 > tokens * (tokens + 1) / 2 + 1e-6:
            out.append([tokens, kpairs])
    return out


def test_the_profile_prefills_after_cached_blocks_unless_told_not_to(tiny_llama):
    flags = dict(FLAGS, enable_latency_aware_schedule=True, max_global_tpot_ms=1000, profile_max_prompt_length=128)
    with_blocks = LLM(str(tiny_llama), **flags)
    try:
        assert _prefills_after_cached_context(with_blocks)
        assert with_blocks.engine.kv.num_free_blocks == 200 and with_blocks.engine.kv.pool.num_cached == 0
    finally:
        with_blocks.shutdown()
    without = LLM(str(tiny_llama), **flags, enable_profile_kv_blocks=False)
    try:
        assert _prefills_after_cached_context(without) == []
    finally:
        without.shutdown()


def test_flags_need_their_partners():
    def problems(**flags):
        return check_flag_combinations(load_config([], overrides={"model": "x", **flags}).config)
    assert any("--enable_profile_token_budget: needs --max_global_tpot_ms" in p
               for p in problems(enable_profile_token_budget=True))
    assert problems(enable_profile_token_budget=True, max_global_tpot_ms=50) == []
    assert any("--enable_profile_kv_blocks=False: only --enable_latency_aware_schedule" in p
               for p in problems(enable_profile_kv_blocks=False))


def test_the_profile_runs_prefills_up_to_profile_max_prompt_length_then_decode_batches(tiny_llama, monkeypatch):
    """The latency-aware profile's batches, by hand: --profile_max_prompt_length=128 is the smallest
    of the limits (max_tokens_per_batch 256, max_model_len 512 less 2), so single prefills of
    128 >> 0, 2, 4, 6, 8 tokens (at least 1) = 1, 2, 8, 32, 128 tokens with one token to generate;
    then 1, 4 and 16 requests of 32 tokens generating 4 (max_seqs_per_batch allows 16)."""
    from heterollm.engine import latency_profile

    ran = []
    real = latency_profile.run_startup_batches
    monkeypatch.setattr(latency_profile, "run_startup_batches",
                        lambda engine, batches, gen: (ran.extend(batches), real(engine, batches, gen)))
    llm = LLM(str(tiny_llama), **FLAGS, enable_latency_aware_schedule=True, max_global_tpot_ms=1000,
              profile_max_prompt_length=128, enable_profile_kv_blocks=False)
    try:
        assert ran == [[(1, 1)], [(2, 1)], [(8, 1)], [(32, 1)], [(128, 1)],
                       [(32, 4)], [(32, 4)] * 4, [(32, 4)] * 16]
        assert llm.engine.kv.num_free_blocks == 200
    finally:
        llm.shutdown()
