"""The benchmark's arithmetic: vLLM's figures from request timings and server counters."""

from __future__ import annotations

import pytest

from sluiceway.bench import RequestResult, server_figures, summarize
from sluiceway.v1 import inference_pb2


def test_summarize_gives_vllm_figures() -> None:
    results = [
        RequestResult(ok=True, prompt_len=10, output_len=3, ttft=0.1, e2e=0.5, itl=[0.2, 0.2]),
        RequestResult(ok=True, prompt_len=20, output_len=5, ttft=0.3, e2e=1.1, itl=[0.2] * 4),
        RequestResult(ok=False, prompt_len=7, error="UNAVAILABLE: gone"),
    ]
    f = summarize(results, duration_s=2.0)
    assert (f["successful_requests"], f["failed_requests"]) == (2, 1)
    assert f["output_throughput"] == 8 / 2.0
    assert f["total_token_throughput"] == (30 + 8) / 2.0
    assert f["mean_ttft_ms"] == pytest.approx(200.0)
    assert f["mean_tpot_ms"] == pytest.approx(200.0)  # (e2e - ttft) / (n - 1) = 0.2 s each
    assert f["median_itl_ms"] == pytest.approx(200.0)
    assert f["p99_e2el_ms"] == pytest.approx(500 + 0.99 * 600)


def test_server_figures_are_differences_of_counters() -> None:
    before = inference_pb2.ModelInfo(
        kv_cache_tokens_stored_total=100, kv_cache_slots_allocated_total=200,
        prefix_cache_queries_total=50, prefix_cache_hits_total=10, num_preemptions_total=1,
    )  # fmt: skip
    after = inference_pb2.ModelInfo(
        kv_cache_tokens_stored_total=1060, kv_cache_slots_allocated_total=1200,
        prefix_cache_queries_total=450, prefix_cache_hits_total=110, num_preemptions_total=4,
    )  # fmt: skip
    assert server_figures(before, after) == {
        "kv_cache_utilization_pct": 96.0,
        "prefix_cache_hit_rate_pct": 25.0,
        "num_preemptions": 3,
    }
