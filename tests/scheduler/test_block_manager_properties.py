"""Property tests: block accounting stays exact under any mix of scheduler events.

A hypothesis state machine drives the real `Scheduler` (admit, steps with
random sampled tokens, aborts) over a small pool, with prompts drawn from a
few shared prefixes so sequences share cached blocks and preemption is
frequent, under any long-prefill threshold and partial-prefill caps (no chunk
over the threshold), and parallel-sampling requests (n samples of one prompt,
sharing its full blocks through the prefix cache), under every policy (and the priority
policy alone, with random priorities: a victim that already had its share of the step gives
it back). It also plays the worker: a
model of the KV pool records which token each slot holds, applying the step's
writes through the worker's own copy of each block table, and every computed
position must hold its sequence's token (a block written while shared shows
here).

The block manager's doors are probed on copies of the state at any point:
`allocate_slots` and `allocate_for_transfer` return None exactly when the
free blocks do not suffice (counted here from the cached prefix and the
reference counts), and then change nothing; otherwise they reserve exactly
what was asked.
"""

from __future__ import annotations

import copy
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sluiceway.prefix_hash import prompt_block_hashes
from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.sequence import Sequence, SequenceStatus
from sluiceway.v1 import inference_pb2

BLOCK_SIZE = 4
NUM_BLOCKS = 12
PREFIXES = [[7] * 9, [7] * 5 + [8] * 4, [9, 10, 11, 12, 13, 14, 15, 16]]


def check_block_accounting_of_tables(bm: BlockManager, live: list[Sequence]) -> None:
    """Every block is exactly one of free, cached-evictable or owned, with reference counts
    exactly its holders among the tables of `live`."""
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


def check_block_accounting(sched: Scheduler, live: list[Sequence]) -> None:
    """`check_block_accounting_of_tables`, and each live sequence holds the blocks of its
    computed tokens exactly."""
    bm = sched.block_manager
    check_block_accounting_of_tables(bm, live)
    for seq in live:
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens) or (
            seq.status is SequenceStatus.FINISHED
        )


def pool_state(bm: BlockManager) -> tuple[object, ...]:
    """Everything a failed allocation must leave as it was."""
    return (
        [(b.ref_count, b.block_hash) for b in bm.blocks],
        list(bm._free),
        dict(bm._cached),
        bm.prefix_cache_queries,
        bm.prefix_cache_hits,
    )


