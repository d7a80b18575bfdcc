"""Tool calling on the request path (docs/tool-calling.md): a conversation's tools checked and
rendered into the prompt, the tool_choice turned into a plan (a grammar for ``required`` and a
named function, a parser for ``auto``), and a sample's responses split into content and tool
calls (router/tool_parsers.py).

Fields are named in the public proto's words ("messages.tools[2].parameters",
"messages.tool_choice"); the HTTP front renames them.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from sluiceway.json_nesting import too_deep
from sluiceway.router.tokenizer import CHAT_ROLES
from sluiceway.router.tool_parsers import (
    PARSERS,
    CallStream,
    NamedStream,
    RequiredFormat,
    new_call_id,
    parser_format,
)
from sluiceway.sampling_params import MAX_CONSTRAINT_BYTES, MAX_JSON_SCHEMA_DEPTH
from sluiceway.status import FieldError, RequestError
from sluiceway.v1 import inference_pb2

__all__ = [
    "MAX_TOOLS",
    "ToolPlan",
    "call_constraint",
    "chat_conversation",
    "named_schema",
    "plan_tools",
    "required_schema",
    "tool_call_responses",
]

#: Tools a request may give at most (OpenAI's limit).
MAX_TOOLS = 128
#: Nesting a tool's parameters schema may have at most: a required choice's schema wraps it in
#: 5 levels (array, items, anyOf, the call, its properties), within the constraint's limit.
MAX_SCHEMA_DEPTH = MAX_JSON_SCHEMA_DEPTH - 5
#: Whitespace characters an enforced call may have between two JSON tokens at most: room for a
#: newline and the indent of a call pretty-printed 7 levels deep.
MAX_CALL_WHITESPACE = 16
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_MODES = {
    inference_pb2.TOOL_CHOICE_MODE_NONE: "none",
    inference_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    inference_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}
_ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}

# The generic tools section of the system prompt, for a chat template that takes no tools
# (SmolLM2's): the Hermes / Qwen format, which the `hermes` parser reads back.
GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request.

The functions you can call are described by these JSON signatures, within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments, within \
<tool_call></tool_call>, one for each call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def parse_tools(messages: inference_pb2.ChatMessages) -> list[dict[str, Any]]:
    """The request's tools as ``{"name", "description", "parameters": dict}``, checked.

    Raises FieldError("messages.tools"): more than MAX_TOOLS; ("messages.tools[i].name"): a
    name that is not 1 to 64 letters, digits, _ or -, or one given twice;
    ("messages.tools[i].parameters"): not a JSON object, a "type" other than "object" (none
    given is "object"), or nested deeper than MAX_SCHEMA_DEPTH.
    """
    if len(messages.tools) > MAX_TOOLS:
        raise FieldError("messages.tools", f"at most {MAX_TOOLS} tools; got {len(messages.tools)}")
    tools: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(messages.tools):
        where = f"messages.tools[{i}]"
        if not _NAME.match(tool.name):
            raise FieldError(
                f"{where}.name", f"must be 1 to 64 letters, digits, _ or -; got {tool.name!r}"
            )
        if tool.name in seen:
            raise FieldError(f"{where}.name", f"{tool.name!r} is given twice")
        seen.add(tool.name)
        params: Any = dict(_ANY_OBJECT)
        if tool.parameters:
            if too_deep(tool.parameters, MAX_SCHEMA_DEPTH) is not None:  # before the parser
                raise FieldError(
                    f"{where}.parameters", f"nested deeper than {MAX_SCHEMA_DEPTH} levels"
                )
            try:
                params = json.loads(tool.parameters)
            except (ValueError, RecursionError):
                raise FieldError(f"{where}.parameters", "must be JSON text") from None
            if not isinstance(params, dict):
                raise FieldError(f"{where}.parameters", "must be a JSON schema object")
            if params.get("type", "object") != "object":  # OpenAI's rule: calls are objects
                raise FieldError(
                    f"{where}.parameters",
                    f'must be an object schema ("type": "object"); got type {params["type"]!r}',
                )
            params = {"type": "object", **params}  # `{}` (no parameters) too: not any value
        tools.append({"name": tool.name, "description": tool.description, "parameters": params})
    return tools


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a named tool_choice's output: the function's arguments object."""
    return dict(tool["parameters"])


