"""`sluiceway bench roofline` (issue 33): the work counted from a config, the limit and its
fraction, the saved results it reads, its flags, and one small run of the measurements (no
timing is asserted: speed targets never live in tests)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sluiceway.bench import roofline
from sluiceway.bench.machine_rates import (
    GemmFigures,
    Machine,
    l3_cache_bytes,
    linear_shapes,
    measure_bandwidth,
    measure_gemm,
)
from sluiceway.bench.roofline import (
    Run,
    count_work,
    evaluate,
    fraction,
    kv_bytes_per_token,
    limit_of,
    parse_durations,
    runs_from_json,
)
from sluiceway.worker.model_config import ModelConfig


def tiny(layer_windows: tuple[int | None, ...] = ()) -> ModelConfig:
    """2 layers, hidden 8, FFN 12, 2 query heads / 1 KV head of 4, vocabulary 10."""
    return ModelConfig(
        model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=64, layer_windows=layer_windows,
    )  # fmt: skip


def smollm2() -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=1e5, max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip


def test_shapes_and_kv_bytes_of_a_tiny_config() -> None:
    shapes = {s.name: (s.out_features, s.in_features, s.count) for s in linear_shapes(tiny())}
    # qkv (2 + 2 x 1) heads x 4; o; gate_up 2 x 12; down; the LM head once
    assert shapes == {
        "qkv": (16, 8, 2), "o": (8, 8, 2), "gate_up": (24, 8, 2), "down": (8, 12, 2),
        "lm_head": (10, 8, 1),
    }  # fmt: skip
    assert kv_bytes_per_token(tiny()) == 2 * 2 * 1 * 4 * 2  # layers x K,V x heads x dim x bf16
    assert kv_bytes_per_token(tiny(), dtype_bytes=4) == 64


def test_work_of_a_tiny_config_by_hand() -> None:
    # per layer 16*8 + 8*8 + 24*8 + 8*12 = 480 weights, 960 over 2 layers; LM head 80
    work = count_work(tiny(), [(5, 3), (1, 1), (4, 0)])  # the last one failed: no output
    assert work.requests == 2
    assert (work.prompt_tokens, work.decode_tokens) == (6, 2)
    assert work.prefill_layer_flops == 2 * 6 * 960
    assert work.prefill_lm_head_flops == 2 * 2 * 80  # each request's last prompt token
    assert work.decode_layer_flops == 2 * 2 * 960
    assert work.decode_lm_head_flops == 2 * 2 * 80
    assert work.flops == 11520 + 320 + 3840 + 320
    # (5, 3): decode steps at contexts 6 and 7 tokens, 32 bytes each; (1, 1) has no decode step
    assert work.kv_bytes == (6 + 7) * 32


def test_a_sliding_window_layer_reads_its_window_at_most() -> None:
    work = count_work(tiny(layer_windows=(3, None)), [(5, 3)])
    assert work.kv_bytes == (3 + 3) * 16 + (6 + 7) * 16  # 16 bytes a token per layer
    brute = sum(min(c, 4) for c in range(2, 9))
    assert roofline._sum_min(2, 8, 4) == brute
    assert roofline._sum_min(5, 8, 2) == 8 and roofline._sum_min(3, 2, None) == 0


def test_w1_of_smollm2_in_closed_form() -> None:
    config = smollm2()
    layer_w = 30 * ((9 + 6) * 64 * 576 + 576 * 576 + 2 * 1536 * 576 + 1536 * 576)
    head_w = 49152 * 576
    assert (layer_w, layer_w + head_w) == (106_168_320, 134_479_872)  # "~106 M", "~134 M"
    assert kv_bytes_per_token(config) == 23_040  # 22.5 KiB
    work = count_work(config, [(256, 128)] * 200)
    assert work.prefill_flops == 2 * 51_200 * layer_w + 2 * 200 * head_w
    assert work.decode_flops == 2 * 200 * 127 * (layer_w + head_w)
    # a request's decode contexts 257 .. 383: 127 x 256 + 127 x 128 / 2 = 40,640 tokens
    assert work.kv_bytes == 200 * 40_640 * 23_040


def gemm_figures() -> GemmFigures:
    """One call: 1 ms per shape at 1 row, 2 ms at 200 and 20 ms at 2,048 (LM head: 4 ms at 1
    and 200 rows, none at 2,048)."""
    layer = {"qkv": 1e-3, "o": 1e-3, "gate_up": 1e-3, "down": 1e-3}
    return GemmFigures(
        "test",
        {1: {**layer, "lm_head": 4e-3}, 200: {k: 2 * v for k, v in layer.items()} | {"lm_head": 4e-3},
         2048: {k: 20 * v for k, v in layer.items()}},
        copies=1, copies_bytes=0,
    )  # fmt: skip


def test_limit_and_fraction_arithmetic() -> None:
    config, gemm = tiny(), gemm_figures()
    work = count_work(config, [(5, 3), (1, 1)])  # 6 prompt tokens, 2 requests, 2 decode tokens
    limit = limit_of(work, config, gemm, bandwidth=416.0)
    # prefill: 6 tokens x 4 shapes x 2 layers x 20 ms / 2048 rows; 2 LM heads x 4 ms / 200
    assert limit.prefill_s == pytest.approx(6 * 8 * 20e-3 / 2048 + 2 * 4e-3 / 200)
    # decode: 2 tokens x (8 layer calls x 2 ms + 4 ms) / 200 rows
    assert limit.decode_s == pytest.approx(2 * (8 * 2e-3 + 4e-3) / 200)
    assert limit.kv_s == 1.0  # 416 bytes at 416 B/s
    assert limit.limit_s == pytest.approx(limit.gemm_s + 1.0)
    assert fraction(2.0, 4.0) == 0.5 and math.isnan(fraction(1.0, 0.0))


def test_evaluate_adds_the_arrival_floor_of_a_finite_rate() -> None:
    config = tiny()
    machine = Machine("cpu", 2, "bfloat16", 1 << 20, 8 << 20, 416.0, gemm_figures(), 1)
    row = evaluate(Run("W3", [(5, 3), (5, 3)], 10.0, last_arrival_s=7.0), config, machine)
    assert row["kv_bytes"] == 2 * 416 and row["limit_s"] == pytest.approx(2.0, rel=1e-3)
    assert row["fraction"] == pytest.approx(row["limit_s"] / 10.0)
    # the last request alone: prefill at 1 row (5 < 200), decode at 1 row, 1 s of K/V
    alone = 5 * 8 * 1e-3 + 4e-3 + 2 * (8 * 1e-3 + 4e-3) + 1.0
    assert row["arrival_floor_s"] == pytest.approx(7.0 + alone)
    assert row["fraction_of_bound"] == pytest.approx((7.0 + alone) / 10.0)
    unmeasured = evaluate(Run("W1", [(5, 3)], None), config, machine)
    assert unmeasured["fraction"] is None and "arrival_floor_s" not in unmeasured


def test_saved_results_give_durations_and_token_counts(tmp_path: Path) -> None:
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({
        "args": {"request_rate": "inf", "seed": 0, "num_prompts": 2}, "duration_s": 3.0,
        "requests": [{"ok": True, "prompt_len": 5, "output_len": 3},
                     {"ok": False, "prompt_len": 9, "output_len": 1}],
    }))  # fmt: skip
    (run,) = runs_from_json(serve)
    assert (run.label, run.lengths, run.duration_s, run.last_arrival_s) == (
        "serve",
        [(5, 3)],
        3.0,
        0.0,
    )
    compare = tmp_path / "compare.json"
    compare.write_text(json.dumps({
        "args": {"request_rate": 4.0, "burstiness": 1.0, "seed": 1, "num_prompts": 3,
                 "ignore_eos": True, "dataset_name": "random", "random_range_ratio": 0.0},
        "configurations": [{"label": "continuous", "figures": {
            "duration_s": 9.0, "successful_requests": 3, "total_input_tokens": 7,
            "total_output_tokens": 6}}],
    }))  # fmt: skip
    (run,) = runs_from_json(compare)
    assert run.label == "compare: continuous" and run.lengths == [(3, 2), (2, 2), (2, 2)]
    assert run.note == "token totals" and run.last_arrival_s == pytest.approx(
        roofline.last_arrival_s(3, 4.0, 1.0, 1)
    )
    vllm = tmp_path / "vllm.json"
    vllm.write_text(json.dumps({"duration": 2.0, "completed": 2, "request_rate": 4.0,
                                "total_input_tokens": 10, "total_output_tokens": 5}))  # fmt: skip
    (run,) = runs_from_json(vllm)
    assert run.lengths == [(5, 3), (5, 2)] and run.last_arrival_s is None
    assert "mean length" in run.note
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="not a benchmark result"):
        runs_from_json(bad)


def test_durations_flag() -> None:
    assert parse_durations("40.5", ["W1"]) == {"W1": 40.5}
    assert parse_durations("w1=40.5, W3=57", ["W1", "W2", "W3"]) == {"W1": 40.5, "W3": 57.0}
    assert parse_durations(None, ["W1"]) == {}
    for bad, names in (("40", ["W1", "W2"]), ("W4=1", ["W1"]), ("W1=-1", ["W1"]), ("x", ["W1"])):
        with pytest.raises(ValueError, match="--duration-s"):
            parse_durations(bad, names)


def test_cli_parses_roofline_and_the_serve_and_compare_flag() -> None:
    from sluiceway.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "roofline", "--workload", "W3", "--duration-s", "57.5",
                              "--threads", "2", "--json", "out.json"])  # fmt: skip
    assert (args.bench_command, args.workload, args.duration_s) == ("roofline", "W3", "57.5")
    assert (args.dtype, args.threads, args.reps, args.from_json) == ("bfloat16", 2, 3, [])
    args = parser.parse_args(
        ["bench", "roofline", "--from-json", "a.json", "--from-json", "b.json"]
    )
    assert args.from_json == ["a.json", "b.json"] and args.workload == "all"
    assert parser.parse_args(["bench", "serve", "--roofline"]).roofline
    assert parser.parse_args(["bench", "compare", "--roofline"]).roofline
    assert not parser.parse_args(["bench", "serve"]).roofline


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_measurements_run_on_tiny_shapes(dtype: torch.dtype) -> None:
    gemm = measure_gemm(tiny(), dtype, rows=(1, 4, 16), reps=1, cache_bytes=1, max_head_rows=4)
    assert gemm.copies == 2  # at most the layers
    assert set(gemm.seconds) == {1, 4, 16}
    assert set(gemm.seconds[4]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert "lm_head" not in gemm.seconds[16]
    assert all(t > 0 for secs in gemm.seconds.values() for t in secs.values())
    assert measure_bandwidth(1 << 20, reps=1) > 0
    assert l3_cache_bytes() > 0


def test_the_command_prints_and_writes_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sluiceway.cli import build_parser

    machine = Machine("cpu", 2, "bfloat16", 1 << 20, 8 << 20, 416.0, gemm_figures(), 1)
    monkeypatch.setattr(roofline, "model_config", lambda model: (tiny(), "tiny"))
    monkeypatch.setattr(roofline, "measure_machine", lambda config, dtype, reps: machine)
    out = tmp_path / "roofline.json"
    args = build_parser().parse_args(
        ["bench", "roofline", "--workload", "W1", "--duration-s", "40", "--json", str(out)]
    )
    assert roofline.roofline_command(args) == 0
    printed = capsys.readouterr().out
    assert "| W1 | 200 | 51,200 | 25,400 |" in printed
    saved = json.loads(out.read_text())
    (row,) = saved["workloads"]
    assert row["measured_s"] == 40.0 and row["fraction"] == pytest.approx(row["limit_s"] / 40)
    assert saved["machine"]["bandwidth"] == 416.0
    bad = build_parser().parse_args(["bench", "roofline", "--duration-s", "40"])
    assert roofline.roofline_command(bad) == 2  # one number for three workloads


def test_serve_and_compare_print_and_save_the_fraction_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sluiceway.bench import compare, serve
    from sluiceway.bench.metrics import RequestResult, summarize
    from sluiceway.cli import build_parser
    from sluiceway.sharegpt import SampledRequest

    machine = Machine("cpu", 2, "bfloat16", 1 << 20, 8 << 20, 416.0, gemm_figures(), 1)
    monkeypatch.setattr(roofline, "model_config", lambda model: (tiny(), "tiny"))
    monkeypatch.setattr(roofline, "measure_machine", lambda config, dtype, reps=3: machine)
    results = [RequestResult(ok=True, prompt_len=5, output_len=3, ttft=0.5, e2e=1.0)]
    run = serve.BenchRun(results, {**summarize(results, 2.0), "kv_cache_utilization_pct": 0.0}, [])

    async def workload(*args, **kwargs):  # type: ignore[no-untyped-def]
        return run

    monkeypatch.setattr(serve, "load_requests", lambda args: [SampledRequest("", 5, 3)])
    monkeypatch.setattr(serve, "run_workload", workload)
    out = tmp_path / "serve.json"
    args = build_parser().parse_args(["bench", "serve", "--roofline", "--save-result", str(out)])
    assert serve.serve_command(args) == 0
    assert "Roofline" in capsys.readouterr().out
    saved = json.loads(out.read_text())["roofline"]
    assert saved["kv_bytes"] == 416 and saved["fraction"] == pytest.approx(saved["limit_s"] / 2)

    monkeypatch.setattr(compare, "load_requests", lambda args: [SampledRequest("", 5, 3)])
    monkeypatch.setattr(compare, "_run_config", lambda *a: run)
    out = tmp_path / "compare.json"
    args = build_parser().parse_args(
        ["bench", "compare", "--policies", "continuous", "--roofline", "--save-result", str(out)]
    )
    assert compare.compare_command(args) == 0
    saved = json.loads(out.read_text())
    assert saved["roofline"][0]["workload"] == "continuous"
    (run_of_file,) = runs_from_json(out)  # its per-request token counts come back
    assert run_of_file.lengths == [(5, 3)] and run_of_file.note == "per-request token counts"
