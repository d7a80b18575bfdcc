"""The --tool-call-parser formats (hermes, llama3_json, mistral) and a required tool_choice's
array, on recorded model outputs: the calls and the content, whole and fed in pieces of every
size (what streaming sees); a call that does not parse comes back as text."""

from __future__ import annotations

import json

import pytest

from sluiceway.router.tool_parsers import (
    PARSERS,
    Call,
    CallStream,
    NamedStream,
    RequiredFormat,
    new_call_id,
    parser_format,
)


def feed_all(stream: CallStream | NamedStream, text: str, step: int) -> tuple[str, list[Call]]:
    """`text` fed in pieces of `step` characters, the last one final."""
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    content, calls = [], []
    for k, piece in enumerate(pieces):
        out, got = stream.feed(piece, k == len(pieces) - 1)
        content.append(out)
        calls += got
    return "".join(content), calls


WEATHER = Call("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = Call("get_time", '{"timezone": "Europe/Paris"}')

# (parser, recorded output, expected content, expected calls). The outputs are each model
# family's format as vLLM's parsers of the same name read it (Hermes-2-Pro / Qwen2.5,
# Llama-3.1/3.2-Instruct, Mistral-7B-Instruct-v0.3 and the v11 tokenizer's Mistral-Small).
CASES = [
    ("hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     "\n</tool_call>",
     "", [WEATHER]),
    ("hermes",
     "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
     "\"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
     "\"arguments\": {\"timezone\": \"Europe/Paris\"}}\n</tool_call>",
     "Let me check both.\n", [WEATHER, TIME]),
    ("hermes",  # the closing tag cut by EOS: taken, as vLLM does
     '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n',
     "", [TIME]),
    ("hermes", "Paris is sunny today, 21 degrees < 30.", "Paris is sunny today, 21 degrees < 30.",
     []),
    ("hermes",  # arguments as a JSON string (some fine-tunes): taken, re-serialized
     '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"Europe/Paris\\"}"}'
     "</tool_call>",
     "", [TIME]),
    ("llama3_json",
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     "", [WEATHER]),
    ("llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
     "", [WEATHER, TIME]),
    ("llama3_json",  # "arguments" is read too
     '  {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}', "", [TIME]),
    ("llama3_json",  # JSON not at the start is text
     'The answer is {"name": "get_time", "parameters": {}}',
     'The answer is {"name": "get_time", "parameters": {}}', []),
    ("mistral",
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}, {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
     "", [WEATHER, TIME]),
    ("mistral",
     'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
     "Sure. ", [TIME]),
    ("mistral",  # the v11 tokenizer's format
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}',
     "", [WEATHER, TIME]),
]  # fmt: skip
MALFORMED = [
    ("hermes", 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n'
     "</tool_call> done", "Checking. "),
    ("hermes", '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', ""),  # no name
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>', ""),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', ""),  # cut short
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {\"timezone\": 3", ""),
    ("mistral", "[TOOL_CALLS]", ""),
]  # fmt: skip
STEPS = [1, 2, 3, 7, 10_000]


@pytest.mark.parametrize(("parser", "output", "content", "calls"), CASES)
@pytest.mark.parametrize("step", STEPS)
def test_recorded_outputs(
    parser: str, output: str, content: str, calls: list[Call], step: int
) -> None:
    assert feed_all(CallStream(parser_format(parser)), output, step) == (content, calls)


@pytest.mark.parametrize(("parser", "output", "before"), MALFORMED)
@pytest.mark.parametrize("step", STEPS)
def test_a_malformed_call_is_text(parser: str, output: str, before: str, step: int) -> None:
    content, calls = feed_all(CallStream(parser_format(parser)), output, step)
    assert calls == []
    assert content == output, (before, content)  # nothing lost, nothing added


def test_text_that_may_begin_a_marker_is_held_back_then_given_out() -> None:
    stream = CallStream(parser_format("hermes"))
    assert stream.feed("a <tool", False) == ("a ", [])
    assert stream.feed("box> b", False) == ("<toolbox> b", [])
    assert stream.feed(" <too", True) == (" <too", [])  # the end: nothing is held


def test_calls_come_out_as_each_completes() -> None:
    stream = CallStream(parser_format("hermes"))
    first = '<tool_call>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}</tool_call>'
    assert stream.feed(first + "\n<tool_ca", False) == ("", [TIME])
    assert stream.feed('ll>{"name": "get_time", "arguments": {}}</tool_call>\n', False) == (
        "",
        [Call("get_time", "{}")],
    )
    assert stream.feed("", True) == ("", [])  # trailing whitespace after a call is dropped


REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},\n'
    ' {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]'
)


@pytest.mark.parametrize("step", STEPS)
def test_required_array(step: int) -> None:
    assert feed_all(CallStream(RequiredFormat()), REQUIRED, step) == ("", [WEATHER, TIME])


def test_required_array_cut_by_max_tokens_is_text() -> None:
    cut = REQUIRED[:100]
    content, calls = feed_all(CallStream(RequiredFormat()), cut, 5)
    assert calls == [WEATHER]  # the first call had closed
    assert content == cut[cut.index("}},") + 2 :] == ',\n {"name": "get_time", '  # the rest


def test_named_streams_the_arguments_as_they_come() -> None:
    stream = NamedStream("get_time")
    assert stream.feed('{"timez', False) == ("", [Call("get_time", '{"timez')])
    assert stream.feed("", False) == ("", [])
    assert stream.feed('one": "UTC"}', True) == ("", [Call("", 'one": "UTC"}')])


def test_unicode_arguments_are_kept_as_text() -> None:
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    _, calls = feed_all(CallStream(parser_format("hermes")), output, 4)
    assert calls == [Call("get_weather", '{"city": "Zürich"}')]
    assert json.loads(calls[0].arguments) == {"city": "Zürich"}


def test_parser_names_are_vllms() -> None:
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]


def test_call_ids() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


@pytest.mark.parametrize("step", STEPS)
def test_a_call_of_a_function_not_in_the_tools_is_text(step: int) -> None:
    names = frozenset({"get_weather", "get_time"})
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert feed_all(CallStream(parser_format("hermes"), names), good, step) == ("", [WEATHER])
    # a call of no such tool, and everything after it, is text; the calls before it stand
    got = feed_all(CallStream(parser_format("hermes"), names), good + "\n" + bad + " ok", step)
    assert got == (bad + " ok", [WEATHER])
    llama = '{"name": "rm_rf", "parameters": {}}'
    assert feed_all(CallStream(parser_format("llama3_json"), names), llama, step) == (llama, [])
