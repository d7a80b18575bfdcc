"""`sluiceway generate`, `serve` and `convert` as a new user runs them, against a real stack."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from sluiceway.client import Client
from sluiceway.model_files import embedded_model_path
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_for_free_blocks

pytestmark = pytest.mark.slow

EOS_FIRST = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\nOK."


def generate(
    stack: Stack, *argv: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "generate", "--target", stack.target, *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_reads_stdin_and_shows_usage(stack: Stack) -> None:
    with stack.client() as client:
        text, ids, last = client.generate(
            Client.request("The capital of France is", temperature=0, max_tokens=6)
        )
    result = generate(
        stack, "-", "--temperature", "0", "--max-tokens", "6", "--show-usage",
        stdin="The capital of France is\n",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, text + "\n")
    assert result.stderr == (
        f"usage: finish reason length, prompt tokens {last.usage.prompt_tokens}, "
        "completion tokens 6\n"
    )
    assert len(ids) == 6


def test_generate_system_prompt_stop_string_and_logprobs(stack: Stack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [("system", "Answer in one sentence."), ("user", "What is the capital of France?")]
    with stack.client() as client:
        text, ids, _ = client.generate(
            Client.request(messages=messages, temperature=0, max_tokens=12)
        )
    assert " Paris" in text, text
    result = generate(
        stack, "--system", messages[0][1], messages[1][1], "--temperature", "0",
        "--max-tokens", "12", "--stop", " Paris", "--show-usage", "--logprobs", "2",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, text.split(" Paris")[0] + "\n")
    lines = result.stderr.splitlines()
    assert re.fullmatch(r"usage: finish reason stop, prompt tokens \d+, completion tokens \d+",
                        lines[-1])  # fmt: skip
    quoted = r'("(?:[^"\\]|\\.)*")'  # a JSON string: the token's text
    logprobs = [
        re.fullmatch(rf"logprobs: (\d+) token {quoted} \((\d+)\) (-?\d+\.\d{{4}})  "
                     rf"top: {quoted} \((\d+)\) -?\d+\.\d{{4}}, {quoted} \((\d+)\) .+", line)
        for line in lines[:-1]
    ]  # fmt: skip
    assert all(logprobs), lines
    got = [int(m.group(3)) for m in logprobs if m]
    assert got == ids[: len(got)] and len(got) >= 2
    for m in logprobs:
        assert m is not None
        for text_group, id_group in ((2, 3), (5, 6), (7, 8)):  # the token, the top two
            token_id = int(m.group(id_group))
            assert json.loads(m.group(text_group)) == tokenizer.decode([token_id])
        assert m.group(3) == m.group(6)  # greedy: the top one
    # the answer's tokens up to the stop string, as the texts of the logprobs lines
    shown = "".join(json.loads(m.group(2)) for m in logprobs if m)
    assert shown.startswith(text.split(" Paris")[0]), shown


def test_generate_an_eos_first_answer_prints_a_hint(stack: Stack) -> None:
    result = generate(stack, EOS_FIRST, "--temperature", "0", "--show-usage")
    assert (result.returncode, result.stdout) == (0, "")
    hint, usage = result.stderr.splitlines()
    assert hint == (
        "sluiceway generate: no tokens generated (finish reason: stop, the model emitted EOS "
        "first); try --ignore-eos or --min-tokens"
    )
    assert re.fullmatch(r"usage: finish reason stop, prompt tokens \d+, completion tokens 1", usage)
    again = generate(stack, EOS_FIRST, "--temperature", "0", "--min-tokens", "4", "--show-usage")
    assert again.returncode == 0 and "no tokens generated" not in again.stderr
    assert re.search(r"completion tokens ([4-9]|1\d)$", again.stderr.strip()), again.stderr


def test_ctrl_c_during_generate_is_one_line_and_exit_130(stack: Stack) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluiceway.cli", "generate", "--target", stack.target,
         "--ignore-eos", "--max-tokens", "4000", "Tell me a long story."],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.read(1)  # streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert (proc.returncode, err) == (130, "sluiceway generate: interrupted\n")
    with stack.client() as client:  # the stream was cancelled upstream
        info = wait_for_free_blocks(client, timeout_s=10)
        assert info.num_free_kv_blocks == info.num_kv_blocks


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose GGUF conversion cache is empty."""
    return {**os.environ, "SLUICEWAY_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}


def test_first_start_says_it_converts_then_refuses_a_max_model_len_above_8192(
    fresh_cache: dict[str, str],
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "serve", "--port", "0", "--metrics-port", "-1",
         "--http-port", "-1", "--log-format", "console", "--max-model-len", "100000"],
        capture_output=True, text=True, timeout=300, env=fresh_cache,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, "")
    converting, converted, refused = result.stderr.splitlines()
    gguf = embedded_model_path().resolve()
    folder = f"{fresh_cache['SLUICEWAY_CACHE_DIR']}/gguf/SmolLM2-135M-Instruct.Q4_1-"
    assert re.search(
        rf"converting {re.escape(str(gguf))} \(\d+ MB\) into {re.escape(folder)}\S+ \(first "
        r"start only, about 10 s per 100 MB\)",
        converting,
    ), converting
    assert re.search(rf"converted {re.escape(str(gguf))} into \S+ in \d+\.\d s", converted)
    assert refused == (
        "sluiceway: User-specified max_model_len (100000) is greater than the derived "
        "max_model_len (max_position_embeddings=8192 in model's config.json)"
    )


def test_convert_writes_a_folder_that_serves_the_same_greedy_tokens(
    fresh_cache: dict[str, str], stack: Stack, tmp_path: pathlib.Path
) -> None:
    out = tmp_path / "SmolLM2-hf"
    result = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "convert", "--output", str(out)],
        capture_output=True, text=True, timeout=300, env=fresh_cache,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"sluiceway convert: wrote {out}; serve it with: sluiceway serve --model {out}\n"
    )
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert "sluiceway.json" not in files
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    requests = [Client.request(p, temperature=0, max_tokens=16, ignore_eos=True) for p in prompts]
    with stack.client() as client:
        reference = [client.generate(r)[1] for r in requests]
    served = start_stack("--model", str(out))
    try:
        with served.client() as client:
            assert [client.generate(r)[1] for r in requests] == reference
            assert client.model_info().model_id == "SmolLM2-hf"
        assert "serving SmolLM2-hf on" in "".join(served.log)
    finally:
        assert stop_stack(served) == 0, "".join(served.log[-30:])


def test_generate_against_a_server_imports_no_torch(stack: Stack) -> None:
    from tests.test_cli import HEAVY, imported_packages

    result, packages = imported_packages(
        "generate", "--target", stack.target, "--temperature", "0", "--max-tokens", "8",
        "--logprobs", "1", "--ignore-eos", "The capital of France is",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len(result.stderr.splitlines()) == 8  # a logprobs line per token
    assert result.stdout.strip()
    assert "grpc" in packages and packages & HEAVY == set()


def test_bench_serve_against_a_server_imports_no_torch(stack: Stack) -> None:
    """The workload's token counts come from the model's tokenizer.json through `tokenizers`
    (transformers would import torch: 3-4 s before the first request); numpy draws the
    arrival times."""
    from tests.test_cli import HEAVY, imported_packages

    result, packages = imported_packages(
        "bench", "serve", "--target", stack.target, "--num-prompts", "2",
        "--sharegpt-max-output-len", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "successful_requests                                  2" in result.stdout, result.stdout
    assert "tokenizers" in packages and packages & (HEAVY - {"numpy"}) == set()
