"""Offline throughput: heterollm vs transformers' `generate` (and, with --peers, vLLM and llama.cpp),
same prompts, same run, one table.

    python bench/throughput.py                       # SmolLM2-135M, 64 x (128 in, 128 out), greedy
    python bench/throughput.py --peers vllm          # + vLLM's CPU build (bench/peers.sh vllm)
    python bench/throughput.py --peers vllm,llamacpp --json results.json
    python bench/throughput.py --num-requests 16 --dtype float32 --skip-hf
    python bench/throughput.py --configs bf16,w8a8,bf16+graph --skip-hf   # heterollm rows to run

--dtype auto (the default) is what `heterollm generate/serve` picks: bf16 on a CPU that supports
it, else float32. transformers runs in the same resolved dtype, on the same weights unpacked into a
dense model (--hf-gguf-packed: transformers' own packed-GGUF kernels instead).

Every engine gets identical random prompts (fixed seed, token ids) and generates exactly
--output-len tokens (EOS ignored), greedy. transformers runs the whole batch in one `generate` call
(all prompts have the same length, so no padding is involved). Peers, each in its own venv and
process, after heterollm has shut down:
  vllm      `LLM.generate` on all prompts at once, in heterollm's resolved dtype, prefix cache off (bench/peer_vllm.py;
            ~110 s to start, not counted)
  llamacpp  llama-cpp-python on the Q4_1 GGUF, one prompt after the other (it has no batching)
            (bench/peer_llamacpp.py)
A missing peer is named ("run bash bench/peers.sh X") and its row skipped.

Table: output tok/s over the timed run, mean per-request TTFT and TPOT where the engine reports
them, and heterollm's output tok/s over the row's (> 1: heterollm is faster)."""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import common


QUANT = {"bf16": None, "wint8": "wint8", "wint4": "wint4", "w8a8": "w8a8"}


