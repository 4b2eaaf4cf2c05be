"""Offline throughput: heterollm vs transformers' `generate`, same weights, same run.

    python bench/throughput.py                       # SmolLM2-135M, 64 x (128 in, 128 out), greedy
    python bench/throughput.py --num-requests 16 --dtype float32

--dtype auto (the default) is what `heterollm generate/serve` picks: bf16 on a CPU that supports
it, else float32. transformers runs in the same resolved dtype.

Both engines get identical random prompts (fixed seed) and generate exactly --output-len tokens
(EOS ignored). transformers runs the whole batch in one `generate` call (all prompts have the
same length, so no padding is involved). Prints tokens/s for each and the ratio."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--hf-batch-size", type=int, default=0, help="0: all requests in one generate call")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from heterollm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (args.num_requests, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    dtype = llm.engine.dtype
    result = {"model": args.model, "dtype": str(dtype).removeprefix("torch."), "requests": args.num_requests,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "threads": torch.get_num_threads(),
              "heterollm_s": round(ours_s, 2), "heterollm_out_tok_s": round(generated / ours_s, 1)}
    print(f"heterollm     {generated} tokens in {ours_s:7.2f}s = {generated / ours_s:8.1f} output tok/s")

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        src = llm.engine.source
        if src.gguf_file is not None:
            hf = AutoModelForCausalLM.from_pretrained(str(src.folder), gguf_file=src.gguf_file.name, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(src.folder), dtype=dtype)
        hf.eval()
        llm.shutdown()
        bs = args.hf_batch_size or args.num_requests
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf.generate(ids[:2], max_new_tokens=4, do_sample=False, min_new_tokens=4, pad_token_id=0)
            t = time.perf_counter()
            hf_tokens = 0
            for i in range(0, len(prompts), bs):
                out = hf.generate(ids[i:i + bs], attention_mask=torch.ones_like(ids[i:i + bs]),
                                  max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                  do_sample=False, pad_token_id=0)
                hf_tokens += (out.shape[1] - args.prompt_len) * out.shape[0]
            hf_s = time.perf_counter() - t
        print(f"transformers  {hf_tokens} tokens in {hf_s:7.2f}s = {hf_tokens / hf_s:8.1f} output tok/s")
        ratio = (generated / ours_s) / (hf_tokens / hf_s)
        print(f"ratio heterollm / transformers = {ratio:.2f}x")
        result.update({"transformers_s": round(hf_s, 2), "transformers_out_tok_s": round(hf_tokens / hf_s, 1),
                       "ratio": round(ratio, 2)})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
