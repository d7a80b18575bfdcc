"""Speculative decoding: `--speculative-config` (vLLM's JSON shape) and the n-gram proposer.

A decoding sequence gets up to ``num_speculative_tokens`` (K) proposed tokens; the worker
computes its last token and the K proposals in one forward (K + 1 positions), samples every
position exactly as plain decoding would (the forward is batch invariant, so a position's
logits do not depend on how many positions share the step; a seeded sequence draws its
uniforms in position order), and keeps the longest prefix of the proposal that equals what it
sampled, plus the first token that differs. The output is bitwise the output of the same
request without speculation (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", ICML 2023, with the rejection rule of greedy / exact-match
verification, which a draw equal to the plain run's makes lossless for sampling too).

The n-gram proposer is prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method,
llama.cpp's ``--lookup``): the longest suffix of the sequence's tokens, between
``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long, that occurred earlier in the
sequence (prompt and output), and the tokens that followed its most recent earlier
occurrence. No model runs.

The draft model (vLLM's ``draft_model`` method; Leviathan et al.) is a second, cheaper model
with the target's vocabulary, run by the worker (:mod:`worker.draft`): it proposes its greedy
tokens one forward per token, its K/V in a pool of its own indexed by the target's block
table. Its proposals go through the same verification, so the output is the plain run's,
whatever the draft proposes.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field

from sluiceway.argtypes import QUANTIZATION_CHOICES

__all__ = [
    "METHODS",
    "AdaptiveLength",
    "NgramProposer",
    "SpecDecodeCounts",
    "SpeculativeConfig",
    "speculative_config_arg",
]

METHODS = ("ngram", "draft_model")
# vLLM's defaults: both bounds 5 when neither is given, else the one given for both
_DEFAULT_LOOKUP = 5
_KEYS = frozenset(
    {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
     "disable_by_batch_size", "model", "quantization"}
)  # fmt: skip
_NGRAM_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
MAX_SPECULATIVE_TOKENS = 15  # at most a block of positions beyond the last token


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A resolved `--speculative-config`.

    method: ``"ngram"`` (prompt lookup) or ``"draft_model"``. num_speculative_tokens: K,
    proposals per step and sequence, 1..15. prompt_lookup_min / prompt_lookup_max: the
    n-gram sizes tried, longest first (1 <= min <= max; ngram only). disable_by_batch_size:
    no proposal in a step whose running sequences exceed this many (0: never off; vLLM
    counts enqueued requests): at large batches the step is bound by compute and the extra
    positions cost more than they save. model: the draft's model (a folder or .gguf file,
    as ``--model`` takes; draft_model only). quantization: the draft's ``--quantization``
    (``auto`` unless given; draft_model only).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    disable_by_batch_size: int = 0
    model: str = ""
    quantization: str = "auto"

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """The config of `text`, a JSON object with vLLM's keys.

        Raises:
            ValueError: not a JSON object, an unknown or unsupported key or method, a value
                out of its range (the message names the key).
        """
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config: not JSON ({e.msg})") from None
        if not isinstance(raw, dict):
            raise ValueError("speculative_config: a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')  # fmt: skip
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(_KEYS))})")  # fmt: skip
        method, model = raw.get("method"), raw.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method, model = "ngram", None  # vLLM's older spelling of the method
        if method not in METHODS:
            raise ValueError(f"speculative_config.method: one of {', '.join(METHODS)}, "
                             f"got {method!r}")  # fmt: skip
        k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
        off = _int(raw, "disable_by_batch_size", 0, 0, None)
        assert k is not None and off is not None
        if method == "draft_model":
            return cls._draft_model(raw, k, off)
        for key in ("model", "quantization"):
            if raw.get(key) is not None and not (key == "model" and model is None):
                raise ValueError(f"speculative_config.{key}: only with \"method\": "
                                 f'"draft_model" (got {raw[key]!r})')  # fmt: skip
        lo = _int(raw, "prompt_lookup_min", None, 1, None)
        hi = _int(raw, "prompt_lookup_max", None, 1, None)
        if lo is None and hi is None:
            lo = hi = _DEFAULT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        assert lo is not None and hi is not None
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")  # fmt: skip
        return cls(method, k, lo, hi, off)

    @classmethod
    def _draft_model(cls, raw: dict[str, object], k: int, off: int) -> SpeculativeConfig:
        """The draft_model config of `raw` (`parse` checked its method, K and off)."""
        for key in _NGRAM_KEYS:
            if raw.get(key) is not None:
                raise ValueError(f'speculative_config.{key}: only with "method": "ngram"')
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model: the draft model's path is required "
                             f'with "method": "draft_model" (got {model!r})')  # fmt: skip
        quantization = raw.get("quantization")
        quantization = "auto" if quantization is None else quantization
        if quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"speculative_config.quantization: one of "
                             f"{', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")  # fmt: skip
        return cls("draft_model", k, disable_by_batch_size=off, model=model,
                   quantization=str(quantization))  # fmt: skip

    @property
    def draft_model_path(self) -> str | None:
        """The draft model's path (``model``) with ``draft_model``; None for n-gram lookup."""
        return self.model if self.method == "draft_model" else None

    def allows(self, batch: int) -> bool:
        """Whether a step of `batch` running sequences may propose (`disable_by_batch_size`)."""
        return not self.disable_by_batch_size or batch <= self.disable_by_batch_size

    def to_json(self) -> str:
        """The canonical JSON of this config (what `parse` reads back)."""
        fields: dict[str, object] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "disable_by_batch_size": self.disable_by_batch_size,
        }
        if self.method == "draft_model":
            fields |= {"model": self.model, "quantization": self.quantization}
        else:
            fields |= {"prompt_lookup_max": self.prompt_lookup_max,
                       "prompt_lookup_min": self.prompt_lookup_min}  # fmt: skip
        return json.dumps(fields, separators=(",", ":"))


