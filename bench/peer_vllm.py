"""vLLM (CPU build) on token-id prompts: the vLLM row of bench/throughput.py and bench/latency.py.

Runs INSIDE vLLM's own venv (bench/peers.sh vllm), never the project's; the other scripts start it:

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 \\
      $PEERS/vllm/bin/python bench/peer_vllm.py --model $PEERS/smollm2-hf \\
      --prompts-json F --max-tokens N --out OUT.json

F: {"prompts": [[token ids], ...], "answer_prompt": [token ids] | null}. Every prompt is generated
greedily (temperature 0) for exactly N tokens (EOS ignored), all in one `LLM.generate` call.
With a single prompt it also measures TTFT (the best of --repeats 1-token runs) and the decode
rate (N-1) / (e2e - TTFT), e2e the best of --repeats full runs. Prefix caching is off (heterollm
has none), so repeated runs of one prompt really prefill. answer_prompt (optional): generated
greedily up to 32 tokens, stopping at EOS, and returned as token ids (an answer check).

Writes OUT.json: load_s, total_s, output_tokens, out_tok_s, per-request ttft/tpot when vLLM reports
them, and for a single prompt ttft_s, e2e_s, decode_tok_s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _req_times(out) -> tuple[float | None, float | None]:
    """(TTFT, TPOT) in seconds of one vLLM RequestOutput, from its RequestStateStats when present."""
    m = getattr(out, "metrics", None)
    if m is None:
        return None, None
    ttft = getattr(m, "first_token_latency", None) or None
    first, last = getattr(m, "first_token_ts", 0.0), getattr(m, "last_token_ts", 0.0)
    n = len(out.outputs[0].token_ids)
    tpot = (last - first) / (n - 1) if n > 1 and first and last > first else None
    return ttft, tpot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the HF-format model folder ($PEERS/smollm2-hf)")
    ap.add_argument("--prompts-json", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs for a single prompt (the best is kept)")
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile: starts in ~30 s, decodes slower "
                    "(for smoke tests only)")
    ap.add_argument("--prefix-caching", action="store_true", help="leave vLLM's prefix cache on")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the weights' dtype: the callers pass heterollm's resolved one (float32 on a CPU "
                         "without native bf16, where vLLM's bf16 falls back to torch's emulated GEMM)")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.load(open(args.prompts_json))
    prompts: list[list[int]] = spec["prompts"]
    answer_prompt = spec.get("answer_prompt")

    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, enforce_eager=args.enforce_eager,
              enable_prefix_caching=args.prefix_caching, max_model_len=args.max_model_len,
              disable_log_stats=False)  # False: RequestOutput.metrics carries the per-request timings
    load_s = time.perf_counter() - t

    def params(n: int, ignore_eos: bool = True) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos)

    def gen(ps: list[list[int]], sp: SamplingParams):
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)

    # warm-up on other token ids than the measured prompts (nothing of theirs gets cached)
    warm = [[(x + 7) % 30000 + 100 for x in p] for p in prompts[:2]]
    gen(warm, params(4))

    result: dict = {"engine": "vllm", "version": vllm.__version__, "dtype": args.dtype,
                    "enforce_eager": args.enforce_eager, "prefix_caching": args.prefix_caching,
                    "load_s": round(load_s, 2), "requests": len(prompts), "max_tokens": args.max_tokens}
    t = time.perf_counter()
    outs = gen(prompts, params(args.max_tokens))
    total_s = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    times = [_req_times(o) for o in outs]
    ttfts = [a for a, _ in times if a is not None]
    tpots = [b for _, b in times if b is not None]
    result.update({"total_s": round(total_s, 3), "output_tokens": tokens, "out_tok_s": round(tokens / total_s, 2),
                   "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
                   "mean_tpot_s": statistics.fmean(tpots) if tpots else None,
                   "first_token_ids": list(outs[0].outputs[0].token_ids[:16])})

    if len(prompts) == 1:
        ttft_runs, e2e_runs = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            gen(prompts, params(1))
            ttft_runs.append(time.perf_counter() - t)
        e2e_runs.append(total_s)
        for _ in range(args.repeats - 1):
            t = time.perf_counter()
            o = gen(prompts, params(args.max_tokens))
            e2e_runs.append(time.perf_counter() - t)
        ttft, e2e = min(ttft_runs), min(e2e_runs)
        n = len(outs[0].outputs[0].token_ids)
        result.update({"ttft_s": ttft, "e2e_s": e2e, "ttft_runs_s": ttft_runs, "e2e_runs_s": e2e_runs,
                       "decode_tok_s": (n - 1) / (e2e - ttft) if e2e > ttft and n > 1 else None,
                       "tpot_s": (e2e - ttft) / (n - 1) if n > 1 else None,
                       "token_ids": list(outs[0].outputs[0].token_ids)})

    if answer_prompt:
        o = gen([answer_prompt], params(32, ignore_eos=False))[0]
        result["answer_token_ids"] = list(o.outputs[0].token_ids)
        result["answer_text"] = o.outputs[0].text

    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"vllm: {tokens} tokens in {total_s:.2f}s = {tokens / total_s:.1f} tok/s (load {load_s:.1f}s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a separate process: keep the guard
    sys.exit(main())
