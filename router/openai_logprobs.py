"""Log-probabilities in the OpenAI-compatible API's shapes, from the public proto's entries
(`sluiceway.v1.TokenLogprobs`, whose ``token`` and ``bytes`` the router filled in):

- chat: ``logprobs.content``, one ``{token, logprob, bytes, top_logprobs}`` per token;
- completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``, with ``echo`` the
  prompt's tokens first (the first of them with null logprob and null top_logprobs);
- vLLM's ``prompt_logprobs``: ``[null, {"ID": {logprob, rank, decoded_token}}, ...]``, each
  position's prompt token and the N most likely there.

``text_offset`` counts characters of the choice's text: each token advances it by what it
adds to the text decoded in context (a token holding part of a UTF-8 character adds
nothing until the token that completes the character), not by its length decoded alone.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Any

from sluiceway.v1 import inference_pb2

__all__ = [
    "TextOffsets",
    "chat_entries",
    "completion_logprobs",
    "merge_completion_logprobs",
    "vllm_prompt_logprobs",
]


def _entry(token: str, logprob: float, data: bytes) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(data)}


def chat_entries(entries: Iterable[inference_pb2.TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` items: the token's text (OpenAI's: partial UTF-8 bytes as
    ``\\xNN``), logprob, own bytes and top alternatives."""
    return [
        {**_entry(lp.token, lp.logprob, lp.bytes),
         "top_logprobs": [_entry(t.token, t.logprob, t.bytes) for t in lp.top_logprobs]}
        for lp in entries
    ]  # fmt: skip


class TextOffsets:
    """A choice's ``text_offset`` running count: characters of the text so far, bytes of a
    character not yet complete held back (an incremental UTF-8 decoder over the tokens'
    bytes)."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, data: bytes) -> int:
        """The offset of a token with bytes ``data``; then moves past what it adds."""
        offset = self.chars
        self.chars += len(self._decoder.decode(data))
        return offset


def completion_logprobs(
    entries: Iterable[inference_pb2.TokenLogprobs],
    offsets: TextOffsets,
    *,
    prompt: bool = False,
) -> dict[str, Any]:
    """Completions' ``logprobs`` of ``entries``; ``offsets`` runs on across calls (a stream's
    chunks). Each position's top_logprobs hold its token besides the N most likely (up to
    N + 1 entries, as OpenAI's legacy completions and vLLM). ``prompt``: the entries are a
    response's ``prompt_logprobs`` (echo): the first has a null logprob and null
    top_logprobs."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}  # fmt: skip
    for i, lp in enumerate(entries):
        out["tokens"].append(lp.token)
        out["text_offset"].append(offsets.advance(lp.bytes))
        if prompt and i == 0:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(lp.logprob)
        top = {t.token: t.logprob for t in lp.top_logprobs}
        top.setdefault(lp.token, lp.logprob)  # the chosen token always (OpenAI's, vLLM's)
        out["top_logprobs"].append(top)
    return out


def merge_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """``first``'s lists followed by ``second``'s (echo: the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    entries: Iterable[inference_pb2.TokenLogprobs],
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map of
    token id -> ``{logprob, rank, decoded_token}`` holding the prompt token (its rank among
    the whole vocabulary) and the N most likely tokens (ranks 1..N)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, lp in enumerate(entries):
        if i == 0:
            out.append(None)
            continue
        position = {
            str(t.token_id): {"logprob": t.logprob, "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(lp.top_logprobs, 1)
        }
        position.setdefault(
            str(lp.token_id),
            {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.token},
        )
        out.append(position)
    return out
