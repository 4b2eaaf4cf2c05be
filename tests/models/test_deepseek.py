"""DeepSeek-V2 / V3 (multi-head latent attention, grouped routing, shared experts, dense first layers)
against transformers on tiny random configs: greedy tokens identical and logprobs within 1e-3 (fp32),
with the prompts prefilled whole and in small chunks over cached context; the router's choice and
weights against transformers' own router; the cache holds one latent per token; bf16, compiled decode
steps (--enable_graph) and --quantization run; an attention family without MLA and configs
transformers does not run are refused with the reason."""
from __future__ import annotations

import pytest
import torch

from helpers import (assert_logprobs_match_transformers, assert_same_parameters, build_tiny_model, hf_greedy,
                     hf_logprobs, load_family_weights, write_deepseek_gguf)
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor.models.deepseek_v2 import DeepseekV2Moe, MlaUpProjection
from heterollm.model_executor.models.llama import MLP
from heterollm.model_executor.moe import FusedMoE, group_limited_topk
from heterollm.plugins.resolver import LaunchError

PROMPTS = [[1, 20, 30, 40, 50], list(range(100, 137)), [7, 7, 7], list(range(500, 700, 3)), [42]]
NEW = 16
VARIANTS = {
    # softmax greedy routing, q_proj without a q latent, the first layer dense
    "deepseek_v2": ("deepseek_v2", {}),
    # DeepSeek-V2's node-limited routing: the top 2 experts within the 2 of 4 groups whose best expert
    # scores highest, scaled; a q latent; every layer sparse
    "deepseek_v2-grouped": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                                            "q_lora_rank": 32, "routed_scaling_factor": 2.0,
                                            "first_k_dense_replace": 0}),
    # sigmoid routing with the correction bias, groups scored by their best two, renormalized, scaled;
    # interleaved rotary pairs
    "deepseek_v3": ("deepseek_v3", {}),
    # YaRN with mscale_all_dim (the softmax scale changes, not only the rotary table), rotate-half
    # rotary layout, weights not renormalized
    "deepseek_v3-yarn": ("deepseek_v3", {"rope_interleave": False, "norm_topk_prob": False,
                                         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                             "original_max_position_embeddings": 128,
                                                             "mscale": 1.0, "mscale_all_dim": 1.0}}),
}
DENSE_LAYERS = {"deepseek_v2": {0}, "deepseek_v3": {0}, "deepseek_v3-yarn": {0}, "deepseek_v2-grouped": set()}
FLAGS = {"dtype": "float32", "block_size": 16, "num_gpu_blocks_override": 128}
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return request.param, folder, hf_greedy(folder, PROMPTS, NEW)


@pytest.mark.parametrize("mode", ["default", "small_chunks"])
def test_greedy_matches_transformers(deepseek, mode):
    name, folder, expected = deepseek
    flags = {**FLAGS, **({"max_tokens_per_chunk_for_prefill": 8, "max_tokens_per_batch": 24}
                         if mode == "small_chunks" else {})}
    llm = LLM(str(folder), **flags)
    model = llm.engine.executor.runner.model
    dense = {i for i, layer in enumerate(model.model.layers) if type(layer.mlp) is MLP}
    assert dense == DENSE_LAYERS[name]
    assert all(isinstance(layer.mlp, DeepseekV2Moe) for i, layer in enumerate(model.model.layers) if i not in dense)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected, f"{name} / {mode}"


def test_prefix_cache_serves_shared_latents(tmp_path):
    """Prompts sharing a 40-token prefix, the later ones read its latents from the cache (blocks hit),
    and give transformers' tokens."""
    folder = build_tiny_model(tmp_path / "v3", "deepseek_v3")
    prefix = list(range(200, 240))
    prompts = [prefix + [5, 6, 7], prefix + [8], prefix + list(range(300, 320))]
    expected = hf_greedy(folder, prompts, 8)
    llm = LLM(str(folder), **FLAGS, enable_prefix_cache=True)
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    rest = llm.generate(prompts[1:], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert [o.metrics.num_cached_tokens for o in rest] == [32, 32]  # two full 16-token blocks of the prefix


def test_logprobs_match_transformers(deepseek):
    name, folder, _ = deepseek
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=128,
              max_tokens_per_chunk_for_prefill=16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(PROMPTS[:4], params)
    assert_logprobs_match_transformers(folder, PROMPTS[:4], outs)


def test_routing_matches_transformers_router(deepseek):
    """Each sparse layer's chosen experts and their weights against transformers' own router on the
    same hidden states, which spread unevenly over the experts."""
    from transformers import AutoModelForCausalLM

    name, folder, _ = deepseek
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), **FLAGS)
    ours = llm.engine.executor.runner.model
    x = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    checked = 0
    for layer, hf_layer in zip(ours.model.layers, hf.model.layers):
        if not isinstance(layer.mlp, DeepseekV2Moe):
            continue
        with torch.no_grad():
            _, hf_weights, hf_ids = hf_layer.mlp.gate(x)
            weights, ids = layer.mlp.route(x)
        order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
        assert torch.equal(order.values, hf_order.values), name
        torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))
        counts = torch.bincount(ids.flatten(), minlength=layer.mlp.num_experts)
        assert counts.max() > counts.min()
        checked += 1
    assert checked == len(ours.model.layers) - len(DENSE_LAYERS[name])


