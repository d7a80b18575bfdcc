"""One sample of a request: its scheduler stream, detokenization, retry, metrics and logs.

A request with ``n`` samples is ``n`` `Sample` streams on one replica (router/request_path.py
merges them). Sample ``i`` of a seeded request uses ``seed + i`` (mod 2**64, vLLM's
convention); with ``n`` > 1 its scheduler request id is ``<request_id>-<i>`` and its
``parent_request_id`` one the router makes unique per request (clients may reuse a
request_id), so that the scheduler shares the prompt's blocks between the samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import grpc
import structlog

from sluiceway.grpc_server import REQUEST_ID_METADATA
from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.balancer import SchedulerPool, SchedulerReplica
from sluiceway.router.detokenizer import IncrementalDetokenizer
from sluiceway.router.metrics import FINISHED_REASONS, RequestRecorder
from sluiceway.router.token_bytes import TokenBytes, fill_logprob_text
from sluiceway.sampling_params import SamplingParams
from sluiceway.status import RequestError, error_from_rpc, written_by_sluiceway
from sluiceway.v1 import inference_pb2

__all__ = ["SHUTTING_DOWN", "DetokenizeTotals", "Sample", "StreamCuts"]

UNSPECIFIED = inference_pb2.FINISH_REASON_UNSPECIFIED
# The status details of a stream a shutdown cut (UNAVAILABLE: another server may take it).
SHUTTING_DOWN = "server shutting down"


class StreamCuts:
    """The scheduler calls of a router's streams, for a shutdown to cut (`cut`): each stream
    it cuts ends with UNAVAILABLE "server shutting down", which its front presents (a gRPC
    status, an HTTP 503 or SSE error event), instead of a reset connection."""

    def __init__(self) -> None:
        self.cutting = False
        self.calls: set[grpc.aio.Call] = set()

    def cut(self) -> None:
        """Cancels every scheduler call (the scheduler frees their KV blocks); their streams,
        and any stream that would start one from now on, end with `SHUTTING_DOWN`."""
        self.cutting = True
        for call in list(self.calls):
            call.cancel()


def _task_cancelled() -> bool:
    """Whether the running task was cancelled (a client gone), as opposed to a scheduler
    call cancelled under it by `StreamCuts.cut`."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass(slots=True)
class DetokenizeTotals:
    """The router's share of `sluiceway.v1.StepTimes`: seconds spent in incremental
    detokenization and stop strings, and the tokens detokenized, since start."""

    seconds: float = 0.0
    tokens: int = 0


@dataclass(slots=True)
class SampleContext:
    """What every sample of one request shares."""

    pool: SchedulerPool
    tokenizer: object
    token_bytes: TokenBytes  # each token's own bytes and text, for logprob entries
    totals: DetokenizeTotals
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # resolved (SamplingParams.resolve)
    cancel_code: Callable[[], grpc.StatusCode]
    parent_request_id: str | None  # set when n > 1
    cuts: StreamCuts
    priority: int = 0  # GenerateRequest.priority: every sample's, and a resumed stream's


