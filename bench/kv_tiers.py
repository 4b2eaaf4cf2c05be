"""Time to first token on a long shared prefix that the device pool could not keep: recomputed, brought
back from the host KV tier, or fetched from the KV cache store by a second instance.

    python bench/kv_tiers.py                                 # SmolLM2-135M, 3,968-token prefix, 5 rounds
    python bench/kv_tiers.py --prefix-len 512 --rounds 2     # a smoke test

The pool is sized to one request (prefix + question + the first token), so every request evicts
the one before. Each setup first meets the prefix once; then each round runs a filler prompt of the
same length (other tokens: it evicts the prefix from the pool), a short two-token request (its steps
run the filler's pending moves, so they stay out of the timed request), then the timed request,
prefix + its own question, one greedy token. Every setup prefills in chunks of --chunk (2048) tokens,
so that no step completes more blocks than one Mooncake put request carries (64 MiB). Setups:

  recompute   no tier: the evicted prefix is computed again
  host        --host_blocks_factor F: evicted blocks are copied to host slots and back on the hit
  store       --enable_kvcache_store: instance A (a child process) computes the prefix and puts it in
              Mooncake's store (scripts/mooncake.sh starts mooncake_master on loopback) and stays up;
              instance B, another process, runs the rounds and fetches the prefix from the store

Per setup: TTFT p50 (and min, max) over the rounds, its ratio to recompute, the prompt tokens each
timed request found cached, the blocks it brought in and the bytes per block (every layer's K and V
of one block; a host-tier copy and a store value are that size).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import common

VOCAB = (1000, 40000)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def engine_flags(args: argparse.Namespace) -> dict:
    """The flags every setup shares: one request's worth of blocks in the pool."""
    need = args.prefix_len + args.question_len + 1
    blocks = -(-need // args.block_size)
    return {"block_size": args.block_size, "num_gpu_blocks_override": blocks, "max_model_len": blocks * args.block_size,
            "dtype": args.dtype, "max_tokens_per_chunk_for_prefill": args.chunk}


def run_rounds(llm, args: argparse.Namespace, prefix: list[int]) -> dict:
    """Warm up and meet the prefix once, then per round: filler, flush, the timed prefix request.
    TTFTs and what each hit. Every setup draws the same fillers and questions."""
    from heterollm import SamplingParams

    rng = random.Random(1)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    # two steps: a block committed after the step that computed it is put before the forward of the
    # second step after it (kv_cache/store_tier.py), so one step would leave the filler's puts pending
    flush_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([tokens(rng, 64)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    llm.generate([prefix + tokens(rng, args.question_len)], one)  # the prefix is known (store: fetched)
    before = llm.engine.stats()
    length = args.prefix_len + args.question_len
    ttfts, cached, first, flush = [], [], [], []
    for _ in range(args.rounds):
        llm.generate([tokens(rng, length)], one)  # evicts the prefix from the pool
        t = time.perf_counter()
        llm.generate([tokens(rng, 8)], flush_params)  # the steps carrying the filler's moves
        flush.append(time.perf_counter() - t)
        out = llm.generate([prefix + tokens(rng, args.question_len)], one)[0]
        ttfts.append(out.metrics.ttft)
        cached.append(out.metrics.num_cached_tokens)
        first.append(out.outputs[0].token_ids[0])
    stats = llm.engine.stats()
    return {"ttfts": ttfts, "cached": cached, "first": first, "flush": flush,
            "bytes_per_block": llm.engine.kv_plan.bytes_per_block, "num_blocks": llm.engine.num_blocks,
            "max_model_len": llm.engine.max_model_len,
            "host_tier_blocks": stats["host_tier_blocks"],  # the counters below: over the rounds only
            **{k: stats[k] - before[k] for k in ("prefix_hits", "prefix_host_hits", "host_tier_saved",
                                                 "host_tier_loaded", "prefix_store_hits", "store_put_blocks",
                                                 "store_fetched_blocks")}}


def run_local(args: argparse.Namespace, prefix: list[int], **flags) -> dict:
    from heterollm import LLM

    llm = LLM(args.model, **engine_flags(args), **flags)
    try:
        return run_rounds(llm, args, prefix)
    finally:
        llm.shutdown()
        del llm
        gc.collect()


STORE_FLAGS = ("enable_kvcache_store", "store_master_server_address", "store_metadata_server")


def run_store(args: argparse.Namespace, prefix: list[int]) -> dict:
    """Start a master; instance A (a child process) puts the prefix and stays up, since its blocks
    live in the memory it mounted; instance B (another child) runs the rounds; then both go, then
    the master (a client whose master went first retries for a while at exit)."""
    script = str(common.ROOT / "scripts" / "mooncake.sh")
    folder = tempfile.mkdtemp(prefix="heterollm-bench-mooncake-")
    started = subprocess.run([script, "start", "--dir", folder], capture_output=True, text=True, timeout=60)
    if started.returncode != 0:
        raise SystemExit(f"scripts/mooncake.sh start failed: {started.stderr.strip()}")
    master, metadata = started.stdout.split()
    spec = json.dumps({**vars(args), **dict(zip(STORE_FLAGS, (True, master, metadata)))})
    child = [sys.executable, __file__, "--store-child", spec, "--prefix", json.dumps(prefix)]
    log = open(f"{folder}/instance_a.log", "w")
    a = subprocess.Popen([*child, "--role", "put"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                         text=True)
    try:
        ready = next((x for x in a.stdout if x.startswith("READY ")), None)
        if ready is None:
            raise SystemExit(f"instance A failed (log: {folder}/instance_a.log)")
        b = subprocess.run([*child, "--role", "rounds"], capture_output=True, text=True, timeout=3600)
        line = [x for x in b.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"instance B failed:\n{b.stderr[-3000:]}")
        result = json.loads(line[0][len("RESULT "):])
        result["a_put_blocks"] = int(ready.split()[1])
        return result
    finally:
        a.stdin.close()
        a.wait(timeout=120)
        log.close()
        subprocess.run([script, "stop", "--dir", folder], timeout=60)


def store_child(spec: str, prefix: str, role: str) -> None:
    """Instance A (`put`): compute the prefix, put it, wait for stdin to close. Instance B
    (`rounds`): the rounds, fetching the prefix from the store."""
    from heterollm import LLM, SamplingParams

    opts = json.loads(spec)
    args = argparse.Namespace(**opts)
    llm = LLM(args.model, **engine_flags(args), **{k: opts[k] for k in STORE_FLAGS})
    try:
        if role == "rounds":
            print("RESULT " + json.dumps(run_rounds(llm, args, json.loads(prefix))), flush=True)
            return
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate([json.loads(prefix) + tokens(random.Random(7), args.question_len)], one)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))  # the steps that put its blocks
        print(f"READY {llm.engine.stats()['store_put_blocks']}", flush=True)
        sys.stdin.read()
    finally:
        llm.shutdown()


def row(name: str, r: dict, base: dict | None, args: argparse.Namespace) -> dict:
    ms = [1000 * t for t in r["ttfts"]]
    blocks_in = {"recompute": 0, "host": r["host_tier_loaded"], "store": r["store_fetched_blocks"]}[name]
    return {"setup": name, "p50": statistics.median(ms), "min": min(ms), "max": max(ms),
            "x": (statistics.median([1000 * t for t in base["ttfts"]]) / statistics.median(ms)) if base else 1.0,
            "cached": statistics.median(r["cached"]), "blocks_in": blocks_in / args.rounds,
            "mib_in": blocks_in / args.rounds * r["bytes_per_block"] / 2**20, "kib_block": r["bytes_per_block"] / 1024,
            "flush": 1000 * statistics.median(r["flush"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix-len", type=int, default=3968, help="shared prefix tokens (31 blocks of 128)")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--host-blocks-factor", type=float, default=4.0)
    ap.add_argument("--chunk", type=int, default=2048,
                    help="--max_tokens_per_chunk_for_prefill, every setup: a step's store puts are one put_batch, "
                         "which Mooncake refuses whole past its 64 MiB client buffer (21 SmolLM2 blocks of 128)")
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where the CPU has it), float32, bfloat16")
    ap.add_argument("--setups", default="recompute,host,store")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--store-child", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.store_child:
        store_child(args.store_child, args.prefix, args.role)
        return

    # a registry of KV reservations of our own: other heterollm processes on a shared host must not
    # leave the instances here without room (the pool is sized explicitly anyway)
    os.environ.setdefault("HETEROLLM_CACHE_DIR", tempfile.mkdtemp(prefix="heterollm-bench-cache-"))
    prefix = tokens(random.Random(0), args.prefix_len)
    results = {}
    for name in args.setups.split(","):
        if name == "recompute":
            results[name] = run_local(args, prefix)
        elif name == "host":
            results[name] = run_local(args, prefix, host_blocks_factor=args.host_blocks_factor)
        elif name == "store":
            results[name] = run_store(args, prefix)
        else:
            raise SystemExit(f"unknown setup {name!r} (recompute, host, store)")
    base = results.get("recompute")
    rows = [row(name, r, base, args) for name, r in results.items()]
    firsts = {name: r["first"] for name, r in results.items()}
    any_r = next(iter(results.values()))
    host, store = results.get("host", {}), results.get("store", {})
    common.print_table(
        f"TTFT of a {args.prefix_len}-token shared prefix + {args.question_len} own tokens, evicted from a "
        f"{any_r['num_blocks']}-block pool ({args.block_size} slots) before each of {args.rounds} rounds, 1 greedy token",
        rows, [("setup", "setup", 0), ("p50", "TTFT p50 ms", 0), ("min", "min ms", 0), ("max", "max ms", 0),
               ("x", "x recompute", 2), ("cached", "tokens cached", 0), ("blocks_in", "blocks in", 0),
               ("mib_in", "MiB in", 1), ("kib_block", "KiB/block", 0), ("flush", "flush step ms", 0)],
        notes=["x recompute: recompute's TTFT p50 over the row's (> 1: faster)",
               "blocks in / MiB in: per timed request, copied back from the host tier or fetched from the store",
               "flush step: the two-token request after each filler, whose steps run the filler's pending "
               "moves (store: the filler's puts; host: the one block it evicts)",
               f"host: --host_blocks_factor {args.host_blocks_factor} ({host.get('host_tier_blocks')} slots); over "
               f"the rounds {host.get('host_tier_saved')} blocks saved, {host.get('host_tier_loaded')} loaded; the "
               "timed request's step also saves the filler's evicted blocks before loading the prefix",
               f"store: instance A put {store.get('a_put_blocks')} blocks; over the rounds instance B fetched "
               f"{store.get('store_fetched_blocks')} and put {store.get('store_put_blocks')}",
               f"first tokens: {firsts}",
               f"max_model_len {any_r['max_model_len']}, prefill chunks of {args.chunk} tokens"])
    common.write_json(args.json, {"machine": common.machine_info(), "results": results, "rows": rows,
                                  "args": vars(args)})


if __name__ == "__main__":
    main()
