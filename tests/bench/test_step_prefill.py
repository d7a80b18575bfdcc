"""`sluiceway bench step --prefill-tokens` (issue 33, part 3): the prompts it makes, how it
splits a profile, the FLOPs it counts, and one run on a tiny random model (no timing is
asserted: speed targets never live in tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluiceway.bench.step_prefill import is_linear_op, prompt_lengths, split_self_times
from sluiceway.cli import main


def test_prompt_lengths_fill_the_rows_with_a_shorter_last_prompt() -> None:
    assert prompt_lengths(2048, 256) == [256] * 8
    assert prompt_lengths(600, 256) == [256, 256, 88]
    assert prompt_lengths(5, 256) == [5]
    with pytest.raises(ValueError, match=">= 1"):
        prompt_lengths(0, 256)


def test_profile_entries_split_into_linears_attention_and_the_rest() -> None:
    entries = [
        ("sluiceway::bf16_gemm", 3.0),
        ("sluiceway::quant_gemm", 0.3),
        ("sluiceway::quant_gemm_a8", 0.03),
        ("mkldnn::_linear_pointwise", 0.6),
        ("sluiceway::paged_attention", 1.5),
        ("sluiceway::silu_and_mul", 0.15),
        ("aten::empty", 0.06),
    ]
    split = split_self_times(entries, steps=3)
    assert split.linears == pytest.approx(3.93 / 3)
    assert split.attention == pytest.approx(0.5)
    assert split.other == pytest.approx(0.07)
    assert not is_linear_op("sluiceway::decoder_layers")  # the stack: never counted as a GEMM


def test_cli_refuses_decode_batches_with_a_prefill_step() -> None:
    with pytest.raises(SystemExit, match="--batch-sizes sets decode batches"):
        main(["bench", "step", "--random-model", "tiny", "--prefill-tokens", "64",
              "--batch-sizes", "1,2"])  # fmt: skip


def test_prefill_step_on_a_tiny_random_model(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--random-model", "tiny", "--device", "cpu", "--dtype", "bfloat16",
            "--prefill-tokens", "600", "--context-len", "256", "--warmup", "1", "--iters", "1",
            "--num-threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    prefill = report["prefill"]
    assert prefill["prefill_tokens"] == 600
    assert prefill["prompt_lens"] == [256, 256, 88]
    assert report["context_lengths"]["kind"] == "prompts"
    assert report["results"] == []  # no decode batch
    # tiny: 4 layers of hidden 256, FFN 688, 4 query / 2 KV heads of 64; vocabulary 1024
    per_layer = (4 + 2 * 2) * 64 * 256 + 256 * 256 + 2 * 688 * 256 + 688 * 256
    assert prefill["linear_flops"] == 2 * 600 * 4 * per_layer + 2 * 3 * 1024 * 256
    assert prefill["linears_ms"] > 0 and prefill["attention_ms"] > 0
    assert prefill["linears_of_p"] > 0


def test_more_prompts_than_the_lm_head_rows_p_measures(tmp_path: Path) -> None:
    """201 one-token prompts: the LM head runs on 201 rows, above the 200 that bench
    roofline times it at; P is measured at 201 for this step."""
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--random-model", "tiny", "--device", "cpu", "--dtype", "bfloat16",
            "--prefill-tokens", "201", "--context-len", "1", "--warmup", "0", "--iters", "1",
            "--num-threads", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    prefill = json.loads(out.read_text())["prefill"]
    assert prefill["prompt_lens"] == [1] * 201
    per_layer = (4 + 2 * 2) * 64 * 256 + 256 * 256 + 2 * 688 * 256 + 688 * 256
    assert prefill["linear_flops"] == 2 * 201 * 4 * per_layer + 2 * 201 * 1024 * 256


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--iters", "0"], "argument --iters: must be >= 1, got 0"),
        (["--context-len", "0"], "argument --context-len: must be >= 1, got 0"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    ],
)
def test_bad_counts_are_usage_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--random-model", "tiny", "--prefill-tokens", "8", *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_json_folder_or_a_context_past_the_model_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    with pytest.raises(SystemExit, match="is a folder, give a file path"):
        main(["bench", "step", "--random-model", "tiny", "--prefill-tokens", "8",
              "--json", str(tmp_path)])  # fmt: skip
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="--json: cannot make"):
        main(["bench", "step", "--random-model", "tiny", "--prefill-tokens", "8",
              "--json", str(blocker / "x.json")])  # fmt: skip
    with pytest.raises(SystemExit, match="max_model_len"):  # the embedded model: 8,192
        main(["bench", "step", "--device", "cpu", "--prefill-tokens", "9000",
              "--context-len", "9000"])  # fmt: skip
