"""The scheduler process: the `Scheduler` gRPC service over one `Engine`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from sluiceway.grpc_server import (
    REQUEST_ID_METADATA,
    bind,
    new_server,
    on_shutdown_signal,
    set_health,
)
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.options import port_or_none
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.engine import Engine
from sluiceway.scheduler.kv_events import KvEventPublisher, run_publisher
from sluiceway.scheduler.metrics import REQUESTS_RECEIVED, init_series
from sluiceway.scheduler.registration import RegistrationError
from sluiceway.scheduler.worker_group import WorkerInfo
from sluiceway.status import RequestError, abort
from sluiceway.v1 import inference_pb2

log = structlog.get_logger("scheduler")


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    """gRPC face of the engine: AddRequest streams, info, worker registration, KV events."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kv_events = KvEventPublisher(
            lambda: [
                g.scheduler.block_manager if g.scheduler is not None else None
                for g in engine.groups
            ],
            lambda: engine.block_size,
        )

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
            seq = await self.engine.add_request(request)
        except RequestError as e:
            rlog.warning("request_rejected", code=e.code.name, error=e.details)
            await abort(context, e)
        REQUESTS_RECEIVED.labels(self.engine.model_id).inc()
        rlog.info(
            "request_added",
            seq_id=seq.seq_id,
            prompt_tokens=len(seq.prompt_token_ids),
            max_tokens=seq.sampling.max_tokens,
        )
        stream = self.engine.stream(seq)
        try:
            async for event in stream:
                yield event
        except RequestError as e:
            await abort(context, e)
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
        if engine.max_model_len == 0:
            return scheduler_pb2.SchedulerInfo(ready=False)
        st = engine.stats()
        reply = scheduler_pb2.SchedulerInfo(
            ready=engine.ready,
            model_id=engine.model_id,
            max_model_len=engine.max_model_len,
            block_size=engine.block_size,
            num_kv_blocks=st.num_kv_blocks,
            num_free_kv_blocks=st.num_free_kv_blocks,
            num_requests_running=st.num_running,
            num_requests_waiting=st.num_waiting,
            vocab_size=engine.vocab_size,
            kv_cache=scheduler_pb2.KvCacheStats(
                utilization=st.utilization,
                tokens_stored_total=st.tokens_stored_total,
                slots_allocated_total=st.slots_allocated_total,
                prefix_cache_queries_total=st.prefix_cache_queries_total,
                prefix_cache_hits_total=st.prefix_cache_hits_total,
                num_preemptions_total=st.num_preemptions_total,
                spec_decode_num_drafts_total=st.spec_decode.num_drafts,
                spec_decode_num_draft_tokens_total=st.spec_decode.num_draft_tokens,
                spec_decode_num_accepted_tokens_total=st.spec_decode.num_accepted_tokens,
            ),
            step_times=engine.step_times.to_proto(),
        )
        reply.step_times.num_step_loops = len(engine.groups)
        return reply

    async def SubscribeKvEvents(
        self, request: scheduler_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.KvEvents]:
        """A snapshot of the prefix cache's block hashes, then their changes, until the
        client goes away (scheduler/kv_events.py). RESOURCE_EXHAUSTED for a client that
        reads too slowly (it subscribes again and gets a new snapshot)."""
        queue = self.kv_events.subscribe()
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                else:
                    yield item
        finally:
            self.kv_events.unsubscribe(queue)

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerResponse:
        if request.num_kv_blocks == 0 or request.block_size == 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "num_kv_blocks and block_size must be > 0"
            )
        info = WorkerInfo(
            address=request.address,
            rank=request.rank,
            model_id=request.model_id,
            num_kv_blocks=request.num_kv_blocks,
            block_size=request.block_size,
            max_model_len=request.max_model_len,
            vocab_size=request.vocab_size,
            worker_group=request.worker_group,
            tensor_parallel_size=request.tensor_parallel_size or 1,
            kv_pool=request.kv_pool if request.HasField("kv_pool") else None,
            worker_id=request.worker_id,
            batch_invariant=request.batch_invariant,
            has_draft_model=request.has_draft_model,
            draft_reads_model_kv=request.draft_reads_model_kv,
        )
        try:
            max_model_len = await self.engine.register_worker(info)
        except RegistrationError as e:
            log.error("worker_refused", address=request.address, error=str(e))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        init_series(info.model_id)  # every worker serves the same model (register_worker)
        return scheduler_pb2.RegisterWorkerResponse(max_model_len=max_model_len)


async def serve(config: SchedulerConfig) -> None:
    """Runs the scheduler on `config.listen` until SIGINT/SIGTERM; serves Prometheus metrics
    on `config.metrics_host:config.metrics_port` unless the port is -1. Raises OSError if it
    is taken."""
    engine = Engine(config)
    metrics_port = port_or_none(config.metrics_port)
    if metrics_port is not None:
        from prometheus_client import REGISTRY

        from sluiceway.metrics import serve_metrics
        from sluiceway.scheduler.metrics import SchedulerCollector

        REGISTRY.register(SchedulerCollector(engine))
        serve_metrics(metrics_port, config.metrics_host)
    server, health = new_server()
    service = SchedulerService(engine)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(service, server)
    bound = bind(server, config.listen)
    await server.start()
    engine.start()
    stop = asyncio.Event()
    on_shutdown_signal(stop.set)  # before saying so: a signal from then on stops it cleanly
    log.info("scheduler_listening", address=bound)

    async def follow_readiness(poll_s: float = 0.1) -> None:
        """SERVING while a worker is registered and has not failed, else NOT_SERVING."""
        serving: bool | None = None
        while True:
            if engine.ready != serving:
                serving = engine.ready
                await set_health(health, ["", "sluiceway.internal.v1.Scheduler"], serving)
            await asyncio.sleep(poll_s)

    ready_task = asyncio.create_task(follow_readiness())
    kv_events_task = asyncio.create_task(run_publisher(service.kv_events))
    await stop.wait()
    ready_task.cancel()
    kv_events_task.cancel()
    log.info("scheduler_stopping")
    await server.stop(grace=1.0)
    await engine.stop()
