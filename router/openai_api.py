"""The OpenAI-compatible HTTP API of the router (what vLLM, SGLang and TGI serve).

FastAPI on the router's own event loop (uvicorn), beside the gRPC server, over the same
:meth:`router.server.InferenceService.generate` path: the same validation, tokenization, chat
template, detokenization, stop strings, retries, metrics and logs. A request body becomes a
``sluiceway.v1.GenerateRequest`` (OpenAI's parameter names, vLLM's extra-body names for the
rest) and the responses come back in OpenAI's shapes.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (non-streamed, or streamed
as server-sent events: ``data: {chunk}`` lines, ``data: [DONE]`` last,
``stream_options.include_usage`` for a final usage chunk), ``GET /v1/models``, ``GET /health``,
``GET /version``, ``POST /tokenize``, ``POST /detokenize``.

Errors: OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``, with HTTP
400 for what the gRPC API refuses as INVALID_ARGUMENT (``param`` names the field in this API's
words), 404 for an unknown model, 429 / 503 where gRPC says RESOURCE_EXHAUSTED / UNAVAILABLE.
A client that disconnects aborts its request (the scheduler stream is cancelled: its KV blocks
come back).

``n`` > 1: ``sampling.n`` of the gRPC API, the same path (parallel sampling: the samples share
the prompt's KV blocks; a seeded request's sample ``i`` uses ``seed + i``); choice
``p * n + i`` is sample ``i`` of prompt ``p``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Literal

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sluiceway.router.errors import InvalidRequest
from sluiceway.router.server import InferenceService, RequestFailed
from sluiceway.router.streams import merge_streams
from sluiceway.router.validation import MAX_N
from sluiceway.v1 import inference_pb2

__all__ = ["HttpServer", "build_app", "start_http_server"]


FINISH = {
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
}
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def _error_response(status: int, message: str, param: str | None) -> JSONResponse:
    kind = next((k for s, k in HTTP_STATUS.values() if s == status), "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


# -- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's extra-body ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(BaseModel):
    """The parameters both endpoints share: OpenAI's names, then vLLM's extra-body names."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int | None = None  # 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's names before structured_outputs (removed in vLLM 0.12): the same constraints
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# -- mapping ----------------------------------------------------------------------------------

_CONSTRAINT_FIELD = "sampling.structured_outputs"

# gRPC field names (router/validation.py) -> this API's, where they differ
_PARAM_NAMES = {
    "sampling.max_tokens": "max_tokens",
    "input": "prompt",
    "request_id": "request_id",
}


def _param(field: str | None, chat: bool) -> str | None:
    """The body field that ``field`` (a gRPC request field) came from."""
    if field is None:
        return None
    if field == "sampling.logprobs":
        return "top_logprobs" if chat else "logprobs"
    if field == "input" and chat:
        return "messages"
    if field.startswith("messages.messages"):
        return "messages" + field[len("messages.messages") :]
    if field.startswith("prompt_token_ids"):
        return "prompt"
    if field in _PARAM_NAMES:
        return _PARAM_NAMES[field]
    return field.removeprefix("sampling.")


_U32 = (0, (1 << 32) - 1)
_RANGES = {  # the proto field's integer type
    "max_tokens": _U32,
    "min_tokens": _U32,
    "logprobs": _U32,
    "top_k": (-(1 << 31), (1 << 31) - 1),
    "seed": (0, (1 << 64) - 1),
    "n": (1, MAX_N),
    "token_id": _U32,
}


def _in_range(value: int, name: str, param: str) -> int:
    """``value`` if it fits the proto type of field ``name`` (a key of ``_RANGES``), else a
    400 naming ``param``."""
    lo, hi = _RANGES[name]
    if not lo <= value <= hi:
        raise ApiError(400, f"{param}: must be in [{lo}, {hi}], got {value}", param)
    return value