def revived(bm: BlockManager, block_ids: list[int] | tuple[int, ...]) -> int:
    """How many of `block_ids` are evictable (taking them costs a free block)."""
    return sum(1 for b in block_ids if bm.blocks[b].ref_count == 0)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.seqs: list[Sequence] = []
        self.next_id = 1
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token written there
        self.worker_tables: dict[int, list[int]] = {}  # seq_id -> the worker's block table

    @initialize(
        policy=st.sampled_from(["fcfs", "priority", "static"]),
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        budget=st.integers(4, 40),
        threshold=st.integers(0, 12),
        partial=st.integers(1, 3),
        long_partial=st.integers(1, 3),
    )
    def setup(
        self,
        policy: str,
        chunked: bool,
        prefix_caching: bool,
        budget: int,
        threshold: int,
        partial: int,
        long_partial: int,
    ) -> None:
        if not chunked:
            threshold, partial, long_partial = 0, 1, 1
        config = SchedulerConfig(
            long_prefill_token_threshold=threshold,
            max_num_partial_prefills=partial,
            max_long_partial_prefills=min(long_partial, partial),
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
        n=st.sampled_from([1, 1, 2, 3]),
        priority=st.integers(-1, 2),
    )
    def admit(
        self, prefix: list[int], suffix: list[int], max_tokens: int, n: int, priority: int
    ) -> None:
        assert self.sched is not None
        if self.sched.config.scheduling_policy != "priority":
            priority = 0  # the engine refuses any other
        parent = f"parent-{self.next_id}" if n > 1 else None
        for _ in range(n):
            seq = Sequence(
                seq_id=self.next_id,
                request_id=str(self.next_id),
                prompt_token_ids=prefix + suffix,
                sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=(2,)),
                parent_request_id=parent,
                priority=priority,
            )
            self.next_id += 1
            self.sched.add(seq)
            self.seqs.append(seq)

    def _run_step(self, tokens: list[int]) -> None:
        assert self.sched is not None
        out = self.sched.schedule()
        threshold = self.sched.long_prefill_token_threshold
        assert not threshold or all(s.num_new_tokens <= threshold for s in out.scheduled)
        self._play_worker(out)
        sampled = {s.seq.seq_id: tokens[i % 8] for i, s in enumerate(out.scheduled) if s.samples}
        self.sched.apply_sampled(out, sampled)

    def _play_worker(self, out: SchedulerOutput) -> None:
        """What a worker does with the step: forget, extend tables, write K/V."""
        assert self.sched is not None
        bm = self.sched.block_manager
        for seq_id in out.finished_seq_ids:
            self.worker_tables.pop(seq_id, None)
        for s in out.scheduled:
            if s.is_new:
                table = self.worker_tables[s.seq.seq_id] = list(s.new_block_ids)
            else:
                table = self.worker_tables[s.seq.seq_id]
                table.extend(s.new_block_ids)
            assert table == s.seq.block_table
            tokens = s.seq.token_ids
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                block = table[pos // BLOCK_SIZE]
                assert bm.blocks[block].ref_count == 1, (block, pos)  # never write a shared block
                self.slots[(block, pos % BLOCK_SIZE)] = tokens[pos]

    @rule(data=st.data(), num_new=st.integers(0, 24))
    def allocate_slots_on_a_copy(self, data: st.DataObject, num_new: int) -> None:
        """`allocate_slots` for a running or waiting sequence, on a copy of the state."""
        assert self.sched is not None
        sched = copy.deepcopy(self.sched)
        candidates = [*sched.running, *sched.waiting]
        if not candidates:
            return
        seq = data.draw(st.sampled_from(candidates))
        bm = sched.block_manager
        before, free = pool_state(bm), bm.num_free_blocks
        table, computed = list(seq.block_table), seq.num_computed_tokens
        cached = None if table else bm.find_cached_prefix(seq)
        if cached is None:
            need = bm.blocks_for(computed + num_new) - len(table)
        else:
            assert computed == 0 and cached.num_tokens == len(cached.block_ids) * BLOCK_SIZE
            assert cached.num_tokens < seq.num_tokens  # one token left to compute at least
            missing = bm.blocks_for(cached.num_tokens + num_new) - len(cached.block_ids)
            need = max(0, missing) + revived(bm, cached.block_ids)
        new_blocks = bm.allocate_slots(seq, num_new, cached)
        assert (new_blocks is None) == (need > free), (need, free)
        if new_blocks is None:
            assert pool_state(bm) == before
            assert (seq.block_table, seq.num_computed_tokens) == (table, computed)
            return
        assert bm.num_free_blocks == free - need
        prefix = table if cached is None else list(cached.block_ids)
        assert seq.block_table == [*prefix, *new_blocks]
        assert len(seq.block_table) == bm.blocks_for(seq.num_computed_tokens + num_new)
        assert all(bm.blocks[b].ref_count == 1 for b in new_blocks)
        check_block_accounting_of_tables(bm, [*sched.running, *sched.waiting, *sched._holding])

    @rule(data=st.data())
    def allocate_for_transfer_on_a_copy(self, data: st.DataObject) -> None:
        """`allocate_for_transfer` of any sequence's first tokens into a copy of the pool (the
        decode pool of a hand-off), then `release_blocks`: every reference comes back."""
        assert self.sched is not None
        if not self.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs))
        num_tokens = data.draw(st.integers(1, seq.num_tokens))
        bm = copy.deepcopy(self.sched.block_manager)
        before, free = pool_state(bm), bm.num_free_blocks
        cached: list[int] = []
        if bm.enable_prefix_caching:
            for h in prompt_block_hashes(seq.token_ids[:num_tokens], BLOCK_SIZE):
                if h not in bm._cached:
                    break
                cached.append(bm._cached[h])
        need = bm.blocks_for(num_tokens) - len(cached) + revived(bm, cached)
        reserved = bm.allocate_for_transfer(seq, num_tokens)
        assert (reserved is None) == (need > free), (need, free)
        if reserved is None:
            assert pool_state(bm) == before
            return
        blocks, num_cached = reserved
        assert (blocks[:num_cached], num_cached) == (cached, len(cached))
        assert len(blocks) == len(set(blocks)) == bm.blocks_for(num_tokens)
        assert bm.num_free_blocks == free - need
        assert all(bm.blocks[b].ref_count == 1 for b in blocks[num_cached:])
        bm.release_blocks(blocks)  # every reference comes back (evicted hashes do not)
        assert [b.ref_count for b in bm.blocks] == [r for r, _ in before[0]]  # type: ignore[attr-defined]
        assert bm.num_free_blocks == free

    @rule(tokens=st.lists(st.integers(2, 40), min_size=8, max_size=8))
    def step(self, tokens: list[int]) -> None:
        self._run_step(tokens)

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

    @invariant()
    def kv_holds_every_computed_token(self) -> None:
        if self.sched is None:
            return
        for seq in self.sched.running:
            tokens = seq.token_ids
            for pos in range(seq.num_computed_tokens):
                slot = (seq.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                assert self.slots.get(slot) == tokens[pos], (seq.seq_id, pos)

    def teardown(self) -> None:
        sched = self.sched
        if sched is None:
            return
        # Everything ends (no deadlock, no starvation): run steps until all finish.
        for _ in range(2000):
            if all(s.is_finished for s in self.seqs):
                break
            self._run_step([5] * 8)
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


class PriorityMachine(SchedulerMachine):
    """The same properties under the priority policy alone, with four priorities, so that a
    running sequence earlier in the step than the one that needs a block is often the victim
    (its share of the step taken back)."""

    @initialize(
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        budget=st.integers(4, 40),
        threshold=st.integers(0, 12),
    )
    def setup(  # type: ignore[override]
        self, chunked: bool, prefix_caching: bool, budget: int, threshold: int
    ) -> None:
        super().setup("priority", chunked, prefix_caching, budget, threshold, 2, 1)


TestPriorityMachine = PriorityMachine.TestCase
TestPriorityMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
