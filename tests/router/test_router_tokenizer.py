"""router.tokenizer: loading, plain prompts and the chat template, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from tokenizers import processors

from sluiceway.router.tokenizer import encode_chat, encode_prompt, load_tokenizer
from sluiceway.status import FieldError

CONVERSATIONS: list[list[tuple[str, str]]] = [
    [("user", "hi")],
    [("system", "Be terse."), ("user", "What is 2+2?")],
    [
        ("system", "You answer in French."),
        ("user", "Hello"),
        ("assistant", "Bonjour !"),
        ("user", "天气怎么样？🌧️"),
    ],
    [("user", "call the tool"), ("assistant", '{"name": "f"}'), ("tool", '{"result": 4}')],
    [("user", "")],
]


def hf_chat_ids(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_load_tokenizer_is_fast(tokenizer: Any) -> None:
    assert tokenizer.is_fast
    assert tokenizer.backend_tokenizer is not None
    assert len(tokenizer) == 49152


def test_load_tokenizer_missing_folder(tmp_path: pathlib.Path) -> None:
    with pytest.raises(OSError):
        load_tokenizer(tmp_path / "nope")


def test_encode_prompt_matches_tokenizer(tokenizer: Any) -> None:
    for text in ["Hello world", "天气怎么样？", " leading space", "a\x00b\tc\n", ""]:
        assert encode_prompt(tokenizer, text) == tokenizer.encode(text)
    assert encode_prompt(tokenizer, "Hello world") == [19556, 905]


def test_encode_prompt_adds_bos_when_the_tokenizer_does(fresh_tokenizer: Any) -> None:
    bos = fresh_tokenizer.bos_token_id
    fresh_tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{fresh_tokenizer.bos_token} $A",
        special_tokens=[(fresh_tokenizer.bos_token, bos)],
    )
    assert encode_prompt(fresh_tokenizer, "Hello world") == [bos, 19556, 905]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_encode_chat_matches_apply_chat_template(
    tokenizer: Any, messages: list[tuple[str, str]]
) -> None:
    ids = encode_chat(tokenizer, messages)
    assert ids == hf_chat_ids(tokenizer, messages)
    assert all(isinstance(i, int) for i in ids)
    assert ids[:2] != [tokenizer.bos_token_id] * 2  # no double BOS
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    for _role, content in messages:
        assert content in text


def test_encode_chat_default_system_prompt(tokenizer: Any) -> None:
    text = tokenizer.decode(encode_chat(tokenizer, [("user", "hi")]))
    assert text.startswith("<|im_start|>system\n")
    assert text.count("<|im_start|>") == 3


def test_encode_chat_bos_in_template_not_doubled(fresh_tokenizer: Any) -> None:
    tok = fresh_tokenizer
    bos = tok.bos_token_id
    # A tokenizer that adds BOS itself, with a template that writes BOS too (Llama 3 style).
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)]
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    ids = encode_chat(tok, [("user", "Hello world")])
    assert ids[0] == bos and ids.count(bos) == 1
    assert ids == hf_chat_ids(tok, [("user", "Hello world")])
    assert tok.decode(ids) == f"{tok.bos_token}user: Hello world\nassistant:"


@pytest.mark.parametrize("index", [0, 3])
def test_encode_chat_unknown_role(tokenizer: Any, index: int) -> None:
    messages = [("user", "a"), ("assistant", "b"), ("user", "c"), ("user", "d")]
    messages[index] = ("robot", "beep")
    with pytest.raises(FieldError) as info:
        encode_chat(tokenizer, messages)
    assert info.value.field == f"messages[{index}].role"
    assert "robot" in info.value.message and "system" in info.value.message


def test_encode_chat_role_is_case_sensitive(tokenizer: Any) -> None:
    with pytest.raises(FieldError) as info:
        encode_chat(tokenizer, [("User", "hi")])
    assert info.value.field == "messages[0].role"


def test_encode_chat_empty(tokenizer: Any) -> None:
    with pytest.raises(FieldError) as info:
        encode_chat(tokenizer, [])
    assert info.value.field == "messages"


def test_encode_chat_without_template(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = None
    with pytest.raises(FieldError) as info:
        encode_chat(fresh_tokenizer, [("user", "hi")])
    assert info.value.field == "messages"
    assert "chat template" in info.value.message


def test_encode_chat_template_refusal(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert encode_chat(fresh_tokenizer, [("user", "hi")]) == fresh_tokenizer.encode("hi")
    with pytest.raises(FieldError) as info:
        encode_chat(fresh_tokenizer, [("system", "s"), ("user", "hi")])
    assert info.value.field == "messages"
    assert "first must be user" in info.value.message