# Keys whose values are JSON data, not subschemas: a "$ref" in them is not a reference.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references (``"$ref": "#..."``, e.g. pydantic's
    ``#/$defs/Address``) pointing below the JSON pointer `base`, where the schema now lives
    inside a larger one."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a required tool_choice's output (vLLM's): an array of 1 call (at most
    1 unless `parallel`), each ``{"name": <a tool's name>, "parameters": <its arguments>}``
    with the arguments valid against that tool's parameters (their local ``$ref``s rewritten
    to where the parameters now are)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["name"]]},
                "parameters": _rebased(t["parameters"], f"#/items/anyOf/{i}/properties/parameters"),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_constraint(schema: dict[str, Any]) -> inference_pb2.StructuredOutputs:
    """The constraint of JSON valid against `schema`: xgrammar's EBNF grammar of it with at
    most MAX_CALL_WHITESPACE whitespace characters between two tokens of the JSON (a
    JSON-schema constraint allows any run, and a small model given a function without
    parameters fills the call with newlines until max_tokens; none at all changes the style a
    model was trained to write, and SmolLM2 then repeats parallel calls). When xgrammar cannot convert the schema, or the grammar is over
    MAX_CONSTRAINT_BYTES (a deeply nested schema), the schema itself: the worker then
    compiles it, or its refusal names the field."""
    import xgrammar  # the grammar engine; imported on first use (it is slow to import)

    text = json.dumps(schema)
    try:
        grammar = str(
            xgrammar.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_CALL_WHITESPACE)
        )
    except (RuntimeError, ValueError, TypeError):
        return inference_pb2.StructuredOutputs(json=text)
    if len(grammar.encode()) > MAX_CONSTRAINT_BYTES:
        return inference_pb2.StructuredOutputs(json=text)
    return inference_pb2.StructuredOutputs(grammar=grammar)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools do: `mode` "none" (text only), "auto" (parsed with `parser`),
    "required" or "named" (`function`): output forced by a grammar."""

    mode: str
    tools: tuple[dict[str, Any], ...]
    function: str | None = None
    parallel: bool = True
    parser: str | None = None

    def constraint(self) -> inference_pb2.StructuredOutputs | None:
        """The structured-outputs constraint that forces the calls (None for none / auto): the
        call schema as a compact grammar (`call_constraint`)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["name"] == self.function)
            return call_constraint(named_schema(tool))
        if self.mode == "required":
            schema = required_schema(list(self.tools), self.parallel)
            return call_constraint(schema)
        return None

    def sampling(self, sampling: inference_pb2.SamplingParams) -> inference_pb2.SamplingParams:
        """`sampling` with the plan's constraint, and with special tokens kept in the text for
        a parser that reads markers (vLLM's, unless the request says otherwise).

        Raises FieldError("sampling.structured_outputs"): the request has its own constraint
        and the plan one too; ("sampling.stop" / "sampling.stop_token_ids"): given with a
        required or named choice (a stop would cut the call short)."""
        out = inference_pb2.SamplingParams()
        out.CopyFrom(sampling)
        constraint = self.constraint()
        if constraint is not None:
            for name in ("stop", "stop_token_ids"):
                if getattr(sampling, name):
                    raise FieldError(
                        f"sampling.{name}",
                        f"cannot be combined with a {self.mode} tool_choice: it would end "
                        "the enforced tool call early",
                    )
            if sampling.HasField("structured_outputs"):
                raise FieldError(
                    "sampling.structured_outputs",
                    f"cannot be combined with a {self.mode} tool_choice (its tool call is "
                    "the output's constraint)",
                )
            out.structured_outputs.CopyFrom(constraint)
        if self.mode == "auto" and not sampling.HasField("skip_special_tokens"):
            out.skip_special_tokens = False
        return out

    def own_error(self, error: RequestError) -> RequestError:
        """`error` named after "messages.tools" when the plan's constraint caused it (a
        constraint refused or not compiled: its schemas came from the tools), else `error`."""
        forced = self.mode in ("named", "required")
        if not forced or not (error.field or "").startswith("sampling.structured_outputs"):
            return error
        return FieldError("messages.tools", f"the tools' call grammar: {error.message}")

    def stream(self) -> CallStream | NamedStream | None:
        """A new splitter of one sample's output into content and calls; None for none."""
        if self.mode == "named":
            assert self.function is not None
            return NamedStream(self.function)
        if self.mode == "required":
            return CallStream(RequiredFormat())
        if self.mode == "auto":
            assert self.parser is not None
            return CallStream(parser_format(self.parser), frozenset(t["name"] for t in self.tools))
        return None


