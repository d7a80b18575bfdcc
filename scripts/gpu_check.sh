#!/usr/bin/env bash
# Prove the GPU paths of sluiceway on one CUDA machine in one run (under 8 minutes).
#
# First, on a dev machine:  bash scripts/gpu_wheels.sh   (fills .gpu/: wheels + tokenizer)
# Then, on the GPU machine, from the repository root:  bash scripts/gpu_check.sh
# (the project is not installed there: PYTHONPATH carries it and the wheels).
#
# Steps, each with its own timeout, all run even when one fails; kernels, invariance, kv-ipc,
# parity, tp and disagg side by side, then inv-bench, bench and bench-ni alone:
#   kernels   the Triton kernel tests on CUDA (tests/kernels/test_triton_kernels.py, and
#             sliding windows and head dim 256: tests/kernels/test_triton_sliding_window.py;
#             the int8 KV cache: tests/kernels/test_triton_kv_int8.py)
#   invariance  the batch-invariant path on CUDA (issue 16): the kernels bitwise (a row at M 1
#             vs 7 vs 33 vs 70, a token as decode / in chunks / after a prefix hit, split or
#             not) and the whole forward through ModelRunner in bfloat16
#             (tests/kernels/test_triton_batch_invariance.py, tests/worker/test_batch_invariance_triton.py)
#   inv-bench scripts/invariance_bench.py: the Triton matmul vs cuBLAS at M 1, 32, 256 for
#             7B-shaped layers, unified vs old attention (decode batch 1/32/256, 2,048-token
#             prefill), both bitwise checks again; INVARIANCE-RESULT -> $OUT/invariance.json
#   kv-ipc    a KV pool shared between two processes through CUDA IPC (test_kv_pool -k cuda)
#   parity    `sluiceway serve --device cuda` greedy tokens == transformers generate, with
#             CUDA graphs and with --enforce-eager (tests/integration/test_cuda_parity.py)
#   bench     `sluiceway bench step --random-model llama-2-7b`, batches 1, 32, 256: decode
#             tokens/s with CUDA graphs and eager, against the HBM bound
#   tp        two tensor-parallel ranks on the one GPU (SLUICEWAY_DISTRIBUTED_BACKEND=gloo)
#   disagg    a prefill and a decode worker, KV blocks copied over CUDA IPC
#   bench-ni  the bench step again with SLUICEWAY_BATCH_INVARIANT=0 (old attention kernels,
#             cuBLAS, torch RMSNorm): what the invariant default costs, to be measured
# Writes $OUT/gpu_check.json (per step: name, status, rc, seconds, figures: pytest counts,
# PARITY-RESULT lines, kernel errors, the bench JSONs, INVARIANCE-RESULT), $OUT/gpu_check.log
# (all output), $OUT/bench_step.json, $OUT/bench_step_noninvariant.json and
# $OUT/invariance.json; prints a summary table. Exit status 0 when every step passed.
#
# Environment: OUT (default /tmp/gpu_check_out), PYTHON (default python3),
# GPU_CHECK_BUDGET_S (default 450: steps that would start later are skipped),
# SLUICEWAY_PARITY_DEVICE=cpu (dry run of the parity tests without CUDA).
set -u -o pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu_check_out}
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
DEPS=/tmp/sluiceway-deps
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
STEPS=$WORK/steps.tsv
: >"$STEPS"
START=$(date +%s)
DEADLINE=$((START + BUDGET))

