"""A worker group: one instance of the model (its tensor-parallel ranks) and its KV pool.

The scheduler process drives one group per model instance. A plain scheduler has one group
that prefills and decodes ("both"); with ``--num-prefill-workers P --num-decode-workers D``
(disaggregated prefill, as in Splitwise / DistServe) groups ``0..P-1`` only prefill and the
next ``D`` groups decode sequences whose prompt K/V were copied to them. Each group has its own
:class:`~scheduler.scheduler.Scheduler` over its own block pool and its own step loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.grpc_server import channel_options
from sluiceway.internal.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from sluiceway.scheduler.block_manager import BlockManager
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler
from sluiceway.v1 import inference_pb2

log = structlog.get_logger("scheduler")

# A block copy is a few milliseconds per megabyte; a decode worker that does not answer in this
# long is stuck, and the sequences keep decoding where they were prefilled.
COPY_BLOCKS_TIMEOUT_S = 60.0

# As the worker's server accepts: a step carries the whole prompt of each new sequence.
WORKER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

ROLES = ("both", "prefill", "decode")


# What each dimension of a KvPoolHandle's shape is (kernels.paged_attention.kv_pool_shape);
# all but num_blocks must be the same in two pools for blocks to be copied between them.
KV_POOL_DIMS = ("num_layers", "K/V", "num_blocks", "num_kv_heads per rank", "block_size * head_dim")


def kv_pool_mismatch(
    a: scheduler_pb2.KvPoolHandle, b: scheduler_pb2.KvPoolHandle
) -> tuple[str, str, str] | None:
    """The first field that keeps blocks from being copied between pools `a` and `b`, as
    ``(field, value in a, value in b)``: ``dtype``, a dimension of the block layout (see
    `KV_POOL_DIMS`; the number of blocks may differ) or, for shapes of different lengths,
    ``shape``. None when they match."""
    if a.dtype != b.dtype:
        return ("dtype", a.dtype, b.dtype)
    if len(a.shape) != len(b.shape) or len(a.shape) != len(KV_POOL_DIMS):
        return ("shape", str(list(a.shape)), str(list(b.shape)))
    for name, x, y in zip(KV_POOL_DIMS, a.shape, b.shape, strict=True):
        if name != "num_blocks" and x != y:
            return (name, str(x), str(y))
    return None


@dataclass(slots=True)
class WorkerInfo:
    """What a worker rank reported when it registered."""

    address: str
    rank: int
    model_id: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    worker_group: int = 0
    tensor_parallel_size: int = 1
    kv_pool: scheduler_pb2.KvPoolHandle | None = None
    worker_id: str = ""  # random per worker process; "" from a worker that sends none
    batch_invariant: bool = False  # its forward's rows do not depend on the rest of the step
    has_draft_model: bool = False  # it loaded a --speculative-config draft_model's draft
    draft_reads_model_kv: bool = False  # that draft uses the model's KV pool (worker.draft)

    def same_process(self, other: WorkerInfo) -> bool:
        """Whether `other` is a registration of the very process this one came from (it
        registered again without restarting)."""
        return bool(self.worker_id) and (self.worker_id, self.address) == (
            other.worker_id,
            other.address,
        )


class WorkerGroup:
    """The ranks of one model instance, their gRPC stubs and the `Scheduler` of their pool.

    `scheduler` is None until every rank has registered; `ready` is set while the group is
    complete and has not failed.
    """

    def __init__(
        self, index: int, role: str, tensor_parallel_size: int, config: SchedulerConfig
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.index = index
        self.role = role
        self.tensor_parallel_size = tensor_parallel_size
        self.config = config
        self.ranks: dict[int, WorkerInfo] = {}
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._stubs: dict[int, worker_pb2_grpc.WorkerStub] = {}
        self.scheduler: Scheduler | None = None
        self.ready = asyncio.Event()
        self.wakeup = asyncio.Event()
        self.lost_reason = ""

    def __repr__(self) -> str:
        return f"WorkerGroup({self.index}, {self.role})"

    @property
    def name(self) -> str:
        """``both-0``, ``prefill-1``, ...: the group in logs."""
        return f"{self.role}-{self.index}"

    @property
    def leader(self) -> WorkerInfo | None:
        """Rank 0's registration: it samples and answers each step."""
        return self.ranks.get(0)

    @property
    def is_complete(self) -> bool:
        return len(self.ranks) == self.tensor_parallel_size

    @property
    def load(self) -> tuple[int, int]:
        """Sort key of the least loaded group: sequences it holds, then fewest free blocks."""
        s = self.scheduler
        if s is None:
            return (1 << 30, 0)
        return (len(s.running) + len(s.waiting), -s.block_manager.num_free_blocks)

    async def add_rank(self, info: WorkerInfo) -> bool:
        """Connects to a rank that registered; returns whether every rank of the group is now
        registered.

        A rank that registers again after a restart (another `worker_id`), or a new one
        while the group is complete, starts a new generation: the other ranks'
        registrations are dropped too, because their process group broke with the restarted
        rank (they restart and register again; see `worker.server`). Steps go out only once
        every rank of the new generation is there, so no rank waits in a collective for a
        peer that never got the step. The same process registering again keeps the others.
        """
        known = self.ranks.get(info.rank)
        if known is not None and known.same_process(info):
            await self._channels.pop(info.rank).close()
        elif self.is_complete or known is not None:
            for channel in self._channels.values():
                await channel.close()
            self._channels.clear()
            self._stubs.clear()
            self.ranks.clear()
        # A connection of its own (gRPC otherwise shares one between channels to the same
        # address): a rank restarted at the address a dead one had (a container's fixed
        # port) would get the dead one's connection, failing and in reconnect backoff, and
        # the first probe would drop it again at once, for good.
        options = [
            *channel_options(WORKER_MAX_MESSAGE_BYTES),
            ("grpc.use_local_subchannel_pool", 1),
        ]
        channel = grpc.aio.insecure_channel(info.address, options=options)
        self._channels[info.rank] = channel
        self._stubs[info.rank] = worker_pb2_grpc.WorkerStub(channel)
        self.ranks[info.rank] = info
        return self.is_complete

    def new_scheduler(self, max_model_len: int) -> Scheduler:
        """A Scheduler over the smallest pool of the ranks (they hold the same blocks, each its
        share of the KV heads); counters continue from the previous one, if any."""
        num_blocks = min(r.num_kv_blocks for r in self.ranks.values())
        block_size = self.ranks[0].block_size
        previous = self.scheduler
        speculative = self.config.speculative
        if speculative is not None and not all(r.batch_invariant for r in self.ranks.values()):
            log.warning(
                "speculative_decoding_off",
                group=self.name,
                reason="the worker's forward is not batch invariant (README, Reproducibility): "
                "verified tokens would differ from plain decoding",
            )
            speculative = None
        if (
            speculative is not None
            and speculative.method == "draft_model"
            and not all(r.has_draft_model for r in self.ranks.values())
        ):
            log.warning(
                "speculative_decoding_off",
                group=self.name,
                reason="a worker has no draft model: give the workers the same "
                "--speculative-config (serve does)",
            )
            speculative = None
        if speculative is not None:  # (a server that speculates says so, and how)
            log.info("speculative_decoding_on", group=self.name, config=speculative.to_json())
        self.scheduler = Scheduler(
            self.config,
            BlockManager(num_blocks, block_size, self.config.enable_prefix_caching),
            max_model_len,
            speculative,
            draft_catches_up=not all(r.draft_reads_model_kv for r in self.ranks.values()),
        )
        if previous is not None:  # counters are "since start": a new worker does not reset them
            self.scheduler.carry_counters_from(previous)
        return self.scheduler

    async def execute(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        """Sends the step to every rank at once and returns rank 0's answer.

        Raises grpc.aio.AioRpcError when any rank fails it.
        """
        if self.tensor_parallel_size == 1:
            return await self._stubs[0].ExecuteStep(request)
        responses = await asyncio.gather(
            *(self._stubs[r].ExecuteStep(request) for r in range(self.tensor_parallel_size))
        )
        return responses[0]

    async def copy_blocks_from(
        self, source: WorkerGroup, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> int:
        """Has each rank copy `src_block_ids` of the same rank of `source` into its
        `dst_block_ids` (device to device, through the source's pool handles); returns the
        bytes copied over all ranks. Raises grpc.aio.AioRpcError when a rank fails."""
        responses = await asyncio.gather(
            *(
                self._stubs[r].CopyBlocks(
                    worker_pb2.CopyBlocksRequest(
                        source=source.ranks[r].kv_pool,
                        src_block_ids=src_block_ids,
                        dst_block_ids=dst_block_ids,
                    ),
                    timeout=COPY_BLOCKS_TIMEOUT_S,
                )
                for r in range(self.tensor_parallel_size)
            )
        )
        return sum(r.num_bytes for r in responses)

    async def prepare_structured_outputs(
        self, constraint: inference_pb2.StructuredOutputs, timeout_s: float
    ) -> float:
        """Has every rank compile `constraint` into its grammar cache; returns the longest
        compile, seconds. Raises grpc.aio.AioRpcError from the first rank that fails
        (INVALID_ARGUMENT: it does not compile)."""
        responses = await asyncio.gather(
            *(
                self._stubs[r].PrepareStructuredOutputs(constraint, timeout=timeout_s)
                for r in range(self.tensor_parallel_size)
            )
        )
        return max(r.compile_seconds for r in responses)

    async def probe(self, timeout_s: float) -> None:
        """Health-checks every rank; raises grpc.aio.AioRpcError from the first that fails."""
        await asyncio.gather(
            *(
                health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s
                )
                for ch in self._channels.values()
            )
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
