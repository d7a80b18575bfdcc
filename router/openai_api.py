"""The OpenAI-compatible HTTP API of the router (what vLLM, SGLang and TGI serve).

FastAPI on the router's own event loop (uvicorn), beside the gRPC server, over the same
:meth:`router.request_path.RequestPath.generate` path (the gRPC front's peer: neither
imports the other): the same validation, tokenization, chat
template, detokenization, stop strings, retries, metrics and logs. A request body becomes a
``sluiceway.v1.GenerateRequest`` (OpenAI's parameter names, vLLM's extra-body names for the
rest) and the responses come back in OpenAI's shapes.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (non-streamed, or streamed
as server-sent events: ``data: {chunk}`` lines, ``data: [DONE]`` last,
``stream_options.include_usage`` for a final usage chunk), ``GET /v1/models``, ``GET /health``,
``GET /version``, ``POST /tokenize``, ``POST /detokenize``. With API keys
(``--api-key``), every path but /health and /version needs ``Authorization: Bearer KEY``
(401 otherwise); over TLS with ``--ssl-certfile`` (docs/security.md).

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
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluiceway.options import DEFAULT_MAX_MESSAGE_BYTES
from sluiceway.router.auth import UNAUTHORIZED, ApiKeys
from sluiceway.router.config import RouterConfig
from sluiceway.router.openai_errors import (
    ApiError,
    add_error_handlers,
    api_error,
    error_response,
)
from sluiceway.router.openai_fields import check_body_fields, check_json_nesting
from sluiceway.router.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ToolDefinition,
    sampling_values,
)
from sluiceway.router.openai_responses import Run
from sluiceway.router.request_path import RequestPath
from sluiceway.sampling_params import check_wire_integers, sampling_proto
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2

__all__ = ["HttpServer", "build_app", "start_http_server"]

# A completion's `max_tokens` when the body leaves it out (OpenAI's and vLLM's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def _sampling(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    *,
    chat: bool,
    names: dict[str, str],
) -> inference_pb2.SamplingParams:
    """`body`'s sampling parameters as the proto (its ranges are the request path's to
    check). Raises ApiError (400) for what cannot be expressed in it."""
    try:
        values = sampling_values(body, max_tokens, logprobs)
    except FieldError as e:  # named in this API's words already
        raise ApiError(400, e.details, e.field) from None
    try:
        return sampling_proto(values)
    except FieldError as e:
        raise api_error(e, chat=chat, names=names) from None


def _check_prompt_logprobs(body: ChatCompletionRequest | CompletionRequest) -> None:
    """vLLM's rule: prompt_logprobs come in the whole response only (400 with stream)."""
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs: not available with stream: true", "prompt_logprobs")


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


def _chat_messages(messages: list[ChatMessage]) -> list[inference_pb2.ChatMessage]:
    out = []
    for i, m in enumerate(messages):
        message = inference_pb2.ChatMessage(
            role=m.role,
            content=_message_text(m, i),
            tool_call_id=m.tool_call_id or "",
            name=m.name or "",
        )
        for j, call in enumerate(m.tool_calls or []):
            if call.type != "function":
                where = f"messages[{i}].tool_calls[{j}].type"
                raise ApiError(400, f'{where}: must be "function"; got {call.type!r}', where)
            message.tool_calls.add(
                id=call.id, name=call.function.name, arguments=call.function.arguments
            )
        out.append(message)
    return out


