"""Tensor parallelism of the worker: the rank's process group, its shard arithmetic and the
collectives the sharded decoder needs.

The sharding is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3): in each decoder layer the
Q/K/V and gate/up projections are column-parallel (rank ``r`` of ``N`` holds ``Hq / N`` query
heads, ``Hkv / N`` KV heads and ``I / N`` intermediate columns), the o and down projections
row-parallel (the matching input columns) followed by one all-reduce each; the embedding and
the LM head are vocab-parallel (rank ``r`` holds vocabulary rows
``[r * ceil(V / N), (r + 1) * ceil(V / N))``, the last shard zero-padded when ``N`` does not
divide ``V``). Norms, rotary tables and the o/down biases are replicated.

A world of size 1 needs no process group: every collective is then the identity, and the model
runs the code path it runs without tensor parallelism.

Usage, in each of the ``N`` worker processes (one per device)::

    tp = init_tensor_parallel(rank, n, "tcp://127.0.0.1:29500", "cuda:0")
    runner = ModelRunner(model_dir, device="cuda:0", tensor_parallel_rank=rank,
                         tensor_parallel_size=n)
    ...
    destroy_tensor_parallel()
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # worker.model imports this module
    from sluiceway.worker.model import ModelConfig

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_TIMEOUT_S",
    "TensorParallelGroup",
    "check_tensor_parallel",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "joined_group",
]

DEFAULT_TIMEOUT_S = 600.0
"""Default seconds a collective waits for the other ranks before it raises (see
:func:`init_tensor_parallel`)."""

BACKEND_ENV = "SLUICEWAY_DISTRIBUTED_BACKEND"
"""Environment variable that overrides the torch.distributed backend: ``gloo`` or ``nccl``
(see :func:`init_tensor_parallel`)."""


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel world, its shard sizes and its collectives.

    The collectives run on torch's default process group (the one
    :func:`init_tensor_parallel` creates); with ``world_size == 1`` they return their input
    and need no group. Every rank must call the same collectives in the same order with
    tensors of the same shapes, or they block (until the group's timeout) or fail.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``; rank 0 samples.
        world_size: the number of ranks ``N``.
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"tensor parallel rank {self.rank} outside a world of size {self.world_size}"
            )

    @property
    def enabled(self) -> bool:
        """More than one rank: the collectives communicate."""
        return self.world_size > 1

    # -- shard arithmetic ----------------------------------------------------------------

    def shard(self, size: int, what: str = "size") -> int:
        """``size / N``, the rank's share of a dimension split evenly.

        Raises:
            ValueError: ``N`` does not divide ``size``.
        """
        if size % self.world_size:
            raise ValueError(
                f"tensor_parallel_size {self.world_size} does not divide the model's {size} {what}"
            )
        return size // self.world_size

    def shard_range(self, size: int) -> tuple[int, int]:
        """The rank's ``[start, stop)`` of a dimension of ``size`` split evenly (see
        :meth:`shard`)."""
        n = self.shard(size)
        return self.rank * n, (self.rank + 1) * n

    def vocab_shard_size(self, vocab_size: int) -> int:
        """Rows of the rank's embedding / LM-head shard: ``ceil(V / N)`` (padding included)."""
        return math.ceil(vocab_size / self.world_size)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """The token ids ``[start, stop)`` the rank's vocabulary shard holds; ``stop - start``
        is less than :meth:`vocab_shard_size` on the last ranks when ``N`` does not divide
        ``V`` (possibly 0), the rest of the shard being zero padding."""
        n = self.vocab_shard_size(vocab_size)
        start = min(self.rank * n, vocab_size)
        return start, min(start + n, vocab_size)

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``.

        CPU tensors: every rank's ``x`` is all-gathered and summed in float32 in rank order
        0, 1, ..., N - 1, rounded once to ``x``'s dtype: each element's sum has one order
        whatever the tensor's size (gloo's ring splits a tensor into chunks by size, and an
        element's order of addition follows its chunk: a row's sum would depend on the batch).
        CUDA tensors: the backend's all-reduce (NCCL, or gloo through host memory), whose order
        follows the size too.
        """
        if self.world_size == 1:
            return x
        if x.is_cuda:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            return x
        send = x.contiguous()
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(parts, send)
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        x.copy_(total)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` ``[..., n]`` along the last dim, in rank order:
        ``[..., N * n]`` on every rank. All ranks must pass the same shape and dtype.
        (gloo with CUDA tensors: through host memory, see :func:`_gloo_cuda`.)"""
        if self.world_size == 1:
            return x
        send = x.contiguous()
        staged = _gloo_cuda(send)
        if staged:
            send = send.cpu()
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(parts, send)
        out = torch.cat(parts, dim=-1)
        return out.to(x.device) if staged else out

    def gather_last_dim(self, x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
        """Like :meth:`all_gather_last_dim` but only rank ``dst`` receives the ``[..., N * n]``
        result; the other ranks send their part and get None."""
        if self.world_size == 1:
            return x
        send = x.contiguous()
        staged = _gloo_cuda(send)
        if staged:
            send = send.cpu()
        parts = (
            [torch.empty_like(send) for _ in range(self.world_size)] if self.rank == dst else None
        )
        dist.gather(send, parts, dst=dst)
        if parts is None:
            return None
        out = torch.cat(parts, dim=-1)
        return out.to(x.device) if staged else out

    def min_int(self, value: int) -> int:
        """The minimum of an integer over the ranks (e.g. KV blocks, so all ranks agree)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def _gloo_cuda(x: torch.Tensor) -> bool:
    """Whether ``x`` is a CUDA tensor in a gloo group: gloo reduces CUDA tensors
    (``all_reduce``) but its gather and all-gather are documented for CPU tensors only, so
    those two go through host memory then (the ``SLUICEWAY_DISTRIBUTED_BACKEND=gloo`` case,
    e.g. several ranks on one GPU)."""
    return x.is_cuda and dist.get_backend() == "gloo"


def _backend(device: torch.device) -> str:
    """The torch.distributed backend for ``device``: ``$SLUICEWAY_DISTRIBUTED_BACKEND`` when
    set, else NCCL on CUDA and gloo on CPU.

    Raises:
        ValueError: an override other than gloo/nccl, or nccl for a CPU device.
    """
    override = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not override:
        return "nccl" if device.type == "cuda" else "gloo"
    if override not in ("gloo", "nccl"):
        raise ValueError(f"{BACKEND_ENV} must be gloo or nccl, got {override!r}")
    if override == "nccl" and device.type != "cuda":
        raise ValueError(f"{BACKEND_ENV}=nccl needs a CUDA device, not {device}")
    return override


def _collective_device() -> torch.device:
    """Where small control tensors must live for the default group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Refuse a model that cannot be split ``tensor_parallel_size`` ways.

    Query heads, KV heads and the MLP's intermediate size must be multiples of ``N`` (KV heads
    are not replicated across ranks). The vocabulary need not be: its last shard is padded
    (see :meth:`TensorParallelGroup.vocab_range`).

    Raises:
        ValueError: ``N < 1`` or a size ``N`` does not divide, e.g. "tensor_parallel_size 2
            does not divide the model's 3 KV heads (num_key_value_heads)".
    """
    n = tensor_parallel_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {n}")
    for size, what in (
        (config.num_kv_heads, "KV heads (num_key_value_heads)"),
        (config.num_heads, "attention heads (num_attention_heads)"),
        (config.intermediate_size, "MLP intermediate size (intermediate_size)"),
    ):
        if size % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide the model's {size} {what}")


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: str | torch.device,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TensorParallelGroup:
    """Join the tensor-parallel world: ``torch.distributed.init_process_group`` with NCCL on
    CUDA (after selecting ``device`` as the current CUDA device) or gloo on CPU.

    The environment variable ``SLUICEWAY_DISTRIBUTED_BACKEND=gloo|nccl`` overrides that choice
    (:data:`BACKEND_ENV`). NCCL refuses two ranks on one GPU, so a smoke test of tensor
    parallelism on a single GPU (``sluiceway serve --device cuda --tensor-parallel-size 2``)
    sets it to ``gloo``: gloo all-reduces CUDA tensors (through host memory, so much slower
    than NCCL), and the gathers of the logits are staged through the host
    (:meth:`TensorParallelGroup.gather_last_dim`). ``nccl`` with a CPU device is refused.

    Call it in each of the ``world_size`` processes before building their
    :class:`worker.model_runner.ModelRunner`; it returns once all ranks have joined (or raises
    after ``timeout_s``). With ``world_size == 1`` no group is created.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: the number of ranks.
        init_method: where the ranks meet, e.g. ``tcp://127.0.0.1:29500`` (rank 0 listens
            there; see :func:`sluiceway.launcher.free_port`).
        device: this rank's device, ``cpu`` or ``cuda:K`` (one GPU per rank).
        timeout_s: how long the rendezvous and every later collective wait for the other ranks
            before raising ``RuntimeError`` (gloo: "Timed out waiting ... for recv"; NCCL: the
            watchdog aborts the communicator, and the process, after the timeout). A rank that
            dies closes its sockets, which gloo peers usually notice at once.

    Raises:
        ValueError: a bad rank or world size, or a bad ``SLUICEWAY_DISTRIBUTED_BACKEND``.
        RuntimeError: the group is already initialised, or the rendezvous failed / timed out.
    """
    group = TensorParallelGroup(rank, world_size)
    if world_size == 1:
        return group
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    dev = torch.device(device)
    backend = _backend(dev)
    if dev.type == "cuda" and dev.index is not None:
        # plain "cuda" (one GPU for every rank) is the current device already, and
        # torch.cuda.set_device refuses a device without an index
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return group


def joined_group(rank: int, world_size: int) -> TensorParallelGroup:
    """The group of a process that has joined the world with :func:`init_tensor_parallel`
    (any group when ``world_size == 1``), checked against torch.distributed's.

    Raises:
        ValueError: a bad rank or world size.
        RuntimeError: ``world_size > 1`` and torch.distributed is not initialised, or its rank
            or world size differ.
    """
    group = TensorParallelGroup(rank, world_size)
    if world_size == 1:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"tensor_parallel_size {world_size} needs torch.distributed initialised first: "
            "call worker.parallel.init_tensor_parallel in every rank"
        )
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise RuntimeError(
            f"tensor parallel rank {rank} of {world_size} disagrees with torch.distributed's "
            f"rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    return group


def destroy_tensor_parallel() -> None:
    """Leave the group created by :func:`init_tensor_parallel` (no-op when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
