"""The step loops: schedule, send one `ExecuteStep` to every worker rank, apply the tokens.

One asyncio task per worker group (see :mod:`scheduler.worker_group`) in the
scheduler process. Requests arrive through `new_sequence` + `stream` (one
async iterator of `TokenEvent`s per request); closing that iterator aborts
the request and frees its blocks before the next step. In disaggregated mode
a prefill group hands each sequence that has sampled its first token to the
least loaded decode group: the decode group's ranks copy the prompt's blocks
from the prefill ranks' pools (`CopyBlocks`), then the sequence decodes
there. A sequence that finds no decode group with room keeps decoding where
it was prefilled, and tries again after every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import structlog

from sluiceway.internal.v1 import scheduler_pb2, worker_pb2
from sluiceway.scheduler import metrics
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.scheduler import Scheduler, SchedulerOutput
from sluiceway.scheduler.sequence import Sequence
from sluiceway.scheduler.worker_group import WorkerGroup, WorkerInfo, kv_pool_mismatch
from sluiceway.v1 import inference_pb2

log = structlog.get_logger("scheduler")

# The step watchdog: a step not answered within step_timeout_s(step) seconds means a hung
# worker (SIGSTOPped, deadlocked, swapping to a halt). The bound grows with the step's size:
# STEP_TIMEOUT_FLOOR_S + STEP_TIMEOUT_PER_TOKEN_S * batched tokens + STEP_TIMEOUT_PER_SEQ_S
# * sequences. Measured on 2 CPU cores (SmolLM2, README): a decode step of 200 sequences
# 100 ms (0.5 ms a sequence), prefill some thousands of tokens/s; the constants allow ~20-30x
# that (a loaded machine) and a floor of 10 s for any step, so only a worker that stopped
# answering trips it, never a slow one. A 2,048-token prefill step: 10 + 20.5 = 30.5 s.
STEP_TIMEOUT_FLOOR_S = 10.0
STEP_TIMEOUT_PER_TOKEN_S = 0.01
STEP_TIMEOUT_PER_SEQ_S = 0.01

# While idle, the step loop checks the worker still answers this often, seconds; one that is
# gone (UNAVAILABLE) is lost, one that does not answer within the floor is hung.
IDLE_PROBE_INTERVAL_S = 1.0
IDLE_PROBE_TIMEOUT_S = STEP_TIMEOUT_FLOOR_S


def step_timeout_s(out: SchedulerOutput) -> float:
    """The watchdog's bound on one step, seconds (see STEP_TIMEOUT_FLOOR_S)."""
    return (
        STEP_TIMEOUT_FLOOR_S
        + STEP_TIMEOUT_PER_TOKEN_S * out.num_batched_tokens
        + STEP_TIMEOUT_PER_SEQ_S * len(out.scheduled)
    )


# A compile that takes longer is a worker in trouble (xgrammar compiles a JSON schema of a
# few KiB in tens of milliseconds on one core).
PREPARE_STRUCTURED_OUTPUTS_TIMEOUT_S = 60.0


class WorkerUnavailable(Exception):
    """The worker failed a step; the requests it held end with UNAVAILABLE."""


class NotReady(Exception):
    """Not every worker rank has registered: none yet, or one failed."""


class RegistrationError(ValueError):
    """A worker's registration contradicts the scheduler's configuration or the other ranks."""


class QueueFull(Exception):
    """`max_waiting_requests` requests are already waiting."""


