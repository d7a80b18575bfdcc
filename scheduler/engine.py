"""The scheduler's engine: its worker groups, their step loops, and the requests they serve.

Requests arrive through `add_request` + `stream` (one async iterator of `TokenEvent`s per
request); closing that iterator aborts the request and frees its blocks before the next step.
Each worker group (scheduler/worker_group.py) has its own `Scheduler` over its own block pool
and its own step loop (scheduler/step_loop.py); worker faults cost what their kind costs
(scheduler/faults.py); in disaggregated mode a prefill group hands each prefilled sequence to
a decode group (scheduler/handoff.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc
import structlog

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.sampling_params import SamplingParams, check_prompt_token_ids
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.faults import GroupFaults
from sluiceway.scheduler.handoff import HandOff
from sluiceway.scheduler.registration import check_registration
from sluiceway.scheduler.requests import RequestTable
from sluiceway.scheduler.sequence import Sequence
from sluiceway.scheduler.step_loop import StepLoop, StepTimeTotals
from sluiceway.scheduler.worker_group import WorkerGroup, WorkerInfo
from sluiceway.speculative import SpecDecodeCounts
from sluiceway.status import FieldError, RequestError, error_from_rpc
from sluiceway.v1 import inference_pb2

__all__ = ["Engine", "EngineStats"]

log = structlog.get_logger("scheduler")

# A compile that takes longer is a worker in trouble (xgrammar compiles a JSON schema of a
# few KiB in tens of milliseconds on one core).
PREPARE_STRUCTURED_OUTPUTS_TIMEOUT_S = 60.0


@dataclass(slots=True)
class EngineStats:
    """The KV pools and queues of every worker group, summed (what `GetSchedulerInfo` and the
    Prometheus collector report)."""

    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage_perc: float = 0.0  # blocks held by live requests / all blocks
    utilization: float = 0.0  # last steps: tokens stored / slots allocated, block-weighted
    tokens_stored_total: int = 0
    slots_allocated_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_preemptions_total: int = 0
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)


class Engine:
    """Owns the worker groups (a `Scheduler` and the worker ranks of each), their step loops
    and the live requests."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.groups = [
            WorkerGroup(i, role, config.tensor_parallel_size, config)
            for i, role in enumerate(config.group_roles)
        ]
        self.requests = RequestTable()
        self.faults = GroupFaults(self.requests)
        self.hand_off = HandOff(self.groups, self.requests, config.max_num_seqs)
        self.step_times = StepTimeTotals()
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._loop_tasks: list[asyncio.Task[None]] = []

    @property
    def num_kv_transfers(self) -> int:
        """Sequences whose blocks moved to a decode group since start."""
        return self.hand_off.num_kv_transfers

    @property
    def kv_transfer_bytes(self) -> int:
        """Bytes those moves copied, every rank."""
        return self.hand_off.kv_transfer_bytes

    # -- workers ----------------------------------------------------------------

    async def register_worker(self, info: WorkerInfo) -> int:
        """Connects to a worker rank that announced itself; once every rank of its group has
        registered, sizes the group's block pool from them.

        Returns the max_model_len the scheduler enforces for the group (the rank's own until
        the group is complete): the smaller of the model's and `--max-model-len`, capped as
        `Scheduler` explains. A rank registering again after a restart (a new `worker_id`)
        ends the requests its group holds with UNAVAILABLE; the same process registering
        again while its group serves changes nothing.

        Raises RegistrationError (`check_registration`).
        """
        check_registration(self.config, self.groups, info)
        group = self.groups[info.worker_group]
        known = group.ranks.get(info.rank)
        if known is not None and known.same_process(info) and group.ready.is_set():
            # It lost sight of us (a broken health watch) while we kept it: nothing changes.
            assert group.scheduler is not None
            log.info("worker_still_registered", address=info.address, group=group.name,
                     rank=info.rank)  # fmt: skip
            return group.scheduler.max_model_len
        if group.scheduler is not None and group.is_complete:
            group.ready.clear()
            self.faults.fail_group(
                group, RequestError(grpc.StatusCode.UNAVAILABLE, "worker restarted")
            )
        complete = await group.add_rank(info)
        log.info(
            "worker_registered",
            address=info.address,
            group=group.name,
            rank=info.rank,
            num_kv_blocks=info.num_kv_blocks,
            complete=complete,
        )
        if not complete:
            return info.max_model_len
        return self._size_group(group)

    def _size_group(self, group: WorkerGroup) -> int:
        """Gives a complete group its new scheduler and readiness; returns its max_model_len."""
        cfg = self.config
        requested = min(r.max_model_len for r in group.ranks.values())
        if cfg.max_model_len is not None:
            requested = min(requested, cfg.max_model_len)
        sched = group.new_scheduler(requested)
        if sched.max_model_len < requested:
            log.warning(
                "max_model_len_capped",
                group=group.name,
                requested=requested,
                max_model_len=sched.max_model_len,
                kv_pool_tokens=sched.block_manager.num_blocks * sched.block_manager.block_size,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
            )
        group.ready.set()
        group.wakeup.set()
        return sched.max_model_len

    @property
    def ready(self) -> bool:
        """Every rank of every group has registered and none has failed since."""
        return all(g.ready.is_set() for g in self.groups)

    @property
    def model_id(self) -> str:
        leader = self.groups[0].leader
        return leader.model_id if leader is not None else ""

    @property
    def vocab_size(self) -> int:
        leader = self.groups[0].leader
        return leader.vocab_size if leader is not None else 0

    @property
    def max_model_len(self) -> int:
        """The longest sequence every group accepts (0 before all are sized)."""
        lens = [g.scheduler.max_model_len for g in self.groups if g.scheduler is not None]
        return min(lens) if len(lens) == len(self.groups) else 0

    @property
    def block_size(self) -> int:
        leader = self.groups[0].leader
        return leader.block_size if leader is not None else 0

    def stats(self) -> EngineStats:
        """Queues and KV pools of every group that has a scheduler, summed."""
        st = EngineStats()
        weighted_utilization = 0.0
        for g in self.groups:
            sched = g.scheduler
            if sched is None:
                continue
            bm = sched.block_manager
            st.num_kv_blocks += bm.num_blocks
            st.num_free_kv_blocks += bm.num_free_blocks
            st.num_running += len(sched.running)
            st.num_waiting += len(sched.waiting)
            weighted_utilization += sched.kv_usage.utilization * bm.num_blocks
            st.tokens_stored_total += sched.kv_usage.tokens_stored_total
            st.slots_allocated_total += sched.kv_usage.slots_allocated_total
            st.prefix_cache_queries_total += bm.prefix_cache_queries
            st.prefix_cache_hits_total += bm.prefix_cache_hits
            st.num_preemptions_total += sched.num_preemptions
            st.spec_decode.merge(sched.spec_decode)
        if st.num_kv_blocks:
            st.kv_usage_perc = (st.num_kv_blocks - st.num_free_kv_blocks) / st.num_kv_blocks
            st.utilization = weighted_utilization / st.num_kv_blocks
        return st

    def start(self) -> None:
        """Starts one step loop per worker group (each waits for its group to be ready)."""
        self._loop_tasks = []
        for g in self.groups:
            loop = StepLoop(
                g,
                self.requests,
                self.faults,
                self._step_ids,
                self.step_times,
                lambda: self.model_id,
                after_step=functools.partial(self.hand_off, g) if g.role == "prefill" else None,
            )
            self._loop_tasks.append(asyncio.create_task(loop.run(), name=f"step-loop-{g.name}"))

    async def stop(self) -> None:
        """Stops the step loops and closes the workers' channels.

        Cancels until every loop has ended: on Python 3.11 `asyncio.wait_for` returns its
        result instead of raising when a cancel arrives just as the awaited event is set
        (CPython gh-86296, bpo-42130; fixed in 3.12), so one cancel of a loop idling in
        `wait_for(wakeup.wait())` can be swallowed and the loop goes on."""
        pending = set(self._loop_tasks)
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        for g in self.groups:
            await g.close()

    # -- requests ---------------------------------------------------------------

    def _check_ready(self) -> None:
        """Raises RequestError(UNAVAILABLE), with the first lost group's reason, unless every
        group is ready."""
        if not self.ready:
            missing = [g for g in self.groups if not g.ready.is_set()]
            reasons = [g.lost_reason for g in missing if g.lost_reason]
            reason = reasons[0] if reasons else "no worker has registered yet"
            raise RequestError(grpc.StatusCode.UNAVAILABLE, reason)

    async def add_request(self, req: scheduler_pb2.AddRequestRequest) -> Sequence:
        """The replica's gate: checks a request, has its structured-outputs constraint compiled
        (`prepare_structured_outputs`), and queues it on the least loaded group that
        prefills. A request with `output_token_ids` (a stream resumed from a failed replica)
        continues after them, as a preempted sequence does.

        Raises:
            FieldError: a priority other than 0 under a policy other than priority, a
                sampling field out of its range (`SamplingParams.from_proto`), a
                token id >= vocab_size, a prompt (with its outputs) empty or not shorter than
                max_model_len, max_tokens not above the outputs, a constraint that does not
                compile.
            RequestError: UNAVAILABLE (a worker missing or failing), RESOURCE_EXHAUSTED
                (`max_waiting_requests` requests waiting, the samples of one counted once).
        """
        self._check_priority(req.priority)  # whatever the workers' state: retrying won't help
        self._check_ready()
        params = SamplingParams.from_proto(req.sampling)
        params.check_token_ids(self.vocab_size)
        tokens = [*req.prompt_token_ids, *req.output_token_ids]
        if not req.prompt_token_ids:
            raise FieldError("input", "the prompt is empty (0 tokens); it needs at least 1")
        check_prompt_token_ids(tokens, self.vocab_size, self.max_model_len)
        if params.max_tokens <= len(req.output_token_ids):
            raise FieldError(
                "sampling.max_tokens",
                f"must exceed the {len(req.output_token_ids)} output_token_ids; "
                f"got {params.max_tokens}",
            )
        if params.structured_outputs is not None:
            await self.prepare_structured_outputs(params.structured_outputs)
            self._check_ready()  # a worker may have gone while it compiled
        entry = [g for g in self.groups if g.role != "decode"]
        # a request's n samples count once: n above the bound must not be refused forever
        waiting = {
            s.parent_request_id or s.request_id
            for g in entry
            if g.scheduler is not None
            for s in g.scheduler.waiting
        }
        parent = req.parent_request_id or req.request_id
        if parent not in waiting and len(waiting) >= self.config.max_waiting_requests:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(waiting)} requests are waiting (--max-waiting-requests "
                f"{self.config.max_waiting_requests}); retry later",
            )
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=params,
            parent_request_id=req.parent_request_id or None,
            output_token_ids=list(req.output_token_ids),
            priority=req.priority,
        )
        group = min(entry, key=lambda g: g.load)
        assert group.scheduler is not None
        group.scheduler.add(seq)
        self.requests.add(seq, group)
        group.wakeup.set()
        return seq

    def _check_priority(self, priority: int) -> None:
        """Raises FieldError("priority") for a priority other than 0 unless the policy is
        priority: under fcfs (or static) it would be ignored, and vLLM refuses it too."""
        policy = self.config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise FieldError(
                "priority",
                f"priority scheduling is not enabled (this server runs --scheduling-policy "
                f"{policy}; start it with --scheduling-policy priority); got {priority}, only "
                "0 is accepted",
            )

    async def prepare_structured_outputs(
        self, constraint: inference_pb2.StructuredOutputs
    ) -> float:
        """Has every rank of every group (the prefill workers sample a request's first token,
        the decode workers the rest) compile `constraint` before the request is queued, so
        that no step waits for a compile; returns the longest compile, seconds.

        Raises RequestError: the worker's (INVALID_ARGUMENT naming the field: it does not
        compile), or UNAVAILABLE (a worker missing or failing).
        """
        self._check_ready()
        try:
            times = await asyncio.gather(
                *(
                    g.prepare_structured_outputs(constraint, PREPARE_STRUCTURED_OUTPUTS_TIMEOUT_S)
                    for g in self.groups
                )
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise error_from_rpc(e) from None
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"a worker failed to compile the constraint: {e.code().name}",
            ) from None
        return max(times)

    async def stream(self, seq: Sequence) -> AsyncGenerator[scheduler_pb2.TokenEvent, None]:
        """Yields the events of `seq` until it finishes; closing the iterator early aborts it.

        Raises RequestError when a fault ends `seq` (scheduler/faults.py).
        """
        queue = self.requests.queue(seq)
        try:
            while True:
                event = await queue.get()
                if isinstance(event, RequestError):
                    raise event
                yield event
                if event.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            group = self.requests.remove(seq)
            if group is not None and group.scheduler is not None and not seq.is_finished:
                group.scheduler.finish(seq, inference_pb2.FINISH_REASON_ABORT)
                log.info("request_aborted", request_id=seq.request_id)
                group.wakeup.set()
