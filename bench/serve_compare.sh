#!/usr/bin/env bash
# Serving, side by side, measured by vLLM's own client (`vllm bench serve`): heterollm's OpenAI
# server vs vLLM's (CPU build), same model, same random prompts, one server at a time.
#
#   bash bench/serve_compare.sh                          # concurrency 4 and 16, 4*C prompts each
#   bash bench/serve_compare.sh --concurrency "4 16" --num-prompts 64 --json serve.json
#   bash bench/serve_compare.sh --concurrency 2 --num-prompts 2 --output-len 4 --vllm-enforce-eager  # smoke
#
# Flags: --concurrency "C1 C2 ..." (default "4 16"), --num-prompts N (default 4*C per level),
#   --input-len 128, --output-len 64, --result-dir DIR (default a fresh folder under /tmp),
#   --json FILE (the table as JSON), --skip-heterollm, --skip-vllm, --vllm-enforce-eager (vLLM
#   without torch.compile: starts in ~30 s instead of ~110 s, slower; smoke tests only),
#   --vllm-start-timeout S (default 300), --heterollm-flags "..." (extra `heterollm serve` flags),
#   --startup-only (only launch to healthy, no client: needs no vLLM peer; implies --skip-vllm).
# vLLM serves in the dtype heterollm's --dtype auto resolves to on this CPU (bfloat16 where it is
# native, else float32, where vLLM's bf16 would run torch's emulated GEMM); VLLM_DTYPE overrides.
#
# Each server: launched, timed to its first healthy /health, one short warm-up request, then for
# each concurrency C `vllm bench serve --backend openai --endpoint /v1/completions --dataset-name
# random --random-input-len IN --random-output-len OUT --ignore-eos --temperature 0 --num-prompts N
# --max-concurrency C --save-result`, then SIGTERM. The client runs on the same 2 cores as the
# server, identically for both. vLLM's prefix cache is off (heterollm has none; random prompts
# barely hit it anyway). Needs `bash bench/peers.sh vllm model` (the client is vLLM's; without the
# vLLM peer nothing can be measured). Prints output tok/s, mean/median TTFT, mean TPOT for both
# and the ratios heterollm / vLLM, the exact command and the machine line.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PEERS=${HETEROLLM_PEERS_DIR:-$HOME/.cache/heterollm-peers}
VLLM_VENV="$PEERS/vllm"
MODEL_DIR="$PEERS/smollm2-hf"
PY="$ROOT/.venv/bin/python"
COMMAND="bash bench/serve_compare.sh${*:+ $(printf '%q ' "$@")}"
COMMAND=${COMMAND% }

CONCURRENCY="4 16"
NUM_PROMPTS=""
INPUT_LEN=128
OUTPUT_LEN=64
RESULT_DIR=""
JSON_OUT=""
SKIP_HETEROLLM=0
SKIP_VLLM=0
VLLM_EAGER=0
STARTUP_ONLY=0
VLLM_START_TIMEOUT=300
HETEROLLM_FLAGS=""

while [ $# -gt 0 ]; do
    case "$1" in
        --concurrency) CONCURRENCY=${2//,/ }; shift 2 ;;
        --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
        --input-len) INPUT_LEN=$2; shift 2 ;;
        --output-len) OUTPUT_LEN=$2; shift 2 ;;
        --result-dir) RESULT_DIR=$2; shift 2 ;;
        --json) JSON_OUT=$2; shift 2 ;;
        --skip-heterollm) SKIP_HETEROLLM=1; shift ;;
        --skip-vllm) SKIP_VLLM=1; shift ;;
        --vllm-enforce-eager) VLLM_EAGER=1; shift ;;
        --vllm-start-timeout) VLLM_START_TIMEOUT=$2; shift 2 ;;
        --heterollm-flags) HETEROLLM_FLAGS=$2; shift 2 ;;
        --startup-only) STARTUP_ONLY=1; SKIP_VLLM=1; shift ;;
        -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown flag: $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[serve_compare] %s\n' "$*" >&2; }

[ -x "$PY" ] || { echo "the project's .venv is missing: run scripts/setup.sh" >&2; exit 1; }
if [ "$STARTUP_ONLY" = 1 ]; then
    :  # no client, no vLLM server: nothing of the peer is needed
elif [ ! -f "$VLLM_VENV/.heterollm-peer" ] || [ ! -x "$VLLM_VENV/bin/vllm" ]; then
    echo "peer vllm not installed (run bash bench/peers.sh vllm): its client \`vllm bench serve\` is what measures" >&2
    exit 1
fi
[ "$STARTUP_ONLY" = 1 ] || [ -f "$MODEL_DIR/config.json" ] || {
    echo "peer model not installed (run bash bench/peers.sh model)" >&2; exit 1; }

