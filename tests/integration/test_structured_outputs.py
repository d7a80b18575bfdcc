"""Structured outputs end to end: sampled at temperature 1 with many seeds, SmolLM2 breaks a
JSON schema, a regex and a choice list when unconstrained, and never when constrained; bad
constraints are INVALID_ARGUMENT (HTTP 400) naming the field; a constraint cut short by
max_tokens ends with LENGTH. Batch invariance, preemption, chunked prefill, prefix caching and
disaggregated prefill/decode with a constraint: tests/integration/test_batch_invariance.py
(its constrained probe)."""

from __future__ import annotations

import json
import math
import re

import grpc
import jsonschema
import openai
import pytest

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, http_base_url, wait_for_free_blocks

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PHONE = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
SENTIMENTS = ["positive", "negative", "neutral"]
SEEDS = 8  # n = 8 samples, seeds 1..8
MODEL = "SmolLM2-135M-Instruct"
STOP = inference_pb2.FINISH_REASON_STOP


def samples(
    stack: Stack, request: inference_pb2.GenerateRequest
) -> list[tuple[str, inference_pb2.GenerateResponse]]:
    with stack.client() as client:
        return [(text, last) for text, _, last in client.generate_samples(request, timeout=600)]


def person_request(
    max_tokens: int = 160, n: int = SEEDS, **constraint: object
) -> inference_pb2.GenerateRequest:
    return Client.request(
        messages=[("user", "Describe a person as JSON with a name, an age and a role.")],
        temperature=1.0, seed=1, n=n, max_tokens=max_tokens, **constraint,
    )  # fmt: skip


def follows_schema(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_schema_holds_for_every_seed_and_breaks_without_it(stack: Stack) -> None:
    free = samples(stack, person_request())
    assert not all(follows_schema(text) for text, _ in free)
    constrained = samples(
        stack,
        person_request(structured_outputs=inference_pb2.StructuredOutputs(json=json.dumps(PERSON))),
    )
    assert len(constrained) == SEEDS
    for text, last in constrained:
        assert last.finish_reason == STOP, text
        assert follows_schema(text), text
    assert len({text for text, _ in constrained}) > 1  # the seeds still differ


def test_regex_and_choice_hold_for_every_seed_and_break_without_them(stack: Stack) -> None:
    def phone(**constraint: object) -> inference_pb2.GenerateRequest:
        return Client.request("My office phone number is", temperature=1.0, seed=1, n=SEEDS,
                              max_tokens=24, **constraint)  # fmt: skip

    def sentiment(**constraint: object) -> inference_pb2.GenerateRequest:
        return Client.request(
            messages=[("user", "Is 'the soup was cold and late' positive, negative or neutral?")],
            temperature=1.0, seed=1, n=SEEDS, max_tokens=8, **constraint,
        )  # fmt: skip

    assert not all(re.fullmatch(PHONE, t) for t, _ in samples(stack, phone()))
    regex = inference_pb2.StructuredOutputs(regex=PHONE)
    for text, last in samples(stack, phone(structured_outputs=regex)):
        assert re.fullmatch(PHONE, text) and last.finish_reason == STOP, text

    assert not all(t in SENTIMENTS for t, _ in samples(stack, sentiment()))
    choice = inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=SENTIMENTS))
    for text, last in samples(stack, sentiment(structured_outputs=choice)):
        assert text in SENTIMENTS and last.finish_reason == STOP, text


def test_grammar_json_object_greedy_penalties_and_logprobs(stack: Stack) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe, " [0-9] [0-9] "%"'
    with stack.client() as client:
        text, _, last = client.generate(
            Client.request("Will it rain tomorrow?", temperature=0, max_tokens=16,
                           presence_penalty=1.5, logprobs=2,
                           structured_outputs=inference_pb2.StructuredOutputs(grammar=grammar)),
            timeout=120,
        )  # fmt: skip
        assert re.fullmatch(r"yes|no|maybe, [0-9]{2}%", text), text
        assert last.finish_reason == STOP
        any_object = inference_pb2.StructuredOutputs(json_object=True)
        text, _, last = client.generate(
            Client.request(messages=[("user", 'Return {"answer": ...} with the sum of 2 and 2.')],
                           temperature=0, max_tokens=200, structured_outputs=any_object),
            timeout=120,
        )  # fmt: skip
        assert last.finish_reason == STOP, text
        assert isinstance(json.loads(text), dict), text
        # sampled, an open-ended object may run past max_tokens; every one that ends is one
        sampled = client.generate_samples(
            Client.request(messages=[("user", "Convert to JSON: name Bob, age 30.")],
                           temperature=1.0, seed=3, n=4, max_tokens=120,
                           structured_outputs=any_object),
            timeout=600,
        )  # fmt: skip
        for text, _, last in sampled:
            if last.finish_reason == STOP:
                assert isinstance(json.loads(text), dict), text
            else:
                assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
                assert text.lstrip().startswith("{"), text


