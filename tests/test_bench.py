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


def test_request_intervals_follow_vllm() -> None:
    from sluiceway.bench import request_intervals

    assert request_intervals(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    poisson = request_intervals(4000, 4.0, 1.0, seed=1)
    assert sum(poisson) / len(poisson) == pytest.approx(0.25, rel=0.05)
    bursty = request_intervals(4000, 4.0, 0.25, seed=1)
    assert sum(bursty) / len(bursty) == pytest.approx(0.25, rel=0.1)  # same mean rate
    assert max(bursty) > max(poisson)  # longer gaps, tighter bursts
    assert request_intervals(10, 2.0, 1.0, seed=3) == request_intervals(10, 2.0, 1.0, seed=3)
    with pytest.raises(ValueError):
        request_intervals(3, 0.0, 1.0, seed=0)


def test_random_dataset_lengths_and_ids() -> None:
    from sluiceway.bench import random_requests

    fixed = random_requests(6, 32, 8, 0.0, vocab_size=100, seed=0)
    assert [(r.prompt_len, r.output_len, len(r.prompt_token_ids)) for r in fixed] == [
        (32, 8, 32)
    ] * 6
    assert all(0 <= t < 100 for r in fixed for t in r.prompt_token_ids)
    ranged = random_requests(200, 100, 10, 0.5, vocab_size=100, seed=0)
    assert {r.prompt_len for r in ranged} <= set(range(50, 151))
    assert min(r.prompt_len for r in ranged) < 60 and max(r.prompt_len for r in ranged) > 140