_TOOL_CHOICE_MODES = {
    "none": inference_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _tool_definitions(
    tools: list[ToolDefinition] | None, messages: inference_pb2.ChatMessages
) -> None:
    """Adds `tools` to `messages` (the request path checks them). Raises ApiError (400) for a
    tool type other than ``function``."""
    for i, tool in enumerate(tools or []):
        if tool.type != "function":
            where = f"tools[{i}].type"
            raise ApiError(400, f'{where}: only "function" tools are served; got {tool.type!r}',
                           where)  # fmt: skip
        f = tool.function
        try:
            parameters = json.dumps(f.parameters) if f.parameters is not None else ""
        except (ValueError, RecursionError):
            where = f"tools[{i}].function.parameters"
            raise ApiError(400, f"{where}: not a JSON schema object", where) from None
        messages.tools.add(name=f.name, description=f.description or "", parameters=parameters)


def _tools(body: ChatCompletionRequest, messages: inference_pb2.ChatMessages) -> None:
    """Sets `body`'s tools, tool_choice and parallel_tool_calls on `messages` (the request
    path checks them). Raises ApiError (400) for a tool or choice type other than
    ``function``."""
    _tool_definitions(body.tools, messages)
    choice = body.tool_choice
    if isinstance(choice, str):
        messages.tool_choice.mode = _TOOL_CHOICE_MODES[choice]
    elif choice is not None:
        if choice.type != "function":
            raise ApiError(400, f'tool_choice.type: must be "function"; got {choice.type!r}',
                           "tool_choice.type")  # fmt: skip
        messages.tool_choice.function_name = choice.function.name
    if body.parallel_tool_calls is not None:
        messages.parallel_tool_calls = body.parallel_tool_calls


def _token_ids(ids: list[int], where: str) -> list[int]:
    """`ids` if each fits a token id's proto type (uint32; the vocabulary is checked later),
    else a 400 naming ``where[i]``."""
    try:
        check_wire_integers(inference_pb2.TokenIds, "ids", ids, where)
    except FieldError as e:
        raise ApiError(400, e.details, e.field) from None
    return ids


def _priority(body: ChatCompletionRequest | CompletionRequest) -> int:
    """`body.priority` (null or unset: 0) if it fits GenerateRequest.priority (int32), else a
    400 naming it (the scheduler checks what its policy accepts)."""
    priority = body.priority or 0
    try:
        check_wire_integers(inference_pb2.GenerateRequest, "priority", priority, "priority")
    except FieldError as e:
        raise ApiError(400, e.details, e.field) from None
    return priority


class _Served:
    """The served model's name, as the schedulers report it (`--served-model-name`)."""

    def __init__(self, path: RequestPath) -> None:
        self.path = path

    def model_id(self) -> str:
        limits = self.path.limits
        if limits is None:
            raise ApiError(503, "no scheduler is ready yet")
        return limits.model_id

    def check(self, name: str | None) -> str:
        """The served name; a 404 when the body names another model."""
        served = self.model_id()
        if name is not None and name != served:
            raise ApiError(404, f"the model `{name}` does not exist (this server serves "
                           f"`{served}`)", "model")  # fmt: skip
        return served


class _CheckedJsonRoute(APIRoute):
    """A route whose JSON body's nesting is checked before FastAPI parses it
    (`check_json_nesting`: a 400 naming where, not a RecursionError)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method == "POST":
                check_json_nesting(await request.body())  # cached for FastAPI's own read
            return await handler(request)

        return checked


# Paths open without an API key (vLLM keeps /health open too); /metrics is on its own port.
OPEN_PATHS = frozenset({"/health", "/version"})


class _RequireApiKey:
    """ASGI middleware: a request to any path but `OPEN_PATHS` without ``Authorization:
    Bearer KEY`` of a valid key gets 401 in OpenAI's error shape (the same answer for a
    missing and a wrong key), with ``WWW-Authenticate: Bearer``; it never reaches the app."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["path"] not in OPEN_PATHS
            and not self.keys.allows(Headers(scope=scope).get("authorization"))
        ):
            headers = {"WWW-Authenticate": "Bearer"}
            await error_response(401, UNAUTHORIZED, None, headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _LimitBody:
    """ASGI middleware: a request body over `limit` bytes (the router's --max-message-size,
    the gRPC API's bound) gets 413 in OpenAI's error shape before the app reads any of it:
    at once when its Content-Length says so, else as soon as the chunks received pass the
    limit (the body is held until complete, then handed to the app as received)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the request body is over {self.limit} bytes, the server's limit (--max-message-size)"
        )
        await error_response(413, message, None)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large(scope, receive, send)
            return
        held: list[Message] = []
        size = 0
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":  # a disconnect: the app sees it
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return held.pop(0) if held else await receive()

        await self.app(scope, replay, send)


def build_app(
    path: RequestPath,
    api_keys: ApiKeys | None = None,
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> FastAPI:
    """The FastAPI application over `path` (see the module docstring); with `api_keys`,
    every path but `OPEN_PATHS` needs one (401 otherwise); a body over `max_body_bytes`
    gets 413."""
    app = FastAPI(title="sluiceway", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = _CheckedJsonRoute
    app.add_middleware(_LimitBody, limit=max_body_bytes)
    if api_keys is not None:  # added last: outermost, so a request without a key is not read
        app.add_middleware(_RequireApiKey, keys=api_keys)
    add_error_handlers(app)
    served = _Served(path)
    _add_info_routes(app, path, served)
    _add_generation_routes(app, path, served)
    return app


def _add_info_routes(app: FastAPI, path: RequestPath, served: _Served) -> None:
    """/health, /version, /v1/models, /tokenize and /detokenize."""

    @app.get("/health")
    async def health() -> JSONResponse:
        # what the router's gRPC health says: a ready scheduler, and not draining
        if not path.serving:
            return error_response(503, "not ready", None)
        return JSONResponse({})

    @app.get("/version")
    async def version() -> dict[str, str]:
        from importlib.metadata import version as package_version

        return {"version": package_version("sluiceway")}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = served.model_id()
        limits = path.limits
        assert limits is not None
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": int(time.time()),
                      "owned_by": "sluiceway", "root": limits.model_id,
                      "max_model_len": limits.max_model_len}],
        }  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_body_fields(body)
        served.check(body.model)
        request = inference_pb2.TokenizeRequest()
        if body.messages is not None:
            request.messages.messages.extend(_chat_messages(body.messages))
            _tool_definitions(body.tools, request.messages)
        elif body.prompt is not None:
            request.prompt = body.prompt
        else:
            raise ApiError(400, "prompt: set one of prompt, messages", "prompt")
        try:
            ids = await asyncio.to_thread(path.prompt_token_ids, request)
        except FieldError as e:
            raise api_error(e, chat=body.messages is not None) from None
        limits = path.limits
        return {"count": len(ids), "max_model_len": limits.max_model_len if limits else None,
                "tokens": ids}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_body_fields(body)
        served.check(body.model)
        ids = _token_ids(body.tokens, "tokens")
        limits = path.limits
        vocab = limits.vocab_size if limits is not None else None
        for i, t in enumerate(ids):
            if vocab is not None and t >= vocab:
                raise ApiError(400, f"tokens[{i}]: must be < {vocab}, got {t}", f"tokens[{i}]")
        return {"prompt": path.tokenizer.decode(ids)}


def _add_generation_routes(app: FastAPI, path: RequestPath, served: _Served) -> None:
    """/v1/chat/completions and /v1/completions."""

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, raw: Request
    ) -> JSONResponse | StreamingResponse:
        check_body_fields(body)
        model = served.check(body.model)
        _check_prompt_logprobs(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        # logprobs: true alone = each token's logprob, no alternatives (OpenAI's; proto 0)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_tokens
        names = {}
        if body.max_completion_tokens is not None:  # OpenAI's newer name wins; 0 is refused
            max_tokens = body.max_completion_tokens
            names["sampling.max_tokens"] = "max_completion_tokens"
        if max_tokens is None and path.limits is not None:  # no limit: as long as fits
            max_tokens = path.limits.max_model_len
        sampling = _sampling(body, max_tokens, logprobs, chat=True, names=names)
        base = inference_pb2.GenerateRequest(sampling=sampling, priority=_priority(body))
        base.messages.messages.extend(_chat_messages(body.messages))
        _tools(body, base.messages)
        run = Run(path, body, model, chat=True, logprobs=body.logprobs, names=names)
        return await run.respond([base], raw)

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, raw: Request
    ) -> JSONResponse | StreamingResponse:
        check_body_fields(body)
        model = served.check(body.model)
        _check_prompt_logprobs(body)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        # vLLM's: echo with max_tokens 0 returns the prompt alone (one token is generated and
        # left out); echo with logprobs asks for the prompt's logprobs too
        echo_only = body.echo and max_tokens == 0
        sampling = _sampling(
            body, 1 if echo_only else max_tokens, body.logprobs, chat=False, names={}
        )
        if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
            sampling.prompt_logprobs = body.logprobs
        priority = _priority(body)
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            items: list[Any] = [p]
        else:
            items = list(p)
        if not items:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        prompts: list[inference_pb2.GenerateRequest] = []
        for i, item in enumerate(items):
            req = inference_pb2.GenerateRequest(sampling=sampling, priority=priority)
            if isinstance(item, str):
                req.prompt = item
            else:
                req.prompt_token_ids.ids.extend(
                    _token_ids(item, "prompt" if len(items) == 1 else f"prompt[{i}]")
                )
            prompts.append(req)
        echo = None
        if body.echo:  # each prompt's text: as sent, or its token ids decoded
            echo = [item if isinstance(item, str) else path.tokenizer.decode(item)
                    for item in items]  # fmt: skip
        run = Run(path, body, model, chat=False, logprobs=body.logprobs is not None,
                  echo=echo, echo_only=echo_only)  # fmt: skip
        return await run.respond(prompts, raw)


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


async def start_http_server(
    path: RequestPath,
    host: str,
    port: int,
    *,
    api_keys: ApiKeys | None = None,
    tls: RouterConfig | None = None,
    max_body_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> HttpServer:
    """Serve :func:`build_app` on ``host:port`` (0: a free port) on this loop; with
    `api_keys` and `max_body_bytes` (see `build_app`); over TLS when `tls` (the router's config) has
    ``ssl_certfile`` (uvicorn's ``ssl_*`` settings, as vLLM passes them; client certificates
    as ``RouterConfig.client_cert_required`` says).

    Raises:
        OSError: the port is taken (or any other bind error).
    """
    ssl: dict[str, Any] = {}
    if tls is not None and tls.tls:
        ssl = {"ssl_certfile": tls.ssl_certfile, "ssl_keyfile": tls.ssl_keyfile,
               "ssl_ca_certs": tls.ssl_ca_certs,
               "ssl_cert_reqs": 2 if tls.client_cert_required else 0}  # fmt: skip
    config = uvicorn.Config(
        build_app(path, api_keys, max_body_bytes), host=host, port=port, log_level="warning",
        access_log=False, lifespan="off", timeout_graceful_shutdown=1, **ssl,
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
    scheme = "https" if ssl else "http"
    return HttpServer(server, task, f"{scheme}://{host}:{bound}")
