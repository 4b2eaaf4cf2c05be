"""Mixture-of-experts families (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral) against
transformers on tiny random configs: greedy tokens identical and logprobs within 1e-3 (fp32) on a
batch of prompts whose tokens spread unevenly over the experts; Qwen-MoE's dense layers
(`mlp_only_layers`, `decoder_sparse_step`); `--load_choices default_v1` and transformers' fused
3-D expert tensors load the same parameters, rank by rank; `--quantization` covers the experts;
Qwen-MoE GGUF files load as their folders do, quantized checkpoints and the GGUF files transformers
reads no config for are refused with the reason; and the `fused_moe` op against a plain per-token loop written here."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from helpers import (MOE_FAMILIES, assert_logprobs_match_transformers, assert_same_parameters, build_tiny_model,
                     hf_greedy, hf_logprobs, load_family_weights, write_moe_gguf)
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import state_bytes
from heterollm.model_executor.loader import resolve_model
from heterollm.model_executor.models.llama import MLP
from heterollm.model_executor.moe import FusedMoE, SparseMoeBlock
from heterollm.model_executor.parallel import ParallelContext
from heterollm.plugins import get_registry
from heterollm_cpu import kernels

PROMPTS = [[1, 20, 30, 40, 50], list(range(100, 137)), [7, 7, 7], list(range(500, 700, 3)), [42]]
NEW = 16
VARIANTS = {
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    # layer 0 dense (listed in mlp_only_layers), layer 1 sparse; renormalized top-k
    "qwen2_moe-dense0": ("qwen2_moe", {"mlp_only_layers": [0], "norm_topk_prob": True}),
    # only every second layer sparse: layer 0 dense, layer 1 sparse; top-k weights not renormalized
    "qwen3_moe-step2": ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": False}),
}
DENSE_LAYERS = {"qwen2_moe-dense0": {0}, "qwen3_moe-step2": {0}}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_model(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return request.param, folder, hf_greedy(folder, PROMPTS, NEW)


def hf_expert_counts(folder) -> list[torch.Tensor]:
    """transformers' own routing of all the prompts' tokens: tokens per expert, per sparse layer."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    k, counts = model.config.num_experts_per_tok, []
    with torch.no_grad():
        per_prompt = [model(torch.tensor([ids]), output_router_logits=True).router_logits for ids in PROMPTS]
    for layer in zip(*per_prompt):
        logits = torch.cat([t.reshape(-1, t.shape[-1]) for t in layer])
        counts.append(torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=logits.shape[-1]))
    return counts


@pytest.mark.parametrize("mode", ["default", "small_chunks"])
def test_greedy_matches_transformers(moe_model, mode):
    name, folder, expected = moe_model
    flags = {"dtype": "float32", "block_size": 16, "num_gpu_blocks_override": 128,
             **({"max_tokens_per_chunk_for_prefill": 8, "max_tokens_per_batch": 24} if mode == "small_chunks" else {})}
    llm = LLM(str(folder), **flags)
    model = llm.engine.executor.runner.model
    dense = {i for i, layer in enumerate(model.model.layers) if type(layer.mlp) is MLP}
    assert dense == DENSE_LAYERS.get(name, set())
    assert all(isinstance(layer.mlp, SparseMoeBlock) for i, layer in enumerate(model.model.layers) if i not in dense)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected, f"{name} / {mode}"
    if mode == "default":  # the batch really routes unevenly (transformers' router says so)
        for counts in hf_expert_counts(folder):
            assert counts.sum() == sum(map(len, PROMPTS)) * llm.engine.executor.runner.source.hf_config.num_experts_per_tok
            assert counts.max() > counts.min()


def test_logprobs_match_transformers(moe_model):
    name, folder, _ = moe_model
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=128,
              max_tokens_per_chunk_for_prefill=16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate(PROMPTS[:4], params)
    assert_logprobs_match_transformers(folder, PROMPTS[:4], outs)


