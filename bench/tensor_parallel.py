"""Tensor parallelism on CPU: decode step time at tp_size 1 vs 2 (vs 3), same model, same run, and
where a TP step's time goes.

    python bench/tensor_parallel.py                     # SmolLM2-135M-shaped random model, bf16
    python bench/tensor_parallel.py --batches 1,8 --tp 1,2 --decode-steps 8     # a smoke test

SmolLM2-135M itself has 9 query heads, which tp_size=2 cannot split, so the model here has its
shapes (hidden 576, MLP 1536, 30 layers, vocab 49152) with 8 heads and 4 KV heads (random weights:
speed does not depend on them). For each tp_size and batch size B: B requests of 64 prompt tokens
decode together; the row is the mean of --decode-steps decode-only steps, split into
  - rank 0's own phases as the runner reports them: prepare, forward (with the collectives), sample
  - overhead: the rest of the executor call (pickling the batch, the pipe to rank 0, its broadcast
    to the other ranks, the answer back)
and "comm est.": one all-reduce of (B, 576) per attention and per MLP block and one all-gather of the
logits, timed alone between two gloo processes and multiplied by their count (61 a step).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch

import common


def build_model(folder: Path) -> Path:
    import transformers

    from heterollm.model_executor import gguf_cache
    from heterollm.model_executor.loader import resolve_model

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    gguf_cache.load_tokenizer(resolve_model("smollm2").gguf_file).save_pretrained(folder)  # SmolLM2's tokenizer
    return folder


def decode_steps(llm, batch: int, steps: int) -> list[dict[str, float]]:
    from heterollm import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([1000 + (i * 7 + j) % 40000 for j in range(64)], params, request_id=f"b{batch}-{i}")
    records = common.run_recording_steps(engine)
    rows = [r for r in records if r["decode"]][1:steps + 1]  # drop the first decode (warm-up)
    return rows


def comm_estimate(batch: int, world: int) -> float:
    """Seconds of one step's collectives (60 all-reduces of (B, 576) + 1 all-gather of (B, vocab/world)),
    measured between `world` gloo processes."""
    import torch.multiprocessing as mp

    from heterollm.distributed.executor import free_port

    q = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    procs = [mp.get_context("spawn").Process(target=_comm_worker, args=(r, world, port, batch, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get()
    for p in procs:
        p.join()
    return result


def _comm_worker(rank: int, world: int, port: int, batch: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.randn(batch, 576, dtype=torch.bfloat16)
    logits = torch.randn(batch, 49152 // world, dtype=torch.float32)
    parts = [torch.empty_like(logits) for _ in range(world)]
    for _ in range(20):
        dist.all_reduce(x)
    dist.barrier()
    t = time.perf_counter()
    n = 50
    for _ in range(n):
        for _ in range(60):
            dist.all_reduce(x)
        dist.all_gather(parts, logits)
    if rank == 0:
        q.put((time.perf_counter() - t) / n)
    dist.destroy_process_group()


def sample_batch(batch: int):
    """A decode step's SchedulerOutput as the engine builds it: `batch` requests with 64 prompt and
    64 generated tokens each."""
    from heterollm.interfaces import SamplingInfo, ScheduledRequest, SchedulerOutput
    from heterollm.sampling import SamplingParams

    sampling = SamplingInfo(SamplingParams(max_tokens=128, temperature=0))
    items = [ScheduledRequest(f"req-{i}", [5], 127, list(range(8 * i, 8 * i + 8)), True, sampling,
                              list(range(2000, 2064)), list(range(1000, 1064))) for i in range(batch)]
    return SchedulerOutput(items, [])


def _dispatch_worker(rank: int, world: int, port: int, conn, mode: str) -> None:
    import torch.distributed as dist

    if mode == "broadcast":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        if mode == "pipes" or rank == 0:
            msg = conn.recv()
        if mode == "broadcast":
            box = [msg if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
        if msg is None:
            break
        if mode == "pipes" or rank == 0:
            conn.send(len(msg.requests))
    if mode == "broadcast":
        dist.destroy_process_group()


def dispatch_cost(batch: int, world: int, mode: str, iters: int = 200) -> float:
    """Seconds to hand one step's batch to `world` ranks and hear back: "pipes" (a pipe to every
    rank, each answers) or "broadcast" (a pipe to rank 0, which broadcasts on gloo and answers)."""
    import multiprocessing as mp

    from heterollm.distributed.executor import free_port

    ctx = mp.get_context("spawn")
    port, so = free_port(), sample_batch(batch)
    pipes = [ctx.Pipe() for _ in range(world)]
    procs = [ctx.Process(target=_dispatch_worker, args=(r, world, port, pipes[r][1], mode)) for r in range(world)]
    for p in procs:
        p.start()
    talk = [pipes[r][0] for r in range(world)] if mode == "pipes" else [pipes[0][0]]
    for i in range(iters + 20):
        if i == 20:
            t = time.perf_counter()
        for c in talk:
            c.send(so)
        for c in talk:
            c.recv()
    elapsed = (time.perf_counter() - t) / iters
    for c in talk:
        c.send(None)
    for p in procs:
        p.join()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    from heterollm import LLM

    folder = build_model(Path(tempfile.mkdtemp(prefix="heterollm-tp-bench-")))
    rows = []
    for tp in [int(t) for t in args.tp.split(",")]:
        llm = LLM(str(folder), tp_size=tp, max_cache_size=2**30)
        for batch in [int(b) for b in args.batches.split(",")]:
            recs = decode_steps(llm, batch, args.decode_steps)
            mean = {k: 1000 * statistics.mean(r.get(k, 0.0) for r in recs) for k in ("wall", "prepare", "forward",
                                                                                       "sample")}
            rows.append({"tp": tp, "batch": batch, "step_ms": mean["wall"], "prepare_ms": mean["prepare"],
                         "forward_ms": mean["forward"], "sample_ms": mean["sample"],
                         "overhead_ms": mean["wall"] - mean["prepare"] - mean["forward"] - mean["sample"],
                         "comm_ms": 1000 * comm_estimate(batch, tp) if tp > 1 else 0.0})
        llm.shutdown()
        del llm
        gc.collect()
    base = {r["batch"]: r["step_ms"] for r in rows if r["tp"] == 1}
    for r in rows:
        r["x"] = base.get(r["batch"], float("nan")) / r["step_ms"]
    common.print_table(
        f"decode step, SmolLM2-135M-shaped model (8 heads), bf16, {args.decode_steps} steps each",
        rows, [("tp", "tp_size", 0), ("batch", "batch", 0), ("step_ms", "step ms", 1), ("prepare_ms", "prepare", 1),
               ("forward_ms", "forward", 1), ("sample_ms", "sample", 1), ("overhead_ms", "overhead", 2),
               ("comm_ms", "comm est.", 1), ("x", "x vs tp1", 2)],
        notes=["prepare/forward/sample: rank 0's phases; overhead: pickling, pipe, broadcast to the ranks and back; "
               "comm est.: the step's 61 collectives timed alone between gloo processes"])
    ways = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for mode in ("pipes", "broadcast"):
            ways.append({"batch": batch, "mode": mode, "ms": 1000 * dispatch_cost(batch, 2, mode)})
    common.print_table("handing a decode step's batch to 2 ranks and hearing back (pickled SchedulerOutput)", ways,
                       [("batch", "batch", 0), ("mode", "how", 0), ("ms", "ms per step", 3)],
                       notes=["pipes: one pipe per rank, each rank answers; broadcast: a pipe to rank 0, which "
                              "forwards it with a gloo broadcast (what the executor does) and answers"])
    common.write_json(args.json, {"machine": common.machine_info(), "rows": rows, "dispatch": ways,
                                  "args": vars(args)})


if __name__ == "__main__":
    main()
