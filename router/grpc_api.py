"""The gRPC front of the router: the public `sluiceway.v1.Inference` service over the
`RequestPath`, with the standard health service and server reflection."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health

from sluiceway.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, bind, new_server, set_health
from sluiceway.reflection import enable_server_reflection
from sluiceway.router.auth import ApiKeyInterceptor, ApiKeys
from sluiceway.router.handlers import MalformedRequest, add_inference_servicer
from sluiceway.router.metrics import REQUEST_FAILURE
from sluiceway.router.request_path import RequestPath
from sluiceway.status import FieldError, RequestError, abort
from sluiceway.v1 import inference_pb2, inference_pb2_grpc

__all__ = ["InferenceServicer", "Router", "start_router", "watch_scheduler"]

log = structlog.get_logger("router")

# A stream cancelled with less than this left before its deadline ended by the deadline:
# the cancellation reaches the handler a little before the deadline itself.
DEADLINE_SLACK_S = 0.1


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Generate / Tokenize / GetModelInfo: the gRPC face of one `RequestPath`. A failure ends
    the call with its status (sluiceway.status.abort: the field as data when it names one)."""

    def __init__(self, path: RequestPath) -> None:
        self.path = path

    def on_malformed_request(self, method: str, request: MalformedRequest) -> None:
        """A request whose bytes are not a valid message (it gets INVALID_ARGUMENT before
        reaching the method; router/handlers.py): logged, and a failed `Generate` counted
        as every other invalid one is."""
        code = grpc.StatusCode.INVALID_ARGUMENT.name
        if method == "Generate":
            limits = self.path.limits
            model = limits.model_id if limits is not None else ""
            REQUEST_FAILURE.labels(model, code, "grpc").inc()
        log.warning("request_failed", method=method, code=code, error=request.details)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        arrival = time.monotonic()
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"

        # The client left, or its deadline passed: the task is cancelled, or (cancelled while
        # the handler in router/handlers.py waited at a yield) the generator is closed.
        def cancel_code() -> grpc.StatusCode:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= DEADLINE_SLACK_S:
                return grpc.StatusCode.DEADLINE_EXCEEDED
            return grpc.StatusCode.CANCELLED

        try:
            async with contextlib.aclosing(
                self.path.generate(request, request_id, arrival=arrival, cancel_code=cancel_code)
            ) as responses:
                async for response in responses:
                    yield response
        except RequestError as e:
            await abort(context, e)

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        try:
            ids = await asyncio.to_thread(self.path.prompt_token_ids, request)
        except FieldError as e:
            await abort(context, e)
        return inference_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ModelInfo:
        try:
            return await self.path.model_info()
        except RequestError as e:
            await abort(context, e)


async def watch_scheduler(
    path: RequestPath,
    health_servicer: health.aio.HealthServicer,
    names: list[str],
    poll_s: float = 0.5,
) -> None:
    """Keeps the router's health in step with its schedulers: SERVING while at least one
    answers ready (and the router is not draining), NOT_SERVING otherwise.

    Polls every scheduler every `poll_s` seconds, and at once when a request saw one fail.
    """
    serving: bool | None = None
    while True:
        ready = await path.scheduler_ready(timeout_s=max(poll_s, 1.0))
        now_serving = ready and not path.draining
        if now_serving != serving:
            await set_health(health_servicer, names, now_serving)
            if now_serving:
                assert path.limits is not None
                log.info(
                    "router_ready",
                    model_id=path.limits.model_id,
                    max_model_len=path.limits.max_model_len,
                    schedulers=[r.address for r in path.pool.ready_replicas()],
                )
            elif serving is not None and not path.draining:
                log.warning("no_scheduler_ready", schedulers=path.pool.addresses)
            serving = now_serving
        await path.pool.wait_changed(poll_s)


@dataclass
class Router:
    """A started gRPC front: its server, request path and health watcher."""

    server: grpc.aio.Server
    path: RequestPath
    health: health.aio.HealthServicer
    names: list[str]  # the health service names it sets ("" and the Inference service)
    address: str  # as bound (a free port resolved)
    watcher: asyncio.Task[None]

    async def stop(self, grace: float | None = None) -> None:
        """Stops the watcher and the server, then closes the scheduler channels."""
        self.watcher.cancel()
        await self.server.stop(grace)
        await self.path.close()


async def start_router(
    path: RequestPath,
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    poll_s: float = 0.5,
    api_keys: ApiKeys | None = None,
    credentials: grpc.ServerCredentials | None = None,
    internal_address: str | None = None,
) -> Router:
    """Serves `path` (with health and reflection) on `address`; health NOT_SERVING until
    the watcher (polling every `poll_s` seconds) sees a scheduler ready.

    `api_keys`: every call but health and reflection needs one (UNAUTHENTICATED otherwise;
    router/auth.py). `credentials`: TLS on `address`. `internal_address` (unix:PATH): the same
    services there too, without TLS (keys still checked): `serve`'s readiness probe.

    Raises BindError when an address cannot be bound."""
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys is not None else []
    server, health_servicer = new_server(max_message_bytes, interceptors)
    servicer = InferenceServicer(path)
    # not inference_pb2_grpc.add_InferenceServicer_to_server: undecodable bytes must get
    # INVALID_ARGUMENT, not UNKNOWN
    add_inference_servicer(servicer, server, on_malformed=servicer.on_malformed_request)
    service_name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    enable_server_reflection([service_name, "grpc.health.v1.Health"], server)
    bound = bind(server, address, credentials)
    if internal_address is not None:
        bind(server, internal_address)
    names = ["", service_name]
    await set_health(health_servicer, names, serving=False)
    await server.start()
    path.pool.start_kv_events()
    watcher = asyncio.create_task(watch_scheduler(path, health_servicer, names, poll_s))
    return Router(server, path, health_servicer, names, bound, watcher)