def test_bf16_runs_and_mostly_agrees(moe_model):
    """bf16 end to end (Mixtral's routing weights stay fp32, Qwen's are cast, as transformers does): the
    first greedy token is fp32's choice or within a small logprob margin of it (bf16 rounding may flip
    near-ties, in routing as in logits)."""
    name, folder, _ = moe_model
    llm = LLM(str(folder), dtype="bfloat16", num_gpu_blocks_override=64)
    assert llm.engine.executor.runner.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(folder, prompt)[-1]
        assert ref.max().item() - ref[out.outputs[0].token_ids[0]].item() < 0.05, name

@pytest.mark.parametrize("flag", ["wint8", "wint4", "w8a8"])
def test_quantization_covers_the_experts(moe_model, flag):
    """--quantization wint8 / wint4 / w8a8 prepares every expert with the flag's linear method (no float copy
    left), the weights shrink accordingly, and greedy decoding stays near transformers' fp32 choice."""
    name, folder, expected = moe_model
    float_bytes = LLM(str(folder), dtype="float32", num_gpu_blocks_override=16).engine.executor.runner.weight_bytes
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=64, quantization=flag)
    runner = llm.engine.executor.runner
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.method.name == flag and m.w13.numel() == 0 and m.w2.numel() == 0 for m in experts)
    codes = experts[0].states13[0][0]
    assert codes.dtype == (torch.uint8 if flag == "wint4" else torch.int8)
    float_experts = sum(4 * m.num_experts * 3 * m.inter * runner.model.config.hidden_size for m in experts)
    quantized_experts = sum(state_bytes(m.state) for m in experts)
    # codes of 1 byte (wint8, w8a8) or half a byte (wint4) per fp32 weight, plus scales; counted in weight_bytes
    assert quantized_experts < float_experts * (0.2 if flag == "wint4" else 0.3)
    assert runner.weight_bytes <= float_bytes - (float_experts - quantized_experts)
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_logprobs(folder, prompt)[-1]
        # a random token sits ~2.6 below the best here (median); wint4's VNNI route (int8 activations, as
        # llama.cpp's Q4_1 x Q8_1) picked a third choice 0.39 below it on qwen3_moe-step2
        assert ref.max().item() - ref[out.outputs[0].token_ids[0]].item() < (0.5 if flag == "wint4" else 0.3), name


@pytest.mark.parametrize("flag", ["wint8", "wint4"])
def test_quantized_experts_compute_with_their_dequantized_weights(flag):
    """The quantized path is the same expert math: a FusedMoE on the CPU backend's wint8 / wint4 method
    equals the per-token loop on the weights that method represents (read back by multiplying the
    identity), and stays near the float weights."""
    from heterollm_cpu.linear import WeightOnlyInt4, WeightOnlyInt8
    method = {"wint8": WeightOnlyInt8, "wint4": WeightOnlyInt4}[flag]()
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, k = 19, 64, 32, 4, 2
    layer = FusedMoE(experts, hidden, inter, ParallelContext())
    layer.w13.data.copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2)
    layer.w2.data.copy_(torch.randn(experts, hidden, inter, generator=gen) * 0.2)
    w13, w2 = layer.w13.data.clone(), layer.w2.data.clone()
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    layer.prepare(method)

    def dequantized(states, rows, cols):
        return torch.stack([method.apply(st, torch.eye(cols), None).t() for st in states])

    d13, d2 = dequantized(layer.states13, 2 * inter, hidden), dequantized(layer.states2, hidden, inter)
    assert not torch.equal(d13, w13) and (d13 - w13).abs().max() < (0.02 if flag == "wint8" else 0.1)
    got = layer(x, weights, ids)
    ref = per_token_reference(x, d13, d2, weights, ids)
    # the kernels round activations: to int16 (`int4_linear` per block of 32, wint8's `int8_gemm` per row, to
    # 1 / 65534 of the largest), ~1e-4 of the output's size, which the fp32 paths (torch's) do not add; to
    # int8 per group of 32 (`int4_dot_linear`, the AVX512-VNNI route: 1 / 254 of the group's largest, in
    # both of an expert's products), 2.9% of the output's size here
    rounded = isinstance(layer.states13[0][0], torch.Tensor) and layer.states13[0][0].dim() == 4 if flag == "wint8" \
        else kernels.available()
    dot = flag == "wint4" and layer.states13[0][0].shape[-1] == 64
    tol = (5e-2 if dot else 3e-4) * ref.abs().max().item() if rounded else 1e-4
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=tol)
    # the method's own products, token by token (its activation rounding is per row): the same numbers up to
    # fp32 rounding, which may move an int8 activation code by one (2e-3 of the output's size at most)
    apply = [lambda t, e=e, s=s: method.apply(s[e], t[None], None)[0] for s in (layer.states13, layer.states2)
             for e in range(experts)]
    exact = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = apply[e](x[t]).chunk(2)
            exact[t] += float(weights[t, j]) * apply[experts + e](F.silu(gate) * up).double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=2e-3 * exact.abs().max().item())


