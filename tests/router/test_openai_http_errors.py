"""Every failure of the OpenAI-compatible HTTP API answers OpenAI's error object, FastAPI's and
Starlette's own too: an unknown path, a wrong method, a body that is not JSON by its
Content-Type, JSON that does not parse (with its line and column), a body over the size limit,
an unexpected exception.

The app is the real `build_app` over a request path that is never reached (each request here
fails before its endpoint runs, or, for the 500, in it)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from sluiceway.router.openai_api import build_app
from sluiceway.router.request_path import RequestPath


@pytest.fixture(scope="module")
def client() -> TestClient:
    unready = RequestPath.__new__(RequestPath)  # no attribute set: any use of it raises
    return TestClient(build_app(unready), raise_server_exceptions=False)


def error(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def test_an_unknown_path_is_404(client: TestClient) -> None:
    r = client.post("/v1/chat/completion", json={"messages": []})
    assert (r.status_code, r.json()) == (
        404,
        error(404, "NotFoundError", "no such endpoint: POST /v1/chat/completion"),
    )
    assert client.get("/").json() == error(404, "NotFoundError", "no such endpoint: GET /")


def test_a_wrong_method_is_405_with_allow(client: TestClient) -> None:
    r = client.get("/v1/completions")
    assert (r.status_code, r.headers["allow"], r.json()) == (
        405,
        "POST",
        error(405, "MethodNotAllowedError",
              "method not allowed: GET /v1/completions (allowed: POST)"),
    )  # fmt: skip
    r = client.post("/v1/models")
    assert (r.status_code, r.json()["error"]["message"]) == (
        405,
        "method not allowed: POST /v1/models (allowed: GET)",
    )


@pytest.mark.parametrize(
    ("headers", "shown"),
    [
        ({"Content-Type": "text/plain"}, "text/plain"),
        ({"Content-Type": "application/x-www-form-urlencoded"},  # curl -d without -H
         "application/x-www-form-urlencoded"),
        ({}, "none"),
    ],
)  # fmt: skip
def test_a_body_that_is_not_json_by_its_content_type_is_415(
    client: TestClient, headers: dict[str, str], shown: str
) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    assert (r.status_code, r.json()) == (
        415,
        error(415, "UnsupportedMediaTypeError",
              f"Content-Type: must be application/json, got {shown}"),
    )  # fmt: skip


def test_json_that_does_not_parse_is_400_with_its_line_and_column(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        content=b'{\n  "prompt": [}\n',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert (r.status_code, r.json()) == (
        400,
        error(400, "BadRequestError",
              "body: invalid JSON: Expecting value: line 2 column 14 (char 15)"),
    )  # fmt: skip


def test_a_body_over_the_limit_is_413_whether_its_length_is_given_or_not() -> None:
    unready = RequestPath.__new__(RequestPath)
    small = TestClient(build_app(unready, max_body_bytes=1000), raise_server_exceptions=False)
    too_large = error(413, "RequestTooLargeError",
                      "the request body is over 1000 bytes, the server's limit "
                      "(--max-message-size)")  # fmt: skip
    json_type = {"Content-Type": "application/json"}
    over = b'{"prompt": "' + b"x" * 1000 + b'"}'
    r = small.post("/v1/completions", content=over, headers=json_type)  # Content-Length
    assert (r.status_code, r.json()) == (413, too_large)
    chunks = [over[i : i + 300] for i in range(0, len(over), 300)]  # chunked, no length
    r = small.post("/v1/completions", content=iter(chunks), headers=json_type)
    assert (r.status_code, r.json()) == (413, too_large)
    # At the limit the body reaches the app whole, in one piece or in chunks: its JSON error
    # is at the column of the end of all 1000 bytes
    under = b'{"prompt": "' + b"x" * 987 + b"]"
    assert len(under) == 1000
    parse_error = error(400, "BadRequestError",
                        "body: invalid JSON: Unterminated string starting at: line 1 column 12 "
                        "(char 11)")  # fmt: skip
    for content in (under, iter([under[:400], under[400:]])):
        r = small.post("/v1/completions", content=content, headers=json_type)
        assert (r.status_code, r.json()) == (400, parse_error)


def test_an_unexpected_exception_is_500_in_the_same_shape(client: TestClient) -> None:
    r = client.get("/v1/models")  # the request path has no pool: AttributeError
    assert (r.status_code, r.json()) == (
        500,
        error(500, "InternalServerError", "internal error (the server's log has the cause)"),
    )


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "any"}, "tool_choice", "Input should be 'none', 'auto' or 'required'"),
        ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", "Field required"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "Field required"),
    ],
)  # fmt: skip
def test_a_tool_field_that_does_not_validate_is_400_naming_it(
    client: TestClient, body: dict[str, Any], param: str, message: str
) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [], **body})
    assert (r.status_code, r.json()["error"]["param"]) == (400, param)
    assert r.json()["error"]["message"] == f"{param}: {message}"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": False}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [2, True]}, "stop_token_ids[1]"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"7": True}}, "logit_bias[7]"),
        ("/v1/chat/completions", {"messages": [], "max_completion_tokens": True},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [], "top_logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": [], "priority": False}, "priority"),
    ],
)  # fmt: skip
def test_a_boolean_where_a_number_belongs_is_400_naming_it(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    """pydantic's lax mode reads true as 1: ``"max_tokens": true`` would ask for one token."""
    r = client.post(path, json=body)
    assert (r.status_code, r.json()["error"]["param"]) == (400, param)
    assert r.json()["error"]["message"] == f"{param}: must be a number, not a boolean"


PROMPT_SHAPES = (
    "prompt: must be a string, a list of strings, a list of token ids or a list of lists of "
    "token ids (integers)"
)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/completions", {"prompt": [True, 5, 6]}, PROMPT_SHAPES),  # not token ids 1, 5, 6
        ("/v1/completions", {"prompt": [[1, False]]}, PROMPT_SHAPES),
        ("/v1/completions", {"prompt": 5}, PROMPT_SHAPES),
        ("/detokenize", {"tokens": [True]}, "tokens[0]: must be a number, not a boolean"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"true": 5}},  # a key in brackets
         "logit_bias[true]: Input should be a valid integer, unable to parse string as an integer"),
        ("/v1/completions", {"prompt": "x", "echo": 1}, "echo: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "x", "stream": "on"},
         "stream: Input should be a valid boolean"),
        ("/v1/completions", {"prompt": "x", "ignore_eos": "true"},
         "ignore_eos: Input should be a valid boolean"),
        ("/v1/chat/completions", {"messages": [], "logprobs": 1},
         "logprobs: Input should be a valid boolean"),
        ("/v1/chat/completions", {"messages": [], "stream_options": {"include_usage": 0}},
         "stream_options.include_usage: Input should be a valid boolean"),
    ],
)  # fmt: skip
def test_token_ids_are_integers_and_booleans_are_json_booleans(
    client: TestClient, path: str, body: dict[str, Any], message: str
) -> None:
    """Lax pydantic would read ``[true, 5]`` as token ids 1 and 5, ``"echo": 1`` and
    ``"stream": "on"`` as true: each is a 400 naming the field instead."""
    r = client.post(path, json=body)
    assert (r.status_code, r.json()["error"]["message"]) == (400, message)
