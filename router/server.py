"""The router process: the public `sluiceway.v1.Inference` service.

Stateless: tokenizes, validates, forwards token ids to a scheduler, and turns
the token stream that comes back into text deltas. Any number of routers can
serve the same schedulers; a router given several schedulers (model replicas)
spreads its requests over them (router/balancer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health

from sluiceway.grpc_server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    REQUEST_ID_METADATA,
    bind,
    new_server,
    on_shutdown_signal,
    set_health,
)
from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.options import port_or_none
from sluiceway.reflection import enable_server_reflection
from sluiceway.router.balancer import (
    ModelLimits,
    SchedulerPool,
    SchedulerReplica,
    merge_scheduler_infos,
)
from sluiceway.router.config import RouterConfig
from sluiceway.router.detokenizer import IncrementalDetokenizer
from sluiceway.router.errors import InvalidRequest, client_details
from sluiceway.router.handlers import MalformedRequest, add_inference_servicer
from sluiceway.router.metrics import FINISHED_REASONS, REQUEST_FAILURE, Protocol, RequestRecorder
from sluiceway.router.streams import merge_streams
from sluiceway.router.tokenizer import encode_chat, encode_prompt, load_tokenizer
from sluiceway.router.validation import (
    ResolvedSampling,
    resolve_request,
    validate_prompt_token_ids,
    validate_request_id,
)
from sluiceway.v1 import inference_pb2, inference_pb2_grpc

log = structlog.get_logger("router")

UNSPECIFIED = inference_pb2.FINISH_REASON_UNSPECIFIED
# A stream cancelled with less than this left before its deadline ended by the deadline:
# the cancellation reaches the handler a little before the deadline itself.
DEADLINE_SLACK_S = 0.1


class RequestFailed(Exception):
    """A generation that ends with a status instead of (more) responses.

    Attributes:
        code: the gRPC status (the HTTP front maps it: router/openai_api.py).
        details: what went wrong, for the client ("field: message" for INVALID_ARGUMENT).
        field: the request field at fault (INVALID_ARGUMENT from validation), else None.
    """

    def __init__(self, code: grpc.StatusCode, details: str, field: str | None = None) -> None:
        super().__init__(code, details)
        self.code = code
        self.details = details
        self.field = field


def eos_token_ids(tokenizer, model_dir: Path) -> list[int]:  # type: ignore[no-untyped-def]
    """EOS ids from generation_config.json (a list or an int), else the tokenizer's EOS."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Generate / Tokenize / GetModelInfo over one scheduler or several.

    With several, each `Generate` goes to the scheduler `SchedulerPool.pick`
    chooses (where most of the prompt is cached, else least outstanding requests). A scheduler
    that fails a stream with UNAVAILABLE gets no new requests until the health
    watcher sees it ready again, and each of its streams goes on once on
    another ready scheduler: resubmitted with the tokens already received as
    `output_token_ids`, so the client sees no lost and no repeated token (and,
    with deterministic inference, the tokens the failed one would have made).
    """

    def __init__(  # type: ignore[no-untyped-def]
        self,
        tokenizer,
        model_dir: Path,
        scheduler_addresses: str | Sequence[str],
        **pool_options: Any,
    ) -> None:
        """`scheduler_addresses`: one address, a comma-separated string or a list;
        `pool_options`: `SchedulerPool`'s routing thresholds."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(tokenizer, model_dir)
        self.pool = SchedulerPool(scheduler_addresses, **pool_options)
        self.detokenize_seconds_total = 0.0  # seconds in IncrementalDetokenizer.add_tokens
        self.draining = False  # set on SIGTERM: new streams get UNAVAILABLE
        self.num_in_flight = 0  # Generate streams forwarded to the scheduler, not yet ended
        self.detokenized_tokens_total = 0

    @property
    def limits(self) -> ModelLimits | None:
        """The model's limits, once a scheduler has been ready (see `SchedulerPool.limits`)."""
        return self.pool.limits

    async def scheduler_ready(self, timeout_s: float) -> bool:
        """Asks every scheduler whether its workers have registered; caches the model limits.

        True when at least one answers ready within `timeout_s` seconds.
        """
        return await self.pool.refresh(timeout_s)

    async def close(self) -> None:
        await self.pool.close()

    def _prompt_token_ids(
        self, request: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest
    ) -> list[int]:
        """Token ids of the request's `input` oneof. Raises InvalidRequest when it is unset."""
        which = request.WhichOneof("input")
        if which == "prompt":
            return encode_prompt(self.tokenizer, request.prompt)
        if which == "messages":
            return encode_chat(
                self.tokenizer, [(m.role, m.content) for m in request.messages.messages]
            )
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)  # type: ignore[union-attr]
        names = ", ".join(f.name for f in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise InvalidRequest("input", f"set one of {names}")

    def on_malformed_request(self, method: str, request: MalformedRequest) -> None:
        """A request whose bytes are not a valid message (it gets INVALID_ARGUMENT before
        reaching the method; router/handlers.py): logged, and a failed `Generate` counted
        as every other invalid one is."""
        code = grpc.StatusCode.INVALID_ARGUMENT.name
        if method == "Generate":
            limits = self.limits
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
                self.generate(request, request_id, arrival=arrival, cancel_code=cancel_code)
            ) as responses:
                async for response in responses:
                    yield response
        except RequestFailed as e:
            await context.abort(e.code, e.details)

    async def generate(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        *,
        arrival: float,
        protocol: Protocol = "grpc",
        cancel_code: Callable[[], grpc.StatusCode] = lambda: grpc.StatusCode.CANCELLED,
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """The one path of a generation, for every front (gRPC here, HTTP in
        router/openai_api.py): validation, tokenization, the scheduler streams, detokenization
        and stop strings, the retry on another replica, metrics and logs.

        A request with ``sampling.n`` > 1 is n samples, each a scheduler stream of its own on
        one replica (they share the prompt's KV blocks there, scheduler/scheduler.py), their
        responses merged as they come and told apart by ``index``; each counts as a request in
        the metrics (as vLLM counts them). `arrival` is ``time.monotonic()`` at the request's
        arrival; `protocol` the metrics' label; `cancel_code` names the status a cancelled
        stream ends with (counted and logged).

        Raises:
            RequestFailed: the request ends with a status instead of (more) responses
                (INVALID_ARGUMENT with the field named, UNAVAILABLE, RESOURCE_EXHAUSTED, ...);
                already counted and logged. A failure of one sample ends them all.

        Closing the generator (a client gone) cancels the scheduler streams, which frees the
        request's KV blocks.
        """
        limits = self.limits
        rlog = log.bind(request_id=request_id, protocol=protocol)
        recorder = RequestRecorder(limits.model_id if limits else "", arrival, protocol)

        def fail(code: grpc.StatusCode, details: str, field: str | None = None) -> RequestFailed:
            recorder.on_failure(code.name)
            rlog.warning("request_failed", code=code.name, error=details)
            return RequestFailed(code, details, field)

        if self.draining:
            raise fail(grpc.StatusCode.UNAVAILABLE, "router is draining; retry another router")
        if limits is None:
            raise fail(grpc.StatusCode.UNAVAILABLE, "no scheduler is ready yet")
        try:
            validate_request_id(request.request_id)
            # a thread: tokenizing a megabyte prompt takes seconds; other streams go on
            prompt_ids = await asyncio.to_thread(self._prompt_token_ids, request)
            validate_prompt_token_ids(prompt_ids, limits.vocab_size, limits.max_model_len)
            resolved = resolve_request(
                request.sampling,
                prompt_len=len(prompt_ids),
                max_model_len=limits.max_model_len,
                vocab_size=limits.vocab_size,
                eos_token_ids=[] if request.sampling.ignore_eos else self.eos_token_ids,
            )
        except InvalidRequest as e:
            raise fail(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        except asyncio.CancelledError:
            recorder.on_failure(cancel_code().name)
            raise
        replica = self.pool.pick(prompt_ids)
        if replica is None:
            raise fail(grpc.StatusCode.UNAVAILABLE, "no scheduler is ready")
        n = resolved.n
        # unique, unlike a client's request_id, which two live requests may share
        parent_request_id = f"{request_id}/{uuid.uuid4().hex}" if n > 1 else None
        samples = [
            _Sample(
                self,
                index=i,
                request_id=request_id,
                prompt_ids=prompt_ids,
                resolved=resolved,
                rlog=rlog if n == 1 else rlog.bind(index=i),
                recorder=recorder
                if i == 0
                else RequestRecorder(recorder.model_name, arrival, protocol),
                cancel_code=cancel_code,
                parent_request_id=parent_request_id,
            ).responses(replica)
            for i in range(n)
        ]
        self.num_in_flight += 1
        try:
            merged = samples[0] if n == 1 else merge_streams(samples)
            async with contextlib.aclosing(merged) as responses:
                async for response in responses:
                    yield response
        finally:
            self.num_in_flight -= 1

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        try:
            ids = await asyncio.to_thread(self._prompt_token_ids, request)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return inference_pb2.TokenizeResponse(token_ids=ids)

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ModelInfo:
        """Model facts from the first ready scheduler (in `--scheduler` order); KV pool sizes
        and every `_total` counter summed over the ready schedulers, `kv_cache_utilization`
        their mean weighted by blocks in use (`merge_scheduler_infos`). With one scheduler:
        its own figures. The detokenization step times are this router's."""
        targets = self.pool.ready_replicas() or self.pool.replicas
        answers = await asyncio.gather(
            *(
                r.stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=5.0)
                for r in targets
            ),
            return_exceptions=True,
        )
        infos: list[scheduler_pb2.SchedulerInfo] = []
        errors: list[str] = []  # as one scheduler's router has always said them
        for answer in answers:
            if isinstance(answer, scheduler_pb2.SchedulerInfo):
                if answer.ready:
                    infos.append(answer)
                else:
                    errors.append("scheduler not ready")
            elif isinstance(answer, grpc.aio.AioRpcError):
                errors.append(f"scheduler: {client_details(answer)}")
            else:
                raise answer
        if not infos:
            if len(targets) == 1:
                await context.abort(grpc.StatusCode.UNAVAILABLE, errors[0])
            reasons = "; ".join(  # by index: addresses are internal
                f"scheduler {self.pool.replicas.index(r)}: {e.removeprefix('scheduler: ')}"
                for r, e in zip(targets, errors, strict=True)
            )
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"no scheduler is ready ({reasons})")
        info = merge_scheduler_infos(infos)
        reply = inference_pb2.ModelInfo(
            model_id=info.model_id,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=self.eos_token_ids,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            num_free_kv_blocks=info.num_free_kv_blocks,
            kv_cache_utilization=info.kv_cache.utilization,
            kv_cache_tokens_stored_total=info.kv_cache.tokens_stored_total,
            kv_cache_slots_allocated_total=info.kv_cache.slots_allocated_total,
            prefix_cache_queries_total=info.kv_cache.prefix_cache_queries_total,
            prefix_cache_hits_total=info.kv_cache.prefix_cache_hits_total,
            num_preemptions_total=info.kv_cache.num_preemptions_total,
            step_times=info.step_times,
        )
        reply.step_times.detokenize_seconds_total = self.detokenize_seconds_total
        reply.step_times.detokenized_tokens_total = self.detokenized_tokens_total
        return reply