def _sampling_params(
    body: _Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    *,
    max_tokens_param: str = "max_tokens",
    logprobs_param: str = "logprobs",
) -> dict[str, Any]:
    """The ``SamplingParams`` fields of ``body``; integers outside their proto type's range
    are refused here (HTTP 400 naming the field), the rest by the shared validation."""
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "n"):  # fmt: skip
        value = getattr(body, name)
        if value is not None:
            params[name] = _in_range(value, name, name) if name in _RANGES else value
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(
                400, f"{max_tokens_param}: must be >= 1, got {max_tokens}", max_tokens_param
            )
        params["max_tokens"] = _in_range(max_tokens, "max_tokens", max_tokens_param)
    if body.stop is not None:
        params["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.stop_token_ids:
        params["stop_token_ids"] = [
            _integer(t, f"stop_token_ids[{i}]") for i, t in enumerate(body.stop_token_ids)
        ]
    if logprobs is not None:
        params["logprobs"] = _in_range(logprobs, "logprobs", logprobs_param)
    constraint = _structured_outputs(body)
    if constraint is not None:
        params["structured_outputs"] = constraint
    params["ignore_eos"] = body.ignore_eos
    params["skip_special_tokens"] = body.skip_special_tokens
    params["include_stop_str_in_output"] = body.include_stop_str_in_output
    return params


def _structured_outputs(body: _Sampling) -> inference_pb2.StructuredOutputs | None:
    """The constraint of ``response_format`` (OpenAI) or ``structured_outputs`` (vLLM's extra
    body; or its older ``guided_json``, ``guided_regex``, ``guided_choice``,
    ``guided_grammar``), None for none (or ``{"type": "text"}``); a 400 for two, or for a
    ``structured_outputs`` that sets not exactly one field. The shared validation checks the
    rest."""
    fmt, so = body.response_format, body.structured_outputs
    guided = {k: getattr(body, "guided_" + k) for k in ("json", "regex", "choice", "grammar")}
    if any(v is not None for v in guided.values()):
        if so is not None:
            raise ApiError(
                400, "structured_outputs: give it or guided_*, not both", "structured_outputs"
            )
        so = StructuredOutputsBody.model_validate(
            {k: v for k, v in guided.items() if v is not None}
        )
    if fmt is not None and fmt.type != "text" and so is not None:
        raise ApiError(
            400, "structured_outputs: give it or response_format, not both", "structured_outputs"
        )
    if fmt is not None and fmt.type == "json_object":
        return inference_pb2.StructuredOutputs(json_object=True)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            param = "response_format.json_schema.schema"
            raise ApiError(400, f"{param}: required with type json_schema", param)
        return inference_pb2.StructuredOutputs(json=json.dumps(fmt.json_schema.json_schema))
    if so is None:
        return None
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
             if getattr(so, k) is not None]  # fmt: skip
    if len(given) != 1:
        raise ApiError(
            400,
            "structured_outputs: set exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    if so.json_ is not None:
        text = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return inference_pb2.StructuredOutputs(json=text)
    if so.choice is not None:
        return inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=so.choice))
    if so.json_object is not None:
        return inference_pb2.StructuredOutputs(json_object=so.json_object)
    if so.regex is not None:
        return inference_pb2.StructuredOutputs(regex=so.regex)
    return inference_pb2.StructuredOutputs(grammar=so.grammar)


def _message_text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for j, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            where = f"messages[{index}].content[{j}]"
            raise ApiError(400, f"{where}: only text content parts are supported", where)
        parts.append(part["text"])
    return "".join(parts)


# pydantic's names for the member of a union that failed ("str", "list[int]"), not fields
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


