"""The worker's side of a step: records, block tables and the copy-on-write block copies."""

from __future__ import annotations

import pathlib

import pytest
import torch

from sluiceway.internal.v1 import worker_pb2
from sluiceway.kernels.paged_attention import key_blocks, value_blocks
from sluiceway.v1 import inference_pb2
from sluiceway.worker.model_runner import ModelRunner
from sluiceway.worker.server import StepExecutor

BLOCK = 4
PROMPT = [5, 9, 11, 200, 3, 17, 42, 8, 99, 61]  # 10 tokens: blocks 0, 1 and half of 2


def _slot(pool: torch.Tensor, block: int, offset: int, head_dim: int) -> torch.Tensor:
    """K and V of every layer at one slot, ``[L, 2, Hkv, D]`` (layout: kernels/paged_attention.py)."""
    return torch.stack([
        torch.stack([key_blocks(layer, head_dim)[block, :, :, offset],
                     value_blocks(layer, head_dim)[block, :, offset, :]])
        for layer in pool
    ])  # fmt: skip


def test_a_forked_sample_copies_the_partial_block_and_both_records_follow(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    executor = StepExecutor(runner)
    greedy = inference_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1)
    first = executor.execute(
        worker_pb2.StepRequest(
            step_id=1,
            new_sequences=[
                worker_pb2.NewSequence(seq_id=1, prompt_token_ids=PROMPT, sampling=greedy)
            ],
            scheduled=[
                worker_pb2.ScheduledSequence(
                    seq_id=1, num_computed_tokens=0, num_new_tokens=10, new_block_ids=[0, 1, 2]
                )
            ],
        )
    )
    token = first.sampled[0].token_id
    pool = runner.kv_pool
    d = runner.config.head_dim
    written = [_slot(pool, 2, o, d).clone() for o in range(2)]  # positions 8 and 9
    # sample 2 forks 9 tokens (blocks 0, 1, 2) and recomputes position 9 in a copy of block
    # 2 (5); sample 1 writes position 10 into another copy (6), as the scheduler plans it
    second = executor.execute(
        worker_pb2.StepRequest(
            step_id=2,
            block_copies=[
                worker_pb2.BlockCopy(src_block_id=2, dst_block_id=5),
                worker_pb2.BlockCopy(src_block_id=2, dst_block_id=6),
            ],
            new_sequences=[
                worker_pb2.NewSequence(seq_id=2, prompt_token_ids=PROMPT, sampling=greedy)
            ],
            scheduled=[
                worker_pb2.ScheduledSequence(
                    seq_id=1,
                    appended_token_ids=[token],
                    num_computed_tokens=10,
                    num_new_tokens=1,
                    copied_last_block_id=6,
                ),
                worker_pb2.ScheduledSequence(
                    seq_id=2, num_computed_tokens=9, num_new_tokens=1, new_block_ids=[0, 1, 5]
                ),
            ],
        )
    )
    assert executor.sequences[1].block_table == [0, 1, 6]
    assert executor.sequences[2].block_table == [0, 1, 5]
    sampled = {s.seq_id: s.token_id for s in second.sampled}
    assert sampled[2] == token  # greedy from the same prompt: the same first token
    assert torch.equal(_slot(pool, 2, 0, d), written[0]) and torch.equal(
        _slot(pool, 2, 1, d), written[1]
    )  # the source block is untouched
    for copy in (5, 6):
        assert torch.equal(_slot(pool, copy, 0, d), written[0])  # copied
    torch.testing.assert_close(_slot(pool, 5, 1, d), written[1])  # recomputed by sample 2
    assert torch.equal(_slot(pool, 6, 1, d), written[1])  # copied, then sample 1 wrote slot 2


def test_a_copy_outside_the_pool_is_refused(tiny_models: dict[str, pathlib.Path]) -> None:
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    request = worker_pb2.StepRequest(
        step_id=1,
        block_copies=[worker_pb2.BlockCopy(src_block_id=0, dst_block_id=runner.num_kv_blocks)],
    )
    with pytest.raises(ValueError, match="dst_block_ids"):
        StepExecutor(runner).execute(request)
