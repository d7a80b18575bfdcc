"""The step loop: schedule, send one `ExecuteStep` to every worker rank, apply the tokens.

Runs as one asyncio task in the scheduler process. Requests arrive through
`add_request` (one async iterator of `TokenEvent`s per request); cancelling
that iterator aborts the request and frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from scheduler import metrics
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler, SchedulerOutput
from scheduler.sequence import Sequence
from sluiceway.internal.v1 import scheduler_pb2, worker_pb2, worker_pb2_grpc
from sluiceway.v1 import inference_pb2

log = structlog.get_logger("scheduler")

# While idle, the step loop checks the worker is still reachable this often, seconds.
IDLE_PROBE_INTERVAL_S = 1.0
IDLE_PROBE_TIMEOUT_S = 5.0


class WorkerUnavailable(Exception):
    """The worker failed a step; the requests it held end with UNAVAILABLE."""


class NotReady(Exception):
    """No worker is registered: none yet, or the last one failed."""


class QueueFull(Exception):
    """`max_waiting_requests` requests are already waiting."""


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
        req.scheduled.append(
            worker_pb2.ScheduledSequence(
                seq_id=s.seq.seq_id,
                appended_token_ids=[] if s.is_new else s.appended_token_ids,
                num_computed_tokens=s.num_computed_tokens,
                num_new_tokens=s.num_new_tokens,
                new_block_ids=s.new_block_ids,
            )
        )
    return req


class Engine:
    """Owns the `Scheduler`, the worker connections and the per-request event queues."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.scheduler: Scheduler | None = None
        self.worker: WorkerInfo | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._channel: grpc.aio.Channel | None = None
        self._queues: dict[int, asyncio.Queue[scheduler_pb2.TokenEvent | Exception]] = {}
        self._seq_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        self._wakeup = asyncio.Event()
        self._ready = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._lost_reason = ""
        self.step_times = StepTimeTotals()

    # -- workers ----------------------------------------------------------------

    async def register_worker(self, info: WorkerInfo) -> int:
        """Connects to a worker that announced itself and sizes the block pool from it.

        Returns the max_model_len the scheduler enforces: the smaller of the
        model's and `--max-model-len`, capped as `Scheduler` explains. A worker registering again (a restart)
        replaces the old one: requests in flight end with UNAVAILABLE.
        """
        requested = info.max_model_len
        if self.config.max_model_len is not None:
            requested = min(requested, self.config.max_model_len)
        if self.scheduler is not None:
            self._fail_all(WorkerUnavailable("worker restarted"))
        if self._channel is not None:
            await self._channel.close()
        self._channel = grpc.aio.insecure_channel(info.address)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.worker = info
        previous = self.scheduler
        self.scheduler = Scheduler(
            self.config,
            BlockManager(info.num_kv_blocks, info.block_size, self.config.enable_prefix_caching),
            requested,
        )
        if previous is not None:  # counters are "since start": a new worker does not reset them
            self.scheduler.carry_counters_from(previous)
        max_model_len = self.scheduler.max_model_len
        if max_model_len < requested:
            log.warning(
                "max_model_len_capped",
                requested=requested,
                max_model_len=max_model_len,
                kv_pool_tokens=info.num_kv_blocks * info.block_size,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                enable_chunked_prefill=self.config.enable_chunked_prefill,
            )
        self._ready.set()
        log.info(
            "worker_registered",
            address=info.address,
            rank=info.rank,
            num_kv_blocks=info.num_kv_blocks,
            max_model_len=max_model_len,
        )
        return max_model_len

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name="step-loop")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()

    # -- requests ---------------------------------------------------------------

    def new_sequence(self, req: scheduler_pb2.AddRequestRequest) -> Sequence:
        """Validates and queues a request.

        Raises NotReady (no worker), QueueFull (`max_waiting_requests` waiting), or
        ValueError if it can never run.
        """
        if self.scheduler is None or not self.ready:
            raise NotReady(
                "no worker has registered yet" if self.scheduler is None else self._lost_reason
            )
        waiting = len(self.scheduler.waiting)
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
        )
        if not seq.prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if seq.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.scheduler.add(seq)
        self._queues[seq.seq_id] = asyncio.Queue()
        self._wakeup.set()
        return seq

    async def stream(self, seq: Sequence) -> AsyncGenerator[scheduler_pb2.TokenEvent, None]:
        """Yields the events of `seq` until it finishes; closing the iterator early aborts it.

        Raises WorkerUnavailable if the worker fails while `seq` is in flight.
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
            if self.scheduler is not None and not seq.is_finished:
                self.scheduler.finish(seq, inference_pb2.FINISH_REASON_ABORT)
                log.info("request_aborted", request_id=seq.request_id)
                self._wakeup.set()

    # -- the loop ---------------------------------------------------------------

    async def _run(self) -> None:
        await self._ready.wait()
        while True:
            sched = self.scheduler
            assert sched is not None
            if not sched.has_work:
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_PROBE_INTERVAL_S)
                except TimeoutError:
                    await self._probe_idle_worker()
                continue
            preemptions = sched.num_preemptions
            t0 = time.perf_counter()
            out = sched.schedule()
            t1 = time.perf_counter()
            if sched.num_preemptions > preemptions:
                log.info(
                    "preempted",
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
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                response = await self._execute(out)
            except (grpc.aio.AioRpcError, WorkerUnavailable) as e:
                if sched is not self.scheduler:
                    continue  # a new worker registered while the step ran: it has failed those
                reason = (
                    f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else e
                )
                log.error("step_failed", error=str(reason))
                await self._lose_worker(f"the worker failed a step ({reason})")
                continue
            if sched is not self.scheduler:
                continue  # a worker re-registered while the step ran
            t2 = time.perf_counter()
            by_seq = {s.seq_id: s for s in response.sampled}
            sampled = {seq_id: s.token_id for seq_id, s in by_seq.items()}
            for update in sched.apply_sampled(out, sampled):
                queue = self._queues.get(update.seq.seq_id)
                if queue is not None:
                    event = scheduler_pb2.TokenEvent(
                        token_ids=[update.token_id], finish_reason=update.seq.finish_reason
                    )
                    seq = update.seq
                    if seq.sampling.HasField("num_logprobs"):
                        event.logprobs.append(token_logprobs(by_seq[seq.seq_id]))
                    if len(seq.output_token_ids) == 1 and seq.first_scheduled_time is not None:
                        event.queue_seconds = seq.first_scheduled_time - seq.arrival_time
                    queue.put_nowait(event)
            self._record_step(out, response, t0, t1, t2)

    async def _probe_idle_worker(self) -> None:
        """While no step runs, asks the worker's health service whether it is still there: a
        worker that died idle is noticed within seconds, not at the next request's first step.

        Only an unreachable worker counts (UNAVAILABLE, or no answer within
        IDLE_PROBE_TIMEOUT_S), so a busy machine cannot make a live worker look dead.
        """
        if self._channel is None or not self.ready:
            return
        sched = self.scheduler
        try:
            await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=IDLE_PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            if sched is not self.scheduler or e.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                return
            log.error("worker_unreachable", code=e.code().name, details=e.details())
            await self._lose_worker(f"the worker is unreachable ({e.code().name})")

    async def _lose_worker(self, reason: str) -> None:
        """The worker is gone: NOT_SERVING, every sequence in flight ends with
        WorkerUnavailable(`reason`), new requests get NotReady; returns once a worker has
        registered again."""
        self._lost_reason = f"{reason}; waiting for a worker"
        self._ready.clear()
        self._fail_all(WorkerUnavailable(reason))
        await self._ready.wait()

    def _record_step(
        self,
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
        model = self.worker.model_id if self.worker is not None else ""
        metrics.SCHEDULER_STEP_SECONDS.labels(model).observe(t1 - t0)
        metrics.MODEL_STEP_SECONDS.labels(model).observe(t2 - t1)
        metrics.BATCH_SIZE.labels(model).observe(len(out.scheduled))
        metrics.BATCHED_TOKENS.labels(model).observe(sum(s.num_new_tokens for s in out.scheduled))

    async def _execute(self, out: SchedulerOutput) -> worker_pb2.StepResponse:
        assert self._stub is not None
        request = build_step_request(next(self._step_ids), out)
        return await self._stub.ExecuteStep(request)

    def _fail_all(self, error: Exception) -> None:
        """Ends every sequence in flight with `error` and frees its blocks."""
        sched = self.scheduler
        if sched is None:
            return
        for seq in [*sched.running, *sched.waiting]:
            sched.finish(seq, inference_pb2.FINISH_REASON_ABORT)
            queue = self._queues.get(seq.seq_id)
            if queue is not None:
                queue.put_nowait(error)
