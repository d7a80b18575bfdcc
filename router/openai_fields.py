"""What the HTTP API does with a body field that its request models do not declare: nothing is
dropped silently.

A declared field (router/openai_models.py) is supported. Any other field is one of:

- **ignored**: accepted whatever its value, because it changes nothing this server returns
  (`IGNORED`: OpenAI's ``user``, ``store``, ``metadata``, ...);
- **refused unless neutral**: a field of OpenAI's API or of vLLM's extra body that this server
  does not implement (`REFUSED`): accepted only with the value that asks for nothing (its
  default, or null), else HTTP 400 naming it;
- **unknown**: a name neither API has (a typo, a newer API): HTTP 400 naming it.

An agent framework then tells a dropped feature from a model that chose not to use it. README's
field table lists these tables and the declared fields (tests/router/test_openai_fields.py
holds them equal).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel

from sluiceway.json_nesting import too_deep
from sluiceway.router.openai_errors import ApiError

__all__ = ["IGNORED", "REFUSED", "check_body_fields", "check_json_nesting"]

#: Fields accepted and ignored: name -> why they change nothing here. A name is the field's
#: path in the body, a list's items written "[]" ("messages[].name").
IGNORED: dict[str, str] = {
    "user": "an end-user id for the caller's abuse tracking",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "nothing is stored",
    "service_tier": "one tier",
    "prompt_cache_key": "prefix caching is automatic (and shared)",
    "safety_identifier": "an end-user id for the caller's abuse tracking",
}

_NULL: tuple[Any, ...] = (None,)

#: Fields refused unless they ask for nothing: name (as in `IGNORED`) -> the values that ask
#: for nothing (JSON null always does). OpenAI's, then vLLM's extra body.
REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "audio": _NULL,
    "best_of": (None, 1),
    "function_call": _NULL,  # the deprecated form of tool_choice
    "functions": (None, []),  # the deprecated form of tools
    "modalities": (None, ["text"]),
    "prediction": _NULL,
    "reasoning_effort": _NULL,
    "suffix": (None, ""),
    "verbosity": _NULL,
    "web_search_options": _NULL,
    # vLLM's extra body
    "add_generation_prompt": (None, True),
    "bad_words": (None, []),
    "cache_salt": _NULL,  # ignoring it would share the prefix cache it asks to isolate
    "chat_template": _NULL,
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "documents": _NULL,
    "guided_decoding_backend": _NULL,
    "guided_whitespace_pattern": _NULL,
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "mm_processor_kwargs": _NULL,
    "return_tokens_as_token_ids": (None, False),
    "structural_tag": _NULL,
    "truncate_prompt_tokens": _NULL,
    "use_beam_search": (None, False),
    "stream_options.continuous_usage_stats": (None, False),
}

#: Deepest nesting of arrays and objects a request body may have. A JSON schema inside it may
#: nest `MAX_JSON_SCHEMA_DEPTH` levels (sluiceway/sampling_params.py) below the few levels
#: that lead to it (``response_format.json_schema.schema``); deeper, Python's JSON parser
#: would exhaust its recursion (1,000 levels), as the peers' caps guard against.
MAX_BODY_NESTING = 128


_ITEM_INDEX = re.compile(r"\[\d+\]")


def _neutral(key: str, value: Any) -> bool:
    """Whether `value` of refused field `key` asks for nothing (``1 == True``: types too)."""
    return value is None or any(type(value) is type(v) and value == v for v in REFUSED[key])


def _name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_body_fields(body: BaseModel, prefix: str = "") -> None:
    """Refuses the fields of `body` (and of the models nested in it, lists of them included)
    that it does not declare, unless `IGNORED` or neutral for `REFUSED`.

    Args:
        body: a request model parsed with ``extra="allow"`` (its undeclared fields in
            ``model_extra``).
        prefix: `body`'s place in the request, for the error's `param` ("messages[2]").

    Raises:
        ApiError(400): the first refused field, its path as `param`; or a string with a lone
            UTF-16 surrogate (JSON allows ``"\\ud800"``, UTF-8 cannot carry it).
    """
    for name, value in (body.model_extra or {}).items():
        where = _name(prefix, name)
        key = _ITEM_INDEX.sub("[]", where)
        if key in IGNORED:
            continue
        if key in REFUSED:
            if not _neutral(key, value):
                raise ApiError(400, f"{where}: not supported by this server", where)
            continue
        raise ApiError(400, f"{where}: unknown field", where)
    for name in type(body).model_fields:
        value = getattr(body, name)
        field = type(body).model_fields[name]
        where = _name(prefix, field.alias or name)
        if isinstance(value, BaseModel):
            check_body_fields(value, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    check_body_fields(item, f"{where}[{i}]")
                else:
                    _check_text(item, f"{where}[{i}]")
        else:
            _check_text(value, where)


def _check_text(value: Any, where: str) -> None:
    """Refuses a string holding a lone surrogate in `value` (a string, or a JSON list or
    object of them at any depth), naming where: the tokenizer, the proto and the response
    would each fail to encode it (a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            message = f"{where}: not valid Unicode (a lone surrogate at character {e.start})"
            raise ApiError(400, message, where) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_text(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}")


def check_json_nesting(body: bytes, limit: int = MAX_BODY_NESTING) -> None:
    """Refuses a JSON body that nests arrays and objects deeper than `limit` levels, naming
    where (before it is parsed: Python's parser fails on ~1,000 levels with RecursionError).

    Only a body holding more than `limit` brackets is scanned (a C count first), so an ordinary
    request costs two ``bytes.count`` calls.

    Raises:
        ApiError(400): the body nests too deep; `param` is the path of the first container past
            the limit ("structured_outputs.json[0][0]...", shortened to its first 8 parts).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    path = too_deep(body.decode("utf-8", errors="replace"), limit)
    if path is None:
        return
    shown = "".join(path[:8]) + ("..." if len(path) > 8 else "")
    param = shown.lstrip(".") or None
    raise ApiError(
        400, f"{param or 'body'}: nested deeper than {limit} levels of arrays and objects", param
    )
