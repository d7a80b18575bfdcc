"""Nothing in an HTTP body is dropped silently (router/openai_fields.py): an undeclared field
is accepted only when it changes nothing here (ignored, or a refused field with its neutral
value), else a 400 naming it; a body or a JSON schema nested past its cap is a 400 naming where,
not a RecursionError; a gRPC request carrying a field number this server does not know is
INVALID_ARGUMENT naming where; README's field table is the code's.

The app is the real `build_app` over a request path with no scheduler ready: a body that passes
the field checks gets 503 ("no scheduler is ready yet"), one refused gets 400 first."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sluiceway.router.openai_api import build_app
from sluiceway.router.openai_fields import IGNORED, REFUSED
from sluiceway.router.request_path import RequestPath
from sluiceway.sampling_params import MAX_JSON_SCHEMA_DEPTH, SamplingParams
from sluiceway.status import FieldError
from sluiceway.unknown_fields import check_unknown_fields
from sluiceway.v1 import inference_pb2

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}
NOT_READY = (503, "no scheduler is ready yet")


@pytest.fixture(scope="module")
def client() -> TestClient:
    path = RequestPath.__new__(RequestPath)
    path.pool = SimpleNamespace(limits=None)  # type: ignore[assignment]
    return TestClient(build_app(path), raise_server_exceptions=False)


def answer(client: TestClient, url: str, body: dict[str, Any]) -> tuple[int, str]:
    r = client.post(url, json=body)
    error = r.json()["error"]
    if r.status_code == 400:
        assert error["message"].startswith(f"{error['param']}: ")
    return r.status_code, error["message"]


@pytest.mark.parametrize(("url", "base"), [("/v1/chat/completions", CHAT),
                                           ("/v1/completions", COMPLETION)])  # fmt: skip
def test_an_unknown_field_is_400_naming_it(client: TestClient, url: str, base: dict) -> None:
    assert answer(client, url, base | {"temprature": 0}) == (400, "temprature: unknown field")
    assert answer(client, url, base | {"stream_options": {"include_usage": True, "x": 1}}) == (
        400,
        "stream_options.x: unknown field",
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("best_of", 2), ("use_beam_search", True), ("bad_words", ["a"]), ("suffix", "end"),
     ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("length_penalty", 2),
     ("add_generation_prompt", False), ("cache_salt", "s"), ("chat_template", "{{x}}")],
)  # fmt: skip
def test_a_field_not_implemented_is_400_unless_neutral(
    client: TestClient, field: str, value: Any
) -> None:
    assert answer(client, "/v1/completions", COMPLETION | {field: value}) == (
        400,
        f"{field}: not supported by this server",
    )
    neutral = next((v for v in REFUSED[field] if v is not None), None)
    assert answer(client, "/v1/completions", COMPLETION | {field: neutral}) == NOT_READY
    assert answer(client, "/v1/completions", COMPLETION | {field: None}) == NOT_READY


def test_a_refused_field_in_a_nested_object_is_named_by_its_path(client: TestClient) -> None:
    body = CHAT | {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    assert answer(client, "/v1/chat/completions", body) == (
        400,
        "stream_options.continuous_usage_stats: not supported by this server",
    )
    body["stream_options"] = {"continuous_usage_stats": False, "include_usage": True}
    assert answer(client, "/v1/chat/completions", body) == NOT_READY
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x",
                                                           "audio": {"id": "a"}}]}  # fmt: skip
    assert answer(client, "/v1/chat/completions", body) == (400, "messages[1].audio: unknown field")


def test_fields_that_change_nothing_are_accepted(client: TestClient) -> None:
    body = CHAT | {"user": "u-1", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
                   "prompt_cache_key": "k", "safety_identifier": "s"}  # fmt: skip
    assert set(body) - set(CHAT) == set(IGNORED)
    assert answer(client, "/v1/chat/completions", body) == NOT_READY
    assert answer(client, "/v1/completions", COMPLETION | {"user": "u"}) == NOT_READY


def _nested(depth: int) -> str:
    """The issue's schema: `depth` levels of {"type": "array", "items": ...}."""
    return '{"type":"array","items":' * depth + "{}" + "}" * depth


