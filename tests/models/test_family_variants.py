"""Config variants of the registered families, each against transformers on a tiny random model:
Llama 3.x rope scaling (rope_type "llama3"), Mistral's sliding window (every layer) and Qwen2's
(`use_sliding_window`: the layers `layer_types` marks). Greedy tokens identical and logprobs within
1e-3 (fp32), through chunked prefill over cached context, tiny blocks and preemption, where a
window shorter than the prompts changes the answer."""
from __future__ import annotations

import pytest

from helpers import build_tiny_model, hf_greedy, hf_logprobs
from heterollm import LLM, SamplingParams
from heterollm.plugins.resolver import LaunchError

PROMPTS = [[1, 20, 30, 40, 50], list(range(100, 137)), [7, 7, 7], list(range(500, 700, 3))]
NEW = 24
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE, "head_dim": 16}),
    "mistral_sliding_window": ("mistral", {"sliding_window": 8}),
    "qwen2_sliding_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "phi3_partial_rotary_sliding_window": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 8}),
    "gemma2": ("gemma2", {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0}),
    "gemma3_text": ("gemma3", {"sliding_window": 8, "sliding_window_pattern": 2, "head_dim": 16,
                               "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0,
                               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1000000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10000.0}}}),
}
MODES = {
    "default": {},
    "small_chunks": {"max_tokens_per_chunk_for_prefill": 8, "max_tokens_per_batch": 24},
    "no_mix_small_chunks": {"enable_mix_batch": False, "max_tokens_per_chunk_for_prefill": 5},
    "block_size_3": {"block_size": 3},
    "preemption": {"block_size": 4, "num_gpu_blocks_override": 40},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    return request.param, folder, hf_greedy(folder, PROMPTS, NEW)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_matches_transformers(variant, mode):
    name, folder, expected = variant
    flags = {"dtype": "float32", "block_size": 16, "num_gpu_blocks_override": 128, **MODES[mode]}
    outs = LLM(str(folder), **flags).generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected, f"{name} / {mode}"


def test_logprobs_match_transformers(variant):
    name, folder, _ = variant
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=128,
              max_tokens_per_chunk_for_prefill=16)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(folder, prompt + gen)
        for j, lp in enumerate(out.outputs[0].logprobs):
            assert lp.token_id == gen[j] and abs(lp.logprob - ref[len(prompt) - 1 + j][gen[j]].item()) < 1e-3, name
        for pos in range(1, len(prompt)):
            assert abs(out.prompt_logprobs[pos].logprob - ref[pos - 1][prompt[pos]].item()) < 1e-3, name


def test_an_attention_without_sliding_window_is_refused_at_launch(tmp_path):
    """The out-of-tree `example` attention does not declare sliding-window support: the launch says so."""
    folder = build_tiny_model(tmp_path / "m", "mistral", sliding_window=8)
    with pytest.raises(LaunchError) as err:
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, extension_impl="example")
    msg = str(err.value)
    assert "sliding window of 8 tokens" in msg and "example" in msg and "\n" not in msg


def test_an_attention_without_score_capping_is_refused_at_launch(tmp_path):
    folder = build_tiny_model(tmp_path / "m", "gemma2", sliding_window=8, head_dim=16, attn_logit_softcapping=2.0)
    with pytest.raises(LaunchError) as err:
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, extension_impl="example")
    assert err.value.reasons[1].startswith("--model: the checkpoint caps attention scores (attn_logit_softcapping=2.0)")
