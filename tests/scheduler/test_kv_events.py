"""KV events: the block manager's log and the publisher's snapshot + net changes."""

from __future__ import annotations

import asyncio

import pytest

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.prefix_hash import prompt_block_hashes
from sluiceway.sampling_params import SamplingParams
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.kv_events import KvEventPublisher, SubscriberOverflow
from sluiceway.scheduler.scheduler import Scheduler
from sluiceway.scheduler.sequence import Sequence

BS = 4


def seq(seq_id: int, prompt: list[int], max_tokens: int = 1) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
    )


def run_to_end(sched: Scheduler, s: Sequence) -> None:
    sched.add(s)
    while not s.is_finished:
        out = sched.schedule()
        sched.apply_sampled(out, {x.seq.seq_id: 3 for x in out.scheduled if x.samples})


def drain(queue: asyncio.Queue[scheduler_pb2.KvEvents | Exception]) -> list[object]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_routers_hash_prompts_as_the_block_manager_does() -> None:
    sched = Scheduler(SchedulerConfig(), BlockManager(16, BS), max_model_len=64)
    s = seq(1, list(range(10)), max_tokens=3)  # 10 prompt + 3 outputs: 3 full blocks
    run_to_end(sched, s)
    assert s.block_hashes == prompt_block_hashes(s.token_ids, BS)
    assert len(prompt_block_hashes(list(range(10)), BS)) == 2  # no hash for a partial block
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes([1], 0)


def test_the_block_manager_logs_stores_and_evictions_in_order() -> None:
    bm = BlockManager(3, BS)
    sched = Scheduler(SchedulerConfig(), bm, max_model_len=12)
    bm.kv_event_log = []
    a = seq(1, list(range(9)))  # 9 prompt tokens + 1 output: 2 full blocks, 3 blocks held
    run_to_end(sched, a)
    h0, h1 = a.block_hashes
    assert bm.kv_event_log == [(h0, True), (h1, True)]
    bm.kv_event_log = []
    b = seq(2, list(range(100, 109)))  # needs every block: evicts both cached ones
    run_to_end(sched, b)
    assert bm.kv_event_log[:2] == [(h1, False), (h0, False)]  # a's tail is evicted first
    assert [stored for _, stored in bm.kv_event_log[2:]] == [True, True]
    bm.kv_event_log = []
    run_to_end(sched, seq(3, list(range(200, 209))))  # evicts b's two cached blocks in turn
    assert bm.kv_event_log[:2] == [(h, False) for h in reversed(b.block_hashes)]


def test_a_subscriber_gets_a_snapshot_then_the_net_changes() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(SchedulerConfig(), bm, max_model_len=32)
    pools: list[BlockManager | None] = [bm]
    pub = KvEventPublisher(lambda: pools, lambda: BS, max_hashes_per_message=2)
    a = seq(1, list(range(13)))  # 3 full blocks
    run_to_end(sched, a)
    queue = pub.subscribe()
    snapshot = drain(queue)
    assert [(m.reset, len(m.stored), m.block_size) for m in snapshot] == [  # type: ignore[attr-defined]
        (True, 2, BS),
        (False, 1, BS),
    ]
    assert {h for m in snapshot for h in m.stored} == set(a.block_hashes)  # type: ignore[attr-defined]
    b = seq(2, [*range(8), 50, 51, 52, 53, 54])  # shares a's first 2 blocks, adds one
    run_to_end(sched, b)
    pub.poll()
    (change,) = drain(queue)
    assert list(change.stored) == [b.block_hashes[2]] and not change.removed  # type: ignore[attr-defined]
    pub.poll()
    assert drain(queue) == []  # nothing new: nothing sent
    # a worker registered again: a new, empty pool replaces the old one
    pools[0] = BlockManager(8, BS)
    pub.poll()
    changes = drain(queue)  # 4 hashes, 2 per message
    assert [len(m.removed) for m in changes] == [2, 2]  # type: ignore[attr-defined]
    removed = {h for m in changes for h in m.removed}  # type: ignore[attr-defined]
    assert removed == {*a.block_hashes, b.block_hashes[2]}
    pub.unsubscribe(queue)
    run_to_end(Scheduler(SchedulerConfig(), pools[0], max_model_len=64), seq(3, list(range(20))))
    pub.poll()
    assert drain(queue) == []  # no longer a subscriber: nothing sent


def test_a_hash_two_groups_hold_is_removed_when_neither_does() -> None:
    first, second = BlockManager(4, BS), BlockManager(4, BS)
    pools: list[BlockManager | None] = [first, second]
    pub = KvEventPublisher(lambda: pools, lambda: BS)
    queue = pub.subscribe()
    drain(queue)
    for bm in (first, second):
        run_to_end(Scheduler(SchedulerConfig(), bm, max_model_len=16), seq(1, list(range(5))))
    pub.poll()
    (stored,) = drain(queue)
    assert len(stored.stored) == 1  # type: ignore[attr-defined]
    pools[0] = first = BlockManager(2, BS)  # the first group's worker registered again
    pub.poll()
    assert drain(queue) == []  # the second group still holds it
    pools[1] = BlockManager(4, BS)  # and the second's
    pub.poll()
    (removed,) = drain(queue)
    assert list(removed.removed) == list(stored.stored)  # type: ignore[attr-defined]
    # evicted and stored again between two polls: no net change
    sched = Scheduler(SchedulerConfig(), first, max_model_len=8)
    run_to_end(sched, seq(2, list(range(5))))
    run_to_end(sched, seq(3, list(range(100, 107))))  # takes both blocks: evicts it
    run_to_end(sched, seq(4, list(range(5))))  # stores it again, evicting seq 3's
    pub.poll()
    (again,) = drain(queue)
    assert list(again.stored) == list(stored.stored)  # type: ignore[attr-defined]
    assert not again.removed  # type: ignore[attr-defined]


def test_a_subscriber_that_does_not_read_is_dropped() -> None:
    bm = BlockManager(64, BS)
    sched = Scheduler(SchedulerConfig(), bm, max_model_len=256)
    pub = KvEventPublisher(lambda: [bm], lambda: BS, max_queued_messages=3)
    queue = pub.subscribe()  # 1 message (an empty snapshot)
    for i in range(4):
        run_to_end(sched, seq(i, [1000 * i + k for k in range(5)]))
        pub.poll()
    items = drain(queue)
    assert len(items) == 4 and isinstance(items[-1], SubscriberOverflow)
    run_to_end(sched, seq(9, [9000 + k for k in range(20)]))
    pub.poll()
    assert drain(queue) == []  # dropped: nothing more is queued for it