export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# the CLI asks importlib.metadata for "vllm"; peers.sh installs a shim that answers for vllm-cpu
[ "$STARTUP_ONLY" = 1 ] || "$VLLM_VENV/bin/vllm" --version >/dev/null 2>&1 || {
    echo "\`$VLLM_VENV/bin/vllm --version\` fails (the importlib.metadata \"vllm\" shim?):" \
        "re-run bash bench/peers.sh vllm" >&2
    exit 1
}

RESULT_DIR=${RESULT_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/heterollm-serve-compare-$(date +%Y%m%d-%H%M%S)-XXXX")}
mkdir -p "$RESULT_DIR"
log "results and server logs in $RESULT_DIR"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }

SERVER_PID=""
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        log "stopping server (process group $SERVER_PID, SIGTERM)"
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            log "server still up after 60 s: SIGKILL"
            kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
}
trap stop_server EXIT
trap 'exit 130' INT TERM

# start_server NAME LOG CMD...: in its own process group (so it and its children can be stopped together)
start_server() {
    local name=$1 logfile=$2; shift 2
    log "starting $name: $*"
    setsid "$@" >"$logfile" 2>&1 &
    SERVER_PID=$!
}

# wait_healthy NAME URL TIMEOUT: seconds from now until /health answers 200, on stdout
wait_healthy() {
    local name=$1 url=$2 timeout=$3 t0 logfile=$4
    t0=$(now)
    while :; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "$name exited before it was healthy; the end of its log ($logfile):"
            tail -30 "$logfile" >&2
            return 1
        fi
        if curl -sf -o /dev/null --max-time 2 "$url/health"; then
            break
        fi
        if "$PY" -c "import sys; sys.exit(0 if float(sys.argv[1]) - float(sys.argv[2]) > float(sys.argv[3]) else 1)" \
            "$(now)" "$t0" "$timeout"; then
            log "$name not healthy after $timeout s; the end of its log ($logfile):"
            tail -30 "$logfile" >&2
            return 1
        fi
        sleep 0.5
    done
}

warm_up() {
    curl -sf -o /dev/null --max-time 120 "$1/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model": "smollm2", "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0}' \
        || log "warm-up request to $1 failed (continuing)"
}

# bench ENGINE URL: one `vllm bench serve` per concurrency level
bench() {
    local engine=$1 url=$2 c n
    for c in $CONCURRENCY; do
        n=${NUM_PROMPTS:-$((4 * c))}
        log "$engine: vllm bench serve, $n prompts, concurrency $c"
        "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "$url" --endpoint /v1/completions \
            --model smollm2 --tokenizer "$MODEL_DIR" --dataset-name random \
            --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos --temperature 0 \
            --num-prompts "$n" --max-concurrency "$c" --seed 0 --disable-tqdm \
            --percentile-metrics ttft,tpot,itl,e2el \
            --save-result --result-dir "$RESULT_DIR" --result-filename "$engine-c$c.json" \
            >"$RESULT_DIR/$engine-c$c.log" 2>&1 || {
            log "$engine: vllm bench serve failed at concurrency $c; the end of its log:"
            tail -20 "$RESULT_DIR/$engine-c$c.log" >&2
        }
    done
}

STARTUP_FILE="$RESULT_DIR/startup.json"
echo '{}' >"$STARTUP_FILE"
record_startup() {  # record_startup ENGINE SECONDS
    "$PY" - "$STARTUP_FILE" "$1" "$2" <<'EOF'
import json, sys
p, k, v = sys.argv[1], sys.argv[2], float(sys.argv[3])
d = json.load(open(p)); d[k] = v; json.dump(d, open(p, "w"))
EOF
}

