"""The benchmark's arithmetic: vLLM's figures from request timings and server counters."""

from __future__ import annotations

import pathlib

import pytest

from sluiceway.bench.metrics import RequestResult, server_figures, summarize
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
        spec_decode_num_drafts_total=5, spec_decode_num_draft_tokens_total=20,
        spec_decode_num_accepted_tokens_total=7,
    )  # fmt: skip
    after = inference_pb2.ModelInfo(
        kv_cache_tokens_stored_total=1060, kv_cache_slots_allocated_total=1200,
        prefix_cache_queries_total=450, prefix_cache_hits_total=110, num_preemptions_total=4,
        spec_decode_num_drafts_total=15, spec_decode_num_draft_tokens_total=60,
        spec_decode_num_accepted_tokens_total=32,
    )  # fmt: skip
    assert server_figures(before, after) == {
        "kv_cache_utilization_pct": 96.0,
        "prefix_cache_hit_rate_pct": 25.0,
        "num_preemptions": 3,
        "spec_decode_acceptance_rate_pct": 62.5,  # 25 of 40 proposed
        "spec_decode_mean_acceptance_length": 3.5,  # 1 + 25 / 10
    }


def test_request_intervals_follow_vllm() -> None:
    from sluiceway.bench.workload import request_intervals

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
    from sluiceway.bench.workload import random_requests

    fixed = random_requests(6, 32, 8, 0.0, vocab_size=100, seed=0)
    assert [(r.prompt_len, r.output_len, len(r.prompt_token_ids)) for r in fixed] == [
        (32, 8, 32)
    ] * 6
    assert all(0 <= t < 100 for r in fixed for t in r.prompt_token_ids)
    ranged = random_requests(200, 100, 10, 0.5, vocab_size=100, seed=0)
    assert {r.prompt_len for r in ranged} <= set(range(50, 151))
    assert min(r.prompt_len for r in ranged) < 60 and max(r.prompt_len for r in ranged) > 140


def test_step_breakdown_splits_the_step() -> None:
    from sluiceway.bench.metrics import step_breakdown

    before = inference_pb2.StepTimes(num_steps_total=10, schedule_seconds_total=1.0)
    after = inference_pb2.StepTimes(
        num_steps_total=110,  # 100 steps in the window
        schedule_seconds_total=1.2,  # 2 ms per step
        execute_seconds_total=30.0,  # 300 ms per step waiting for the worker
        worker_step_seconds_total=29.0,  # so RPC is 10 ms per step
        worker_prepare_seconds_total=1.0,
        worker_forward_seconds_total=26.0,
        worker_sample_seconds_total=1.5,  # worker "other" = 29 - 28.5 = 0.5 s
        apply_seconds_total=0.3,
        detokenize_seconds_total=0.5,
        detokenized_tokens_total=10_000,
    )
    f = step_breakdown(before, after, duration_s=40.0)
    assert f["num_steps"] == 100
    expected_ms = {
        "step_schedule_ms": 2.0, "step_rpc_ms": 10.0, "step_worker_prepare_ms": 10.0,
        "step_worker_forward_ms": 260.0, "step_worker_sample_ms": 15.0,
        "step_worker_other_ms": 5.0, "step_apply_ms": 3.0, "step_total_ms": 305.0,
    }  # fmt: skip
    for key, value in expected_ms.items():
        assert f[key] == pytest.approx(value), key
    assert f["step_loop_busy_pct"] == pytest.approx(100 * 30.5 / 40.0)
    assert f["detokenize_us_per_token"] == pytest.approx(50.0)
    assert f["detokenize_pct"] == pytest.approx(1.25)
    assert step_breakdown(after, after, 1.0)["step_total_ms"] == 0.0  # no steps: no division
    after.num_step_loops = 2  # e.g. two replicas: 30.5 s of steps over 2 x 40 s of loops
    assert step_breakdown(before, after, 40.0)["step_loop_busy_pct"] == pytest.approx(38.125)


def test_transformers_kv_slots_count_padding_and_finished_rows_as_waste() -> None:
    from sluiceway.bench.transformers_baseline import kv_slots

    # Prompts of 4 and 2 tokens (width 4), outputs of 3 and 1 tokens: 3 forwards.
    # s=0: slots 2*4,  stored 4 + 2;  s=1: slots 2*5, stored 4+1 (row 2 done);
    # s=2: slots 2*6, stored 4+2.
    assert kv_slots([4, 2], [3, 1]) == (6 + 5 + 6, 8 + 10 + 12)
    assert kv_slots([5], [2]) == (5 + 6, 5 + 6)  # one row, no padding: all useful


