"""Weight loading: `--load_choices default` (each tensor handed to the weight loaders whole) against
`default_v1` (windows over the memory-mapped file, so a tensor-parallel rank reads and converts only
its shard), at tp_size 1 and 2, for a safetensors and a pytorch_model.bin copy of one checkpoint, at
the checkpoint's dtype and at another, same run.

    python bench/loading.py                          # a 0.3B Llama-shaped bf16 checkpoint, 3 repeats
    python bench/loading.py --layers 2 --repeats 1 --formats safetensors --dtypes bfloat16   # smoke test

The checkpoint is random (load speed does not depend on the values): bf16, with the default model's
tokenizer. Each row launches a fresh process that builds an `LLM` and shuts it down; it reports, as
medians over --repeats launches (the configurations take turns, so the page cache treats them alike:
the file is read from memory, not from disk):
  - load s: the runner's own timer around building the model and loading its weights, on the
    slowest rank;
  - handed MiB: checkpoint bytes handed to the weight loaders as tensors, per rank (the runner counts
    them). A safetensors tensor is memory-mapped either way: at the checkpoint's dtype, narrowing it
    touches only the shard's pages, so the default loader does not read what it is handed; a dtype
    conversion or a .bin file (read whole by torch.load) does;
  - peak RSS MiB: the largest process's peak resident memory (getrusage: the engine process at
    tp_size 1, the largest worker at tp_size 2).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common

CHILD = r"""
import json, logging, resource, sys
from heterollm import LLM
folder, tp, choice, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
llm = LLM(folder, dtype=dtype, tp_size=tp, load_choices=choice, num_gpu_blocks_override=16, block_size=16,
          max_model_len=256)
llm.shutdown()
who = resource.RUSAGE_SELF if tp == 1 else resource.RUSAGE_CHILDREN
print(json.dumps({"peak_rss_kib": resource.getrusage(who).ru_maxrss}))
"""
LOADED = re.compile(r"in ([0-9.]+)s; --load_choices (\S+) handed the weight loaders ([0-9.]+) of the checkpoint's "
                    r"([0-9.]+) MiB")


def build_checkpoint(folder: Path, layers: int) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    gguf = common.gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, architectures=["LlamaForCausalLM"])
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": torch.ones(h).bfloat16(),
             "lm_head.weight": rand(cfg.vocab_size, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        state |= {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                  p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                  p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                  p + "mlp.down_proj.weight": rand(h, i), p + "input_layernorm.weight": torch.ones(h).bfloat16(),
                  p + "post_attention_layernorm.weight": torch.ones(h).bfloat16()}
    folders = {}
    for fmt in ("safetensors", "bin"):
        target = folder / fmt
        target.mkdir(parents=True, exist_ok=True)
        if fmt == "bin":
            torch.save(state, target / "pytorch_model.bin")
        else:
            save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(target)
        tok.save_pretrained(target)
        folders[fmt] = target
    return folders


def launch(folder: Path, tp: int, choice: str, dtype: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tp), choice, dtype], capture_output=True,
                          text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"launch failed (tp {tp}, {choice}):\n{proc.stderr[-3000:]}")
    ranks = LOADED.findall(proc.stderr)
    if len(ranks) != tp:
        raise SystemExit(f"expected {tp} 'loaded' log lines, found {len(ranks)}:\n{proc.stderr[-3000:]}")
    rss = json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_kib"]
    return {"load_s": max(float(r[0]) for r in ranks), "handed_mib": max(float(r[2]) for r in ranks),
            "stored_mib": float(ranks[0][3]), "peak_rss_mib": rss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--formats", default="safetensors,bin")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="the checkpoint is bf16: float32 converts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    info = common.machine_info()
    configs = [(fmt, dtype, int(tp), choice) for fmt in args.formats.split(",") for dtype in args.dtypes.split(",")
               for tp in args.tp.split(",") for choice in ("default", "default_v1")]
    with tempfile.TemporaryDirectory(prefix="heterollm-load-bench-") as tmp:
        folders = build_checkpoint(Path(tmp), args.layers)
        runs: dict[tuple, list[dict]] = {c: [] for c in configs}
        for _ in range(args.repeats):
            for fmt, dtype, tp, choice in configs:
                runs[(fmt, dtype, tp, choice)].append(launch(folders[fmt], tp, choice, dtype))
    rows = []
    for fmt, dtype, tp, choice in configs:
        got, base = runs[(fmt, dtype, tp, choice)], runs[(fmt, dtype, tp, "default")]
        row = {"format": fmt, "dtype": dtype, "tp_size": tp, "load_choices": choice,
               **{key: statistics.median(r[key] for r in got) for key in got[0]}}
        row["load_vs_default"] = row["load_s"] / statistics.median(r["load_s"] for r in base)
        row["rss_vs_default"] = row["peak_rss_mib"] / statistics.median(r["peak_rss_mib"] for r in base)
        rows.append(row)
    common.print_table(
        f"Weight loading, {args.layers}-layer Llama (hidden 1024, vocab 49152), {rows[0]['stored_mib']:.0f} MiB "
        f"bf16 checkpoint, median of {args.repeats}",
        rows, [("format", "format", 0), ("dtype", "--dtype", 0), ("tp_size", "tp", 0),
               ("load_choices", "--load_choices", 0), ("load_s", "load s", 2), ("load_vs_default", "vs default", 2),
               ("handed_mib", "handed MiB / rank", 0), ("peak_rss_mib", "peak RSS MiB", 0),
               ("rss_vs_default", "vs default", 2)], machine=info)
    common.write_json(args.json, {"machine": info, "command": common.command_line(), "rows": rows})


if __name__ == "__main__":
    main()
