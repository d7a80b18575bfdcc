"""Helpers of scripts/bench_vs_vllm.sh, run with the project's own Python.

    python scripts/bench_vs_vllm.py model-dir [MODEL]  # the embedded model or MODEL, an HF folder
    python scripts/bench_vs_vllm.py sharegpt OUT.json  # ShareGPT's complete records, valid JSON
    python scripts/bench_vs_vllm.py table OUT_DIR      # markdown table from the saved results

`model-dir` reuses sluiceway's own GGUF -> safetensors conversion
(:func:`sluiceway.model_files.resolve_model`, cached under ``$SLUICEWAY_CACHE_DIR``; the files
``sluiceway convert`` writes), so vLLM and sluiceway load the very same weights; MODEL is what
``serve --model`` takes (a .gguf path, a short name). `sharegpt` writes the records that
:mod:`sluiceway.sharegpt` reads from the truncated packaged file (vLLM's ``json.load`` fails
on that file), so both clients sample the same prompts. `table` reads both clients' saved
JSON (the two use vLLM's figure names) and the start-up times the script recorded.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

WORKLOAD_TITLES = {
    "W1": "random 256/128, all at once",
    "W2": "ShareGPT, output 128, all at once",
    "W3": "random 256/128, 4 req/s",
}


def model_dir(model: str | None = None) -> int:
    from sluiceway.model_files import ModelFilesError, resolve_model

    try:
        folder = resolve_model(model)
    except ModelFilesError as e:  # e.g. an architecture the converter does not know yet
        print(f"model-dir: {e}", file=sys.stderr)
        return 1
    needed = ["config.json", "generation_config.json", "tokenizer_config.json"]
    missing = [n for n in needed if not (folder / n).is_file()]
    if not list(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not (folder / "tokenizer.json").is_file() and not (folder / "vocab.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        print(f"{folder}: missing {', '.join(missing)}", file=sys.stderr)
        return 1
    print(folder)
    return 0


def sharegpt(out: str) -> int:
    from sluiceway.sharegpt import default_dataset_path, iter_records

    path = pathlib.Path(out)
    stamp = path.with_suffix(path.suffix + ".count")
    if path.is_file() and stamp.is_file():  # written completely by an earlier run
        print(f"{path}: {stamp.read_text().strip()} records (kept)")
        return 0
    records = list(iter_records(default_dataset_path()))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(records, f, ensure_ascii=False)
        with open(tmp, encoding="utf-8") as f:
            assert len(json.load(f)) == len(records)  # valid JSON, as vLLM will read it
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    stamp.write_text(f"{len(records)}\n")
    print(f"{path}: {len(records)} records written")
    return 0


def _fmt(value: object, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, int | float) else "–"


def table(out_dir: str) -> int:
    root = pathlib.Path(out_dir)
    meta_path = root / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    systems = meta.get("systems") or []
    workloads = meta.get("workloads") or []
    lines = [
        "| system | workload | done / failed | input tok | output tok/s "
        "| TTFT P50 (ms) | TTFT P99 (ms) | TPOT P50 (ms) | TPOT P99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in workloads:
        for s in systems:
            f = root / f"{s}-{w}.json"
            if not f.is_file():
                lines.append(f"| {s} | {w} | no result | | | | | | |")
                continue
            r = json.loads(f.read_text())
            done = r.get("completed", r.get("successful_requests"))
            failed = r.get("failed", r.get("failed_requests"))
            if failed is None and isinstance(done, int | float):
                failed = r.get("num_prompts", done) - done
            lines.append(
                f"| {s} | {w} ({WORKLOAD_TITLES.get(w, w)}) | {_fmt(done, 0)} / {_fmt(failed, 0)} "
                f"| {_fmt(r.get('total_input_tokens'), 0)} | {_fmt(r.get('output_throughput'))} "
                f"| {_fmt(r.get('median_ttft_ms'))} | {_fmt(r.get('p99_ttft_ms'))} "
                f"| {_fmt(r.get('median_tpot_ms'))} | {_fmt(r.get('p99_tpot_ms'))} |"
            )
    lines += ["", "| system | start-up (s) |", "|---|---|"]
    for s in systems:
        lines.append(f"| {s} | {_fmt(meta.get('startup_s', {}).get(s))} |")
    text = "\n".join(lines) + "\n"
    if meta:
        text = (
            f"{meta.get('date', '')}, {meta.get('model', 'SmolLM2-135M-Instruct')}, "
            f"{meta.get('cpu', '')}, {meta.get('num_prompts')} prompts "
            f"per workload, dtype {meta.get('dtype')}, vLLM binding {meta.get('vllm_binding')}\n\n"
            + text
        )
    (root / "summary.md").write_text(text)
    print(text, end="")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["model-dir"] and len(argv) <= 2:
        return model_dir(argv[1] if len(argv) == 2 else None)
    if argv[:1] == ["sharegpt"] and len(argv) == 2:
        return sharegpt(argv[1])
    if argv[:1] == ["table"] and len(argv) == 2:
        return table(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
