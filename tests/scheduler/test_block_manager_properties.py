"""Property tests: block accounting stays exact under any mix of scheduler events.

A hypothesis state machine drives the real `Scheduler` (admit, steps with
random sampled tokens, aborts) over a small pool, with prompts drawn from a
few shared prefixes so sequences fork by prefix and preemption is frequent.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, SequenceStatus
from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.v1 import inference_pb2

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PREFIXES = [[7] * 9, [7] * 5 + [8] * 4, [9, 10, 11, 12, 13, 14, 15, 16]]


def check_block_accounting(sched: Scheduler, live: list[Sequence]) -> None:
    """Every block is exactly one of free, cached-evictable or owned, with exact ref counts."""
    bm = sched.block_manager
    holders = Counter(b for seq in live for b in seq.block_table)
    free = set(bm._free)
    assert len(free) == len(bm._free)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], block
        assert (block.ref_count == 0) == (block.block_id in free), block
    for h, block_id in bm._cached.items():
        assert bm.blocks[block_id].block_hash == h
    hashed = [b for b in bm.blocks if b.block_hash is not None]
    assert len(hashed) == len(bm._cached)
    assert bm.num_free_blocks + len(holders) == bm.num_blocks
    for seq in live:
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens) or (
            seq.status is SequenceStatus.FINISHED
        )


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.seqs: list[Sequence] = []
        self.next_id = 1

    @initialize(
        policy=st.sampled_from(["continuous", "static"]),
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        budget=st.integers(4, 40),
    )
    def setup(self, policy: str, chunked: bool, prefix_caching: bool, budget: int) -> None:
        config = SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=budget if chunked else 64,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=prefix_caching,
            scheduling_policy=policy,
            static_batch_size=3,
        )
        bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(config, bm, max_model_len=NUM_BLOCKS * BLOCK_SIZE)

    @property
    def live(self) -> list[Sequence]:
        """Sequences that may hold blocks: queued, running, or static members held."""
        assert self.sched is not None
        return [*self.sched.running, *self.sched.waiting, *self.sched._holding]

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(20, 30), max_size=10),
        max_tokens=st.integers(1, 12),
    )
    def admit(self, prefix: list[int], suffix: list[int], max_tokens: int) -> None:
        assert self.sched is not None
        seq = Sequence(
            seq_id=self.next_id,
            request_id=str(self.next_id),
            prompt_token_ids=prefix + suffix,
            sampling=scheduler_pb2.SequenceSamplingParams(),
            max_tokens=max_tokens,
            stop_token_ids=frozenset({2}),
        )
        self.next_id += 1
        self.sched.add(seq)
        self.seqs.append(seq)

    @rule(tokens=st.lists(st.integers(2, 40), min_size=8, max_size=8))
    def step(self, tokens: list[int]) -> None:
        assert self.sched is not None
        out = self.sched.schedule()
        sampled = {s.seq.seq_id: tokens[i % 8] for i, s in enumerate(out.scheduled) if s.samples}
        self.sched.apply_sampled(out, sampled)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.sched is not None
        candidates = [s for s in self.seqs if not s.is_finished]
        if candidates:
            seq = data.draw(st.sampled_from(candidates))
            self.sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)

    @invariant()
    def accounting(self) -> None:
        if self.sched is not None:
            check_block_accounting(self.sched, self.live)

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        # Everything ends (no deadlock, no starvation): run steps until all finish.
        for _ in range(2000):
            if all(s.is_finished for s in self.seqs):
                break
            out = sched.schedule()
            sched.apply_sampled(out, {s.seq.seq_id: 5 for s in out.scheduled if s.samples})
        assert all(s.is_finished for s in self.seqs), [s.status for s in self.seqs]
        check_block_accounting(sched, self.live)
        assert sched.block_manager.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_count == 0 for b in sched.block_manager.blocks)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
