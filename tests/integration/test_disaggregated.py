"""Disaggregated prefill end to end: a prefill worker and a decode worker (separate processes,
KV blocks copied through the prefill worker's shared-memory pool) give the same greedy tokens
as one worker."""

from __future__ import annotations

import pytest

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
        with stack.client() as client:
            tokens = generate_concurrently(client, requests)
            info = wait_for_free_blocks(client)
        scheduler = metrics_urls(stack.log)["scheduler"]
        transfers = metric_sum(scheduler, "sluiceway:kv_transfers_total")
        transfer_bytes = metric_sum(scheduler, "sluiceway:kv_transfer_bytes_total")
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