def test_comparison_table_ratios_follow_the_seed_article() -> None:
    from sluiceway.bench.compare import comparison_table, improvement

    assert improvement(1824, 856, higher_is_better=True) == pytest.approx(2.131, abs=1e-3)
    assert improvement(380, 1200, higher_is_better=False) == pytest.approx(3.158, abs=1e-3)
    assert improvement(1.0, 0.0, higher_is_better=True) == 0.0
    figures = {
        "static": {"output_throughput": 856.0, "median_e2el_ms": 1200.0, "p99_e2el_ms": 8900.0,
                   "median_ttft_ms": 100.0, "median_tpot_ms": 40.0, "p99_tpot_ms": 90.0,
                   "kv_cache_utilization_pct": 46.0},
        "continuous": {"output_throughput": 1824.0, "median_e2el_ms": 380.0,
                       "p99_e2el_ms": 2100.0, "median_ttft_ms": 50.0, "median_tpot_ms": 20.0,
                       "p99_tpot_ms": 30.0, "kv_cache_utilization_pct": 93.0},
    }  # fmt: skip
    table, ratios = comparison_table(["static", "continuous"], figures, "continuous")
    assert ratios["static"]["p99_e2el_ms"] == pytest.approx(8900 / 2100)
    assert ratios["static"]["kv_cache_utilization_pct"] == pytest.approx(93 / 46)
    lines = table.splitlines()
    assert lines[0].split("|")[1:-1] == [
        " Metric                       ", " static ", " continuous ", " continuous vs static ",
    ]  # fmt: skip
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == [
        "Throughput (output tokens/s)", "856.0", "1824.0", "2.13x",
    ]  # fmt: skip
    assert len(lines) == 2 + 7


def test_compare_configurations() -> None:
    from sluiceway.bench.compare import configurations

    configs = configurations(["sluiceway", "transformers"], ["static", "continuous"], [64, 256], 32)
    assert [c.label for c in configs] == [
        "static (batch 32)", "continuous (64 seqs)", "continuous (256 seqs)",
        "transformers (batch 32)",
    ]  # fmt: skip
    assert configs[0].serve_args == [
        "--scheduling-policy", "static", "--static-batch-size", "32",
    ]  # fmt: skip
    assert configs[2].serve_args == ["--scheduling-policy", "fcfs", "--max-num-seqs", "256"]
    assert (configs[3].backend, configs[3].batch_size) == ("transformers", 32)
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        configurations(["vllm"], ["static"], [256], 32)
    spec = '{"method":"ngram","num_speculative_tokens":4}'
    with_spec = configurations(["sluiceway"], ["continuous"], [8], 32, spec)
    assert [c.label for c in with_spec] == ["continuous", "continuous + spec"]
    assert with_spec[1].serve_args == [*with_spec[0].serve_args, "--speculative-config", spec]
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        configurations(["sluiceway"], ["fifo"], [256], 32)


