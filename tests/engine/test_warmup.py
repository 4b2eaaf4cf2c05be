"""--use_warmup 1 (FastDeploy): before serving, the engine runs the longest prompt its limits allow
and a full decode batch, then leaves no trace: every KV block free again, the prefix cache empty,
and the first requests' greedy tokens equal those of an engine that did not warm up."""
from __future__ import annotations

import pytest

from heterollm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140))]


def _run(folder, **flags):
    flags = {"max_seqs_per_batch": 12, **flags}
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=40, max_model_len=128, **flags)
    engine = llm.engine
    try:
        state = (list(engine.warmup_shapes), engine.kv.num_free_blocks, engine.num_blocks,
                 engine.kv.pool.num_cached, engine.scheduler.has_unfinished())
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()
    return state, tokens


def test_warm_up_runs_the_largest_steps_and_leaves_nothing_behind(tiny_llama):
    (shapes, free, total, cached, busy), tokens = _run(tiny_llama, use_warmup=1)
    # max_model_len 128 and 40 blocks of 8 (320 slots): a 126-token prompt (two tokens to generate),
    # then max_seqs_per_batch=12 requests of 4 tokens decoding together
    assert shapes == [(126, 2)] + [(4, 2)] * 12
    assert free == total and cached == 0 and not busy
    (cold_shapes, *_), cold_tokens = _run(tiny_llama)
    assert cold_shapes == [] and tokens == cold_tokens


def test_without_chunked_prefill_the_prompt_fits_one_step(tiny_llama):
    (shapes, *_), _ = _run(tiny_llama, use_warmup=1, enable_chunked_prefill=False, max_tokens_per_batch=64)
    assert shapes[0] == (64, 2)


def test_a_small_cache_bounds_the_warm_up(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=8, num_gpu_blocks_override=6, max_model_len=128,
              use_warmup=1)
    try:  # 6 blocks of 8: max_model_len is capped to 48; the batch is one request per block
        assert llm.engine.warmup_shapes == [(46, 2)] + [(4, 2)] * 6
        assert llm.engine.kv.num_free_blocks == 6
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value", [2, -1])
def test_use_warmup_is_0_or_1(tiny_llama, value):
    from heterollm.config import ConfigError

    with pytest.raises(ConfigError, match="use_warmup"):
        LLM(str(tiny_llama), use_warmup=value)


def test_a_batch_of_one_warms_up_one_decoding_request_and_says_so(tiny_llama, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="heterollm"):
        (shapes, free, total, *_), _ = _run(tiny_llama, use_warmup=1, max_seqs_per_batch=1)
    # one sequence a step: the decode batch is a single 4-token request
    assert shapes == [(126, 2), (4, 2)] and free == total
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm-up")]
    assert line.startswith("warm-up (--use_warmup): a 126-token prompt, then 1 requests decoding together, in ")