def plan_tools(
    messages: inference_pb2.ChatMessages, *, parser: str | None, auto_enabled: bool
) -> ToolPlan | None:
    """The plan of a chat request's tools and tool_choice; None without tools (or with
    tool_choice none and no tools). `parser`: the router's --tool-call-parser;
    `auto_enabled`: its --enable-auto-tool-choice.

    Raises FieldError: what `parse_tools` refuses; ("messages.tool_choice"): a tool_choice
    without tools, an UNSPECIFIED mode, or auto (explicit, or by default with tools) on a
    router without both flags, as vLLM; ("messages.tool_choice.function_name"): not one of
    the tools.
    """
    tools = parse_tools(messages)
    has_choice = messages.HasField("tool_choice")
    which = messages.tool_choice.WhichOneof("choice") if has_choice else None
    if has_choice and which is None:
        raise FieldError("messages.tool_choice", "set mode or function_name")
    mode = "auto" if tools else "none"
    if which == "mode":
        if messages.tool_choice.mode not in _MODES:
            raise FieldError("messages.tool_choice.mode", "must be NONE, AUTO or REQUIRED")
        mode = _MODES[messages.tool_choice.mode]
    elif which == "function_name":
        mode = "named"
    if not tools:
        if mode == "none":
            return None
        raise FieldError("messages.tool_choice", f"{mode} needs tools")
    function = messages.tool_choice.function_name if mode == "named" else None
    if function is not None and function not in {t["name"] for t in tools}:
        raise FieldError(
            "messages.tool_choice.function_name", f"{function!r} is not one of the tools"
        )
    if mode == "auto" and not (auto_enabled and parser in PARSERS):
        raise FieldError(
            "messages.tool_choice",
            '"auto" needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser (give required, none or a function)",
        )
    parallel = messages.parallel_tool_calls if messages.HasField("parallel_tool_calls") else True
    return ToolPlan(mode, tuple(tools), function, parallel, parser if mode == "auto" else None)


def _arguments(call: inference_pb2.ToolCall, where: str) -> Any:
    try:
        return json.loads(call.arguments or "{}")
    except (ValueError, RecursionError):
        raise FieldError(f"{where}.arguments", "must be JSON text") from None


