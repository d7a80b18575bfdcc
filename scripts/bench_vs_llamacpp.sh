#!/usr/bin/env bash
# sluiceway against llama.cpp's `llama-server`, side by side on this machine, one server after
# the other, the same .gguf file, the same number of threads, the same client.
#
#   bash scripts/bench_vs_llamacpp.sh                                    # llama.cpp, sluiceway
#   MODES="--quantization none|--quantization gguf|--quantization gguf --kv-cache-dtype int8" \
#       bash scripts/bench_vs_llamacpp.sh                                # three sluiceway modes
#   NUM_PROMPTS=16 SINGLE_REPS=2 bash scripts/bench_vs_llamacpp.sh       # a smoke run
#   bash scripts/bench_vs_llamacpp.sh --build                            # build llama-server first
#
# Steps:
#   1. llama-server: $LLAMA_CPP_DIR/build/bin/llama-server, built from source outside the
#      repository (never a dependency). With --build, when that binary is missing:
#        cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
#        cmake --build build --target llama-server -j $(nproc)
#      in $LLAMA_CPP_DIR (a checkout of github.com/ggerganov/llama.cpp; ~6.5 min on 2 cores).
#   2. the model: MODEL, a .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF,
#      sluiceway.model_files.embedded_model_path()). Both servers load that very file;
#      sluiceway's client takes its tokenizer from it (`bench serve --model MODEL`).
#   3. per engine: start the server, poll until it is ready, run two workloads with
#      `sluiceway bench serve --backend openai --no-keep-alive` (streamed POST /v1/completions,
#      prompts as token ids, greedy, ignore_eos: every request yields exactly its output
#      length; the same client and protocol for every engine; a connection per request, as
#      llama-server closes the connection after each streamed response), stop it:
#        single  batch 1: SINGLE_REPS requests of 256 random prompt tokens -> 128 output tokens,
#                one at a time (--max-concurrency 1); decode tok/s = 1000 / TPOT P50 (ms)
#        W1      NUM_PROMPTS requests of 256 -> 128, all at once (--request-rate inf)
#      Engines: llamacpp (llama-server -t THREADS -tb THREADS -np LLAMA_SLOTS -c
#      LLAMA_SLOTS*LLAMA_SLOT_CTX -cb --timeout LLAMA_TIMEOUT_S: continuous batching over
#      LLAMA_SLOTS slots, each of LLAMA_SLOT_CTX tokens), then one sluiceway server per mode
#      of MODES (`serve --model MODEL --num-threads THREADS --dtype DTYPE --max-num-seqs
#      MAX_NUM_SEQS --max-num-batched-tokens MAX_NUM_BATCHED_TOKENS --kv-cache-memory
#      KV_CACHE_GIB GiB` plus the mode's flags).
#   4. a markdown table (summary.md): per engine/mode single-stream decode tok/s, W1 output
#      tok/s, TTFT P50, TPOT P50, and the ratios against llama.cpp and against REFERENCE_MODE.
#
# Output ($OUT_DIR): <engine>-single.json and <engine>-W1.json (the client's --save-result),
# <engine>-server.log, <engine>-<workload>.log (client output), meta.json (machine, commits,
# load average around each run, start-up times), summary.md. <engine>: llamacpp, or sluiceway-
# plus the mode's flags as a slug (sluiceway-default, sluiceway-quantization-gguf, ...).
#
# Environment: MODES ("default": a |-separated list of `serve` flag sets, "default" = none),
# REFERENCE_MODE (the mode the "vs sluiceway" ratio divides by; default: the first of MODES),
# ENGINES ("llamacpp sluiceway"), MODEL (the embedded GGUF), THREADS (2), NUM_PROMPTS (200),
# SINGLE_REPS (5), INPUT_LEN (256), OUTPUT_LEN (128), LLAMA_CPP_DIR
# (~/.cache/sluiceway-bench/llama.cpp), LLAMA_SERVER ($LLAMA_CPP_DIR/build/bin/llama-server),
# LLAMA_SLOTS (16), LLAMA_SLOT_CTX (512: tokens per slot, >= INPUT_LEN + OUTPUT_LEN),
# LLAMA_TIMEOUT_S (7200: llama-server's --timeout, past W1's longest queue wait),
# LLAMA_ARGS (more llama-server flags), SERVED_NAME (SmolLM2-135M-Instruct), DTYPE
# (bfloat16), MAX_NUM_SEQS (256), MAX_NUM_BATCHED_TOKENS (2048), KV_CACHE_GIB (4),
# SLUICEWAY_SERVE_ARGS (more `serve` flags for every mode), OUT_DIR (docs/bench/vs-llamacpp),
# LLAMA_PORT (18090), SLUICEWAY_PORT (18051), SLUICEWAY_HTTP_PORT (18080), START_TIMEOUT_S
# (900), PROJECT_PYTHON (.venv/bin/python), NOTE (a line for meta.json and summary.md, e.g.
# how quiet the machine was).
# Options: --build (build llama-server when missing). Exit status 0 when every run finished
# with every request answered in full.
#
# Figures need a quiet machine: llama.cpp's thread pool busy-waits at its barriers, so
# `-t 2` on 2 cores shared with other work is far slower than its quiet figure; meta.json
# records the load average before and after each run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