def test_the_cache_holds_one_latent_per_token(deepseek):
    """kv_lora_rank + qk_rope_head_dim values per token and layer, no heads, no V plane: the budget's
    bytes per block say so, and the caches are shaped so."""
    name, folder, _ = deepseek
    llm = LLM(str(folder), **FLAGS)
    runner = llm.engine.executor.runner
    cfg = runner.source.hf_config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert runner.kv_bytes_per_block() == cfg.num_hidden_layers * 16 * latent * 4
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    assert all(c.shape == (1, 1, 128, 16, latent) for c in runner.kv_caches)


def test_bf16_runs_and_mostly_agrees(deepseek):
    name, folder, _ = deepseek
    llm = LLM(str(folder), dtype="bfloat16", num_gpu_blocks_override=64)
    model = llm.engine.executor.runner.model
    gates = [layer.mlp.gate.weight for layer in model.model.layers if isinstance(layer.mlp, DeepseekV2Moe)]
    assert gates and all(g.dtype == torch.float32 for g in gates)  # the router stays fp32, as transformers keeps it
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(folder, prompt)[-1]
        assert ref.max().item() - ref[out.outputs[0].token_ids[0]].item() < 0.05, name


def test_compiled_decode_steps_give_the_eager_tokens(tmp_path):
    folder = build_tiny_model(tmp_path / "v3", "deepseek_v3")
    expected = hf_greedy(folder, PROMPTS[:3], 8)
    llm = LLM(str(folder), **FLAGS, enable_graph=True)
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.executor.runner.graph_runner.num_replays > 0


@pytest.mark.parametrize("flag", ["wint8", "wint4"])
def test_quantization_covers_experts_and_linears_but_not_kv_b_proj(tmp_path, flag):
    folder = build_tiny_model(tmp_path / "v3", "deepseek_v3")
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, quantization=flag)
    model = llm.engine.executor.runner.model
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.method.name == flag for m in experts)
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj.method.name == flag and attn.kv_a_proj_with_mqa.method.name == flag
    ups = [m for m in model.modules() if isinstance(m, MlaUpProjection)]
    assert len(ups) == 2 and all(m.weight.dtype == torch.float32 and m.weight.numel() > 0 for m in ups)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(folder, prompt)[-1]
        assert ref.max().item() - ref[out.outputs[0].token_ids[0]].item() < 0.3


GGUF_VARIANTS = {
    # llama.cpp's current layout: kv_b_proj split into attn_k_b (transposed per head) and attn_v_b; tied
    # embeddings (no output.weight)
    "deepseek_v2": ("deepseek_v2", {"tie_word_embeddings": True}, True),
    # the older layout (one attn_kv_b); group-limited softmax routing, a q latent, every layer sparse
    "deepseek_v2-grouped": VARIANTS["deepseek_v2-grouped"] + (False,),
    # sigmoid routing with exp_probs_b; YaRN with mscale_all_dim from yarn_log_multiplier (interleaved
    # rotary pairs: llama.cpp keeps DeepSeek's weights as they are)
    "deepseek_v3-yarn": ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                             "original_max_position_embeddings": 128,
                                                             "mscale": 0.707, "mscale_all_dim": 0.707}}, True),
}


