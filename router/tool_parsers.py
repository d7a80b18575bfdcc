"""Tool calls parsed out of a model's output text, incrementally (docs/tool-calling.md).

`CallStream` is fed a sample's text deltas and splits them into content text and tool calls,
as they complete: the same pieces whether the client streams or not (a non-streamed answer
joins them), so streamed and whole answers agree by construction. It is driven by an output
format:

- the `--tool-call-parser` formats of `tool_choice: "auto"`, vLLM's names and outputs:
  ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text
  before them is content), ``llama3_json`` (a JSON object ``{"name": ..., "parameters":
  {...}}`` at the start of the output or after ``<|python_tag|>``, several separated by
  ``;``), ``mistral`` (``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``, or
  Mistral's v11 ``[TOOL_CALLS]name[ARGS]{...}``);
- ``required``: the JSON array ``[{"name": ..., "parameters": {...}}, ...]`` that a required
  tool_choice's grammar produces (vLLM's).

A call that does not parse (bad JSON, no name, arguments not an object), one naming a function
that is not one of the tools, or one cut short by the end of generation, is returned as text,
with everything after it.

`NamedStream` is a named tool_choice's: the whole output is the arguments of that function,
streamed as it comes.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "PARSERS",
    "Call",
    "CallStream",
    "Malformed",
    "NamedStream",
    "RequiredFormat",
    "new_call_id",
    "parser_format",
]

_DECODER = json.JSONDecoder()


def new_call_id() -> str:
    """A tool call id: ``call_`` and 24 random hex digits (OpenAI's prefix)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class Call:
    """One parsed call: the function's name and its arguments as JSON text; a `name` of ""
    is more arguments of the call before (`NamedStream`'s pieces)."""

    name: str
    arguments: str


class Malformed(ValueError):
    """A tool-call segment that ended but is not a valid call."""


def _call(obj: Any, *arg_keys: str) -> Call:
    """The call a parsed JSON value describes: an object with a string ``name`` and an object
    under the first of `arg_keys` present (a JSON string holding an object is taken too).
    Raises Malformed otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise Malformed("no function name")
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    raise Malformed("arguments are not JSON") from None
            if not isinstance(args, dict):
                raise Malformed("arguments are not an object")
            return Call(obj["name"], json.dumps(args, ensure_ascii=False))
    raise Malformed("no arguments")


def _decode(buf: str, pos: int, final: bool) -> tuple[Any, int] | None:
    """The JSON value at `buf[pos:]` (after whitespace) and the index after it; None when it
    may still be incomplete (not `final`). Raises Malformed when `final` and it does not
    parse."""
    pos = _skip_ws(buf, pos)
    try:
        return _DECODER.raw_decode(buf, pos)
    except (ValueError, RecursionError):
        if final:
            raise Malformed("not JSON") from None
        return None


def _skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    return pos


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class Format(Protocol):
    """An output format of tool calls. `at_start`: nothing but whitespace was output yet, or
    the text follows a call."""

    def find(self, text: str, at_start: bool) -> int | None:
        """Where in `text` a tool-call segment begins, or None."""

    def hold(self, text: str, at_start: bool) -> int:
        """How many characters at the end of `text` may begin a segment (held back)."""

    def take(self, buf: str, final: bool) -> tuple[list[Call], int] | None:
        """The calls of the segment `buf` begins with and the characters they used; None
        while it is incomplete. Raises Malformed for a segment that is not valid calls."""


class _StartMarker:
    """A format whose calls begin with the marker `start`, wherever it stands."""

    start = ""

    def find(self, text: str, at_start: bool) -> int | None:
        i = text.find(self.start)
        return None if i < 0 else i

    def hold(self, text: str, at_start: bool) -> int:
        return _partial_marker(text, self.start)


class HermesFormat(_StartMarker):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen); the
    closing tag may be missing at the end of the output, as vLLM's parser takes it."""

    start, end = "<tool_call>", "</tool_call>"

    def take(self, buf: str, final: bool) -> tuple[list[Call], int] | None:
        close = buf.find(self.end)
        if close < 0:
            if not final:
                return None
            close = len(buf)
        body = buf[len(self.start) : close].strip()
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            raise Malformed("not JSON") from None
        return [_call(obj, "arguments")], min(len(buf), close + len(self.end))


class Llama3JsonFormat:
    """Llama 3's JSON calls: ``{"name": ..., "parameters": {...}}`` at the start of the
    output (or after ``<|python_tag|>``), several separated by ``;``."""

    tag = "<|python_tag|>"

    def find(self, text: str, at_start: bool) -> int | None:
        i = text.find(self.tag)
        if i >= 0:
            return i
        j = _skip_ws(text, 0)
        return j if at_start and text[j : j + 1] == "{" else None

    def hold(self, text: str, at_start: bool) -> int:
        if at_start and not text.strip():
            return len(text)  # whitespace that a call may follow
        return _partial_marker(text, self.tag)

    def take(self, buf: str, final: bool) -> tuple[list[Call], int] | None:
        pos = len(self.tag) if buf.startswith(self.tag) else 0
        got = _decode(buf, pos, final)
        if got is None:
            return None
        obj, end = got
        after = _skip_ws(buf, end)
        if after == len(buf) and not final:
            return None  # a `;` and another call may follow
        if buf[after : after + 1] == ";":
            end = after + 1
        return [_call(obj, "parameters", "arguments")], end


class MistralFormat(_StartMarker):
    """``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (or one object), or
    Mistral's v11 ``[TOOL_CALLS]name[ARGS]{...}`` (one call per marker)."""

    start, args = "[TOOL_CALLS]", "[ARGS]"

    def take(self, buf: str, final: bool) -> tuple[list[Call], int] | None:
        pos = _skip_ws(buf, len(self.start))
        if pos >= len(buf):
            if final:
                raise Malformed("no call")
            return None
        if buf[pos] in "[{":
            got = _decode(buf, pos, final)
            if got is None:
                return None
            value, end = got
            items = value if isinstance(value, list) else [value]
            return [_call(item, "arguments") for item in items], end
        brace = buf.find("{", pos)
        if brace < 0:
            if final:
                raise Malformed("no arguments")
            return None
        name = buf[pos:brace].strip().removesuffix(self.args).strip()
        got = _decode(buf, brace, final)
        if got is None:
            return None
        args, end = got
        return [_call({"name": name, "arguments": args}, "arguments")], end


class RequiredFormat:
    """A required tool_choice's output: ``[{"name": ..., "parameters": {...}}, ...]``, the
    array of its grammar (router/tool_calls.py); each call is taken as soon as its object
    closes."""

    def find(self, text: str, at_start: bool) -> int | None:
        return 0  # the whole output is calls

    def hold(self, text: str, at_start: bool) -> int:
        return 0

    def take(self, buf: str, final: bool) -> tuple[list[Call], int] | None:
        pos = _skip_ws(buf, 0)
        if buf[pos : pos + 1] in ("[", ","):
            pos = _skip_ws(buf, pos + 1)
        if buf[pos : pos + 1] == "]":
            return [], pos + 1
        if pos == len(buf) and not final:
            return None
        got = _decode(buf, pos, final)
        if got is None:
            return None
        obj, end = got
        return [_call(obj, "parameters")], end


#: The --tool-call-parser names (vLLM's) and their output formats.
PARSERS: dict[str, type[Format]] = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
}


