"""How deep a JSON text nests arrays and objects, found without parsing it (Python's parser
exhausts its recursion at about 1,000 levels and raises RecursionError, which no caller
expects): the HTTP body's check (router/openai_fields.py) and the JSON schema's
(sluiceway/sampling_params.py)."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["too_deep"]

# the characters that open, close or separate JSON values (numbers and literals are skipped)
_STRUCTURE = re.compile(r'["\[\]{}:,]')


def too_deep(text: str, limit: int) -> list[str] | None:
    """The path to the first array or object `limit` + 1 levels deep in JSON `text`, as
    parts (".key", "[i]") below the outermost value, or None when it nests at most `limit`
    levels. Malformed JSON gives None (left to the parser). Linear in `len(text)`: strings are
    skipped by the C decoder, numbers and literals by a regex search."""
    stack: list[list[Any]] = []  # per open container: [kind, part leading to it, index, key]
    last_string: str | None = None
    decoder = json.JSONDecoder()
    i = 0
    while (m := _STRUCTURE.search(text, i)) is not None:
        i = m.start()
        c = text[i]
        if c == '"':
            try:
                last_string, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            continue
        if c in "[{":
            part = ""
            if stack:
                top = stack[-1]
                part = f"[{top[2]}]" if top[0] == "[" else f".{top[3]}"
            stack.append([c, part, 0, None])
            if len(stack) > limit:
                return [s[1] for s in stack[1:]]
        elif c in "]}":
            if not stack:
                return None
            stack.pop()
        elif c == ":" and stack and stack[-1][0] == "{":
            stack[-1][3] = last_string
        elif c == "," and stack and stack[-1][0] == "[":
            stack[-1][2] += 1
        i += 1
    return None
