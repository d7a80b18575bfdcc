# The server lifecycle the side-by-side scripts share (bench_vs_vllm.sh, bench_vs_llamacpp.sh):
# sourced after the caller defines log() and sets OUT_DIR and START_TIMEOUT_S. One server at a
# time, its pid in SERVER_PID (its own process group); STARTUP_S after start_server.
# shellcheck shell=bash

# -- clean-up: the server of the moment (its whole process group) -------------------------
SERVER_PID=""
stop_server() {
    [[ -n $SERVER_PID ]] || return 0
    local pid=$SERVER_PID
    SERVER_PID=""
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true  # the launcher stops its own children
        for _ in $(seq 1 60); do  # 30 s to drain and exit
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        if kill -0 "$pid" 2>/dev/null; then
            log "server pid $pid did not stop on SIGTERM: SIGKILL"
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
    # what outlives the leader in its process group (vLLM's engine core and worker, the
    # multiprocessing resource tracker, our workers): 10 s to exit on their own
    for _ in $(seq 1 20); do
        pgrep -g "$pid" >/dev/null 2>&1 || break
        sleep 0.5
    done
    if pgrep -g "$pid" >/dev/null 2>&1; then
        log "leftovers of server pid $pid: $(pgrep -g "$pid" | tr '\n' ' ')- SIGTERM, then SIGKILL"
        kill -TERM -- "-$pid" 2>/dev/null || true
        sleep 5
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
}

start_server() {  # start_server NAME READY_CHECK CMD...: launch in its own process group, poll
    local name=$1 check=$2
    shift 2
    local logf=$OUT_DIR/$name-server.log
    log "starting $name: $*"
    local t0
    t0=$(date +%s.%N)
    setsid "$@" >"$logf" 2>&1 < /dev/null &
    SERVER_PID=$!
    while ! $check; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            log "$name exited before it was ready; the tail of $logf:"
            tail -n 40 "$logf" >&2
            SERVER_PID=""
            return 1
        fi
        if (( $(date +%s) - ${t0%.*} > START_TIMEOUT_S )); then
            log "$name not ready after $START_TIMEOUT_S s; the tail of $logf:"
            tail -n 40 "$logf" >&2
            return 1
        fi
        sleep 0.5
    done
    STARTUP_S=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    log "$name ready in $STARTUP_S s (pid $SERVER_PID)"
}

port_free() {  # port_free PORT: nothing listens on 127.0.0.1:PORT
    ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}
