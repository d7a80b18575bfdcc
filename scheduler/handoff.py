"""Disaggregated prefill: moving a prefilled sequence from a prefill group to a decode group.

After each step of a prefill group, every sequence that has sampled its first token goes to
the least loaded decode group with room (a slot under `max_num_seqs` and free blocks for its
K/V): the decode ranks copy the prompt's blocks from the prefill ranks' pools (`CopyBlocks`,
device to device), then the prefill group forgets the sequence. A sequence that finds no
decode group with room keeps decoding where it was prefilled, and tries again after every
step.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog

from sluiceway.scheduler.requests import RequestTable
from sluiceway.scheduler.sequence import Sequence
from sluiceway.scheduler.worker_group import WorkerGroup

__all__ = ["HandOff"]

log = structlog.get_logger("scheduler")


@dataclass(slots=True)
class _Move:
    """A sequence on its way from a prefill group to a decode group: its first
    `num_computed_tokens` tokens' K/V go to `blocks` of the decode pool, of which the first
    `num_cached` were already there (its prefix cache) and are not copied."""

    seq: Sequence
    num_computed_tokens: int
    blocks: list[int]
    num_cached: int


class HandOff:
    """Moves sequences from prefill groups to the decode groups among `groups`; counts them."""

    def __init__(self, groups: list[WorkerGroup], requests: RequestTable, max_num_seqs: int):
        self.groups = groups
        self.requests = requests
        self.max_num_seqs = max_num_seqs
        self.num_kv_transfers = 0  # sequences whose blocks moved to a decode group
        self.kv_transfer_bytes = 0

    async def __call__(self, source: WorkerGroup) -> None:
        """Moves every sequence of prefill group `source` that has sampled a token to the least
        loaded decode group with room. Full blocks the decode group already holds in its
        prefix cache (a shared system prompt) are reused, not copied. A failed copy leaves the
        sequence where it is (logged)."""
        src_sched = source.scheduler
        assert src_sched is not None
        ready = [s for s in src_sched.running if s.output_token_ids]
        if not ready:
            return
        decode = [g for g in self.groups if g.role == "decode" and g.ready.is_set()]
        plans: dict[int, tuple[WorkerGroup, list[_Move]]] = {}
        for seq in ready:
            n = seq.num_computed_tokens
            for dest in sorted(decode, key=lambda g: g.load):  # the least loaded with room
                sched = dest.scheduler
                planned = len(plans.get(dest.index, (dest, []))[1])
                if sched is None or len(sched.running) + planned >= self.max_num_seqs:
                    continue
                reserved = sched.block_manager.allocate_for_transfer(seq, n)
                if reserved is not None:
                    blocks, num_cached = reserved
                    plans.setdefault(dest.index, (dest, []))[1].append(
                        _Move(seq, n, blocks, num_cached)
                    )
                    break
            # (no group with room: it keeps decoding here; tried again after the next step)
        if plans:
            await asyncio.gather(*(self._move(source, d, m) for d, m in plans.values()))

    async def _move(self, source: WorkerGroup, dest: WorkerGroup, moves: list[_Move]) -> None:
        """Copies the blocks of `moves` from `source`'s ranks to `dest`'s, then gives the
        sequences to `dest`; a failed copy gives the reserved blocks back."""
        src_sched, dest_sched = source.scheduler, dest.scheduler
        assert src_sched is not None and dest_sched is not None
        src_ids = [b for m in moves for b in m.seq.block_table[m.num_cached : len(m.blocks)]]
        dst_ids = [b for m in moves for b in m.blocks[m.num_cached :]]
        try:
            nbytes = await dest.copy_blocks_from(source, src_ids, dst_ids) if src_ids else 0
        except grpc.aio.AioRpcError as e:
            log.error(
                "kv_transfer_failed",
                source=source.name,
                destination=dest.name,
                error=f"{e.code().name}: {e.details()}",
            )
            for m in moves:
                dest_sched.block_manager.release_blocks(m.blocks)
            return
        if dest.scheduler is not dest_sched or source.scheduler is not src_sched:
            return  # a worker re-registered meanwhile: its sequences have failed
        self.num_kv_transfers += len(moves)
        self.kv_transfer_bytes += nbytes
        for m in moves:
            if m.seq.is_finished:  # aborted while its blocks moved
                dest_sched.block_manager.release_blocks(m.blocks)
                continue
            src_sched.detach(m.seq)
            dest_sched.admit_prefilled(m.seq, m.blocks, m.num_computed_tokens)
            self.requests.move(m.seq, dest)
        dest.wakeup.set()
