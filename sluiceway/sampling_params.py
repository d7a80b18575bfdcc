"""The sampling contract: every sampling parameter's default, range and meaning, written once.

`SamplingParams` is the one definition (as vLLM's and nano-vllm's `SamplingParams`: a dataclass
that checks itself). Each field carries its default and a `Rule` (range, list limits, a
one-line help); the public proto's `sluiceway.v1.SamplingParams` is its wire form, field for
field (tests/test_sampling_params.py holds them equal), and its integer types bound the values
a front may send (`wire_range`). From here derive:

- the router's gate (router/request_path.py): `SamplingParams.from_proto` checks every field,
  `resolve` applies the defaults that depend on the model and the prompt and the rules between
  fields; the resolved proto (`to_proto`) travels to the scheduler and the workers, once per
  sequence, and each of them reads it back with `from_proto`;
- the HTTP body's fields (router/openai_models.py) and `sluiceway generate`'s flags
  (sluiceway/generate_cli.py), names, types, bounds and help;
- the worker's sampler (worker/sampler.py), which takes `SamplingParams` rows as they are.

A new parameter is its proto field, its line here and its effect in the sampler.

Every rejection is a `FieldError` naming the field in the public proto's words
("sampling.top_p", "sampling.stop[2]", "sampling.logit_bias[50000]", "input") and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from sluiceway.json_nesting import too_deep
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2

__all__ = [
    "FIELDS",
    "GREEDY_TEMPERATURE_EPS",
    "MAX_REQUEST_ID_CHARS",
    "Rule",
    "SamplingParams",
    "check_prompt_token_ids",
    "check_request_id",
    "check_wire_integers",
    "python_type",
    "sampling_proto",
    "wire_range",
]

#: A temperature below this is greedy sampling (vLLM's `_SAMPLING_EPS`).
GREEDY_TEMPERATURE_EPS = 1e-5
#: Longest client-chosen request_id, characters (it is echoed in every response).
MAX_REQUEST_ID_CHARS = 256
#: A structured-outputs JSON schema, regex or grammar at most, UTF-8 bytes.
MAX_CONSTRAINT_BYTES = 64 * 1024
#: Alternatives of a `choice` constraint at most.
MAX_CHOICES = 256
#: Levels of arrays and objects a structured-outputs JSON schema may nest (the deepest
#: real-world schemas nest about a dozen; Python's JSON parser fails near 1,000).
MAX_JSON_SCHEMA_DEPTH = 64

_PROTO = inference_pb2.SamplingParams.DESCRIPTOR
# The value range of each protobuf integer type (its constructor refuses the rest).
_INTEGER_TYPES = {
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: ("uint32", 0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: ("uint64", 0, 2**64 - 1),
}


def wire_range(descriptor: FieldDescriptor) -> tuple[str, int, int] | None:
    """``(type name, lowest, highest)`` of an integer proto field (of a map's value or of a
    repeated field's items too), None for other types: what a front must check before it
    builds the message (the constructor raises ValueError past it)."""
    if descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
        descriptor = descriptor.message_type.fields_by_name["key"]
    return _INTEGER_TYPES.get(descriptor.type)


#: Entries of a token-id list or map that is not a vocabulary subset (stop_token_ids,
#: logit_bias): each one is work in every step of the request.
MAX_TOKEN_ID_ENTRIES = 1024
#: allowed_token_ids may name a whole vocabulary: the largest of the models served (Gemma 3's).
MAX_VOCAB_SIZE = 262_144

#: The largest float32: a proto `float` holds no larger finite value.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True)
class Rule:
    """What a sampling field allows beyond its proto type, and its one-line help.

    Attributes:
        help: what the field does, for `--help` and docs (the proto comment is the reference).
        low, high: bounds of a number (of each value of a map); None: no bound there.
        low_open, high_open: the bound itself is refused.
        finite: NaN and infinities refused (bounds refuse NaN anyway).
        note: said after the range in an error ("0 = greedy").
        max_items: a list or map holds at most this many entries.
        item_bytes: each string of a list is 1 to this many UTF-8 bytes.
        token_ids: ids (list items, map keys) must be < the vocabulary size
            (`SamplingParams.check_token_ids`).
    """

    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    note: str = ""
    max_items: int | None = None
    item_bytes: int | None = None
    token_ids: bool = False

    def allowed(self) -> str:
        """The range in words: "a finite number >= 0 (0 = greedy)", "in (0, 1]", "<= 20"."""
        lo = None if self.low is None else _number(self.low)
        hi = None if self.high is None else _number(self.high)
        if lo is not None and hi is not None:
            text = f"in {'(' if self.low_open else '['}{lo}, {hi}{')' if self.high_open else ']'}"
        elif lo is not None:
            text = f"{'>' if self.low_open else '>='} {lo}"
        elif hi is not None:
            text = f"{'<' if self.high_open else '<='} {hi}"
        else:
            text = "a number"
        if self.finite:
            text = f"a finite number {text}"
        return f"{text} ({self.note})" if self.note else text

    def within(self, lo: float, hi: float) -> Rule:
        """This rule with its bounds narrowed to the type's `[lo, hi]`: the range an error
        states when a value passes the rule but not its proto type."""
        low_open = self.low_open and self.low is not None and self.low >= lo
        high_open = self.high_open and self.high is not None and self.high <= hi
        low = lo if self.low is None else max(self.low, lo)
        high = hi if self.high is None else min(self.high, hi)
        return dataclasses.replace(self, low=low, high=high, low_open=low_open, high_open=high_open)

    def admits(self, value: float) -> bool:
        """Whether the number `value` lies in the range (NaN never does)."""
        if value != value or (self.finite and not math.isfinite(value)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (
            self.high is not None and (value >= self.high if self.high_open else value > self.high)
        )


def _number(x: float) -> str:
    """A bound in words: integers in full (4294967295), others as %g (0.5, 3.40282e+38)."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def _param(default: Any, help: str, **rule: Any) -> Any:
    """A `SamplingParams` field: its default and its `Rule`."""
    if isinstance(default, dict):
        return field(default_factory=dict, metadata={"rule": Rule(help, **rule)})
    return field(default=default, metadata={"rule": Rule(help, **rule)})


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How one request is sampled: every field with its default (vLLM's) and its range.

    Construction checks each field on its own (`FieldError`); `resolve` applies what depends
    on the model and the prompt. Fields are those of the public proto, in its order.
    """

    temperature: float = _param(
        1.0, "the logits are divided by it", low=0, finite=True, note="0 = greedy"
    )
    top_p: float = _param(
        1.0, "nucleus sampling: the most likely tokens whose probabilities add up to top_p",
        low=0, high=1, low_open=True,
    )  # fmt: skip
    top_k: int = _param(0, "the K most likely tokens only", low=-1, note="-1 and 0 = off")
    repetition_penalty: float = _param(
        1.0, "> 1 discourages tokens of the prompt and output (CTRL's)",
        low=0, low_open=True, finite=True, note="1 = off",
    )  # fmt: skip
    max_tokens: int = _param(16, "tokens to generate at most", low=1)
    stop: tuple[str, ...] = _param(
        (), "stop strings, left out of the output", max_items=16, item_bytes=256
    )
    stop_token_ids: tuple[int, ...] = _param(
        (), "token ids that end the output (the token is output)", token_ids=True,
        max_items=MAX_TOKEN_ID_ENTRIES,
    )  # fmt: skip
    ignore_eos: bool = _param(False, "keep generating past EOS")
    seed: int | None = _param(None, "sampling seed, for repeatable samples")
    min_p: float = _param(
        0.0, "drop tokens less likely than this times the most likely one", low=0, high=1,
        note="0 = off",
    )  # fmt: skip
    presence_penalty: float = _param(
        0.0, "subtracted from the logit of tokens already generated", low=-2, high=2,
        note="0 = off",
    )  # fmt: skip
    frequency_penalty: float = _param(
        0.0, "times each token's count in the output, subtracted from its logit", low=-2,
        high=2, note="0 = off",
    )  # fmt: skip
    min_tokens: int = _param(
        0, "no EOS, stop token id or stop string ends the output before this many tokens"
    )
    include_stop_str_in_output: bool = _param(
        False, "keep the matched stop string at the end of the output"
    )
    skip_special_tokens: bool = _param(True, "leave special tokens out of the text")
    logprobs: int | None = _param(
        None, "each token's log-probability and the N most likely at its position", low=0,
        high=20,
    )  # fmt: skip
    n: int = _param(1, "samples of the prompt", low=1, high=16)
    structured_outputs: inference_pb2.StructuredOutputs | None = _param(
        None, "a constraint the output matches (JSON schema, regex, choice, grammar)"
    )
    logit_bias: dict[int, float] = _param(
        {}, "token id -> bias added to its logit", low=-100, high=100, token_ids=True,
        max_items=MAX_TOKEN_ID_ENTRIES,
    )  # fmt: skip
    allowed_token_ids: tuple[int, ...] = _param(
        (), "only these token ids may be sampled", token_ids=True,
        max_items=MAX_VOCAB_SIZE,
    )  # fmt: skip
    prompt_logprobs: int | None = _param(
        None, "each prompt token's log-probability and the N most likely at its position",
        low=0, high=20,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name, (default, rule) in FIELDS.items():
            value = getattr(self, name)
            if value is not default and value != default:  # a default is valid by design
                _check_field(name, value, rule)
        if self.structured_outputs is not None:
            check_structured_outputs(self.structured_outputs)
            if self.allowed_token_ids:  # the two masks could leave no token to sample
                raise FieldError(
                    "sampling.allowed_token_ids",
                    "cannot be combined with structured_outputs (the grammar alone says "
                    "which tokens may come)",
                )

    # -- the wire form --------------------------------------------------------------------

    @classmethod
    def from_proto(cls, message: inference_pb2.SamplingParams) -> SamplingParams:
        """The parameters a `sluiceway.v1.SamplingParams` sets, the defaults for the rest,
        each checked. Raises FieldError for a field out of its range."""
        values: dict[str, Any] = {}
        for name, descriptor in _PROTO.fields_by_name.items():
            value = getattr(message, name)
            if _is_map(descriptor):
                if value:
                    values[name] = dict(value)
            elif descriptor.is_repeated:
                if value:
                    values[name] = tuple(value)
            elif descriptor.has_presence:
                if message.HasField(name):
                    values[name] = value
            elif value:  # a plain bool: false is unset
                values[name] = value
        return cls(**values)

    def to_proto(self) -> inference_pb2.SamplingParams:
        """Every field as a `sluiceway.v1.SamplingParams` (optional ones set where not None)."""
        message = inference_pb2.SamplingParams()
        for name, descriptor in _PROTO.fields_by_name.items():
            value = getattr(self, name)
            if value is None:
                continue
            if _is_map(descriptor):
                getattr(message, name).update(value)
            elif descriptor.is_repeated:
                getattr(message, name).extend(value)
            elif descriptor.message_type is not None:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    # -- what depends on the model and the prompt -------------------------------------------

    def resolve(
        self,
        *,
        prompt_len: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> SamplingParams:
        """The parameters as they apply to one prompt of one model.

        Args:
            prompt_len: tokens in the prompt (1 to max_model_len - 1:
                `check_prompt_token_ids` checked them).
            max_model_len: tokens the model may hold, prompt plus output.
            vocab_size: token ids must be below this.
            eos_token_ids: the model's end-of-sequence ids, added to `stop_token_ids` unless
                `ignore_eos`.

        Returns a copy where: a temperature below 1e-5 is greedy (0, with top_p 1, top_k 0
        and min_p 0, as vLLM); a top_k of -1 or >= vocab_size is 0 (off); max_tokens is
        capped at max_model_len - prompt_len and min_tokens with it; stop strings and stop
        token ids are deduplicated, the EOS ids added to the latter.

        Raises:
            FieldError("sampling.min_tokens"): over max_tokens.
            FieldError("sampling.stop_token_ids[i]" / "sampling.logit_bias[ID]"): an id >=
                vocab_size.
        """
        self.check_token_ids(vocab_size)
        if self.min_tokens > self.max_tokens:
            raise FieldError(
                "sampling.min_tokens",
                f"must be at most max_tokens ({self.max_tokens}); got {self.min_tokens}",
            )
        greedy = self.temperature < GREEDY_TEMPERATURE_EPS
        top_k = 0 if self.top_k == -1 or self.top_k >= vocab_size else self.top_k
        max_tokens = min(self.max_tokens, max_model_len - prompt_len)
        stop_ids = self.stop_token_ids + ((*eos_token_ids,) if not self.ignore_eos else ())
        return dataclasses.replace(
            self,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            top_k=0 if greedy else top_k,
            min_p=0.0 if greedy else self.min_p,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=_unique(self.stop),
            stop_token_ids=_unique(stop_ids),
        )

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises FieldError for a token id (`Rule.token_ids` fields) >= vocab_size."""
        for name, (_, rule) in FIELDS.items():
            if not rule.token_ids:
                continue
            ids = getattr(self, name)
            for i, tid in enumerate(ids):
                if tid >= vocab_size:
                    where = f"sampling.{name}[{tid if isinstance(ids, dict) else i}]"
                    raise FieldError(where, f"must be < vocab_size ({vocab_size}); got {tid}")


#: name -> (default, rule) of every sampling field, in the proto's order.
FIELDS: dict[str, tuple[Any, Rule]] = {
    f.name: ({} if f.default is dataclasses.MISSING else f.default, f.metadata["rule"])
    for f in dataclasses.fields(SamplingParams)
}


def _is_map(descriptor: FieldDescriptor) -> bool:
    message = descriptor.message_type
    return message is not None and message.GetOptions().map_entry


def _unique(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(dict.fromkeys(items))


def _check_field(name: str, value: Any, rule: Rule) -> None:
    """Raises FieldError("sampling.NAME...") when `value` breaks `rule` or its proto type."""
    where = f"sampling.{name}"
    if value is None or isinstance(value, bool | inference_pb2.StructuredOutputs):
        return
    descriptor = _PROTO.fields_by_name[name]
    if isinstance(value, tuple | dict):
        if rule.max_items is not None and len(value) > rule.max_items:
            raise FieldError(where, f"at most {rule.max_items} entries; got {len(value)}")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict):  # keys are ids; values have the field's range
                _check_number(f"{where}[{key}]", key, Rule(""), wire_range(descriptor))
                _check_number(f"{where}[{key}]", item, rule, None)
            elif isinstance(item, str):
                _check_text(f"{where}[{key}]", item, rule)
            else:
                _check_number(f"{where}[{key}]", item, Rule(""), wire_range(descriptor))
        return
    _check_number(where, value, rule, wire_range(descriptor))


def _check_number(where: str, value: float, rule: Rule, wire: tuple[str, int, int] | None) -> None:
    if not rule.admits(value):
        raise FieldError(where, f"must be {rule.allowed()}; got {value}")
    if wire is not None:
        kind, lo, hi = wire
        if not lo <= value <= hi:
            raise FieldError(
                where, f"must be {rule.within(lo, hi).allowed()} ({kind}); got {value}"
            )


def _check_text(where: str, text: str, rule: Rule) -> None:
    size = len(text.encode("utf-8"))
    if size == 0:
        raise FieldError(where, "must not be empty")
    if rule.item_bytes is not None and size > rule.item_bytes:
        raise FieldError(where, f"must be at most {rule.item_bytes} UTF-8 bytes; got {size}")


def sampling_proto(values: Mapping[str, Any]) -> inference_pb2.SamplingParams:
    """A `sluiceway.v1.SamplingParams` of the given fields (a front's request mapped to proto
    names). Only what the proto's types cannot hold is refused here (an integer outside its
    type, a list item or map key included: the constructor would raise); the ranges are
    checked by the one gate every request passes (`SamplingParams.from_proto`).

    Raises:
        FieldError("sampling.NAME..."): such an integer (said with the field's range).
    """
    for name, value in values.items():
        descriptor = _PROTO.fields_by_name[name]
        is_float = descriptor.type == FieldDescriptor.TYPE_FLOAT and isinstance(value, float)
        if is_float and math.isfinite(value) and abs(value) > FLOAT32_MAX:  # float32: inf
            rule = FIELDS[name][1].within(-FLOAT32_MAX, FLOAT32_MAX)
            raise FieldError(f"sampling.{name}", f"must be {rule.allowed()} (float); got {value}")
        wire = wire_range(descriptor)
        if wire is None or isinstance(value, bool):
            continue
        if isinstance(value, Mapping):  # a map: its keys are the integers
            entries = [(f"sampling.{name}[{key}]", key, Rule("")) for key in value]
        elif isinstance(value, Iterable):
            entries = [(f"sampling.{name}[{i}]", v, Rule("")) for i, v in enumerate(value)]
        else:
            entries = [(f"sampling.{name}", value, FIELDS[name][1])]
        for where, number, number_rule in entries:
            if not wire[1] <= number <= wire[2]:
                _check_number(where, number, number_rule, wire)
    return inference_pb2.SamplingParams(**values)


def check_wire_integers(
    message: type[Any], name: str, values: Iterable[int] | int, where: str
) -> None:
    """Raises FieldError(f"{where}[i]") for the first of `values` outside the integer type of
    field `name` of proto `message` (e.g. token ids into `TokenIds.ids`, uint32); for one
    value (a scalar field, e.g. `GenerateRequest.priority`, int32), FieldError(where)."""
    wire = wire_range(message.DESCRIPTOR.fields_by_name[name])
    assert wire is not None, f"{name} is not an integer field"
    if isinstance(values, int):
        if not wire[1] <= values <= wire[2]:
            _check_number(where, values, Rule(""), wire)
        return
    for i, value in enumerate(values):
        if not wire[1] <= value <= wire[2]:
            _check_number(f"{where}[{i}]", value, Rule(""), wire)


def check_structured_outputs(c: inference_pb2.StructuredOutputs) -> None:
    """Checks what can be checked without the tokenizer (the workers compile it: a schema or
    grammar xgrammar refuses is INVALID_ARGUMENT from there, naming the field too).

    Raises:
        FieldError("sampling.structured_outputs"): no constraint set.
        FieldError("sampling.structured_outputs.<kind>"): json not JSON text of an object or
            boolean schema (or with a non-local $ref), json_object false, an empty regex or
            grammar, text over MAX_CONSTRAINT_BYTES, no choices, an empty choice or over
            MAX_CHOICES of them.
    """
    kind = c.WhichOneof("constraint")
    where = f"sampling.structured_outputs.{kind}"
    if kind is None:
        raise FieldError(
            "sampling.structured_outputs",
            "set one of json, json_object, regex, choice, grammar (or leave it unset)",
        )
    if kind == "json_object":
        if not c.json_object:
            raise FieldError(where, "must be true when set (unset: no constraint)")
        return
    if kind == "choice":
        choices = c.choice.choices
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise FieldError(where, f"needs 1 to {MAX_CHOICES} choices; got {len(choices)}")
        for i, choice in enumerate(choices):
            if not choice:
                raise FieldError(f"{where}.choices[{i}]", "must not be empty")
        return
    text = getattr(c, kind)
    size = len(text.encode("utf-8"))
    if not 0 < size <= MAX_CONSTRAINT_BYTES:
        raise FieldError(where, f"must be 1 to {MAX_CONSTRAINT_BYTES} UTF-8 bytes; got {size}")
    if kind == "json":
        _check_json_schema(where, text)


def _check_json_schema(where: str, text: str) -> None:
    deep = too_deep(text, MAX_JSON_SCHEMA_DEPTH)
    if deep is not None:
        shown = "".join(deep[:8]) + ("..." if len(deep) > 8 else "")
        raise FieldError(
            where, f"the schema nests deeper than {MAX_JSON_SCHEMA_DEPTH} levels (at {shown})"
        )
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise FieldError(where, f"not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise FieldError(
            where, f"a JSON schema is an object or a boolean; got {type(schema).__name__}"
        )
    external = _external_ref(schema)
    if external is not None:  # the engine would leave that part unconstrained
        raise FieldError(where, f"only local $ref (#/...) can be resolved; got $ref {external!r}")


def _external_ref(schema: object) -> str | None:
    """The first ``$ref`` in ``schema`` (at any depth) that does not point into the document
    itself (``#...``), or None."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                return ref
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None


def check_prompt_token_ids(ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """Checks a prompt's token ids (given by the client, or from the tokenizer and chat
    template, or a resumed stream's prompt plus output) before they reach a model.

    Args:
        ids: the token ids.
        vocab_size: every id must be below this.
        max_model_len: the prompt must leave room for one generated token, so it may have at
            most max_model_len - 1 tokens.

    Raises:
        FieldError("input"): the prompt is empty, or has >= max_model_len tokens.
        FieldError("prompt_token_ids.ids[i]"): the first id >= vocab_size.
    """
    n = len(ids)
    if n == 0:
        raise FieldError("input", "the prompt is empty (0 tokens); it needs at least 1")
    if n >= max_model_len:
        raise FieldError(
            "input",
            f"the prompt has {n} tokens; max_model_len is {max_model_len}, "
            f"so a prompt may have at most {max_model_len - 1}",
        )
    if max(ids) >= vocab_size:  # C-speed check first; find the index only on failure
        for i, tid in enumerate(ids):
            if tid >= vocab_size:
                raise FieldError(
                    f"prompt_token_ids.ids[{i}]", f"must be < vocab_size ({vocab_size}); got {tid}"
                )


def check_request_id(request_id: str) -> None:
    """Raises FieldError("request_id") for an id over MAX_REQUEST_ID_CHARS characters."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise FieldError(
            "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters; got {len(request_id)}"
        )


def python_type(name: str) -> Any:
    """The Python type a front parses field `name` into (float, int, bool, list[str],
    list[int], dict[int, float]); None for a message field, which each front maps itself."""
    descriptor = _PROTO.fields_by_name[name]
    scalar = {
        FieldDescriptor.CPPTYPE_FLOAT: float,
        FieldDescriptor.CPPTYPE_DOUBLE: float,
        FieldDescriptor.CPPTYPE_BOOL: bool,
        FieldDescriptor.CPPTYPE_STRING: str,
    }
    if _is_map(descriptor):
        entry = descriptor.message_type.fields_by_name
        key = scalar.get(entry["key"].cpp_type, int)
        return dict.__class_getitem__((key, scalar.get(entry["value"].cpp_type, int)))
    if descriptor.message_type is not None:
        return None
    item = scalar.get(descriptor.cpp_type, int)
    return list.__class_getitem__(item) if descriptor.is_repeated else item
