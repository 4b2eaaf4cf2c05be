"""Prefill/decode disaggregation against one instance, on the same cores.

    python bench/pd.py                      # SmolLM2-135M, 2 cores: (a) MIX on both, (b) P on core 0 + D on core 1
    python bench/pd.py --long 24 --short 24 --concurrency 4 --long-len 1024 --short-len 64

A mixed load: long prompts that write few tokens (--long-len in, --long-out out) interleaved with
short chats (--short-len in, --short-out out), from --concurrency streaming clients. (a) one
`heterollm serve` (MIX) with every core; (b) a PREFILL and a DECODE instance, each pinned to half
the cores (taskset), behind `heterollm route`, once per --modes: PUSH (the prefill instance writes
into blocks the decode instance reserved) and PULL (the decode instance reads the prefill
instance's blocks), over Mooncake's transfer engine, TCP on loopback. Reports TTFT and TPOT
p50 / p99 per class, and the transfer time per block from the moving side's /metrics
(heterollm_kv_push_* on the PREFILL instance: what its answers waited for the writes after the
forwards, the layers pushed beside them; heterollm_kv_pull_* on the DECODE one: from the step that
started each pull to the step that saw it end).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import serving  # noqa: E402


CACHE = 2 << 30
"""KV cache bytes per PD instance (the MIX instance gets both shares): two instances on one host split
its memory budget, or the first would reserve all of it."""


def start(cmd: list[str], url: str, cores: str | None, threads: int, what: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    full = (["taskset", "-c", cores] if cores else []) + cmd
    print("starting:", " ".join(full), file=sys.stderr)
    proc = subprocess.Popen(full, env=env, stderr=sys.stderr)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{what} did not become healthy in 600 s")


def serve_cmd(model: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", model, "--host=127.0.0.1",
            f"--port={port}", "--uvicorn_log_level=warning", "--max_concurrent_requests=0", *extra]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


async def mixed_load(url: str, model: str, long_prompts, short_prompts, long_out: int, short_out: int,
                     concurrency: int) -> tuple[dict[str, list], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        await serving.one_request(client, url, model, short_prompts[0][:8], 2, {})  # warm-up
        gate = asyncio.Semaphore(concurrency)
        jobs = [("long", p, long_out) for p in long_prompts] + [("short", p, short_out) for p in short_prompts]
        random.Random(0).shuffle(jobs)

        async def one(kind, prompt, out):
            async with gate:
                return kind, await serving.one_request(client, url, model, prompt, out, {})

        start_t = time.perf_counter()
        done = await asyncio.gather(*(one(*j) for j in jobs))
        wall = time.perf_counter() - start_t
    by: dict[str, list] = {"long": [], "short": []}
    for kind, result in done:
        by[kind].append(result)
    return by, wall


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--long", type=int, default=12, help="long prompts")
    ap.add_argument("--short", type=int, default=24, help="short chats")
    ap.add_argument("--long-len", type=int, default=1024)
    ap.add_argument("--long-out", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--short-out", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--modes", default="PUSH,PULL", help="the transfer modes to run (b) with")
    ap.add_argument("--json")
    args = ap.parse_args()
    cores = os.cpu_count() or 2
    half = max(cores // 2, 1)
    first, second = f"0-{half - 1}" if half > 1 else "0", f"{half}-{cores - 1}" if cores - half > 1 else str(half)
    rng = random.Random(1)
    long_prompts = [[rng.randrange(100, 32000) for _ in range(args.long_len)] for _ in range(args.long)]
    short_prompts = [[rng.randrange(100, 32000) for _ in range(args.short_len)] for _ in range(args.short)]
    rows, notes = [], []

    # (a) one MIX instance on every core
    port = serving.free_port()
    url = f"http://127.0.0.1:{port}"
    procs = [start(serve_cmd(args.model, port, ["--instance_role=MIX", f"--max_cache_size={2 * CACHE}"]), url, None,
                   cores, "MIX instance")]
    try:
        name = serving.served_name(url, {})
        by, wall = asyncio.run(mixed_load(url, name, long_prompts, short_prompts, args.long_out, args.short_out,
                                          args.concurrency))
    finally:
        stop(procs)
    for kind in ("long", "short"):
        rows.append({"setup": f"MIX, cores 0-{cores - 1}", "class": kind, **serving.summarize(kind, by[kind], wall)})

    # (b) PREFILL on one half, DECODE on the other, behind the router, per transfer mode
    per_block = {}
    for mode in args.modes.split(","):
        pp, dp, rp = serving.free_port(), serving.free_port(), serving.free_port()
        purl, durl, rurl = (f"http://127.0.0.1:{p}" for p in (pp, dp, rp))
        pd_flags = [f"--kv_cache_transfer_mode={mode}", f"--max_cache_size={CACHE}"]  # two instances share the host
        procs = []
        try:
            procs.append(start(serve_cmd(args.model, pp, ["--instance_role=PREFILL", *pd_flags,
                                                          f"--transfer_listen_port={serving.free_port()}"]),
                               purl, first, half, "PREFILL instance"))
            procs.append(start(serve_cmd(args.model, dp, ["--instance_role=DECODE", *pd_flags,
                                                          f"--transfer_listen_port={serving.free_port()}"]),
                               durl, second, cores - half, "DECODE instance"))
            procs.append(start([sys.executable, "-m", "heterollm.entrypoints.cli", "route", "--host=127.0.0.1",
                                f"--port={rp}", f"--prefill_instances={purl}", f"--decode_instances={durl}"],
                               rurl, None, 1, "router"))
            name = serving.served_name(rurl, {})
            by, wall = asyncio.run(mixed_load(rurl, name, long_prompts, short_prompts, args.long_out,
                                              args.short_out, args.concurrency))
            side, verb = (purl, "push") if mode == "PUSH" else (durl, "pull")
            blocks, seconds = metric(side, f"heterollm_kv_{verb}_blocks"), metric(side, f"heterollm_kv_{verb}_seconds")
        finally:
            stop(procs)
        for kind in ("long", "short"):
            rows.append({"setup": f"{mode}: 1 P (cores {first}) + 1 D (cores {second})", "class": kind,
                         **serving.summarize(kind, by[kind], wall)})
        per_block[mode] = 1000 * seconds / blocks if blocks else float("nan")
        who = "PREFILL instance pushed" if mode == "PUSH" else "DECODE instance pulled"
        waited = ("the answers waited for the writes after the forwards (layers went beside them)"
                  if mode == "PUSH" else "from the start of the step that started each pull to the step that saw it end")
        notes.append(f"{mode}: the {who} {blocks:.0f} blocks, {seconds:.2f} s summed over requests ({waited}) = "
                     f"{per_block[mode]:.2f} ms per block (a block: --block_size tokens, 128 by default, x every "
                     f"layer's K and V; Mooncake's transfer engine over TCP on loopback)")
    notes.append(f"load: {args.long} prompts of {args.long_len} tokens writing {args.long_out}, {args.short} of "
                 f"{args.short_len} writing {args.short_out}, shuffled, {args.concurrency} streaming clients")
    common.print_table("PD disaggregation vs one instance (TTFT / TPOT in ms)", rows,
                       [("setup", "setup", 0), ("class", "class", 0), ("requests", "ok", 0),
                        ("ttft_p50_ms", "TTFT p50", 0), ("ttft_p99_ms", "TTFT p99", 0),
                        ("tpot_p50_ms", "TPOT p50", 1), ("tpot_p99_ms", "TPOT p99", 1),
                        ("output_tok_s", "out tok/s", 1)], notes=notes)
    common.write_json(args.json, {"machine": common.machine_info(), "rows": rows, "kv_ms_per_block": per_block})


if __name__ == "__main__":
    main()