def chat_conversation(
    messages: inference_pb2.ChatMessages, template_takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the tools to render with the chat template.

    With `template_takes_tools` they are given to it as transformers expects (tools as
    OpenAI's ``{"type": "function", "function": {...}}``, an assistant turn's
    ``tool_calls`` with its arguments parsed, a tool turn's ``tool_call_id`` and ``name``);
    otherwise the tools are a section of the system prompt (`GENERIC_TOOLS_PROMPT`, added to
    the first system turn or as one), an assistant's calls ``<tool_call>`` blocks in its
    text, and a tool turn a user turn of ``<tool_response>`` blocks (consecutive ones
    merged), as Hermes and Qwen render them.

    Raises FieldError: what `parse_tools` refuses; ("messages"): no messages;
    ("messages[i].role"): not one of CHAT_ROLES (checked here: the tools' system turn and
    merged tool turns shift the rendered turns' indexes); ("messages[i].tool_calls"): calls in
    a turn that is not an assistant's; ("messages[i].tool_calls[j].arguments"): not JSON.
    """
    tools = parse_tools(messages)
    if not messages.messages:
        raise FieldError("messages", "must hold at least one message")
    for i, m in enumerate(messages.messages):
        if m.role not in CHAT_ROLES:
            raise FieldError(
                f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}"
            )
    spec = [{"type": "function", "function": t} for t in tools]
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages.messages):
        where = f"messages[{i}]"  # as the chat template's errors name a turn
        if m.tool_calls and m.role != "assistant":
            raise FieldError(f"{where}.tool_calls", "only an assistant turn has tool calls")
        calls = [(c, _arguments(c, f"{where}.tool_calls[{j}]")) for j, c in enumerate(m.tool_calls)]
        if template_takes_tools:
            turn: dict[str, Any] = {"role": m.role, "content": m.content}
            if calls:
                turn["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": args}}
                    for c, args in calls
                ]  # fmt: skip
            if m.role == "tool":
                turn.update(tool_call_id=m.tool_call_id, name=m.name)
            turns.append(turn)
        elif m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if turns and turns[-1].get("tool_responses"):
                turns[-1]["content"] += "\n" + block
            else:
                turns.append({"role": "user", "content": block, "tool_responses": True})
        else:
            blocks = [
                "<tool_call>\n" + json.dumps({"name": c.name, "arguments": args},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c, args in calls
            ]  # fmt: skip
            turns.append({"role": m.role, "content": "\n".join([m.content, *blocks]).strip()})
    for turn in turns:
        turn.pop("tool_responses", None)
    if template_takes_tools or not tools:
        return turns, spec if tools else None
    section = GENERIC_TOOLS_PROMPT.format(
        tools="\n".join(json.dumps(s, ensure_ascii=False) for s in spec)
    )
    if turns and turns[0]["role"] == "system":
        turns[0]["content"] = f"{turns[0]['content']}\n\n{section}".strip()
    else:
        turns.insert(0, {"role": "system", "content": section})
    return turns, None


async def tool_call_responses(
    responses: AsyncIterator[inference_pb2.GenerateResponse], plan: ToolPlan
) -> AsyncGenerator[inference_pb2.GenerateResponse, None]:
    """One sample's `responses` with the calls in its text split out (`ToolPlan.stream`) into
    `GenerateResponse.tool_calls` pieces (index, id and name on a call's first) and its
    finish reason TOOL_CALLS when it stopped after a call. A constraint of the plan that does
    not compile fails naming "messages.tools" (the schemas came from there).

    Raises RequestError, as `responses` does.
    """
    stream = plan.stream()
    assert stream is not None
    count = 0
    async with contextlib.aclosing(responses) as upstream:  # type: ignore[type-var]
        try:
            async for r in upstream:
                final = r.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
                out = inference_pb2.GenerateResponse()
                out.CopyFrom(r)  # the sample logs and counts its own finish reason
                out.text, calls = stream.feed(r.text, final)
                for call in calls:
                    if call.name:
                        out.tool_calls.add(index=count, id=new_call_id(), name=call.name,
                                           arguments=call.arguments)  # fmt: skip
                        count += 1
                    else:
                        out.tool_calls.add(index=count - 1, arguments=call.arguments)
                stopped = r.finish_reason == inference_pb2.FINISH_REASON_STOP
                if final and count and stopped and stream.complete():
                    out.finish_reason = inference_pb2.FINISH_REASON_TOOL_CALLS
                yield out
        except RequestError as e:
            raise plan.own_error(e) from None
