"""router.validation: vLLM defaults, caps, and every rejection with its exact field name."""

from __future__ import annotations

import math

import pytest

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.errors import InvalidRequest
from sluiceway.router.validation import (
    DEFAULT_MAX_TOKENS,
    ResolvedSampling,
    resolve_request,
    validate_prompt_token_ids,
)
from sluiceway.v1 import inference_pb2

VOCAB = 49152
MAX_LEN = 2048
EOS = [2]


def resolve(
    prompt_len: int = 10, eos: list[int] | None = None, **fields: object
) -> ResolvedSampling:
    return resolve_request(
        inference_pb2.SamplingParams(**fields),  # type: ignore[arg-type]
        prompt_len=prompt_len,
        max_model_len=MAX_LEN,
        vocab_size=VOCAB,
        eos_token_ids=EOS if eos is None else eos,
    )


def field_of(**fields: object) -> str:
    with pytest.raises(InvalidRequest) as info:
        resolve(**fields)  # type: ignore[arg-type]
    return info.value.field


def test_invalid_request_str_and_attributes() -> None:
    e = InvalidRequest("sampling.top_p", "must be in (0, 1]; got 2.0")
    assert e.field == "sampling.top_p"
    assert e.message == "must be in (0, 1]; got 2.0"
    assert str(e) == "sampling.top_p: must be in (0, 1]; got 2.0"
    assert isinstance(e, Exception)


def test_defaults_are_vllms() -> None:
    r = resolve()
    assert isinstance(r.sampling, scheduler_pb2.SequenceSamplingParams)
    assert r.sampling.temperature == 1.0
    assert r.sampling.top_p == 1.0
    assert r.sampling.top_k == 0
    assert r.sampling.repetition_penalty == 1.0
    assert not r.sampling.HasField("seed")
    assert r.max_tokens == DEFAULT_MAX_TOKENS == 16
    assert r.stop == []
    assert r.stop_token_ids == EOS


def test_set_values_travel() -> None:
    r = resolve(
        temperature=0.5, top_p=0.9, top_k=40, repetition_penalty=1.2, seed=7, max_tokens=100
    )
    assert r.sampling.temperature == pytest.approx(0.5)
    assert r.sampling.top_p == pytest.approx(0.9)
    assert r.sampling.top_k == 40
    assert r.sampling.repetition_penalty == pytest.approx(1.2)
    assert r.sampling.HasField("seed") and r.sampling.seed == 7
    assert r.max_tokens == 100


def test_seed_zero_is_kept() -> None:
    r = resolve(seed=0)
    assert r.sampling.HasField("seed") and r.sampling.seed == 0


def test_top_k_minus_one_is_off() -> None:
    assert resolve(top_k=-1).sampling.top_k == 0
    assert resolve(top_k=0).sampling.top_k == 0
    assert resolve(top_k=1).sampling.top_k == 1
    assert resolve(top_k=VOCAB).sampling.top_k == 0  # keeps every token: off


def test_greedy_temperature_resets_top_p_top_k() -> None:
    r = resolve(temperature=0.0, top_p=0.5, top_k=5)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.top_k) == (0.0, 1.0, 0)
    r = resolve(temperature=1e-6, top_p=0.5)
    assert (r.sampling.temperature, r.sampling.top_p) == (0.0, 1.0)


def test_max_tokens_capped_to_max_model_len() -> None:
    assert resolve(prompt_len=2000, max_tokens=100).max_tokens == MAX_LEN - 2000
    assert resolve(prompt_len=MAX_LEN - 1).max_tokens == 1
    assert resolve(prompt_len=MAX_LEN - 16).max_tokens == 16
    assert resolve(prompt_len=10, max_tokens=2**32 - 1).max_tokens == MAX_LEN - 10


def test_prompt_filling_the_model_is_input_error() -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(prompt_len=MAX_LEN)
    assert info.value.field == "input"
    assert str(MAX_LEN) in info.value.message


def test_stop_token_ids_include_eos_unless_ignore_eos() -> None:
    assert resolve(stop_token_ids=[5, 7]).stop_token_ids == [5, 7, 2]
    assert resolve(stop_token_ids=[5, 2, 5]).stop_token_ids == [5, 2]
    assert resolve(stop_token_ids=[5], ignore_eos=True).stop_token_ids == [5]
    assert resolve(ignore_eos=True).stop_token_ids == []
    assert resolve(eos=[2, 0]).stop_token_ids == [2, 0]
    assert resolve(stop_token_ids=[VOCAB - 1]).stop_token_ids == [VOCAB - 1, 2]


def test_stop_strings_kept_in_order_deduplicated() -> None:
    assert resolve(stop=["b", "a", "b"]).stop == ["b", "a"]
    assert resolve(stop=["x"] * 16).stop == ["x"]
    assert resolve(stop=["é" * 128]).stop == ["é" * 128]  # exactly 256 bytes


def test_generate_request_accepted() -> None:
    req = inference_pb2.GenerateRequest(
        prompt="hi", sampling=inference_pb2.SamplingParams(top_k=3, max_tokens=4)
    )
    r = resolve_request(
        req, prompt_len=3, max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=EOS
    )
    assert r.sampling.top_k == 3 and r.max_tokens == 4


