"""Mixture of experts on CPU: a random-weight Qwen3-MoE-shaped model (about 100M active parameters:
hidden 768, 12 layers, 12 heads / 4 KV heads, 16 experts of 768, top-2, tied 49152-token embedding),
heterollm against transformers (and vLLM's CPU build where it runs the architecture), same weights,
same run; then expert parallelism: a decode step at --ep_size 2 against tensor-parallel experts and
one rank and against attention data parallelism (--dp_size 2 --ep_size 2), with the step's time in
collectives.

    python bench/moe.py                                  # the table in bench/RESULTS.md
    python bench/moe.py --batches 1 --output-len 8 --skip-ep --peers ""       # a smoke test

Throughput: B requests of --prompt-len random tokens, --output-len greedy tokens each (ignore_eos),
output tokens / wall time of the whole generate call (prefill included), bf16. transformers runs one
generate call over the same B prompts (equal lengths: no padding). EP: B requests of 64 prompt
tokens decoding together; the mean of --decode-steps decode-only steps; "comm" is rank 0's wall time
inside collectives (TorchDistributedCommunicator.seconds, waiting for the other rank included).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import common

SHAPE = dict(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=768,
             norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6)


def build_model(folder: Path) -> tuple[Path, dict]:
    import transformers

    from heterollm.model_executor import gguf_cache
    from heterollm.model_executor.loader import resolve_model

    cfg = transformers.Qwen3MoeConfig(**SHAPE)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # spread routing over the experts (init's near-zero router sends most tokens alike)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    total = sum(p.numel() for p in model.parameters())
    per_expert = 3 * SHAPE["hidden_size"] * SHAPE["moe_intermediate_size"]
    inactive = SHAPE["num_hidden_layers"] * (SHAPE["num_experts"] - SHAPE["num_experts_per_tok"]) * per_expert
    model.save_pretrained(folder, safe_serialization=True)
    gguf_cache.load_tokenizer(resolve_model("smollm2").gguf_file).save_pretrained(folder)  # SmolLM2's tokenizer
    return folder, {"params_total_m": total / 1e6, "params_active_m": (total - inactive) / 1e6}


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (batch, length), generator=g).tolist()


def run_heterollm(folder: Path, ps: list[list[int]], output_len: int) -> dict:
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", max_cache_size=2**30)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts(2, 16, seed=9), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(ps, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return {"tok_s": tokens / wall, "wall_s": wall, "first": outs[0].outputs[0].token_ids[:8]}


def run_transformers(folder: Path, ps: list[list[int]], output_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    ids = torch.tensor(ps)
    kw = dict(do_sample=False, min_new_tokens=output_len, max_new_tokens=output_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts(2, 16, seed=9)), max_new_tokens=4, do_sample=False, pad_token_id=0)
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        wall = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tok_s": tokens / wall, "wall_s": wall, "first": out[0, ids.shape[1]:ids.shape[1] + 8].tolist()}


def decode_steps(folder: Path, batch: int, steps: int, **flags) -> dict[str, float]:
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", max_cache_size=2**30, **flags)
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts(batch, 64, seed=3)):
        engine.add_request(p, params, request_id=f"ep-{i}")
    records = common.run_recording_steps(engine)
    llm.shutdown()
    rows = [r for r in records if r["decode"]][1:steps + 1]  # the first decode warms up
    return {k: 1000 * statistics.mean(r.get(k, 0.0) for r in rows) for k in ("wall", "forward", "comm")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--peers", default="vllm", help="comma-separated: vllm (if installed); empty for none")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-ep", action="store_true")
    ap.add_argument("--ep-batches", default="16,64")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()

    folder, size = build_model(Path(tempfile.mkdtemp(prefix="heterollm-moe-bench-")))
    print(common.machine_line())
    print(f"model: Qwen3-MoE-shaped, {size['params_total_m']:.0f}M parameters, {size['params_active_m']:.0f}M active "
          f"per token, bf16 (random weights)")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ps = prompts(batch, args.prompt_len)
        runs = {"heterollm": run_heterollm(folder, ps, args.output_len)}
        gc.collect()
        if not args.skip_hf:
            runs["transformers"] = run_transformers(folder, ps, args.output_len)
            gc.collect()
        if "vllm" in args.peers.split(","):
            peer = common.run_peer("vllm", ps, args.output_len, model=str(folder))
            if peer is not None:
                runs["vllm"] = {"tok_s": peer["out_tok_s"], "wall_s": peer["total_s"],
                                "first": peer["first_token_ids"][:8]}
        base = runs["heterollm"]["tok_s"]
        for engine, r in runs.items():
            rows.append({"batch": batch, "engine": engine, "tok_s": r["tok_s"], "wall_s": r["wall_s"],
                         "x": base / r["tok_s"], "same": r["first"] == runs["heterollm"]["first"]})
    common.print_table(
        f"throughput, {args.prompt_len} in / {args.output_len} out, greedy, bf16", rows,
        [("batch", "batch", 0), ("engine", "engine", 0), ("tok_s", "out tok/s", 1), ("wall_s", "wall s", 2),
         ("x", "heterollm x", 2), ("same", "same first 8 tokens", 0)],
        notes=["heterollm x: heterollm's tok/s over this row's (1.00 on heterollm's own row)",
               "same first 8 tokens: against heterollm's first request (bf16 rounding may differ late)"])
    ep_rows = []
    if not args.skip_ep:
        for batch in [int(b) for b in args.ep_batches.split(",")]:
            for label, flags in (("1 rank", {}), ("TP=2 experts", {"tp_size": 2}),
                                 ("EP=2", {"tp_size": 2, "ep_size": 2}),
                                 ("EP=2, attention DP=2", {"dp_size": 2, "ep_size": 2})):
                m = decode_steps(folder, batch, args.decode_steps, **flags)
                ep_rows.append({"batch": batch, "how": label, "step_ms": m["wall"], "forward_ms": m["forward"],
                                "comm_ms": m["comm"], "comm_share": m["comm"] / m["wall"] if m["wall"] else 0.0})
                gc.collect()
        common.print_table(
            f"decode step, {args.decode_steps} steps each, bf16", ep_rows,
            [("batch", "batch", 0), ("how", "experts", 0), ("step_ms", "step ms", 1), ("forward_ms", "forward", 1),
             ("comm_ms", "comm", 1), ("comm_share", "comm share", 2)],
            notes=["comm: rank 0's wall time in collectives (all-reduce, all-gather, all_to_all), waiting included; "
                   "under attention DP the slowest rank's",
                   "attention DP: each rank runs attention and the dense layers for half of the sequences"])
    common.write_json(args.json, {"machine": common.machine_info(), "model": size, "rows": rows, "ep": ep_rows,
                                  "args": vars(args), "command": common.command_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