def _body_param(loc: Any) -> str | None:
    """The body field a pydantic error location names, in this API's words:
    ``("body", "messages", 0, "role")`` -> ``messages[0].role``; union member tags dropped."""
    out = ""
    for part in list(loc)[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.match(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def _integer(value: int, param: str) -> int:
    """A token id that fits the proto's uint32 (the vocabulary is checked later)."""
    return _in_range(value, "token_id", param)


# -- the app ----------------------------------------------------------------------------------


def build_app(service: InferenceService) -> FastAPI:
    """The FastAPI application over ``service`` (see the module docstring); the model's
    name is the schedulers' (``--served-model-name``)."""
    app = FastAPI(title="sluiceway", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = service.tokenizer

    def model_id() -> str:
        limits = service.limits
        if limits is None:
            raise ApiError(503, "no scheduler is ready yet")
        return limits.model_id

    def check_model(name: str | None) -> str:
        served = model_id()
        if name is not None and name != served:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves "
                           f"`{served}`)", "model")  # fmt: skip
        return served

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error_response(e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(400, f"body: invalid JSON: {first.get('ctx', {})}", None)
        param = _body_param(first.get("loc", ()))
        return _error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid body')}", param)

    @app.get("/health")
    async def health() -> JSONResponse:
        # what the router's gRPC health says: a ready scheduler, and not draining
        if service.limits is None or service.draining or not service.pool.any_ready:
            return _error_response(503, "not ready", None)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import version as package_version

        return {"version": package_version("sluiceway")}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = model_id()
        limits = service.limits
        assert limits is not None
        return {
            "object": "list",
            "data": [{"id": served, "object": "model", "created": int(time.time()),
                      "owned_by": "sluiceway", "root": limits.model_id,
                      "max_model_len": limits.max_model_len}],
        }  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        request = inference_pb2.TokenizeRequest()
        if body.messages is not None:
            request.messages.messages.extend(
                inference_pb2.ChatMessage(role=m.role, content=_message_text(m, i))
                for i, m in enumerate(body.messages)
            )
        elif body.prompt is not None:
            request.prompt = body.prompt
        else:
            raise ApiError(400, "prompt: set one of prompt, messages", "prompt")
        try:
            ids = await asyncio.to_thread(service._prompt_token_ids, request)
        except InvalidRequest as e:
            raise ApiError(400, str(e), _param(e.field, body.messages is not None)) from None
        limits = service.limits
        return {"count": len(ids), "max_model_len": limits.max_model_len if limits else None,
                "tokens": ids}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        ids = [_integer(t, f"tokens[{i}]") for i, t in enumerate(body.tokens)]
        limits = service.limits
        vocab = limits.vocab_size if limits is not None else None
        for i, t in enumerate(ids):
            if vocab is not None and t >= vocab:
                raise ApiError(400, f"tokens[{i}]: must be < {vocab}, got {t}", f"tokens[{i}]")
        return {"prompt": tokenizer.decode(ids)}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, raw: Request
    ) -> JSONResponse | StreamingResponse:
        served = check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if logprobs == 0:
            logprobs = None  # the chosen token's logprob comes with every token anyway
        max_tokens = body.max_completion_tokens or body.max_tokens
        limits = service.limits
        sampling = _sampling_params(
            body, max_tokens if max_tokens is not None else
            (limits.max_model_len if limits else None), logprobs,
            max_tokens_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
            logprobs_param="top_logprobs",
        )  # fmt: skip
        base = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(**sampling))
        base.messages.messages.extend(
            inference_pb2.ChatMessage(role=m.role, content=_message_text(m, i))
            for i, m in enumerate(body.messages)
        )
        run = _Run(service, body, served, chat=True, logprobs=body.logprobs)
        return await run.respond([base], raw)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, raw: Request
    ) -> JSONResponse | StreamingResponse:
        served = check_model(body.model)
        if body.echo:
            raise ApiError(400, "echo: not supported", "echo")
        sampling = _sampling_params(
            body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs or None
        )
        prompts: list[inference_pb2.GenerateRequest] = []
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            items: list[Any] = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        for i, item in enumerate(items):
            req = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(**sampling))
            if isinstance(item, str):
                req.prompt = item
            else:
                where = "prompt" if len(items) == 1 else f"prompt[{i}]"
                req.prompt_token_ids.ids.extend(_integer(t, where) for t in item)
            prompts.append(req)
        run = _Run(service, body, served, chat=False, logprobs=body.logprobs is not None)
        return await run.respond(prompts, raw)

    return app


