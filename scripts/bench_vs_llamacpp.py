"""Helpers of scripts/bench_vs_llamacpp.sh, run with the project's own Python.

    python scripts/bench_vs_llamacpp.py slug "--quantization gguf"   # quantization-gguf
    python scripts/bench_vs_llamacpp.py meta RUNS.tsv OUT/meta.json  # from the script's env
    python scripts/bench_vs_llamacpp.py table OUT_DIR                # markdown table

`slug` names a sluiceway mode's files (its `serve` flags, "default" for none). `meta` writes
the machine, the commits, the settings and, per engine, the start-up time and the load
average before and after its run. `table` reads the client's saved JSON (vLLM's figure
names): single-stream decode tok/s is 1000 / the median TPOT in ms of the batch-1 run (decode
only: TTFT, the prefill, is apart; its median leaves out the first request, which repeats the
client's warm-up and hits the prefix cache); W1's output tok/s, TTFT P50 and TPOT P50; the ratios
against llama.cpp and against the reference sluiceway mode. It exits 1 when a request failed
or came back short of its output length (the figures would compare unequal work).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import sys
from typing import Any


def slug(flags: str) -> str:
    """'--quantization gguf --kv-cache-dtype int8' -> 'quantization-gguf-kv-cache-dtype-int8';
    '' -> 'default'."""
    words = re.sub(r"[^A-Za-z0-9_.]+", "-", flags).strip("-")
    return words or "default"


def meta(runs_tsv: str, out: str) -> int:
    e = os.environ
    runs = []
    for line in pathlib.Path(runs_tsv).read_text().splitlines():
        engine, mode, startup, load0, load1, seconds = line.split("\t")
        runs.append(
            {
                "engine": engine,
                "mode": mode if engine == "llamacpp" else (mode or "default"),
                "startup_s": float(startup),
                "loadavg_before": load0,
                "loadavg_after": load1,
                "seconds": int(seconds),
            }
        )
    sluiceway_modes = [r["mode"] for r in runs if r["engine"] != "llamacpp"]
    data = {
        "date": e["DATE"],
        "note": e["NOTE"],
        "cpu": f"{e['CPU_MODEL']}, {e['NPROC']} cores",
        "cpu_flags": e["CPU_FLAGS"].split(),
        "model": e["MODEL"],
        "served_model_name": e["SERVED_NAME"],
        "threads": int(e["THREADS"]),
        "input_len": int(e["INPUT_LEN"]),
        "output_len": int(e["OUTPUT_LEN"]),
        "single_reps": int(e["SINGLE_REPS"]),
        "num_prompts": int(e["NUM_PROMPTS"]),
        "llamacpp": {
            "commit": e["LLAMA_COMMIT"],
            "version": e["LLAMA_VERSION"],
            "slots": int(e["LLAMA_SLOTS"]),
            "ctx": int(e["LLAMA_SLOTS"]) * int(e["LLAMA_SLOT_CTX"]),
            "extra_args": e["LLAMA_ARGS"],
        },
        "sluiceway": {
            "git": e["GIT_REV"],
            "git_dirty": e["GIT_DIRTY"] == "true",
            "dtype": e["DTYPE"],
            "max_num_seqs": int(e["MAX_NUM_SEQS"]),
            "max_num_batched_tokens": int(e["MAX_NUM_BATCHED_TOKENS"]),
            "kv_cache_gib": float(e["KV_CACHE_GIB"]),
            "extra_args": e["SLUICEWAY_SERVE_ARGS"],
            "reference_mode": e["REFERENCE_MODE"]
            or (sluiceway_modes[0] if sluiceway_modes else ""),
        },
        "runs": runs,
    }
    pathlib.Path(out).write_text(json.dumps(data, indent=2) + "\n")
    return 0


def _fmt(value: object, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "–"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def _median(values: list[float]) -> float:
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def _figures(root: pathlib.Path, engine: str, output_len: int) -> dict[str, Any]:
    """One engine's figures: decode tok/s of the single run, W1's figures, and how many
    requests failed or came back short of `output_len` over both."""
    out: dict[str, Any] = {"bad": 0, "missing": []}
    for w in ("single", "W1"):
        f = root / f"{engine}-{w}.json"
        if not f.is_file():
            out["missing"].append(w)
            continue
        r = json.loads(f.read_text())
        out["bad"] += sum(1 for q in r["requests"] if not q["ok"] or q["output_len"] != output_len)
        if w == "single":
            tpot = r.get("median_tpot_ms")
            out["decode"] = 1e3 / tpot if tpot else None
            # the first request repeats the client's warm-up: a prefix-cache hit in both
            ttfts = sorted(q["ttft_ms"] for q in r["requests"][1:] if q["ok"])
            out["single_ttft"] = _median(ttfts) if ttfts else r.get("median_ttft_ms")
        else:
            out["w1"] = r.get("output_throughput")
            out["w1_ttft_s"] = r["median_ttft_ms"] / 1e3
            out["w1_tpot"] = r.get("median_tpot_ms")
            out["w1_s"] = r.get("duration_s")
    return out


def _missing(run: dict[str, Any], figures: dict[str, Any]) -> str:
    if run["startup_s"] < 0:
        return f" (did not start: {run['engine']}-server.log)"
    return f" (no {', '.join(figures['missing'])})" if figures["missing"] else ""


def table(out_dir: str) -> int:
    root = pathlib.Path(out_dir)
    m = json.loads((root / "meta.json").read_text())
    output_len = int(m["output_len"])
    runs = m["runs"]
    figs = {r["engine"]: _figures(root, r["engine"], output_len) for r in runs}
    peer = figs.get("llamacpp", {})
    ref_mode = m["sluiceway"]["reference_mode"]
    ref_engine = next(
        (r["engine"] for r in runs if r["engine"] != "llamacpp" and r["mode"] == ref_mode), None
    )
    ref = figs.get(ref_engine, {}) if ref_engine else {}
    ref_label = f"sluiceway {ref_mode}" if ref_engine else "sluiceway (none)"
    lines = [
        "| engine / mode | single-stream decode tok/s | single TTFT P50 (ms) "
        "| W1 output tok/s | W1 TTFT P50 (s) | W1 TPOT P50 (ms) | W1 time (s) "
        f"| vs llama.cpp (single / W1) | vs {ref_label} (single / W1) | failed or short |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    bad = 0
    for r in runs:
        f = figs[r["engine"]]
        bad += f["bad"] + len(f["missing"])
        name = "llama.cpp llama-server" if r["engine"] == "llamacpp" else f"sluiceway {r['mode']}"
        lines.append(
            f"| {name} | {_fmt(f.get('decode'))} | {_fmt(f.get('single_ttft'))} "
            f"| {_fmt(f.get('w1'))} | {_fmt(f.get('w1_ttft_s'), 2)} | {_fmt(f.get('w1_tpot'))} "
            f"| {_fmt(f.get('w1_s'), 0)} "
            f"| {_ratio(f.get('decode'), peer.get('decode'))} / {_ratio(f.get('w1'), peer.get('w1'))} "
            f"| {_ratio(f.get('decode'), ref.get('decode'))} / {_ratio(f.get('w1'), ref.get('w1'))} "
            f"| {f['bad']}{_missing(r, f)} |"
        )
    lc = m["llamacpp"]
    sl = m["sluiceway"]
    loads = "; ".join(f"{r['engine']} {r['loadavg_before']} -> {r['loadavg_after']}" for r in runs)
    head = (
        f"{m['date']}, {m['cpu']} ({' '.join(m['cpu_flags'])}), {m['threads']} threads each, "
        f"{pathlib.Path(m['model']).name}. llama.cpp {lc['commit'][:10]} ({lc['slots']} slots, "
        f"-c {lc['ctx']}, continuous batching{', ' + lc['extra_args'] if lc['extra_args'] else ''}); "
        f"sluiceway {sl['git']}{' (dirty)' if sl['git_dirty'] else ''} (--dtype {sl['dtype']}, "
        f"--max-num-seqs {sl['max_num_seqs']}, --max-num-batched-tokens "
        f"{sl['max_num_batched_tokens']}). Single: {m['single_reps']} requests "
        f"{m['input_len']} -> {m['output_len']} one at a time (decode tok/s = 1000 / TPOT P50); "
        f"W1: {m['num_prompts']} requests {m['input_len']} -> {m['output_len']} all at once. "
        f"Load average (1/5/15 min) before -> after each run: {loads}.\n\n"
    )
    if m.get("note"):
        head += f"Note: {m['note']}\n\n"
    text = head + "\n".join(lines) + "\n"
    (root / "summary.md").write_text(text)
    print(text, end="")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["slug"] and len(argv) == 2:
        print(slug(argv[1]))
        return 0
    if argv[:1] == ["meta"] and len(argv) == 3:
        return meta(argv[1], argv[2])
    if argv[:1] == ["table"] and len(argv) == 2:
        return table(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
