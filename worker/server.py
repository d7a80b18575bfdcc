"""The worker process: the `Worker` gRPC service over one `ModelRunner`.

Keeps each sequence's record (tokens, block table, sampling options) between
steps, so a step carries only ids and small integers. The model forward runs
on the compute thread (compute_thread.py) so the event loop keeps answering
health checks meanwhile. Once registered, the worker watches its scheduler and
registers again when a new scheduler process takes the old one's place (see
`stay_registered`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.grpc_server import (
    SERVING,
    RegistrationRefused,
    SchedulerUnreachable,
    bind,
    channel_options,
    new_server,
    on_shutdown_signal,
)
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluiceway.options import port_or_none
from sluiceway.sampling_params import SamplingParams
from sluiceway.status import RequestError, abort
from sluiceway.v1 import inference_pb2
from sluiceway.worker.compute_thread import compute_executor
from sluiceway.worker.config import WorkerConfig
from sluiceway.worker.kv_pool import SharedKvPool, copy_blocks, open_kv_pool
from sluiceway.worker.metrics import FORWARD_SECONDS, step_phase
from sluiceway.worker.model_runner import ModelRunner, SampledToken, ScheduledChunk, SequenceData
from sluiceway.worker.prompt_logprobs import PromptLogprobs
from sluiceway.worker.structured_output import ConstraintError, GrammarCompiler
from sluiceway.worker.verify import scheduled_chunk

log = structlog.get_logger("worker")

# Steps carry whole prompts when sequences are new (or come back after preemption).
WORKER_MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# How long a starting worker waits for its scheduler to take its registration (seconds).
FIRST_REGISTRATION_TIMEOUT_S = 60.0
# While the scheduler is away, each registration attempt waits this long for it (seconds),
# and a `scheduler_still_away` warning is logged at most this often.
REREGISTER_ATTEMPT_S = 30.0
# Pause after losing the scheduler before registering again (seconds): bounds how fast a
# watch that keeps breaking at once can make the worker re-register.
REREGISTER_PAUSE_S = 1.0
# gRPC's reconnect backoff grows to 2 minutes; a worker waiting for its scheduler retries
# the connection at least this often (milliseconds), to register soon after it is back.
REGISTER_MAX_RECONNECT_BACKOFF_MS = 2000


def _prompt_logprobs(p: PromptLogprobs) -> worker_pb2.PromptLogprobs:
    """The wire form of one chunk's prompt logprobs."""
    return worker_pb2.PromptLogprobs(
        seq_id=p.seq_id,
        first_token_index=p.first_token_index,
        logprobs=[
            inference_pb2.TokenLogprobs(
                token_id=t,
                logprob=lp,
                rank=rank,
                top_logprobs=[
                    inference_pb2.TopLogprob(token_id=i, logprob=v)
                    for i, v in zip(ids, lps, strict=True)
                ],
            )
            for t, lp, rank, ids, lps in zip(
                p.token_ids,
                p.logprobs,
                p.ranks,
                p.top_ids or [[]] * len(p.token_ids),
                p.top_logprobs or [[]] * len(p.token_ids),
                strict=True,
            )
        ],
    )


# Async scheduling: how long a step waits for the one the scheduler sent before it (they
# travel on one channel, so it is normally there first; this only bounds a lost one).
PREVIOUS_STEP_WAIT_S = 30.0


