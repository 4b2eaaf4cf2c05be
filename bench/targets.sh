#!/usr/bin/env bash
# Issue 19's target table on this machine, one command per row, then the table itself:
#
#   bash bench/targets.sh                      # every row (~30 min on 2 cores; needs bash bench/peers.sh)
#   bash bench/targets.sh --rows offline,batch1 --soak-seconds 120
#
# Rows (each prints its own full table too, and leaves its JSON in the result folder):
#   offline  VLLM_CPU_NUM_OF_RESERVED_CPU=0 python bench/throughput.py --configs bf16,w8a8,wint8 --skip-hf --peers vllm
#            target: >= 2x vLLM's output tok/s
#   serve    VLLM_CPU_NUM_OF_RESERVED_CPU=0 bash bench/serve_compare.sh  (then the same server flags with
#            --quantization w8a8 and with wint8, vLLM skipped); target: >= 1.5x vLLM's output tok/s at C=4 and C=16, mean
#            TTFT below vLLM's
#   batch1   python bench/latency.py --configs bf16,wint4,w8a8,wint8 --peers llamacpp
#            targets: wint4 >= llama.cpp Q4_1's decode tok/s; bf16 >= 80% of the memory-bandwidth bound
#   soak     python bench/serving.py --num-prompts 32 --concurrency 8 --duration SOAK  (default 600 s)
#            target: RSS flat (last third of the rounds vs the first third)
#   graph    TORCHINDUCTOR_CACHE_DIR=<empty> bash bench/serve_compare.sh --startup-only
#            --heterollm-flags --enable_graph, then the same without it (eager, for the ratio); target:
#            start to healthy <= 30 s with the compile cache empty
#
# vLLM gets both cores (VLLM_CPU_NUM_OF_RESERVED_CPU=0), its stronger setting on a 2-vCPU machine; heterollm
# ignores the variable. Nothing else should run on the machine meanwhile.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="$ROOT/.venv/bin/python"
ROWS="offline,serve,batch1,soak,graph"
SOAK=600
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rows) ROWS=$2; shift 2 ;;
        --soak-seconds) SOAK=$2; shift 2 ;;
        --result-dir) OUT=$2; shift 2 ;;
        -h | --help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown flag: $1 (see --help)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/heterollm-targets-$(date +%Y%m%d-%H%M%S)-XXXX")}
mkdir -p "$OUT"
cd "$ROOT"
has() { case ",$ROWS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run() {  # run NAME CMD...: print the command, run it, keep its output
    local name=$1; shift
    echo "== $name: $*" | tee -a "$OUT/commands.txt"
    "$@" 2>&1 | tee "$OUT/$name.log" || echo "== $name failed (exit ${PIPESTATUS[0]}); see $OUT/$name.log"
}

if has offline; then
    run offline env VLLM_CPU_NUM_OF_RESERVED_CPU=0 "$PY" bench/throughput.py --configs bf16,w8a8,wint8 --skip-hf \
        --peers vllm --json "$OUT/offline.json"
fi
if has serve; then
    run serve env VLLM_CPU_NUM_OF_RESERVED_CPU=0 bash bench/serve_compare.sh --json "$OUT/serve.json"
    run serve_w8a8 bash bench/serve_compare.sh --skip-vllm --heterollm-flags "--quantization w8a8" \
        --json "$OUT/serve_w8a8.json"
    run serve_wint8 bash bench/serve_compare.sh --skip-vllm --heterollm-flags "--quantization wint8" \
        --json "$OUT/serve_wint8.json"
fi
if has batch1; then
    run batch1 "$PY" bench/latency.py --configs bf16,wint4,w8a8,wint8 --peers llamacpp --json "$OUT/batch1.json"
fi
if has soak; then
    run soak "$PY" bench/serving.py --num-prompts 32 --concurrency 8 --duration "$SOAK" --json "$OUT/soak.json"
fi
if has graph; then
    cache=$(mktemp -d "${TMPDIR:-/tmp}/heterollm-inductor-XXXX")
    run graph env TORCHINDUCTOR_CACHE_DIR="$cache" bash bench/serve_compare.sh --startup-only \
        --heterollm-flags "--enable_graph" --json "$OUT/graph.json"
    run eager-start bash bench/serve_compare.sh --startup-only --json "$OUT/eager_start.json"
    rm -rf "$cache"
fi

"$PY" - "$OUT" <<'EOF'
import json, os, sys
sys.path.insert(0, "bench")
import common

out = sys.argv[1]


