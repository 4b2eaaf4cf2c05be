"""--kv_cache_dtype int8 end to end on the CPU backend: the greedy tokens of the float cache, logprobs
within LOGPROB_TOL of them, about twice the blocks in the same --max_cache_size, and the device
backends' descriptors still refusing it."""
from __future__ import annotations

import pytest
import torch

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams

PROMPTS = [[1, 20, 30, 40, 50], list(range(100, 137)), [7, 7, 7], list(range(500, 600, 3))]
NEW = 16
LOGPROB_TOL = 0.03
"""Largest |logprob difference| of a chosen token between the int8 and the fp32 cache (measured: at
most about 0.01 on these tiny random models)."""
NEAR_TIE = 2 * LOGPROB_TOL
"""A float run's step whose top two logprobs are closer than this may pick the other under int8: the
tiny random models' distributions are nearly flat (top two often within 0.01), so each sequence is
compared up to its first such step, which must lie past most of the generation."""


def _run(folder, **flags) -> list:
    """Greedy completions of PROMPTS with top-2 logprobs, prefilled in chunks of 16 (later chunks
    read the quantized context)."""
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=128,
              max_tokens_per_chunk_for_prefill=16, **flags)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2))
        caches = llm.engine.executor.runner.kv_caches
        assert {c.dtype for c in caches} == {torch.int8 if flags.get("kv_cache_dtype") == "int8" else torch.float32}
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_cache_gives_the_float_caches_greedy_tokens(tmp_path, family):
    folder = build_tiny_model(tmp_path / family, family)
    drift, compared = [], 0
    for ref, got in zip(_run(folder), _run(folder, kv_cache_dtype="int8")):
        for want, have in zip(ref.logprobs, got.logprobs):
            assert have.token_id == want.token_id or want.logprob - want.top[1][1] < NEAR_TIE, (family, compared)
            if have.token_id != want.token_id:
                break
            drift.append(abs(have.logprob - want.logprob))
            compared += 1
    assert compared >= 0.75 * NEW * len(PROMPTS), compared
    assert 0 < max(drift) < LOGPROB_TOL, max(drift)  # 0: the int8 run read a float cache


def test_int8_cache_holds_about_twice_the_blocks(tmp_path):
    """A bf16 model with head_dim 64: a row of 128 bytes becomes 64 int8 values and a 4-byte scale, so
    the same --max_cache_size holds 128 / 68 = 1.88 times the blocks (the engine's count, not a formula)."""
    folder = build_tiny_model(tmp_path / "llama", "llama", hidden_size=128, num_attention_heads=2,
                              num_key_value_heads=1)
    blocks = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(str(folder), dtype="bfloat16", block_size=16, max_cache_size=4 * 2**20,
                  kv_cache_dtype=kv_cache_dtype)
        blocks[kv_cache_dtype] = llm.engine.num_blocks
        llm.shutdown()
    assert blocks["auto"] > 100
    assert 1.8 < blocks["int8"] / blocks["auto"] <= 2, blocks


def test_the_device_backends_still_refuse_int8():
    """CUDA, NPU and MLU keep their reason in the descriptor (their attention stores the model dtype);
    the CPU descriptor no longer lists the flag."""
    from heterollm.config import load_config
    from heterollm.plugins.registry import get_registry
    from heterollm.plugins.resolver import unsupported_flags
    import heterollm_cpu

    config = load_config([], overrides={"model": "x", "kv_cache_dtype": "int8"}).config
    registry = get_registry()
    for name in ("cuda", "npu", "mlu"):
        [reason] = unsupported_flags(config, registry, [name])
        assert reason.startswith("--kv_cache_dtype=int8: ") and f"heterollm-{name}" in reason
    assert unsupported_flags(config, registry, ["cpu"]) == []
    assert "kv_cache_dtype" not in heterollm_cpu.BACKEND.unsupported


@pytest.mark.slow  # compiling the decode step: about 30 s on 2 cores
def test_compiled_decode_steps_read_the_int8_cache(tmp_path):
    """--enable_graph with an int8 cache: the compiled decode steps (the quantizing write is the
    backend's opaque op, the dequantizing gather traced) give the eager int8 run's tokens and logprobs,
    with no graph break."""
    from torch._dynamo.utils import counters

    folder = build_tiny_model(tmp_path / "llama", "llama")
    prompts = [[5, 6, 7], list(range(100, 130)), [9] * 4]

    def run(**flags):
        llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64, kv_cache_dtype="int8",
                  **flags)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
            return ([o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs],
                    llm.engine.executor.runner.graph_runner.num_replays)
        finally:
            llm.shutdown()

    eager_tokens, eager_lps, _ = run()
    counters.clear()
    tokens, lps, replays = run(enable_graph=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert replays >= 11 and tokens == eager_tokens
    assert lps == pytest.approx(eager_lps, abs=1e-4)