def test_quantized_checkpoints_are_refused_and_moe_gguf_files_are_not(tmp_path):
    """Quantized experts have no loader yet: the launch says so instead of reporting missing weights.
    GGUF files of every MoE family here load (Mixtral's and DeepSeek's configs built from the metadata)."""
    folder = build_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    source = resolve_model(str(folder))
    registry = get_registry()
    model = registry.get("models", source.architectures[0], family="core").obj(source.hf_config, ParallelContext(), 64)

    class Gptq:
        def describe(self):
            return "GPTQ 4-bit"

    assert model.launch_refused(None, None, None) is None
    assert model.launch_refused(None, None, tmp_path / "m.gguf") is None  # Qwen3-MoE GGUF files load
    assert "a GPTQ 4-bit checkpoint of Qwen3MoeForCausalLM" in model.launch_refused(None, Gptq(), None)
    folder = build_tiny_model(tmp_path / "mixtral", "mixtral")
    source = resolve_model(str(folder))
    mixtral = registry.get("models", source.architectures[0], family="core").obj(source.hf_config, ParallelContext(), 64)
    assert mixtral.launch_refused(None, None, tmp_path / "m.gguf") is None  # llama files with experts load


@pytest.mark.parametrize("family,arch", [  # ~20 s each: all in the slow step (dense GGUF loading is in the default run)
                                         pytest.param("mixtral", "llama", marks=pytest.mark.slow),
                                         pytest.param("qwen3_moe", "qwen3moe", marks=pytest.mark.slow),
                                         pytest.param("qwen2_moe", "qwen2moe", marks=pytest.mark.slow)])
def test_gguf_files_load_like_the_safetensors_folder(tmp_path, family, arch, monkeypatch):
    """llama.cpp's layout (experts stacked per layer, the shared expert's gate a vector; the experts'
    widths only in `<arch>.expert_*feed_forward_length`, which transformers' GGUF config leaves at the
    class default; Mixtral as a `llama` file with experts, which transformers reads as a dense Llama):
    the greedy tokens of transformers on the folder, and the same parameters."""
    monkeypatch.setenv("HETEROLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / family, family)
    gguf_file = write_moe_gguf(folder, tmp_path / f"{family}.gguf", arch)
    llm = LLM(str(gguf_file), dtype="float32", num_gpu_blocks_override=64)
    cfg = llm.engine.executor.runner.source.hf_config
    if family == "mixtral":
        assert (type(cfg).__name__, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == \
            ("MixtralConfig", 4, 2, 32)
    else:
        assert cfg.moe_intermediate_size == 32 and getattr(cfg, "shared_expert_intermediate_size", 64) == 64
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(folder, PROMPTS, 8)
    from_gguf, _ = load_family_weights(gguf_file)
    want, _ = load_family_weights(folder)
    assert_same_parameters(from_gguf, want)


# -- loading: default_v1 windows and fused expert tensors, rank by rank ---------------------------
@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_default_v1_loads_the_same_parameters_on_every_rank(tmp_path, family):
    folder = build_tiny_model(tmp_path / family, family)
    default, _ = load_family_weights(folder, "default")
    v1, stats = load_family_weights(folder, "default_v1")
    assert_same_parameters(v1, default)
    assert stats.read == stats.stored
    for rank in range(2):
        default, full = load_family_weights(folder, "default", rank, 2)
        v1, shard = load_family_weights(folder, "default_v1", rank, 2)
        assert_same_parameters(v1, default)
        assert shard.stored == full.stored
        # the experts are halved with the other projections: a rank reads about half the bytes
        assert 0.5 * full.stored <= shard.read < 0.65 * full.stored


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_fused_3d_expert_tensors_load_like_per_expert_ones(tmp_path, family):
    """transformers keeps experts as gate_up_proj (experts, 2 * inter, hidden) and down_proj (experts,
    hidden, inter); a checkpoint written that way loads the same parameters, on each of two ranks."""
    folder = build_tiny_model(tmp_path / family, family)
    fused_folder = tmp_path / "fused"
    fused_folder.mkdir()
    names = {"qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
             "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}[family]
    block, gate, up, down = names
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    fused, layers = {}, {int(n.split(".")[2]) for n in state if ".experts." in n}
    num_experts = 1 + max(int(n.split(".experts.")[1].split(".")[0]) for n in state if ".experts." in n)
    for name, tensor in state.items():
        if ".experts." not in name:
            fused[name] = tensor
    for i in layers:
        p = f"model.layers.{i}.{block}.experts"
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state[f"{p}.{e}.{gate}.weight"], state[f"{p}.{e}.{up}.weight"]]) for e in range(num_experts)])
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [state[f"{p}.{e}.{down}.weight"] for e in range(num_experts)])
    save_file(fused, str(fused_folder / "model.safetensors"), metadata={"format": "pt"})
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (fused_folder / f.name).write_bytes(f.read_bytes())
    for tp_size in (1, 2):
        for rank in range(tp_size):
            want, _ = load_family_weights(folder, "default", rank, tp_size)
            for choice in ("default", "default_v1"):
                got, _ = load_family_weights(fused_folder, choice, rank, tp_size)
                assert_same_parameters(got, want)


