"""The model's own tokenizer and chat template, as the router uses them.

Loading goes through `transformers.AutoTokenizer` from a local folder only
(never a model hub). Only fast tokenizers (backed by the `tokenizers`
library) are accepted: the incremental detokenizer drives their Rust decoder
directly.
"""

from __future__ import annotations

import codecs
import pathlib
from collections.abc import Sequence
from typing import Any

from sluiceway.status import FieldError

__all__ = [
    "CHAT_ROLES",
    "encode_chat",
    "encode_prompt",
    "load_chat_template",
    "load_tokenizer",
    "template_takes_tools",
]

#: Roles a chat message may carry (the public proto's `ChatMessage.role`).
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


def load_chat_template(value: str) -> str:
    """The Jinja chat template `--chat-template` gives, as vLLM reads that flag: the content of
    the file `value` names, else (no such file) `value` itself with its backslash escapes
    (``\\n``) decoded, unless it looks like a path (none of ``{``, ``}``, a newline). The
    template must parse.

    Raises:
        ValueError: "--chat-template ..." one line: a path that cannot be read, or a template
            with a Jinja syntax error (its line and message).
    """
    try:
        with open(value, encoding="utf-8") as f:  # vLLM's order: a file first
            template = f.read()
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read: "
                f"{e.strerror or e}"
            ) from None
        # non-ASCII kept: only the backslash escapes are decoded
        template = codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")
    from jinja2 import Environment, TemplateSyntaxError  # a dependency of transformers

    try:
        Environment().parse(template)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: line {e.lineno}: {e.message}") from None
    return template


def load_tokenizer(model_dir: pathlib.Path, chat_template: str | None = None) -> Any:
    """Loads the fast tokenizer of the HF model folder `model_dir`, with `chat_template` (a
    Jinja template: :func:`load_chat_template`) in place of the model's own when given.

    Reads only local files (`local_files_only=True`) and runs no remote code.

    Returns:
        a `transformers` fast tokenizer (it has `backend_tokenizer`, a
        `tokenizers.Tokenizer`).

    Raises:
        OSError: `model_dir` holds no loadable tokenizer.
        ValueError: the tokenizer found is not a fast one.
    """
    from transformers import AutoTokenizer  # heavy import: only where needed

    tokenizer = AutoTokenizer.from_pretrained(
        pathlib.Path(model_dir), local_files_only=True, trust_remote_code=False
    )
    if (
        not getattr(tokenizer, "is_fast", False)
        or getattr(tokenizer, "backend_tokenizer", None) is None
    ):
        raise ValueError(
            f"the tokenizer in {model_dir} is not a fast (tokenizers-backed) tokenizer: "
            f"{type(tokenizer).__name__}"
        )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt.

    Special tokens (a BOS, for tokenizers that add one) are added the way the
    tokenizer does by default, as vLLM does for a completion prompt. An empty
    `text` gives only those special tokens, possibly none: the caller
    rejects an empty prompt (`check_prompt_token_ids`).
    """
    return [int(i) for i in tokenizer.encode(text)]


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` (else router/tool_calls.py writes a
    generic tools section into the system prompt)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def encode_chat(
    tokenizer: Any,
    messages: Sequence[tuple[str, str]] | Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of chat `messages` after the model's chat template: (role, content) pairs,
    or the turns as dicts (``role``, ``content`` and, for templates that take them,
    ``tool_calls``, ``tool_call_id``, ``name``), with `tools` for a template that takes them.

    The template is rendered with `add_generation_prompt=True` (the prompt ends
    with the header of the assistant turn to generate) and the text is
    encoded with `add_special_tokens=False`, exactly like
    `tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=True)`:
    the template itself writes BOS where the model wants one, so it is never
    added a second time.

    Raises:
        FieldError("messages", ...): no messages, the model has no chat
            template, or the template refused the conversation (e.g. roles
            that do not alternate, for templates that check it).
        FieldError("messages[i].role", ...): a role other than system,
            user, assistant or tool.
    """
    if not messages:
        raise FieldError("messages", "must hold at least one message")
    conversation = [
        dict(m) if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages
    ]
    for i, turn in enumerate(conversation):
        role = turn["role"]
        if role not in CHAT_ROLES:
            raise FieldError(
                f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}; got {role!r}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise FieldError(
            "messages",
            "this model has no chat template: start the server with --chat-template FILE|STRING "
            "(a Jinja template), or send a plain prompt instead",
        )
    from jinja2 import TemplateError  # a dependency of transformers' chat templates

    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except TemplateError as e:  # raise_exception(...) in the template, or a render error
        raise FieldError("messages", f"the chat template refused them: {e}") from e
    return [int(i) for i in ids]