def test_a_body_nested_1000_deep_is_400_naming_where(client: TestClient) -> None:
    schema = json.loads(_nested(100))  # parses; sent as an object, nests 1000 more
    head = '{"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": '
    deep = head + _nested(1000) + "}}"
    r = client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "structured_outputs.json" + ".items" * 6 + "..."
    assert r.json()["error"]["message"].endswith("nested deeper than 128 levels of arrays and "
                                                 "objects")  # fmt: skip
    head = '{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": ' \
           '"json_schema", "json_schema": {"name": "n", "schema": '  # fmt: skip
    body = head + _nested(1000) + "}}}"
    r = client.post("/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("response_format.json_schema.schema.items")
    # within the body's cap: the gate's schema cap answers (needs a ready path: unit-tested below)
    assert answer(client, "/v1/completions", COMPLETION | {"guided_json": schema}) == NOT_READY


@pytest.mark.parametrize("depth", [MAX_JSON_SCHEMA_DEPTH, 1000, 2500])  # 2500: under 64 KiB
def test_a_json_schema_nested_too_deep_is_refused_by_the_gate(depth: int) -> None:
    sampling = inference_pb2.SamplingParams(
        structured_outputs=inference_pb2.StructuredOutputs(json=_nested(depth))
    )
    with pytest.raises(FieldError) as e:
        SamplingParams.from_proto(sampling)
    assert e.value.field == "sampling.structured_outputs.json"
    assert e.value.message == (
        f"the schema nests deeper than {MAX_JSON_SCHEMA_DEPTH} levels (at "
        ".items.items.items.items.items.items.items.items...)"
    )
    ok = _nested(MAX_JSON_SCHEMA_DEPTH - 1)  # the outermost object is level 1
    SamplingParams.from_proto(
        inference_pb2.SamplingParams(structured_outputs=inference_pb2.StructuredOutputs(json=ok))
    )


def test_a_grpc_field_this_server_does_not_know_is_refused_naming_where() -> None:
    known = inference_pb2.SamplingParams(temperature=0.5).SerializeToString()
    sampling = inference_pb2.SamplingParams.FromString(known + bytes([0xA8, 0x06, 0x01]))  # 101
    request = inference_pb2.GenerateRequest(prompt="x", sampling=sampling)
    request = inference_pb2.GenerateRequest.FromString(request.SerializeToString())
    with pytest.raises(FieldError) as e:
        check_unknown_fields(request)
    assert e.value.field == "sampling"
    assert "field number 101" in e.value.message
    messages = inference_pb2.ChatMessages.FromString(
        inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user")])
        .SerializeToString() + bytes([0x12, 0x00])  # field 2 (length-delimited, empty)
    )  # fmt: skip
    check_unknown_fields(inference_pb2.GenerateRequest(prompt="x"))
    if not inference_pb2.ChatMessages.DESCRIPTOR.fields_by_name.get("tools"):
        with pytest.raises(FieldError) as e:
            check_unknown_fields(inference_pb2.GenerateRequest(messages=messages))
        assert e.value.field == "messages"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("http_fields", ROOT / "scripts/http_fields.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_readme_field_table_is_the_codes() -> None:
    script = load_script()
    table = script.render()
    assert script.readme_table((ROOT / "README.md").read_text()) == table, (
        "paste `python scripts/http_fields.py` into README.md"
    )
    # the walk finds what the models declare, nested ones included
    from sluiceway.router.openai_models import ChatCompletionRequest

    names = script.declared(ChatCompletionRequest)
    assert {"messages", "messages[].role", "temperature", "response_format.json_schema.schema",
            "stream_options.include_usage"} <= set(names)  # fmt: skip
    assert not set(names) & (set(IGNORED) | set(REFUSED)), "declared and also ignored/refused"


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [("/v1/completions", {"prompt": "\ud800"}, "prompt"),
     ("/v1/completions", {"prompt": ["ok", "a\udc00b"]}, "prompt[1]"),
     ("/v1/completions", COMPLETION | {"stop": ["x", "\ud800"]}, "stop[1]"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]},
      "messages[0].content"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "\ud83d"}]}]}, "messages[0].content[0].text"),
     ("/v1/completions", COMPLETION | {"guided_json": {"properties": {"\ud800": {}}}},
      "guided_json.properties"),
     ("/tokenize", {"prompt": "\ud800"}, "prompt")],
)  # fmt: skip
def test_a_lone_surrogate_is_400_naming_where(
    client: TestClient, url: str, body: dict[str, Any], param: str
) -> None:
    """JSON may escape half of a UTF-16 pair ("\\ud800"); no UTF-8 text holds it."""
    headers = {"Content-Type": "application/json"}
    r = client.post(url, content=json.dumps(body), headers=headers)  # ASCII: the escape
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert "lone surrogate" in r.json()["error"]["message"]


def test_null_is_unset_for_priority(client: TestClient) -> None:
    assert answer(client, "/v1/completions", COMPLETION | {"priority": None}) == NOT_READY
