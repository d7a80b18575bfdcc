"""Each token's own bytes, for logprob entries (OpenAI's ``bytes``), and its text as OpenAI
shows it (``token``).

A token may hold part of a UTF-8 character (an emoji split over two tokens): decoded alone
it is U+FFFD, and a client could not rebuild the text from such entries. The bytes come from
the tokenizer's decoder instead (its ``tokenizer.json`` section):

- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen: decoder ``ByteLevel``): each character of
  the token's string stands for one byte through GPT-2's ``bytes_to_unicode`` table;
- SentencePiece-style (Llama 2, Mistral, Gemma: a ``ByteFallback`` decoder or a model with
  ``byte_fallback``, and ``Replace`` / ``Metaspace`` decoders): a ``<0xF0>`` token is that byte, others are their string with
  the word-boundary mark (``▁``) as a space, in UTF-8;
- anything else: the token decoded alone, in UTF-8.

Special tokens (added tokens marked special) are their own text; with
``skip_special_tokens`` (the default) the text leaves them out and so do their bytes (empty),
so that a sample's entries concatenate to its text's UTF-8.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from sluiceway.v1 import inference_pb2

__all__ = ["TokenBytes", "bytes_to_unicode", "display_text", "fill_logprob_text"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: byte -> the printable character byte-level BPE writes it as (printable
    Latin-1 bytes stand for themselves, the other 68 bytes for U+0100 onwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def display_text(data: bytes) -> str:
    """A token's text as OpenAI shows it: its bytes as UTF-8, each byte that is not part of
    a whole character written ``\\xNN`` (``b"\\xf0\\x9f"`` -> the 8 characters ``\\xf0\\x9f``)."""
    return data.decode("utf-8", errors="backslashreplace")


def _decoders(spec: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decoder steps of a tokenizer.json ``decoder`` section, a Sequence flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for d in spec.get("decoders", []) for step in _decoders(d)]
    return [spec]


class TokenBytes:
    """Token id -> its own bytes and its OpenAI text, for one fast tokenizer (cached per id).

    Args:
        tokenizer: a ``transformers`` fast tokenizer (``backend_tokenizer`` and
            ``convert_ids_to_tokens``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        steps = _decoders(spec.get("decoder"))
        kinds = {d.get("type") for d in steps}
        self._byte_level = "ByteLevel" in kinds
        model = spec.get("model") or {}
        self._byte_fallback = "ByteFallback" in kinds or bool(model.get("byte_fallback"))
        self._replacements: list[tuple[str, str]] = []
        for d in steps:
            if d.get("type") == "Replace" and isinstance(d.get("pattern", {}).get("String"), str):
                self._replacements.append((d["pattern"]["String"], d.get("content", "")))
            elif d.get("type") == "Metaspace":
                self._replacements.append((d.get("replacement", "▁"), " "))
        self._sentencepiece = self._byte_fallback or bool(self._replacements)
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self._special = {
            int(i): str(t.content)
            for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(t, "special", False)
        }
        self._cache: dict[int, bytes] = {}

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a special added token (left out of the text by
        ``skip_special_tokens``)."""
        return token_id in self._special

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a special token's: its text's UTF-8)."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def entry(self, token_id: int, skip_special_tokens: bool) -> tuple[str, bytes]:
        """``(token, bytes)`` of a logprob entry: the OpenAI text (a special token written
        out) and the bytes the token adds to the text (none for a special token the text
        skips)."""
        if token_id in self._special:
            text = self._special[token_id]
            return text, b"" if skip_special_tokens else text.encode()
        data = self.token_bytes(token_id)
        return display_text(data), data

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._special:
            return self._special[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            if self._sentencepiece:
                match = _BYTE_TOKEN.fullmatch(piece) if self._byte_fallback else None
                if match is not None:
                    return bytes([int(match.group(1), 16)])
                for pattern, content in self._replacements:
                    piece = piece.replace(pattern, content)
                return piece.encode()
        return str(self._tokenizer.decode([token_id])).encode()


def fill_logprob_text(
    token_bytes: TokenBytes, entry: inference_pb2.TokenLogprobs, skip_special_tokens: bool
) -> None:
    """Sets ``token`` and ``bytes`` of ``entry`` and of its top logprobs (the scheduler sends
    ids only)."""
    entry.token, entry.bytes = token_bytes.entry(entry.token_id, skip_special_tokens)
    for top in entry.top_logprobs:
        top.token, top.bytes = token_bytes.entry(top.token_id, skip_special_tokens)
