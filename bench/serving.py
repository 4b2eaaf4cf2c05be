"""Serving benchmark: N requests from C concurrent streaming clients against an OpenAI server.

    python bench/serving.py                               # starts `heterollm serve --model smollm2`
    python bench/serving.py --num-prompts 32 --concurrency 8 --input-len 128 --output-len 64
    python bench/serving.py --base-url http://127.0.0.1:8000 --served-model M   # any OpenAI server
    python bench/serving.py --compare http://127.0.0.1:8000=vllm               # a peer, same run

Prompts are random token ids (seeded, the same for every server), sent to /v1/completions as
token-id prompts with ignore_eos, so every request reads exactly --input-len tokens and writes
--output-len. Reports request throughput, output tokens/s, TTFT and TPOT (p50/p99), and with
--compare the ratio heterollm / peer of each, measured in this run with this client.
Output token counts come from the final `usage` chunk (stream_options.include_usage).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


@dataclass
class Result:
    ttft: float
    e2e: float
    output_tokens: int
    error: str | None = None


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                      headers: dict[str, str]) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(0, 0, 0, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(0, 0, 0, chunk["error"]["message"])
                if ttft is None and any(c.get("text") for c in chunk.get("choices", [])):
                    ttft = time.perf_counter() - start
                if chunk.get("usage") and not chunk.get("choices"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Result(0, 0, 0, f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    return Result(ttft if ttft is not None else e2e, e2e, tokens)


async def run_load(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int,
                   headers: dict[str, str]) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        # one short warm-up request (first-call costs are not the server's steady state)
        await one_request(client, url, model, prompts[0][:8], 2, headers)
        gate = asyncio.Semaphore(concurrency)

        async def bounded(p: list[int]) -> Result:
            async with gate:
                return await one_request(client, url, model, p, output_len, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return list(results), time.perf_counter() - start


def summarize(name: str, results: list[Result], wall: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    if failed:
        print(f"{name}: {len(failed)} of {len(results)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
    out_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "requests": len(ok), "failed": len(failed), "duration_s": wall,
        "request_throughput": len(ok) / wall, "output_tok_s": out_tokens / wall,
        "ttft_p50_ms": 1000 * percentile([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1000 * percentile([r.ttft for r in ok], 99),
        "tpot_p50_ms": 1000 * percentile(tpots, 50), "tpot_p99_ms": 1000 * percentile(tpots, 99),
        "e2e_mean_s": statistics.fmean([r.e2e for r in ok]) if ok else float("nan"),
    }


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (`heterollm serve`'s engine-core processes, their tensor-parallel ranks)."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            with open(f"/proc/{pids[i]}/task/{pids[i]}/children", encoding="ascii") as fh:
                pids += [int(c) for c in fh.read().split()]
        except OSError:
            pass
        i += 1
    return pids


def memory_of(pid: int) -> dict[str, float]:
    """Resident and peak resident memory (MiB) of a local server, from /proc: summed over the process and
    its descendants (the API server and its engine cores; the peak is the sum of each one's peak)."""
    out: dict[str, float] = {}
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/status", encoding="ascii") as fh:
                for line in fh:
                    key, _, rest = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        out[key] = out.get(key, 0) + int(rest.split()[0]) / 1024
        except OSError:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_heterollm(model: str, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "heterollm.entrypoints.cli", "serve", "--model", model, "--host=127.0.0.1",
           f"--port={port}", "--uvicorn_log_level=warning", "--max_concurrent_requests=0", *extra]
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"heterollm serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                return proc, url, name
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("heterollm serve did not become healthy in 600 s")


def served_name(url: str, headers: dict[str, str]) -> str:
    return httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="model heterollm serves (when it starts the server)")
    ap.add_argument("--base-url", help="bench this running server instead of starting heterollm")
    ap.add_argument("--served-model", help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--compare", action="append", default=[],
                    help="URL=NAME of a peer OpenAI server to run the same load against (repeatable)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the load on the started server this many times, printing its RSS after each "
                         "(a soak test: RSS should level off, not grow)")
    ap.add_argument("--duration", type=float, default=0,
                    help="a soak by the clock: repeat the load until this many seconds have passed since the "
                         "first round began (with --rounds, whichever ends later), RSS after each round; it stops "
                         "early when a request fails or the server exits. Needs the server this script starts")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("serve_flags", nargs="*", help="extra `heterollm serve` flags, after --")
    args = ap.parse_args()
    if (args.rounds > 1 or args.duration) and args.base_url:
        ap.error("--rounds / --duration: a soak reads the RSS of the server this script starts; drop --base-url")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    # ordinary token ids (past the special tokens at the start of the vocabulary)
    prompts = [[rng.randrange(100, 32000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    proc = None
    if args.base_url:
        url, name = args.base_url.rstrip("/"), args.served_model or served_name(args.base_url, headers)
        label = "server"
    else:
        proc, url, name = start_heterollm(args.model, args.serve_flags)
        label = "heterollm"
    targets = [(label, url, name)]
    for spec in args.compare:
        peer_url, _, peer_label = spec.partition("=")
        peer_url = peer_url.rstrip("/")
        targets.append((peer_label or peer_url, peer_url, served_name(peer_url, headers)))

    report = {}
    memory = {}
    try:
        for tlabel, turl, tname in targets:
            if proc is not None and tlabel == label:
                memory["before"] = memory_of(proc.pid)
            results, wall = asyncio.run(run_load(turl, tname, prompts, args.output_len, args.concurrency, headers))
            report[tlabel] = summarize(tlabel, results, wall)
            if proc is not None and tlabel == label:
                memory["after"] = memory_of(proc.pid)
                memory["rounds"] = [memory["after"].get("VmRSS", 0)]
                soak_start = time.monotonic() - wall
                i = 1
                memory["failed_requests"] = 0
                while i < args.rounds or time.monotonic() - soak_start < args.duration:
                    results, wall = asyncio.run(run_load(turl, tname, prompts, args.output_len, args.concurrency,
                                                         headers))
                    last = summarize(tlabel, results, wall)
                    failed = sum(r.error is not None for r in results)
                    memory["failed_requests"] += failed
                    if proc.poll() is not None or failed:  # a dead or failing server: no RSS figure to trust
                        print(f"round {i + 1}: {failed} of {len(results)} requests failed"
                              + (f"; the server exited ({proc.returncode})" if proc.poll() is not None else "")
                              + ": soak stopped", file=sys.stderr)
                        break
                    memory["rounds"].append(memory_of(proc.pid).get("VmRSS", 0))
                    i += 1
                    print(f"round {i} ({time.monotonic() - soak_start:.0f} s): server RSS "
                          f"{memory['rounds'][-1]:.0f} MiB, {last['output_tok_s']:.1f} out tok/s", file=sys.stderr)
                    memory["last_round_out_tok_s"] = last["output_tok_s"]
                memory["soak_s"] = time.monotonic() - soak_start
                memory["after"] = memory_of(proc.pid)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    print(f"\n{common.machine_line(common.machine_info())}")
    print(f"{common.command_line()}")
    print(f"{args.num_prompts} requests, concurrency {args.concurrency}, {args.input_len} in / "
          f"{args.output_len} out tokens, greedy, EOS ignored")
    keys = ["request_throughput", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"]
    print(f"{'':<12}" + "".join(f"{k:>20}" for k in keys))
    for tlabel, fig in report.items():
        print(f"{tlabel:<12}" + "".join(f"{fig[k]:>20.2f}" for k in keys))
    if len(report) > 1:
        base = report[targets[0][0]]
        for tlabel, fig in list(report.items())[1:]:
            ratios = {k: base[k] / fig[k] if fig[k] else float("nan") for k in keys}
            print(f"{'ratio/' + tlabel:<12}" + "".join(f"{ratios[k]:>20.2f}" for k in keys))
        print("(throughput ratios > 1 and latency ratios < 1 favour the first row)")
    if memory.get("after"):
        b, a = memory.get("before", {}), memory["after"]
        print(f"heterollm server memory (API server + engine cores): RSS {b.get('VmRSS', 0):.0f} MiB before the load, {a.get('VmRSS', 0):.0f} "
              f"MiB after; peak RSS {a.get('VmHWM', 0):.0f} MiB (weights and KV cache size: see the server log)")
        rss = memory["rounds"]
        if len(rss) > 1:
            third = max(1, len(rss) // 3)
            print(f"soak: {len(rss)} rounds in {memory['soak_s']:.0f} s, {memory.get('failed_requests', 0)} failed requests; RSS after each round min {min(rss):.0f} / max "
                  f"{max(rss):.0f} MiB; mean of the last third minus the first third's: "
                  f"{sum(rss[-third:]) / third - sum(rss[:third]) / third:+.1f} MiB; last round "
                  f"{memory['last_round_out_tok_s']:.1f} out tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": common.machine_info(), "results": report, "memory_mib": memory}, f, indent=2)


if __name__ == "__main__":
    main()
