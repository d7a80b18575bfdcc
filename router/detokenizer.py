"""Incremental detokenization and stop strings: token ids in, text deltas out.

One `IncrementalDetokenizer` per request turns the token ids a scheduler
streams back into the text deltas the client sees.

Decoding is done by the `tokenizers` library's own streaming decoder,
`tokenizers.decoders.DecodeStream` (what vLLM's fast detokenizer uses). It
keeps a small window of ids (the tokens of the last emitted chunk plus the
ones not yet emitted), decodes that window each step and gives out only the
text past the previous chunk, and only once it does not end in U+FFFD, so a
token that stops in the middle of a UTF-8 character (byte-level BPE, byte
fallback: CJK, emoji) yields nothing until the character is complete. The
window also gives the decoder the left context that Metaspace / Strip
decoders (Llama, Mistral) need to put the space between words.

Two gaps of `DecodeStream` (tokenizers 0.23) are closed here:

* prompt context: `DecodeStream(ids=prompt)` only learns the prompt's text
  if that text does not end in U+FFFD; otherwise its first chunk repeats the
  whole prompt. So the stream gets a short tail of the prompt (at most
  `CONTEXT_TOKENS` ids, which also keeps its first step cheap) and no prompt
  at all when that tail ends in the middle of a character.
* the end of the stream: `DecodeStream` has no flush, so text that ends in
  U+FFFD (invalid or truncated UTF-8 the model really generated) would never
  come out. `flush()` decodes the ids it still holds, with left context.

`DecodeStream` can also raise "Invalid prefix" when a tokenizer's decoding
of a longer window does not extend that of a shorter one (vLLM issue 17448;
never seen with byte-level BPE). vLLM then restarts it with no context and
may lose or repeat text; here the stream is rebuilt from this class's own
copy of the ids (the pending ids replayed after a few ids of context), and
if that fails too the request falls back to the same rule done by hand: a
window of CONTEXT_TOKENS ids of context plus the pending ids, decoded each
step, its new text given out once it does not end in U+FFFD.

Cost: a step decodes the tokens of the previous chunk plus the pending ones
(usually 2 tokens), so it does not grow with the output. Pending ids pile up
only while the text keeps ending in U+FFFD, i.e. while the model generates
invalid UTF-8 bytes; such a run is decoded again at each step.

Stop strings are matched on the decoded text. Text that could still be the
beginning of a stop string is held back until it either completes one (the
output is cut just before it; the stop string and everything after it are
never returned) or cannot any more (then it is released). When several stop
strings match, the one that is complete first in the text (smallest end)
wins, and among those ending at the same character the longest (earliest
start): the result is what feeding the text one character at a time and
stopping at the first stop string seen would give, however the tokens are
chunked. A stop string that is a prefix of another therefore wins over it,
cut at their common start.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import structlog
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["CONTEXT_TOKENS", "IncrementalDetokenizer"]

log = structlog.get_logger("router.detokenizer")

#: Ids of left context given to the decoder (prompt tail, or output on a restart).
CONTEXT_TOKENS = 6

_REPLACEMENT = "\ufffd"


def _is_invalid_prefix(error: Exception) -> bool:
    return "invalid prefix" in str(error).lower()


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, with stop strings.

    Args:
        tokenizer: a `transformers` fast tokenizer (its `backend_tokenizer`
            is used) or a `tokenizers.Tokenizer`.
        prompt_token_ids: the prompt; only its last few ids are used, as left
            context for the first generated token.
        stop: stop strings (empty strings are ignored); see the module text
            for which one wins when several match.
        skip_special_tokens: leave special tokens (EOS, chat markers) out of
            the text, as vLLM does by default.
        include_stop_str_in_output: end the text with the matched stop
            string instead of just before it.
        min_tokens: stop strings are matched only in the text of the
            `min_tokens`-th generated token and later (vLLM checks them only
            once that many tokens exist); earlier text is given out at once.

    Guarantees (for a stream that does not stop): the concatenation of every
    value returned by `add_tokens` and `flush` equals the tokenizer's decoding
    of all generated ids (for byte-level BPE tokenizers such as SmolLM2,
    GPT-2, Llama 3, Qwen2: exactly `tokenizer.decode(ids,
    skip_special_tokens=...)`; with the prompt as left context, the first
    word keeps its leading space for Metaspace tokenizers, as in vLLM); no
    delta ends with a partial character (a U+FFFD appears only where the
    full decoding has one); `tokenizer.clean_up_tokenization_spaces` is not
    applied (vLLM does not either).
    """

    __slots__ = (
        "_backend",
        "_context",
        "_decoded",
        "_finished",
        "_held",
        "_ids",
        "_include_stop",
        "_min_tokens",
        "_parts",
        "_skip",
        "_stop_suffixes",
        "_stopped",
        "_stops",
        "_stream",
        "stop_string",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, Tokenizer):
            raise TypeError(
                "IncrementalDetokenizer needs a fast tokenizer or a tokenizers.Tokenizer, "
                f"got {type(tokenizer).__name__}"
            )
        self._backend: Tokenizer = backend
        self._skip = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._ids: list[int] = []  # every generated id
        self._decoded = 0  # how many of _ids the stream has turned into text
        self._context = self._safe_context(list(prompt_token_ids[-CONTEXT_TOKENS:]))
        self._stream: DecodeStream | None = self._new_stream(self._context)

        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        # Per stop string: last character -> the lengths k (descending) of its
        # proper prefixes s[:k] that end with that character.
        self._stop_suffixes: list[tuple[str, dict[str, list[int]]]] = []
        for s in self._stops:
            by_last: dict[str, list[int]] = {}
            for k in range(len(s) - 1, 0, -1):
                by_last.setdefault(s[k - 1], []).append(k)
            self._stop_suffixes.append((s, by_last))
        self._held = ""  # decoded text not yet returned: it may begin a stop string
        self._parts: list[str] = []  # everything returned so far
        self._stopped = False
        self._finished = False
        #: The stop string that ended the text, once `stopped`.
        self.stop_string: str | None = None

    # -- public API ---------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; nothing more is returned after that."""
        return self._stopped

    @property
    def text(self) -> str:
        """All the text returned so far (by `add_tokens` and `flush`)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def num_tokens(self) -> int:
        """Generated token ids fed so far (those fed after a stop excluded)."""
        return len(self._ids)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Feeds newly generated token ids; returns the new text delta, possibly "".

        "" comes back while a character is incomplete, while the text may
        still be the start of a stop string, for special tokens (when
        skipped), and always once `stopped`. When a stop string completes,
        the delta is cut just before it and `stopped` becomes True.

        Raises:
            RuntimeError: called after `flush()`.
        """
        if self._finished:
            raise RuntimeError("add_tokens() after flush(): the stream is finished")
        if self._stopped:
            return ""
        new = self._decode(token_ids)
        if not new:
            return ""
        if len(self._ids) < self._min_tokens:
            return self._out(new)  # no stop string may end the text yet
        return self._out(self._release(new, final=False))

    def flush(self) -> str:
        """Ends the stream (EOS, stop token id, length): returns the text still held back.

        That is text that could have begun a stop string, and the text of ids
        the decoder still held (output that ends in invalid or incomplete
        UTF-8 comes out here, with U+FFFD, as the full decoding has it). A stop
        string completed by that text still cuts it (unless fewer than
        `min_tokens` tokens came). Returns "" once stopped, and on a second call.
        """
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        if len(self._ids) < self._min_tokens:
            return self._out(self._window_text())
        return self._out(self._release(self._window_text(), final=True))

    # -- decoding -----------------------------------------------------------

    def _new_stream(self, context: list[int]) -> DecodeStream:
        try:
            return DecodeStream(ids=context, skip_special_tokens=self._skip)
        except TypeError:  # tokenizers < 0.22: no `ids`; prime it by stepping instead
            stream = DecodeStream(skip_special_tokens=self._skip)
            for tid in context:
                stream.step(self._backend, tid)
            return stream

    def _safe_context(self, ids: list[int]) -> list[int]:
        """`ids` if their text does not end in U+FFFD (a cut character), else []."""
        if ids and self._backend.decode(ids, skip_special_tokens=self._skip).endswith(_REPLACEMENT):
            return []
        return ids

    def _left_context(self) -> list[int]:
        """The last ids (prompt tail, then output) before the first not-yet-decoded one."""
        d = self._decoded
        if d >= CONTEXT_TOKENS:
            return self._ids[d - CONTEXT_TOKENS : d]
        need = CONTEXT_TOKENS - d
        return self._context[-need:] + self._ids[:d]

    def _decode(self, token_ids: Iterable[int]) -> str:
        pieces: list[str] = []
        for tid in token_ids:
            self._ids.append(int(tid))
            if self._stream is None:
                piece = self._window_step()
            else:
                try:
                    piece = self._stream.step(self._backend, self._ids[-1])
                except Exception as e:
                    if not _is_invalid_prefix(e):
                        raise
                    piece = self._restart_stream(e)  # advances _decoded itself
                else:
                    if piece is not None:
                        self._decoded = len(self._ids)
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def _restart_stream(self, error: Exception) -> str | None:
        """Recovers from an "Invalid prefix" error; returns the text now complete, if any.

        Replays the ids not yet decoded on a fresh stream primed with the ids
        before them. If that fails too, this request leaves `DecodeStream` for
        good and decodes a window of ids itself (`_window_step`).
        """
        log.warning("detokenizer_invalid_prefix", error=str(error), tokens=len(self._ids))
        pending = self._ids[self._decoded :]
        stream = self._new_stream(self._safe_context(self._left_context()))
        pieces: list[str] = []
        done = 0  # pending ids whose text `stream` gave out
        try:
            for j, tid in enumerate(pending):
                piece = stream.step(self._backend, tid)
                if piece is not None:
                    pieces.append(piece)
                    done = j + 1
        except Exception as e:
            if not _is_invalid_prefix(e):
                raise
            log.warning("detokenizer_window_mode", error=str(e), tokens=len(self._ids))
            self._stream = None
            return self._window_step()
        self._stream = stream
        self._decoded += done
        return "".join(pieces) if pieces else None

    def _window_text(self) -> str:
        """Text of the ids not yet decoded, decoded after up to CONTEXT_TOKENS ids of context."""
        pending = self._ids[self._decoded :]
        if not pending:
            return ""
        left = self._left_context()
        before = self._backend.decode(left, skip_special_tokens=self._skip)
        full = self._backend.decode(left + pending, skip_special_tokens=self._skip)
        if full.startswith(before):
            return full[len(before) :]
        return self._backend.decode(pending, skip_special_tokens=self._skip)  # best effort

    def _window_step(self) -> str | None:
        """DecodeStream's rule without it: the pending text once it does not end in U+FFFD."""
        text = self._window_text()
        if not text or text.endswith(_REPLACEMENT):
            return None
        self._decoded = len(self._ids)
        return text

    # -- stop strings -------------------------------------------------------

    def _out(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta

    def _release(self, new: str, *, final: bool) -> str:
        """Adds decoded text `new`; returns what can be given out now."""
        if not self._stops:
            return new
        held = len(self._held)
        buf = self._held + new
        # Held text holds no whole stop string, so any match ends in `new`.
        best: str | None = None
        best_start = best_end = 0
        for s in self._stops:
            i = buf.find(s, max(0, held - len(s) + 1))
            if i < 0:
                continue
            end = i + len(s)
            if best is None or end < best_end or (end == best_end and i < best_start):
                best, best_start, best_end = s, i, end
        if best is not None:
            self._stopped = True
            self.stop_string = best
            self._held = ""
            return buf[:best_end] if self._include_stop else buf[:best_start]
        if final:
            self._held = ""
            return buf
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def _holdback(self, buf: str) -> int:
        """Length of the longest end of `buf` that is a proper prefix of a stop string."""
        n = len(buf)
        last = buf[-1]
        best = 0
        for s, by_last in self._stop_suffixes:
            for k in by_last.get(last, ()):
                if k <= best:
                    break
                if k <= n and buf.endswith(s[:k]):
                    best = k
                    break
        return best
