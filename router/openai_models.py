"""The request bodies of the OpenAI-compatible HTTP API, and their mapping onto
`sluiceway.v1.SamplingParams`.

Every sampling field whose name means the same here as in the public proto (temperature,
top_p, seed, vLLM's extra-body top_k, min_p, logit_bias, ...) is a body field derived from the
one sampling contract (sluiceway/sampling_params.py: its name and type); the fields this API
names or shapes its own way (max_tokens / max_completion_tokens, logprobs / top_logprobs,
stop as a string or a list, response_format and structured_outputs) are declared here and
mapped in `sampling_values`. Ranges are checked by the request path's gate, not here.

Every model takes undeclared fields (``extra="allow"``) for router/openai_fields.py to accept
as ignored or refuse by name: none is dropped silently.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
)
from pydantic_core import PydanticCustomError

from sluiceway.sampling_params import FIELDS, python_type
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "ToolDefinition",
    "sampling_values",
]

# Sampling fields this API names or shapes its own way (mapped in `sampling_values`).
FRONT_FIELDS = frozenset({"max_tokens", "logprobs", "stop", "structured_outputs"})
# The others: the same name and meaning as in sluiceway.v1.SamplingParams.
SHARED_FIELDS = tuple(name for name in FIELDS if name not in FRONT_FIELDS)


def _not_bool(value: Any) -> Any:
    """Refuses JSON true/false where a number belongs: pydantic's lax mode would read true as
    1 (``"max_tokens": true`` would ask for one token), which OpenAI's API refuses."""
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "must be a number, not a boolean")
    return value


#: An integer / a number of a request body: any JSON number pydantic reads as one (strings of
#: digits too, as vLLM reads them), not a bool.
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
#: A boolean of a request body: JSON true or false only (lax mode would read 1, "on", "yes").
Bool = Annotated[bool, Strict()]


def _prompt_shape(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """One error for a prompt of none of its four shapes (pydantic's would name the first
    shape it tried: "Input should be a valid string" for ``[true, 5]``)."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "prompt_type",
            "must be a string, a list of strings, a list of token ids or a list of lists of "
            "token ids (integers)",
        ) from None


def _body_type(kind: Any) -> Any:
    """`kind` (a `python_type`) with its numbers `Int` / `Float` and booleans `Bool`:
    ``list[int]`` becomes ``list[Int]``, ``dict[int, float]`` ``dict[int, Float]`` (a JSON
    object's keys are strings, read as integers)."""
    numbers = {int: Int, float: Float, bool: Bool}
    origin = get_origin(kind)
    if origin is list:
        return list[numbers.get(get_args(kind)[0], get_args(kind)[0])]  # type: ignore[misc]
    if origin is dict:
        key, value = get_args(kind)
        return dict[key, numbers.get(value, value)]  # type: ignore[misc,valid-type]
    return numbers.get(kind, kind)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: Bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or
    ``json_schema``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's extra-body ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(extra="allow")

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None


class _FrontFields(BaseModel):
    """What both generation endpoints take besides the shared sampling fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    stop: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's names before structured_outputs (removed in vLLM 0.12): the same constraints
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extra-body `priority`: sluiceway.v1.GenerateRequest.priority (lower first under
    # --scheduling-policy priority; anything but 0 is refused under fcfs); null is 0
    priority: Int | None = None


# Both endpoints' parameters: the shared sampling fields, unset (None) unless the body sets
# them, then the fields above.
_Sampling: type[_FrontFields] = create_model(  # type: ignore[call-overload]
    "_Sampling",
    __base__=_FrontFields,
    **{name: (_body_type(python_type(name)) | None, None) for name in SHARED_FIELDS},
)


class FunctionCall(BaseModel):
    """OpenAI's ``tool_calls[j].function`` of an assistant message."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str


class ToolCallBody(BaseModel):
    """One call of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallBody] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    name: str | None = None


class FunctionDefinition(BaseModel):
    """OpenAI's ``tools[i].function``."""

    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always validate when enforced (required / named)


class ToolDefinition(BaseModel):
    """One of ``tools``: only ``type: "function"`` is served."""

    model_config = ConfigDict(extra="ignore")

    type: str
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore")

    type: str = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):  # type: ignore[valid-type,misc]
    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None


class CompletionRequest(_Sampling):  # type: ignore[valid-type,misc]
    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]], WrapValidator(_prompt_shape)]
    max_tokens: Int | None = None
    logprobs: Int | None = None
    echo: Bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # rendered with the messages, as chat does


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Int]


def sampling_values(
    body: _FrontFields, max_tokens: int | None, logprobs: int | None
) -> dict[str, Any]:
    """The `sluiceway.v1.SamplingParams` fields of `body` by proto name (for
    `sampling_proto`): the shared fields it sets, then `max_tokens` and `logprobs` as the
    endpoint resolved them, `stop` as a list and the structured-outputs constraint. Raises
    FieldError for two constraints given at once."""
    values = {name: getattr(body, name) for name in SHARED_FIELDS}
    values = {name: value for name, value in values.items() if value is not None}
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if logprobs is not None:
        values["logprobs"] = logprobs
    if body.stop is not None:
        values["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    constraint = _structured_outputs(body)
    if constraint is not None:
        values["structured_outputs"] = constraint
    return values


def _structured_outputs(body: _FrontFields) -> inference_pb2.StructuredOutputs | None:
    """The constraint of ``response_format`` (OpenAI) or ``structured_outputs`` (vLLM's extra
    body; or its older ``guided_json``, ``guided_regex``, ``guided_choice``,
    ``guided_grammar``), None for none (or ``{"type": "text"}``). Raises FieldError for two,
    or for a ``structured_outputs`` that sets not exactly one field; the gate checks the
    rest."""
    fmt, so = body.response_format, body.structured_outputs
    guided = {k: getattr(body, "guided_" + k) for k in ("json", "regex", "choice", "grammar")}
    if any(v is not None for v in guided.values()):
        if so is not None:
            raise FieldError("structured_outputs", "give it or guided_*, not both")
        so = StructuredOutputsBody.model_validate(
            {k: v for k, v in guided.items() if v is not None}
        )
    if fmt is not None and fmt.type != "text" and so is not None:
        raise FieldError("structured_outputs", "give it or response_format, not both")
    if fmt is not None and fmt.type == "json_object":
        return inference_pb2.StructuredOutputs(json_object=True)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise FieldError("response_format.json_schema.schema", "required with type json_schema")
        return inference_pb2.StructuredOutputs(json=json.dumps(fmt.json_schema.json_schema))
    if so is None:
        return None
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
             if getattr(so, k) is not None]  # fmt: skip
    if len(given) != 1:
        raise FieldError(
            "structured_outputs", "set exactly one of json, regex, choice, grammar, json_object"
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