# -- the op ---------------------------------------------------------------------------------------
def per_token_reference(x, w13, w2, weights, ids):
    """out[t] = sum over t's choices (e, w) of w * down_e(silu(gate_e x[t]) * up_e x[t]), token by token."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = x[t].double()
            g = w13[e, :inter].double() @ xt
            u = w13[e, inter:].double() @ xt
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(g) * u))
    return out


def test_fused_moe_op_equals_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 23, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    # uneven by construction: expert 0 takes most tokens, expert 5 none, a token may pick 0 twice over
    ids = torch.randint(0, 5, (tokens, k), generator=gen)
    ids[: tokens // 2, 0] = 0
    weights = torch.rand(tokens, k, generator=gen)
    assert 5 not in ids
    fused = ops.get("fused_moe")
    got = fused(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), per_token_reference(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    # one token, one choice: decode with top-1
    one = fused(x[:1], w13, w2, weights[:1, :1], ids[:1, :1])
    torch.testing.assert_close(one.double(), per_token_reference(x[:1], w13, w2, weights[:1, :1], ids[:1, :1]),
                               rtol=1e-5, atol=1e-5)
    # bf16 activations with fp32 routing weights (Mixtral's): bf16 out, close to the exact value
    got16 = fused(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert got16.dtype == torch.bfloat16
    ref16 = per_token_reference(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    torch.testing.assert_close(got16.double(), ref16, rtol=3e-2, atol=3e-2)


def test_compiled_decode_steps_call_the_op_whole(tmp_path):
    """--enable_graph on CPU (torch.compile): fused_moe's loop over the experts that received tokens
    cannot be traced, so the graph calls it as one opaque op (heterollm::fused_moe); decode steps then
    run compiled and give the eager tokens and logprobs."""
    folder = build_tiny_model(tmp_path / "mixtral", "mixtral")
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    results = []
    for flags in ({}, {"enable_graph": True}):
        llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64, **flags)
        outs = llm.generate(prompts, params)
        results.append(([o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs],
                        llm.engine.executor.runner.graph_runner.num_replays))
        llm.shutdown()
    (eager_tokens, eager_lps, eager_replays), (tokens, lps, replays) = results
    assert eager_replays == 0 and replays >= 7, "the decode steps ran compiled"
    assert tokens == eager_tokens == hf_greedy(folder, prompts, 8)
    assert lps == pytest.approx(eager_lps, abs=1e-4)
