"""The whole stack over real gRPC: answers, oracle parity, batching invariance, block accounting."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import (
    Stack,
    generate_concurrently,
    metrics_urls,
    wait_for_free_blocks,
)
from tests.oracle import greedy

pytestmark = pytest.mark.slow

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
) * 12 + "Summarize the passage above in one sentence:"

PARITY_PROMPTS: list[tuple[str, str]] = [
    ("chat", "What is the capital of France?"),
    ("chat", "Write a haiku about the sea."),
    ("chat", "用一句话介绍一下长城。"),
    ("chat", "List three prime numbers and explain why they are prime."),
    ("plain", "The quick brown fox"),
    ("plain", "def fibonacci(n):"),
    ("plain", "北京是中国的首都，"),
    ("plain", LONG_PROMPT),
]


def test_three_processes_and_the_capital_of_france(stack: Stack) -> None:
    assert set(stack.pids) == {"worker", "scheduler", "router"}
    assert len(set(stack.pids.values())) == 3
    out = subprocess.run(
        [
            sys.executable, "-m", "sluiceway.cli", "generate", "--target", stack.target,
            "--chat", "--temperature", "0", "What is the capital of France?",
        ],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "Paris" in out.stdout


def test_greedy_tokens_equal_transformers(stack: Stack, oracle, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from sluiceway.router.tokenizer import encode_chat, encode_prompt

    prompts = [
        encode_chat(tokenizer, [("user", text)])
        if kind == "chat"
        else encode_prompt(tokenizer, text)
        for kind, text in PARITY_PROMPTS
    ]
    assert max(len(p) for p in prompts) > 300
    with stack.client() as client:
        for (kind, text), prompt_ids in zip(PARITY_PROMPTS, prompts, strict=True):
            req = (
                Client.request(
                    messages=[("user", text)], temperature=0, ignore_eos=True, max_tokens=32
                )
                if kind == "chat"
                else Client.request(text, temperature=0, ignore_eos=True, max_tokens=32)
            )
            _, ids, last = client.generate(req, timeout=120)
            assert last.usage.prompt_tokens == len(prompt_ids), text
            assert ids == greedy(oracle, prompt_ids, 32), text
            assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH


def test_batching_changes_nothing(
    stack: Stack,
    sharegpt_requests: list[inference_pb2.GenerateRequest],
    reference_tokens: list[list[int]],
) -> None:
    with stack.client() as client:
        together = generate_concurrently(client, sharegpt_requests)
        assert [len(t) for t in together] == [24] * 32
        mismatched = [
            i for i, (a, t) in enumerate(zip(reference_tokens, together, strict=True)) if a != t
        ]
        assert mismatched == []
        info = wait_for_free_blocks(client)
        assert info.num_free_kv_blocks == info.num_kv_blocks


def test_every_cancelled_stream_is_counted_by_the_router(stack: Stack) -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.conftest import metric_sum

    url = metrics_urls(stack.log)["router"]
    name = "sluiceway:request_failure_total"
    before = metric_sum(url, name)

    def cancel_after_3(i: int) -> None:
        with stack.client() as client:
            call = client.stub.Generate(
                Client.request(f"Count to {100 + i}:", temperature=0, ignore_eos=True,
                               max_tokens=200), timeout=120,
            )  # fmt: skip
            for k, _ in enumerate(call):
                if k == 2:
                    call.cancel()
                    break

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(cancel_after_3, range(10)))
    deadline = time.monotonic() + 10
    while metric_sum(url, name) - before < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric_sum(url, name) - before == 10


def test_client_cancel_mid_stream_frees_every_block(stack: Stack) -> None:
    with stack.client() as client:
        start = client.model_info()
        assert start.num_free_kv_blocks == start.num_kv_blocks > 0
        stream = client.generate_stream(
            Client.request(LONG_PROMPT, temperature=0, ignore_eos=True, max_tokens=500)
        )
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert client.model_info().num_free_kv_blocks < start.num_kv_blocks
        stream.cancel()  # type: ignore[attr-defined]
        info = wait_for_free_blocks(client, timeout_s=2.0)
        assert info.num_free_kv_blocks == start.num_kv_blocks


def test_stop_string_ends_the_stream_and_frees_blocks(stack: Stack) -> None:
    with stack.client() as client:
        text, _, last = client.generate(
            Client.request("1, 2, 3, 4, 5, 6,", temperature=0, max_tokens=40, stop=[" 9"]),
            timeout=60,
        )
        assert last.finish_reason == inference_pb2.FINISH_REASON_STOP
        assert " 9" not in text and text.startswith(" 7, 8,")
        info = wait_for_free_blocks(client)
        assert info.num_free_kv_blocks == info.num_kv_blocks


def test_invalid_argument_names_the_field(stack: Stack) -> None:
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(Client.request("hi", temperature=-1.0), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in (err.value.details() or "")
        _, ids, _ = client.generate(Client.request("hi", max_tokens=3, temperature=0), timeout=60)
        assert len(ids) == 3


def test_model_info(stack: Stack) -> None:
    with stack.client() as client:
        info = client.model_info()
    assert info.model_id == "SmolLM2-135M-Instruct"
    assert info.vocab_size == 49152 and info.block_size == 16
    assert info.max_model_len == 8192
    assert list(info.eos_token_ids) == [2]
    # 1 GiB of fp32 KV at 720 KiB per 16-token block
    assert info.num_kv_blocks == (1 << 30) // (30 * 2 * 3 * 64 * 4 * 16)


def test_tokenize(stack: Stack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from sluiceway.router.tokenizer import encode_chat, encode_prompt

    with stack.client() as client:
        reply = client.stub.Tokenize(inference_pb2.TokenizeRequest(prompt="北京 is a city"))
        assert list(reply.token_ids) == encode_prompt(tokenizer, "北京 is a city")
        req = inference_pb2.TokenizeRequest()
        req.messages.messages.add(role="user", content="hi")
        assert list(client.stub.Tokenize(req).token_ids) == encode_chat(tokenizer, [("user", "hi")])
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Tokenize(inference_pb2.TokenizeRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "input: set one of prompt, messages"


def test_bench_serve_short_run(stack: Stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    out = tmp_path / "bench.json"
    subprocess.run(
        [
            sys.executable, "-m", "sluiceway.cli", "bench", "serve", "--target", stack.target,
            "--dataset-name", "random", "--num-prompts", "8", "--random-input-len", "32",
            "--random-output-len", "8", "--ignore-eos", "--request-rate", "20",
            "--save-result", str(out), "--plot", str(tmp_path / "bench.png"),
        ],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    result = json.loads(out.read_text())
    assert result["successful_requests"] == 8 and result["failed_requests"] == 0
    assert result["total_output_tokens"] == 64 and result["total_input_tokens"] == 8 * 32
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            assert result[f"{stat}_{name}_ms"] > 0
    for key in ("request_throughput", "output_throughput", "kv_cache_utilization_pct",
                "prefix_cache_hit_rate_pct", "num_preemptions"):  # fmt: skip
        assert key in result
    assert 0 < result["kv_cache_utilization_pct"] <= 100
    assert result["num_free_kv_blocks_after"] == result["num_kv_blocks"] > 0
    # 8 prompts of 32 tokens and 8 outputs each: at least 8 steps (all decoding together),
    # at most 9 * 8 (+ the warm-up's 8 steps, not counted: snapshots are taken after it).
    assert 8 <= result["num_steps"] <= 72
    assert result["step_worker_forward_ms"] > 0 and result["step_rpc_ms"] > 0
    assert result["step_total_ms"] == pytest.approx(
        sum(result[k] for k in ("step_schedule_ms", "step_rpc_ms", "step_worker_prepare_ms",
                                "step_worker_forward_ms", "step_worker_sample_ms",
                                "step_worker_other_ms", "step_apply_ms"))
    )  # fmt: skip
    assert result["detokenize_us_per_token"] > 0


def test_serve_prints_a_metrics_url_per_process(stack: Stack) -> None:
    from urllib.request import urlopen

    with stack.client() as client:  # so that the router's labelled metrics have samples
        client.generate(Client.request("Hi", temperature=0, max_tokens=2), timeout=60)
    urls = metrics_urls(stack.log)
    assert set(urls) == {"router", "scheduler", "worker"}
    expected = {
        "router": "# TYPE sluiceway:time_to_first_token_seconds histogram",
        "scheduler": "# TYPE sluiceway:num_requests_running gauge",
        "worker": "# TYPE sluiceway:kv_blocks_total gauge",
    }
    for process, url in urls.items():
        text = urlopen(url.rstrip(","), timeout=5).read().decode()
        assert expected[process] in text, process
        assert 'model_name="SmolLM2-135M-Instruct"' in text, process
