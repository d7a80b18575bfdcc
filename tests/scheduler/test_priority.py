"""The priority policy (vLLM's `--scheduling-policy priority`): the waiting queue in
(priority, arrival) order, and preemption of the running sequence with the largest
(priority, arrival); exact orders and block counts, without processes or tensors."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.sequence import Sequence, SequenceStatus
from sluiceway.status import error_from_rpc
from sluiceway.v1 import inference_pb2
from tests.scheduler.test_engine import FakeWorker, _serve, add_request

EOS = 2


def make_seq(seq_id: int, prompt_len: int, priority: int, max_tokens: int = 8) -> Sequence:
    """A sequence with its own prompt (no shared prefix) that arrives at time `seq_id`."""
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        prompt_token_ids=[1000 * seq_id + i for i in range(prompt_len)],
        sampling=SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=(EOS,)),
        arrival_time=float(seq_id),
        priority=priority,
    )


def make_scheduler(num_blocks: int, policy: str = "priority", **config: object) -> Scheduler:
    cfg = SchedulerConfig(scheduling_policy=policy, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, 16), max_model_len=num_blocks * 16)


def run_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.apply_sampled(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
    return out


def run_to_end(sched: Scheduler, seqs: list[Sequence]) -> list[int]:
    """Steps until every sequence finishes; returns the seq_ids of the sequences the steps
    admitted (a new one, or a preempted one again), in order, each once."""
    admitted: list[int] = []
    for _ in range(500):
        if all(s.is_finished for s in seqs):
            break
        for s in run_step(sched).scheduled:
            if s.is_new and s.seq.seq_id not in admitted:
                admitted.append(s.seq.seq_id)
    assert all(s.finish_reason == inference_pb2.FINISH_REASON_LENGTH for s in seqs)
    return admitted


def test_the_waiting_queue_is_in_priority_then_arrival_order() -> None:
    sched = make_scheduler(64)
    for seq_id, priority in [(1, 1), (2, 0), (3, 1), (4, -5), (5, 2), (6, 0)]:
        sched.add(make_seq(seq_id, 4, priority))
    assert [s.seq_id for s in sched.waiting] == [4, 2, 6, 1, 3, 5]


def test_a_high_priority_request_behind_six_low_ones_is_admitted_next() -> None:
    """max_num_seqs 2: two low-priority requests run, six more wait; a priority-0 request
    that arrives then takes the first slot that frees, before the six."""
    sched = make_scheduler(64, max_num_seqs=2)
    low = [make_seq(i, 4, priority=1, max_tokens=2 if i == 1 else 4) for i in range(1, 9)]
    for seq in low:
        sched.add(seq)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]
    high = make_seq(9, 4, priority=0)
    sched.add(high)
    assert [s.seq_id for s in sched.waiting] == [9, 3, 4, 5, 6, 7, 8]
    out = run_step(sched)  # 1 samples its 2nd and last token; no slot was free in the step
    assert [s.seq.seq_id for s in out.scheduled] == [1, 2]
    out = run_step(sched)
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(2, 1), (9, 4)]
    assert run_to_end(sched, [*low, high]) == [3, 4, 5, 6, 7, 8]  # then in arrival order
    assert sched.block_manager.num_free_blocks == 64


def test_equal_priorities_are_served_first_come_first_served() -> None:
    orders = []
    for policy, priority in [("fcfs", 0), ("priority", 0), ("priority", 3)]:
        sched = make_scheduler(64, policy, max_num_seqs=2)
        seqs = [make_seq(i, 4, priority, max_tokens=1 + i % 3) for i in range(1, 8)]
        for seq in seqs:
            sched.add(seq)
        orders.append(run_to_end(sched, seqs))
        assert sched.block_manager.num_free_blocks == 64
    assert orders == [[1, 2, 3, 4, 5, 6, 7]] * 3


@pytest.mark.parametrize(
    ("policy", "priorities", "victim", "waiting"),
    [
        # the largest priority value; 4 (priority 1) waits before it
        ("priority", (1, 2), 2, [4, 2]),
        ("priority", (2, 1), 1, [4, 1]),
        # equals: the later arrival; it waits before 4, which arrived after it
        ("priority", (1, 1), 2, [2, 4]),
        # fcfs: the most recently admitted, the one that needs the block; first in line
        ("fcfs", (0, 0), 3, [3, 4]),
    ],
)
def test_a_high_priority_sequence_that_needs_a_block_preempts_the_lowest_priority_one(
    policy: str, priorities: tuple[int, int], victim: int, waiting: list[int]
) -> None:
    """A pool of 5 blocks: 1 and 2 (20-token prompts, admitted one step apart) hold 2 blocks
    each, the high-priority 3 (16 tokens) the last one; 3's 17th token needs a block. The
    victim is scheduled before 3 in that step: its share is taken back."""
    sched = make_scheduler(5, policy)
    bm = sched.block_manager
    a = make_seq(1, 20, priorities[0])
    b = make_seq(2, 20, priorities[1])
    high = make_seq(3, 16, 0)
    late = make_seq(4, 4, priority=1)
    seqs = {1: a, 2: b, 3: high}
    sched.add(a)
    run_step(sched)
    sched.add(b)
    run_step(sched)
    assert bm.num_free_blocks == 1
    sched.add(high)
    out = run_step(sched)  # 1 and 2 decode within their 2nd block; 3 takes the last one
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 1), (2, 1), (3, 16)]
    assert bm.num_free_blocks == 0
    sched.add(late)

    out = run_step(sched)
    preempted = seqs[victim]
    assert [s.seq.seq_id for s in out.scheduled] == [i for i in (1, 2, 3) if i != victim]
    assert out.num_batched_tokens == 2
    assert out.finished_seq_ids == [victim]  # the worker forgets it in this step
    assert preempted.status is SequenceStatus.WAITING and preempted.block_table == []
    assert preempted.num_preemptions == 1 and sched.num_preemptions == 1
    assert preempted.num_tokens_on_worker == 0 and preempted.num_computed_tokens == 0
    # its tokens are kept, recomputed as prompt later
    assert len(preempted.output_token_ids) == {1: 3, 2: 2, 3: 1}[victim]
    assert [s.seq_id for s in sched.waiting] == waiting
    # the victim's blocks: 2 (one for 3's 17th token, one free), or 3's own 1
    assert bm.num_free_blocks == 1
    assert [len(s.block_table) for s in sched.running] == [2, 2]
    assert run_to_end(sched, [a, b, high, late]) == waiting
    assert bm.num_free_blocks == 5 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_a_waiting_high_priority_request_does_not_preempt_a_running_one() -> None:
    """vLLM v1: only a running sequence that needs a block preempts; a waiting request that
    finds no free block waits, first in line."""
    sched = make_scheduler(2)
    low = make_seq(1, 20, priority=5, max_tokens=4)
    sched.add(low)
    run_step(sched)
    high = make_seq(2, 20, priority=0, max_tokens=4)
    sched.add(high)
    out = run_step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [1]
    assert sched.num_preemptions == 0 and list(sched.waiting) == [high]
    assert run_to_end(sched, [low, high]) == [2]
    assert sched.num_preemptions == 0 and sched.block_manager.num_free_blocks == 2


@pytest.mark.parametrize("policy", ["fcfs", "static"])
def test_a_priority_under_another_policy_is_invalid_argument(policy: str) -> None:
    """As vLLM: a priority other than 0 needs --scheduling-policy priority."""

    async def main() -> None:
        fake = FakeWorker()
        stub, close = await _serve(fake, SchedulerConfig(scheduling_policy=policy))
        try:
            request = add_request(10, 2)
            request.priority = 0
            assert len([e async for e in stub.AddRequest(request)]) == 2
            request.priority = -1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [e async for e in stub.AddRequest(request)]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            error = error_from_rpc(err.value)
            assert error.field == "priority"
            assert error.message.startswith("priority scheduling is not enabled")
        finally:
            await close()

    asyncio.run(main())


def test_the_priority_reaches_the_sequence_under_the_priority_policy() -> None:
    async def main() -> None:
        fake = FakeWorker()
        stub, close = await _serve(fake, SchedulerConfig(scheduling_policy="priority"))
        try:
            request = add_request(10, 3)
            request.priority = -7
            events = [e async for e in stub.AddRequest(request)]
            assert [list(e.token_ids) for e in events] == [[110], [111], [112]]
        finally:
            await close()

    asyncio.run(main())