def _int(raw: dict[str, object], key: str, default: int | None, lo: int, hi: int | None
         ) -> int | None:  # fmt: skip
    value = raw.get(key, default)
    if value is None:
        if default is None and key == "num_speculative_tokens":
            raise ValueError(f"speculative_config.{key} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config.{key}: an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"speculative_config.{key} must be {bound}, got {value}")
    return value


def speculative_config_arg(text: str) -> str:
    """argparse type of `--speculative-config`: the canonical JSON of a valid config, or ""
    (off).

    Raises:
        argparse.ArgumentTypeError: what `SpeculativeConfig.parse` refuses.
    """
    import argparse

    if not text:
        return ""
    try:
        return SpeculativeConfig.parse(text).to_json()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class NgramProposer:
    """Prompt lookup over one sequence's tokens, kept as a growing uint32 buffer per
    sequence so that each step encodes only the tokens added since (the search is bytes.rfind,
    in C)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[int, array[int]] = {}

    def propose(
        self, seq_id: int, prompt: list[int], output: list[int], max_tokens: int
    ) -> list[int]:
        """Up to ``min(K, max_tokens)`` tokens that followed the most recent earlier occurrence
        of the longest matching suffix of ``prompt + output`` (sequence ``seq_id``'s tokens),
        longest n-gram first; [] when none occurs or ``max_tokens`` < 1. Only the tokens
        added since the last call are copied (the two lists are not joined)."""
        k = min(self.config.num_speculative_tokens, max_tokens)
        if k < 1:
            return []
        buf = self._tokens.get(seq_id)
        if buf is None or len(buf) > len(prompt) + len(output):
            buf = self._tokens[seq_id] = array("I")
        if len(buf) < len(prompt):
            buf.extend(prompt[len(buf) :])
        buf.extend(output[len(buf) - len(prompt) :])
        data = buf.tobytes()
        n = len(buf)
        for size in range(
            min(self.config.prompt_lookup_max, n - 1), self.config.prompt_lookup_min - 1, -1
        ):
            pattern = data[4 * (n - size) :]
            end = 4 * (n - 1)  # an earlier occurrence ends before the suffix's last token
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # token-aligned
                    start = at // 4 + size
                    return buf[start : start + k].tolist()
                end = at + 4 * size - 1
        return []

    def forget(self, seq_id: int) -> None:
        """Drops a finished or preempted sequence's buffer."""
        self._tokens.pop(seq_id, None)


@dataclass(slots=True)
class _Pace:
    k: int  # tokens the next proposal may have
    misses: int = 0  # proposals in a row of which none was accepted
    wait: int = 0  # steps to skip before the next proposal
    accepted: float | None = None  # tokens accepted per proposal, decayed mean


class AdaptiveLength:
    """How many tokens each sequence's next proposal may have (whether a step speculates at all
    is :class:`sluiceway.spec_gate.SpeculationGate`'s, measured).

    The next proposal has at most one token more than the last one accepted (K shrinks to what
    the text gives), and after a proposal of which nothing was accepted the sequence skips 1,
    2, 4 ... 32 steps (plain decoding meanwhile), back to no wait at the first acceptance.
    Its recent proposals' mean accepted tokens are what
    :class:`sluiceway.spec_gate.StreamGuard` expects of its next one.

    (A cost model used to decide per step how long a proposal pays, fitting step seconds to
    rows and draft passes: with rows and passes moving together at one stream it told a draft
    model's 37.5 ms for 4 tokens, against 15 ms for one plainly, to stop, and it missed the
    draft's catch-up at 4-32 streams. The gate measures both policies instead.)"""

    MAX_WAIT = 32
    SEQ_DECAY = 0.5  # a sequence's acceptance: its last few proposals (text changes fast)
    PRIOR_DECAY = 0.9  # every sequence's: a new sequence's prior

    def __init__(self, k: int) -> None:
        """`k`: the config's num_speculative_tokens."""
        self.k = k
        self._pace: dict[int, _Pace] = {}
        self._prior: float | None = None

    def expected_accepted(self, seq_id: int, proposed: int) -> float:
        """Tokens of a proposal of `proposed` the sequence is expected to have accepted:
        its recent proposals' mean, or every sequence's before its first (none yet: all),
        at most `proposed`."""
        pace = self._pace.get(seq_id)
        mean = pace.accepted if pace is not None else None
        if mean is None:
            mean = self._prior
        return float(proposed) if mean is None else min(float(proposed), mean)

    def allowed(self, seq_id: int) -> int:
        """Tokens the sequence may propose this step (0: it waits). Counts the step."""
        pace = self._pace.setdefault(seq_id, _Pace(self.k))
        if pace.wait:
            pace.wait -= 1
            return 0
        return pace.k

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """The outcome of a proposal of `proposed` tokens, `accepted` of them accepted."""
        pace = self._pace.setdefault(seq_id, _Pace(self.k))
        pace.k = max(1, min(self.k, accepted + 1))
        pace.accepted = _decayed(pace.accepted, accepted, self.SEQ_DECAY)
        self._prior = _decayed(self._prior, accepted, self.PRIOR_DECAY)
        if accepted:
            pace.misses = pace.wait = 0
        else:
            pace.wait = min(self.MAX_WAIT, 1 << pace.misses)
            pace.misses += 1

    def forget(self, seq_id: int) -> None:
        self._pace.pop(seq_id, None)


def _decayed(mean: float | None, value: float, decay: float) -> float:
    """An exponentially decayed mean after `value` (the first value: itself)."""
    return value if mean is None else decay * mean + (1.0 - decay) * value


@dataclass(slots=True)
class SpecDecodeCounts:
    """Speculative decoding since start (vLLM's `spec_decode_*` counters): steps with a
    proposal (`num_drafts`), proposed and accepted tokens, and accepted tokens by position
    in the proposal (index 0: the first proposed token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def merge(self, other: SpecDecodeCounts) -> None:
        """Adds `other`'s counts to these (several worker groups' sum)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        self.accepted_per_pos = [
            a + b
            for a, b in zip(
                self.accepted_per_pos + [0] * (width - len(self.accepted_per_pos)),
                other.accepted_per_pos + [0] * (width - len(other.accepted_per_pos)),
                strict=True,
            )
        ]

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
