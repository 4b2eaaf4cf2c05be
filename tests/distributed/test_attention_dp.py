"""Attention data parallelism (xLLM's --dp_size with --ep_size = --dp_size) on CPU, two gloo ranks in
one engine: each rank holds its own requests' KV cache (half the engine's blocks) and runs attention
and the dense layers for them alone; the experts are sharded over both ranks and exchange tokens
through the Communicator's all_to_all. Greedy tokens and logprobs equal the single-rank run (MLA
included); a rank without a request in a step still joins the experts' exchange; a prompt goes to
the rank whose prefix cache holds it; EPLB's counters add up over the ranks and do not count the
idle rank's token. The KV manager's split by hand, and the refusals."""
from __future__ import annotations

import pytest

from helpers import PARALLEL_FLAGS, PARALLEL_PROMPTS, build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.kv_cache import DataParallelKVCacheManager
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
    (dict(dp_size=2, ep_size=2, enable_attn_dp_weight_sharding=True),
     "--enable_attn_dp_weight_sharding=true: sharding the attention weights over the attention data-parallel ranks"),
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


# -- the KV manager's split, by hand ---------------------------------------------------------------
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