def parser_format(name: str) -> Format:
    """The output format of parser `name` (a key of PARSERS; KeyError otherwise)."""
    return PARSERS[name]()


class CallStream:
    """Splits a sample's text deltas into content and calls, in `fmt` (the module
    docstring); a call of a function not in `names` (when given) is malformed."""

    def __init__(self, fmt: Format, names: frozenset[str] | None = None) -> None:
        self.fmt = fmt
        self.names = names  # the functions a call may name (None: any)
        self.pending = ""  # text not yet given out: a possible marker, or a segment
        self.in_calls = False  # `pending` begins with a segment
        self.at_start = True
        self.plain = False  # a malformed segment: the rest is text
        self.after_call = False  # only whitespace since the last call

    def complete(self) -> bool:
        """True: a call is given out only once it parsed."""
        return True

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """The content text and the calls that `text` completes; `final`: the output ends
        with it (what is held back is given out or parsed now)."""
        self.pending += text
        out: list[str] = []
        calls: list[Call] = []
        while True:
            if self.plain:
                out.append(self.pending)
                self.pending = ""
                break
            if not self.in_calls and not self._to_segment(out, final):
                break
            try:
                got = self.fmt.take(self.pending, final)
            except Malformed:
                self.plain = True
                continue
            if got is None:
                if final:
                    self.plain = True
                    continue
                break
            segment, used = got
            if self.names is not None and any(c.name not in self.names for c in segment):
                self.plain = True  # a call of no such function is malformed: text
                continue
            calls += segment
            self.pending = self.pending[used:]
            if not self._after_segment(final):
                break
        return "".join(out), calls

    def _to_segment(self, out: list[str], final: bool) -> bool:
        """Gives out the content before the next segment; True when `pending` now begins
        with one, False when more text is needed (what may begin one is held back)."""
        i = self.fmt.find(self.pending, self.at_start)
        if i is None:
            if self.after_call and not self.pending.strip():  # whitespace after a call
                if final:
                    self.pending = ""
                return False
            keep = 0 if final else self.fmt.hold(self.pending, self.at_start)
            cut = len(self.pending) - keep
            if cut > 0:
                head, self.pending = self.pending[:cut], self.pending[cut:]
                if head.strip():
                    out.append(head)
                    self.at_start = self.after_call = False
                elif not self.after_call:  # whitespace after a call is dropped
                    out.append(head)
            return False
        if self.pending[:i].strip():  # whitespace before a call is dropped
            out.append(self.pending[:i])
        self.pending = self.pending[i:]
        self.in_calls = True
        return True

    def _after_segment(self, final: bool) -> bool:
        """After a segment: True to go on with `pending` (another segment, or content), False
        to wait for more text. Whitespace after a call is dropped."""
        self.pending = self.pending.lstrip()
        self.in_calls = False
        self.at_start = True  # what follows a call may be the next one (llama3_json)
        self.after_call = True
        return bool(self.pending)


class NamedStream:
    """A named tool_choice's output: all of it is the arguments of `name` (its grammar makes
    it one JSON object), given out as it comes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        self.arguments = ""

    def complete(self) -> bool:
        """Whether the arguments given out so far parse as one JSON object."""
        try:
            return isinstance(json.loads(self.arguments), dict)
        except (ValueError, RecursionError):
            return False

    def feed(self, text: str, final: bool) -> tuple[str, list[Call]]:
        """No content; the first call gives the function's name, each call an arguments
        piece."""
        self.arguments += text
        if not self.started:
            self.started = True
            return "", [Call(self.name, text)]
        return "", [Call("", text)] if text else []