class StepExecutor:
    """Applies a `StepRequest` to the per-sequence records and runs it on the model.

    Raises ValueError for a step that names an unknown sequence or positions
    beyond a sequence's record (a scheduler bug, reported as INVALID_ARGUMENT).

    A step that fails leaves its sequences out of every later step until the scheduler says
    they finished: the scheduler fails them (scheduler/faults.py), but with async scheduling
    the step after it was sent naming them before the failure was known, and without their
    sampled tokens it would be refused with every other request it holds.
    """

    def __init__(self, runner: ModelRunner, model_name: str = "") -> None:
        self.runner = runner
        self.model_name = model_name
        self.sequences: dict[int, SequenceData] = {}
        self.failed_seq_ids: set[int] = set()  # of a failed step, until finished
        self.grammars = GrammarCompiler(runner.model_dir, runner.vocab_size, runner.eos_token_ids)

    def execute(self, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        t0 = time.perf_counter()
        for seq_id in request.finished_seq_ids:
            self.sequences.pop(seq_id, None)
            self.failed_seq_ids.discard(seq_id)
        for new in request.new_sequences:
            params = SamplingParams.from_proto(new.sampling)
            record = self.runner.make_sequence(
                new.seq_id, list(new.prompt_token_ids), params, new.num_prompt_tokens or None
            )
            if params.structured_outputs is not None:
                generated = record.token_ids[record.num_prompt_tokens :]
                record.constraint = self.grammars.matcher(params.structured_outputs, generated)
            self.sequences[new.seq_id] = record
            log.info(
                "sequence_added",
                request_id=new.request_id,
                seq_id=new.seq_id,
                prompt_tokens=len(new.prompt_token_ids),
            )
        chunks: list[ScheduledChunk] = []
        try:
            for s in request.scheduled:
                if s.seq_id in self.failed_seq_ids:
                    continue  # failed already; the scheduler drops whatever it gets for it
                seq = self.sequences.get(s.seq_id)
                if seq is None:
                    raise ValueError(f"step {request.step_id} names unknown sequence {s.seq_id}")
                seq.append(s.appended_token_ids)
                if s.append_last_sampled:
                    seq.append(self._last_sampled(seq, request.step_id))
                seq.block_table.extend(s.new_block_ids)
                chunks.append(scheduled_chunk(seq, s, self.runner))
            phase = step_phase(chunks)  # (while the records hold the proposals)
            sampled = self.runner.execute(chunks)
        except BaseException:
            self.failed_seq_ids.update(s.seq_id for s in request.scheduled)
            raise
        finally:  # proposed tokens live for the step only: the next step sends those accepted
            for chunk in chunks:
                if chunk.num_draft_tokens:
                    del chunk.seq.token_ids[-chunk.num_draft_tokens :]
        self._keep_sampled(sampled)
        timings = self.runner.last_timings
        if chunks:
            FORWARD_SECONDS.labels(self.model_name, phase).observe(
                timings.prepare_s + timings.forward_s + timings.sample_s
            )
        return worker_pb2.StepResponse(
            step_id=request.step_id,
            sampled=[
                worker_pb2.SampledToken(
                    seq_id=t.seq_id,
                    token_id=t.token_id,
                    logprob=t.logprob,
                    top_token_ids=t.top_ids,
                    top_logprobs=t.top_logprobs,
                )
                for t in sampled
            ],
            prepare_seconds=timings.prepare_s,
            forward_seconds=timings.forward_s,
            sample_seconds=timings.sample_s,
            prompt_logprobs=[_prompt_logprobs(p) for p in self.runner.last_prompt_logprobs],
            step_seconds=time.perf_counter() - t0,
        )

    def _keep_sampled(self, sampled: list[SampledToken]) -> None:
        """Keeps on each record the tokens the step emitted for it, for a next step that
        says `append_last_sampled` (sent before the scheduler had them: async scheduling).
        Only rank 0 samples: the others never keep any (the scheduler sends such steps to
        single-rank groups only)."""
        emitted: dict[int, list[int]] = {}
        for t in sampled:
            emitted.setdefault(t.seq_id, []).append(t.token_id)
        for seq_id, tokens in emitted.items():
            self.sequences[seq_id].last_sampled = tokens

    @staticmethod
    def _last_sampled(seq: SequenceData, step_id: int) -> list[int]:
        """The tokens the record's previous step emitted, taken off it. Raises ValueError
        when there are none (no step sampled it since they were last taken)."""
        tokens = seq.last_sampled
        if tokens is None:
            raise ValueError(
                f"step {step_id}: sequence {seq.seq_id} takes its last sampled token, but "
                "this worker sampled none for it since"
            )
        seq.last_sampled = None
        return tokens

    def copy_blocks(self, request: worker_pb2.CopyBlocksRequest) -> worker_pb2.CopyBlocksResponse:
        """Copies blocks of the peer pool `request.source` into this worker's pool.

        Raises ValueError (mismatched pools, bad ids) or FileNotFoundError (the peer's pool is
        gone).
        """
        t0 = time.perf_counter()
        peer = open_kv_pool(request.source, self.runner.kv_pool.device)
        nbytes = copy_blocks(
            peer, self.runner.kv_pool, list(request.src_block_ids), list(request.dst_block_ids)
        )
        return worker_pb2.CopyBlocksResponse(num_bytes=nbytes, seconds=time.perf_counter() - t0)


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """`ExecuteStep`, `CopyBlocks` and `PrepareStructuredOutputs` over one `StepExecutor`.

    `broken` is set when a collective of a tensor-parallel step fails (a peer rank died or
    timed out): this rank's process group cannot recover, so `serve` exits with status 1 for
    the launcher or the orchestrator to restart the whole instance.
    """

    def __init__(self, executor: StepExecutor) -> None:
        self.executor = executor
        # The thread that loaded the model (compute_thread.py): steps are sequential, and
        # torch keeps its own intra-op threads.
        self._pool = compute_executor()
        self._compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.broken = asyncio.Event()
        # the last step handed to the compute thread, which runs them in that order
        self._last_started_step_id = 0
        self._started = asyncio.Condition()

    async def ExecuteStep(
        self, request: worker_pb2.StepRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StepResponse:
        """Runs one step. A step this worker refuses (a FieldError, or ValueError: positions
        or sequences its records do not have) ends INVALID_ARGUMENT, any other failure of a
        lone rank INTERNAL: the scheduler fails that step's requests and goes on
        (scheduler/faults.py). A failure of a tensor-parallel rank breaks its process group:
        UNAVAILABLE, and the worker exits."""
        loop = asyncio.get_running_loop()
        try:
            if request.previous_step_id:
                await self._wait_started(request.previous_step_id)
            step = loop.run_in_executor(self._pool, self.executor.execute, request)
            async with self._started:
                self._last_started_step_id = max(self._last_started_step_id, request.step_id)
                self._started.notify_all()
            return await step
        except RequestError as e:
            await abort(context, e)
        except ValueError as e:
            await abort(context, RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except Exception as e:
            if self.executor.runner.tp.world_size == 1:
                log.exception("step_failed", step_id=request.step_id)
                message = f"the worker failed the step: {type(e).__name__}: {e}"
                await abort(context, RequestError(grpc.StatusCode.INTERNAL, message[:500]))
            log.error("tensor_parallel_group_broken", error=str(e).strip()[:500])
            self.broken.set()
            await abort(
                context, RequestError(grpc.StatusCode.UNAVAILABLE, "tensor-parallel group broken")
            )

    async def _wait_started(self, previous_step_id: int) -> None:
        """Waits until step `previous_step_id` (or a later one: step ids only grow) has gone
        to the compute thread. Raises RequestError (INVALID_ARGUMENT) after
        PREVIOUS_STEP_WAIT_S: that step never came (the scheduler fails this one's requests)."""
        async with self._started:
            try:
                await asyncio.wait_for(
                    self._started.wait_for(lambda: self._last_started_step_id >= previous_step_id),
                    PREVIOUS_STEP_WAIT_S,
                )
            except TimeoutError:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"step {previous_step_id}, to run before this one, did not come within "
                    f"{PREVIOUS_STEP_WAIT_S:.0f} s",
                ) from None

    async def PrepareStructuredOutputs(
        self, request: inference_pb2.StructuredOutputs, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrepareStructuredOutputsResponse:
        loop = asyncio.get_running_loop()
        try:
            # A thread of its own: a compile never delays a step.
            _, seconds = await loop.run_in_executor(
                self._compile_pool, self.executor.grammars.compile, request
            )
        except ConstraintError as e:
            await abort(context, e)
        return worker_pb2.PrepareStructuredOutputsResponse(compile_seconds=seconds)

    async def CopyBlocks(
        self, request: worker_pb2.CopyBlocksRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CopyBlocksResponse:
        loop = asyncio.get_running_loop()
        try:
            # The same thread as the steps: a copy never overlaps a forward of this worker.
            return await loop.run_in_executor(self._pool, self.executor.copy_blocks, request)
        except ValueError as e:
            await abort(context, RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except (FileNotFoundError, ImportError, RuntimeError) as e:
            await abort(context, RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)))


@dataclass(slots=True)
class Placement:
    """Where this worker sits in the scheduler's layout: its worker group (0 unless prefill
    and decode are disaggregated), its tensor-parallel rank and the group's rank count."""

    worker_group: int = 0
    rank: int = 0
    tensor_parallel_size: int = 1


async def register(
    scheduler_address: str,
    advertise: str,
    runner: ModelRunner,
    model_id: str,
    placement: Placement | None = None,
    kv_pool: SharedKvPool | None = None,
    timeout_s: float = 60.0,
    worker_id: str = "",
) -> None:
    """Announces this worker to the scheduler, retrying until it answers or `timeout_s` passes.

    `worker_id` identifies this process across its registrations (the scheduler keeps a
    worker that registers again with the same id as it is, and takes a new id for a
    restarted worker).

    Raises grpc.aio.AioRpcError if the scheduler never answers, RegistrationRefused if it
    refuses the worker (a placement or model its configuration does not have).
    """
    placement = placement or Placement()
    request = scheduler_pb2.RegisterWorkerRequest(
        address=advertise,
        rank=placement.rank,
        model_id=model_id,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        worker_group=placement.worker_group,
        tensor_parallel_size=placement.tensor_parallel_size,
        kv_pool=kv_pool.handle if kv_pool is not None else None,
        worker_id=worker_id,
        batch_invariant=runner.batch_invariant,
        has_draft_model=runner.draft is not None,
        draft_reads_model_kv=runner.draft is not None and runner.draft.shares_kv,
    )
    options = [
        *channel_options(),
        ("grpc.max_reconnect_backoff_ms", REGISTER_MAX_RECONNECT_BACKOFF_MS),
    ]
    async with grpc.aio.insecure_channel(scheduler_address, options=options) as ch:
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        try:
            await stub.RegisterWorker(request, timeout=timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RegistrationRefused(
                    f"the scheduler refused this worker: {e.details()}"
                ) from e
            raise


async def watch_until_lost(scheduler_address: str) -> grpc.StatusCode | None:
    """Follows the scheduler's `grpc.health.v1` `Watch` stream (service "") until it breaks.

    Status updates, NOT_SERVING included, are not a loss: a scheduler without (all) its
    workers is NOT_SERVING and still holds this worker's registration. The stream has no
    deadline: it stays open as long as the scheduler process lives. Returns the status code
    the stream failed with (UNAVAILABLE when the scheduler process died or cannot be
    reached, CANCELLED when it stopped), or None if the scheduler ended it cleanly.
    """
    async with grpc.aio.insecure_channel(scheduler_address, options=channel_options()) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            async for _ in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return None


async def register_until_answered(
    register_once: Callable[[float], Awaitable[None]],
    attempt_s: float = REREGISTER_ATTEMPT_S,
) -> float:
    """Calls `register_once(timeout_s)` until the scheduler accepts it, however long that
    takes; returns the seconds it took.

    Each attempt waits up to `attempt_s` seconds for the scheduler (gRPC wait_for_ready);
    a failed attempt is retried (after a second if it failed at once), with a
    `scheduler_still_away` warning at most every `attempt_s` seconds. Raises
    RegistrationRefused at once (a configuration error: retrying cannot help).
    """
    start = last_log = time.monotonic()
    while True:
        attempt = time.monotonic()
        try:
            await register_once(attempt_s)
            return time.monotonic() - start
        except grpc.aio.AioRpcError as e:
            now = time.monotonic()
            if now - last_log >= attempt_s:
                log.warning("scheduler_still_away", waited_s=round(now - start), code=e.code().name)
                last_log = now
            if now - attempt < 1.0:
                await asyncio.sleep(1.0)


async def stay_registered(
    scheduler_address: str,
    register_once: Callable[[float], Awaitable[None]],
    attempt_s: float = REREGISTER_ATTEMPT_S,
    pause_s: float = REREGISTER_PAUSE_S,
) -> None:
    """Keeps a registered worker registered across scheduler restarts; runs until cancelled.

    A scheduler that restarts (crash, container or pod restart) comes back without workers
    and would stay NOT_SERVING. So this watches the scheduler (`watch_until_lost`); when the
    stream breaks it logs `scheduler_lost`, waits `pause_s` seconds, registers again with
    `register_once(timeout_s)` until the scheduler answers (`register_until_answered`,
    waiting indefinitely), logs `worker_reregistered` and watches again. Only a broken
    stream, never a NOT_SERVING update, leads to one; a stream that broke while the
    scheduler lived on (a network blip) is harmless: the registration carries the worker's
    id, and a scheduler that still holds that id keeps the worker (and its requests) as is.

    The worker's own health stays SERVING meanwhile: it is alive and ready for steps; the
    scheduler's and router's health say whether the replica can serve. (Orchestrators probe
    a worker's health for liveness: NOT_SERVING would get a healthy worker restarted and
    its model loaded again.)

    Raises RegistrationRefused if the new scheduler refuses the worker (started with another
    layout or model): logged as `reregistration_refused`; `serve` then exits (status 2).
    Returns, with a warning, if the scheduler has no health service to watch.
    """
    while True:
        code = await watch_until_lost(scheduler_address)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            log.warning("scheduler_not_watched", scheduler=scheduler_address,
                        reason="no grpc.health.v1 Watch on the scheduler")  # fmt: skip
            return
        log.warning(
            "scheduler_lost",
            scheduler=scheduler_address,
            code=code.name if code is not None else "OK",
        )
        await asyncio.sleep(pause_s)
        try:
            waited_s = await register_until_answered(register_once, attempt_s)
        except RegistrationRefused as e:
            log.error("reregistration_refused", scheduler=scheduler_address, error=str(e))
            raise
        log.info("worker_reregistered", scheduler=scheduler_address, waited_s=round(waited_s, 1))


async def serve(
    config: WorkerConfig,
    runner: ModelRunner,
    model_id: str,
    kv_pool: SharedKvPool | None = None,
) -> None:
    """Serves steps on `config.listen` and registers with the scheduler at `config.scheduler`
    as `config.advertise` (default: the bound address), in the place `config.worker_group`,
    `config.rank` and `config.tensor_parallel_size` say; runs until SIGINT/SIGTERM.

    Registers again whenever the scheduler restarts (`stay_registered`). Raises
    SchedulerUnreachable if the scheduler does not take the first registration within
    FIRST_REGISTRATION_TIMEOUT_S (the CLI exits 1), RegistrationRefused if it refuses a registration (first or later; the CLI exits
    with status 2), SystemExit(1) when a tensor-parallel collective broke.
    Prometheus metrics on `config.metrics_host:config.metrics_port` unless the port is -1
    (OSError if it is taken). `kv_pool` is the shared pool the runner uses, when it is
    shared (its handle goes to the scheduler; it is closed on the way out).
    """
    address, scheduler_address, advertise = config.listen, config.scheduler, config.advertise
    placement = Placement(config.worker_group, config.rank, config.tensor_parallel_size)
    metrics_port = port_or_none(config.metrics_port)
    if metrics_port is not None:
        from prometheus_client import REGISTRY

        from sluiceway.metrics import serve_metrics
        from sluiceway.worker.metrics import WorkerCollector, init_series

        REGISTRY.register(WorkerCollector(runner, model_id))
        init_series(model_id)
        serve_metrics(metrics_port, config.metrics_host)
    server, health = new_server(max_message_bytes=WORKER_MAX_MESSAGE_BYTES)
    executor = StepExecutor(runner, model_id)
    service = WorkerService(executor)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    bound = bind(server, address)
    await server.start()

    worker_id = uuid.uuid4().hex

    async def register_once(timeout_s: float) -> None:
        await register(
            scheduler_address,
            advertise or bound,
            runner,
            model_id,
            placement,
            kv_pool,
            timeout_s,
            worker_id,
        )

    try:
        await register_once(FIRST_REGISTRATION_TIMEOUT_S)
    except BaseException as e:
        await server.stop(None)
        if kv_pool is not None:
            kv_pool.close()
        if isinstance(e, grpc.aio.AioRpcError):
            raise SchedulerUnreachable(
                f"the scheduler at {scheduler_address} did not accept the registration "
                f"within {FIRST_REGISTRATION_TIMEOUT_S:.0f} s ({e.code().name}: {e.details()}); "
                "is --scheduler right, and is the scheduler running?"
            ) from None
        raise
    stop = asyncio.Event()
    on_shutdown_signal(stop.set)  # before saying so: a signal from then on stops it cleanly
    await health.set("", SERVING)
    log.info(
        "worker_ready",
        address=bound,
        model_id=model_id,
        num_kv_blocks=runner.num_kv_blocks,
        dtype=str(runner.dtype),
    )
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(service.broken.wait())]
    watcher = asyncio.create_task(stay_registered(scheduler_address, register_once))
    done, _ = await asyncio.wait([*waits, watcher], return_when=asyncio.FIRST_COMPLETED)
    if watcher in done and watcher.exception() is None:  # nothing to watch: serve on
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    # The watcher fails on a refused re-registration (or a bug): the worker stops then.
    failure = watcher.exception() if watcher.done() else None
    for task in [*waits, watcher]:
        task.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    log.info("worker_stopping", broken=service.broken.is_set(), failed=failure is not None)
    await server.stop(grace=1.0)
    if kv_pool is not None:
        kv_pool.close()
    if failure is not None:
        raise failure
    if service.broken.is_set():
        raise SystemExit(1)