@dataclass(slots=True)
class StepTimeTotals:
    """Seconds the step loop spent in each phase, summed over `num_steps` steps.

    Sent as `sluiceway.v1.StepTimes`; the worker's share comes from its
    `StepResponse`, so execute - worker_step is RPC and (de)serialization.
    """

    num_steps: int = 0
    schedule_s: float = 0.0
    execute_s: float = 0.0
    worker_step_s: float = 0.0
    worker_prepare_s: float = 0.0
    worker_forward_s: float = 0.0
    worker_sample_s: float = 0.0
    apply_s: float = 0.0

    def add_worker(self, response: worker_pb2.StepResponse) -> None:
        self.worker_step_s += response.step_seconds
        self.worker_prepare_s += response.prepare_seconds
        self.worker_forward_s += response.forward_seconds
        self.worker_sample_s += response.sample_seconds

    def to_proto(self) -> inference_pb2.StepTimes:
        return inference_pb2.StepTimes(
            num_steps_total=self.num_steps,
            schedule_seconds_total=self.schedule_s,
            execute_seconds_total=self.execute_s,
            worker_step_seconds_total=self.worker_step_s,
            worker_prepare_seconds_total=self.worker_prepare_s,
            worker_forward_seconds_total=self.worker_forward_s,
            worker_sample_seconds_total=self.worker_sample_s,
            apply_seconds_total=self.apply_s,
        )


def token_logprobs(sampled: worker_pb2.SampledToken) -> inference_pb2.TokenLogprobs:
    """The public form of a sampled token's log-probabilities."""
    return inference_pb2.TokenLogprobs(
        token_id=sampled.token_id,
        logprob=sampled.logprob,
        top_logprobs=[
            inference_pb2.TopLogprob(token_id=t, logprob=lp)
            for t, lp in zip(sampled.top_token_ids, sampled.top_logprobs, strict=True)
        ],
    )


def build_step_request(step_id: int, out: SchedulerOutput) -> worker_pb2.StepRequest:
    """Translates a `SchedulerOutput` into the wire message of one step."""
    req = worker_pb2.StepRequest(step_id=step_id, finished_seq_ids=out.finished_seq_ids)
    for s in out.scheduled:
        if s.is_new:
            req.new_sequences.append(
                worker_pb2.NewSequence(
                    seq_id=s.seq.seq_id,
                    prompt_token_ids=s.appended_token_ids,
                    sampling=s.seq.sampling,
                    request_id=s.seq.request_id,
                    num_prompt_tokens=len(s.seq.prompt_token_ids),
                )
            )
        scheduled = worker_pb2.ScheduledSequence(
            seq_id=s.seq.seq_id,
            appended_token_ids=[] if s.is_new else s.appended_token_ids,
            num_computed_tokens=s.num_computed_tokens,
            num_new_tokens=s.num_new_tokens,
            new_block_ids=s.new_block_ids,
        )
        req.scheduled.append(scheduled)
    return req


@dataclass(slots=True)
class _Move:
    """A sequence on its way from a prefill group to a decode group: its first
    `num_computed_tokens` tokens' K/V go to `blocks` of the decode pool, of which the first
    `num_cached` were already there (its prefix cache) and are not copied."""

    seq: Sequence
    num_computed_tokens: int
    blocks: list[int]
    num_cached: int


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