main() {
echo "== gpu_check: $(date -u +%FT%TZ) on $(hostname), repo $PWD, budget ${BUDGET}s"

# -- environment ---------------------------------------------------------------------------
# sluiceway/router etc. are symlinks to the top-level folders: remake any a copy dropped
for pkg in router scheduler worker kernels; do
    [ -e "sluiceway/$pkg" ] || ln -s "../$pkg" "sluiceway/$pkg"
done
py_minor=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
shopt -s nullglob
wheels=(.gpu/wheels/*.whl)
if [ "${#wheels[@]}" -eq 0 ]; then
    echo "== no wheels in .gpu/wheels (run scripts/gpu_wheels.sh first and carry .gpu)"
elif [ "$py_minor" != "3.12" ]; then
    echo "== python $py_minor: the carried wheels are for 3.12; using this interpreter's packages"
else
    echo "== installing ${#wheels[@]} wheels into $DEPS"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$DEPS" "${wheels[@]}" || echo "== wheel install failed (rc $?)"
fi
if [ -d "$DEPS" ]; then
    export PYTHONPATH="$DEPS:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SLUICEWAY_PARITY_DIR=${SLUICEWAY_PARITY_DIR:-/tmp/sluiceway-parity}
unset TRITON_INTERPRET  # tests/conftest.py sets it only when CUDA is missing

if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
        >"$WORK/gpu.csv" 2>/dev/null
else
    echo "== no nvidia-smi"
fi
"$PYTHON" - <<'EOF' | tee "$WORK/versions.json"
import importlib, importlib.metadata as md, json, platform, sys
info = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine()}
for dist in ("torch", "triton", "cupy-cuda13x", "cupy-cuda12x", "transformers", "tokenizers",
             "grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "structlog",
             "gguf", "safetensors", "numpy", "pytest"):
    try:
        info[dist] = md.version(dist)
    except md.PackageNotFoundError:
        pass
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = p.name
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["sms"] = p.multi_processor_count
        info["capability"] = f"{p.major}.{p.minor}"
except Exception as e:  # noqa: BLE001
    info["torch_error"] = repr(e)
missing = []
for mod in ("grpc", "google.protobuf", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection",
            "structlog", "uvloop", "prometheus_client", "yaml", "safetensors", "transformers",
            "sluiceway.internal.v1.worker_pb2_grpc", "sluiceway.v1.inference_pb2_grpc",
            "sluiceway.cli", "sluiceway.router.server", "sluiceway.scheduler.server",
            "sluiceway.worker.server", "sluiceway.router.openai_api", "xgrammar"):
    try:
        m = importlib.import_module(mod)
        if mod in ("grpc", "google.protobuf"):
            info[mod + "_file"] = getattr(m, "__file__", None)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{mod}: {e!r}")
info["import_errors"] = missing
print(json.dumps(info))
EOF
HAS_CUDA=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
echo "== CUDA available: $HAS_CUDA"

# -- steps ---------------------------------------------------------------------------------
# step NAME TIMEOUT_S CMD...: runs CMD with min(TIMEOUT_S, what the budget has left), its
# output to the log and to $WORK/NAME.log; appends "name rc seconds timeout" to $STEPS.
step() {
    local name=$1 limit=$2
    shift 2
    local now left t rc t0 t1
    now=$(date +%s)
    left=$((DEADLINE - now))
    if [ "$left" -lt 30 ]; then
        echo "== $name: skipped, ${left}s of the budget left"
        printf '%s\t%s\t%s\t%s\n' "$name" -1 0 0 >>"$STEPS"
        return
    fi
    t=$((limit < left ? limit : left))
    echo
    echo "== step $name (timeout ${t}s): $*"
    t0=$(date +%s.%N)
    timeout -k 10 "$t" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    t1=$(date +%s.%N)
    echo "== step $name: rc $rc after $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" \
        "$t" >>"$STEPS"
}

PYTEST=("$PYTHON" -m pytest -q -s -p no:cacheprovider)
PARITY=tests/integration/test_cuda_parity.py
if [ "$HAS_CUDA" = 1 ]; then
    BENCH=(--random-model llama-2-7b --device cuda --batch-sizes 1,32,256 --warmup 3 --iters 20)
    INV_BENCH=(--device cuda --warmup 3 --iters 20)
else  # a dry run of the code path on CPU
    BENCH=(--random-model tiny --device cpu --batch-sizes 1,4 --warmup 1 --iters 3)
    INV_BENCH=(--device cpu)  # the Triton interpreter, tiny shapes: timings meaningless
fi

# The correctness steps run side by side (each its own process, a 1 GiB KV pool per stack,
# its own parity folder): on one GPU they fit together, and together they fit a lease. The
# timed steps then run alone.
PARALLEL=()  # the side-by-side steps, their output shown in this order once all ended
pstep() {
    PARALLEL+=("$1")
    step "$@" >"$WORK/$1.out" 2>&1 &
}
# (without_triton is a CPU test: it builds the C++ CPU kernels, over 2 minutes on the GPU
# machine's image, and timed out there on 2026-12-04)
pstep kernels 200 "${PYTEST[@]}" tests/kernels/test_triton_kernels.py \
    tests/kernels/test_triton_sliding_window.py tests/kernels/test_triton_kv_int8.py \
    --deselect tests/kernels/test_triton_kernels.py::test_imports_and_torch_backend_without_triton
pstep invariance 200 "${PYTEST[@]}" tests/kernels/test_triton_batch_invariance.py \
    tests/worker/test_batch_invariance_triton.py
pstep kv-ipc 90 "${PYTEST[@]}" tests/worker/test_kv_pool.py -k cuda
pstep parity 200 env SLUICEWAY_PARITY_DIR="$SLUICEWAY_PARITY_DIR-parity" \
    "${PYTEST[@]}" "$PARITY" -k "greedy or helpers"
pstep tp 200 env SLUICEWAY_PARITY_DIR="$SLUICEWAY_PARITY_DIR-tp" \
    "${PYTEST[@]}" "$PARITY" -k tensor_parallel
pstep disagg 200 env SLUICEWAY_PARITY_DIR="$SLUICEWAY_PARITY_DIR-disagg" \
    "${PYTEST[@]}" "$PARITY" -k disaggregated
wait
for name in "${PARALLEL[@]}"; do cat "$WORK/$name.out"; done
step inv-bench 120 "$PYTHON" scripts/invariance_bench.py "${INV_BENCH[@]}" --json "$OUT/invariance.json"
step bench 180 "$PYTHON" -m sluiceway.cli bench step "${BENCH[@]}" --json "$OUT/bench_step.json"
step bench-ni 180 env SLUICEWAY_BATCH_INVARIANT=0 "$PYTHON" -m sluiceway.cli bench step \
    "${BENCH[@]}" --json "$OUT/bench_step_noninvariant.json"

# -- report --------------------------------------------------------------------------------
"$PYTHON" - "$WORK" "$OUT" "$START" "$BUDGET" "$HAS_CUDA" <<'EOF'
import ast, json, pathlib, re, sys, time

work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
start, budget, has_cuda = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")


def pytest_counts(text):
    for line in reversed(text.splitlines()):
        if " in " in line and COUNT.search(line):
            counts = {}
            for n, kind in COUNT.findall(line):
                counts["error" if kind.startswith("error") else kind] = int(n)
            return counts
    return None


steps = []
for row in (work / "steps.tsv").read_text().splitlines():
    name, rc, seconds, limit = row.split("\t")
    rc, log_path = int(rc), work / f"{name}.log"
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    s = {"name": name, "rc": rc, "seconds": round(float(seconds), 1), "timeout_s": int(limit)}
    figures = {}
    counts = pytest_counts(text) if name not in ("bench", "bench-ni", "inv-bench") else None
    if counts is not None:
        figures["pytest"] = counts
    parity = [json.loads(m) for m in re.findall(r"PARITY-RESULT (\{.*\})", text)]
    if parity:
        figures["parity"] = parity
    m = re.search(r"max abs error vs the torch reference on (\w+): (\{.*\})", text)
    if m:
        figures["max_abs_error_device"] = m.group(1)
        figures["max_abs_error"] = ast.literal_eval(m.group(2))
    if name == "bench" and (out / "bench_step.json").exists():
        figures["bench"] = json.loads((out / "bench_step.json").read_text())
    if name == "bench-ni" and (out / "bench_step_noninvariant.json").exists():
        figures["bench"] = json.loads((out / "bench_step_noninvariant.json").read_text())
    inv = re.findall(r"INVARIANCE-RESULT (\{.*\})", text)
    if inv:
        figures["invariance"] = json.loads(inv[-1])
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    if failed:
        figures["failed_tests"] = failed[:20]
    if rc == -1:
        status = "no-time"
    elif rc in (124, 137):
        status = "timeout"
    elif rc != 0:
        status = "failed"
    elif counts is not None and (counts.get("skipped", 0) or not counts.get("passed", 0)):
        status = "skipped"  # a test skipped (no CUDA, no CuPy ...): not proven
    else:
        status = "passed"
    s["status"] = status
    s["figures"] = figures
    if status in ("failed", "timeout"):
        s["log_tail"] = text.splitlines()[-40:]
    steps.append(s)

env = {}
for f in ("versions.json",):
    p = work / f
    if p.exists() and p.read_text().strip():
        env = json.loads(p.read_text().strip().splitlines()[-1])
gpu_csv = work / "gpu.csv"
if gpu_csv.exists():
    env["nvidia_smi"] = gpu_csv.read_text().strip().splitlines()
report = {
    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
    "seconds": round(time.time() - start, 1),
    "budget_s": budget,
    "cuda": has_cuda,
    "environment": env,
    "all_passed": all(s["status"] == "passed" for s in steps),
    "steps": steps,
}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")


def key(s):
    f = s["figures"]
    parts = []
    if "pytest" in f:
        parts.append(", ".join(f"{n} {k}" for k, n in f["pytest"].items()))
    for p in f.get("parity", []):
        parts.append(f"{p['run']}: {p['exact']}/{p['prompts']} exact, {p['near_ties']} near-ties")
    if "max_abs_error" in f:
        parts.append(f"max err {f['max_abs_error']}")
    inv = f.get("invariance")
    if inv:
        parts.append(
            f"matmul invariant {inv['matmul_invariant']} (cuBLAS {inv['cublas_invariant']}), "
            f"attention invariant {inv['attention_invariant']}"
        )
        for m in sorted({r["m"] for r in inv["matmul"]}):
            ratios = [r["triton_over_cublas"] for r in inv["matmul"] if r["m"] == m]
            if all(ratios):
                parts.append(f"M={m}: triton/cuBLAS {min(ratios):.2f}-{max(ratios):.2f}x")
        for r in inv["decode"]:
            parts.append(f"decode b={r['batch']}: unified {r['unified_ms']} vs old {r['old_ms']} ms")
        p = inv["prefill"]
        parts.append(f"prefill {p['tokens']}: unified {p['unified_ms']} vs old {p['old_ms']} ms")
    b = f.get("bench")
    if b:
        for r in b["results"]:
            g = r["graph"]
            best = g["tokens_per_s"] if g else r["eager"]["tokens_per_s"]
            ratio = f", eager/graphs {r['eager_over_graph']:.2f}x" if g else ""
            parts.append(
                f"b={r['batch_size']}: {best:.0f} tok/s{ratio}, "
                f"{100 * r['fraction_of_hbm_bound']:.0f}% of HBM bound"
            )
    return "; ".join(parts)


print()
print(f"== gpu_check summary ({report['seconds']} s, {env.get('gpu', 'no GPU')})")
print(f"{'step':<10} {'status':<8} {'rc':>4} {'s':>7}  figures")
for s in steps:
    print(f"{s['name']:<10} {s['status']:<8} {s['rc']:>4} {s['seconds']:>7.1f}  {key(s)}")
if env.get("import_errors"):
    print("import errors:", env["import_errors"])
print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.log'}")
sys.exit(0 if report["all_passed"] else 1)
EOF
}

main 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
