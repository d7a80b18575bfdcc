"""Parallel sampling (``sampling.n`` > 1) through the whole stack, in bfloat16 (the default):
the n samples share the prompt's full KV blocks (through the prefix cache: the first computes
the prompt, the others its partial last block only, scheduler/scheduler.py) and give the very
tokens of n single requests with seeds seed + i. Every block comes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, metric_sum, metrics_urls, wait_for_free_blocks

pytestmark = pytest.mark.slow

# 16-token blocks: a prompt of 2 full blocks and a partial one, so that the samples share
# the full blocks and each computes the partial one
PROMPT = (
    "Here is a list of European capitals, one per line, with their countries and a short "
    "note on each, written for a geography class of young students who are learning the "
    "map of Europe:\n"
)


def _scheduler_metric(stack: Stack, name: str) -> float:
    urls = metrics_urls(stack.log)
    return sum(metric_sum(url, name) for proc, url in urls.items() if "scheduler" in proc)


def test_seeded_samples_are_the_tokens_of_single_requests_and_share_the_prompt(
    stack: Stack,
) -> None:
    n, seed = 3, 1234
    with stack.client() as client:
        prompt_len = len(
            client.stub.Tokenize(inference_pb2.TokenizeRequest(prompt=PROMPT)).token_ids
        )
        assert prompt_len > 32 and prompt_len % 16, prompt_len  # full blocks and a partial one
        queries = _scheduler_metric(stack, "sluiceway:prefix_cache_queries_total")
        hits = _scheduler_metric(stack, "sluiceway:prefix_cache_hits_total")
        request = Client.request(PROMPT, temperature=1.0, seed=seed, max_tokens=24,
                                 ignore_eos=True, n=n, request_id="parallel-1")  # fmt: skip
        samples = client.generate_samples(request, timeout=600)
        queries = _scheduler_metric(stack, "sluiceway:prefix_cache_queries_total") - queries
        hits = _scheduler_metric(stack, "sluiceway:prefix_cache_hits_total") - hits
        singles = [
            client.generate(
                Client.request(
                    PROMPT, temperature=1.0, seed=seed + i, max_tokens=24, ignore_eos=True
                ),
                timeout=600,
            )
            for i in range(n)
        ]
        info = wait_for_free_blocks(client)
    assert [ids for _, ids, _ in samples] == [ids for _, ids, _ in singles]
    assert [text for text, _, _ in samples] == [text for text, _, _ in singles]
    assert len({tuple(ids) for _, ids, _ in samples}) == n  # three seeds, three samples
    for i, (_, ids, last) in enumerate(samples):
        assert len(ids) == 24 and last.index == i and last.request_id == "parallel-1"
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt_len, 24)
    # the first sample computed the prompt; n - 1 found its full blocks in the prefix cache
    assert (queries, hits) == (n * prompt_len, (n - 1) * ((prompt_len - 1) // 16 * 16))
    assert info.num_free_kv_blocks == info.num_kv_blocks


def test_greedy_samples_are_all_the_greedy_answer(stack: Stack) -> None:
    with stack.client() as client:
        _, single, _ = client.generate(Client.request(PROMPT, temperature=0, max_tokens=16))
        samples = client.generate_samples(
            Client.request(PROMPT, temperature=0, max_tokens=16, n=4), timeout=600
        )
        info = wait_for_free_blocks(client)
    assert [ids for _, ids, _ in samples] == [single] * 4
    assert info.num_free_kv_blocks == info.num_kv_blocks


def test_a_stop_string_ends_only_its_own_sample(stack: Stack) -> None:
    with stack.client() as client:
        singles = [
            client.generate(
                Client.request(
                    PROMPT, temperature=1.0, seed=40 + i, max_tokens=32, ignore_eos=True, stop=["e"]
                )
            )
            for i in range(3)
        ]
        samples = client.generate_samples(
            Client.request(PROMPT, temperature=1.0, seed=40, max_tokens=32, ignore_eos=True,
                           stop=["e"], n=3), timeout=600)  # fmt: skip
        info = wait_for_free_blocks(client)
    assert [(t, ids) for t, ids, _ in samples] == [(t, ids) for t, ids, _ in singles]
    assert info.num_free_kv_blocks == info.num_kv_blocks


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_invalid_argument(stack: Stack, n: int) -> None:
    with stack.client() as client, pytest.raises(grpc.RpcError) as info:
        client.generate_samples(Client.request("Hi", n=n), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n" in (info.value.details() or "")


def test_cancelling_a_parallel_request_frees_every_block(stack: Stack) -> None:
    with stack.client() as client:
        stream = client.generate_stream(
            Client.request(PROMPT, temperature=1.0, max_tokens=400, ignore_eos=True, n=5)
        )
        seen: set[int] = set()
        for response in stream:
            seen.add(response.index)
            if len(seen) == 5:
                break
        stream.cancel()  # type: ignore[attr-defined]
        info = wait_for_free_blocks(client, timeout_s=10)
    assert seen == set(range(5))
    assert info.num_free_kv_blocks == info.num_kv_blocks


def test_two_live_requests_with_one_request_id_keep_their_own_blocks(stack: Stack) -> None:
    prompts = [list(range(2000, 2040)), list(range(5000, 5030))]

    def request(ids: list[int]) -> inference_pb2.GenerateRequest:
        return Client.request(prompt_token_ids=ids, temperature=0, max_tokens=20,
                              ignore_eos=True, n=2, request_id="dup")  # fmt: skip

    with stack.client() as client:
        alone = [client.generate_samples(request(p), timeout=600) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda p: client.generate_samples(request(p), 600), prompts))
        info = wait_for_free_blocks(client)
    assert [[ids for _, ids, _ in r] for r in together] == [[ids for _, ids, _ in r] for r in alone]
    assert info.num_free_kv_blocks == info.num_kv_blocks
