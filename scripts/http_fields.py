"""Renders README's table of the HTTP API's body fields from the code: the fields the request
models declare (router/openai_models.py: supported), and router/openai_fields.py's tables
(accepted and ignored; refused unless they ask for nothing). Any other field is a 400.

    python scripts/http_fields.py            # the table, Markdown, to stdout
    python scripts/http_fields.py --check    # exit 1 if README.md's table differs

tests/router/test_openai_fields.py checks that README.md holds this script's output.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from sluiceway.router.openai_fields import IGNORED, REFUSED
from sluiceway.router.openai_models import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- http-fields: begin -->\n", "<!-- http-fields: end -->\n"


def declared(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field `model` declares, nested models' fields as ``parent.field`` and a list's
    items as ``parent[].field``, in declaration order."""
    names: list[str] = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name)
        names.append(path)
        for inner, suffix in _models_in(field.annotation):
            names.extend(declared(inner, f"{path}{suffix}."))
    return names


def _models_in(annotation: object) -> list[tuple[type[BaseModel], str]]:
    """The models a field's type holds (``X | None``, ``list[X]``), with "[]" for a list's."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, "")]
    found = []
    for arg in typing.get_args(annotation):
        inner = _models_in(arg)
        is_list = typing.get_origin(annotation) is list
        found.extend((m, "[]" + s if is_list else s) for m, s in inner)
    return found


def _codes(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _neutral(values: tuple[object, ...]) -> str:
    shown = [v for v in values if v is not None]
    words = {True: "true", False: "false"}
    return " or ".join(["null"] + [f"`{words.get(v, v)}`" if isinstance(v, bool) else
                                   f"`{v!r}`".replace("'", '"') for v in shown])  # fmt: skip


def render() -> str:
    """The table, between its markers."""
    chat, completions = declared(ChatCompletionRequest), declared(CompletionRequest)
    both = [n for n in chat if n in completions]
    rows = [
        "| body field | what the server does |",
        "|---|---|",
        f"| {_codes(both)} | supported (both endpoints) |",
        f"| {_codes([n for n in chat if n not in both])} | supported (chat completions) |",
        f"| {_codes([n for n in completions if n not in both])} | supported (completions) |",
    ]
    rows += [f"| `{n}` | accepted and ignored: {why} |" for n, why in IGNORED.items()]
    groups: dict[str, list[str]] = {}  # refused fields by the values they are accepted with
    for name, values in REFUSED.items():
        groups.setdefault(_neutral(values), []).append(name)
    rows += [f"| {_codes(names)} | refused (400 naming it) unless {neutral} |"
             for neutral, names in groups.items()]  # fmt: skip
    rows.append("| any other (`echo` on chat completions too) | refused (400: unknown field) |")
    return BEGIN + "\n".join(rows) + "\n" + END


def readme_table(readme: str) -> str:
    """README's table, between its markers ("" if absent)."""
    if BEGIN not in readme or END not in readme:
        return ""
    return readme[readme.index(BEGIN) : readme.index(END) + len(END)]


if __name__ == "__main__":
    table = render()
    if sys.argv[1:] == ["--check"]:
        if readme_table((ROOT / "README.md").read_text()) != table:
            print("README.md's HTTP field table is stale: paste scripts/http_fields.py's output",
                  file=sys.stderr)  # fmt: skip
            sys.exit(1)
    else:
        sys.stdout.write(table)
