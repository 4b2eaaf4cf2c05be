"""Scheduling features against their own off switch, same requests, same run, one table each.

    python bench/scheduling.py                          # SmolLM2-135M, both parts
    python bench/scheduling.py --part overlap --num-requests 16 --output-len 16   # a smoke test

overlap   --enable_schedule_overlap off vs on: --num-requests x (--prompt-len in, --output-len
          out) greedy requests submitted at once (offline LLM.generate); wall time, output tok/s,
          and whether every request's tokens equal the run without overlap.
latency   --enable_latency_aware_schedule off vs on (--max_global_tpot_ms --tpot-ms): --streams
          short requests decode (32-token prompts, --stream-len tokens each) while a --long-len
          token prompt arrives every --every seconds (--num-long of them, 16 tokens each). The
          short requests' inter-token times (p50, p99, max: the TPOT their users see) and the long
          prompts' TTFT. "off" prefills each long prompt in one step (chunks of
          --max_tokens_per_batch); "on" cuts it to what keeps the predicted step under the target.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import common


def run_overlap(args, LLM, SamplingParams) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    rows, reference = [], None
    for overlap in (False, True):
        llm = LLM(args.model, enable_schedule_overlap=overlap)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        toks = [o.outputs[0].token_ids for o in outs]
        reference = reference or toks
        rows.append({"config": "overlap" if overlap else "plain", "wall_s": wall,
                     "out_tok_s": sum(map(len, toks)) / wall, "same": sum(a == b for a, b in zip(toks, reference))})
        llm.shutdown()
        del llm
        gc.collect()
    for r in rows:
        r["x"] = r["out_tok_s"] / rows[0]["out_tok_s"]
    common.print_table(
        f"--enable_schedule_overlap: {args.num_requests} x ({args.prompt_len} in, {args.output_len} out), greedy, "
        "submitted at once", rows,
        [("config", "config", 0), ("wall_s", "wall s", 2), ("out_tok_s", "out tok/s", 1),
         ("same", f"same/{args.num_requests}", 0), ("x", "x tput", 2)])


def drive(llm, args, SamplingParams) -> dict:
    """Short streams decode; long prompts arrive on a clock. Returns the row's figures."""
    rng = random.Random(1)
    engine = llm.engine
    short = SamplingParams(max_tokens=args.stream_len, temperature=0, ignore_eos=True)
    longp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request([rng.randrange(1000, 40000) for _ in range(32)], short, request_id=f"s{i}")
    last: dict[str, float] = {}
    gaps: list[float] = []
    ttft: list[float] = []
    arrivals = 0
    t0 = time.perf_counter()
    while engine.has_unfinished() or arrivals < args.num_long:
        if arrivals < args.num_long and time.perf_counter() - t0 >= args.every * (arrivals + 1):
            engine.add_request([rng.randrange(1000, 40000) for _ in range(args.long_len)], longp,
                               request_id=f"long{arrivals}")
            arrivals += 1
        now_outs = engine.step()
        now = time.perf_counter()
        for o in now_outs:
            if o.request_id.startswith("s"):
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
            elif o.finished:
                ttft.append(o.metrics.ttft)
    gaps.sort()
    return {"tpot_p50_ms": 1000 * statistics.median(gaps), "tpot_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))],
            "tpot_max_ms": 1000 * gaps[-1], "ttft_long_ms": 1000 * statistics.mean(ttft),
            "wall_s": time.perf_counter() - t0}


def run_latency(args, LLM, SamplingParams) -> None:
    rows = []
    for on in (False, True):
        flags = {"enable_latency_aware_schedule": True, "max_global_tpot_ms": args.tpot_ms} if on else {}
        llm = LLM(args.model, **flags)
        row = drive(llm, args, SamplingParams)
        row["config"] = f"on ({args.tpot_ms} ms)" if on else "off"
        if on:
            row["held"] = llm.engine.scheduler.latency.num_held
            print(llm.engine.scheduler.latency.model.describe())
        rows.append(row)
        llm.shutdown()
        del llm
        gc.collect()
    common.print_table(
        f"--enable_latency_aware_schedule: {args.streams} streams decoding {args.stream_len} tokens while "
        f"{args.num_long} prompts of {args.long_len} tokens arrive, one every {args.every} s", rows,
        [("config", "config", 0), ("tpot_p50_ms", "stream TPOT p50 ms", 0), ("tpot_p99_ms", "p99 ms", 0),
         ("tpot_max_ms", "max ms", 0), ("ttft_long_ms", "long prompt TTFT ms", 0), ("held", "chunks cut/held", 0),
         ("wall_s", "wall s", 1)],
        notes=["TPOT: time between a stream's consecutive tokens, over all streams and steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--part", default="overlap,latency")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-len", type=int, default=96)
    ap.add_argument("--long-len", type=int, default=1536)
    ap.add_argument("--num-long", type=int, default=3)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--tpot-ms", type=int, default=120)
    args = ap.parse_args()
    from heterollm import LLM, SamplingParams

    parts = args.part.split(",")
    if "overlap" in parts:
        run_overlap(args, LLM, SamplingParams)
    if "latency" in parts:
        run_latency(args, LLM, SamplingParams)


if __name__ == "__main__":
    main()
