"""Tensor parallelism end to end: `sluiceway serve --tensor-parallel-size 3` (three gloo worker
ranks, each with 3 of SmolLM2's 9 query heads and 1 of its 3 KV heads) gives the greedy tokens
of one worker, and comes back whole when one rank is killed; a size that does not divide the
KV heads is refused at start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest

from sluiceway.client import Client
from sluiceway.ports import free_port
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import (
    generate_concurrently,
    start_stack,
    stop_stack,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

NUM_PROMPTS = 8


def test_three_ranks_give_the_tokens_of_one_worker_and_survive_a_killed_rank(
    sharegpt_requests: list[inference_pb2.GenerateRequest],
    reference_tokens: list[list[int]],
) -> None:
    stack = start_stack("--tensor-parallel-size", "3")
    try:
        assert {"worker-rank0", "worker-rank1", "worker-rank2"} <= set(stack.pids)
        with stack.client() as client:
            tokens = generate_concurrently(client, sharegpt_requests[:NUM_PROMPTS])
            info = wait_for_free_blocks(client)
            assert tokens == reference_tokens[:NUM_PROMPTS]
            assert info.num_free_kv_blocks == info.num_kv_blocks

            # A rank dies mid-stream: the stream ends UNAVAILABLE, serve restarts the whole
            # instance (the other ranks are broken by the lost peer), and it serves again.
            request = Client.request("Count to two hundred:", temperature=0, max_tokens=400,
                                     ignore_eos=True)  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                for k, _ in enumerate(client.stub.Generate(request, timeout=300)):
                    if k == 2:
                        os.kill(stack.pids["worker-rank1"], signal.SIGKILL)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            deadline = time.monotonic() + 120
            while True:
                try:
                    again = client.generate(sharegpt_requests[0], timeout=120)[1]
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline, "".join(stack.log[-30:])
                    time.sleep(0.5)
            assert again == reference_tokens[0]
            for rank in ("worker-rank0", "worker-rank1", "worker-rank2"):
                assert any(f"{rank} restarted" in line for line in stack.log)
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def test_a_size_that_does_not_divide_the_kv_heads_is_refused_at_start() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(free_port()),
         "--metrics-port", "-1", "--http-port", "-1", "--tensor-parallel-size", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "tensor_parallel_size 2 does not divide the model's 3 KV heads" in proc.stderr
    assert re.search(
        r"^sluiceway: worker-rank[01] refused its configuration \(exit 2, its reason above\); "
        "stopping$",
        proc.stderr,
        re.MULTILINE,
    ), proc.stderr
