"""Which registrations a tensor-parallel group keeps: the same process registering again
keeps its peers, a restarted rank (a new worker_id) starts a new generation."""

from __future__ import annotations

import asyncio

from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.worker_group import WorkerGroup, WorkerInfo


def rank(r: int, worker_id: str) -> WorkerInfo:
    return WorkerInfo(
        address=f"127.0.0.1:{50061 + r}", rank=r, model_id="m", num_kv_blocks=8, block_size=16,
        max_model_len=128, vocab_size=100, tensor_parallel_size=2, worker_id=worker_id,
    )  # fmt: skip


def test_same_process_keeps_its_peers_a_restarted_rank_starts_a_new_generation() -> None:
    async def main() -> list[tuple[bool, list[str]]]:
        group = WorkerGroup(0, "both", 2, SchedulerConfig(tensor_parallel_size=2))
        seen = []
        for info in [rank(0, "a"), rank(1, "b"), rank(0, "a"), rank(0, "c"), rank(1, "b"),
                     rank(1, "")]:  # fmt: skip
            complete = await group.add_rank(info)
            seen.append((complete, [group.ranks[r].worker_id for r in sorted(group.ranks)]))
        for channel in group._channels.values():
            await channel.close()
        return seen

    assert asyncio.run(main()) == [
        (False, ["a"]),
        (True, ["a", "b"]),
        (True, ["a", "b"]),  # rank 0 registered again without restarting
        (False, ["c"]),  # rank 0 restarted: rank 1's process group broke with it
        (True, ["c", "b"]),
        (False, [""]),  # no id: taken as a restart
    ]
