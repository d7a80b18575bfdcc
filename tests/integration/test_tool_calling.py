"""Tool calling end to end on the embedded SmolLM2 (its chat template takes no tools: the
generic tools prompt), with the openai SDK and langchain-openai as clients, and the gRPC
client: a named and a required tool_choice always give calls of the tools whose arguments
parse and validate (10 seeds at temperature 1), streamed arguments join to the whole ones, a
follow-up turn with a tool result answers, n=3 gives three calls, and what cannot be honoured
is a 400 naming the field. The default stack has no --enable-auto-tool-choice: an auto request
is refused. The auto parsers: tests/router/test_tool_parsers.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, http_base_url

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 16}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The current time in a timezone"}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=http_base_url(stack), api_key="none", max_retries=0) as c:
        yield c


def assert_valid_calls(choice: Any, *, count: int | None = None) -> None:
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and (count is None or len(calls) == count), choice
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_forced_calls_parse_and_validate_on_10_seeds(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    # n=10 with seed 1: the samples use seeds 1..10, at temperature 1
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
        temperature=1.0, seed=1, n=10, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    assert len(response.choices) == 10
    for choice in response.choices:
        assert_valid_calls(choice)
        if tool_choice is NAMED:
            assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
            assert choice.message.content is None


def streamed_calls(client: openai.OpenAI, **body: Any) -> tuple[list[dict[str, str]], str]:
    """The calls of a streamed answer, joined by index; its finish reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # a call's first piece: its id and name
                    assert delta.id and delta.function and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                          "arguments": ""}  # fmt: skip
                else:  # the same index goes on: no new id
                    assert not delta.id
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_arguments_join_to_the_whole_ones(client: openai.OpenAI, tool_choice: Any) -> None:
    body = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip
    whole = client.chat.completions.create(**body).choices[0]  # type: ignore[call-overload]
    assert_valid_calls(whole)
    streamed, finish = streamed_calls(client, **body)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_follow_up_turn_with_a_tool_result_answers(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=NAMED, temperature=0,
        max_tokens=MAX_TOKENS,
    ).choices[0]  # fmt: skip
    call = first.message.tool_calls[0]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=40,
    ).choices[0]  # fmt: skip
    assert answer.finish_reason in ("stop", "length")
    assert answer.message.content and not answer.message.tool_calls


def test_n3_gives_three_calls(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert_valid_calls(choice, count=1)


def test_langchain_bind_tools_required(stack: Stack) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=http_base_url(stack), api_key="none", model=MODEL,
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0)  # fmt: skip
    message = llm.bind_tools([get_weather], tool_choice="required").invoke(
        "What is the weather like in Paris?"
    )
    assert message.tool_calls, message
    assert message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)


def test_grpc_named_tool_choice(stack: Stack) -> None:
    tool = inference_pb2.Tool(name="get_weather", parameters=json.dumps(WEATHER))
    request = Client.request(
        messages=[("user", QUESTION[0]["content"])], tools=[tool], tool_choice="get_weather",
        temperature=0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    with stack.client() as grpc_client:
        responses = list(grpc_client.generate_stream(request, timeout=120))
    pieces = [c for r in responses for c in r.tool_calls]
    assert pieces[0].index == 0 and pieces[0].name == "get_weather"
    assert pieces[0].id.startswith("call_")
    assert all(p.index == 0 and not p.id for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.arguments for p in pieces)), WEATHER)
    assert responses[-1].finish_reason == inference_pb2.FINISH_REASON_TOOL_CALLS
    assert "".join(r.text for r in responses) == ""


def test_sluiceway_generate_prints_the_calls(stack: Stack) -> None:
    tool = json.dumps({"name": "get_weather", "parameters": WEATHER})
    result = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "generate", "--target", stack.target,
         QUESTION[0]["content"], "--tool", tool, "--tool-choice", "get_weather",
         "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--show-usage"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("tool call get_weather {"), result.stdout
    arguments = result.stdout.removeprefix("tool call get_weather ")
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert "finish reason tool_calls" in result.stderr


def refusal(client: openai.OpenAI, **body: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **body)
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # auto by default: this stack has no parser
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}], "tool_choice": "required"},
         "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
         "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": TOOLS, "tool_choice": NAMED,
          "extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured_outputs"),
    ],
    ids=["default-auto", "auto", "no-tools", "unknown-function", "tool-type", "tool-name",
         "response-format", "structured-outputs"],
)  # fmt: skip
def test_refused_with_400_naming_the_field(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    error = refusal(client, **body)
    assert error.status_code == 400
    assert error.body["param"] == param, error.body  # type: ignore[index]


def test_a_function_without_parameters_is_called_in_few_tokens(client: openai.OpenAI) -> None:
    # a JSON-schema constraint let SmolLM2 (greedy) fill "parameters": { with newlines until
    # max_tokens (120 tokens, finish "length"); the call grammar bounds whitespace: 25 tokens
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="required", parallel_tool_calls=False, temperature=0.0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("f", "{}")
    assert response.usage is not None and response.usage.completion_tokens == 25