@pytest.mark.slow  # ~15 s each
@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_files_load_like_the_safetensors_folder(tmp_path, variant, monkeypatch):
    """A `deepseek2` GGUF file (transformers reads no config for it: gguf_cache builds it from the
    metadata) gives transformers' greedy tokens on the folder and the same parameters."""
    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(tmp_path / "cache"))
    family, overrides, split = GGUF_VARIANTS[variant]
    folder = build_tiny_model(tmp_path / variant, family, **overrides)
    gguf_file = write_deepseek_gguf(folder, tmp_path / f"{variant}.gguf", split_kv_b=split)
    want_tokens = hf_greedy(folder, PROMPTS[:3], NEW)
    for start in ("first", "cached"):  # the second start reads the config and tokenizer saved by the first
        llm = LLM(str(gguf_file), **FLAGS)
        try:
            cfg = llm.engine.executor.runner.source.hf_config
            outs = llm.generate(PROMPTS[:3], GREEDY)
        finally:
            llm.shutdown()
        assert type(cfg).__name__ == ("DeepseekV3Config" if family == "deepseek_v3" else "DeepseekV2Config"), start
        assert [o.outputs[0].token_ids for o in outs] == want_tokens, start
    from_gguf, _ = load_family_weights(gguf_file)
    want, _ = load_family_weights(folder)
    assert_same_parameters(from_gguf, want)
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(folder)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "q_lora_rank",
                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace", "routed_scaling_factor",
                "norm_topk_prob", "n_group", "topk_group", "tie_word_embeddings"):
        assert getattr(cfg, key) == pytest.approx(getattr(ref, key)), key
    assert getattr(cfg, "topk_method", "noaux_tc") == getattr(ref, "topk_method", "noaux_tc")
    assert {k: v for k, v in cfg.rope_parameters.items() if k not in ("beta_fast", "beta_slow")} == \
        pytest.approx({k: v for k, v in ref.rope_parameters.items() if k not in ("beta_fast", "beta_slow")})


@pytest.mark.slow
def test_a_half_split_kv_b_is_refused(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "v2", "deepseek_v2")
    full = write_deepseek_gguf(folder, tmp_path / "full.gguf")
    reader = gguf.GGUFReader(str(full))
    w = gguf.GGUFWriter(str(tmp_path / "half.gguf"), "deepseek2")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name != "blk.1.attn_v_b.weight":
            w.add_tensor(t.name, t.data.reshape(tuple(int(d) for d in reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"holds only half of the split kv_b_proj of \['model.layers.1.self_attn'\]"):
        LLM(str(tmp_path / "half.gguf"), **FLAGS)


def test_an_attention_family_without_mla_is_refused(tmp_path):
    folder = build_tiny_model(tmp_path / "v2", "deepseek_v2")
    with pytest.raises(LaunchError, match=r"multi-head latent attention \(kv_lora_rank=24\).*supports_mla\(\) is False"):
        LLM(str(folder), **FLAGS, extension_impl="example")


@pytest.mark.parametrize("overrides,needle", [
    ({"topk_method": "noaux_tc", "n_group": 4, "topk_group": 2}, "topk_method 'noaux_tc' is not supported"),
    ({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group=3 does not divide the 8 routed experts"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
])
def test_configs_transformers_does_not_run_are_refused(tmp_path, overrides, needle):
    folder = build_tiny_model(tmp_path / "v2", "deepseek_v2")
    import json
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **overrides}))
    with pytest.raises(ConfigError, match=needle):
        LLM(str(folder), **FLAGS)


def test_group_limited_topk_by_hand():
    """Four groups of two experts, scores written out. By their best expert ("max") token 0 keeps
    groups 0 and 2 (0.9, 0.8), so expert 5 (0.6) beats expert 2 (0.3); token 1 keeps groups 3 and 1
    (0.9, 0.6). By the sum of their best two ("top2") token 1 keeps group 1 (1.1) over group 3 (0.95),
    which its best expert alone would have chosen."""
    scores = torch.tensor([[0.9, 0.1, 0.3, 0.2, 0.8, 0.6, 0.2, 0.1],
                           [0.1, 0.2, 0.5, 0.6, 0.3, 0.3, 0.9, 0.05]])
    ids = group_limited_topk(scores, 3, 4, 2, "max", 0.0).sort(dim=-1).values
    assert ids[0].tolist() == [0, 4, 5]  # groups 0 and 2; expert 2 (0.3, group 1) is out
    assert ids[1].tolist() == [2, 3, 6]  # groups 1 (0.6) and 3 (0.9)
    ids = group_limited_topk(scores, 2, 4, 1, "top2", float("-inf")).sort(dim=-1).values
    assert ids[0].tolist() == [4, 5]  # group 2 sums 1.4, more than group 0's 1.0
    assert ids[1].tolist() == [2, 3]  # group 1 sums 1.1, group 3 0.95
