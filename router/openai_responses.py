"""The responses of the OpenAI-compatible HTTP API: one generation request's choices (each a
`RequestPath.generate` stream) merged into OpenAI's shapes, whole or as server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from sluiceway.router.openai_errors import (
    HTTP_STATUS,
    ApiError,
    api_error,
    error_body,
    error_response,
)
from sluiceway.router.openai_logprobs import (
    TextOffsets,
    chat_entries,
    completion_logprobs,
    merge_completion_logprobs,
    vllm_prompt_logprobs,
)
from sluiceway.router.openai_models import ChatCompletionRequest, CompletionRequest
from sluiceway.router.request_path import RequestPath
from sluiceway.router.streams import merge_streams
from sluiceway.status import RequestError
from sluiceway.v1 import inference_pb2

T = TypeVar("T")

__all__ = ["Run"]

FINISH = {
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
    inference_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def _tool_call_deltas(response: inference_pb2.GenerateResponse) -> list[dict[str, Any]]:
    """A response's tool-call pieces as OpenAI's streamed ``delta.tool_calls``: a call's
    first piece with its ``id``, ``type`` and name, the next ones with more arguments."""
    deltas = []
    for call in response.tool_calls:
        delta: dict[str, Any] = {"index": call.index}
        function: dict[str, Any] = {"arguments": call.arguments}
        if call.id:
            delta.update(id=call.id, type="function")
            function = {"name": call.name, **function}
        delta["function"] = function
        deltas.append(delta)
    return deltas


def _join_tool_calls(calls: list[inference_pb2.ToolCall]) -> list[dict[str, Any]]:
    """A sample's tool-call pieces joined into OpenAI's ``message.tool_calls``."""
    joined: dict[int, dict[str, Any]] = {}
    for call in calls:
        if call.index not in joined:
            joined[call.index] = {"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": ""}}  # fmt: skip
        joined[call.index]["function"]["arguments"] += call.arguments
    return [joined[i] for i in sorted(joined)]


class Run:
    """One HTTP generation request: its ``len(prompts) * n`` choices, each a
    :meth:`RequestPath.generate` stream, merged into OpenAI's shapes."""

    def __init__(
        self,
        path: RequestPath,
        body: ChatCompletionRequest | CompletionRequest,
        model: str,
        *,
        chat: bool,
        logprobs: bool,
        names: dict[str, str] | None = None,
        echo: list[str] | None = None,
        echo_only: bool = False,
    ) -> None:
        """`names`: request fields this request's body named otherwise (for error params).
        `echo`: completions' ``echo``, each prompt's text, put before its choices' text (and
        its tokens before their logprobs); `echo_only`: ``max_tokens: 0`` with echo, the
        prompt alone (the one token generated is left out, as vLLM does)."""
        self.path = path
        self.body = body
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.names = names or {}
        self.echo = echo
        self.echo_only = echo_only
        # vLLM's prompt_logprobs field in the response: only when the body asked for it
        self.prompt_logprobs = body.prompt_logprobs is not None
        # the client's request_id travels as it is (its length checked as the gRPC API's);
        # OpenAI's prefix is the response's id only
        self.request_id = body.request_id or uuid.uuid4().hex
        self.id = ("chatcmpl-" if chat else "cmpl-") + self.request_id
        self.created = int(time.time())
        self.arrival = time.monotonic()

    async def _stream(
        self, p: int, request: inference_pb2.GenerateRequest
    ) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse], None]:
        """Prompt ``p``'s responses, each with its choice index (``p * n`` + its sample)."""
        n = self.body.n or 1
        async with contextlib.aclosing(
            self.path.generate(request, request.request_id, arrival=self.arrival, protocol="http")
        ) as responses:
            async for response in responses:
                yield p * n + response.index, response

    def _merged(
        self, prompts: list[inference_pb2.GenerateRequest]
    ) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse], None]:
        """Every choice's responses as they come; a failure of one ends them all."""
        for p, request in enumerate(prompts):
            request.request_id = self.request_id if len(prompts) == 1 else f"{self.request_id}-{p}"
        if len(prompts) == 1:
            return self._stream(0, prompts[0])
        return merge_streams([self._stream(p, r) for p, r in enumerate(prompts)])

    def _completion_choice(
        self, index: int, r: inference_pb2.GenerateResponse, offsets: TextOffsets, first: bool
    ) -> tuple[str, dict[str, Any] | None]:
        """A completion choice's text and logprobs from one response (``first``: the
        choice's first): the echoed prompt before the output on the first, the output
        left out with `echo_only`."""
        n = self.body.n or 1
        text = "" if self.echo_only else r.text
        prompt_part = None
        if self.echo is not None and first:
            text = self.echo[index // n] + text
            if self.logprobs:
                prompt_part = completion_logprobs(r.prompt_logprobs, offsets, prompt=True)
        if not self.logprobs:
            return text, None
        out = completion_logprobs([] if self.echo_only else r.logprobs, offsets)
        return text, out if prompt_part is None else merge_completion_logprobs(prompt_part, out)

    def _usage(self, prompt_tokens: dict[int, int], completion: dict[int, int]) -> dict[str, int]:
        n = self.body.n or 1
        prompt = sum(v for k, v in prompt_tokens.items() if k % n == 0)
        done = sum(completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def respond(
        self, prompts: list[inference_pb2.GenerateRequest], raw: Request
    ) -> JSONResponse | StreamingResponse:
        try:
            if self.body.stream:
                stream = self._sse(prompts)
                # the first event, which waits for the queue and the prompt: a request refused
                # at once gets its HTTP status; the stream's later writes notice a disconnect
                first = await _unless_disconnected(anext(stream), raw)
                if first is None:
                    await stream.aclose()
                    return error_response(499, "client disconnected", None)
                return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
            whole = await _unless_disconnected(self._whole(prompts), raw)
        except RequestError as e:
            raise self._api_error(e) from None
        if whole is None:
            return error_response(499, "client disconnected", None)
        return JSONResponse(whole)

    def _api_error(self, e: RequestError) -> ApiError:
        fmt = self.body.response_format
        constraint_param = None  # the body field the constraint came from, unless vLLM's
        if fmt is not None and fmt.type != "text":
            constraint_param = "response_format"
        for kind in ("json", "regex", "choice", "grammar"):  # vLLM's older guided_* fields
            if getattr(self.body, f"guided_{kind}") is not None:
                constraint_param = f"guided_{kind}"
        return api_error(e, chat=self.chat, names=self.names, constraint_param=constraint_param)

    async def _whole(self, prompts: list[inference_pb2.GenerateRequest]) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        calls: dict[int, list[inference_pb2.ToolCall]] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        offsets: dict[int, TextOffsets] = {}
        prompt_lps: dict[int, list[inference_pb2.TokenLogprobs]] = {}
        finish: dict[int, str] = {}
        prompt_tokens: dict[int, int] = {}
        completion: dict[int, int] = {}
        async with contextlib.aclosing(self._merged(prompts)) as merged:
            async for index, r in merged:
                first = index not in texts
                calls.setdefault(index, []).extend(r.tool_calls)
                if r.prompt_logprobs:
                    prompt_lps[index] = list(r.prompt_logprobs)
                if self.chat:
                    texts.setdefault(index, []).append(r.text)
                    if self.logprobs:
                        lps.setdefault(index, []).extend(chat_entries(r.logprobs))
                else:
                    at = offsets.setdefault(index, TextOffsets())
                    text, part = self._completion_choice(index, r, at, first)
                    texts.setdefault(index, []).append(text)
                    if part is not None:
                        lps.setdefault(index, []).append(part)
                if r.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    finish[index] = FINISH.get(r.finish_reason, "stop")
                    prompt_tokens[index] = r.usage.prompt_tokens
                    completion[index] = r.usage.completion_tokens
        choices = []
        for index in sorted(texts):
            text = "".join(texts[index])
            choice: dict[str, Any] = {"index": index, "finish_reason": finish.get(index)}
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if calls[index]:  # OpenAI's: content null when the answer is only calls
                    message.update(content=text or None, tool_calls=_join_tool_calls(calls[index]))
                choice["message"] = message
                choice["logprobs"] = {"content": lps.get(index, [])} if self.logprobs else None
            else:
                choice["text"] = text
                parts = lps.get(index, [])
                choice["logprobs"] = (
                    functools.reduce(merge_completion_logprobs, parts) if parts else None
                )
                if self.prompt_logprobs:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps.get(index, []))
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(prompt_tokens, completion),
        }
        if self.chat and self.prompt_logprobs:  # vLLM's: the request's, once
            body["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps.get(0, []))
        return body

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    async def _sse(self, prompts: list[inference_pb2.GenerateRequest]) -> AsyncGenerator[str, None]:
        prompt_tokens: dict[int, int] = {}
        completion: dict[int, int] = {}
        offsets: dict[int, TextOffsets] = {}
        started: set[int] = set()
        async with contextlib.aclosing(self._merged(prompts)) as merged:
            async for index, r in merged:
                finished = r.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
                choice: dict[str, Any] = {"index": index}
                said = finished or index not in started or r.text or r.tool_calls
                if self.chat and not said and not (self.logprobs and r.logprobs):
                    continue  # nothing to say (a buffered tool call): no empty delta (vLLM's)
                if self.chat:
                    delta: dict[str, Any] = {"content": r.text}
                    if r.tool_calls:
                        delta = {"content": r.text or None, "tool_calls": _tool_call_deltas(r)}
                    if index not in started:
                        delta = {"role": "assistant", **delta}
                    choice["delta"] = delta
                    choice["logprobs"] = (
                        {"content": chat_entries(r.logprobs)}
                        if self.logprobs and r.logprobs
                        else None
                    )
                else:
                    at = offsets.setdefault(index, TextOffsets())
                    text, part = self._completion_choice(index, r, at, index not in started)
                    choice["text"] = text
                    choice["logprobs"] = part
                started.add(index)
                choice["finish_reason"] = FINISH.get(r.finish_reason, "stop") if finished else None
                if finished:
                    prompt_tokens[index] = r.usage.prompt_tokens
                    completion[index] = r.usage.completion_tokens
                yield self._chunk([choice])
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield self._chunk([], self._usage(prompt_tokens, completion))
        yield "data: [DONE]\n\n"


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    """``first``, then ``rest``; a failure after the first event ends the stream with an
    error event (the HTTP status is already sent)."""
    yield first
    try:
        async for item in rest:
            yield item
    except RequestError as e:
        status, _ = HTTP_STATUS.get(e.code, (500, "InternalServerError"))
        yield f"data: {json.dumps(error_body(status, e.details, None))}\n\n"
        yield "data: [DONE]\n\n"


async def _disconnected(request: Request, poll_s: float = 0.2) -> None:
    """Returns once the client of ``request`` has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


async def _unless_disconnected(work: Awaitable[T], request: Request) -> T | None:
    """``work``'s result, or None once the client of ``request`` has gone first: ``work`` is
    cancelled then (a generation's cancel reaches the scheduler, which frees its blocks).
    Raises what ``work`` raises."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestError):
            await task
        return None
    watcher.cancel()
    return task.result()
