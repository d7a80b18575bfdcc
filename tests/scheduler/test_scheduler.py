"""The batching policy and block accounting, without processes or tensors."""

from __future__ import annotations

import pytest

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler, SchedulerOutput
from scheduler.sequence import Sequence, SequenceStatus
from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.v1 import inference_pb2

EOS = 2


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        sampling=scheduler_pb2.SequenceSamplingParams(temperature=0),
        max_tokens=max_tokens,
        stop_token_ids=frozenset({EOS}),
    )


def make_scheduler(num_blocks: int = 64, max_model_len: int = 1024, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, 16), max_model_len)  # type: ignore[arg-type]


def run_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.seq.seq_id: token for s in out.scheduled if s.samples}
    sched.apply_sampled(out, sampled)
    return out


def test_prompt_takes_ceil_blocks_and_a_new_block_every_16_tokens() -> None:
    sched = make_scheduler()
    seq = make_seq(1, prompt_len=16, max_tokens=40)
    sched.add(seq)
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [16]
    assert len(seq.block_table) == 1  # 16 tokens computed, token 17 sampled
    run_step(sched)  # computes token 17 -> second block
    assert len(seq.block_table) == 2
    for _ in range(15):
        run_step(sched)
    assert seq.num_computed_tokens == 32 and len(seq.block_table) == 2
    run_step(sched)
    assert len(seq.block_table) == 3
    assert sched.block_manager.num_free_blocks == 64 - 3


def test_waiting_requests_join_the_running_batch_at_the_next_step() -> None:
    sched = make_scheduler()
    a = make_seq(1, 20)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 5)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 5)]
    assert out.scheduled[1].is_new and out.scheduled[1].appended_token_ids == b.prompt_token_ids
    assert not out.scheduled[0].is_new and out.scheduled[0].appended_token_ids == [7]


def test_blocks_are_freed_when_a_sequence_finishes_and_reused_next_step() -> None:
    sched = make_scheduler(num_blocks=4)
    a = make_seq(1, 30, max_tokens=2)  # 2 blocks
    b = make_seq(2, 40)  # 3 blocks: must wait for a
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    run_step(sched)
    assert a.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert a.block_table == [] and sched.block_manager.num_free_blocks == 4
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [2]
    assert out.finished_seq_ids == [1]


@pytest.mark.parametrize(
    ("token", "max_tokens", "max_model_len", "reason", "n_out"),
    [
        (EOS, 8, 1024, inference_pb2.FINISH_REASON_STOP, 1),
        (7, 3, 1024, inference_pb2.FINISH_REASON_LENGTH, 3),
        (7, 100, 12, inference_pb2.FINISH_REASON_LENGTH, 2),  # 10 prompt + 2 = max_model_len
    ],
)
def test_finish_reasons(
    token: int, max_tokens: int, max_model_len: int, reason: int, n_out: int
) -> None:
    sched = make_scheduler(max_model_len=max_model_len)
    seq = make_seq(1, 10, max_tokens=max_tokens)
    sched.add(seq)
    while not seq.is_finished:
        run_step(sched, token)
    assert seq.finish_reason == reason
    assert len(seq.output_token_ids) == n_out
    assert sched.block_manager.num_free_blocks == 64


def test_chunked_prefill_fills_the_token_budget_after_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=32)
    a = make_seq(1, 10)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 100)
    sched.add(b)
    chunks = []
    while b.num_computed_tokens < 100 and not b.output_token_ids:
        out = run_step(sched)
        chunks.append([(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled])
    assert chunks == [[(1, 1), (2, 31)], [(1, 1), (2, 31)], [(1, 1), (2, 31)], [(1, 1), (2, 7)]]


def test_without_chunked_prefill_a_prompt_runs_whole() -> None:
    sched = make_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    a = make_seq(1, 10)
    sched.add(a)
    run_step(sched)
    b = make_seq(2, 32)
    sched.add(b)
    out = run_step(sched)  # 1 decode + 32 prompt > 32: b waits
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        sched.add(make_seq(3, 33))


def test_max_num_seqs_bounds_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i + 1, 4))
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]
    assert len(sched.waiting) == 1


def test_preemption_frees_the_latest_sequence_and_requeues_it_first() -> None:
    sched = make_scheduler(num_blocks=3, max_model_len=1024)
    a = make_seq(1, 16, max_tokens=100)
    b = make_seq(2, 16, max_tokens=100)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # a: 1 block, b: 1 block
    out = run_step(sched)  # a takes block 3; b needs one more, none left: b is preempted
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert out.finished_seq_ids == [2]  # the worker forgets b in the same step
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_preemptions == 1
    assert b.output_token_ids == [7]  # kept, recomputed as prompt later
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 1


def test_abort_frees_blocks_at_once_and_tells_the_worker() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 40)
    sched.add(seq)
    run_step(sched)
    assert sched.block_manager.num_free_blocks == 61
    sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
    assert sched.block_manager.num_free_blocks == 64
    assert sched.schedule().finished_seq_ids == [1]


def test_a_sequence_aborted_while_its_step_runs_gets_no_token() -> None:
    sched = make_scheduler()
    seq = make_seq(1, 4)
    sched.add(seq)
    out = sched.schedule()
    sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
    assert sched.apply_sampled(out, {1: 7}) == []
    assert seq.output_token_ids == []


def test_prompts_that_can_never_run_are_rejected() -> None:
    sched = make_scheduler(num_blocks=2, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(1, 100))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(make_seq(2, 32))  # 33 tokens need 3 blocks
