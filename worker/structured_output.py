"""Structured outputs: a per-request constraint on the generated text, applied while sampling.

A constraint (``sluiceway.v1.StructuredOutputs``: a JSON schema, any JSON object, a regex, a
list of choices or an EBNF grammar) is compiled by xgrammar (Dong et al., "XGrammar: Flexible
and Efficient Structured Generation Engine for Large Language Models", 2024: a pushdown
automaton over the tokenizer's vocabulary with a cache of context-independent token masks)
into a ``CompiledGrammar``, once per distinct constraint: the compiler keeps its own cache.
Each constrained sequence has a :class:`ConstraintMatcher` that follows the tokens it is
given; before each sample it writes the sequence's row of a packed token bitmask (``int32``,
one bit per token, ``ceil(V / 32)`` words per row) and :func:`apply_token_bitmask` sets the
logits of every token it excludes to ``-inf``. xgrammar is chosen over llguidance and
outlines-core by measurement (README, Structured outputs; ``sluiceway bench grammar``).

xgrammar imports torch, so it is imported here, in the worker, and only when the first
constraint arrives.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sluiceway.kernels import cpu_ops
from sluiceway.status import FieldError
from sluiceway.v1 import inference_pb2

__all__ = [
    "ConstraintError",
    "ConstraintMatcher",
    "GrammarCompiler",
    "allow_all_bitmask",
    "apply_token_bitmask",
    "constraint_kind",
]


#: The schema of OpenAI's ``json_object`` response format: any JSON object.
ANY_JSON_OBJECT = '{"type": "object"}'


class ConstraintError(FieldError):
    """A constraint that does not compile; ``field`` names it
    (``sampling.structured_outputs.json``, ...)."""


def constraint_kind(c: inference_pb2.StructuredOutputs) -> str | None:
    """Which field of the oneof is set (``json``, ``json_object``, ``regex``, ``choice`` or
    ``grammar``), or None for an empty message (no constraint)."""
    kind = c.WhichOneof("constraint")
    if kind == "json_object" and not c.json_object:
        return None
    return kind


def choice_grammar(choices: Sequence[str]) -> str:
    """The EBNF grammar whose language is exactly ``choices`` (JSON string literals are
    xgrammar's EBNF string literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(slots=True)
class ConstraintMatcher:
    """Where one sequence is in its grammar.

    ``accept`` follows the sequence's tokens; ``fill`` writes the tokens allowed next into a
    row of a bitmask. A matcher that has accepted a stop token (EOS) allows only the stop
    tokens; one given a token its grammar refuses (``violated``: a scheduler or resume bug)
    allows only them too, so the sequence ends rather than leaving its grammar.
    """

    matcher: Any  # xgrammar.GrammarMatcher
    stop_token_ids: tuple[int, ...]
    violated: bool = False

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advances over ``token_ids`` (generated, in order)."""
        for t in token_ids:
            if self.violated or self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(t)):
                self.violated = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into ``bitmask[row]`` (``int32 [R, ceil(V/32)]``)."""
        if self.violated or self.matcher.is_terminated():
            self._fill_stop(bitmask, row)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_along(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        """Speculative decoding: writes into ``bitmask[row + i]`` the tokens allowed after
        ``drafts[:i]``, for i = 0 .. len(drafts), and leaves the matcher where it was (the
        proposals are rolled back). Past a proposal the grammar refuses, the rows allow only
        the stop tokens: no sample reaches them (the row before cannot sample that proposal,
        so verification stops there)."""
        self.fill(bitmask, row)
        accepted = 0
        for i, t in enumerate(drafts, 1):
            if (
                self.violated
                or self.matcher.is_terminated()
                or not self.matcher.accept_token(int(t))
            ):
                for r in range(row + i, row + len(drafts) + 1):
                    self._fill_stop(bitmask, r)
                break
            accepted += 1
            self.fill(bitmask, row + i)
        if accepted:
            self.matcher.rollback(accepted)

    def _fill_stop(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.stop_token_ids:
            bitmask[row, t // 32] |= _bit(t % 32)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word, as a signed value (bit 31 is negative)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer; thread safe.

    Args:
        model_dir: the HF-style folder whose tokenizer files the worker serves.
        vocab_size: width of the model's logits (``V``; may exceed the tokenizer's
            length: the padding ids are never allowed).
        stop_token_ids: the ids that end a complete output (the model's EOS ids).
        cache_limit_bytes: the compiled-grammar cache's bound.
    """

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        cache_limit_bytes: int = 256 << 20,
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self._cache_limit_bytes = cache_limit_bytes
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids)
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=self._cache_limit_bytes
                )
            return self._compiler

    def compile(self, c: inference_pb2.StructuredOutputs) -> tuple[Any, float]:
        """The ``CompiledGrammar`` of ``c`` and the seconds it took (near 0 when cached).

        Raises:
            ConstraintError: no constraint set, or one xgrammar refuses (an invalid schema,
                regex or grammar), naming the field.
        """
        kind = constraint_kind(c)
        if kind is None:
            raise ConstraintError("sampling.structured_outputs", "no constraint set")
        compiler = self._xgr_compiler()
        field = f"sampling.structured_outputs.{kind}"
        t0 = time.perf_counter()
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(c.json)
            elif kind == "json_object":  # an object, not any JSON value (OpenAI's meaning)
                compiled = compiler.compile_json_schema(ANY_JSON_OBJECT)
            elif kind == "regex":
                compiled = compiler.compile_regex(c.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(c.choice.choices))
            else:
                compiled = compiler.compile_grammar(c.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ConstraintError(field, _first_line(e)) from None
        return compiled, time.perf_counter() - t0

    def clear_cache(self) -> None:
        """Forgets every compiled grammar (for benchmarks of cold compiles)."""
        self._xgr_compiler().clear_cache()

    def matcher(
        self, c: inference_pb2.StructuredOutputs, output_token_ids: Sequence[int] = ()
    ) -> ConstraintMatcher:
        """A matcher for ``c`` that has followed ``output_token_ids`` (the tokens a preempted
        or resumed sequence already generated).

        Raises:
            ConstraintError: as :meth:`compile`.
        """
        import xgrammar as xgr

        compiled, _ = self.compile(c)
        m = ConstraintMatcher(
            xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids)),
            self.stop_token_ids,
        )
        m.accept(output_token_ids)
        return m


# xgrammar's messages start with a time and a C++ source location: "[17:28:05]
# /project/cpp/regex_converter.cc:94: ", sometimes "Check failed: (...) is false: " too.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _first_line(e: BaseException) -> str:
    """The first line of xgrammar's message, without its time and source location."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return _XGRAMMAR_PREFIX.sub("", lines[0])[:500]


def allow_all_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An ``int32 [rows, ceil(vocab_size / 32)]`` bitmask on the CPU, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets ``logits[r, t]`` to ``-inf`` for each ``r`` in ``rows`` and every token ``t`` whose
    bit is clear in ``bitmask[r]``, in place: on CPU the C++ kernel
    (:func:`kernels.cpu_ops.apply_token_bitmask`, about 100x xgrammar's CPU path here), else
    xgrammar's kernel for the device.

    Args:
        logits: ``[R, V]`` float32.
        bitmask: ``int32 [R, ceil(V / 32)]`` on the CPU, bit ``t % 32`` of word ``t // 32`` set
            for an allowed token ``t`` (rows outside ``rows`` are not read).
        rows: the constrained rows.
    """
    if logits.device.type == "cpu" and cpu_ops.available():
        cpu_ops.apply_token_bitmask(logits, bitmask, torch.tensor(list(rows), dtype=torch.int64))
        return
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=list(rows)
    )
