"""EPLB (--enable_eplb) on CPU with two expert-parallel ranks (gloo): a DeepSeek-V3 model whose routing
is skewed by construction (the correction bias sends every token to experts 0 and 1, both on rank 0)
keeps its greedy tokens and logprobs while the experts are re-placed every two steps; after a
re-placement the ranks' load evens out below a stated bound and the redundant replicas serve tokens
(the counters say so); /metrics exports the load. The placement plan by hand, and the refusals."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import PARALLEL_FLAGS, PARALLEL_PROMPTS, build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor.eplb import ExpertPlacement, Move
from heterollm.plugins.resolver import LaunchError

FLAGS, PROMPTS = PARALLEL_FLAGS, PARALLEL_PROMPTS
EPLB = dict(tp_size=2, ep_size=2, enable_eplb=True, redundant_experts_num=1)
BOUND = 1.25
"""Max / mean of the ranks' expert choices after a re-placement, on this skew (hand-derived below: 1.0)."""


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    """Layer 1 (sparse; layer 0 is dense) routes every token to experts 0 and 1: their correction bias
    outweighs any sigmoid score, and they make up group 0, which the group ranking then keeps."""
    folder = build_tiny_model(tmp_path_factory.mktemp("skewed"), "deepseek_v3")
    tensors = load_file(folder / "model.safetensors")
    bias = torch.zeros(8)
    bias[:2] = 10.0
    tensors["model.layers.1.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def generate(llm, max_tokens):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1))
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


def test_outputs_do_not_change_while_experts_move(skewed):
    reference = LLM(str(skewed), **FLAGS)
    tokens1, lps1 = generate(reference, 16)
    reference.shutdown()
    llm = LLM(str(skewed), **FLAGS, **EPLB, eplb_update_interval=2)
    try:
        tokens2, lps2 = generate(llm, 16)
        moe = llm.engine.stats()["moe"]
    finally:
        llm.shutdown()
    assert tokens2 == tokens1
    assert lps2 == pytest.approx(lps1, abs=1e-4)
    assert moe["rebalances"] >= 7  # 17 steps, a re-placement every 2
    assert moe["layers"] == [1]
    # the hot experts hold the redundant slots now: two replicas each, one per rank
    placement = moe["placement"][0]
    assert sorted(placement) == [0, 0, 1, 1, 2, 3, 4, 5, 6, 7]
    assert {placement[:5].count(0), placement[5:].count(0), placement[:5].count(1), placement[5:].count(1)} == {1}


def test_a_replacement_evens_the_ranks_and_replicas_serve(skewed):
    llm = LLM(str(skewed), **FLAGS, **EPLB, eplb_update_interval=4)
    try:
        generate(llm, 1)  # one step (the prompts, each sampling its one token): no re-placement yet
        before = llm.engine.stats()["moe"]
        generate(llm, 6)  # steps 2-7: re-placed after step 4, then three steps of 6 choices counted
        after = llm.engine.stats()["moe"]
        generate(llm, 3)
        later = llm.engine.stats()["moe"]
    finally:
        llm.shutdown()
    assert before["rebalances"] == 0
    # the initial placement: rank 0 holds experts 0-3 and a replica of 4, rank 1 holds 4-7 and a replica
    # of 0. Every token chooses 0 and 1: expert 0's choices split over both ranks, expert 1's stay on
    # rank 0, so the ranks serve 3 : 1 of the choices, max / mean = 1.5
    assert before["placement"][0] == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    r0, r1 = before["rank_window"][0]
    assert (r0, r1) != (0, 0) and max(r0, r1) / ((r0 + r1) / 2) == pytest.approx(1.5, abs=0.05)
    assert after["rebalances"] >= 1
    ranks = after["rank_window"][0]
    assert sum(ranks) > 0 and max(ranks) / (sum(ranks) / 2) <= BOUND
    # every replica of a hot expert served choices after the re-placement
    placement = later["placement"][0]
    assert placement == after["placement"][0]
    hot = [p for p, e in enumerate(placement) if e in (0, 1)]
    assert len(hot) == 4
    assert all(later["replica"][0][p] > after["replica"][0][p] for p in hot)
    assert sum(later["expert"][0]) == sum(later["replica"][0])


def test_metrics_export_the_expert_load(skewed):
    from heterollm.entrypoints.openai.metrics import _ReplicaCollector

    llm = LLM(str(skewed), **FLAGS, **EPLB, eplb_update_interval=2)
    try:
        generate(llm, 6)
        families = {f.name: f for f in _ReplicaCollector([llm.engine], "m").collect()}
        moe = llm.engine.stats()["moe"]
    finally:
        llm.shutdown()
    load = {s.labels["expert"]: s.value for s in families["heterollm_moe_expert_load"].samples
            if s.name.endswith("_total")}
    assert load == {str(e): float(c) for e, c in enumerate(moe["expert"][0])}
    assert load["0"] == load["1"] > 0 and load["5"] == 0
    replicas = [s for s in families["heterollm_moe_expert_replica_load"].samples if s.name.endswith("_total")]
    assert len(replicas) == 10 and {s.labels["ep_rank"] for s in replicas} == {"0", "1"}
    assert families["heterollm_eplb_rebalances"].samples[0].value == moe["rebalances"] > 0
    (ratio,) = families["heterollm_eplb_rank_load_ratio"].samples
    assert ratio.labels["layer"] == "1" and 1.0 <= ratio.value <= 2.0


def test_the_plan_by_hand():
    """Four experts on two ranks with one redundant slot each (3 slots a rank); loads 9, 4, 0, 0. The
    two redundant slots go to expert 0 (9 > 4, then 4.5 > 4): 3 replicas of load 3. Packed heaviest
    first: expert 1 (4) to rank 0 (it holds it), e0 (3) to rank 1, e0 to rank 0 (rank 1 has one), e0 to
    rank 1 (6 < 7), e2 to rank 1, e3 to rank 0: ranks 7 and 6. Kept in place where they sit: rank 0
    [0, 1, 2] -> [0, 1, 3], rank 1 [2, 3, 0] -> [2, 0, 0]; slot 2 takes expert 3 from rank 1's slot 1
    (physical 4), slot 4 expert 0 from its own rank's slot 2 (physical 5)."""
    placement = ExpertPlacement(4, 2, 1)
    assert placement.phys2log.tolist() == [0, 1, 2, 2, 3, 0]
    placement.window = torch.tensor([9, 4, 0, 0])
    new = placement.plan()
    assert new.tolist() == [0, 1, 3, 2, 0, 0]
    assert placement.moves(new) == [Move(2, 4), Move(4, 5)]
    placement.commit(new)
    assert placement.replicas.tolist() == [3, 1, 1, 1] and placement.window.sum() == 0
    # choices of expert 0 go to its three replicas in turn, the others to their one slot
    phys = placement.to_physical(torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1]]))
    assert phys.tolist() == [[0, 1], [4, 3], [5, 2], [0, 1]]
    assert placement.rank_load().tolist() == [5, 3]


@pytest.mark.parametrize("flags,needle", [
    (dict(enable_eplb=True), "--enable_eplb: balances experts across expert-parallel ranks"),
    (dict(redundant_experts_num=2), "--redundant_experts_num=2: only --enable_eplb uses it"),
    (dict(eplb_update_interval=5), "--eplb_update_interval=5: only --enable_eplb uses it"),
    (dict(**EPLB, quantization="wint8"), "--enable_eplb with --quantization=wint8: moving prepared"),
])
def test_refusals_name_the_flag(skewed, flags, needle):
    with pytest.raises((ConfigError, LaunchError), match=needle):
        LLM(str(skewed), **FLAGS, **flags)
