#!/usr/bin/env bash
# A real etcd on loopback for service discovery (tests, local trials).
#
#   scripts/etcd.sh start [--port PORT] [--data-dir DIR]   start it in the background, wait until
#                                                          healthy, print its endpoint (127.0.0.1:PORT)
#   scripts/etcd.sh stop --data-dir DIR                    stop the etcd started on DIR (SIGTERM, then wait)
#
# PORT defaults to a free one; DIR to a new temporary folder. The pid and the log live in DIR, so a
# stop, then a start on the same --port and --data-dir, is a restart that keeps the keys and leases.
set -euo pipefail
. "$(dirname "$0")/daemon.sh"

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

free_port() {
    "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cmd=${1:-}; shift || true
port=""; data_dir=""
while [ $# -gt 0 ]; do
    case $1 in
        --port) port=$2; shift 2 ;;
        --data-dir) data_dir=$2; shift 2 ;;
        *) usage ;;
    esac
done

start() {
    command -v etcd >/dev/null || { echo "etcd.sh: etcd is not installed (scripts/setup.sh installs etcd-server)" >&2; exit 1; }
    [ -n "$port" ] || port=$(free_port)
    [ -n "$data_dir" ] || data_dir=$(mktemp -d -t heterollm-etcd-XXXXXX)
    mkdir -p "$data_dir"
    local peer; peer=$(free_port)
    # ETCD_UNSUPPORTED_ARCH lets Debian's etcd run on arm64 too; the data dir is private to this etcd
    ETCD_UNSUPPORTED_ARCH=${ETCD_UNSUPPORTED_ARCH:-arm64} nohup etcd --name heterollm-test \
        --data-dir "$data_dir/data" \
        --listen-client-urls "http://127.0.0.1:$port" --advertise-client-urls "http://127.0.0.1:$port" \
        --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "heterollm-test=http://127.0.0.1:$peer" \
        >>"$data_dir/etcd.log" 2>&1 </dev/null &
    echo $! >"$data_dir/etcd.pid"
    etcd_healthy() { curl -sf --max-time 1 "http://127.0.0.1:$port/health" 2>/dev/null | grep -q '"health":"true"'; }
    wait_ready "$data_dir/etcd.pid" "$data_dir/etcd.log" "etcd.sh: etcd on 127.0.0.1:$port" etcd_healthy
    echo "127.0.0.1:$port"
}

stop() {
    [ -n "$data_dir" ] || usage
    stop_pid_file "$data_dir/etcd.pid" "etcd.sh: etcd"
}

case $cmd in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