def test_a_constraint_cut_short_ends_with_length(stack: Stack) -> None:
    with stack.client() as client:
        text, ids, last = client.generate(
            person_request(
                structured_outputs=inference_pb2.StructuredOutputs(json=json.dumps(PERSON)),
                max_tokens=3,
                n=1,
            ),
            timeout=120,
        )
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert len(ids) == 3 and text.lstrip().startswith("{"), text


@pytest.mark.parametrize(
    ("constraint", "details"),
    [
        (inference_pb2.StructuredOutputs(json="{not json"),
         "sampling.structured_outputs.json: not valid JSON: Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1)"),
        (inference_pb2.StructuredOutputs(json="[1, 2]"),
         "sampling.structured_outputs.json: a JSON schema is an object or a boolean; got list"),
        (inference_pb2.StructuredOutputs(json='{"type": "florp"}'),
         'sampling.structured_outputs.json: Unsupported type "florp"'),
        (inference_pb2.StructuredOutputs(regex="a(b"),
         "sampling.structured_outputs.regex: Regex parsing error at position 4: The "
         "parenthesis is not closed."),
        (inference_pb2.StructuredOutputs(grammar="root ::= undefined_rule"),
         'sampling.structured_outputs.grammar: EBNF parser error at line 1, column 10: Rule '
         '"undefined_rule" is not defined'),
        (inference_pb2.StructuredOutputs(choice=inference_pb2.Choices()),
         "sampling.structured_outputs.choice: needs 1 to 256 choices; got 0"),
        (inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=["a", ""])),
         "sampling.structured_outputs.choice.choices[1]: must not be empty"),
        (inference_pb2.StructuredOutputs(json_object=False),
         "sampling.structured_outputs.json_object: must be true when set (unset: no "
         "constraint)"),
        (inference_pb2.StructuredOutputs(json='{"$ref": "http://example.com/s.json"}'),
         "sampling.structured_outputs.json: only local $ref (#/...) can be resolved; got $ref "
         "'http://example.com/s.json'"),
        (inference_pb2.StructuredOutputs(regex=""),
         "sampling.structured_outputs.regex: must be 1 to 65536 UTF-8 bytes; got 0"),
    ],
)  # fmt: skip
def test_bad_constraints_are_invalid_argument_naming_the_field(
    stack: Stack, constraint: inference_pb2.StructuredOutputs, details: str
) -> None:
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate(Client.request("Hello", structured_outputs=constraint), timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == details
        info_after = wait_for_free_blocks(client)
        assert info_after.num_free_kv_blocks == info_after.num_kv_blocks
        text, _, _ = client.generate(Client.request("Hello", max_tokens=2), timeout=60)
        assert text  # still serving


def test_http_response_format_and_structured_outputs(stack: Stack) -> None:
    api = openai.OpenAI(base_url=http_base_url(stack), api_key="unused", max_retries=0)
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=1.0, seed=2, n=4, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )  # fmt: skip
    for choice in chat.choices:
        assert choice.finish_reason == "stop"
        assert follows_schema(choice.message.content or ""), choice.message.content
    completion = api.completions.create(
        model=MODEL, prompt="The review 'loved every minute' is", temperature=1.0, seed=2, n=4,
        max_tokens=8, logprobs=5, extra_body={"structured_outputs": {"choice": SENTIMENTS}},
    )  # fmt: skip
    assert all(c.text in SENTIMENTS for c in completion.choices), completion.choices
    # the grammar allows fewer than 5 tokens at some steps: only the finite ones are listed
    tops = [t for c in completion.choices for t in c.logprobs.top_logprobs]  # type: ignore[union-attr]
    assert any(len(t) < 5 for t in tops) and all(
        math.isfinite(lp) for t in tops for lp in t.values()
    )
    older = api.completions.create(  # vLLM's names before structured_outputs
        model=MODEL, prompt="Call me at", temperature=1.0, seed=2, n=4, max_tokens=24,
        extra_body={"guided_regex": PHONE},
    )  # fmt: skip
    assert all(re.fullmatch(PHONE, c.text) for c in older.choices), older.choices
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "florp"}}},
        )  # fmt: skip
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == "response_format.json_schema.schema"
    assert body["message"] == 'response_format.json_schema.schema: Unsupported type "florp"'
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(
            model=MODEL,
            prompt="Hi",
            extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "structured_outputs"
