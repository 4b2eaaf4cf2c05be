"""The CPU backend's linear methods one against another, on SmolLM2-135M's layer shapes.

    python bench/linear_kernels.py                  # rows 1, 4, 16, 64, 512
    python bench/linear_kernels.py --rows 1,4 --json linear.json

For each row count M: the 121 linears of one SmolLM2-135M forward (30 x qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536, and the 49152x576 output projection; 8 layers only above 64 rows),
one after the other on fresh random weights (their bytes exceed the caches, as a decode step's do),
x of M random rows in --dtype (float32, or bfloat16: what `--dtype auto` picks on a CPU with
AVX512-bf16). Each method as the engine prepares it (heterollm_cpu.linear): the --dtype weight prepacked
for oneDNN, and in bf16 on a CPU with AVX512_BF16 packed for `heterollm_cpu::bf16_linear` (what `linear.none`
runs there), `wint8` on `heterollm_cpu::int8_gemm` and on torch's
`_weight_int8pack_mm` (what wint8 runs without the kernels), `w8a8` on whichever path this CPU takes (int8_dot_gemm with AVX512-VNNI),
`wint4` on `heterollm_cpu::int4_linear` and, with AVX512-VNNI, on `int4_dot_linear` (what wint4 runs
there, x rounded to int8 per group of 32). Best of --repeats passes; "x fp32" ("x bf16") is the --dtype
oneDNN time over the row's (> 1: faster than it); GB/s counts each method's weight bytes once per pass.
"""
from __future__ import annotations

import argparse
import time

import torch

import common

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the activations' and the unquantized weight's dtype (the quantized ones are made from it)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from heterollm_cpu import kernels
    from heterollm_cpu import linear as cpu_linear

    if not kernels.available():
        raise SystemExit("the CPU kernels are not built: `python -m heterollm_cpu.kernels` (scripts/setup.sh does)")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    short = {"float32": "fp32", "bfloat16": "bf16"}[args.dtype]
    base = f"{args.dtype} (oneDNN)"
    weights = [(torch.randn(n, k) * 0.05).to(dtype) for n, k in SHAPES]
    onednn, dense = cpu_linear.OneDnnLinear(), cpu_linear.OneDnnLinear()
    onednn.dot = False  # oneDNN's prepacked GEMM, measured beside bf16_linear where the engine takes that
    wint8 = cpu_linear.WeightOnlyInt8()
    wint4_panels, wint4 = cpu_linear.WeightOnlyInt4(), cpu_linear.WeightOnlyInt4()
    wint4_panels.dot = False  # the AVX2 kernel, measured beside the VNNI one where both run
    methods = {base: onednn}
    if dense.dot and dtype == torch.bfloat16:
        methods["bf16_linear"] = dense
    methods |= {"wint8 int8_gemm": wint8, "wint8 torch": wint8,
               "w8a8": cpu_linear.DynamicInt8(), "wint4 int4_linear": wint4_panels}
    if wint4.dot:
        methods["wint4 int4_dot_linear"] = wint4
    labels = {"bf16_linear": "bf16_linear", "wint8 int8_gemm": "wint8", "wint8 torch": "wint8 torch", "w8a8": "w8a8", "wint4 int4_linear": "wint4",
              "wint4 int4_dot_linear": "wint4 dot"}
    states = {name: [method.prepare(w) for w in weights] for name, method in methods.items() if name != "wint8 torch"}
    # plain codes, the scales in x's dtype: the torch path
    states["wint8 torch"] = [(c, sc.to(dtype)) for c, sc in map(cpu_linear.int8_per_channel, weights)]
    if states["wint8 int8_gemm"][0][0].dim() != 4:
        raise SystemExit("wint8 does not run int8_gemm on this CPU (it needs AVX2)")

    def nbytes(state) -> int:
        parts = state if isinstance(state, tuple) else (getattr(state, "packed", state),)
        return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))

    state_bytes = {name: sum(map(nbytes, sts)) for name, sts in states.items()}
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        layers = len(SHAPES) if m <= 64 else 8
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        row = {"rows": m}
        for name, method in methods.items():
            if name == "wint8 torch" and m > 64:
                row[name] = None  # minutes per pass: 40x the kernel at 64 rows already
                continue
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for i in range(layers):
                    method.apply(states[name][i], xs[SHAPES[i][1]], None)
                best = min(best, time.perf_counter() - t0)
            row[name] = best * 1e3
            if m <= 64:
                row[name + " GB/s"] = state_bytes[name] / best / 1e9
        rows_out.append(row)
    names = list(methods)
    cols = [("rows", "rows", 0)]
    for name in names:
        cols.append((name, f"{name} ms", 2))
    for r in rows_out:
        for name in names[1:]:
            r[f"x {name}"] = r[base] / r[name] if r.get(name) else None
    cols += [(f"x {name}", f"x {short} {labels[name]}", 2) for name in names[1:]]
    w8a8 = methods["w8a8"]
    w8a8_path = "int8_dot_gemm" if w8a8.dot else "int8_gemm" if w8a8.panels else "torch._int_mm / w8a8_linear"
    common.print_table("Linear methods on SmolLM2-135M's 121 layer shapes (ms per pass)", rows_out, cols, [
        f"w8a8 runs {w8a8_path} on this CPU; "
        "above 64 rows 8 layers per pass; torch threads %d" % torch.get_num_threads(),
        "GB/s at <= 64 rows: " + ", ".join(f"{n} {rows_out[0].get(n + ' GB/s', 0):.1f}" for n in names
                                            if rows_out and rows_out[0].get(n + " GB/s")) + f" (at {rows_out[0]['rows']} rows)"
        if rows_out else ""])
    common.write_json(args.json, {"rows": rows_out, "dtype": args.dtype, "machine": common.machine_info()})


if __name__ == "__main__":
    main()
