"""`--chat-template FILE|STRING` (vLLM's flag): the template read from a file or from the flag's
own text, the router's tokenizer rendering chat requests with it on the one request path (the
tokens a scheduler receives), and a model without any template refused with the fix named.
The schedulers are fakes (tests/router/test_balancer.py)."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.grpc_api import Router
from sluiceway.router.openai_api import start_http_server
from sluiceway.router.tokenizer import load_chat_template, load_tokenizer
from tests.router.test_balancer import FakeScheduler, _with_router, run

# as a file holds it; on a command line the newlines are typed \n
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NO_TEMPLATE = (
    "messages: this model has no chat template: start the server with --chat-template "
    "FILE|STRING (a Jinja template), or send a plain prompt instead"
)


def test_the_template_from_a_file_or_from_the_flags_text(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE.replace("\n", "\\n")) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    # only backslash escapes are decoded: other characters stay as typed
    assert load_chat_template("{{ 'café ☕' }}\\t") == "{{ 'café ☕' }}\t"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("/nonexistent/chat.jinja", "--chat-template '/nonexistent/chat.jinja' looks like a "
         "file path, but it cannot be read: No such file or directory"),
        ("{% for m in messages %}{{ m }}", "--chat-template: line 1: Unexpected end of "
         "template. Jinja was looking for the following tags: 'endfor' or 'else'. The "
         "innermost block that needs to be closed is 'for'."),
    ],
)  # fmt: skip
def test_a_template_that_cannot_be_read_or_parsed_is_one_line(value: str, error: str) -> None:
    with pytest.raises(ValueError) as e:
        load_chat_template(value)
    assert str(e.value) == error


def test_a_folder_is_not_a_template(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="looks like a file path, but it cannot be read"):
        load_chat_template(str(tmp_path))


class PromptScheduler(FakeScheduler):
    """Records the prompt token ids of every AddRequest."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[int]] = []

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.prompts.append(list(request.prompt_token_ids))
        async for event in super().AddRequest(request, context):
            yield event


def _chat_through_the_path(tokenizer: Any, model_dir: pathlib.Path) -> list[Any]:
    """Sends one chat request over HTTP through the router's path; returns [status, body,
    the prompt ids the scheduler received (None when it received none)]."""
    out: list[Any] = []

    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        (fake,) = fakes
        assert isinstance(fake, PromptScheduler)
        http = await start_http_server(router.path, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=http.url, timeout=30) as client:
                body = {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}], "max_tokens": 2}  # fmt: skip
                r = await client.post("/v1/chat/completions", json=body)
        finally:
            await http.stop()
        out.extend([r.status_code, r.json(), fake.prompts[0] if fake.prompts else None])

    run(_with_router(tokenizer, model_dir, [PromptScheduler()], scenario))
    return out


@pytest.mark.parametrize("given_as", ["file", "string"])
def test_chat_requests_render_with_the_flags_template(
    tokenizer_dir: pathlib.Path, tmp_path: pathlib.Path, given_as: str
) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    value = str(path) if given_as == "file" else TEMPLATE.replace("\n", "\\n")
    tokenizer = load_tokenizer(tokenizer_dir, chat_template=load_chat_template(value))
    status, body, prompt = _chat_through_the_path(tokenizer, tokenizer_dir)
    assert status == 200, body
    text = "<|system|>Be brief.\n<|user|>Hi there\n<|assistant|>"
    assert prompt == tokenizer.encode(text, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_a_model_without_a_template_names_the_flag(tokenizer_dir: pathlib.Path) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    tokenizer.chat_template = None  # as a base model's GGUF
    status, body, prompt = _chat_through_the_path(tokenizer, tokenizer_dir)
    assert (status, prompt) == (400, None)
    assert body["error"]["message"] == NO_TEMPLATE
    assert body["error"]["param"] == "messages"
