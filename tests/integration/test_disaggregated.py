"""Disaggregated prefill end to end: a prefill worker and a decode worker (separate processes,
KV blocks copied through the prefill worker's shared-memory pool) give the same greedy tokens
as one worker."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import (
    generate_concurrently,
    metric_sum,
    metrics_urls,
    start_stack,
    stop_stack,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

NUM_PROMPTS = 16


def test_one_prefill_and_one_decode_worker_give_the_tokens_of_one_worker(
    sharegpt_requests: list[inference_pb2.GenerateRequest],
    reference_tokens: list[list[int]],
) -> None:
    requests = sharegpt_requests[:NUM_PROMPTS]
    stack = start_stack("--num-prefill-workers", "1", "--num-decode-workers", "1")
    try:
        assert {"worker-prefill0", "worker-decode0"} <= set(stack.pids)
        urls = metrics_urls(stack.log)
        with stack.client() as client:
            tokens = generate_concurrently(client, requests)
            info = wait_for_free_blocks(client)
            transfers = metric_sum(urls["scheduler"], "sluiceway:kv_transfers_total")
            transfer_bytes = metric_sum(urls["scheduler"], "sluiceway:kv_transfer_bytes_total")
            # A 1-token prompt, alone: its only step on the prefill worker is a prefill step.
            before = steps_by_phase(urls["worker-prefill0"])
            one_token = Client.request(prompt_token_ids=[504], temperature=0, max_tokens=4,
                                       ignore_eos=True)  # fmt: skip
            final = list(client.stub.Generate(one_token, timeout=120))[-1]
            assert final.usage.completion_tokens == 4
            after = steps_by_phase(urls["worker-prefill0"])
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
    mismatched = [
        i
        for i, (a, b) in enumerate(zip(reference_tokens[:NUM_PROMPTS], tokens, strict=True))
        if a != b
    ]
    assert mismatched == []
    # every sequence moved once its first token was sampled (24 tokens each, none ends early)
    assert transfers == NUM_PROMPTS
    bytes_per_block = 30 * 2 * 3 * 64 * 4 * 16  # SmolLM2, fp32, 16 tokens
    assert transfer_bytes % bytes_per_block == 0 and transfer_bytes >= NUM_PROMPTS * bytes_per_block
    assert info.num_free_kv_blocks == info.num_kv_blocks
    assert (after["prefill"] - before["prefill"], after["decode"] - before["decode"]) == (1, 0)


def steps_by_phase(url: str) -> dict[str, float]:
    """The worker's `forward_seconds` step counts by phase."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    counts = {"prefill": 0.0, "decode": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sluiceway:forward_seconds_count":
                counts[s.labels["phase"]] += s.value
    return counts