def test_resolved_sampling_is_slotted() -> None:
    r = resolve()
    assert not hasattr(r, "__dict__")


@pytest.mark.parametrize("value", [-0.1, -1.0, math.nan, math.inf, -math.inf])
def test_temperature_rejected(value: float) -> None:
    assert field_of(temperature=value) == "sampling.temperature"


@pytest.mark.parametrize("value", [0.0, -0.5, 1.0001, 2.0, math.nan, math.inf])
def test_top_p_rejected(value: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(top_p=value)
    assert info.value.field == "sampling.top_p"
    assert "(0, 1]" in info.value.message


def test_top_p_one_accepted() -> None:
    assert resolve(top_p=1.0).sampling.top_p == 1.0


@pytest.mark.parametrize("value", [-2, -100, -(2**31)])
def test_top_k_rejected(value: int) -> None:
    assert field_of(top_k=value) == "sampling.top_k"


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_repetition_penalty_rejected(value: float) -> None:
    assert field_of(repetition_penalty=value) == "sampling.repetition_penalty"


def test_max_tokens_zero_rejected() -> None:
    assert field_of(max_tokens=0) == "sampling.max_tokens"


def test_stop_token_id_out_of_vocab_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(stop_token_ids=[3, VOCAB + 5, VOCAB])
    assert info.value.field == "sampling.stop_token_ids[1]"
    assert str(VOCAB) in info.value.message
    assert field_of(stop_token_ids=[VOCAB]) == "sampling.stop_token_ids[0]"


def test_too_many_stop_strings_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(stop=[f"s{i}" for i in range(17)])
    assert info.value.field == "sampling.stop"
    assert "16" in info.value.message


def test_empty_stop_string_rejected() -> None:
    assert field_of(stop=["ok", ""]) == "sampling.stop[1]"


def test_long_stop_string_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(stop=["a", "b", "x" * 257])
    assert info.value.field == "sampling.stop[2]"
    assert "256" in info.value.message
    assert field_of(stop=["é" * 129]) == "sampling.stop[0]"  # 258 bytes, 129 characters


# -- validate_prompt_token_ids --------------------------------------------------


def test_prompt_ok() -> None:
    validate_prompt_token_ids([0, 1, VOCAB - 1], VOCAB, MAX_LEN)
    validate_prompt_token_ids([5] * (MAX_LEN - 1), VOCAB, MAX_LEN)


def test_empty_prompt_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_prompt_token_ids([], VOCAB, MAX_LEN)
    assert info.value.field == "input"


def test_prompt_id_out_of_vocab_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_prompt_token_ids([1, 2, VOCAB, VOCAB + 1], VOCAB, MAX_LEN)
    assert info.value.field == "prompt_token_ids.ids[2]"
    assert str(VOCAB) in info.value.message


def test_prompt_too_long_rejected() -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_prompt_token_ids([5] * MAX_LEN, VOCAB, MAX_LEN)
    assert info.value.field == "input"
    assert str(MAX_LEN) in info.value.message and str(MAX_LEN - 1) in info.value.message


def test_request_id_length_is_bounded() -> None:
    from sluiceway.router.validation import MAX_REQUEST_ID_CHARS, validate_request_id

    validate_request_id("x" * MAX_REQUEST_ID_CHARS)
    with pytest.raises(InvalidRequest) as err:
        validate_request_id("x" * (MAX_REQUEST_ID_CHARS + 1))
    assert err.value.field == "request_id"


def test_new_sampling_defaults_are_vllms() -> None:
    r = resolve()
    assert (r.sampling.min_p, r.sampling.presence_penalty, r.sampling.frequency_penalty) == (
        0.0, 0.0, 0.0,
    )  # fmt: skip
    assert (r.min_tokens, r.include_stop_str_in_output, r.skip_special_tokens) == (0, False, True)
    assert r.logprobs is None and not r.sampling.HasField("num_logprobs")
    assert list(r.sampling.stop_token_ids) == []  # only sent when min_tokens masks them


def test_new_sampling_values_travel() -> None:
    r = resolve(min_p=0.1, presence_penalty=-2.0, frequency_penalty=1.5, min_tokens=5,
                max_tokens=20, logprobs=0, include_stop_str_in_output=True,
                skip_special_tokens=False, stop_token_ids=[7])  # fmt: skip
    assert r.sampling.min_p == pytest.approx(0.1)
    assert (r.sampling.presence_penalty, r.sampling.frequency_penalty) == (-2.0, 1.5)
    assert r.min_tokens == r.sampling.min_tokens == 5
    assert list(r.sampling.stop_token_ids) == [7, 2]  # masked until 5 tokens: EOS included
    assert r.logprobs == 0 and r.sampling.HasField("num_logprobs")
    assert r.include_stop_str_in_output and not r.skip_special_tokens


def test_min_p_is_off_for_greedy_and_min_tokens_capped_with_max_tokens() -> None:
    assert resolve(temperature=0, min_p=0.5).sampling.min_p == 0.0
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

    from sluiceway.router.validation import check_structured_outputs

    constraint = inference_pb2.StructuredOutputs(json=json.dumps(schema))
    if error is None:
        check_structured_outputs(constraint)
    else:
        with pytest.raises(InvalidRequest) as info:
            check_structured_outputs(constraint)
        assert str(info.value) == error
