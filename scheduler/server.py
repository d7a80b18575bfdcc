"""The scheduler process: the `Scheduler` gRPC service over one `Engine`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine, NotReady, QueueFull, WorkerInfo, WorkerUnavailable
from sluiceway.grpc_server import (
    REQUEST_ID_METADATA,
    bind,
    new_server,
    on_shutdown_signal,
    set_health,
)
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.v1 import inference_pb2

log = structlog.get_logger("scheduler")


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """gRPC face of the engine: AddRequest streams, info, worker registration."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def AddRequest(
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        metadata = dict(context.invocation_metadata() or ())
        traced = metadata.get(REQUEST_ID_METADATA)
        request_id = (
            traced.decode(errors="replace") if isinstance(traced, bytes) else request.request_id
        )
        rlog = log.bind(request_id=request_id)
        try:
            seq = self.engine.new_sequence(request)
        except NotReady as e:
            rlog.warning("request_rejected", code="UNAVAILABLE", error=str(e))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except QueueFull as e:
            rlog.warning("request_rejected", code="RESOURCE_EXHAUSTED", error=str(e))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            rlog.warning("request_rejected", code="INVALID_ARGUMENT", error=str(e))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rlog.info(
            "request_added",
            seq_id=seq.seq_id,
            prompt_tokens=len(seq.prompt_token_ids),
            max_tokens=seq.max_tokens,
        )
        stream = self.engine.stream(seq)
        try:
            async for event in stream:
                yield event
        except WorkerUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            await stream.aclose()  # on cancel: aborts the sequence, frees its blocks
            rlog.info(
                "request_done",
                seq_id=seq.seq_id,
                completion_tokens=len(seq.output_token_ids),
                finish_reason=inference_pb2.FinishReason.Name(seq.finish_reason),
                num_preemptions=seq.num_preemptions,
            )

    async def GetSchedulerInfo(
        self, request: scheduler_pb2.GetSchedulerInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        engine = self.engine
        sched, worker = engine.scheduler, engine.worker
        if sched is None or worker is None:
            return scheduler_pb2.SchedulerInfo(ready=False)
        return scheduler_pb2.SchedulerInfo(
            ready=engine.ready,
            model_id=worker.model_id,
            max_model_len=sched.max_model_len,
            block_size=sched.block_manager.block_size,
            num_kv_blocks=sched.block_manager.num_blocks,
            num_free_kv_blocks=sched.block_manager.num_free_blocks,
            num_requests_running=len(sched.running),
            num_requests_waiting=len(sched.waiting),
            vocab_size=worker.vocab_size,
            kv_cache=scheduler_pb2.KvCacheStats(
                utilization=sched.kv_usage.utilization,
                tokens_stored_total=sched.kv_usage.tokens_stored_total,
                slots_allocated_total=sched.kv_usage.slots_allocated_total,
                prefix_cache_queries_total=sched.block_manager.prefix_cache_queries,
                prefix_cache_hits_total=sched.block_manager.prefix_cache_hits,
                num_preemptions_total=sched.num_preemptions,
            ),
            step_times=self.engine.step_times.to_proto(),
        )

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        if request.num_kv_blocks == 0 or request.block_size == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "num_kv_blocks and block_size must be > 0"
            )
        max_model_len = await self.engine.register_worker(
            WorkerInfo(
                address=request.address,
                rank=request.rank,
                model_id=request.model_id,
                num_kv_blocks=request.num_kv_blocks,
                block_size=request.block_size,
                max_model_len=request.max_model_len,
                vocab_size=request.vocab_size,
            )
        )
        return scheduler_pb2.RegisterWorkerResponse(max_model_len=max_model_len)


async def serve(
    address: str,
    config: SchedulerConfig,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> None:
    """Runs the scheduler on `address` until SIGINT/SIGTERM; serves Prometheus metrics on
    `metrics_host:metrics_port` unless the port is None. Raises OSError if it is taken."""
    engine = Engine(config)
    if metrics_port is not None:
        from prometheus_client import REGISTRY

        from scheduler.metrics import SchedulerCollector
        from sluiceway.metrics import serve_metrics

        REGISTRY.register(SchedulerCollector(engine))
        serve_metrics(metrics_port, metrics_host)
    server, health = new_server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(engine), server)
    bound = bind(server, address)
    await server.start()
    engine.start()
    log.info("scheduler_listening", address=bound)
    stop = asyncio.Event()
    on_shutdown_signal(stop.set)

    async def follow_readiness(poll_s: float = 0.1) -> None:
        """SERVING while a worker is registered and has not failed, else NOT_SERVING."""
        serving: bool | None = None
        while True:
            if engine.ready != serving:
                serving = engine.ready
                await set_health(health, ["", "sluiceway.internal.v1.Scheduler"], serving)
            await asyncio.sleep(poll_s)

    ready_task = asyncio.create_task(follow_readiness())
    await stop.wait()
    ready_task.cancel()
    log.info("scheduler_stopping")
    await server.stop(grace=1.0)
    await engine.stop()