class _Sample:
    """One of a request's ``n`` samples: its scheduler stream, detokenizer, metrics and logs.

    Sample ``i`` of a seeded request uses ``seed + i`` (mod 2**64, vLLM's convention); with
    ``n`` > 1 its scheduler request id is ``<request_id>-<i>`` and its ``parent_request_id``
    one the router makes unique per request (clients may reuse a request_id), so that the
    scheduler shares the prompt's blocks between the samples.
    """

    def __init__(
        self,
        service: InferenceService,
        *,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        resolved: ResolvedSampling,
        rlog: structlog.typing.FilteringBoundLogger,
        recorder: RequestRecorder,
        cancel_code: Callable[[], grpc.StatusCode],
        parent_request_id: str | None,
    ) -> None:
        self.service = service
        self.index = index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.resolved = resolved
        self.rlog = rlog
        self.recorder = recorder
        self.cancel_code = cancel_code
        self.parent_request_id = parent_request_id
        self.finished = False

    def _add_request(self) -> scheduler_pb2.AddRequestRequest:
        resolved = self.resolved
        add_request = scheduler_pb2.AddRequestRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids,
            sampling=resolved.sampling,
            max_tokens=resolved.max_tokens,
            stop_token_ids=resolved.stop_token_ids,
            min_tokens=resolved.min_tokens,
        )
        if self.parent_request_id is not None:  # one of n > 1 samples
            add_request.request_id = f"{self.request_id}-{self.index}"
            add_request.parent_request_id = self.parent_request_id
            if self.index and add_request.sampling.HasField("seed"):
                add_request.sampling.seed = (add_request.sampling.seed + self.index) % (1 << 64)
        return add_request

    def _fail(self, code: grpc.StatusCode, details: str, field: str | None = None) -> RequestFailed:
        self.finished = True
        self.recorder.on_failure(code.name)
        self.rlog.warning("request_failed", code=code.name, error=details)
        return RequestFailed(code, details, field)

    async def responses(
        self, replica: SchedulerReplica
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """This sample's responses from `replica`; if it becomes unavailable, from another
        one, resumed after the tokens already received (once). Raises RequestFailed."""
        try:
            async for response in self._responses(replica):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            if not self.finished:
                code = self.cancel_code()
                self.recorder.on_failure(code.name)
                self.rlog.info(
                    "request_cancelled",
                    code=code.name,
                    completion_tokens=self.recorder.num_generated,
                )
            raise

    async def _responses(
        self, replica: SchedulerReplica
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        service, pool, recorder, rlog = self.service, self.service.pool, self.recorder, self.rlog
        resolved, prompt_ids = self.resolved, self.prompt_ids
        detok = IncrementalDetokenizer(
            service.tokenizer,
            prompt_ids,
            resolved.stop,
            skip_special_tokens=resolved.skip_special_tokens,
            include_stop_str_in_output=resolved.include_stop_str_in_output,
            min_tokens=resolved.min_tokens,
        )
        add_request = self._add_request()
        tried: list[SchedulerReplica] = []
        received: list[int] = []  # token ids this sample got, from every replica tried
        while True:
            current = replica
            tried.append(current)
            pool.begin(current)
            call = current.stub.AddRequest(
                add_request, metadata=((REQUEST_ID_METADATA, add_request.request_id.encode()),)
            )
            try:
                async for event in call:
                    received.extend(event.token_ids)
                    recorder.on_tokens(len(event.token_ids), time.monotonic())
                    if event.HasField("queue_seconds"):
                        recorder.on_queue_time(event.queue_seconds)
                    t0 = time.perf_counter()
                    new_ids = list(event.token_ids)
                    if (
                        event.finish_reason == inference_pb2.FINISH_REASON_STOP
                        and not resolved.include_stop_str_in_output
                    ):
                        new_ids = new_ids[:-1]  # a stop token id (EOS): its text is not output
                    text = detok.add_tokens(new_ids)
                    service.detokenize_seconds_total += time.perf_counter() - t0
                    service.detokenized_tokens_total += len(event.token_ids)
                    finish = (
                        inference_pb2.FINISH_REASON_STOP if detok.stopped else event.finish_reason
                    )
                    response = inference_pb2.GenerateResponse(
                        request_id=self.request_id,
                        token_ids=event.token_ids,
                        finish_reason=finish,
                        logprobs=event.logprobs,
                        index=self.index,
                    )
                    if finish != UNSPECIFIED:
                        if not detok.stopped:
                            text += detok.flush()
                        response.usage.prompt_tokens = len(prompt_ids)
                        response.usage.completion_tokens = recorder.num_generated
                        self.finished = True
                    response.text = text
                    yield response
                    if finish != UNSPECIFIED:
                        reason = FINISHED_REASONS.get(finish, "abort")
                        recorder.on_success(reason, len(prompt_ids))
                        rlog.info(
                            "request_finished",
                            prompt_tokens=len(prompt_ids),
                            completion_tokens=recorder.num_generated,
                            ttft_s=round(recorder.ttft, 6),
                            e2e_s=round(recorder.e2e, 6),
                            finish_reason=reason,
                            scheduler=current.address,
                        )
                        return
            except grpc.aio.AioRpcError as e:
                raw = f"{e.code().name}: {e.details()}"
                details = client_details(e)
                if details != e.details():  # transport text: for the log only
                    rlog.warning("scheduler_call_failed", scheduler=current.address, error=raw)
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    pool.mark_unavailable(current, raw)
                    retry = None if len(tried) > 1 else pool.pick(prompt_ids, tried)
                    if retry is not None:
                        # Resumed after the tokens already sent, as a preempted sequence is:
                        # with deterministic inference the continuation is the one the failed
                        # replica would have made; nothing is lost or repeated.
                        add_request.output_token_ids[:] = received
                        rlog.warning(
                            "request_resumed" if received else "request_retried",
                            scheduler=current.address,
                            retry_scheduler=retry.address,
                            completion_tokens=len(received),
                            error=raw,
                        )
                        replica = retry
                        continue
                raise self._fail(e.code(), details) from None
            finally:
                call.cancel()  # a client gone, a stop string or an error: abort upstream
                pool.end(current)
            raise self._fail(grpc.StatusCode.UNAVAILABLE, "scheduler ended the stream early")


async def watch_scheduler(
    service: InferenceService,
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
        ready = await service.scheduler_ready(timeout_s=max(poll_s, 1.0))
        now_serving = ready and not service.draining
        if now_serving != serving:
            await set_health(health_servicer, names, now_serving)
            if now_serving:
                assert service.limits is not None
                log.info(
                    "router_ready",
                    model_id=service.limits.model_id,
                    max_model_len=service.limits.max_model_len,
                    schedulers=[r.address for r in service.pool.ready_replicas()],
                )
            elif serving is not None and not service.draining:
                log.warning("no_scheduler_ready", schedulers=service.pool.addresses)
            serving = now_serving
        await service.pool.wait_changed(poll_s)


@dataclass
class Router:
    """A started router: its gRPC server, service and health watcher."""

    server: grpc.aio.Server
    service: InferenceService
    health: health.aio.HealthServicer
    names: list[str]  # the health service names it sets ("" and the Inference service)
    address: str  # as bound (a free port resolved)
    watcher: asyncio.Task[None]

    async def stop(self, grace: float | None = None) -> None:
        """Stops the watcher and the server, then closes the scheduler channels."""
        self.watcher.cancel()
        await self.server.stop(grace)
        await self.service.close()


async def start_router(
    service: InferenceService,
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    poll_s: float = 0.5,
) -> Router:
    """Serves `service` (with health and reflection) on `address`; health NOT_SERVING until
    the watcher (polling every `poll_s` seconds) sees a scheduler ready."""
    server, health = new_server(max_message_bytes)
    # not inference_pb2_grpc.add_InferenceServicer_to_server: undecodable bytes must get
    # INVALID_ARGUMENT, not UNKNOWN
    add_inference_servicer(service, server, on_malformed=service.on_malformed_request)
    service_name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    enable_server_reflection([service_name, "grpc.health.v1.Health"], server)
    bound = bind(server, address)
    names = ["", service_name]
    await set_health(health, names, serving=False)
    await server.start()
    service.pool.start_kv_events()
    watcher = asyncio.create_task(watch_scheduler(service, health, names, poll_s))
    return Router(server, service, health, names, bound, watcher)


async def serve(config: RouterConfig, model_dir: Path) -> None:
    """Serves the public API on `config.host:config.port` until SIGINT/SIGTERM, then drains;
    the OpenAI-compatible HTTP API (router/openai_api.py) on `config.http_host` (default:
    `config.host`) `:config.http_port` too unless the port is -1 (0: a free port; OSError if
    it is taken). `model_dir`: the resolved `config.model`, whose tokenizer is loaded.

    `config.scheduler`: one scheduler address or several comma-separated; requests are
    spread over them (router/balancer.py, with `config.cache_threshold` and
    `config.balance_abs_threshold`).
    Raises ValueError when there is none or one is given twice.

    A request or response over `config.max_message_size` bytes gets RESOURCE_EXHAUSTED.

    Health is NOT_SERVING until a scheduler reports ready, and again whenever
    none does. On a signal the router drains: health NOT_SERVING, new
    `Generate` streams get UNAVAILABLE, the streams in flight run to their end
    for at most `config.drain_timeout` seconds, then the server stops. Prometheus
    metrics on `config.metrics_host:config.metrics_port` unless the port is -1 (OSError if
    it is taken).
    """
    address = f"{config.host}:{config.port}"
    drain_timeout_s = config.drain_timeout
    metrics_port, http_port = port_or_none(config.metrics_port), port_or_none(config.http_port)
    if metrics_port is not None:
        from sluiceway.metrics import serve_metrics

        serve_metrics(metrics_port, config.metrics_host)
    tokenizer = load_tokenizer(model_dir)
    service = InferenceService(
        tokenizer,
        model_dir,
        config.scheduler,
        cache_threshold=config.cache_threshold,
        balance_abs_threshold=config.balance_abs_threshold,
    )
    router = await start_router(service, address, max_message_bytes=config.max_message_size)
    http = None
    if http_port is not None:
        from sluiceway.router.openai_api import start_http_server

        http = await start_http_server(service, config.http_host or config.host, http_port)
    log.info(
        "router_listening",
        address=router.address,
        http=http.url if http is not None else None,
        schedulers=service.pool.addresses,
    )
    stop = asyncio.Event()
    on_shutdown_signal(stop.set)
    await stop.wait()
    service.draining = True
    await set_health(router.health, router.names, serving=False)
    log.info("router_draining", in_flight=service.num_in_flight, drain_timeout_s=drain_timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout_s
    while service.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    log.info("router_stopping", unfinished=service.num_in_flight)
    if http is not None:
        await http.stop()
    await router.stop(grace=1.0)