class Engine:
    """Owns the worker groups (a `Scheduler` and the worker ranks of each) and the
    per-request event queues."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.groups = [
            WorkerGroup(i, role, config.tensor_parallel_size, config)
            for i, role in enumerate(config.group_roles)
        ]
        self._group_of: dict[int, WorkerGroup] = {}  # seq_id -> the group that holds it
        self._queues: dict[int, asyncio.Queue[scheduler_pb2.TokenEvent | Exception]] = {}
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._loop_tasks: list[asyncio.Task[None]] = []
        self.step_times = StepTimeTotals()
        self.num_kv_transfers = 0  # sequences whose blocks moved to a decode group
        self.kv_transfer_bytes = 0

    # -- workers ----------------------------------------------------------------

    async def register_worker(self, info: WorkerInfo) -> int:
        """Connects to a worker rank that announced itself; once every rank of its group has
        registered, sizes the group's block pool from them.

        Returns the max_model_len the scheduler enforces for the group (the rank's own until
        the group is complete): the smaller of the model's and `--max-model-len`, capped as
        `Scheduler` explains. A rank registering again after a restart (a new `worker_id`)
        ends the requests its group holds with UNAVAILABLE; the same process registering
        again while its group serves changes nothing.

        Raises RegistrationError for a group or rank the configuration does not have, a
        tensor-parallel size that differs from `--tensor-parallel-size`, a pool without a
        handle in disaggregated mode, a model or block size that differs from the other
        groups', or a KV pool whose blocks cannot be copied to or from the pools of the ranks
        registered in the other groups (another dtype, number of layers, KV heads per rank or
        block_size * head_dim; see `kv_pool_mismatch`).
        """
        cfg = self.config
        if info.worker_group >= len(self.groups):
            raise RegistrationError(
                f"worker_group {info.worker_group} does not exist: this scheduler has "
                f"{len(self.groups)} worker group(s) (--num-prefill-workers "
                f"{cfg.num_prefill_workers}, --num-decode-workers {cfg.num_decode_workers})"
            )
        if info.tensor_parallel_size != cfg.tensor_parallel_size:
            raise RegistrationError(
                f"worker started with --tensor-parallel-size {info.tensor_parallel_size}, "
                f"the scheduler with {cfg.tensor_parallel_size}"
            )
        if not 0 <= info.rank < cfg.tensor_parallel_size:
            raise RegistrationError(
                f"rank {info.rank} outside [0, {cfg.tensor_parallel_size}) "
                f"(--tensor-parallel-size {cfg.tensor_parallel_size})"
            )
        if cfg.is_disaggregated and info.kv_pool is None:
            raise RegistrationError(
                "disaggregated prefill copies KV blocks between workers: start the worker "
                "with --share-kv-pool"
            )
        for other in self.groups:
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
        group = self.groups[info.worker_group]
        if info.kv_pool is not None:
            self._check_kv_pool(info, group)
        known = group.ranks.get(info.rank)
        if known is not None and known.same_process(info) and group.ready.is_set():
            # It lost sight of us (a broken health watch) while we kept it: nothing changes.
            assert group.scheduler is not None
            log.info("worker_still_registered", address=info.address, group=group.name,
                     rank=info.rank)  # fmt: skip
            return group.scheduler.max_model_len
        if group.scheduler is not None and group.is_complete:
            group.ready.clear()
            self._fail_group(group, WorkerUnavailable("worker restarted"))
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

    def _check_kv_pool(self, info: WorkerInfo, group: WorkerGroup) -> None:
        """Raises RegistrationError when the pool of `info` (joining `group`) does not match
        the pool of a rank registered in another group: block copies between them would
        fail."""
        assert info.kv_pool is not None
        for other in self.groups:
            if other is group:
                continue
            for rank, peer in sorted(other.ranks.items()):
                if peer.kv_pool is None:
                    continue
                mismatch = kv_pool_mismatch(info.kv_pool, peer.kv_pool)
                if mismatch is None:
                    continue
                field, mine, theirs = mismatch
                raise RegistrationError(
                    f"worker {info.address} ({group.name} rank {info.rank}) has a KV pool with "
                    f"{field} {mine}, worker {peer.address} ({other.name} rank {rank}) one with "
                    f"{field} {theirs}: KV blocks cannot be copied between them (start every "
                    "worker with the same model, --dtype, --block-size and "
                    "--tensor-parallel-size)"
                )

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
        if st.num_kv_blocks:
            st.kv_usage_perc = (st.num_kv_blocks - st.num_free_kv_blocks) / st.num_kv_blocks
            st.utilization = weighted_utilization / st.num_kv_blocks
        return st

    def start(self) -> None:
        self._loop_tasks = [
            asyncio.create_task(self._run(g), name=f"step-loop-{g.name}") for g in self.groups
        ]

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
        """Raises NotReady, with the first lost group's reason, unless every group is ready."""
        if not self.ready:
            missing = [g for g in self.groups if not g.ready.is_set()]
            reasons = [g.lost_reason for g in missing if g.lost_reason]
            raise NotReady(reasons[0] if reasons else "no worker has registered yet")

    async def prepare_structured_outputs(
        self, constraint: inference_pb2.StructuredOutputs
    ) -> float:
        """Has every rank of every group (the prefill workers sample a request's first token,
        the decode workers the rest) compile `constraint` before the request is queued, so
        that no step waits for a compile; returns the longest compile, seconds.

        Raises ValueError (it does not compile: the message names the field) or NotReady (a
        worker missing or failing).
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
                raise ValueError(e.details()) from None
            raise NotReady(f"a worker failed to compile the constraint: {e.code().name}") from None
        return max(times)

    def new_sequence(self, req: scheduler_pb2.AddRequestRequest) -> Sequence:
        """Validates and queues a request on the least loaded group that prefills.

        A request with `output_token_ids` (a stream resumed from a failed replica) continues
        after them, as a preempted sequence does.

        Raises NotReady (a worker missing), QueueFull (`max_waiting_requests` waiting), or
        ValueError if it can never run.
        """
        self._check_ready()
        entry = [g for g in self.groups if g.role != "decode"]
        waiting = sum(len(g.scheduler.waiting) for g in entry if g.scheduler is not None)
        if waiting >= self.config.max_waiting_requests:
            raise QueueFull(
                f"{waiting} requests are waiting (--max-waiting-requests "
                f"{self.config.max_waiting_requests}); retry later"
            )
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=req.sampling,
            max_tokens=req.max_tokens,
            stop_token_ids=frozenset(req.stop_token_ids),
            min_tokens=req.min_tokens,
            parent_request_id=req.parent_request_id or None,
            output_token_ids=list(req.output_token_ids),
        )
        if not seq.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if seq.max_tokens <= len(seq.output_token_ids):
            raise ValueError(
                f"max_tokens ({seq.max_tokens}) must exceed the "
                f"{len(seq.output_token_ids)} output_token_ids"
            )
        if seq.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_tokens} tokens, max_model_len is {self.max_model_len}"
            )
        group = min(entry, key=lambda g: g.load)
        assert group.scheduler is not None
        group.scheduler.add(seq)
        self._group_of[seq.seq_id] = group
        self._queues[seq.seq_id] = asyncio.Queue()
        group.wakeup.set()
        return seq

    async def stream(self, seq: Sequence) -> AsyncGenerator[scheduler_pb2.TokenEvent, None]:
        """Yields the events of `seq` until it finishes; closing the iterator early aborts it.

        Raises WorkerUnavailable if a worker of its group fails while `seq` is in flight.
        """
        queue = self._queues[seq.seq_id]
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if event.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            self._queues.pop(seq.seq_id, None)
            group = self._group_of.pop(seq.seq_id, None)
            if group is not None and group.scheduler is not None and not seq.is_finished:
                group.scheduler.finish(seq, inference_pb2.FINISH_REASON_ABORT)
                log.info("request_aborted", request_id=seq.request_id)
                group.wakeup.set()

    # -- the loops --------------------------------------------------------------

    async def _run(self, group: WorkerGroup) -> None:
        await group.ready.wait()
        while True:
            sched = group.scheduler
            assert sched is not None
            if not sched.has_work:
                group.wakeup.clear()
                try:
                    await asyncio.wait_for(group.wakeup.wait(), IDLE_PROBE_INTERVAL_S)
                except TimeoutError:
                    await self._probe_idle_group(group)
                continue
            preemptions = sched.num_preemptions
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            if sched.num_preemptions > preemptions:
                log.info(
                    "preempted",
                    group=group.name,
                    num_preemptions=sched.num_preemptions - preemptions,
                    num_free_kv_blocks=sched.block_manager.num_free_blocks,
                    num_waiting=len(sched.waiting),
                )
            now = time.monotonic()
            for s in out.scheduled:
                if s.seq.first_scheduled_time is None:
                    s.seq.first_scheduled_time = now
            if out.is_empty:
                # Nothing fits right now (e.g. every block held by a step in flight);
                # wait for an abort or a new request to change that.
                group.wakeup.clear()
                await group.wakeup.wait()
                continue
            try:
                request = build_step_request(next(self._step_ids), out)
                timeout_s = step_timeout_s(out)
                response = await asyncio.wait_for(group.execute(request), timeout_s)
            except TimeoutError:
                if sched is not group.scheduler:
                    continue
                log.error("step_timed_out", group=group.name, timeout_s=round(timeout_s, 3),
                          num_seqs=len(out.scheduled))  # fmt: skip
                await self._stall_group(
                    group, f"the worker did not answer a step within {timeout_s:.1f} s"
                )
                continue
            except grpc.aio.AioRpcError as e:
                if sched is not group.scheduler:
                    continue  # a rank re-registered while the step ran: it has failed those
                # the details (gRPC's transport text, the worker's address) only in the log:
                # the reason reaches clients
                log.error("step_failed", group=group.name, error=f"{e.code().name}: {e.details()}")
                await self._lose_group(group, f"the worker failed a step ({e.code().name})")
                continue
            if sched is not group.scheduler:
                continue  # a rank re-registered while the step ran
            t2 = time.perf_counter()
            self._apply(sched, out, response)
            self._record_step(group, out, response, t0, t1, t2)
            if group.role == "prefill":
                await self._hand_off(group)

    def _apply(
        self, sched: Scheduler, out: SchedulerOutput, response: worker_pb2.StepResponse
    ) -> None:
        """Appends the step's sampled tokens and sends each to its request's stream."""
        by_seq = {s.seq_id: s for s in response.sampled}
        sampled = {seq_id: s.token_id for seq_id, s in by_seq.items()}
        for update in sched.apply_sampled(out, sampled):
            queue = self._queues.get(update.seq.seq_id)
            if queue is None:
                continue
            seq = update.seq
            event = scheduler_pb2.TokenEvent(
                token_ids=[update.token_id], finish_reason=seq.finish_reason
            )
            if seq.sampling.HasField("num_logprobs"):
                event.logprobs.append(token_logprobs(by_seq[seq.seq_id]))
            if len(seq.output_token_ids) == 1 and seq.first_scheduled_time is not None:
                event.queue_seconds = seq.first_scheduled_time - seq.arrival_time
            queue.put_nowait(event)

    async def _hand_off(self, source: WorkerGroup) -> None:
        """Moves every sequence of prefill group `source` that has sampled a token to the least
        loaded decode group with room (a slot under `max_num_seqs` and free blocks for its
        K/V): the decode ranks copy the blocks from the source ranks' pools, then the source
        forgets the sequence. Full blocks the decode group already holds in its prefix cache
        (a shared system prompt) are reused, not copied. A failed copy leaves the sequence
        where it is (logged)."""
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
                if sched is None or len(sched.running) + planned >= self.config.max_num_seqs:
                    continue
                reserved = sched.block_manager.allocate_for_transfer(seq, n)
                if reserved is not None:
                    blocks, num_cached = reserved
                    plans.setdefault(dest.index, (dest, []))[1].append(
                        _Move(seq, n, blocks, num_cached)
                    )
                    break
            # (no group with room: it keeps decoding here; tried again after the next step)
        if not plans:
            return

        async def move(dest: WorkerGroup, moves: list[_Move]) -> None:
            dest_sched = dest.scheduler
            assert dest_sched is not None
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
                self._group_of[m.seq.seq_id] = dest
            dest.wakeup.set()

        await asyncio.gather(*(move(dest, moves) for dest, moves in plans.values()))

    async def _probe_idle_group(self, group: WorkerGroup) -> None:
        """While no step runs, asks the group's ranks whether they are still there: a worker
        that died idle (UNAVAILABLE) is lost until it registers again; one that does not
        answer within IDLE_PROBE_TIMEOUT_S (hung, paused) is out until it answers
        (`_stall_group`). Either is noticed within seconds, not at the next request's step."""
        if not group.ready.is_set():
            return
        sched = group.scheduler
        try:
            await group.probe(IDLE_PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if sched is not group.scheduler:
                return
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                log.error("worker_not_answering", group=group.name, timeout_s=IDLE_PROBE_TIMEOUT_S)
                await self._stall_group(
                    group, f"the worker did not answer within {IDLE_PROBE_TIMEOUT_S:.0f} s"
                )
            elif e.code() == grpc.StatusCode.UNAVAILABLE:  # gone: connection refused or reset
                log.error("worker_unreachable", group=group.name, code=e.code().name)
                await self._lose_group(group, f"the worker is unreachable ({e.code().name})")

    async def _stall_group(self, group: WorkerGroup, reason: str) -> None:
        """A worker of `group` does not answer (hung, SIGSTOPped): NOT_SERVING, every sequence
        the group holds ends with WorkerUnavailable(`reason`) (the router retries one that
        sent nothing elsewhere), new requests get NotReady. Unlike `_lose_group`, the group
        comes back by itself: once every rank answers a health check again (SIGCONT), it
        serves again with the same pool (the sequences it held are finished, so the next step
        tells the workers to forget them); a worker found gone meanwhile, or one registering
        again, goes the way of a registration. Returns once the group is ready again."""
        sched = group.scheduler
        group.lost_reason = f"{reason}; waiting for it to answer"
        group.ready.clear()
        self._fail_group(group, WorkerUnavailable(reason))
        while not group.ready.is_set():
            try:
                await group.probe(IDLE_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:  # it died: wait for a registration
                    group.lost_reason = f"{reason}, then became unreachable; waiting for a worker"
                    await group.ready.wait()
                    return
                with contextlib.suppress(TimeoutError):  # or it registered again meanwhile
                    await asyncio.wait_for(group.ready.wait(), IDLE_PROBE_INTERVAL_S)
                continue
            if group.scheduler is sched and not group.ready.is_set():
                log.info("worker_answers_again", group=group.name)
                group.lost_reason = ""
                group.ready.set()
                group.wakeup.set()

    async def _lose_group(self, group: WorkerGroup, reason: str) -> None:
        """A worker of `group` is gone: NOT_SERVING, every sequence the group holds ends with
        WorkerUnavailable(`reason`), new requests get NotReady; returns once the group is
        complete again."""
        group.lost_reason = f"{reason}; waiting for a worker"
        group.ready.clear()
        self._fail_group(group, WorkerUnavailable(reason))
        await group.ready.wait()

    def _record_step(
        self,
        group: WorkerGroup,
        out: SchedulerOutput,
        response: worker_pb2.StepResponse,
        t0: float,
        t1: float,
        t2: float,
    ) -> None:
        """Adds one step (scheduled at t0, sent at t1, answered at t2) to the totals and, when
        it computed anything (not only told the workers to forget finished sequences), to
        the histograms."""
        times = self.step_times
        times.num_steps += 1
        times.schedule_s += t1 - t0
        times.execute_s += t2 - t1
        times.apply_s += time.perf_counter() - t2
        times.add_worker(response)
        if not out.scheduled:
            return
        model = self.model_id
        metrics.SCHEDULER_STEP_SECONDS.labels(model).observe(t1 - t0)
        metrics.MODEL_STEP_SECONDS.labels(model).observe(t2 - t1)
        metrics.BATCH_SIZE.labels(model).observe(len(out.scheduled))
        metrics.BATCHED_TOKENS.labels(model).observe(out.num_batched_tokens)

    def _fail_group(self, group: WorkerGroup, error: Exception) -> None:
        """Ends every sequence `group` holds with `error` and frees its blocks."""
        sched = group.scheduler
        if sched is None:
            return
        for seq in [*sched.running, *sched.waiting]:
            sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
            queue = self._queues.get(seq.seq_id)
            if queue is not None:
                queue.put_nowait(error)
