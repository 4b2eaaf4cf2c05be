"""Shared-prefix workload: the prefix cache on vs off, same requests, same run, one table.

    python bench/prefix_cache.py                       # SmolLM2-135M: 64 requests, 1,000-token shared system prompt
    python bench/prefix_cache.py --requests 8 --system-len 200 --output-len 4   # a smoke test

Every request is the same --system-len random-token "system prompt" followed by its own
--question-len random tokens, then --output-len greedy tokens (EOS ignored). All requests are
submitted at once (offline `LLM.generate`), once per configuration:

  off        --noenable_prefix_cache: every request computes the system prompt
  on         --enable_prefix_cache (the default): blocks computed in one step are shared from the next
  in-batch   also --enable_in_batch_prefix_cache: blocks a prefill completes are shared in the same step

Per row: wall time, output tok/s, mean and p50 TTFT (arrival to first token), prompt tokens
served from the cache, and the ratios to "off". The greedy tokens of every row are checked equal
to "off" (the "same" column).
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import common

CONFIGS = {
    "off": {"enable_prefix_cache": False},
    "on": {"enable_prefix_cache": True},
    "in-batch": {"enable_prefix_cache": True, "enable_in_batch_prefix_cache": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--configs", default="off,on,in-batch")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32, bfloat16")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from heterollm import LLM, SamplingParams

    rng = random.Random(0)
    system = [rng.randrange(1000, 40000) for _ in range(args.system_len)]
    prompts = [system + [rng.randrange(1000, 40000) for _ in range(args.question_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)

    rows, reference = [], None
    for name in args.configs.split(","):
        llm = LLM(args.model, block_size=args.block_size, dtype=args.dtype, **CONFIGS[name])
        llm.generate([[rng.randrange(1000, 40000) for _ in range(64)]], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        toks = [o.outputs[0].token_ids for o in outs]
        reference = reference or toks
        ttfts = [o.metrics.ttft for o in outs]
        rows.append({"config": name, "wall_s": wall, "out_tok_s": sum(map(len, toks)) / wall,
                     "ttft_mean_ms": 1000 * statistics.mean(ttfts), "ttft_p50_ms": 1000 * statistics.median(ttfts),
                     "cached": sum(o.metrics.num_cached_tokens for o in outs) / sum(map(len, prompts)),
                     "same": sum(t == r for t, r in zip(toks, reference)),
                     "first_diff": min((next(i for i, (a, b) in enumerate(zip(t + [-1], r + [-2])) if a != b)
                                        for t, r in zip(toks, reference) if t != r), default=None)})
        llm.engine.shutdown()
        del llm
        gc.collect()
    base = rows[0]
    for r in rows:
        r["x_tput"] = r["out_tok_s"] / base["out_tok_s"]
        r["x_ttft"] = base["ttft_mean_ms"] / r["ttft_mean_ms"]
        r["cached"] = 100 * r["cached"]
    common.print_table(
        f"{args.requests} requests sharing a {args.system_len}-token system prompt (+{args.question_len} own tokens), "
        f"{args.output_len} greedy tokens each, all submitted at once",
        rows, [("config", "config", 0), ("wall_s", "wall s", 2), ("out_tok_s", "out tok/s", 1),
               ("ttft_mean_ms", "TTFT mean ms", 0), ("ttft_p50_ms", "TTFT p50 ms", 0),
               ("cached", "% prompt cached", 1), ("same", f"same/{args.requests}", 0),
               ("first_diff", "1st diff at", 0),
               ("x_tput", "x tput", 2), ("x_ttft", "x TTFT", 2)],
        notes=[f"x tput / x TTFT: throughput over {base['config']}'s, {base['config']}'s mean TTFT over the row's "
               "(> 1: better)",
               f"same: greedy tokens equal to {base['config']}'s; 1st diff at: the earliest output position where "
               "one differs (in bf16 a cached prefix is summed in another order than a one-piece prefill, so "
               "near-ties may flip; float32 does not)"])
    common.write_json(args.json, {"machine": common.machine_info(), "rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
