"""The sampling contract (sluiceway/sampling_params.py): vLLM's defaults, the caps and rules
that depend on the prompt and the model, every rejection with its exact field name, and the
proto's fields being the contract's, field for field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sluiceway.sampling_params import (
    FIELDS,
    MAX_REQUEST_ID_CHARS,
    SamplingParams,
    check_prompt_token_ids,
    check_request_id,
    check_structured_outputs,
    sampling_proto,
)
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2

VOCAB = 49152
MAX_LEN = 2048
EOS = [2]


def resolve(prompt_len: int = 10, eos: list[int] | None = None, **fields: object) -> SamplingParams:
    """The request's `SamplingParams` as the router's gate makes them: from the proto, then
    resolved for a prompt of `prompt_len` tokens."""
    params = SamplingParams.from_proto(inference_pb2.SamplingParams(**fields))  # type: ignore[arg-type]
    return params.resolve(
        prompt_len=prompt_len,
        max_model_len=MAX_LEN,
        vocab_size=VOCAB,
        eos_token_ids=EOS if eos is None else eos,
    )


def field_of(**fields: object) -> str:
    with pytest.raises(FieldError) as info:
        resolve(**fields)  # type: ignore[arg-type]
    assert info.value.field is not None
    return info.value.field


def test_field_error_str_and_attributes() -> None:
    e = FieldError("sampling.top_p", "must be in (0, 1]; got 2.0")
    assert e.field == "sampling.top_p"
    assert e.message == "must be in (0, 1]; got 2.0"
    assert str(e) == e.details == "sampling.top_p: must be in (0, 1]; got 2.0"
    assert isinstance(e, ValueError)


def test_the_contract_has_exactly_the_protos_fields_in_its_order() -> None:
    proto = [f.name for f in inference_pb2.SamplingParams.DESCRIPTOR.fields]
    assert list(FIELDS) == proto
    assert [f.name for f in dataclasses.fields(SamplingParams)] == proto


def test_every_field_survives_the_wire_both_ways() -> None:
    params = SamplingParams(
        temperature=0.5, top_p=0.75, top_k=3, repetition_penalty=1.25, max_tokens=9,
        stop=("a", "b"), stop_token_ids=(5, 2), ignore_eos=True, seed=0, min_p=0.25,
        presence_penalty=-1.5, frequency_penalty=0.5, min_tokens=2,
        include_stop_str_in_output=True, skip_special_tokens=False, logprobs=0, n=3,
        logit_bias={7: -100.0, 8: 2.5}, allowed_token_ids=(3, 9), prompt_logprobs=0,
    )  # fmt: skip
    constrained = dataclasses.replace(  # allowed_token_ids and a constraint exclude each other
        params,
        allowed_token_ids=(),
        structured_outputs=inference_pb2.StructuredOutputs(regex="[a-z]+"),
    )
    set_fields = {
        n for n, (d, _) in FIELDS.items() if d != getattr(params, n) or d != getattr(constrained, n)
    }
    assert set_fields == set(FIELDS), "test every field"
    for p in (params, constrained):
        assert SamplingParams.from_proto(p.to_proto()) == p
    assert SamplingParams.from_proto(inference_pb2.SamplingParams()) == SamplingParams()


def test_integers_past_their_proto_type_are_refused_before_the_proto_is_made() -> None:
    with pytest.raises(FieldError) as info:
        sampling_proto({"max_tokens": 2**32})
    assert info.value.field == "sampling.max_tokens"
    # said with the range the field allows within its type, not the type's alone
    assert info.value.message == "must be in [1, 4294967295] (uint32); got 4294967296"
    with pytest.raises(FieldError) as info:
        sampling_proto({"temperature": 1e39})  # a float32 would hold it as inf
    assert (info.value.field, info.value.message) == (
        "sampling.temperature",
        "must be a finite number in [0, 3.40282e+38] (0 = greedy) (float); got 1e+39",
    )
    with pytest.raises(FieldError) as info:
        sampling_proto({"logprobs": -1})
    assert info.value.message == "must be in [0, 20]; got -1"
    with pytest.raises(FieldError) as info:
        sampling_proto({"max_tokens": -1})  # said with the field's own range first
    assert info.value.message == "must be >= 1; got -1"
    with pytest.raises(FieldError) as info:
        sampling_proto({"stop_token_ids": [1, -3]})
    assert info.value.field == "sampling.stop_token_ids[1]"
    with pytest.raises(FieldError) as info:
        sampling_proto({"logit_bias": {2**32: 1.0}})
    assert info.value.field == "sampling.logit_bias[4294967296]"
    assert sampling_proto({"top_k": -1, "logit_bias": {3: 1.0}}) == inference_pb2.SamplingParams(
        top_k=-1, logit_bias={3: 1.0}
    )


def test_allowed_token_ids_must_be_in_the_vocabulary() -> None:
    assert resolve(allowed_token_ids=[0, VOCAB - 1]).allowed_token_ids == (0, VOCAB - 1)
    assert field_of(allowed_token_ids=[3, VOCAB]) == "sampling.allowed_token_ids[1]"


def test_allowed_token_ids_do_not_combine_with_structured_outputs() -> None:
    """Both mask tokens: together they could leave none to sample."""
    choice = inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=["hello"]))
    with pytest.raises(FieldError) as info:
        SamplingParams(allowed_token_ids=(5,), structured_outputs=choice)
    assert (info.value.field, info.value.message) == (
        "sampling.allowed_token_ids",
        "cannot be combined with structured_outputs (the grammar alone says which tokens may come)",
    )


@pytest.mark.parametrize(
    ("name", "limit"),
    [("stop_token_ids", 1024), ("logit_bias", 1024), ("allowed_token_ids", 262_144)],
)
def test_token_id_lists_are_bounded(name: str, limit: int) -> None:
    """Each entry is work in every step of the request (a 3 MB list slowed every other
    stream); allowed_token_ids may name the largest vocabulary served."""
    ids = range(limit + 1)
    value = dict.fromkeys(ids, 1.0) if name == "logit_bias" else tuple(ids)
    with pytest.raises(FieldError) as info:
        SamplingParams(**{name: value})
    assert (info.value.field, info.value.message) == (
        f"sampling.{name}",
        f"at most {limit} entries; got {limit + 1}",
    )


def test_logit_bias_range_and_token_ids() -> None:
    assert resolve(logit_bias={0: -100.0, VOCAB - 1: 100.0}).logit_bias == {
        0: -100.0,
        VOCAB - 1: 100.0,
    }
    assert field_of(logit_bias={5: 100.5}) == "sampling.logit_bias[5]"
    assert field_of(logit_bias={5: math.nan}) == "sampling.logit_bias[5]"
    with pytest.raises(FieldError) as info:
        resolve(logit_bias={3: 1.0, VOCAB: 1.0})
    assert info.value.field == f"sampling.logit_bias[{VOCAB}]"
    assert info.value.message == f"must be < vocab_size ({VOCAB}); got {VOCAB}"


def test_defaults_are_vllms() -> None:
    r = resolve()
    assert r.temperature == 1.0
    assert r.top_p == 1.0
    assert r.top_k == 0
    assert r.repetition_penalty == 1.0
    assert r.seed is None
    assert r.max_tokens == FIELDS["max_tokens"][0] == 16
    assert r.stop == ()
    assert r.stop_token_ids == tuple(EOS)


def test_set_values_travel() -> None:
    r = resolve(
        temperature=0.5, top_p=0.9, top_k=40, repetition_penalty=1.2, seed=7, max_tokens=100
    )
    assert r.temperature == pytest.approx(0.5)
    assert r.top_p == pytest.approx(0.9)
    assert r.top_k == 40
    assert r.repetition_penalty == pytest.approx(1.2)
    assert r.seed == 7
    assert r.max_tokens == 100


def test_seed_zero_is_kept() -> None:
    r = resolve(seed=0)
    assert r.seed == 0


def test_top_k_minus_one_is_off() -> None:
    assert resolve(top_k=-1).top_k == 0
    assert resolve(top_k=0).top_k == 0
    assert resolve(top_k=1).top_k == 1
    assert resolve(top_k=VOCAB).top_k == 0  # keeps every token: off


def test_greedy_temperature_resets_top_p_top_k() -> None:
    r = resolve(temperature=0.0, top_p=0.5, top_k=5)
    assert (r.temperature, r.top_p, r.top_k) == (0.0, 1.0, 0)
    r = resolve(temperature=1e-6, top_p=0.5)
    assert (r.temperature, r.top_p) == (0.0, 1.0)


def test_max_tokens_capped_to_max_model_len() -> None:
    assert resolve(prompt_len=2000, max_tokens=100).max_tokens == MAX_LEN - 2000
    assert resolve(prompt_len=MAX_LEN - 1).max_tokens == 1
    assert resolve(prompt_len=MAX_LEN - 16).max_tokens == 16
    assert resolve(prompt_len=10, max_tokens=2**32 - 1).max_tokens == MAX_LEN - 10


def test_prompt_filling_the_model_is_input_error() -> None:
    with pytest.raises(FieldError) as info:
        check_prompt_token_ids([5] * MAX_LEN, VOCAB, MAX_LEN)  # the gate, before resolve
    assert info.value.field == "input"
    assert str(MAX_LEN) in info.value.message


def test_stop_token_ids_include_eos_unless_ignore_eos() -> None:
    assert resolve(stop_token_ids=[5, 7]).stop_token_ids == (
        5,
        7,
        2,
    )
    assert resolve(stop_token_ids=[5, 2, 5]).stop_token_ids == (
        5,
        2,
    )
    assert resolve(stop_token_ids=[5], ignore_eos=True).stop_token_ids == (5,)
    assert resolve(ignore_eos=True).stop_token_ids == ()
    assert resolve(eos=[2, 0]).stop_token_ids == (
        2,
        0,
    )
    assert resolve(stop_token_ids=[VOCAB - 1]).stop_token_ids == (
        VOCAB - 1,
        2,
    )


def test_stop_strings_kept_in_order_deduplicated() -> None:
    assert resolve(stop=["b", "a", "b"]).stop == (
        "b",
        "a",
    )
    assert resolve(stop=["x"] * 16).stop == ("x",)
    assert resolve(stop=["é" * 128]).stop == ("é" * 128,)  # exactly 256 bytes


def test_unset_fields_take_the_defaults_set_ones_are_kept() -> None:
    req = inference_pb2.GenerateRequest(
        prompt="hi", sampling=inference_pb2.SamplingParams(top_k=3, max_tokens=4)
    )
    r = SamplingParams.from_proto(req.sampling).resolve(
        prompt_len=3, max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=EOS
    )
    assert r.top_k == 3 and r.max_tokens == 4 and r.temperature == 1.0


def test_sampling_params_are_slotted_and_frozen() -> None:
    r = resolve()
    assert not hasattr(r, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.temperature = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("value", [-0.1, -1.0, math.nan, math.inf, -math.inf])
def test_temperature_rejected(value: float) -> None:
    assert field_of(temperature=value) == "sampling.temperature"


@pytest.mark.parametrize("value", [0.0, -0.5, 1.0001, 2.0, math.nan, math.inf])
def test_top_p_rejected(value: float) -> None:
    with pytest.raises(FieldError) as info:
        resolve(top_p=value)
    assert info.value.field == "sampling.top_p"
    assert "(0, 1]" in info.value.message


def test_top_p_one_accepted() -> None:
    assert resolve(top_p=1.0).top_p == 1.0


@pytest.mark.parametrize("value", [-2, -100, -(2**31)])
def test_top_k_rejected(value: int) -> None:
    assert field_of(top_k=value) == "sampling.top_k"


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_repetition_penalty_rejected(value: float) -> None:
    assert field_of(repetition_penalty=value) == "sampling.repetition_penalty"


def test_max_tokens_zero_rejected() -> None:
    assert field_of(max_tokens=0) == "sampling.max_tokens"


def test_stop_token_id_out_of_vocab_rejected() -> None:
    with pytest.raises(FieldError) as info:
        resolve(stop_token_ids=[3, VOCAB + 5, VOCAB])
    assert info.value.field == "sampling.stop_token_ids[1]"
    assert str(VOCAB) in info.value.message
    assert field_of(stop_token_ids=[VOCAB]) == "sampling.stop_token_ids[0]"


def test_too_many_stop_strings_rejected() -> None:
    with pytest.raises(FieldError) as info:
        resolve(stop=[f"s{i}" for i in range(17)])
    assert info.value.field == "sampling.stop"
    assert "16" in info.value.message


def test_empty_stop_string_rejected() -> None:
    assert field_of(stop=["ok", ""]) == "sampling.stop[1]"


def test_long_stop_string_rejected() -> None:
    with pytest.raises(FieldError) as info:
        resolve(stop=["a", "b", "x" * 257])
    assert info.value.field == "sampling.stop[2]"
    assert "256" in info.value.message
    assert field_of(stop=["é" * 129]) == "sampling.stop[0]"  # 258 bytes, 129 characters


# -- check_prompt_token_ids --------------------------------------------------


def test_prompt_ok() -> None:
    check_prompt_token_ids([0, 1, VOCAB - 1], VOCAB, MAX_LEN)
    check_prompt_token_ids([5] * (MAX_LEN - 1), VOCAB, MAX_LEN)


def test_empty_prompt_rejected() -> None:
    with pytest.raises(FieldError) as info:
        check_prompt_token_ids([], VOCAB, MAX_LEN)
    assert info.value.field == "input"


def test_prompt_id_out_of_vocab_rejected() -> None:
    with pytest.raises(FieldError) as info:
        check_prompt_token_ids([1, 2, VOCAB, VOCAB + 1], VOCAB, MAX_LEN)
    assert info.value.field == "prompt_token_ids.ids[2]"
    assert str(VOCAB) in info.value.message


def test_prompt_too_long_rejected() -> None:
    with pytest.raises(FieldError) as info:
        check_prompt_token_ids([5] * MAX_LEN, VOCAB, MAX_LEN)
    assert info.value.field == "input"
    assert str(MAX_LEN) in info.value.message and str(MAX_LEN - 1) in info.value.message


def test_request_id_length_is_bounded() -> None:
    check_request_id("x" * MAX_REQUEST_ID_CHARS)
    with pytest.raises(FieldError) as err:
        check_request_id("x" * (MAX_REQUEST_ID_CHARS + 1))
    assert err.value.field == "request_id"


def test_new_sampling_defaults_are_vllms() -> None:
    r = resolve()
    assert (r.min_p, r.presence_penalty, r.frequency_penalty) == (
        0.0, 0.0, 0.0,
    )  # fmt: skip
    assert (r.min_tokens, r.include_stop_str_in_output, r.skip_special_tokens) == (0, False, True)
    assert r.logprobs is None and not r.to_proto().HasField("logprobs")
    assert r.stop_token_ids == tuple(EOS)  # what the scheduler stops on and min_tokens masks


def test_new_sampling_values_travel() -> None:
    r = resolve(min_p=0.1, presence_penalty=-2.0, frequency_penalty=1.5, min_tokens=5,
                max_tokens=20, logprobs=0, include_stop_str_in_output=True,
                skip_special_tokens=False, stop_token_ids=[7])  # fmt: skip
    assert r.min_p == pytest.approx(0.1)
    assert (r.presence_penalty, r.frequency_penalty) == (-2.0, 1.5)
    assert r.min_tokens == 5
    assert list(r.stop_token_ids) == [7, 2]  # masked until 5 tokens: EOS included
    assert r.logprobs == 0 and r.to_proto().HasField("logprobs")
    assert r.include_stop_str_in_output and not r.skip_special_tokens


def test_min_p_is_off_for_greedy_and_min_tokens_capped_with_max_tokens() -> None:
    assert resolve(temperature=0, min_p=0.5).min_p == 0.0
    r = resolve(prompt_len=MAX_LEN - 3, max_tokens=10, min_tokens=8)
    assert (r.max_tokens, r.min_tokens) == (3, 3)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"min_p": -0.1}, "sampling.min_p"),
        ({"min_p": 1.5}, "sampling.min_p"),
        ({"min_p": math.nan}, "sampling.min_p"),
        ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
        ({"presence_penalty": math.nan}, "sampling.presence_penalty"),
        ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
        ({"logprobs": 21}, "sampling.logprobs"),
        ({"prompt_logprobs": 21}, "sampling.prompt_logprobs"),
        ({"min_tokens": 17}, "sampling.min_tokens"),  # over the default max_tokens 16
        ({"min_tokens": 5, "max_tokens": 4}, "sampling.min_tokens"),
    ],
)
def test_new_sampling_values_rejected(fields: dict[str, object], field: str) -> None:
    assert field_of(**fields) == field


@pytest.mark.parametrize(
    ("schema", "error"),
    [
        ({"type": "object", "properties": {"a": {"items": [{"$ref": "other.json#/x"}]}}},
         "sampling.structured_outputs.json: only local $ref (#/...) can be resolved; got $ref "
         "'other.json#/x'"),
        ({"$defs": {"p": {"type": "integer"}}, "properties": {"$ref": {"$ref": "#/$defs/p"}}},
         None),  # a local $ref, and a property that happens to be named "$ref"
    ],
)  # fmt: skip
def test_json_schemas_with_an_external_ref_are_refused(schema: object, error: str | None) -> None:
    import json

    constraint = inference_pb2.StructuredOutputs(json=json.dumps(schema))
    if error is None:
        check_structured_outputs(constraint)
    else:
        with pytest.raises(FieldError) as info:
            check_structured_outputs(constraint)
        assert str(info.value) == error


def test_every_field_is_documented_for_clients() -> None:
    """docs/client.md's table of `Client.request` arguments and README's list of
    `SamplingParams` name every field of the contract (the proto comments, docs/api.md, are
    generated and checked by tests/test_proto_docs.py)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    table = (root / "docs" / "client.md").read_text(encoding="utf-8")
    readme = (root / "README.md").read_text(encoding="utf-8")
    missing = [n for n in FIELDS if f"| `{n}` |" not in table]
    assert not missing, f"docs/client.md lacks {missing}"
    missing = [n for n in FIELDS if f"`{n}`" not in readme]
    assert not missing, f"README.md lacks {missing}"


def test_the_python_client_takes_one_stop_string_as_one() -> None:
    """As OpenAI's `stop`: a str is one stop string, not its letters."""
    from sluiceway.client import Client

    assert list(Client.request("x", stop="zebra").sampling.stop) == ["zebra"]
    assert list(Client.request("x", stop=["a", "b"]).sampling.stop) == ["a", "b"]
