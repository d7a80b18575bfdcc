"""Speculative decoding end to end (`serve --speculative-config`, bfloat16: the batch-invariant
worker): with disaggregated prefill (the proposals on the decode worker) and with tensor
parallelism (three gloo ranks verify together) the tokens are those of the same stack without
speculation, every block comes back, and the acceptance counters move; so with a draft model
(the embedded GGUF in gguf_a8 drafting, `serve` handing the flag to the workers) on the
decode worker of a disaggregated stack (the draft's K/V recomputed after the hand-off)."""

from __future__ import annotations

import json

import pytest

from sluiceway.client import Client
from sluiceway.kernels import cpu_ops
from sluiceway.model_files import embedded_model_path
from sluiceway.speculative import SpeculativeConfig
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

BF16 = ("--dtype", "bfloat16")
SPEC = ("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}))  # fmt: skip
DRAFT = ("--speculative-config", json.dumps({"method": "draft_model", "num_speculative_tokens": 3,
          "model": str(embedded_model_path()), "quantization": "gguf_a8"}))  # fmt: skip
PARAGRAPH = (
    "The river rises in the hills above the town, runs past the old mill and the stone "
    "bridge, and reaches the sea after a long bend through the marshes."
)
REPEAT = f"Repeat this paragraph 3 times.\n\n{PARAGRAPH}\n\n{PARAGRAPH}\n\n"


def _run(
    requests: list[inference_pb2.GenerateRequest], *flags: str
) -> tuple[list[list[int]], float]:
    """Each request's tokens from a stack started with `flags`, all sent at once, and the
    proposed tokens its scheduler accepted."""
    stack = start_stack(*flags)
    try:
        scheduler = metrics_urls(stack.log)["scheduler"]
        if "--speculative-config" in flags:  # the scheduler says it speculates, and how
            config = SpeculativeConfig.parse(flags[flags.index("--speculative-config") + 1])
            assert any(
                "speculative_decoding_on" in line and config.to_json() in line for line in stack.log
            ), "".join(stack.log[-30:])
        with stack.client() as client:
            tokens = generate_concurrently(client, requests)
            info = wait_for_free_blocks(client)
            assert info.num_free_kv_blocks == info.num_kv_blocks
        accepted = metric_sum(scheduler, "sluiceway:spec_decode_num_accepted_tokens_total")
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
    return tokens, accepted


def test_disaggregated_and_tensor_parallel_speculation_give_the_plain_tokens(
    sharegpt_requests: list[inference_pb2.GenerateRequest],
) -> None:
    requests = [
        Client.request(REPEAT, temperature=0, max_tokens=48, ignore_eos=True),
        Client.request(REPEAT, temperature=0.8, top_p=0.9, seed=5, max_tokens=48, ignore_eos=True),
        *sharegpt_requests[:4],
    ]
    plain, _ = _run(requests, *BF16)
    disaggregated, accepted = _run(
        requests, *BF16, *SPEC, "--num-prefill-workers", "1", "--num-decode-workers", "1"
    )
    assert disaggregated == plain and accepted > 0
    if cpu_ops.quant_gemm_a8_supported():  # (the draft's int8 activations need VNNI)
        drafted, accepted = _run(
            requests, *BF16, *DRAFT, "--num-prefill-workers", "1", "--num-decode-workers", "1"
        )
        assert drafted == plain and accepted > 0

    tp_plain, _ = _run(requests, *BF16, "--tensor-parallel-size", "3")
    tp_spec, accepted = _run(requests, *BF16, *SPEC, "--tensor-parallel-size", "3")
    assert tp_spec == tp_plain and accepted > 0