if [ "$SKIP_HETEROLLM" = 0 ]; then
    port=$(free_port)
    url="http://127.0.0.1:$port"
    # shellcheck disable=SC2086  # HETEROLLM_FLAGS is a list of flags
    start_server heterollm "$RESULT_DIR/heterollm-server.log" "$ROOT/.venv/bin/heterollm" serve --model smollm2 \
        --host=127.0.0.1 --port="$port" --uvicorn_log_level=warning --max_concurrent_requests=0 $HETEROLLM_FLAGS
    t0=$(now)
    if wait_healthy heterollm "$url" 600 "$RESULT_DIR/heterollm-server.log"; then
        t=$("$PY" -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" "$(now)" "$t0")
        log "heterollm healthy $t s after launch"
        record_startup heterollm "$t"
        if [ "$STARTUP_ONLY" = 0 ]; then
            warm_up "$url"
            bench heterollm "$url"
        fi
    fi
    stop_server
fi

if [ "$SKIP_VLLM" = 0 ]; then
    port=$(free_port)
    url="http://127.0.0.1:$port"
    eager=()
    [ "$VLLM_EAGER" = 1 ] && eager=(--enforce-eager)
    dtype=${VLLM_DTYPE:-$("$PY" -c "from heterollm_cpu.platform import CpuPlatform
print('bfloat16' if CpuPlatform().supports_dtype('bfloat16') else 'float32')")}
    log "vLLM in $dtype"
    start_server vllm "$RESULT_DIR/vllm-server.log" "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" --dtype "$dtype" \
        --host 127.0.0.1 --port "$port" --served-model-name smollm2 --no-enable-prefix-caching \
        --disable-uvicorn-access-log "${eager[@]}"
    t0=$(now)
    if wait_healthy vllm "$url" "$VLLM_START_TIMEOUT" "$RESULT_DIR/vllm-server.log"; then
        t=$("$PY" -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" "$(now)" "$t0")
        log "vllm healthy $t s after launch"
        record_startup vllm "$t"
        warm_up "$url"
        bench vllm "$url"
    fi
    stop_server
fi

BENCH_DIR="$ROOT/bench" "$PY" - "$RESULT_DIR" "$CONCURRENCY" "$INPUT_LEN" "$OUTPUT_LEN" "$VLLM_EAGER" "$COMMAND" \
    "${JSON_OUT:-}" <<'EOF'
import json, os, sys
sys.path.insert(0, os.environ["BENCH_DIR"])
import common

d, levels, inp, out, eager, command, json_out = sys.argv[1:8]
startup = json.load(open(os.path.join(d, "startup.json")))
rows, table = [], {}
for c in levels.split():
    for engine in ("heterollm", "vllm"):
        p = os.path.join(d, f"{engine}-c{c}.json")
        if not os.path.exists(p):
            continue
        r = json.load(open(p))
        label = engine if engine == "heterollm" else ("vLLM (eager)" if eager == "1" else "vLLM")
        row = {"engine": label, "concurrency": int(c), "prompts": r.get("num_prompts", r.get("completed")),
               "completed": r.get("completed"), "failed": r.get("failed", 0),
               "out_tok_s": r.get("output_throughput"), "req_s": r.get("request_throughput"),
               "ttft_mean_ms": r.get("mean_ttft_ms"), "ttft_median_ms": r.get("median_ttft_ms"),
               "tpot_mean_ms": r.get("mean_tpot_ms"), "startup_s": startup.get(engine), "file": p}
        rows.append(row)
        table[(engine, c)] = row
for c in levels.split():
    h, v = table.get(("heterollm", c)), table.get(("vllm", c))
    if h and v:
        rows.append({"engine": "heterollm/vLLM", "concurrency": int(c),
                     "out_tok_s": h["out_tok_s"] / v["out_tok_s"] if v["out_tok_s"] else None,
                     "req_s": h["req_s"] / v["req_s"] if v["req_s"] else None,
                     "ttft_mean_ms": h["ttft_mean_ms"] / v["ttft_mean_ms"] if v["ttft_mean_ms"] else None,
                     "ttft_median_ms": h["ttft_median_ms"] / v["ttft_median_ms"] if v["ttft_median_ms"] else None,
                     "tpot_mean_ms": h["tpot_mean_ms"] / v["tpot_mean_ms"] if v["tpot_mean_ms"] else None,
                     "startup_s": h["startup_s"] / v["startup_s"] if h["startup_s"] and v["startup_s"] else None})
cols = [("engine", "engine", 0), ("concurrency", "C", 0), ("completed", "done", 0), ("failed", "failed", 0),
        ("out_tok_s", "out tok/s", 2), ("req_s", "req/s", 3), ("ttft_mean_ms", "TTFT mean ms", 2),
        ("ttft_median_ms", "TTFT p50 ms", 2), ("tpot_mean_ms", "TPOT mean ms", 2), ("startup_s", "start s", 1)]
machine = common.machine_info()
notes = [f"vllm bench serve --backend openai --endpoint /v1/completions, random dataset {inp} in / {out} out tokens, "
         f"--ignore-eos --temperature 0, N prompts at max concurrency C, one server at a time on the same cores",
         "heterollm/vLLM rows: ratios (throughput > 1 and latency < 1 favour heterollm); "
         "start s: launch to first healthy /health",
         f"result JSONs and server logs: {d}"]
common.command_line = lambda: command  # what print_table shows as the command
common.print_table("Serving (CPU), measured by vLLM's client", rows, cols, notes, machine)
if json_out:
    common.write_json(json_out, {"command": command, "machine": machine, "startup_s": startup, "rows": rows})
EOF
