# Shared by scripts/etcd.sh and scripts/mooncake.sh (sourced, not run): wait for a daemon started in
# the background to answer, and stop one by its pid file.

# wait_ready PID_FILE LOG WHAT CHECK...: run CHECK every 0.1 s for up to 10 s until it succeeds;
# fail (exit 1, the log's last lines on stderr) when the process exits first or time runs out
wait_ready() {
    local pid_file=$1 log=$2 what=$3
    shift 3
    for _ in $(seq 1 100); do
        "$@" && return 0
        if ! kill -0 "$(cat "$pid_file")" 2>/dev/null; then
            echo "$what exited at start; last log lines:" >&2
            tail -5 "$log" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "$what not answering after 10 s (log: $log)" >&2
    exit 1
}

# stop_pid_file PID_FILE WHAT: SIGTERM the process, wait up to 10 s, then SIGKILL; remove the file
stop_pid_file() {
    local pid_file=$1 what=$2
    [ -f "$pid_file" ] || { echo "no $(basename "$pid_file") for $what in $(dirname "$pid_file")" >&2; exit 1; }
    local pid; pid=$(cat "$pid_file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || { rm -f "$pid_file"; return 0; }
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$pid_file"
}
