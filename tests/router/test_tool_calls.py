"""Tool calling on the request path: the grammar of a required / named tool_choice (its JSON
schema accepts exactly the valid calls, and xgrammar compiles it into a grammar that accepts
and refuses the same strings), the plan of tools and tool_choice and the fields its refusals
name, the HTTP names of those fields, and the rendering of tools and tool turns: the generic
prompt for SmolLM2's template (exact text) and a tools-aware template given exactly what
transformers' apply_chat_template takes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from sluiceway.router.config import RouterConfig
from sluiceway.router.openai_errors import body_param
from sluiceway.router.tokenizer import encode_chat, template_takes_tools
from sluiceway.router.tool_calls import (
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    ToolPlan,
    call_constraint,
    chat_conversation,
    named_schema,
    parse_tools,
    plan_tools,
    required_schema,
    tool_call_responses,
)
from sluiceway.sampling_params import SamplingParams
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2 as pb

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}


def tools_msg(**fields: Any) -> pb.ChatMessages:
    msg = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[
            pb.Tool(name="get_weather", description="Weather of a city",
                    parameters=json.dumps(WEATHER)),
            pb.Tool(name="get_time", parameters=json.dumps(TIME)),
        ],
    )  # fmt: skip
    for name, value in fields.items():
        if name == "mode":
            msg.tool_choice.mode = value
        elif name == "function":
            msg.tool_choice.function_name = value
        else:
            setattr(msg, name, value)
    return msg


GOOD = [
    [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
     {"name": "get_time", "parameters": {"tz": "UTC"}}],
]  # fmt: skip
BAD = [
    [],  # no call
    [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # city missing
    [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
    [{"name": "delete_all", "parameters": {}}],  # not a tool
    [{"name": "get_time"}],  # no parameters
    [{"name": "get_time", "parameters": {"tz": "UTC"}, "extra": 1}],
    {"name": "get_time", "parameters": {"tz": "UTC"}},  # not an array
]


def test_required_schema_accepts_exactly_valid_calls() -> None:
    schema = required_schema(parse_tools(tools_msg()), parallel=True)
    for calls in GOOD:
        jsonschema.validate(calls, schema)
    for calls in BAD:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(calls, schema)


def test_required_schema_without_parallel_calls_is_one_call() -> None:
    schema = required_schema(parse_tools(tools_msg()), parallel=False)
    jsonschema.validate(GOOD[0], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(GOOD[1], schema)


def test_xgrammar_compiles_the_constraints_to_the_same_language() -> None:
    xgr = pytest.importorskip("xgrammar")
    accepts = xgr.testing._is_grammar_accept_string
    required = xgr.Grammar.from_json_schema(
        json.dumps(required_schema(parse_tools(tools_msg()), parallel=True))
    )
    for calls in GOOD:
        assert accepts(required, json.dumps(calls))
    for calls in BAD:
        assert not accepts(required, json.dumps(calls)), calls
    named = xgr.Grammar.from_json_schema(json.dumps(named_schema(parse_tools(tools_msg())[0])))
    assert accepts(named, '{"city": "Paris", "unit": "fahrenheit"}')
    assert not accepts(named, '{"unit": "fahrenheit"}')
    assert not accepts(named, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')


def test_plans() -> None:
    auto = plan_tools(tools_msg(), parser="hermes", auto_enabled=True)
    assert auto is not None and (auto.mode, auto.parser) == ("auto", "hermes")
    assert auto.constraint() is None
    assert auto.sampling(pb.SamplingParams()).skip_special_tokens is False  # markers kept
    kept = auto.sampling(pb.SamplingParams(skip_special_tokens=True))
    assert kept.skip_special_tokens is True  # the request's own choice wins
    named = plan_tools(tools_msg(function="get_time"), parser=None, auto_enabled=False)
    assert named == ToolPlan("named", tuple(parse_tools(tools_msg())), "get_time", True, None)
    assert named.sampling(pb.SamplingParams()).structured_outputs == call_constraint(TIME)
    required = plan_tools(
        tools_msg(mode=pb.TOOL_CHOICE_MODE_REQUIRED, parallel_tool_calls=False),
        parser="hermes", auto_enabled=True,
    )  # fmt: skip
    assert required is not None and required.mode == "required" and not required.parallel
    constraint = required.sampling(pb.SamplingParams()).structured_outputs
    assert constraint == call_constraint(required_schema(parse_tools(tools_msg()), False))
    none = plan_tools(tools_msg(mode=pb.TOOL_CHOICE_MODE_NONE), parser=None, auto_enabled=False)
    assert none is not None and none.mode == "none" and none.stream() is None
    assert plan_tools(pb.ChatMessages(), parser=None, auto_enabled=False) is None


def with_tools(tools: list[pb.Tool], **fields: Any) -> pb.ChatMessages:
    msg = tools_msg(**fields)
    del msg.tools[:]
    msg.tools.extend(tools)
    return msg


REFUSED = [
    (tools_msg(), "messages.tool_choice"),  # auto by default, no parser
    (tools_msg(mode=pb.TOOL_CHOICE_MODE_AUTO), "messages.tool_choice"),
    (tools_msg(mode=pb.TOOL_CHOICE_MODE_UNSPECIFIED), "messages.tool_choice.mode"),
    (tools_msg(function="nope"), "messages.tool_choice.function_name"),
    (with_tools([], mode=pb.TOOL_CHOICE_MODE_REQUIRED), "messages.tool_choice"),
    (with_tools([pb.Tool(name="a b")], mode=pb.TOOL_CHOICE_MODE_NONE), "messages.tools[0].name"),
    (with_tools([pb.Tool(name="f"), pb.Tool(name="f")]), "messages.tools[1].name"),
    (with_tools([pb.Tool(name="f", parameters="[1]")]), "messages.tools[0].parameters"),
    (with_tools([pb.Tool(name="f", parameters="{")]), "messages.tools[0].parameters"),
    (with_tools([pb.Tool(name="f", parameters='{"a":' * 100 + "1" + "}" * 100)]),
     "messages.tools[0].parameters"),
    (with_tools([pb.Tool(name=f"f{i}") for i in range(MAX_TOOLS + 1)]), "messages.tools"),
    (with_tools([pb.Tool(name="f", parameters='{"type": "string"}')], function="f"),
     "messages.tools[0].parameters"),  # not an object schema
]  # fmt: skip


def test_refusals_say_why() -> None:
    deep = '{"items": ' * 1000 + "{}" + "}" * 1000  # over the JSON parser's recursion limit
    with pytest.raises(FieldError, match="nested deeper than 59 levels"):
        parse_tools(with_tools([pb.Tool(name="f", parameters=deep)]))
    with pytest.raises(FieldError, match="must be an object schema") as info:
        parse_tools(with_tools([pb.Tool(name="f", parameters='{"type": "string"}')]))
    assert body_param(info.value.field, chat=True, names={}) == "tools[0].function.parameters"
    parse_tools(with_tools([pb.Tool(name="f", parameters='{"properties": {}}')]))  # type implied


def test_conversation_refusals_name_the_requests_own_message() -> None:
    for template_takes in (False, True):  # the generic prompt adds a system turn first
        bogus = tools_msg(mode=pb.TOOL_CHOICE_MODE_NONE)
        bogus.messages.add(role="bogus", content="x")
        with pytest.raises(FieldError) as info:
            chat_conversation(bogus, template_takes)
        assert info.value.field == "messages[1].role"
        empty = tools_msg(mode=pb.TOOL_CHOICE_MODE_NONE)
        del empty.messages[:]
        with pytest.raises(FieldError, match="at least one message") as info:
            chat_conversation(empty, template_takes)
        assert info.value.field == "messages"


@pytest.mark.parametrize(("msg", "field"), REFUSED)
def test_refusals_name_the_field(msg: pb.ChatMessages, field: str) -> None:
    with pytest.raises(FieldError) as info:
        plan_tools(msg, parser=None, auto_enabled=False)
    assert info.value.field == field


def test_a_forced_choice_and_the_requests_own_constraint_are_refused() -> None:
    plan = plan_tools(tools_msg(function="get_time"), parser=None, auto_enabled=False)
    assert plan is not None
    own = pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="a+"))
    with pytest.raises(FieldError) as info:
        plan.sampling(own)
    assert info.value.field == "sampling.structured_outputs"
    required = plan_tools(tools_msg(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parser=None,
                          auto_enabled=False)  # fmt: skip
    assert required is not None
    for forced in (plan, required):  # a stop would end the enforced call early
        for sampling, field, param in (
            (pb.SamplingParams(stop=["\n"]), "sampling.stop", "stop"),
            (pb.SamplingParams(stop_token_ids=[2]), "sampling.stop_token_ids", "stop_token_ids"),
        ):
            with pytest.raises(FieldError, match="enforced tool call early") as info:
                forced.sampling(sampling)
            assert (info.value.field, body_param(info.value.field, chat=True, names={})) == (
                field,
                param,
            )


async def _collect(rs: AsyncIterator[pb.GenerateResponse]) -> list[pb.GenerateResponse]:
    return [r async for r in rs]


async def _answers(*responses: pb.GenerateResponse) -> AsyncIterator[pb.GenerateResponse]:
    for r in responses:
        yield r


def test_a_named_call_that_does_not_parse_is_not_finished_as_tool_calls() -> None:
    plan = plan_tools(tools_msg(function="get_time"), parser=None, auto_enabled=False)
    assert plan is not None
    stop, length = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH
    for pieces, reason, want in (
        (['{"tz": ', '"UTC"}'], stop, pb.FINISH_REASON_TOOL_CALLS),
        (['{"tz": ', '"UT'], length, length),  # cut by max_tokens
        (["{"], stop, stop),  # ended early: never reported as a finished call
    ):
        answers = [pb.GenerateResponse(text=p) for p in pieces]
        answers[-1].finish_reason = reason
        got = asyncio.run(_collect(tool_call_responses(_answers(*answers), plan)))
        assert "".join(c.arguments for r in got for c in r.tool_calls) == "".join(pieces)
        assert got[-1].finish_reason == want


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("messages.tool_choice", "tool_choice"),
        ("messages.tool_choice.function_name", "tool_choice.function.name"),
        ("messages.tools", "tools"),
        ("messages.tools[3].name", "tools[3].function.name"),
        ("messages.tools[0].parameters", "tools[0].function.parameters"),
        ("messages.parallel_tool_calls", "parallel_tool_calls"),
        ("messages.messages[2].tool_calls", "messages[2].tool_calls"),
        ("messages[2].tool_calls[1].arguments", "messages[2].tool_calls[1].function.arguments"),
        ("messages.messages[2].tool_calls[1].name", "messages[2].tool_calls[1].function.name"),
    ],
)  # fmt: skip
def test_http_names_of_the_fields(field: str, param: str) -> None:
    assert body_param(field, chat=True, names={}) == param


CONVERSATION = pb.ChatMessages(
    messages=[
        pb.ChatMessage(role="system", content="Be brief."),
        pb.ChatMessage(role="user", content="Weather in Paris and the time in UTC?"),
        pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
            pb.ToolCall(id="call_2", name="get_time", arguments='{"tz": "UTC"}'),
        ]),
        pb.ChatMessage(role="tool", content="21 C", tool_call_id="call_1", name="get_weather"),
        pb.ChatMessage(role="tool", content="12:00", tool_call_id="call_2"),
    ],
    tools=tools_msg().tools,
)  # fmt: skip


def test_generic_rendering_for_a_template_without_tools(tokenizer: Any) -> None:
    assert not template_takes_tools(tokenizer)  # SmolLM2's
    turns, tools = chat_conversation(CONVERSATION, template_takes_tools=False)
    assert tools is None
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    system = turns[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    signatures = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(s) for s in signatures] == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Weather of a city",
                                          "parameters": WEATHER}},
        {"type": "function", "function": {"name": "get_time", "description": "",
                                          "parameters": TIME}},
    ]  # fmt: skip
    assert turns[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    )
    assert turns[3]["content"] == (
        "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    )
    ids = encode_chat(tokenizer, turns)
    text = tokenizer.decode(ids)
    assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


# A tools-aware chat template, in the style of Qwen2.5's: tools, tool_calls, tool turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}"
    "[{{ c.id }}:{{ c.function.name }}:{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tools_gets_them_as_transformers_takes_them(
    fresh_tokenizer: Any,
) -> None:
    tok = fresh_tokenizer
    tok.chat_template = TOOLS_TEMPLATE
    assert template_takes_tools(tok)
    turns, tools = chat_conversation(CONVERSATION, template_takes_tools=True)
    assert tools is not None and [t["function"]["name"] for t in tools] == [
        "get_weather", "get_time"
    ]  # fmt: skip
    assert turns[2]["tool_calls"][0] == {
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }  # fmt: skip
    assert turns[3] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1",
                        "name": "get_weather"}  # fmt: skip
    expected = tok.apply_chat_template(
        turns, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert encode_chat(tok, turns, tools) == expected
    text = tok.decode(expected)
    assert '[call_1:get_weather:{"city": "Paris"}]' in text and "(call_2)" in text


def test_tool_calls_only_in_assistant_turns_and_arguments_json() -> None:
    bad_role = pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(name="f", arguments="{}")])
    ])  # fmt: skip
    with pytest.raises(FieldError) as info:
        chat_conversation(bad_role, template_takes_tools=False)
    assert info.value.field == "messages[0].tool_calls"
    bad_args = pb.ChatMessages(messages=[
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(name="f", arguments="{x")])
    ])  # fmt: skip
    with pytest.raises(FieldError) as info:
        chat_conversation(bad_args, template_takes_tools=False)
    assert info.value.field == "messages[0].tool_calls[0].arguments"


def test_router_flags() -> None:
    config = RouterConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert config.to_argv() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        RouterConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        RouterConfig(tool_call_parser="pythonic")


def nested(depth: int) -> str:
    """A parameters schema `depth` levels deep (the outer object is level 1)."""
    return '{"type": "object", "additionalProperties": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def test_the_deepest_parameters_fit_the_constraints_limit() -> None:
    deepest = with_tools([pb.Tool(name="f", parameters=nested(MAX_SCHEMA_DEPTH))],
                         mode=pb.TOOL_CHOICE_MODE_REQUIRED)  # fmt: skip
    plan = plan_tools(deepest, parser=None, auto_enabled=False)
    assert plan is not None
    SamplingParams.from_proto(plan.sampling(pb.SamplingParams()))  # within its depth limit
    deeper = with_tools([pb.Tool(name="f", parameters=nested(MAX_SCHEMA_DEPTH + 1))],
                        mode=pb.TOOL_CHOICE_MODE_REQUIRED)  # fmt: skip
    with pytest.raises(FieldError) as info:
        plan_tools(deeper, parser=None, auto_enabled=False)
    assert info.value.field == "messages.tools[0].parameters"


def test_a_constraint_refusal_of_a_forced_choice_names_the_tools() -> None:
    big = json.dumps({"type": "object", "properties": {"a": {"enum": ["x" * 70_000]}}})
    plan = plan_tools(with_tools([pb.Tool(name="f", parameters=big)], function="f"),
                      parser=None, auto_enabled=False)  # fmt: skip
    assert plan is not None
    with pytest.raises(FieldError) as info:
        SamplingParams.from_proto(plan.sampling(pb.SamplingParams()))
    assert plan.own_error(info.value).field == "messages.tools"
    auto = plan_tools(tools_msg(), parser="hermes", auto_enabled=True)
    assert auto is not None and auto.own_error(info.value) is info.value  # not the tools'


def test_local_refs_of_nested_models_survive_the_required_wrapper() -> None:
    pydantic = pytest.importorskip("pydantic")
    xgr = pytest.importorskip("xgrammar")

    class Address(pydantic.BaseModel):
        street: str
        city: str

    class Person(pydantic.BaseModel):
        name: str
        home: Address
        others: list[Address]

    person = Person.model_json_schema()  # {"$defs": {"Address": ...}, "$ref"s into it}
    assert person["properties"]["home"] == {"$ref": "#/$defs/Address"}
    legacy = json.loads(json.dumps(person).replace("$defs", "definitions"))  # draft-07 name
    msg = with_tools([pb.Tool(name="person", parameters=json.dumps(person)),
                      pb.Tool(name="legacy", parameters=json.dumps(legacy))],
                     mode=pb.TOOL_CHOICE_MODE_REQUIRED)  # fmt: skip
    tools = parse_tools(msg)
    args = {"name": "Ann", "home": {"street": "1 Main St", "city": "Paris"},
            "others": [{"street": "2 Side St", "city": "Lyon"}]}  # fmt: skip
    good = [{"name": "person", "parameters": args}, {"name": "legacy", "parameters": args}]
    bad = [{"name": "person", "parameters": {**args, "home": {"street": "1 Main St"}}}]
    for parallel, calls in ((True, good), (False, good[1:])):
        schema = required_schema(tools, parallel)
        assert schema["items"]["anyOf"][1]["properties"]["parameters"]["properties"]["home"] == {
            "$ref": "#/items/anyOf/1/properties/parameters/definitions/Address"
        }
        jsonschema.validate(calls, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        assert xgr.testing._is_grammar_accept_string(grammar, json.dumps(calls))
        assert not xgr.testing._is_grammar_accept_string(grammar, json.dumps(bad))


def test_the_call_constraint_is_compact() -> None:
    xgr = pytest.importorskip("xgrammar")
    accepts = xgr.testing._is_grammar_accept_string
    for params in (None, "{}", '{"type": "object", "properties": {}}'):  # no parameters
        tool = pb.Tool(name="f", parameters=params) if params else pb.Tool(name="f")
        msg = with_tools([tool], mode=pb.TOOL_CHOICE_MODE_REQUIRED, parallel_tool_calls=False)
        plan = plan_tools(msg, parser=None, auto_enabled=False)
        assert plan is not None
        constraint = plan.sampling(pb.SamplingParams()).structured_outputs
        assert constraint.WhichOneof("constraint") == "grammar"
        grammar = xgr.Grammar.from_ebnf(constraint.grammar)
        assert accepts(grammar, '[{"name": "f", "parameters": {}}]')
        assert not accepts(grammar, '[{"name": "f", "parameters": 1}]')  # `{}` is an object
        assert accepts(grammar, '[\n {"name": "f", "parameters": {\n' + " " * 14 + "}}]")
        assert not accepts(grammar, '[{"name": "f", "parameters": {\n' + " " * 16 + "}}]")
    named = plan_tools(tools_msg(function="get_weather"), parser=None, auto_enabled=False)
    assert named is not None
    grammar = xgr.Grammar.from_ebnf(named.sampling(pb.SamplingParams()).structured_outputs.grammar)
    assert accepts(grammar, '{"city": "Paris", "unit": "celsius"}')
    assert accepts(grammar, '{\n  "city": "Paris",\n  "unit": "celsius"\n}')
    assert not accepts(grammar, '{"city": "Paris",' + " " * 17 + '"unit": "celsius"}')
    assert not accepts(grammar, '{"unit": "celsius"}')
    broken = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    fallback = call_constraint(broken)  # xgrammar's refusal comes from the worker, named
    assert fallback == pb.StructuredOutputs(json=json.dumps(broken))