class _Run:
    """One HTTP generation request: its ``len(prompts) * n`` choices, each a
    :meth:`InferenceService.generate` stream, merged into OpenAI's shapes."""

    def __init__(
        self,
        service: InferenceService,
        body: ChatCompletionRequest | CompletionRequest,
        model: str,
        *,
        chat: bool,
        logprobs: bool,
    ) -> None:
        self.service = service
        self.body = body
        self.model = model
        self.chat = chat
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + (body.request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self.arrival = time.monotonic()

    async def _stream(
        self, p: int, request: inference_pb2.GenerateRequest
    ) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse], None]:
        """Prompt ``p``'s responses, each with its choice index (``p * n`` + its sample)."""
        n = self.body.n or 1
        async with contextlib.aclosing(
            self.service.generate(
                request, request.request_id, arrival=self.arrival, protocol="http"
            )
        ) as responses:
            async for response in responses:
                yield p * n + response.index, response

    def _merged(
        self, prompts: list[inference_pb2.GenerateRequest]
    ) -> AsyncGenerator[tuple[int, inference_pb2.GenerateResponse], None]:
        """Every choice's responses as they come; a failure of one ends them all."""
        for p, request in enumerate(prompts):
            request.request_id = self.id if len(prompts) == 1 else f"{self.id}-{p}"
        if len(prompts) == 1:
            return self._stream(0, prompts[0])
        return merge_streams([self._stream(p, r) for p, r in enumerate(prompts)])

    def _logprobs(self, response: inference_pb2.GenerateResponse) -> list[dict[str, Any]]:
        tok = self.service.tokenizer

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = tok.decode([token_id])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [
            {**entry(lp.token_id, lp.logprob),
             "top_logprobs": [entry(x.token_id, x.logprob) for x in lp.top_logprobs]}
            for lp in response.logprobs
        ]  # fmt: skip

    def _completion_logprobs(self, entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
        offsets, pos = [], offset
        for e in entries:
            offsets.append(pos)
            pos += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets,
        }  # fmt: skip

    def _usage(self, prompt_tokens: dict[int, int], completion: dict[int, int]) -> dict[str, int]:
        n = self.body.n or 1
        prompt = sum(v for k, v in prompt_tokens.items() if k % n == 0)
        done = sum(completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def respond(
        self, prompts: list[inference_pb2.GenerateRequest], raw: Request
    ) -> JSONResponse | StreamingResponse:
        if self.body.stream:
            stream = self._sse(prompts)
            try:  # the first event: a request refused at once gets its HTTP status
                first = await anext(stream)
            except RequestFailed as e:
                raise self._api_error(e) from None
            return StreamingResponse(_prepend(first, stream), media_type="text/event-stream")
        task = asyncio.create_task(self._whole(prompts))
        watcher = asyncio.create_task(_disconnected(raw))
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:  # the client left: cancel the generation (its blocks come back)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RequestFailed):
                await task
            return _error_response(499, "client disconnected", None)
        watcher.cancel()
        try:
            return JSONResponse(task.result())
        except RequestFailed as e:
            raise self._api_error(e) from None

    def _api_error(self, e: RequestFailed) -> ApiError:
        status, _ = HTTP_STATUS.get(e.code, (500, ""))
        message = e.details
        field = e.field
        if field is None and message.startswith(_CONSTRAINT_FIELD):  # a worker's compile error
            field = message.split(":", 1)[0]
        param = _param(field, self.chat)
        if field is not None and field.startswith(_CONSTRAINT_FIELD):
            param = self._constraint_param(field)
        if field is not None and param is not None and message.startswith(field + ":"):
            message = param + message[len(field) :]
        return ApiError(status, message, param)

    def _constraint_param(self, field: str) -> str:
        """The body field a structured-outputs error names: ``response_format...`` when the
        constraint came from there, else vLLM's ``structured_outputs.<kind>``."""
        fmt = self.body.response_format
        if fmt is not None and fmt.type != "text":
            return (
                "response_format.json_schema.schema"
                if field.endswith(".json")
                else "response_format"
            )
        return field.removeprefix("sampling.")

    async def _whole(self, prompts: list[inference_pb2.GenerateRequest]) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        lps: dict[int, list[dict[str, Any]]] = {}
        finish: dict[int, str] = {}
        prompt_tokens: dict[int, int] = {}
        completion: dict[int, int] = {}
        async with contextlib.aclosing(self._merged(prompts)) as merged:
            async for index, r in merged:
                texts.setdefault(index, []).append(r.text)
                if self.logprobs:
                    lps.setdefault(index, []).extend(self._logprobs(r))
                if r.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    finish[index] = FINISH.get(r.finish_reason, "stop")
                    prompt_tokens[index] = r.usage.prompt_tokens
                    completion[index] = r.usage.completion_tokens
        choices = []
        for index in sorted(texts):
            text = "".join(texts[index])
            choice: dict[str, Any] = {"index": index, "finish_reason": finish.get(index)}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = {"content": lps.get(index, [])} if self.logprobs else None
            else:
                choice["text"] = text
                choice["logprobs"] = (
                    self._completion_logprobs(lps.get(index, []), 0) if self.logprobs else None
                )
            choices.append(choice)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(prompt_tokens, completion),
        }

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

    async def _sse(self, prompts: list[inference_pb2.GenerateRequest]) -> AsyncIterator[str]:
        prompt_tokens: dict[int, int] = {}
        completion: dict[int, int] = {}
        offsets: dict[int, int] = {}
        started: set[int] = set()
        async with contextlib.aclosing(self._merged(prompts)) as merged:
            async for index, r in merged:
                finished = r.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
                choice: dict[str, Any] = {"index": index}
                if self.chat:
                    delta: dict[str, Any] = {"content": r.text}
                    if index not in started:
                        delta = {"role": "assistant", **delta}
                    choice["delta"] = delta
                    choice["logprobs"] = (
                        {"content": self._logprobs(r)} if self.logprobs and r.logprobs else None
                    )
                else:
                    choice["text"] = r.text
                    entries = self._logprobs(r) if self.logprobs else []
                    choice["logprobs"] = (
                        self._completion_logprobs(entries, offsets.get(index, 0))
                        if self.logprobs
                        else None
                    )
                    offsets[index] = offsets.get(index, 0) + len(r.text)
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
    except RequestFailed as e:
        status, kind = HTTP_STATUS.get(e.code, (500, "InternalServerError"))
        error = {"message": e.details, "type": kind, "param": None, "code": status}
        yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"


async def _disconnected(request: Request, poll_s: float = 0.2) -> None:
    """Returns once the client of a non-streamed request has gone."""
    while not await request.is_disconnected():
        await asyncio.sleep(poll_s)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router handles SIGINT/SIGTERM (drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The HTTP API serving in the background on the running event loop."""

    def __init__(self, server: _Server, task: asyncio.Task[None], url: str) -> None:
        self._server = server
        self._task = task
        self.url = url

    async def stop(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def start_http_server(service: InferenceService, host: str, port: int) -> HttpServer:
    """Serve :func:`build_app` on ``host:port`` (0: a free port) on this loop.

    Raises:
        OSError: the port is taken (or any other bind error).
    """
    config = uvicorn.Config(
        build_app(service), host=host, port=port, log_level="warning",
        access_log=False, lifespan="off", timeout_graceful_shutdown=1,
    )  # fmt: skip
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # uvicorn logs a bind error and exits (SystemExit)
            with contextlib.suppress(SystemExit):
                task.result()
            raise OSError(f"cannot listen on {host}:{port} (HTTP)")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return HttpServer(server, task, f"http://{host}:{bound}")
