"""`sluiceway bench compare`: a server per configuration plus the transformers baseline."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_compare_short_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    proc = subprocess.run(
        [
            sys.executable, "-m", "sluiceway.cli", "bench", "compare",
            "--backend", "sluiceway,transformers", "--policies", "static,continuous",
            "--static-batch-size", "2", "--dataset-name", "random", "--num-prompts", "4",
            "--random-input-len", "16", "--random-output-len", "4", "--ignore-eos",
            "--serve-args",
            "--dtype float32 --kv-cache-memory 256MiB --log-level debug --log-format json",
            "--dtype", "float32", "--save-result", str(out), "--plot", str(png),
            "--server-log-dir", str(tmp_path / "logs"),
        ],
        check=True, timeout=600, capture_output=True, text=True,
    )  # fmt: skip
    assert png.read_bytes()[:4] == b"\x89PNG"
    result = json.loads(out.read_text())
    labels = [c["label"] for c in result["configurations"]]
    assert labels == ["static (batch 2)", "continuous", "transformers (batch 2)"]
    assert result["reference"] == "continuous"
    for config in result["configurations"]:
        f = config["figures"]
        assert (f["successful_requests"], f["failed_requests"]) == (4, 0), config["label"]
        assert (f["total_input_tokens"], f["total_output_tokens"]) == (64, 16), config["label"]
        assert len(config["e2e_ms"]) == 4 and all(x > 0 for x in config["e2e_ms"])
        assert 0 < f["kv_cache_utilization_pct"] <= 100
    assert set(result["ratios"]) == {"static (batch 2)", "transformers (batch 2)"}
    static = result["configurations"][0]["figures"]
    continuous = result["configurations"][1]["figures"]
    assert result["ratios"]["static (batch 2)"]["output_throughput"] == pytest.approx(
        continuous["output_throughput"] / static["output_throughput"]
    )
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| Metric"))
    assert "continuous vs static (batch 2)" in header
    assert "continuous vs transformers (batch 2)" in header
    assert result["machine"]["cpu_count"] >= 1 and result["command"].startswith("sluiceway bench")
    # each request was sent as bench-RUN-i, and the servers' kept logs split its decoding
    for config in result["configurations"][:2]:
        ids = [r["request_id"] for r in config["requests"]]
        assert [i.rsplit("-", 1)[1] for i in ids] == ["0", "1", "2", "3"], ids
    attribution = subprocess.run(
        [sys.executable, str(ROOT / "scripts/step_attribution.py"), str(out), str(tmp_path / "logs"),
         "--a", "continuous", "--b", "static (batch 2)"],
        check=True, timeout=60, capture_output=True, text=True,
    )  # fmt: skip
    assert attribution.stdout.startswith(
        "4 requests with 2+ tokens; static (batch 2) over continuous"
    )
