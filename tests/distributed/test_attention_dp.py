"""Attention data parallelism (xLLM's --dp_size with --ep_size = --dp_size) on CPU, two gloo ranks in
one engine: each rank holds its own requests' KV cache (half the engine's blocks) and runs attention
and the dense layers for them alone; the experts are sharded over both ranks and exchange tokens
through the Communicator's all_to_all. Greedy tokens and logprobs equal the single-rank run (MLA
included); a rank without a request in a step still joins the experts' exchange; a prompt goes to
the rank whose prefix cache holds it; EPLB's counters add up over the ranks and do not count the
idle rank's token; the refusals. The KV manager's split, by hand: tests/kv_cache/test_dp_kv_manager.py."""
from __future__ import annotations

import pytest

from helpers import PARALLEL_FLAGS, PARALLEL_PROMPTS, build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.plugins.resolver import LaunchError

FLAGS = PARALLEL_FLAGS
DP = dict(dp_size=2, ep_size=2)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)


def tokens_and_logprobs(outs):
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_attention_dp_equals_one_rank(tmp_path, family):
    folder = build_tiny_model(tmp_path / family, family)
    reference = LLM(str(folder), **FLAGS)
    try:
        tokens1, lps1 = tokens_and_logprobs(reference.generate(PARALLEL_PROMPTS, GREEDY))
        one_rank_block = reference.engine.kv_plan.bytes_per_block
    finally:
        reference.shutdown()
    llm = LLM(str(folder), **FLAGS, **DP)
    try:
        tokens2, lps2 = tokens_and_logprobs(llm.generate(PARALLEL_PROMPTS, GREEDY))
        kv = llm.engine.kv
        touched = [rank.pool.num_touched for rank in kv.ranks]
        pool = (kv.pool.num_blocks, [rank.pool.num_blocks for rank in kv.ranks], kv.num_free_blocks)
        block = llm.engine.kv_plan.bytes_per_block
    finally:
        llm.shutdown()
    assert tokens2 == tokens1
    assert lps2 == pytest.approx(lps1, abs=1e-4)
    assert all(touched), touched  # both ranks held requests
    assert pool == (128, [64, 64], 128)  # --num_gpu_blocks_override's 128 split; every block back
    # a block of the engine's pool lives on one rank: its bytes are one rank's block, not two
    assert block == one_rank_block