BUILD=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --build) BUILD=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench_vs_llamacpp: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

PROJECT_PYTHON=${PROJECT_PYTHON:-$REPO/.venv/bin/python}
SLUICEWAY=$(dirname "$PROJECT_PYTHON")/sluiceway
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-$HOME/.cache/sluiceway-bench/llama.cpp}
LLAMA_SERVER=${LLAMA_SERVER:-$LLAMA_CPP_DIR/build/bin/llama-server}
MODES=${MODES:-default}
ENGINES=${ENGINES:-llamacpp sluiceway}
MODEL=${MODEL:-}
THREADS=${THREADS:-2}
NUM_PROMPTS=${NUM_PROMPTS:-200}
SINGLE_REPS=${SINGLE_REPS:-5}
INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-128}
LLAMA_SLOTS=${LLAMA_SLOTS:-16}
LLAMA_SLOT_CTX=${LLAMA_SLOT_CTX:-512}
LLAMA_ARGS=${LLAMA_ARGS:-}
# llama-server closes a connection that has sent nothing for --timeout seconds (600 by default):
# W1's last requests wait longer than that in its queue on a slow machine (8 of 200 were cut,
# ReadError, on 2026-12-03 when its W1 took 1,099 s)
LLAMA_TIMEOUT_S=${LLAMA_TIMEOUT_S:-7200}
SERVED_NAME=${SERVED_NAME:-SmolLM2-135M-Instruct}
DTYPE=${DTYPE:-bfloat16}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
KV_CACHE_GIB=${KV_CACHE_GIB:-4}
SLUICEWAY_SERVE_ARGS=${SLUICEWAY_SERVE_ARGS:-}
OUT_DIR=${OUT_DIR:-docs/bench/vs-llamacpp}
LLAMA_PORT=${LLAMA_PORT:-18090}
SLUICEWAY_PORT=${SLUICEWAY_PORT:-18051}
SLUICEWAY_HTTP_PORT=${SLUICEWAY_HTTP_PORT:-18080}
START_TIMEOUT_S=${START_TIMEOUT_S:-900}

for v in THREADS NUM_PROMPTS SINGLE_REPS INPUT_LEN OUTPUT_LEN LLAMA_SLOTS LLAMA_SLOT_CTX; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "bench_vs_llamacpp: $v must be a positive integer, not ${!v}" >&2; exit 2; }
done
(( LLAMA_SLOT_CTX >= INPUT_LEN + OUTPUT_LEN )) || {
    echo "bench_vs_llamacpp: LLAMA_SLOT_CTX ($LLAMA_SLOT_CTX) < INPUT_LEN + OUTPUT_LEN" >&2; exit 2; }
for e in $ENGINES; do
    case $e in llamacpp|sluiceway) ;; *) echo "bench_vs_llamacpp: unknown engine $e (llamacpp sluiceway)" >&2; exit 2 ;; esac
