"""LLM.embed on tiny random Llama and Qwen3 models: the pooled, normalized final hidden states
equal transformers' (AutoModel's last_hidden_state, after the final norm) pooled the same way, one
prompt or a batch, with and without the prefix cache, in one chunk or several."""
from __future__ import annotations

import pytest
import torch

from helpers import ADMIT_ALL, build_tiny_model, hf_pooled
from heterollm import LLM
from heterollm.pooling import PoolingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [13, 14], [21, 22, 23], [5, 6, 7, 8, 9, 10, 11, 12] * 4 + [40]]
"""The first and last share 32 tokens (four blocks of 8): the last finds them in the prefix cache."""


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(f"embed-{request.param}"), request.param)


def make_llm(folder, **flags) -> LLM:
    flags = {"dtype": "float32", "task": "embed", "block_size": 8, "num_gpu_blocks_override": 64,
             "max_model_len": 128, **flags}
    return LLM(str(folder), **flags)


def assert_matches(folder, outs, prompts, pooling, **kw):
    for ids, out in zip(prompts, outs):
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.embedding), hf_pooled(folder, ids, pooling, **kw),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_pooled_vectors_equal_transformers(tiny, prefix_cache):
    llm = make_llm(tiny, enable_prefix_cache=prefix_cache)
    try:
        for pooling in ("LAST", "MEAN", "CLS"):
            params = PoolingParams(pooling_type=pooling)
            assert_matches(tiny, llm.embed(PROMPTS, params), PROMPTS, pooling)  # one batch
            assert_matches(tiny, llm.embed(PROMPTS[2], params), PROMPTS[2:], pooling)  # alone, prefix cached
        if prefix_cache:  # LAST pooling reused cached blocks; MEAN and CLS computed every position
            assert llm.engine.kv.hits > 0
    finally:
        llm.shutdown()


def test_chunked_prompts_pool_across_chunks(tiny):
    """MEAN sums over chunks of 8 tokens, CLS keeps the first chunk's first position."""
    llm = make_llm(tiny, enable_chunked_prefill=True, max_tokens_per_chunk_for_prefill=8, max_tokens_per_batch=16)
    try:
        for pooling in ("MEAN", "CLS", "LAST"):
            assert_matches(tiny, llm.embed(PROMPTS, PoolingParams(pooling_type=pooling)), PROMPTS, pooling)
    finally:
        llm.shutdown()


def test_dimensions_and_normalize(tiny):
    llm = make_llm(tiny)
    try:
        outs = llm.embed(PROMPTS[:2], PoolingParams(dimensions=16))
        assert [len(o.embedding) for o in outs] == [16, 16]
        assert_matches(tiny, outs, PROMPTS[:2], "LAST", dimensions=16)  # truncated, then normalized
        raw = llm.embed(PROMPTS[:2], PoolingParams(normalize=False, pooling_type="MEAN"))
        assert_matches(tiny, raw, PROMPTS[:2], "MEAN", normalize=False)
        with pytest.raises(ValueError, match="hidden size 64"):
            llm.embed(PROMPTS[:1], PoolingParams(dimensions=65))
    finally:
        llm.shutdown()


def test_defaults_come_from_pooler_config_then_sentence_transformers(tmp_path):
    folder = build_tiny_model(tmp_path / "st", "qwen3", sentence_transformers="MEAN")
    llm = make_llm(folder)
    try:
        assert_matches(folder, llm.embed(PROMPTS[:2]), PROMPTS[:2], "MEAN")
    finally:
        llm.shutdown()
    llm = make_llm(folder, pooler_config='{"pooling_type": "CLS", "normalize": false}')
    try:
        assert_matches(folder, llm.embed(PROMPTS[:2]), PROMPTS[:2], "CLS", normalize=False)
    finally:
        llm.shutdown()


def test_fastdeploy_runner_pooling_is_task_embed(tiny):
    llm = LLM(str(tiny), dtype="float32", runner="pooling", max_model_len=128, num_gpu_blocks_override=64)
    try:
        assert_matches(tiny, llm.embed(PROMPTS[:1]), PROMPTS[:1], "LAST")
        with pytest.raises(ValueError, match="--task embed"):
            llm.generate([1, 2, 3])
    finally:
        llm.shutdown()


def test_wrong_task_is_refused_naming_the_flag(tiny):
    llm = LLM(str(tiny), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
    try:
        with pytest.raises(ValueError, match="--task embed"):
            llm.embed(PROMPTS[:1])
    finally:
        llm.shutdown()


def test_a_prompt_may_fill_the_context(tmp_path):
    """A pooling request samples no token after its prompt: max_model_len tokens fit, one more does not."""
    from heterollm.scheduler.request import RequestRejected
    folder = build_tiny_model(tmp_path / "ctx", "llama")
    llm = make_llm(folder, max_model_len=32)
    try:
        assert len(llm.embed([list(range(3, 35))])[0].embedding) == 64
        with pytest.raises(RequestRejected, match="max_model_len"):
            llm.embed([list(range(3, 36))])
    finally:
        llm.shutdown()


def test_preemption_and_schedule_overlap_keep_the_vectors(tiny):
    """A cache of 6 blocks for four 32-token prompts in chunks of 8: requests are preempted part way
    and recomputed (the pooler starts over at position 0); with --enable_schedule_overlap the step
    after a pooled prompt is scheduled before its output is known."""
    prompts = [list(range(3 + i, 35 + i)) for i in range(4)]
    for flags in ({"num_gpu_blocks_override": 6, "max_model_len": 40, "enable_prefix_cache": False, **ADMIT_ALL},
                  {"enable_schedule_overlap": True}):
        llm = make_llm(tiny, enable_chunked_prefill=True, max_tokens_per_chunk_for_prefill=8, max_tokens_per_batch=32,
                       **flags)
        try:
            assert_matches(tiny, llm.embed(prompts, PoolingParams(pooling_type="MEAN")), prompts, "MEAN")
            if "num_gpu_blocks_override" in flags:
                assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.shutdown()


def test_an_embedding_launch_warms_up_with_pooling_requests(tiny):
    """--use_warmup on a launch that cannot generate runs its warm-up as embedding requests: the
    longest prompt (max_model_len 128 less two) and one 4-token request per KV block (64 of 8,
    fewer than max_seqs_per_batch), and the vectors afterwards are still transformers'."""
    llm = make_llm(tiny, use_warmup=1)
    try:
        assert llm.engine.warmup_shapes == [(126, 2)] + [(4, 2)] * 64
        assert llm.engine.kv.num_free_blocks == 64
        assert_matches(tiny, llm.embed(PROMPTS), PROMPTS, "LAST")
    finally:
        llm.shutdown()
