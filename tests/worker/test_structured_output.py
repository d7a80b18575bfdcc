"""worker/structured_output.py on SmolLM2's tokenizer: the bitmask allows exactly the tokens
that continue a match, a finished or violated grammar allows only EOS, a matcher rebuilt
from a preempted sequence's output is where the incremental one is, and the sampler keeps
EOS reachable when min_tokens and a finished grammar disagree."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from sluiceway.model_files import resolve_model
from sluiceway.sampling_params import SamplingParams
from sluiceway.v1 import inference_pb2
from sluiceway.worker.loader import load_config
from sluiceway.worker.sampler import sample
from sluiceway.worker.structured_output import (
    ConstraintError,
    GrammarCompiler,
    allow_all_bitmask,
    apply_token_bitmask,
    choice_grammar,
)


@pytest.fixture(scope="module")
def model_dir():  # type: ignore[no-untyped-def]
    return resolve_model(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir) -> GrammarCompiler:  # type: ignore[no-untyped-def]
    config = load_config(model_dir)
    return GrammarCompiler(model_dir, config.vocab_size, list(config.eos_token_ids))


def allowed_ids(grammars: GrammarCompiler, matcher) -> list[int]:  # type: ignore[no-untyped-def]
    bitmask = allow_all_bitmask(1, grammars.vocab_size)
    matcher.fill(bitmask, 0)
    logits = torch.zeros(1, grammars.vocab_size)
    apply_token_bitmask(logits, bitmask, [0])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_a_choice_allows_the_prefixes_of_its_strings_then_only_eos(
    grammars: GrammarCompiler, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    choice = inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=["yes", "no"]))
    m = grammars.matcher(choice)
    first = {tokenizer.decode([t]) for t in allowed_ids(grammars, m)}
    assert first == {"y", "ye", "yes", "n", "no"}
    m.accept(tokenizer.encode("yes", add_special_tokens=False))
    assert allowed_ids(grammars, m) == list(grammars.stop_token_ids)
    m.accept([grammars.stop_token_ids[0]])  # terminated: still only EOS, no error
    assert allowed_ids(grammars, m) == list(grammars.stop_token_ids)


def test_a_refused_token_leaves_only_eos(grammars: GrammarCompiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    m = grammars.matcher(inference_pb2.StructuredOutputs(regex="[0-9]+"))
    m.accept(tokenizer.encode("12", add_special_tokens=False))
    assert not m.violated
    m.accept(tokenizer.encode("a", add_special_tokens=False))
    assert m.violated
    assert allowed_ids(grammars, m) == list(grammars.stop_token_ids)


def test_a_rebuilt_matcher_is_where_the_incremental_one_is(
    grammars: GrammarCompiler, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    schema = inference_pb2.StructuredOutputs(
        json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    output = tokenizer.encode('{"a": 1', add_special_tokens=False)
    incremental = grammars.matcher(schema)
    for t in output:
        incremental.accept([t])
    rebuilt = grammars.matcher(schema, output)
    assert allowed_ids(grammars, rebuilt) == allowed_ids(grammars, incremental)
    assert tokenizer.encode("}", add_special_tokens=False)[0] in allowed_ids(grammars, rebuilt)


def test_choice_strings_are_escaped(grammars: GrammarCompiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    tricky = ['say "hi"', "back\\slash", "é"]
    assert choice_grammar(tricky) == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "é"'
    choice = inference_pb2.StructuredOutputs(choice=inference_pb2.Choices(choices=tricky))
    for text in tricky:
        m = grammars.matcher(choice, tokenizer.encode(text, add_special_tokens=False))
        assert not m.violated and allowed_ids(grammars, m) == list(grammars.stop_token_ids)


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (inference_pb2.StructuredOutputs(json='{"type": "florp"}'), "json"),
        (inference_pb2.StructuredOutputs(regex="(("), "regex"),
        (inference_pb2.StructuredOutputs(grammar="root ::= missing"), "grammar"),
    ],
)
def test_compile_errors_name_the_field_without_xgrammar_noise(
    grammars: GrammarCompiler, constraint: inference_pb2.StructuredOutputs, field: str
) -> None:
    with pytest.raises(ConstraintError) as info:
        grammars.compile(constraint)
    assert info.value.field == f"sampling.structured_outputs.{field}"
    assert str(info.value).startswith(f"sampling.structured_outputs.{field}: ")
    assert ".cc:" not in str(info.value) and "Check failed" not in str(info.value)


def test_min_tokens_does_not_mask_the_only_token_a_finished_grammar_allows() -> None:
    logits = torch.full((2, 8), float("-inf"))
    logits[:, 2] = 0.0  # the grammar allows only EOS (id 2) in both rows
    logits[1, 5] = 1.0  # row 1 also allows token 5
    options = [SamplingParams(temperature=0, min_tokens=4, stop_token_ids=(2,))] * 2
    result = sample(logits, options, [None, None], [[1], [1]], [1, 1])
    assert result.token_ids.tolist() == [2, 5]
