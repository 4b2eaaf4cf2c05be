#!/usr/bin/env bash
# Mooncake's store master on loopback, with its own HTTP metadata server (tests, local trials).
#
#   scripts/mooncake.sh start [--port PORT] [--metadata-port PORT] [--dir DIR]
#       start mooncake_master in the background, wait until both ports answer, print
#       "MASTER_ADDRESS METADATA_URL" (127.0.0.1:PORT http://127.0.0.1:PORT/metadata)
#   scripts/mooncake.sh stop --dir DIR    stop the master started on DIR (SIGTERM, then wait)
#
# The ports default to free ones, DIR to a new temporary folder holding the pid and the log. The
# master comes from the Python environment's Mooncake wheel (scripts/setup.sh installs it).
set -euo pipefail
. "$(dirname "$0")/daemon.sh"

usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
PY=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[ -x "$PY" ] || PY=python3

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

answers() {  # host port
    "$PY" -c 'import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()' "$@" 2>/dev/null
}

cmd=${1:-}; shift || true
port=""; meta_port=""; dir=""
while [ $# -gt 0 ]; do
    case $1 in
        --port) port=$2; shift 2 ;;
        --metadata-port) meta_port=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        *) usage ;;
    esac
done

start() {
    local master; master=$(dirname "$PY")/mooncake_master
    [ -x "$master" ] || master=$(command -v mooncake_master) \
        || { echo "mooncake.sh: mooncake_master is not installed (pip install 'heterollm[kv]')" >&2; exit 1; }
    [ -n "$port" ] || port=$(free_port)
    [ -n "$meta_port" ] || meta_port=$(free_port)
    [ -n "$dir" ] || dir=$(mktemp -d -t heterollm-mooncake-XXXXXX)
    mkdir -p "$dir"
    local admin; admin=$(free_port)
    nohup "$master" --rpc_address 127.0.0.1 --rpc_port "$port" \
        --enable_http_metadata_server=true --http_metadata_server_host 127.0.0.1 \
        --http_metadata_server_port "$meta_port" --metrics_port "$admin" --enable_metric_reporting=false \
        >>"$dir/master.log" 2>&1 </dev/null &
    echo $! >"$dir/master.pid"
    both_answer() { answers 127.0.0.1 "$port" && answers 127.0.0.1 "$meta_port"; }
    wait_ready "$dir/master.pid" "$dir/master.log" "mooncake.sh: mooncake_master on 127.0.0.1:$port" both_answer
    echo "127.0.0.1:$port http://127.0.0.1:$meta_port/metadata"
}

stop() {
    [ -n "$dir" ] || usage
    stop_pid_file "$dir/master.pid" "mooncake.sh: mooncake_master"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
