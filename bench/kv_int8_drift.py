"""--kv_cache_dtype int8 against the bf16 KV cache on the real default model: logprob drift, token
agreement, and KV blocks per GiB.

    python bench/kv_int8_drift.py                        # SmolLM2-135M, bf16, 8 prompts x 64 greedy tokens
    python bench/kv_int8_drift.py --max-tokens 8         # a smoke test

Each prompt is decoded greedily (EOS ignored) once with each cache. Drift is measured on the chosen
tokens while both runs still agree (after a divergence the contexts differ): max and mean |logprob
difference|. Agreement: the share of generated tokens before each sequence's first divergence, and
how many sequences agree to the end. Blocks per GiB: the engine's block count for --max_cache_size
of 1 GiB. Wall time: the whole generate call, after a warm-up (the int8 cache runs the torch
attention path, not the C++ kernels).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import common

PROMPTS = [
    "The capital of Japan is",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):",
    "List three uses of a paperclip:",
    "Once upon a time, in a village at the edge of a forest,",
    "Translate to French: I would like a cup of coffee, please.",
    "The three laws of thermodynamics are",
]


def run(model: str, kv_cache_dtype: str, max_tokens: int) -> dict:
    from heterollm import LLM, SamplingParams

    llm = LLM(model, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_cache_size=2**30)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    try:
        llm.generate(PROMPTS[:1], params)  # warm-up: the first step's one-time costs stay out of the time
        started = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        wall = time.perf_counter() - started
        return {"blocks_per_gib": llm.engine.num_blocks, "block_size": llm.config.kv_cache.block_size,
                "bytes_per_block": llm.engine.executor.runner.kv_bytes_per_block(), "wall": wall,
                "outputs": [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]}
    finally:
        llm.shutdown()
        gc.collect()


def compare(ref: list, got: list) -> dict:
    drift, agreed, whole = [], 0, 0
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b), len(ref_ids))
        drift += [abs(a - b) for a, b in zip(ref_lps[:n], lps[:n])]
        agreed += n
        whole += n == len(ref_ids)
    total = sum(len(ids) for ids, _ in ref)
    return {"max": max(drift), "mean": statistics.fmean(drift), "agree": agreed / total, "whole": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    print(common.machine_line())
    runs = {kv: run(args.model, kv, args.max_tokens) for kv in ("auto", "int8")}
    stats = compare(runs["auto"]["outputs"], runs["int8"]["outputs"])
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} greedy tokens, {args.model}, dtype bfloat16")
    for kv, r in runs.items():
        print(f"  kv_cache_dtype={kv:5s} blocks per GiB {r['blocks_per_gib']:6d} ({r['block_size']} slots, "
              f"{r['bytes_per_block']} bytes per block)  generate {r['wall']:.2f} s")
    print(f"  blocks ratio int8 / bf16: {runs['int8']['blocks_per_gib'] / runs['auto']['blocks_per_gib']:.3f}")
    print(f"  |delta logprob| of the chosen tokens while agreeing: max {stats['max']:.4f}, mean {stats['mean']:.4f}")
    print(f"  token agreement: {stats['agree']:.1%} of generated tokens before the first divergence; "
          f"{stats['whole']}/{len(PROMPTS)} sequences identical to the end")


if __name__ == "__main__":
    main()