class Sample:
    """Sample `index` of a request: `responses(replica)` streams it."""

    def __init__(
        self,
        ctx: SampleContext,
        index: int,
        rlog: structlog.typing.FilteringBoundLogger,
        recorder: RequestRecorder,
    ) -> None:
        self.ctx = ctx
        self.index = index
        self.rlog = rlog
        self.recorder = recorder
        self.finished = False
        # GenerateResponse.prompt_logprobs still to send (on this sample's first message)
        self.prompt_logprobs_due = ctx.params.prompt_logprobs is not None

    def add_request(self) -> scheduler_pb2.AddRequestRequest:
        """The scheduler request of this sample (its own seed and ids when n > 1)."""
        ctx, params = self.ctx, self.ctx.params
        request_id = ctx.request_id
        if ctx.parent_request_id is not None:  # one of n > 1 samples
            request_id = f"{ctx.request_id}-{self.index}"
            if self.index and params.seed is not None:
                params = dataclasses.replace(params, seed=(params.seed + self.index) % (1 << 64))
        return scheduler_pb2.AddRequestRequest(
            request_id=request_id,
            prompt_token_ids=ctx.prompt_ids,
            sampling=params.to_proto(),
            parent_request_id=ctx.parent_request_id or "",
            priority=ctx.priority,
        )

    def _fail(self, error: RequestError) -> RequestError:
        self.finished = True
        self.recorder.on_failure(error.code.name)
        self.rlog.warning("request_failed", code=error.code.name, error=error.details)
        return error

    def _cut(self) -> RequestError:
        """The failure of a stream a shutdown cut (`StreamCuts`), counted and logged."""
        return self._fail(RequestError(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN))

    async def responses(
        self, replica: SchedulerReplica
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """This sample's responses from `replica`; if it becomes unavailable, from another
        one, resumed after the tokens already received (once). Raises RequestError."""
        try:
            async for response in self._responses(replica):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            if not self.finished:
                code = self.ctx.cancel_code()
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
        ctx, params = self.ctx, self.ctx.params
        detok = IncrementalDetokenizer(
            ctx.tokenizer,
            ctx.prompt_ids,
            list(params.stop),
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        add_request = self.add_request()
        tried: list[SchedulerReplica] = []
        received: list[int] = []  # token ids this sample got, from every replica tried
        while True:
            if ctx.cuts.cutting:
                raise self._cut()
            current = replica
            tried.append(current)
            ctx.pool.begin(current)
            call = current.stub.AddRequest(
                add_request, metadata=((REQUEST_ID_METADATA, add_request.request_id.encode()),)
            )
            ctx.cuts.calls.add(call)
            try:
                async for event in call:
                    received.extend(event.token_ids)
                    response = self._response(detok, event)
                    yield response
                    if response.finish_reason != UNSPECIFIED:
                        self._log_finished(response, current)
                        return
            except asyncio.CancelledError:
                # grpc.aio raises CancelledError from a call cancelled locally: here, cut
                if not ctx.cuts.cutting or _task_cancelled():
                    raise
                raise self._cut() from None
            except grpc.aio.AioRpcError as e:
                if ctx.cuts.cutting:
                    raise self._cut() from None
                retry = self._on_scheduler_error(e, current, tried)
                if retry is None:
                    raise self._fail(error_from_rpc(e)) from None
                # Resumed after the tokens already sent, as a preempted sequence is: with
                # deterministic inference the continuation is the one the failed replica
                # would have made; nothing is lost or repeated.
                add_request.output_token_ids[:] = received
                self.rlog.warning(
                    "request_resumed" if received else "request_retried",
                    scheduler=current.address,
                    retry_scheduler=retry.address,
                    completion_tokens=len(received),
                    error=f"{e.code().name}: {e.details()}",
                )
                replica = retry
                continue
            finally:
                call.cancel()  # a client gone, a stop string or an error: abort upstream
                ctx.cuts.calls.discard(call)
                ctx.pool.end(current)
            if ctx.cuts.cutting:
                raise self._cut()
            error = RequestError(grpc.StatusCode.UNAVAILABLE, "scheduler ended the stream early")
            raise self._fail(error)

    def _on_scheduler_error(
        self,
        error: grpc.aio.AioRpcError,
        current: SchedulerReplica,
        tried: list[SchedulerReplica],
    ) -> SchedulerReplica | None:
        """Logs a failed scheduler call (gRPC's transport text goes to the log only) and, for
        UNAVAILABLE, marks the replica down and returns another one to resume on (once)."""
        raw = f"{error.code().name}: {error.details()}"
        if not written_by_sluiceway(error):
            self.rlog.warning("scheduler_call_failed", scheduler=current.address, error=raw)
        if error.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        self.ctx.pool.mark_unavailable(current, raw)
        return None if len(tried) > 1 else self.ctx.pool.pick(self.ctx.prompt_ids, tried)

    def _response(
        self, detok: IncrementalDetokenizer, event: scheduler_pb2.TokenEvent
    ) -> inference_pb2.GenerateResponse:
        """The public response of one scheduler event: its text delta (a stop token id's text
        left out, a stop string ending it), tokens, logprobs and, on the last, usage."""
        ctx, recorder = self.ctx, self.recorder
        recorder.on_tokens(len(event.token_ids), time.monotonic())
        if event.HasField("queue_seconds"):
            recorder.on_queue_time(event.queue_seconds)
        t0 = time.perf_counter()
        new_ids = list(event.token_ids)
        if (
            event.finish_reason == inference_pb2.FINISH_REASON_STOP
            and not ctx.params.include_stop_str_in_output
        ):
            new_ids = new_ids[:-1]  # a stop token id (EOS): its text is not output
        text = detok.add_tokens(new_ids)
        finish = inference_pb2.FINISH_REASON_STOP if detok.stopped else event.finish_reason
        if finish != UNSPECIFIED and not detok.stopped:
            text += detok.flush()
        skip = ctx.params.skip_special_tokens
        for lp in event.logprobs:  # each token's own text and bytes, for every client
            fill_logprob_text(ctx.token_bytes, lp, skip)
        if self.prompt_logprobs_due:  # the first event: the first prompt token has no logprob
            self.prompt_logprobs_due = False
            event.prompt_logprobs.insert(0, inference_pb2.TokenLogprobs(token_id=ctx.prompt_ids[0]))
        for lp in event.prompt_logprobs:  # the prompt's text keeps its special tokens
            fill_logprob_text(ctx.token_bytes, lp, False)
        ctx.totals.seconds += time.perf_counter() - t0
        ctx.totals.tokens += len(event.token_ids)
        response = inference_pb2.GenerateResponse(
            request_id=ctx.request_id,
            text=text,
            token_ids=event.token_ids,
            finish_reason=finish,
            logprobs=event.logprobs,
            index=self.index,
            prompt_logprobs=event.prompt_logprobs,
        )
        if finish != UNSPECIFIED:
            response.usage.prompt_tokens = len(ctx.prompt_ids)
            response.usage.completion_tokens = recorder.num_generated
            self.finished = True
        return response

    def _log_finished(
        self, response: inference_pb2.GenerateResponse, replica: SchedulerReplica
    ) -> None:
        reason = FINISHED_REASONS.get(response.finish_reason, "abort")
        recorder = self.recorder
        recorder.on_success(reason, len(self.ctx.prompt_ids))
        self.rlog.info(
            "request_finished",
            prompt_tokens=len(self.ctx.prompt_ids),
            completion_tokens=recorder.num_generated,
            ttft_s=round(recorder.ttft, 6),
            e2e_s=round(recorder.e2e, 6),
            finish_reason=reason,
            scheduler=replica.address,
        )