def run_heterollm(args: argparse.Namespace, config: str) -> tuple[dict, list[list[int]], torch.dtype, object]:
    """One heterollm row (`bf16`, `w8a8+graph`, ...): load (timed, including the graph warm-up), a warm-up
    request, the timed run."""
    from heterollm import LLM, SamplingParams

    base, _, graph = config.partition("+")
    flags = {"quantization": QUANT[base]} if QUANT[base] else {}
    t = time.perf_counter()
    if args.profile_steps:
        flags["enable_profile_step_time"] = True
    llm = LLM(args.model, dtype=args.dtype, enable_graph=bool(graph), **flags)
    load_s = time.perf_counter() - t
    vocab = llm.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 100, (args.num_requests, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    dtype, src = llm.engine.dtype, llm.engine.source
    label = "heterollm" + (f" {QUANT[base]}" if QUANT[base] else "") + (" --enable_graph" if graph else "")
    print(f"{label:<13} {generated} tokens in {ours_s:7.2f}s = {generated / ours_s:8.1f} output tok/s", flush=True)
    weights = str(dtype).removeprefix("torch.") + (f" {QUANT[base]}" if QUANT[base] else "")
    row = {"engine": label, "weights": weights, "out_tok_s": generated / ours_s,
           "time_s": ours_s, "tokens": generated, "ttft_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
           "tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None, "load_s": load_s}
    llm.shutdown()
    return row, prompts, dtype, src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--hf-batch-size", type=int, default=0, help="0: all requests in one generate call")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers row")
    ap.add_argument("--hf-gguf-packed", action="store_true",
                    help="transformers keeps the GGUF blocks packed (its GGUF kernels) instead of a dense model")
    ap.add_argument("--peers", default="",
                    help="comma list of more engines: vllm, llamacpp (transformers runs unless --skip-hf)")
    ap.add_argument("--vllm-enforce-eager", action="store_true",
                    help="vLLM without torch.compile (~30 s start instead of ~110 s, slower): smoke tests only")
    ap.add_argument("--configs", default="bf16",
                    help="heterollm rows, comma-separated: bf16, wint8, wint4, w8a8 (--quantization), each "
                         "optionally +graph (--enable_graph); the first is the x column's reference")
    ap.add_argument("--graph", action="store_true",
                    help="a second heterollm row with --enable_graph (decode steps through torch.compile)")
    ap.add_argument("--profile-steps", action="store_true",
                    help="--enable_profile_step_time on the heterollm rows: every 50 steps, the mean ms of each "
                         "phase (schedule, prepare, forward, sample, output), decode and prefill steps apart")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    peers = [p.strip().replace("llama.cpp", "llamacpp") for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in ("transformers", "vllm", "llamacpp"):
            ap.error(f"--peers: unknown {p!r} (vllm, llamacpp)")
    peers = [p for p in peers if p != "transformers"]  # transformers: the default row, unless --skip-hf

    if args.profile_steps:
        import logging
        logging.basicConfig(format="%(message)s")
        logging.getLogger("heterollm.profile").setLevel(logging.INFO)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.graph and "bf16+graph" not in configs:
        configs.append("bf16+graph")
    for c in configs:
        base, plus, graph = c.partition("+")
        if base not in QUANT or (plus and graph != "graph"):
            ap.error(f"--configs: unknown {c!r} (bf16, wint8, wint4, w8a8, each optionally +graph)")
    if not configs:
        ap.error("--configs: at least one heterollm row is needed")

    rows, prompts, dtype, src = [], None, None, None
    for c in configs:
        row, prompts, dtype, src = run_heterollm(args, c)
        rows.append(row)
    dname = str(dtype).removeprefix("torch.")
    ours_s, generated = rows[0]["time_s"], rows[0]["tokens"]
    result = {"model": args.model, "dtype": dname, "requests": args.num_requests,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "threads": torch.get_num_threads(),
              "heterollm_s": round(ours_s, 2), "heterollm_out_tok_s": round(generated / ours_s, 1)}

    if not args.skip_hf:
        t = time.perf_counter()
        hf, weights = common.load_transformers(src, dtype, args.hf_gguf_packed)
        hf_load_s = time.perf_counter() - t
        bs = args.hf_batch_size or args.num_requests
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf.generate(ids[:2], max_new_tokens=4, do_sample=False, min_new_tokens=4, pad_token_id=0,
                        attention_mask=torch.ones_like(ids[:2]))
            t = time.perf_counter()
            hf_tokens = 0
            for i in range(0, len(prompts), bs):
                out = hf.generate(ids[i:i + bs], attention_mask=torch.ones_like(ids[i:i + bs]),
                                  max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                  do_sample=False, pad_token_id=0)
                hf_tokens += (out.shape[1] - args.prompt_len) * out.shape[0]
            hf_s = time.perf_counter() - t
        del hf
        print(f"transformers  {hf_tokens} tokens in {hf_s:7.2f}s = {hf_tokens / hf_s:8.1f} output tok/s", flush=True)
        ratio = (generated / ours_s) / (hf_tokens / hf_s)
        print(f"ratio heterollm / transformers = {ratio:.2f}x", flush=True)
        result.update({"transformers_s": round(hf_s, 2), "transformers_out_tok_s": round(hf_tokens / hf_s, 1),
                       "ratio": round(ratio, 2)})
        rows.append({"engine": f"transformers (batch {bs})", "weights": weights, "out_tok_s": hf_tokens / hf_s,
                     "time_s": hf_s, "tokens": hf_tokens, "load_s": hf_load_s})

    for p in peers:
        eager = p == "vllm" and args.vllm_enforce_eager
        # vLLM in heterollm's resolved dtype: the same GEMMs' precision (float32 on a CPU without native
        # bf16, where vLLM's bf16 would run torch's emulated bf16 GEMM: measured 6x slower on AVX2)
        extra = ["--dtype", dname] + (["--enforce-eager"] if eager else []) if p == "vllm" else []
        r = common.run_peer(p, prompts, args.output_len, extra=extra)
        if r is None:
            continue
        label = {"vllm": "vLLM", "llamacpp": "llama.cpp (batch 1)"}[p] + (" (eager)" if eager else "")
        rows.append({"engine": f"{label} {r.get('version', '')}".strip(),
                     "weights": r.get("dtype", "bfloat16") if p == "vllm" else "Q4_1 GGUF", "out_tok_s": r["out_tok_s"],
                     "time_s": r["total_s"], "tokens": r["output_tokens"], "load_s": r.get("load_s"),
                     "ttft_ms": 1000 * r["mean_ttft_s"] if r.get("mean_ttft_s") else None,
                     "tpot_ms": 1000 * r["mean_tpot_s"] if r.get("mean_tpot_s") else None, "command": r["command"]})
        result[f"{p}_out_tok_s"] = round(r["out_tok_s"], 1)
        result[f"ratio_{p}"] = round((generated / ours_s) / r["out_tok_s"], 2)

    for r in rows:
        r["x"] = rows[0]["out_tok_s"] / r["out_tok_s"] if r["out_tok_s"] else None
    machine = common.machine_info(torch.__version__)
    cols = [("engine", "engine", 0), ("weights", "weights", 0), ("out_tok_s", "out tok/s", 1),
            ("ttft_ms", "TTFT ms", 1), ("tpot_ms", "TPOT ms", 2), ("x", "x heterollm/row", 2),
            ("time_s", "time s", 2), ("load_s", "load s", 1)]
    notes = [f"{args.num_requests} requests x ({args.prompt_len} random prompt tokens -> {args.output_len} tokens), "
             f"greedy, EOS ignored; one timed run after a warm-up; TTFT/TPOT: per-request means where the engine "
             f"reports them; torch threads {torch.get_num_threads()}"]
    common.print_table("Offline throughput (CPU)", rows, cols, notes, machine)
    result.update({"command": common.command_line(), "machine": machine, "rows": rows})
    common.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
