"""The CPU backend's linear methods one against another, on SmolLM2-135M's layer shapes.

    python bench/linear_kernels.py                  # rows 1, 4, 16, 64, 512
    python bench/linear_kernels.py --rows 1,4 --json linear.json

For each row count M: the 121 linears of one SmolLM2-135M forward (30 x qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536, and the 49152x576 output projection; 8 layers only above 64 rows),
one after the other on fresh random weights (their bytes exceed the caches, as a decode step's do),
x of M random rows. Each method as the engine prepares it (heterollm_cpu.linear): float32 prepacked
for oneDNN (`linear.none`), `wint8` on `heterollm_cpu::int8_gemm` and on torch's
`_weight_int8pack_mm` (what wint8 runs without the kernels), `w8a8` on whichever path this CPU takes,
`wint4` on `heterollm_cpu::int4_linear`. Best of --repeats passes; "x fp32" is the float32 time over
the row's (> 1: faster than float32); GB/s counts each method's weight bytes once per pass.
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
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from heterollm_cpu import kernels
    from heterollm_cpu import linear as cpu_linear

    if not kernels.available():
        raise SystemExit("the CPU kernels are not built: `python -m heterollm_cpu.kernels` (scripts/setup.sh does)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    wint8 = cpu_linear.WeightOnlyInt8()
    methods = {"float32 (oneDNN)": cpu_linear.OneDnnLinear(), "wint8 int8_gemm": wint8, "wint8 torch": wint8,
               "w8a8": cpu_linear.DynamicInt8(), "wint4 int4_linear": cpu_linear.WeightOnlyInt4()}
    states = {name: [method.prepare(w) for w in weights] for name, method in methods.items() if name != "wint8 torch"}
    states["wint8 torch"] = [cpu_linear.int8_per_channel(w) for w in weights]  # plain codes: the torch path
    if states["wint8 int8_gemm"][0][0].dim() != 4:
        raise SystemExit("wint8 does not run int8_gemm on this CPU (it needs AVX2)")

    def nbytes(state) -> int:
        parts = state if isinstance(state, tuple) else (getattr(state, "packed", state),)
        return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))

    state_bytes = {name: sum(map(nbytes, sts)) for name, sts in states.items()}
    rows_out = []
    for m in (int(r) for r in args.rows.split(",")):
        layers = len(SHAPES) if m <= 64 else 8
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
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
            r[f"x {name}"] = r["float32 (oneDNN)"] / r[name] if r.get(name) else None
    cols += [(f"x {name}", f"x fp32 {name.split()[0]}" + (" torch" if name == "wint8 torch" else ""), 2)
             for name in names[1:]]
    common.print_table("Linear methods on SmolLM2-135M's 121 layer shapes (ms per pass)", rows_out, cols, [
        f"w8a8 runs {'int8_gemm' if methods['w8a8'].panels else 'torch._int_mm / w8a8_linear'} on this CPU; "
        "above 64 rows 8 layers per pass; torch threads %d" % torch.get_num_threads(),
        "GB/s at <= 64 rows: " + ", ".join(f"{n} {rows_out[0].get(n + ' GB/s', 0):.1f}" for n in names
                                            if rows_out and rows_out[0].get(n + " GB/s")) + f" (at {rows_out[0]['rows']} rows)"
        if rows_out else ""])
    common.write_json(args.json, {"rows": rows_out, "machine": common.machine_info()})


if __name__ == "__main__":
    main()
