"""The `sluiceway` command without a running server: help, version, every flag's help and
one-line usage error, the one-line configuration errors of `serve` (exit 2, no traceback),
`convert`'s refusals, and what the commands that only print import. `generate`'s request and
errors: tests/test_cli_generate.py."""

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
from sluiceway.model_files import (
    ModelFilesError,
    context_window,
    export_hf_folder,
    resolve_max_model_len,
    served_model_name,
)
from tests.cli_helpers import run_cli, usage_error


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


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["serve", "--num-threads", "-1"], "argument --num-threads: must be >= 1, got -1"),
        (["worker", "--num-threads", "0"], "argument --num-threads: must be >= 1, got 0"),
        (["bench", "step", "--num-threads", "0"], "argument --num-threads: must be >= 1, got 0"),
        *(
            (
                [*command, "--log-level", "FOO"],
                "argument --log-level: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
                "(any case), got 'FOO'",
            )
            for command in (["serve"], ["router"], ["scheduler"], ["worker"], ["convert"])
        ),
        (
            ["serve", "--kv-cache-memory", "4XB"],
            "argument --kv-cache-memory: not a size: '4XB' (bytes, or a number with KiB, MiB, "
            "GiB, TiB or KB, MB, GB, TB, e.g. 4GiB, 512MiB, 2000000000)",
        ),
        (
            ["worker", "--kv-cache-memory", "0"],
            "argument --kv-cache-memory: must be at least 1 byte, got 0 (no room for a KV block)",
        ),
        (
            ["serve", "--kv-cache-memory", "0.5"],
            "argument --kv-cache-memory: size must be at least 1 byte, got '0.5'",
        ),
        (
            ["router", "--max-message-size", "0MiB"],
            "argument --max-message-size: must be at least 1 byte, got 0 (every message would "
            "be refused)",
        ),
        (["serve", "--max-model-len", "0"], "argument --max-model-len: must be >= 2, got 0"),
        (["scheduler", "--max-model-len", "1"], "argument --max-model-len: must be >= 2, got 1"),
        (["worker", "--max-model-len", "1"], "argument --max-model-len: must be >= 2, got 1"),
        (
            ["serve", "--max-waiting-requests", "-1"],
            "argument --max-waiting-requests: must be >= 1, got -1",
        ),
        (
            ["serve", "--cache-threshold", "2"],
            "argument --cache-threshold: must be in [0, 1], got 2",
        ),
        (
            ["router", "--cache-threshold", "-1"],
            "argument --cache-threshold: must be in [0, 1], got -1",
        ),
        (
            ["serve", "--balance-abs-threshold", "-1"],
            "argument --balance-abs-threshold: must be >= 0, got -1",
        ),
        (["router", "--drain-timeout", "-1"], "argument --drain-timeout: must be >= 0, got -1"),
        (
            ["serve", "--gpu-memory-utilization", "5"],
            "argument --gpu-memory-utilization: must be in (0, 1], got 5",
        ),
        (
            ["worker", "--gpu-memory-utilization", "0"],
            "argument --gpu-memory-utilization: must be in (0, 1], got 0",
        ),
        (
            ["scheduler", "--static-batch-size", "0"],
            "argument --static-batch-size: must be >= 1, got 0",
        ),
        (["serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["bench", "serve", "--port", "1"], "unrecognized arguments: --port 1"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv: list[str], error: str) -> None:
    command = " ".join(a for a in argv[:2] if not a.startswith("-"))
    assert usage_error(*argv) == (
        f"sluiceway {command}: error: {error} (see sluiceway {command} --help)"
    )


def test_flags_at_their_bounds_are_accepted() -> None:
    args = build_parser().parse_args(
        ["serve", "--log-level", "debug", "--num-threads", "1", "--max-model-len", "2",
         "--cache-threshold", "0", "--balance-abs-threshold", "0", "--drain-timeout", "0",
         "--gpu-memory-utilization", "1", "--static-batch-size", "1",
         "--max-waiting-requests", "1", "--kv-cache-memory", "1", "--max-message-size", "4KiB"]
    )  # fmt: skip
    assert (args.log_level, args.num_threads, args.max_model_len) == ("DEBUG", 1, 2)
    assert (args.cache_threshold, args.balance_abs_threshold, args.drain_timeout) == (0, 0, 0)
    assert (args.gpu_memory_utilization, args.static_batch_size) == (1, 1)
    assert (args.max_waiting_requests, args.kv_cache_memory, args.max_message_size) == (
        1,
        1,
        4096,
    )


def test_a_usage_error_is_one_line_from_the_command_line() -> None:
    result = run_cli("serve", "--kv-cache-memory", "4XB")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "sluiceway serve: error: argument --kv-cache-memory: not a size: '4XB' (bytes, or a "
        "number with KiB, MiB, GiB, TiB or KB, MB, GB, TB, e.g. 4GiB, 512MiB, 2000000000) "
        "(see sluiceway serve --help)\n"
    )


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


def test_serve_a_draft_model_that_is_not_a_model_is_refused_before_any_process(
    tmp_path: pathlib.Path,
) -> None:
    for path, reason in [("/nonexistent.gguf", "model path /nonexistent.gguf does not exist"),
                         (str(tmp_path), f"{tmp_path} is a folder without config.json: not an "
                                         "HF model folder")]:  # fmt: skip
        spec = json.dumps({"method": "draft_model", "model": path, "num_speculative_tokens": 3})
        assert one_line_error("serve", "--speculative-config", spec) == (
            f"sluiceway: speculative_config.model: {reason}"
        )


def test_serve_a_draft_model_of_another_vocabulary_is_refused_before_any_process(
    tmp_path: pathlib.Path,
) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 262144}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = json.dumps(
        {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    )
    assert one_line_error("serve", "--speculative-config", spec) == (
        "sluiceway: speculative_config.model: the draft's vocabulary has 262144 tokens, the "
        "model's 49152"
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
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert one_line_error("serve", "--model", str(tmp_path), "--max-model-len", "100000") == (
        "sluiceway: User-specified max_model_len (100000) is greater than the derived "
        "max_model_len (max_position_embeddings=8192 in model's config.json)"
    )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ],
)
def test_serve_an_architecture_that_is_not_implemented(
    tmp_path: pathlib.Path, config: dict[str, object], named: str
) -> None:
    from sluiceway.worker.architectures import ARCHITECTURES

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert one_line_error("serve", "--model", str(tmp_path)) == (
        f"sluiceway: architecture {named} is not implemented; supported: "
        + ", ".join(ARCHITECTURES)
    )


