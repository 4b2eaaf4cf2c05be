"""Tensor parallelism on CPU (gloo): one spawned worker process per rank. Greedy tokens with
tp_size=2 equal tp_size=1 for every model family (a mixture-of-experts one and DeepSeek's MLA included), with K/V heads split or replicated; shapes that
cannot split fail with a message naming the shape; --random_seed makes sampled text repeatable; a
worker that dies fails the step, never hangs."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from helpers import PARALLEL_FLAGS, PARALLEL_PROMPTS, build_tiny_model, greedy_run, smollm2_gguf
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.interfaces import ExecutorDead

FLAGS, PROMPTS = PARALLEL_FLAGS, PARALLEL_PROMPTS
run = greedy_run


SLOW = pytest.mark.slow  # ~6 s each (two ranks spawned): the default run keeps one per kind of split


@pytest.mark.parametrize("family,shape", [
    ("llama", {}), pytest.param("qwen2", {}, marks=SLOW), pytest.param("qwen3", {}, marks=SLOW),
    ("llama", {"num_key_value_heads": 1}),  # fewer KV heads than ranks: each rank holds a replica
    # fused checkpoint projections split before sharding; GLM's per-head q/k reorder
    ("phi3", {}), pytest.param("glm4", {}, marks=SLOW),
    pytest.param("gemma2", {"sliding_window": 8, "head_dim": 16, "attn_logit_softcapping": 2.0}, marks=SLOW),
    pytest.param("gemma3", {"sliding_window": 8, "sliding_window_pattern": 2, "head_dim": 16}, marks=SLOW),
    # each expert's and the shared expert's intermediate dimension split, one all-reduce per block; a
    # dense layer too. One MoE family: the three share the sharded experts (test_moe.py loads each's shards)
    pytest.param("qwen2_moe", {"mlp_only_layers": [1]}, marks=SLOW),
    # MLA: heads split (q_b_proj, kv_b_proj rows, o_proj columns), the latent and its cache replicated;
    # a dense first layer, then grouped sigmoid routing over the split experts and the shared expert
    ("deepseek_v3", {}),
], ids=["llama", "qwen2", "qwen3", "llama-kv-replicated", "phi3", "glm4", "gemma2", "gemma3", "qwen2-moe",
        "deepseek-v3"])
def test_tp2_equals_tp1(tmp_path, family, shape):
    folder = build_tiny_model(tmp_path / family, family, **shape)
    tokens1, lps1 = run(folder)
    tokens2, lps2 = run(folder, tp_size=2)
    assert tokens2 == tokens1
    assert lps2 == pytest.approx(lps1, abs=1e-4)


@pytest.mark.slow  # 10 s; the greedy parity above stays in the default run
def test_random_seed_makes_sampled_text_repeatable_across_ranks(tmp_path):
    """--random_seed seeds every rank's process, not only the engine's: sampling with tp_size=2
    gives the same text on every run (issue 18, defect 6)."""
    folder = build_tiny_model(tmp_path / "llama", "llama")
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), **FLAGS, tp_size=2, random_seed=1)
        try:
            runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], sampled)])
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]


@SLOW  # 7 s: the flag checks' own refusals of TP sizes stay in the default run
def test_a_shape_that_cannot_split_names_itself(tmp_path):
    folder = build_tiny_model(tmp_path / "llama", "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        LLM(str(folder), **FLAGS, tp_size=3)


@pytest.mark.slow  # 33 s: the real model over three ranks (test_tp2_equals_tp1 covers TP in the default run)
def test_smollm2_splits_its_9_heads_over_3_ranks():
    """SmolLM2-135M has 9 query heads and 3 KV heads: tp_size=3 splits both (one KV head per rank);
    tp_size=2 divides neither and is refused."""
    gguf = smollm2_gguf()
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    flags = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=16)
    prompt = "The capital of France is"
    one = LLM(str(gguf), **flags)
    want = one.generate(prompt, p)[0].outputs[0].token_ids
    one.shutdown()
    three = LLM(str(gguf), **flags, tp_size=3)
    assert three.generate(prompt, p)[0].outputs[0].token_ids == want
    three.shutdown()
    with pytest.raises(ConfigError, match="num_attention_heads=9 is not divisible by tp_size=2"):
        LLM(str(gguf), **flags, tp_size=2)


def test_a_killed_worker_fails_the_step_and_stops_the_rest(tmp_path):
    folder = build_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(folder), **FLAGS, tp_size=2, health_check_interval_ms=200)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    procs = engine.executor.procs
    os.kill(procs[1].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ExecutorDead, match="rank 1 died"):
        for _ in range(1000):
            engine.step()
    assert time.monotonic() - t0 < 30
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(ExecutorDead):
        engine.step()
    llm.shutdown()


@pytest.mark.slow  # 9 s; structured output itself is tested on one rank in the default run
def test_structured_output_across_ranks(tmp_path):
    """The grammar bitmask travels to the worker processes with the step: tp_size=2 gives the
    constrained tokens tp_size=1 gives, and they match the regex."""
    folder = build_tiny_model(tmp_path / "m", "llama")
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=3, n=2,
                            structured_outputs={"regex": "[a-d]{3}-[0-9]{2}"})
    texts = []
    for tp in (1, 2):
        llm = LLM(str(folder), **FLAGS, tp_size=tp, guided_decoding_backend="auto")
        try:
            texts.append([c.text for c in llm.generate([PROMPTS[1]], params)[0].outputs])
        finally:
            llm.shutdown()
    assert texts[0] == texts[1]
    assert all(re.fullmatch("[a-d]{3}-[0-9]{2}", t) for t in texts[0])


@pytest.mark.slow  # 7 s; the reload itself is tested on one rank in the default run
def test_weights_reload_on_every_rank(tmp_path):
    """--dynamic_load_weight with tp_size=2: each rank loads its shard of the new weights, and the
    greedy tokens become transformers' on them."""
    from helpers import hf_greedy
    a, b = build_tiny_model(tmp_path / "a", "llama", seed=0), build_tiny_model(tmp_path / "b", "llama", seed=1)
    llm = LLM(str(a), **FLAGS, tp_size=2, dynamic_load_weight=1)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids == hf_greedy(a, [PROMPTS[1]], 8)[0]
        llm.update_weights(path=str(b))
        assert llm.generate([PROMPTS[1]], greedy)[0].outputs[0].token_ids == hf_greedy(b, [PROMPTS[1]], 8)[0]
    finally:
        llm.shutdown()
