"""Errors of the OpenAI-compatible HTTP API: OpenAI's error object, and a `RequestError` of the
request path presented in this API's words (its HTTP status, and `param` naming the body field
the failing request field came from, read from the error's field, never from its text).

`add_error_handlers` gives every answer that is not a success this shape, FastAPI's and
Starlette's own included: an unknown path (404), a method the path does not take (405, with
its ``Allow`` header), a body that is not JSON by its Content-Type (415: what was sent is not
what the endpoint reads; vLLM answers 400 with pydantic's "Input should be a valid
dictionary", which hides the cause), JSON that does not parse (400, with the line and column
where it broke, as OpenAI answers 400 for it), a body that does not validate (400 naming the
field), and an unexpected exception (500)."""

from __future__ import annotations

import email.message
import re
from collections.abc import Mapping
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from sluiceway.status import RequestError

__all__ = [
    "HTTP_STATUS",
    "ApiError",
    "add_error_handlers",
    "api_error",
    "error_body",
    "error_response",
]

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "BadRequestError"),
    grpc.StatusCode.NOT_FOUND: (404, "NotFoundError"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "RateLimitError"),
    grpc.StatusCode.UNAVAILABLE: (503, "ServiceUnavailableError"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "TimeoutError"),
}

# request fields (the public proto's words) -> this API's, where they differ
_PARAM_NAMES = {"input": "prompt", "request_id": "request_id"}
_CONSTRAINT_FIELD = "sampling.structured_outputs"


class ApiError(Exception):
    """An error answered with OpenAI's error object: `status` (HTTP), `message` (whole, the
    param first where there is one) and `param` (the body field at fault, or None)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


# an error's `type`: the name of the exception the openai SDK raises for its status
ERROR_TYPES = {status: kind for status, kind in HTTP_STATUS.values()} | {
    401: "AuthenticationError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
}


def error_body(status: int, message: str, param: str | None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, param: str | None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """`error_body` as a response with HTTP status `status` (and `headers`)."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Answers every failure of `app` with OpenAI's error object (the module docstring)."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, e.param)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        allow = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow")
        message = {
            404: f"no such endpoint: {where}",
            405: f"method not allowed: {where} (allowed: {allow})",
        }.get(e.status_code, str(e.detail))
        return error_response(e.status_code, message, None, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, e: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type")
        if not _is_json(content_type):  # FastAPI passed the body on as bytes: never valid
            return error_response(
                415, f"Content-Type: must be application/json, got {content_type or 'none'}", None
            )
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, f"body: invalid JSON: {_where(first, e.body)}", None)
        param = _body_param(first.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid body')}", param)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        # Starlette still raises `e` after this answer: the server logs it
        return error_response(500, "internal error (the server's log has the cause)", None)


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is one whose body FastAPI parses as JSON (its own test)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def _where(error: dict[str, Any], body: Any) -> str:
    """A JSON decode error of FastAPI's with its place in `body`, as Python's json module
    writes it: ``Expecting value: line 2 column 13 (char 14)``."""
    pos = int(error["loc"][1])
    doc = body.decode(errors="replace") if isinstance(body, bytes) else str(body)
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)
    what = error.get("ctx", {}).get("error", "invalid")
    return f"{what}: line {line} column {column} (char {pos})"


# pydantic's names for the member of a union that failed ("str", "list[int]",
# "literal['none','auto']", a model's class name), not fields (body fields are snake_case)
_TYPE_TAG = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*|[A-Z]\w*)$"
)


def _body_param(loc: Any) -> str | None:
    """The body field a pydantic error location names, in this API's words:
    ``("body", "messages", 0, "role")`` -> ``messages[0].role``; a map's key in brackets, as
    the request path writes it (``("body", "logit_bias", "5")`` -> ``logit_bias[5]``, a key
    that is not one: ``(..., "true", "[key]")`` -> ``logit_bias[true]``); union member tags
    dropped."""
    parts = list(loc)[1:]
    out = ""
    for i, part in enumerate(parts):
        is_key = str(part).isdigit() or (i + 1 < len(parts) and parts[i + 1] == "[key]")
        if isinstance(part, int) or (is_key and out):
            out += f"[{part}]"
        elif part != "[key]" and not _TYPE_TAG.match(str(part)):
            out += f".{part}" if out else str(part)
    return out or None


def api_error(
    error: RequestError,
    *,
    chat: bool,
    names: dict[str, str] | None = None,
    constraint_param: str | None = None,
) -> ApiError:
    """`error` in this API's words: its HTTP status and its field as a body `param`.

    Args:
        error: a failure of the request path (its field in the public proto's words).
        chat: the request came to /v1/chat/completions (messages, top_logprobs).
        names: request fields the endpoint named otherwise, e.g. {"sampling.max_tokens":
            "max_completion_tokens"}.
        constraint_param: the body field a structured-outputs constraint came from when it
            was not vLLM's `structured_outputs` (``response_format``).
    """
    status, _ = HTTP_STATUS.get(error.code, (500, ""))
    param = body_param(error.field, chat=chat, names=names or {})
    if param is not None and param.startswith("structured_outputs") and constraint_param:
        param = constraint_param
        if error.field == f"{_CONSTRAINT_FIELD}.json" and constraint_param == "response_format":
            param = "response_format.json_schema.schema"
    message = f"{param}: {error.message}" if param else error.message
    return ApiError(status, message, param)


def body_param(field: str | None, *, chat: bool, names: dict[str, str]) -> str | None:
    """The body field that request field `field` came from (None for None)."""
    if field is None:
        return None
    if field in names:
        return names[field]
    if field == "sampling.logprobs":
        return "top_logprobs" if chat else "logprobs"
    if field == "input" and chat:
        return "messages"
    if field.startswith("messages.messages"):
        field = "messages" + field[len("messages.messages") :]
    if field.startswith("messages["):  # a call's name and arguments are its function's
        return re.sub(r"(tool_calls\[\d+\])\.(name|arguments)$", r"\1.function.\2", field)
    if field.startswith("messages.tools"):  # messages.tools[2].name: tools[2].function.name
        return re.sub(r"^(tools\[\d+\])\.", r"\1.function.", field[len("messages.") :])
    if field.startswith("messages.tool_choice"):
        return "tool_choice" + field[len("messages.tool_choice") :].replace(
            ".function_name", ".function.name"
        )
    if field.startswith("messages."):
        return field[len("messages.") :]
    if field.startswith("prompt_token_ids"):
        return "prompt"
    return _PARAM_NAMES.get(field, field.removeprefix("sampling."))
