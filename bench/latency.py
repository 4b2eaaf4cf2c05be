"""Single-stream latency on CPU, side by side: heterollm (bf16, wint8, wint4) vs transformers,
llama.cpp and vLLM, same prompt, same run, one table.

    python bench/latency.py                          # SmolLM2-135M: 128 random prompt tokens -> 128 out
    python bench/latency.py --peers transformers     # skip llama.cpp and vLLM
    python bench/latency.py --configs bf16 --peers '' --output-len 4   # a smoke test

One prompt of --prompt-len random token ids (fixed seed), --output-len tokens, greedy, EOS ignored,
batch 1. Per row: TTFT (time to the first token), TPOT = (e2e - TTFT) / (n - 1), decode tok/s =
1 / TPOT, each the best of --repeats runs after a warm-up on other tokens; "x" is heterollm bf16's
decode tok/s over the row's (> 1: heterollm bf16 is faster); "agree" is how many of the row's
tokens match heterollm bf16's from the start.

  heterollm   in-process, one config after the other (LLM(model, quantization=...), shutdown between);
              TTFT and e2e from RequestOutput.metrics.
  transformers `generate` (batch 1) on the same GGUF, dequantized to the same dtype; TTFT from a streamer.
  llama.cpp   llama-cpp-python on the Q4_1 GGUF itself, 2 threads (bench/peer_llamacpp.py, its own venv).
  vLLM        vLLM's CPU build, bf16 (bench/peer_vllm.py, its own venv; ~110 s to start).
Peers come from `bash bench/peers.sh`; a missing one is named and its row skipped.

For each heterollm quantization it also prints the greedy answer to the chat prompt --question and
the drift of the chosen tokens' logprobs against the bf16 run: max / mean |delta| over the common
prefix of the random-prompt run (logprobs=0), and teacher-forced over all --output-len positions
(the bf16 run's tokens appended to the prompt, prompt_logprobs=0, both models in the same prefill
path), which does not stop at the first token where greedy decoding diverges.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

import common

QUANT = {"bf16": None, "auto": None, "wint8": "wint8", "wint4": "wint4", "w8a8": "w8a8"}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_heterollm(model: str, config: str, dtype: str, prompt: list[int], warm: list[int], chat: list[dict],
                  output_len: int, repeats: int, ref_tokens: list[int] | None) -> tuple[dict, dict]:
    from heterollm import LLM, SamplingParams

    base, _, graph = config.partition("+")
    flags = {"dtype": dtype, "enable_graph": bool(graph)}
    if QUANT[base]:
        flags["quantization"] = QUANT[base]
    t = time.perf_counter()
    llm = LLM(model, **flags)
    load_s = time.perf_counter() - t
    resolved = str(llm.engine.dtype).removeprefix("torch.")
    label = f"heterollm {resolved if QUANT[base] is None else QUANT[base]}" + (" --enable_graph" if graph else "")
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    runs = []
    for _ in range(repeats):
        o = llm.generate(prompt, sp)[0]
        m = o.metrics
        runs.append({"ttft": m.ttft, "e2e": m.finished_time - m.arrival_time, "n": len(o.outputs[0].token_ids)})
    # logprobs in a run of their own: the timed runs stay free of the extra softmax
    lp = llm.generate(prompt, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, logprobs=0))[0]
    # teacher-forced: the logprobs this model gives the reference's generated tokens (one prefill, every
    # position, whatever this model would have chosen itself)
    forced = ref_tokens if ref_tokens is not None else list(lp.outputs[0].token_ids)
    tf = llm.generate(prompt + forced, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    answer = llm.chat(chat, SamplingParams(max_tokens=32, temperature=0))[0]
    row_bytes = bytes_per_token(llm)
    ctx = {"source": llm.engine.source, "tokenizer": llm.get_tokenizer(),
           "chat_ids": list(llm.engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True))}
    row = _timing_row(label, runs)
    row.update({"weights": f"{resolved}" + (f" {QUANT[base]}" if QUANT[base] else ""), "load_s": load_s,
                "token_ids": list(lp.outputs[0].token_ids),
                "logprobs": [t.logprob for t in (lp.outputs[0].logprobs or [])],
                "forced_logprobs": [t.logprob for t in tf.prompt_logprobs[len(prompt):]],
                "answer": answer.outputs[0].text, "config": config, "bytes_per_token": row_bytes})
    llm.shutdown()
    del llm
    gc.collect()
    return row, ctx


def bytes_per_token(llm) -> int:
    """The weight bytes one decode step reads: every prepared weight (the runner's weight_bytes), less
    the input embedding's table when the output projection has its own prepared copy (a tied
    embedding keeps its float table for the lookup, which reads one row per token). A dense model's
    figure: a mixture of experts reads only its routed experts, so its bound would be set too low."""
    from heterollm.model_executor.layers import ParallelLMHead, VocabParallelEmbedding

    runner = llm.engine.executor.runner
    total = runner.weight_bytes
    model = runner.model
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    if heads and heads[0].method is not None:
        for m in model.modules():
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead):
                total -= m.weight.numel() * m.weight.element_size()
    return total


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """This machine's memory bandwidth with torch's threads, best of `repeats`: `read` sums a
    `mib` MiB fp32 buffer (the weights' traffic in decode: read only), `copy` copies it (read + write
    counted)."""
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        best_copy = min(best_copy, time.perf_counter() - t)
    return {"read_gb_s": a.nbytes / best_read / 1e9, "copy_gb_s": 2 * a.nbytes / best_copy / 1e9}


def _timing_row(label: str, runs: list[dict]) -> dict:
    ttft = min(r["ttft"] for r in runs)
    tpots = [(r["e2e"] - r["ttft"]) / (r["n"] - 1) for r in runs if r["n"] > 1]
    tpot = min(tpots) if tpots else None
    return {"engine": label, "ttft_ms": 1000 * ttft, "tpot_ms": 1000 * tpot if tpot else None,
            "decode_tok_s": 1 / tpot if tpot else None, "runs": runs}


def run_transformers(src, dtype: torch.dtype, prompt: list[int], warm: list[int], chat_ids: list[int],
                     output_len: int, repeats: int, packed: bool) -> dict:
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        """generate() puts the prompt first, then each new token: note when the first new one arrives."""

        def __init__(self) -> None:
            self.calls, self.first = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    t = time.perf_counter()
    hf, weights = common.load_transformers(src, dtype, packed)
    load_s = time.perf_counter() - t
    ids = torch.tensor([prompt])
    kw = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    runs, out = [], None
    with torch.no_grad():
        w = torch.tensor([warm])
        hf.generate(w, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                    attention_mask=torch.ones_like(w))
        for _ in range(repeats):
            s = FirstToken()
            t = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, streamer=s, **kw)
            e2e = time.perf_counter() - t
            runs.append({"ttft": (s.first or time.perf_counter()) - t, "e2e": e2e, "n": out.shape[1] - len(prompt)})
        c = torch.tensor([chat_ids])
        ans = hf.generate(c, max_new_tokens=32, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(c))
    row = _timing_row(f"transformers {str(dtype).removeprefix('torch.')}", runs)
    row.update({"weights": weights, "load_s": load_s,
                "token_ids": out[0, len(prompt):].tolist(), "answer_ids": ans[0, len(chat_ids):].tolist()})
    del hf
    gc.collect()
    return row


def peer_row(name: str, label: str, weights: str, prompt: list[int], chat_ids: list[int], output_len: int,
             extra: list[str]) -> dict | None:
    r = common.run_peer(name, [prompt], output_len, extra=extra, answer_prompt=chat_ids)
    if r is None:
        return None
    tpot = r.get("tpot_s")
    return {"engine": f"{label} {r.get('version', '')}".strip(), "weights": weights, "ttft_ms": 1000 * r["ttft_s"],
            "tpot_ms": 1000 * tpot if tpot else None, "decode_tok_s": r.get("decode_tok_s"),
            "prompt_eval_tok_s": r.get("prompt_eval_tok_s"), "load_s": r.get("load_s"),
            "token_ids": r.get("token_ids", []), "answer_ids": r.get("answer_token_ids"),
            "command": r.get("command"), "peer": r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row; the best is kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="heterollm's dtype (and transformers'); auto = what `heterollm serve` picks")
    ap.add_argument("--configs", default="bf16,wint8,wint4",
                    help="heterollm rows, comma list of bf16 (= --dtype), wint8, wint4, each optionally +graph "
                         "(--enable_graph); the first is the reference")
    ap.add_argument("--peers", default="transformers,llamacpp,vllm",
                    help="comma list of transformers, llamacpp, vllm ('' for none)")
    ap.add_argument("--hf-gguf-packed", action="store_true",
                    help="transformers keeps the GGUF blocks packed (its GGUF kernels) instead of a dense model")
    ap.add_argument("--question", default="What is the capital of Japan?")
    ap.add_argument("--vllm-enforce-eager", action="store_true",
                    help="vLLM without torch.compile (~30 s start instead of ~110 s, slower decode): smoke tests only")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    peers = [p.strip().replace("llama.cpp", "llamacpp") for p in args.peers.split(",") if p.strip()]
    for c in configs:
        base, plus, graph = c.partition("+")
        if base not in QUANT or (plus and graph != "graph"):
            ap.error(f"--configs: unknown {c!r} (bf16, wint8, wint4, w8a8, each optionally +graph)")
    for p in peers:
        if p not in ("transformers", "llamacpp", "vllm"):
            ap.error(f"--peers: unknown {p!r} (transformers, llamacpp, vllm)")
    if not configs:
        ap.error("--configs: at least one heterollm row is needed")

    g = torch.Generator().manual_seed(args.seed)
    vocab_hi = 49152 - 100  # SmolLM2's vocabulary; any model with >= 49152 tokens works
    prompt = torch.randint(100, vocab_hi, (args.prompt_len,), generator=g).tolist()
    warm = torch.randint(100, vocab_hi, (args.prompt_len,), generator=g).tolist()
    chat = [{"role": "user", "content": args.question}]

    rows: list[dict] = []
    ctx: dict = {}
    for c in configs:
        print(f"heterollm {c} ...", file=sys.stderr, flush=True)
        row, this = run_heterollm(args.model, c, args.dtype, prompt, warm, chat, args.output_len, args.repeats,
                                  rows[0]["token_ids"] if rows else None)
        rows.append(row)
        ctx = ctx or this  # the reference's: weights source, chat prompt ids, tokenizer
    ref = rows[0]
    dtype = getattr(torch, ref["weights"].split()[0])
    src, chat_ids, tok = ctx["source"], ctx["chat_ids"], ctx["tokenizer"]

    for p in peers:
        print(f"{p} ...", file=sys.stderr, flush=True)
        if p == "transformers":
            rows.append(run_transformers(src, dtype, prompt, warm, chat_ids, args.output_len, args.repeats,
                                         args.hf_gguf_packed))
        elif p == "llamacpp":
            r = peer_row("llamacpp", "llama.cpp", "Q4_1 GGUF", prompt, chat_ids, args.output_len,
                         ["--repeats", str(args.repeats)])
            if r:
                rows.append(r)
        elif p == "vllm":
            extra = ["--repeats", str(args.repeats)] + (["--enforce-eager"] if args.vllm_enforce_eager else [])
            r = peer_row("vllm", "vLLM", "bfloat16", prompt, chat_ids, args.output_len, extra)
            if r:
                r["engine"] += " (eager)" if args.vllm_enforce_eager else ""
                rows.append(r)

    for r in rows:
        if "answer_ids" in r and r["answer_ids"] is not None:
            r["answer"] = tok.decode(r["answer_ids"], skip_special_tokens=True)
        r["agree"] = common_prefix(ref["token_ids"], r.get("token_ids", []))
        r["agree_s"] = f"{r['agree']}/{args.output_len}"
        ok = ref.get("decode_tok_s") and r.get("decode_tok_s")
        r["x"] = ref["decode_tok_s"] / r["decode_tok_s"] if ok else None

    # logprob drift of each heterollm quantization against the reference run
    drift_lines = []
    for r in rows[1:len(configs)]:
        n = common_prefix(ref["token_ids"], r["token_ids"])
        d = [abs(a - b) for a, b in zip(ref["logprobs"][:n], r["logprobs"][:n])]
        f = [abs(a - b) for a, b in zip(ref["forced_logprobs"], r["forced_logprobs"])]
        r["logprob_drift_max"] = max(d) if d else None
        r["logprob_drift_mean"] = statistics.fmean(d) if d else None
        r["forced_drift_max"] = max(f) if f else None
        r["forced_drift_mean"] = statistics.fmean(f) if f else None
        drift_lines.append(f"  {r['engine']:<18} vs {ref['engine']}: same tokens for {n}/{args.output_len}; "
                           f"|delta logprob| over those: max {common.fmt(r['logprob_drift_max'], 4)} "
                           f"mean {common.fmt(r['logprob_drift_mean'], 4)}; teacher-forced on the reference's "
                           f"{len(f)} tokens: max {common.fmt(r['forced_drift_max'], 4)} "
                           f"mean {common.fmt(r['forced_drift_mean'], 4)}")

    # the memory-bandwidth bound of each heterollm row: weight bytes per token / the machine's read bandwidth
    bw = memory_bandwidth()
    for r in rows[:len(configs)]:
        bound = bw["read_gb_s"] * 1e9 / r["bytes_per_token"]
        r["bound_tok_s"], r["of_bound"] = bound, r["decode_tok_s"] / bound if r.get("decode_tok_s") else None
        r["of_bound_s"] = f"{100 * r['of_bound']:.0f}% of {bound:.0f}" if r["of_bound"] else "-"

    machine = common.machine_info(torch.__version__)
    cols = [("engine", "engine", 0), ("weights", "weights", 0), ("decode_tok_s", "decode tok/s", 1),
            ("ttft_ms", "TTFT ms", 1), ("tpot_ms", "TPOT ms", 2), ("x", f"x {ref['engine']}/row", 2),
            ("agree_s", "agree", 0), ("of_bound_s", "bandwidth bound", 0), ("load_s", "load s", 1)]
    per_token = ", ".join(f"{r['engine']} {r['bytes_per_token'] / 1e6:.0f} MB" for r in rows[:len(configs)])
    notes = [f"bandwidth bound: the weight bytes a decode step reads ({per_token}) at this machine's read "
             f"bandwidth ({bw['read_gb_s']:.1f} GB/s summing a 512 MiB buffer; copy {bw['copy_gb_s']:.1f} GB/s "
             f"read + write), torch threads {torch.get_num_threads()}",
             f"batch 1, {args.prompt_len} random prompt tokens (seed {args.seed}) -> {args.output_len} tokens, greedy, "
             f"EOS ignored; best of {args.repeats} runs after a warm-up; threads: torch {torch.get_num_threads()}",
             "agree: tokens equal to the reference row's from the start (llama.cpp computes on Q4_1 directly)"]
    pe = [r for r in rows if r.get("prompt_eval_tok_s")]
    notes += [f"{r['engine']}: prompt eval {r['prompt_eval_tok_s']:.1f} tok/s (llama.cpp's own counters)" for r in pe]
    notes.append(f"greedy answers to {args.question!r} (32 tokens at most):")
    notes += [f"  {r['engine']:<18} {r.get('answer', '')!r}" for r in rows if r.get("answer") is not None]
    if drift_lines:
        notes.append("logprob drift of the chosen tokens vs the reference (random-prompt run; teacher-forced: the "
                     "reference's tokens fed back as a prompt, prompt_logprobs, both rows in that same prefill path):")
        notes += drift_lines
    common.print_table("Single-stream latency (CPU)", rows, cols, notes, machine)
    if args.json:
        keep = ("engine", "weights", "decode_tok_s", "ttft_ms", "tpot_ms", "x", "agree", "load_s", "answer",
                "prompt_eval_tok_s", "logprob_drift_max", "logprob_drift_mean", "forced_drift_max", "forced_drift_mean",
                "runs", "command", "token_ids", "bytes_per_token", "bound_tok_s", "of_bound")
        common.write_json(args.json, {"args": vars(args), "command": common.command_line(), "machine": machine,
                                      "rows": [{k: r[k] for k in keep if k in r} for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
