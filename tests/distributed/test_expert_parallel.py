"""Expert parallelism on CPU (gloo, one spawned worker per rank): with --ep_size 2 each rank holds
half of the experts whole, tokens go to their experts' ranks and back through the Communicator's
all_to_all, and greedy tokens and logprobs equal the single-rank run for every MoE family (shared
experts, DeepSeek's MLA and grouped routing included); FastDeploy's --enable_expert_parallel and
xLLM's --expert_parallel_degree spell the same; sizes that cannot shard are refused naming the flag."""
from __future__ import annotations

import pytest
import torch

from helpers import PARALLEL_FLAGS, build_tiny_model, greedy_run, load_family_weights
from heterollm import LLM
from heterollm.config import ConfigError

FLAGS = PARALLEL_FLAGS
run = greedy_run


@pytest.mark.parametrize("family,flags", [
    # ~6 s each (two ranks spawned): qwen2_moe and qwen3_moe run in the slow step
    pytest.param("qwen2_moe", {"ep_size": 2}, marks=pytest.mark.slow),  # a shared expert scaled by its gate
    pytest.param("qwen3_moe", {"enable_expert_parallel": True}, marks=pytest.mark.slow),  # FastDeploy's spelling
    ("mixtral", {"expert_parallel_degree": 2}),  # xLLM's other spelling
    ("deepseek_v3", {"ep_size": 2}),  # MLA attention tensor-parallel, grouped sigmoid routing, dense layer 0
])
def test_ep2_equals_ep1(tmp_path, family, flags):
    folder = build_tiny_model(tmp_path / family, family)
    tokens1, lps1 = run(folder)
    tokens2, lps2 = run(folder, tp_size=2, **flags)
    assert tokens2 == tokens1
    assert lps2 == pytest.approx(lps1, abs=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_each_rank_loads_its_half_of_the_experts_whole(tmp_path, family):
    folder = build_tiny_model(tmp_path / family, family)
    full, _ = load_family_weights(folder)
    experts = [n for n in full if n.endswith(".experts.w13") or n.endswith(".experts.w2")]
    assert experts
    for rank in range(2):
        for choices in ("default", "default_v1"):
            mine, _ = load_family_weights(folder, choices, rank, 2, ep_size=2)
            for name in experts:
                half = full[name].shape[0] // 2
                assert torch.equal(mine[name], full[name][rank * half:(rank + 1) * half]), (name, rank)


def test_fused_expert_tensors_shard_by_expert(tmp_path):
    """transformers' fused 3-D expert tensors (all experts stacked) load this rank's experts only."""
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe")
    full, _ = load_family_weights(folder)
    tensors = load_file(folder / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        names = sorted(n for n in tensors if n.startswith(prefix + "."))
        gate = torch.stack([tensors[f"{prefix}.{e}.gate_proj.weight"] for e in range(8)])
        up = torch.stack([tensors[f"{prefix}.{e}.up_proj.weight"] for e in range(8)])
        down = torch.stack([tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
        for n in names:
            del tensors[n]
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[f"{prefix}.down_proj"] = down
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for rank in range(2):
        mine, _ = load_family_weights(folder, "default", rank, 2, ep_size=2)
        for layer in range(2):
            for p in ("w13", "w2"):
                name = f"model.layers.{layer}.mlp.experts.{p}"
                assert torch.equal(mine[name], full[name][rank * 4:(rank + 1) * 4])


@pytest.mark.parametrize("family,flags,needle", [
    ("qwen3_moe", {"tp_size": 2, "ep_size": 4}, "--ep_size=4: experts are sharded over the tensor-parallel ranks, "
                                                "so it must equal --tp_size=2"),
    ("qwen3_moe", {"tp_size": 2, "ep_size": 2, "expert_parallel_degree": 4},
     "--expert_parallel_degree=4: disagrees with --ep_size=2"),
    ("llama", {"tp_size": 2, "ep_size": 2}, "--ep_size=2: LlamaForCausalLM has no experts to shard"),
    ("mixtral", {"tp_size": 2, "ep_size": 2, "_experts": 3}, "--ep_size=2 does not divide the 3 routed experts"),
    ("qwen3_moe", {"enable_attn_dp_weight_sharding": True}, "--enable_attn_dp_weight_sharding: shards the attention "
                                                            "weights over the attention data-parallel ranks; set "
                                                            "--dp_size"),
])
def test_sizes_that_cannot_shard_name_the_flag(tmp_path, family, flags, needle):
    flags = dict(flags)
    overrides = {"num_local_experts": flags.pop("_experts")} if "_experts" in flags else {}
    folder = build_tiny_model(tmp_path / family, family, **overrides)
    from heterollm.plugins.resolver import LaunchError
    with pytest.raises((ConfigError, LaunchError), match=needle.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(folder), **FLAGS, **flags)
