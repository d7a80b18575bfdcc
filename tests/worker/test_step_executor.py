"""The worker's side of a step and of a block copy: records, block tables, refused copies."""

from __future__ import annotations

import pathlib

import pytest
import torch

from sluiceway.internal.v1 import worker_pb2
from sluiceway.kernels.paged_attention import key_blocks, value_blocks
from sluiceway.v1 import inference_pb2
from sluiceway.worker.kv_pool import allocate_shared_kv_pool
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


GREEDY = inference_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1)


def prompt_step(step_id: int, seq_id: int) -> worker_pb2.StepRequest:
    """A step that adds sequence `seq_id` (PROMPT, greedy) and computes its whole prompt into
    blocks 0-2."""
    return worker_pb2.StepRequest(
        step_id=step_id,
        new_sequences=[
            worker_pb2.NewSequence(seq_id=seq_id, prompt_token_ids=PROMPT, sampling=GREEDY)
        ],
        scheduled=[
            worker_pb2.ScheduledSequence(
                seq_id=seq_id, num_computed_tokens=0, num_new_tokens=10, new_block_ids=[0, 1, 2]
            )
        ],
    )


def test_a_sample_starting_from_cached_blocks_computes_its_partial_block_in_its_own(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    executor = StepExecutor(runner)
    first = executor.execute(prompt_step(1, seq_id=1))
    token = first.sampled[0].token_id
    pool = runner.kv_pool
    d = runner.config.head_dim
    before = pool.clone()
    # sample 2 takes blocks 0 and 1 (8 tokens) from the prefix cache and computes positions 8
    # and 9 into block 5; sample 1 writes position 10 into its own block 2, as the scheduler
    # plans it
    second = executor.execute(
        worker_pb2.StepRequest(
            step_id=2,
            new_sequences=[
                worker_pb2.NewSequence(seq_id=2, prompt_token_ids=PROMPT, sampling=GREEDY)
            ],
            scheduled=[
                worker_pb2.ScheduledSequence(
                    seq_id=1, appended_token_ids=[token], num_computed_tokens=10, num_new_tokens=1
                ),
                worker_pb2.ScheduledSequence(
                    seq_id=2, num_computed_tokens=8, num_new_tokens=2, new_block_ids=[0, 1, 5]
                ),
            ],
        )
    )
    assert executor.sequences[1].block_table == [0, 1, 2]
    assert executor.sequences[2].block_table == [0, 1, 5]
    sampled = {s.seq_id: s.token_id for s in second.sampled}
    assert sampled[2] == token  # greedy from the same prompt: the same first token
    assert torch.equal(pool[:, :, :2], before[:, :, :2])  # the shared blocks are only read
    for offset in (0, 1):  # positions 8 and 9: the same K/V in either sample's block
        torch.testing.assert_close(_slot(pool, 5, offset, d), _slot(pool, 2, offset, d))
    assert not torch.equal(_slot(pool, 2, 2, d), _slot(before, 2, 2, d))  # sample 1: position 10


def test_a_copy_outside_the_pool_is_refused(tiny_models: dict[str, pathlib.Path]) -> None:
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    peer = allocate_shared_kv_pool(tuple(runner.kv_pool.shape), runner.kv_pool.dtype, "cpu")
    try:
        request = worker_pb2.CopyBlocksRequest(
            source=peer.handle, src_block_ids=[0], dst_block_ids=[runner.num_kv_blocks]
        )
        with pytest.raises(ValueError, match="dst_block_ids"):
            StepExecutor(runner).copy_blocks(request)
    finally:
        peer.close()


def test_a_step_takes_the_token_the_worker_sampled_last_where_it_says_so(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    """Async scheduling: `append_last_sampled` puts in the token the previous step emitted,
    as `appended_token_ids` would; without one to take the step is refused."""
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )

    def run(executor: StepExecutor, sent: bool) -> list[int]:
        tokens = [executor.execute(prompt_step(1, seq_id=1)).sampled[0].token_id]
        for step_id in range(2, 6):
            decode = worker_pb2.ScheduledSequence(
                seq_id=1, num_computed_tokens=9 + step_id - 1, num_new_tokens=1
            )
            if sent:
                decode.appended_token_ids.append(tokens[-1])
            else:
                decode.append_last_sampled = True
            if step_id == 3:
                decode.new_block_ids.append(3)
            request = worker_pb2.StepRequest(step_id=step_id, scheduled=[decode])
            tokens.append(executor.execute(request).sampled[0].token_id)
        return tokens

    assert run(StepExecutor(runner), sent=False) == run(StepExecutor(runner), sent=True)
    executor = StepExecutor(runner)
    run(executor, sent=True)
    missing = worker_pb2.ScheduledSequence(
        seq_id=1, num_computed_tokens=14, num_new_tokens=1, append_last_sampled=True
    )
    executor.sequences[1].last_sampled = None
    with pytest.raises(ValueError, match="sampled none for it"):
        executor.execute(worker_pb2.StepRequest(step_id=9, scheduled=[missing]))


def test_a_later_step_leaves_out_the_sequences_of_a_failed_step(
    tiny_models: dict[str, pathlib.Path],
) -> None:
    """Async scheduling: step 3 was sent before step 2 failed; it runs its other sequences
    (here a new prompt, with the token a step of its own gives) and leaves out step 2's,
    which have no sampled token to take, until the scheduler says they finished."""
    runner = ModelRunner(
        tiny_models["llama-untied"], dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
    )
    alone = StepExecutor(runner).execute(prompt_step(1, seq_id=2)).sampled[0].token_id
    executor = StepExecutor(runner)
    executor.execute(prompt_step(1, seq_id=1))
    decode_1 = worker_pb2.ScheduledSequence(
        seq_id=1, num_computed_tokens=10, num_new_tokens=1, append_last_sampled=True
    )
    unknown = worker_pb2.ScheduledSequence(seq_id=99, num_computed_tokens=0, num_new_tokens=1)
    with pytest.raises(ValueError, match="unknown sequence 99"):
        executor.execute(worker_pb2.StepRequest(step_id=2, scheduled=[decode_1, unknown]))
    assert executor.failed_seq_ids == {1, 99}
    step_3 = prompt_step(3, seq_id=2)
    step_3.scheduled[0].new_block_ids[:] = [3, 4, 5]
    step_3.scheduled.append(decode_1)
    sampled = executor.execute(step_3).sampled
    assert [(t.seq_id, t.token_id) for t in sampled] == [(2, alone)]
    executor.execute(worker_pb2.StepRequest(step_id=4, finished_seq_ids=[1, 99]))
    assert executor.failed_seq_ids == set() and 1 not in executor.sequences