def test_plot_writes_a_png(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sluiceway.bench.plot import PlotSeries, plot_runs

    path = tmp_path / "bench.png"
    plot_runs(
        [PlotSeries("static", [900.0, 1200.0, 8900.0], [100.0, 150.0, 400.0], 856.0),
         PlotSeries("continuous", [300.0, 380.0, 2100.0], [50.0, 60.0, 90.0], 1824.0)],
        str(path), title="synthetic",
    )  # fmt: skip
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_printed_counts_are_integers_and_the_other_figures_have_two_decimals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sluiceway.bench.metrics import step_breakdown
    from sluiceway.bench.serve import print_figures

    results = [RequestResult(ok=True, prompt_len=10, output_len=4, ttft=0.1, e2e=0.4)] * 20
    figures = summarize(results, duration_s=8.0)
    figures.update(server_figures(inference_pb2.ModelInfo(), inference_pb2.ModelInfo()))
    figures["num_kv_blocks"] = 1024
    steps = inference_pb2.StepTimes(num_steps_total=80, schedule_seconds_total=0.4)
    figures.update(step_breakdown(inference_pb2.StepTimes(), steps, duration_s=8.0))
    print_figures(figures, [])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert lines["successful_requests"] == f"{'successful_requests':<40}{'20':>14}"
    assert lines["failed_requests"].split()[1] == "0"
    assert lines["total_input_tokens"].split()[1] == "200"
    assert lines["total_output_tokens"].split()[1] == "80"
    assert lines["num_preemptions"].split()[1] == "0"
    assert lines["num_kv_blocks"].split()[1] == "1024"
    assert lines["num_steps"].split()[1] == "80"
    assert lines["num_step_loops"].split()[1] == "1"
    assert lines["duration_s"].split()[1] == "8.00"
    assert lines["request_throughput"].split()[1] == "2.50"
    assert lines["mean_ttft_ms"].split()[1] == "100.00"
    assert lines["kv_cache_utilization_pct"].split()[1] == "0.00"


@pytest.mark.parametrize("backend", ["sluiceway", "openai"])
def test_bench_serve_saves_per_request_figures_and_plots_for_either_backend(
    backend: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    import json

    from sluiceway.bench import openai_client, serve
    from sluiceway.cli import build_parser
    from sluiceway.sharegpt import SampledRequest

    requests = [SampledRequest("a", 3, 4), SampledRequest("b", 5, 2)]
    results = [
        RequestResult(ok=True, prompt_len=3, output_len=4, ttft=0.25, e2e=1.0, itl=[0.25] * 3),
        RequestResult(ok=False, prompt_len=5, error="UNAVAILABLE: gone"),
    ]

    async def grpc_workload(target, reqs, intervals, max_concurrency, ignore_eos, connection):  # type: ignore[no-untyped-def]
        assert (target, reqs) == ("127.0.0.1:50051", requests)
        return serve.BenchRun(results, summarize(results, 2.0), ["UNAVAILABLE: gone"])

    async def http_workload(
        base_url, model, reqs, intervals, max_concurrency, ignore_eos, connection, keep_alive
    ):  # type: ignore[no-untyped-def]
        assert (base_url, reqs, keep_alive) == ("http://127.0.0.1:8000", requests, False)
        return results, summarize(results, 2.0)

    monkeypatch.setattr(serve, "load_requests", lambda args: requests)
    monkeypatch.setattr(serve, "run_workload", grpc_workload)
    monkeypatch.setattr(openai_client, "run_openai_workload", http_workload)
    out, png = tmp_path / "result.json", tmp_path / "result.png"
    args = build_parser().parse_args(
        ["bench", "serve", "--backend", backend, "--num-prompts", "2",
         "--save-result", str(out), "--plot", str(png), "--no-keep-alive"]
    )  # fmt: skip
    assert serve.serve_command(args) == 1  # a request failed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(out.read_text())
    assert (saved["successful_requests"], saved["errors"]) == (1, ["UNAVAILABLE: gone"])
    assert saved["requests"] == [
        {"ok": True, "prompt_len": 3, "output_len": 4, "ttft_ms": 250.0, "e2e_ms": 1000.0},
        {"ok": False, "prompt_len": 5, "output_len": 0, "ttft_ms": 0.0, "e2e_ms": 0.0,
         "error": "UNAVAILABLE: gone"},
    ]  # fmt: skip


def test_bench_grammar_prints_compile_times_and_the_per_step_mask_cost() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "bench", "grammar", "--num-seqs", "4"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout  # fmt: skip
    rows = {line[:40].strip(): line[40:].split() for line in out.splitlines()[2:]}
    for kind in ("json (6-property schema)", "json_object", "regex (phone number)",
                 "choice (3 strings)", "grammar (EBNF)"):  # fmt: skip
        cold, ms, cached, ms2 = rows[kind]
        assert ms == ms2 == "ms" and float(cold) > 0 and float(cached) >= 0
    assert "per step at 4 constrained sequences" in out
    for label in ("fill bitmask", "apply to logits", "advance matchers"):
        value, unit, _, per_unit = rows[label]
        assert unit == "ms" and per_unit == "us/seq" and float(value) >= 0
    total = float(rows["total"][0])
    parts = sum(float(rows[k][0]) for k in ("fill bitmask", "apply to logits", "advance matchers"))
    assert abs(total - parts) < 0.02


def test_the_workloads_token_counter_is_the_models_tokenizer() -> None:
    """`bench`'s counter (tokenizer.json through `tokenizers`) gives the ids transformers'
    fast tokenizer gives, special tokens included, on ShareGPT's own turns."""
    from sluiceway.bench.workload import TokenCounter
    from sluiceway.model_files import resolve_model
    from sluiceway.router.tokenizer import load_tokenizer
    from sluiceway.sharegpt import load_conversations

    model_dir = resolve_model(None)
    counter, tokenizer = TokenCounter.of(model_dir), load_tokenizer(model_dir)
    _, conversations = load_conversations(None)
    texts = [turn["value"] for conv in conversations[:100] for turn in conv[:2]]
    assert [counter(t).input_ids for t in texts] == [tokenizer(t).input_ids for t in texts]
    assert len(counter) == len(tokenizer) == 49152


def test_bench_compare_keeps_server_logs_only_in_a_directory(tmp_path: pathlib.Path) -> None:
    from sluiceway.cli import build_parser
    from tests.cli_helpers import usage_error

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert usage_error("bench", "compare", "--server-log-dir", str(a_file)) == (
        f"sluiceway bench compare: error: argument --server-log-dir: {a_file}: exists and is not "
        "a directory (see sluiceway bench compare --help)"
    )
    new = tmp_path / "logs" / "run-1"  # made when the first server starts
    args = build_parser().parse_args(["bench", "compare", "--server-log-dir", str(new)])
    assert args.server_log_dir == new
