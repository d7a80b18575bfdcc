"""The one request path of the router, which every front calls (gRPC: router/grpc_api.py,
HTTP: router/openai_api.py): tokenization and the chat template, the validation gate, the choice
of a scheduler replica, the scheduler streams, detokenization and stop strings, the retry on
another replica, metrics and logs. It knows no front: a failure is a `RequestError` (code,
message, field as data) for the front to present.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.balancer import ModelLimits, SchedulerPool, merge_scheduler_infos
from sluiceway.router.metrics import Protocol, RequestRecorder
from sluiceway.router.samples import DetokenizeTotals, Sample, SampleContext, StreamCuts
from sluiceway.router.streams import merge_streams
from sluiceway.router.token_bytes import TokenBytes
from sluiceway.router.tokenizer import encode_chat, encode_prompt, template_takes_tools
from sluiceway.router.tool_calls import (
    ToolPlan,
    chat_conversation,
    plan_tools,
    tool_call_responses,
)
from sluiceway.sampling_params import SamplingParams, check_prompt_token_ids, check_request_id
from sluiceway.status import FieldError, RequestError, error_from_rpc
from sluiceway.unknown_fields import check_unknown_fields
from sluiceway.v1 import inference_pb2

__all__ = ["RequestPath", "eos_token_ids"]

log = structlog.get_logger("router")

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def eos_token_ids(tokenizer: Any, model_dir: Path) -> list[int]:
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


class RequestPath:
    """Generate, tokenize and model info over one scheduler or several (`SchedulerPool`).

    With several, each generation goes to the scheduler `SchedulerPool.pick` chooses (where
    most of the prompt is cached, else least outstanding requests). A scheduler that fails a
    stream with UNAVAILABLE gets no new requests until the health watcher sees it ready again,
    and each of its streams goes on once on another ready scheduler: resubmitted with the
    tokens already received as `output_token_ids`, so the client sees no lost and no repeated
    token (and, with deterministic inference, the tokens the failed one would have made).
    """

    def __init__(
        self,
        tokenizer: Any,
        model_dir: Path,
        scheduler_addresses: str | Sequence[str],
        *,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        **pool_options: Any,
    ) -> None:
        """`scheduler_addresses`: one address, a comma-separated string or a list;
        `tool_call_parser`, `enable_auto_tool_choice`: the router's flags of those names
        (router/tool_calls.py); `pool_options`: `SchedulerPool`'s routing thresholds."""
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.eos_token_ids = eos_token_ids(tokenizer, model_dir)
        self.pool = SchedulerPool(scheduler_addresses, **pool_options)
        self.detokenize = DetokenizeTotals()
        self.draining = False  # set on SIGTERM: new generations get UNAVAILABLE
        self.num_in_flight = 0  # generations admitted (not refused at once), not yet ended
        self.cuts = StreamCuts()
        self._idle = asyncio.Event()  # set while num_in_flight is 0
        self._idle.set()

    @functools.cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's own bytes and OpenAI text (logprob entries), built on first use."""
        return TokenBytes(self.tokenizer)

    @property
    def limits(self) -> ModelLimits | None:
        """The model's limits, once a scheduler has been ready (see `SchedulerPool.limits`)."""
        return self.pool.limits

    @property
    def serving(self) -> bool:
        """A scheduler is ready and the router is not draining (what health says)."""
        return self.limits is not None and not self.draining and self.pool.any_ready

    async def scheduler_ready(self, timeout_s: float) -> bool:
        """Asks every scheduler whether its workers have registered; caches the model limits.
        True when at least one answers ready within `timeout_s` seconds."""
        return await self.pool.refresh(timeout_s)

    async def close(self) -> None:
        await self.pool.close()

    async def wait_idle(self) -> None:
        """Returns once no generation is in flight."""
        await self._idle.wait()

    def cut_streams(self) -> None:
        """Ends every generation in flight, and any admitted from now on, with UNAVAILABLE
        "server shutting down" (`StreamCuts`): a shutdown that will not wait for them."""
        self.cuts.cut()

    def prompt_token_ids(
        self, request: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest
    ) -> list[int]:
        """Token ids of the request's `input` oneof, as the model will see them (no length
        limit applied). Raises FieldError("input") when it is unset, and the tokenizer's
        FieldErrors for messages it refuses."""
        which = request.WhichOneof("input")
        if which == "prompt":
            return encode_prompt(self.tokenizer, request.prompt)
        if which == "messages":
            return self._encode_messages(request.messages)
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)  # type: ignore[union-attr]
        names = ", ".join(f.name for f in request.DESCRIPTOR.oneofs_by_name["input"].fields)
        raise FieldError("input", f"set one of {names}")

    def _encode_messages(self, messages: inference_pb2.ChatMessages) -> list[int]:
        """A conversation's token ids; with tools or tool turns, rendered as
        router/tool_calls.py says (`chat_conversation`)."""
        if not messages.tools and not any(
            m.tool_calls or m.tool_call_id for m in messages.messages
        ):
            return encode_chat(self.tokenizer, [(m.role, m.content) for m in messages.messages])
        turns, tools = chat_conversation(messages, template_takes_tools(self.tokenizer))
        return encode_chat(self.tokenizer, turns, tools)

    async def generate(
        self,
        request: inference_pb2.GenerateRequest,
        request_id: str,
        *,
        arrival: float,
        protocol: Protocol = "grpc",
        cancel_code: Callable[[], grpc.StatusCode] = lambda: grpc.StatusCode.CANCELLED,
    ) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
        """The responses of one generation: each sample's text deltas and tokens, the last of
        each with its finish reason and usage.

        A request with ``sampling.n`` > 1 is n samples, each a scheduler stream of its own on
        one replica (they share the prompt's KV blocks there), their responses merged as they
        come and told apart by ``index``; each counts as a request in the metrics (as vLLM
        counts them). `arrival` is ``time.monotonic()`` at the request's arrival; `protocol`
        the metrics' label; `cancel_code` names the status a cancelled stream ends with
        (counted and logged).

        Raises:
            RequestError: the request ends with a status instead of (more) responses
                (INVALID_ARGUMENT with the field named, UNAVAILABLE, RESOURCE_EXHAUSTED, ...);
                already counted and logged. A failure of one sample ends them all.

        Closing the generator (a client gone) cancels the scheduler streams, which frees the
        request's KV blocks.
        """
        limits = self.limits
        rlog = log.bind(request_id=request_id, protocol=protocol)
        recorder = RequestRecorder(limits.model_id if limits else "", arrival, protocol)

        def fail(error: RequestError) -> RequestError:
            recorder.on_failure(error.code.name)
            rlog.warning("request_failed", code=error.code.name, error=error.details)
            return error

        if self.draining:
            raise fail(RequestError(UNAVAILABLE, "router is draining; retry another router"))
        if limits is None:
            raise fail(RequestError(UNAVAILABLE, "no scheduler is ready yet"))
        self.num_in_flight += 1  # from here on, a drain waits for it and a cut ends it
        self._idle.clear()
        try:
            try:
                prompt_ids, params, plan = await self._admit(request, limits)
            except FieldError as e:
                raise fail(e) from None
            except asyncio.CancelledError:
                recorder.on_failure(cancel_code().name)
                raise
            replica = self.pool.pick(prompt_ids)
            if replica is None:
                raise fail(RequestError(UNAVAILABLE, "no scheduler is ready"))
            ctx = SampleContext(
                pool=self.pool,
                tokenizer=self.tokenizer,
                token_bytes=self.token_bytes,
                totals=self.detokenize,
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                cancel_code=cancel_code,
                # unique, unlike a client's request_id, which two live requests may share
                parent_request_id=f"{request_id}/{uuid.uuid4().hex}" if params.n > 1 else None,
                cuts=self.cuts,
                priority=request.priority,
            )
            samples = [
                Sample(
                    ctx,
                    i,
                    rlog if params.n == 1 else rlog.bind(index=i),
                    recorder if i == 0 else RequestRecorder(recorder.model_name, arrival, protocol),
                ).responses(replica)
                for i in range(params.n)
            ]
            if plan is not None and plan.mode != "none":  # each sample's calls split out
                samples = [tool_call_responses(s, plan) for s in samples]
            merged = samples[0] if params.n == 1 else merge_streams(samples)
            async with contextlib.aclosing(merged) as responses:
                async for response in responses:
                    yield response
        finally:
            self._end_flight()

    def _end_flight(self) -> None:
        """A generation counted in `num_in_flight` ended."""
        self.num_in_flight -= 1
        if not self.num_in_flight:
            self._idle.set()

    async def _admit(
        self, request: inference_pb2.GenerateRequest, limits: ModelLimits
    ) -> tuple[list[int], SamplingParams, ToolPlan | None]:
        """The gate every request passes: its id, no field this server does not know, its
        prompt's token ids (tokenized in a thread: a megabyte prompt takes seconds, other
        streams go on), its tools' plan (router/tool_calls.py: a required or named tool_choice
        adds its grammar to the sampling parameters) and its sampling parameters, checked and
        resolved. Raises FieldError."""
        check_request_id(request.request_id)
        check_unknown_fields(request)
        plan = None
        sampling = request.sampling
        if request.WhichOneof("input") == "messages":
            plan = plan_tools(
                request.messages,
                parser=self.tool_call_parser,
                auto_enabled=self.enable_auto_tool_choice,
            )
            if plan is not None:
                sampling = plan.sampling(sampling)
        try:
            params = SamplingParams.from_proto(sampling)
        except FieldError as e:
            raise e if plan is None else plan.own_error(e) from None
        prompt_ids = await asyncio.to_thread(self.prompt_token_ids, request)
        check_prompt_token_ids(prompt_ids, limits.vocab_size, limits.max_model_len)
        resolved = params.resolve(
            prompt_len=len(prompt_ids),
            max_model_len=limits.max_model_len,
            vocab_size=limits.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )
        return prompt_ids, resolved, plan

    async def model_info(self) -> inference_pb2.ModelInfo:
        """Model facts from the first ready scheduler (in `--scheduler` order); KV pool sizes
        and every `_total` counter summed over the ready schedulers, `kv_cache_utilization`
        their mean weighted by blocks in use (`merge_scheduler_infos`). With one scheduler:
        its own figures. The detokenization step times are this router's.

        Raises RequestError(UNAVAILABLE) when no scheduler is ready, with each one's reason.
        """
        targets = self.pool.ready_replicas() or self.pool.replicas
        answers = await asyncio.gather(
            *(
                r.stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=5.0)
                for r in targets
            ),
            return_exceptions=True,
        )
        infos: list[scheduler_pb2.SchedulerInfo] = []
        errors: list[str] = []
        for answer in answers:
            if isinstance(answer, scheduler_pb2.SchedulerInfo):
                if answer.ready:
                    infos.append(answer)
                else:
                    errors.append("scheduler not ready")
            elif isinstance(answer, grpc.aio.AioRpcError):
                errors.append(f"scheduler: {error_from_rpc(answer).details}")
            else:
                raise answer
        if not infos:
            if len(targets) == 1:
                raise RequestError(UNAVAILABLE, errors[0])
            reasons = "; ".join(  # by index: addresses are internal
                f"scheduler {self.pool.replicas.index(r)}: {e.removeprefix('scheduler: ')}"
                for r, e in zip(targets, errors, strict=True)
            )
            raise RequestError(UNAVAILABLE, f"no scheduler is ready ({reasons})")
        return self._model_info(merge_scheduler_infos(infos))

    def _model_info(self, info: scheduler_pb2.SchedulerInfo) -> inference_pb2.ModelInfo:
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
            spec_decode_num_drafts_total=info.kv_cache.spec_decode_num_drafts_total,
            spec_decode_num_draft_tokens_total=info.kv_cache.spec_decode_num_draft_tokens_total,
            spec_decode_num_accepted_tokens_total=info.kv_cache.spec_decode_num_accepted_tokens_total,
            step_times=info.step_times,
        )
        reply.step_times.detokenize_seconds_total = self.detokenize.seconds
        reply.step_times.detokenized_tokens_total = self.detokenize.tokens
        return reply
