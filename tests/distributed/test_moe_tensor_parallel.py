"""Tensor parallelism for a mixture-of-experts family on CPU (gloo), one spawned worker per rank:
Qwen2-MoE with tp_size=2 (each expert's and the shared expert's intermediate dimension split over
the ranks, one all-reduce per block) gives tp_size=1's greedy tokens and logprobs. One family only:
the three share the sharded experts (tests/models/test_moe.py checks each family's shards load)."""
from __future__ import annotations

import pytest

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams

FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=256)
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


def run(folder, **flags):
    llm = LLM(str(folder), **FLAGS, **flags)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


def test_qwen2_moe_tp2_equals_tp1(tmp_path):
    folder = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe", mlp_only_layers=[1])  # a dense layer too
    tokens1, lps1 = run(folder)
    tokens2, lps2 = run(folder, tp_size=2)
    assert tokens2 == tokens1
    assert lps2 == pytest.approx(lps1, abs=1e-4)
