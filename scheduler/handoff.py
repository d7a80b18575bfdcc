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
        # a sample whose siblings wait to fork its prompt's blocks stays one more step
        ready = [
            s for s in src_sched.running if s.output_token_ids and not src_sched.awaits_fork(s)
        ]
        if not ready:
            return
        plans: dict[int, tuple[WorkerGroup, list[_Move]]] = {}
        for seq in ready:
            best: tuple[tuple[int, int], WorkerGroup, list[int]] | None = None
            for g in self.groups:
                sched = g.scheduler
                if g.role != "decode" or not g.ready.is_set() or sched is None:
                    continue
                bm = sched.block_manager
                planned = len(plans.get(g.index, (g, []))[1])
                cached = bm.find_cached_prefix(seq)[: bm.blocks_for(seq.num_computed_tokens)]
                revived = sum(1 for b in cached if bm.blocks[b].ref_count == 0)
                need = bm.blocks_for(seq.num_computed_tokens) - len(cached) + revived
                if len(sched.running) + planned >= self.max_num_seqs:
                    continue
                if bm.num_free_blocks < need:
                    continue
                if best is None or g.load < best[0]:
                    best = (g.load, g, cached)
            if best is None:
                continue  # keeps decoding here; tried again after the next step
            _, dest, cached = best
            assert dest.scheduler is not None
            bm = dest.scheduler.block_manager
            n = seq.num_computed_tokens
            bm.ref_blocks(cached)  # before allocating: allocation must not evict them
            blocks = cached + bm.allocate_blocks(bm.blocks_for(n) - len(cached))
            plans.setdefault(dest.index, (dest, []))[1].append(_Move(seq, n, blocks, len(cached)))
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