def load(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None


lines = []  # (workload, heterollm, peer, ratio, target, met)
off = load("offline")
if off:
    vllm = next((r for r in off["rows"] if r["engine"].startswith("vLLM")), None)
    for r in off["rows"]:
        if r["engine"].startswith("heterollm") and vllm:
            ratio = r["out_tok_s"] / vllm["out_tok_s"]
            lines.append((f"offline 64 x 128/128, out tok/s ({r['weights']})", f"{r['out_tok_s']:.1f}",
                          f"vLLM {vllm['out_tok_s']:.1f}", f"{ratio:.2f}x", ">= 2x", ratio >= 2))
serve = load("serve")
for data, tag in ((serve, "--dtype auto"), (load("serve_w8a8"), "w8a8"), (load("serve_wint8"), "wint8")):
    if not data:
        continue
    for r in data["rows"]:
        if r.get("engine") != "heterollm":
            continue
        peer = next((p for p in (serve or {}).get("rows", []) if p.get("engine") == "vLLM"
                     and p.get("concurrency") == r.get("concurrency")), None)
        if peer and all(d.get(k) for d in (r, peer) for k in ("out_tok_s", "ttft_mean_ms")):
            ratio = r["out_tok_s"] / peer["out_tok_s"]
            ttft = r["ttft_mean_ms"] / peer["ttft_mean_ms"]
            lines.append((f"vllm bench serve C={r['concurrency']}, out tok/s, mean TTFT ms ({tag})",
                          f"{r['out_tok_s']:.1f}, {r['ttft_mean_ms']:.0f}",
                          f"vLLM {peer['out_tok_s']:.1f}, {peer['ttft_mean_ms']:.0f}",
                          f"{ratio:.2f}x, TTFT {ttft:.2f}x", ">= 1.5x, TTFT < 1x", ratio >= 1.5 and ttft < 1))
b1 = load("batch1")
if b1:
    llama = next((r for r in b1["rows"] if r["engine"].startswith("llama.cpp")), None)
    for r in b1["rows"]:
        if not r["engine"].startswith("heterollm"):
            continue
        if "wint4" in r["weights"] and llama and llama.get("decode_tok_s") and r.get("decode_tok_s"):
            ratio = r["decode_tok_s"] / llama["decode_tok_s"]
            lines.append(("batch 1 decode tok/s, wint4 vs llama.cpp Q4_1", f"{r['decode_tok_s']:.1f}",
                          f"llama.cpp {llama['decode_tok_s']:.1f}", f"{ratio:.2f}x", ">= 1x", ratio >= 1))
        elif "wint8" in r["weights"] and llama and llama.get("decode_tok_s") and r.get("decode_tok_s"):
            ratio = r["decode_tok_s"] / llama["decode_tok_s"]  # no target of its own: the int8 row beside wint4's
            lines.append(("batch 1 decode tok/s, wint8 vs llama.cpp Q4_1", f"{r['decode_tok_s']:.1f}",
                          f"llama.cpp {llama['decode_tok_s']:.1f}", f"{ratio:.2f}x", "-", None))
        if r.get("of_bound") is not None:
            target = ">= 80%" if r["weights"] in ("bfloat16", "float32") else "-"
            lines.append((f"batch 1 decode tok/s, {r['weights']} vs the bandwidth bound", f"{r['decode_tok_s']:.1f}",
                          f"bound {r['bound_tok_s']:.0f}", f"{100 * r['of_bound']:.0f}%", target,
                          r["of_bound"] >= 0.8 if target != "-" else None))
soak = load("soak")
if soak and soak.get("memory_mib", {}).get("rounds"):
    rss = soak["memory_mib"]["rounds"]
    third = max(1, len(rss) // 3)
    growth = sum(rss[-third:]) / third - sum(rss[:third]) / third
    lines.append((f"RSS over a {soak['memory_mib'].get('soak_s', 0):.0f} s soak at C=8 ({len(rss)} rounds)",
                  f"{min(rss):.0f}-{max(rss):.0f} MiB", "-", f"{growth:+.1f} MiB (last third - first)",
                  "flat", abs(growth) < 0.02 * max(rss)))
graph, eager = load("graph"), load("eager_start")
eager_s = (eager or {}).get("startup_s", {}).get("heterollm")
if graph and graph.get("startup_s", {}).get("heterollm") is not None:
    s = graph["startup_s"]["heterollm"]
    lines.append(("--enable_graph start to healthy, compile cache empty", f"{s:.1f} s",
                  f"eager {eager_s:.1f} s" if eager_s else "-", f"{s / eager_s:.1f}x eager" if eager_s else "-",
                  "<= 30 s", s <= 30))
if serve and serve.get("startup_s") or eager_s:
    st = dict((serve or {}).get("startup_s") or {}) or {"heterollm": eager_s}
    if "heterollm" in st:
        lines.append(("start to healthy (eager)", f"{st['heterollm']:.1f} s",
                      f"vLLM {st['vllm']:.1f} s" if "vllm" in st else "-", "-", "<= 15 s", st["heterollm"] <= 15))

print("\nIssue 19's targets on this machine")
print(common.machine_line(common.machine_info()))
print("| workload | heterollm | peer | ratio | target | met |")
print("|---|---|---|---|---|---|")
for w, h, p, r, t, m in lines:
    print(f"| {w} | {h} | {p} | {r} | {t} | {'-' if m is None else ('yes' if m else 'no')} |")
print(f"commands: {os.path.join(out, 'commands.txt')}")
EOF