done
case $LLAMA_CPP_DIR/ in "$REPO"/*)
    echo "bench_vs_llamacpp: LLAMA_CPP_DIR must be outside the repository ($REPO)" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
log() { printf '[bench_vs_llamacpp %(%H:%M:%S)T] %s\n' -1 "$*"; }

# shellcheck source=scripts/bench_servers.sh
source "$REPO/scripts/bench_servers.sh"  # stop_server, start_server, port_free
trap 'stop_server; rm -f "${RUNS_TSV:-}"' EXIT
trap 'log "interrupted"; exit 130' INT TERM

# -- 1. llama-server ------------------------------------------------------------------------
if [[ " $ENGINES " == *" llamacpp "* && ! -x $LLAMA_SERVER ]]; then
    if (( ! BUILD )) || [[ ! -f $LLAMA_CPP_DIR/CMakeLists.txt ]]; then
        log "no $LLAMA_SERVER: check out github.com/ggerganov/llama.cpp into $LLAMA_CPP_DIR and run with --build (or set LLAMA_SERVER)"
        exit 2
    fi
    log "building llama-server in $LLAMA_CPP_DIR (~6.5 min on 2 cores)"
    (cd "$LLAMA_CPP_DIR" && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF >/dev/null \
        && cmake --build build --target llama-server -j "$(nproc)" >/dev/null)
fi

# -- 2. the model ---------------------------------------------------------------------------
if [[ -z $MODEL ]]; then
    MODEL=$("$PROJECT_PYTHON" -c 'from sluiceway.model_files import embedded_model_path; print(embedded_model_path())')
fi
[[ -f $MODEL && $MODEL == *.gguf ]] || { log "MODEL must be a .gguf file, not $MODEL"; exit 2; }
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
log "model: $MODEL ($(du -h "$MODEL" | cut -f1))"

# -- 3. one server, its workloads -----------------------------------------------------------

llamacpp_ready() { curl -sf -o /dev/null "http://127.0.0.1:$LLAMA_PORT/health"; }
sluiceway_ready() { grep -qs "^sluiceway: OpenAI-compatible API" "$OUT_DIR/$ENGINE-server.log"; }
loadavg() { cut -d' ' -f1-3 /proc/loadavg; }

workload_flags() {  # the client flags of workload $1
    echo "--dataset-name random --random-input-len $INPUT_LEN --random-output-len $OUTPUT_LEN"
    echo "--random-range-ratio 0 --ignore-eos"
    case $1 in
        single) echo "--num-prompts $SINGLE_REPS --max-concurrency 1 --seed 1" ;;
        W1) echo "--num-prompts $NUM_PROMPTS --request-rate inf --seed 0" ;;
    esac
}

FAILED=0
RUNS_TSV=$(mktemp)  # engine, mode flags, start-up s, load before, load after, seconds
record_run() {  # record_run ENGINE MODE STARTUP_S (-1: did not start) LOAD_BEFORE T0
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(loadavg)" "$((SECONDS - $5))" >>"$RUNS_TSV"
}
run_engine() {  # run_engine ENGINE [MODE FLAGS...]: $ENGINE names its files
    local engine=$1 mode=$2 port w flags out load0 t0
    load0=$(loadavg)
    t0=$SECONDS
    case $engine in
        llamacpp)
            port=$LLAMA_PORT
            port_free "$port" || { log "port $port is taken (LLAMA_PORT)"; return 1; }
            # shellcheck disable=SC2086
            start_server "$engine" llamacpp_ready "$LLAMA_SERVER" -m "$MODEL" --alias "$SERVED_NAME" \
                --host 127.0.0.1 --port "$port" -t "$THREADS" -tb "$THREADS" -np "$LLAMA_SLOTS" \
                -c $((LLAMA_SLOTS * LLAMA_SLOT_CTX)) -cb --no-webui --timeout "$LLAMA_TIMEOUT_S" $LLAMA_ARGS \
                || { record_run "$engine" "$mode" -1 "$load0" "$t0"; return 1; }
            ;;
        *)
            port=$SLUICEWAY_HTTP_PORT
            port_free "$SLUICEWAY_PORT" || { log "port $SLUICEWAY_PORT is taken (SLUICEWAY_PORT)"; return 1; }
            port_free "$port" || { log "port $port is taken (SLUICEWAY_HTTP_PORT)"; return 1; }
            # shellcheck disable=SC2086
            start_server "$engine" sluiceway_ready "$SLUICEWAY" serve --model "$MODEL" \
                --served-model-name "$SERVED_NAME" --host 127.0.0.1 --port "$SLUICEWAY_PORT" \
                --http-port "$port" --metrics-port -1 --log-format console \
                --num-threads "$THREADS" --dtype "$DTYPE" --max-num-seqs "$MAX_NUM_SEQS" \
                --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" \
                --kv-cache-memory "${KV_CACHE_GIB}GiB" $SLUICEWAY_SERVE_ARGS $mode \
                || { record_run "$engine" "$mode" -1 "$load0" "$t0"; return 1; }
            ;;
    esac
    local startup=$STARTUP_S
    for w in single W1; do
        flags=$(workload_flags "$w" | tr '\n' ' ')
        out=$OUT_DIR/$engine-$w.json
        rm -f "$out"
        log "$engine $w: $flags"
        local tw=$SECONDS
        # shellcheck disable=SC2086
        "$SLUICEWAY" bench serve --backend openai --base-url "http://127.0.0.1:$port" --no-keep-alive \
            --served-model-name "$SERVED_NAME" --model "$MODEL" $flags --save-result "$out" \
            >"$OUT_DIR/$engine-$w.log" 2>&1 || true
        if [[ -f $out ]]; then
            log "$engine $w: $((SECONDS - tw)) s"
            sed -n '/Serving Benchmark Result/,/^=\{20,\}$/p' "$OUT_DIR/$engine-$w.log" | head -n 30
        else
            log "$engine $w: no result; the tail of $OUT_DIR/$engine-$w.log:"
            tail -n 30 "$OUT_DIR/$engine-$w.log" >&2
            FAILED=1
        fi
    done
    log "stopping $engine"
    stop_server
    record_run "$engine" "$mode" "$startup" "$load0" "$t0"
}

T_ALL=$SECONDS
for e in $ENGINES; do
    if [[ $e == llamacpp ]]; then
        run_engine llamacpp "" || { FAILED=1; stop_server; }
        continue
    fi
    IFS='|' read -r -a mode_list <<<"$MODES"
    for mode in "${mode_list[@]}"; do
        mode=$(echo "$mode" | xargs)  # trim
        [[ $mode == default ]] && mode=""
        ENGINE=sluiceway-$("$PROJECT_PYTHON" scripts/bench_vs_llamacpp.py slug "$mode")
        run_engine "$ENGINE" "$mode" || { FAILED=1; stop_server; }
    done
done

# -- 4. meta.json and the table -------------------------------------------------------------
llama_commit=$(git -C "$LLAMA_CPP_DIR" rev-parse HEAD 2>/dev/null || cat "$LLAMA_CPP_DIR/COMMIT" 2>/dev/null || echo "")
llama_version=$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || true)
CPU_MODEL=$(lscpu | sed -n 's/^Model name: *//p' | head -1) \
CPU_FLAGS=$(grep -m1 -ow -E 'avx2|avx512f|avx512bw|avx512vl|avx512_vnni|avx_vnni|avx512_bf16|amx_bf16|amx_int8|f16c|fma' /proc/cpuinfo | sort -u | tr '\n' ' ') \
NPROC=$(nproc) DATE=$(date -Iseconds) MODEL=$MODEL SERVED_NAME=$SERVED_NAME THREADS=$THREADS \
NUM_PROMPTS=$NUM_PROMPTS SINGLE_REPS=$SINGLE_REPS INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN \
LLAMA_SLOTS=$LLAMA_SLOTS LLAMA_SLOT_CTX=$LLAMA_SLOT_CTX LLAMA_ARGS=$LLAMA_ARGS DTYPE=$DTYPE \
MAX_NUM_SEQS=$MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS=$MAX_NUM_BATCHED_TOKENS KV_CACHE_GIB=$KV_CACHE_GIB \
SLUICEWAY_SERVE_ARGS=$SLUICEWAY_SERVE_ARGS REFERENCE_MODE=${REFERENCE_MODE:-} NOTE=${NOTE:-} \
LLAMA_COMMIT=$llama_commit LLAMA_VERSION=$llama_version \
GIT_REV=$(git rev-parse --short HEAD 2>/dev/null || echo "") \
GIT_DIRTY=$([[ -n $(git status --porcelain 2>/dev/null) ]] && echo true || echo false) \
"$PROJECT_PYTHON" scripts/bench_vs_llamacpp.py meta "$RUNS_TSV" "$OUT_DIR/meta.json"
rm -f "$RUNS_TSV"
log "results in $OUT_DIR ($((SECONDS - T_ALL)) s in all)"
echo
"$PROJECT_PYTHON" scripts/bench_vs_llamacpp.py table "$OUT_DIR" || FAILED=1
exit $FAILED
