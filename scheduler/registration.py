"""What a worker's registration must agree with: the scheduler's layout and the other ranks."""

from __future__ import annotations

from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.worker_group import WorkerGroup, WorkerInfo, kv_pool_mismatch

__all__ = ["RegistrationError", "check_registration"]


class RegistrationError(ValueError):
    """A worker's registration contradicts the scheduler's configuration or the other ranks."""


def check_registration(
    config: SchedulerConfig, groups: list[WorkerGroup], info: WorkerInfo
) -> None:
    """Raises RegistrationError for a group or rank the configuration does not have, a
    tensor-parallel size that differs from `--tensor-parallel-size`, a pool without a handle in
    disaggregated mode, a model or block size that differs from the other groups', or a KV pool
    whose blocks cannot be copied to or from the pools of the ranks registered in the other
    groups (another dtype, number of layers, KV heads per rank or block_size * head_dim; see
    `kv_pool_mismatch`)."""
    if info.worker_group >= len(groups):
        raise RegistrationError(
            f"worker_group {info.worker_group} does not exist: this scheduler has "
            f"{len(groups)} worker group(s) (--num-prefill-workers "
            f"{config.num_prefill_workers}, --num-decode-workers {config.num_decode_workers})"
        )
    if info.tensor_parallel_size != config.tensor_parallel_size:
        raise RegistrationError(
            f"worker started with --tensor-parallel-size {info.tensor_parallel_size}, "
            f"the scheduler with {config.tensor_parallel_size}"
        )
    if not 0 <= info.rank < config.tensor_parallel_size:
        raise RegistrationError(
            f"rank {info.rank} outside [0, {config.tensor_parallel_size}) "
            f"(--tensor-parallel-size {config.tensor_parallel_size})"
        )
    if config.is_disaggregated and info.kv_pool is None:
        raise RegistrationError(
            "disaggregated prefill copies KV blocks between workers: start the worker "
            "with --share-kv-pool"
        )
    for other in groups:
        leader = other.leader
        if leader is None or (other.index == info.worker_group and info.rank == 0):
            continue
        if (leader.model_id, leader.block_size, leader.vocab_size) != (
            info.model_id,
            info.block_size,
            info.vocab_size,
        ):
            raise RegistrationError(
                f"worker serves {info.model_id!r} (block_size {info.block_size}, vocab "
                f"{info.vocab_size}); group {other.name} serves {leader.model_id!r} "
                f"(block_size {leader.block_size}, vocab {leader.vocab_size})"
            )
    if info.kv_pool is not None:
        _check_kv_pool(info, groups)


def _check_kv_pool(info: WorkerInfo, groups: list[WorkerGroup]) -> None:
    """Raises RegistrationError when the pool of `info` does not match the pool of a rank
    registered in another group: block copies between them would fail."""
    assert info.kv_pool is not None
    mine = groups[info.worker_group]
    for other in groups:
        if other is mine:
            continue
        for rank, peer in sorted(other.ranks.items()):
            if peer.kv_pool is None:
                continue
            mismatch = kv_pool_mismatch(info.kv_pool, peer.kv_pool)
            if mismatch is None:
                continue
            field, value, theirs = mismatch
            raise RegistrationError(
                f"worker {info.address} ({mine.name} rank {info.rank}) has a KV pool with "
                f"{field} {value}, worker {peer.address} ({other.name} rank {rank}) one with "
                f"{field} {theirs}: KV blocks cannot be copied between them (start every "
                "worker with the same model, --dtype, --block-size and "
                "--tensor-parallel-size)"
            )
