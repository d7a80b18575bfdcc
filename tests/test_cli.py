"""The `sluiceway` command without a running server: help, version, `generate`'s request, and
the one-line configuration errors of `serve` (exit 2, no traceback)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from sluiceway.cli import build_parser
from sluiceway.generate_cli import build_request
from sluiceway.model_files import (
    ModelFilesError,
    context_window,
    export_hf_folder,
    resolve_max_model_len,
    served_model_name,
)
from sluiceway.v1 import inference_pb2


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def flags(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, argparse.Action]]:
    """Every flag and positional of `parser` and of its subcommands, with the command path."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, parser, action


def test_every_flag_of_every_subcommand_has_help_that_shows_its_default() -> None:
    seen = set()
    for path, parser, action in flags(build_parser()):
        name = " ".join(
            (*path, action.option_strings[-1] if action.option_strings else action.dest)
        )
        seen.add(name)
        assert action.help, f"{name} has no help"
        shown = parser._get_formatter()._get_help_string(action) % vars(action)
        if action.option_strings and not action.required:
            assert "default" in shown.lower(), f"{name}: {shown!r} shows no default"
    assert {
        "serve --port",
        "serve --max-num-seqs",
        "generate --target",
        "generate --temperature",
        "generate prompt",
        "bench step --iters",
    } <= seen


def test_serve_help_shows_defaults() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "--port PORT the first router's port (more routers: the next ones; 0 = free ports) " \
        "(default: 50051)" in text  # fmt: skip
    assert "--max-num-seqs MAX_NUM_SEQS sequences in one step at most (default: 256)" in text


def test_version() -> None:
    result = run_cli("--version")
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"sluiceway {importlib.metadata.version('sluiceway')}\n"


def test_generate_has_a_flag_for_every_sampling_param() -> None:
    args = build_parser().parse_args(
        ["generate", "Hi", "--system", "Be brief.", "--max-tokens", "9", "--min-tokens", "2",
         "--temperature", "0.5", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.1",
         "--seed", "3", "--repetition-penalty", "1.2", "--presence-penalty", "0.5",
         "--frequency-penalty", "-0.5", "--stop", "a", "--stop", "b c", "--stop-token-ids",
         "2,7", "--ignore-eos", "--include-stop-str-in-output", "--no-skip-special-tokens",
         "--logprobs", "5", "-n", "2"]
    )  # fmt: skip
    req = build_request(args, "Hi")
    s = req.sampling
    for field in inference_pb2.SamplingParams.DESCRIPTOR.fields:
        value = getattr(s, field.name)
        assert value or (field.has_presence and s.HasField(field.name)), field.name
    assert (s.max_tokens, s.min_tokens, s.top_k, s.seed, s.logprobs, s.n) == (9, 2, 40, 3, 5, 2)
    assert (s.temperature, s.top_p, s.min_p) == pytest.approx((0.5, 0.9, 0.1))
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx(
        (1.2, 0.5, -0.5)
    )
    assert (list(s.stop), list(s.stop_token_ids)) == (["a", "b c"], [2, 7])
    assert (s.ignore_eos, s.include_stop_str_in_output, s.skip_special_tokens) == (
        True,
        True,
        False,
    )
    assert [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]


def test_generate_without_flags_leaves_every_sampling_param_to_the_server() -> None:
    req = build_request(build_parser().parse_args(["generate", "Hi"]), "Hi")
    assert req.prompt == "Hi"
    assert req.sampling == inference_pb2.SamplingParams()


@pytest.mark.parametrize(
    ("flag", "error"),
    [
        (
            "--stop-token-ids=2,x",
            "argument --stop-token-ids: must be token ids like 2,7, got '2,x'",
        ),
        ("--stop-token-ids=-1", "argument --stop-token-ids: token ids must be >= 0, got '-1'"),
        ("--max-tokens=0", "argument --max-tokens: must be >= 1, got 0"),
    ],
)
def test_generate_bad_flag_is_a_usage_error(flag: str, error: str) -> None:
    result = run_cli("generate", "Hi", flag)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == f"sluiceway generate: error: {error}"


def one_line_error(*argv: str) -> str:
    """Runs `sluiceway *argv`, asserts exit 2 and a single stderr line; returns that line."""
    result = run_cli(*argv, "--metrics-port", "-1", "--http-port", "-1", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr.rstrip("\n")


def test_serve_a_model_path_that_does_not_exist() -> None:
    assert one_line_error("serve", "--model", "/nonexistent") == (
        "sluiceway: model path /nonexistent does not exist"
    )


def test_serve_a_folder_without_config_json(tmp_path: pathlib.Path) -> None:
    assert one_line_error("serve", "--model", str(tmp_path)) == (
        f"sluiceway: {tmp_path} is a folder without config.json: not an HF model folder"
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch build")
def test_serve_device_cuda_on_a_cpu_only_torch() -> None:
    assert one_line_error("serve", "--device", "cuda") == (
        f"sluiceway: --device cuda: torch {torch.__version__} is a CPU-only build; install a "
        "CUDA build of torch (README: GPU install) or pass --device cpu"
    )


def test_serve_a_step_budget_below_max_num_seqs() -> None:
    assert one_line_error("serve", "--max-num-batched-tokens", "64") == (
        "sluiceway: max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (256)"
    )


def test_scheduler_a_step_budget_below_max_num_seqs() -> None:
    result = run_cli("scheduler", "--max-num-seqs", "16", "--max-num-batched-tokens", "8")
    assert result.returncode == 2
    assert result.stderr == (
        "sluiceway scheduler: max_num_batched_tokens (8) must be greater than or equal to "
        "max_num_seqs (16)\n"
    )


def test_serve_max_model_len_above_the_models_context(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert one_line_error("serve", "--model", str(tmp_path), "--max-model-len", "100000") == (
        "sluiceway: User-specified max_model_len (100000) is greater than the derived "
        "max_model_len (max_position_embeddings=8192 in model's config.json)"
    )


def test_max_model_len_resolution() -> None:
    assert resolve_max_model_len(None, 8192, None) == 8192
    assert resolve_max_model_len(100, 8192, None) == 100
    assert resolve_max_model_len(8192, 8192, None) == 8192
    assert resolve_max_model_len(None, 32768, 4096) == 4096
    with pytest.raises(ValueError, match=r"\(8193\) is greater .* \(sliding_window=4096 in"):
        resolve_max_model_len(8193, 32768, 4096)
    mistral = {"model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    assert context_window(mistral) == (32768, 4096)
    assert context_window({**mistral, "model_type": "qwen2"}) == (32768, None)
    assert context_window({"model_type": "llama"}) == (2048, None)


def test_served_model_name(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "SmolLM2-hf"
    folder.mkdir()
    assert served_model_name(folder) == "SmolLM2-hf"
    assert served_model_name(folder / ".." / "SmolLM2-hf") == "SmolLM2-hf"
    assert served_model_name(folder, "my-model") == "my-model"
    (folder / "sluiceway.json").write_text(json.dumps({"model_id": "SmolLM2-135M-Instruct"}))
    assert served_model_name(folder) == "SmolLM2-135M-Instruct"


def test_convert_refuses_a_folder_that_is_not_empty(tmp_path: pathlib.Path) -> None:
    (tmp_path / "x").write_text("")
    with pytest.raises(ModelFilesError, match="exists and is not an empty folder"):
        export_hf_folder(None, tmp_path)
    with pytest.raises(ModelFilesError, match=r"x is not a \.gguf file"):
        export_hf_folder(tmp_path / "x", tmp_path / "out")
