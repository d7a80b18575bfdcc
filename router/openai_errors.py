"""Errors of the OpenAI-compatible HTTP API: OpenAI's error object, and a `RequestError` of the
request path presented in this API's words (its HTTP status, and `param` naming the body field
the failing request field came from, read from the error's field, never from its text)."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi.responses import JSONResponse

from sluiceway.status import RequestError

__all__ = ["HTTP_STATUS", "ApiError", "api_error", "error_body", "error_response"]

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


def error_body(status: int, message: str, param: str | None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = next((k for s, k in HTTP_STATUS.values() if s == status), "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


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
        if error.field == f"{_CONSTRAINT_FIELD}.json":
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
        return "messages" + field[len("messages.messages") :]
    if field.startswith("prompt_token_ids"):
        return "prompt"
    return _PARAM_NAMES.get(field, field.removeprefix("sampling."))