def test_serve_a_chat_template_that_cannot_be_read() -> None:
    assert one_line_error("serve", "--chat-template", "/nonexistent/chat.jinja") == (
        "sluiceway: --chat-template '/nonexistent/chat.jinja' looks like a file path, but it "
        "cannot be read: No such file or directory"
    )


def test_max_model_len_resolution() -> None:
    assert resolve_max_model_len(None, 8192) == 8192
    assert resolve_max_model_len(100, 8192) == 100
    assert resolve_max_model_len(8192, 8192) == 8192
    # a sliding window is attention's, not a cap: Gemma 3 270M serves 32,768 tokens
    assert resolve_max_model_len(None, 32768) == 32768
    with pytest.raises(ValueError, match=r"\(32769\) is greater .* \(max_position_embeddings"):
        resolve_max_model_len(32769, 32768)
    mistral = {"model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    assert context_window(mistral) == (32768, 4096)
    assert context_window({**mistral, "model_type": "qwen2"}) == (32768, None)
    assert context_window({**mistral, "model_type": "qwen3"}) == (32768, None)
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


def test_convert_an_output_that_cannot_be_written() -> None:
    result = run_cli("convert", "--output", "/proc/forbidden")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1:] == [
        "sluiceway convert: cannot write /proc/forbidden: No such file or directory"
    ]
    assert "Traceback" not in result.stderr


def test_convert_raises_model_files_error_for_any_os_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelFilesError, match=r"^cannot write .*file/out: Not a directory$"):
        export_hf_folder(None, tmp_path / "file" / "out")


def test_bench_serve_a_dataset_path_that_does_not_exist() -> None:
    result = run_cli("bench", "serve", "--dataset-path", "/nonexist.json", "--num-prompts", "2")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "sluiceway bench serve: --dataset-path /nonexist.json: No such file or directory\n"
    )


# What a command that talks to a server, or only prints, must not pay for (~2.3 s of CPU for
# torch through transformers at 83db0c5).
HEAVY = {"torch", "transformers", "triton", "xgrammar", "numpy"}


def imported_packages(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Runs `python -X importtime -m sluiceway.cli *argv`; returns the result (importtime's
    lines removed from its stderr) and the top-level packages the whole run imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sluiceway.cli", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = result.stderr.splitlines(keepends=True)
    timed = [line for line in lines if line.startswith("import time:")]
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in timed[1:]}  # [0]: header
    result.stderr = "".join(line for line in lines if not line.startswith("import time:"))
    return result, names


@pytest.mark.parametrize(
    "argv", [["--version"], ["--help"], ["generate", "--help"], ["bench", "serve", "--help"]]
)
def test_commands_that_only_print_import_no_torch(argv: list[str]) -> None:
    result, packages = imported_packages(*argv)
    assert (result.returncode, result.stderr) == (0, "")
    assert "sluiceway" in packages and "argparse" in packages  # importtime saw the run
    assert packages & HEAVY == set()