@pytest.mark.slow  # ~13-20 s each; test_attention_dp_equals_one_rank stays in the default run
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_sharded_attention_weights_give_the_same_tokens(tmp_path, family):
    """--enable_attn_dp_weight_sharding: each rank keeps half of every attention weight's rows and
    gathers them per layer (an idle rank too: one prompt leaves rank 1 idle while the other runs)."""
    folder = build_tiny_model(tmp_path / family, family)
    prompts = [PARALLEL_PROMPTS[1], PARALLEL_PROMPTS[0]]
    params = [GREEDY, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)]
    runs = {}
    for name, flags in (("one", {}), ("whole", DP), ("sharded", {**DP, "enable_attn_dp_weight_sharding": True})):
        llm = LLM(str(folder), **FLAGS, **flags)
        try:
            runs[name] = tokens_and_logprobs(llm.generate(prompts, params))
            weights = [m.weights for m in llm.engine.executor.memory_profile()]
        finally:
            llm.shutdown()
        runs[name + "_weights"] = weights
    assert runs["sharded"][0] == runs["one"][0] == runs["whole"][0]
    assert runs["sharded"][1] == pytest.approx(runs["one"][1], abs=1e-4)
    # float32: q/k/v and o of 2 layers (Qwen3-MoE: 64 x 64 + 2 x 32 x 64 + 64 x 64 each), half on each rank
    attention = {"qwen3_moe": 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64) * 4}.get(family)
    saved = [w - s for w, s in zip(runs["whole_weights"], runs["sharded_weights"])]
    assert all(s > 0 for s in saved), saved
    if attention is not None:
        assert saved == [attention // 2] * 2


def test_an_idle_rank_and_the_prefix_cache_route(tmp_path):
    folder = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    long_prompt, other = list(range(100, 140)), list(range(300, 330))
    reference = LLM(str(folder), **FLAGS)
    try:
        expected = tokens_and_logprobs(reference.generate([other, long_prompt], GREEDY))
    finally:
        reference.shutdown()
    llm = LLM(str(folder), **FLAGS, **DP)
    try:
        alone = tokens_and_logprobs(llm.generate([long_prompt], GREEDY))  # rank 1 idles every step
        hits_before = llm.engine.kv.hits
        both = tokens_and_logprobs(llm.generate([other, long_prompt], GREEDY))
        kv = llm.engine.kv
        per_rank_hits = [rank.hits for rank in kv.ranks]
    finally:
        llm.shutdown()
    assert alone[0] == [expected[0][1]]
    assert both[0] == expected[0]
    assert both[1] == pytest.approx(expected[1], abs=1e-4)
    # `other` took the first free rank (0, the one caching long_prompt: ties go low); long_prompt then
    # followed its cached prefix there instead of taking the idle rank 1
    assert hits_before == 0 and per_rank_hits[0] >= 32 and per_rank_hits[1] == 0


@pytest.mark.slow  # two 2-rank launches
def test_eplb_counts_add_up_over_the_ranks(tmp_path):
    """Two prompts, one per rank; the short one ends first and its rank then idles, its placeholder
    token not counted as load. The summed counters, and so the placement planned from them, equal the
    expert-parallel run's (the same tokens routed), and re-placement keeps the tokens."""
    folder = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe")
    eplb = dict(enable_eplb=True, redundant_experts_num=1, eplb_update_interval=3)
    prompts = [PARALLEL_PROMPTS[1], PARALLEL_PROMPTS[0]]
    params = [GREEDY, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)]
    runs = {}
    for name, flags in (("ep", dict(tp_size=2, ep_size=2)), ("dp", DP)):
        llm = LLM(str(folder), **FLAGS, **flags, **eplb)
        try:
            runs[name] = tokens_and_logprobs(llm.generate(prompts, params)), llm.engine.stats()["moe"]
            touched = [rank.pool.num_touched for rank in llm.engine.kv.ranks] if name == "dp" else [1, 1]
        finally:
            llm.shutdown()
    (ep_out, ep_moe), (dp_out, dp_moe) = runs["ep"], runs["dp"]
    assert all(touched)
    assert dp_out[0] == ep_out[0]
    assert dp_out[1] == pytest.approx(ep_out[1], abs=1e-4)
    assert dp_moe["rebalances"] == ep_moe["rebalances"] >= 3
    assert dp_moe["expert"] == ep_moe["expert"] and dp_moe["placement"] == ep_moe["placement"]
    assert dp_moe["placement"] != [[0, 1, 2, 3, 4, 4, 5, 6, 7, 0]] * len(dp_moe["layers"])  # it did move
    choices = (40 + 9 + 5 + 3) * 2  # both prompts, then their decode steps' tokens, two experts each
    assert [sum(layer) for layer in dp_moe["expert"]] == [choices] * len(dp_moe["layers"])


@pytest.mark.parametrize("flags,needle", [
    (dict(tp_size=2, dp_size=2, ep_size=4), "--dp_size=2 with --ep_size=4: attention data parallelism runs each DP "
                                            "rank's attention whole"),
    (dict(dp_size=2, ep_size=2, num_speculative_tokens=2, speculative_algorithm="draft_model"),
     "--dp_size=2 with --speculative_algorithm=draft_model"),
    (dict(dp_size=2, ep_size=2, enable_graph=True), "--enable_graph with attention data parallelism \\(--dp_size=2\\)"),
    (dict(dp_size=2, ep_size=2, enable_attn_dp_weight_sharding=True, dynamic_load_weight=1),
     "--enable_attn_dp_weight_sharding with --dynamic_load_weight: reloading weights into sharded attention"),
])
def test_refusals_name_the_flag(tmp_path, flags, needle):
    folder = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    with pytest.raises((ConfigError, LaunchError), match=needle):
        LLM(str(folder), **FLAGS, **flags)


def test_a_mismatched_ep_size_names_both_meanings_of_dp_size():
    from heterollm.config import load_config
    from heterollm.config.checks import attention_dp_size, engine_replicas, expert_parallel_problems

    config = load_config([], overrides={"model": "m", "dp_size": 3, "ep_size": 2}).config
    (problem,) = expert_parallel_problems(config)
    assert problem.startswith("--ep_size=2: experts are sharded over the tensor-parallel ranks, so it must equal "
                              "--tp_size=1 (or stay 1), or --dp_size x --tp_size for attention data parallelism "
                              "(--dp_size=3 gives 3)")
    assert (attention_dp_size(config), engine_replicas(config)) == (1, 3)
    config = load_config([], overrides={"model": "m", "dp_size": 2, "ep_size": 2}).config
    assert (attention_dp_size(config), engine_replicas(config), expert_parallel_problems(config)) == (2, 1, [])


def test_too_few_blocks_for_the_ranks(tmp_path):
    folder = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    with pytest.raises(ConfigError, match="--dp_size=2: the KV cache has 1 blocks, fewer than one per attention DP"):
        LLM(str(folder), **{**FLAGS, "num_gpu_blocks_override": 1}, **DP)
