"""The sampling rows of a step, and the verification of proposed tokens (speculative decoding,
:mod:`sluiceway.speculative`).

A chunk that samples gives one logits row, its last position; a chunk with ``d`` proposed
tokens (the last ``d`` of its record's tokens during the step) gives ``d + 1``: its last
token's position and each proposal's. Row ``j`` of such a chunk is sampled as plain decoding
would sample that position: penalties and ``min_tokens`` over the tokens before it (the
record's tokens up to the proposal ``j``), a seeded sequence's uniforms drawn in row order
(the draws a plain run makes at those output positions). The chunk then emits the longest
prefix of the proposal that equals what was sampled, plus the token sampled after it:
exactly the tokens plain decoding gives, one per step. A seeded generator is put back where
plain decoding leaves it: one draw per emitted token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sluiceway.internal.v1 import worker_pb2
from sluiceway.worker.sampler import SampleResult
from sluiceway.worker.step_inputs import ScheduledChunk, SequenceData

if TYPE_CHECKING:
    from sluiceway.worker.model_runner import ModelRunner

__all__ = [
    "SampledToken",
    "SamplingRows",
    "accepted_count",
    "restore_generators",
    "sampled_tokens",
    "sampling_rows",
    "scheduled_chunk",
]


@dataclass(slots=True)
class SampledToken:
    """A token sampled for a sequence, with its logprob (log-softmax of the penalized logits)
    and, when the sequence asked, the ``logprobs`` most likely ids and their logprobs."""

    seq_id: int
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SamplingRows:
    """The logits rows of a step, in order: for each sampling chunk (``chunks`` indices in
    ``sampling`` order) its ``1 + num_draft_tokens`` rows. ``hidden_rows``: each row's row of
    the forward's output; ``seqs``: its sequence; ``seen``: the tokens before the position
    it samples (prompt + output so far, for penalties); ``draws``: by chunk index, the
    seeded generator of a chunk with proposals and its state before the step (see
    :func:`restore_generators`)."""

    hidden_rows: list[int]
    seqs: list[SequenceData]
    seen: list[Sequence[int]]
    draws: dict[int, tuple[torch.Generator, torch.Tensor]]
    # per sampling chunk: its first logits row and its proposed tokens
    chunk_rows: list[tuple[int, list[int]]]


def scheduled_chunk(
    seq: SequenceData, s: worker_pb2.ScheduledSequence, runner: ModelRunner
) -> ScheduledChunk:
    """The runner's chunk of step share `s` for record `seq`; proposed tokens are appended
    to the record for the step (the caller takes them off after it), or, for the draft
    model's, counted for `ModelRunner.execute` to propose.

    Raises ValueError: positions past the record's tokens, or proposed tokens on a chunk
    that does not decode the last token, where the forward is not batch invariant (their
    verification would not be exact) or, for the draft model's, on a runner without one.
    """
    drafts = list(s.draft_token_ids)
    num_drafts = len(drafts) or s.num_draft_model_tokens
    if num_drafts:
        if s.num_new_tokens != 1 + num_drafts or s.num_computed_tokens + 1 != len(seq.token_ids):
            raise ValueError(
                f"sequence {s.seq_id}: {num_drafts} proposed tokens on a chunk of "
                f"{s.num_new_tokens} at {s.num_computed_tokens} of {len(seq.token_ids)} "
                "tokens (they follow the last token, one chunk of 1 + their number)"
            )
        if not runner.batch_invariant:
            raise ValueError(
                f"sequence {s.seq_id}: proposed tokens on a forward that is not batch "
                "invariant (their verification would not be exact)"
            )
        if drafts and max(drafts) >= runner.vocab_size:
            raise ValueError(f"sequence {s.seq_id}: a proposed token outside the vocabulary")
        if not drafts and runner.draft is None:
            raise ValueError(f"sequence {s.seq_id}: draft-model tokens asked of a worker "
                             "without a draft model (--speculative-config)")  # fmt: skip
        seq.token_ids.extend(drafts)
    elif s.num_computed_tokens + s.num_new_tokens > len(seq.token_ids):
        raise ValueError(
            f"sequence {s.seq_id}: positions up to "
            f"{s.num_computed_tokens + s.num_new_tokens} but {len(seq.token_ids)} tokens"
        )
    if drafts:
        return ScheduledChunk(seq, s.num_computed_tokens, s.num_new_tokens, len(drafts))
    return ScheduledChunk(seq, s.num_computed_tokens, s.num_new_tokens, num_model_drafts=num_drafts)


def sampling_rows(
    chunks: Sequence[ScheduledChunk], sampling: Sequence[int], row_start: Sequence[int]
) -> SamplingRows:
    """The rows to sample for ``chunks[i]``, ``i`` in ``sampling``, whose first forward row is
    ``row_start[i]``."""
    rows = SamplingRows([], [], [], {}, [])
    for i in sampling:
        c = chunks[i]
        seq, d = c.seq, c.num_draft_tokens
        last = row_start[i] + c.num_new_tokens - 1
        rows.chunk_rows.append((len(rows.seqs), seq.token_ids[-d:] if d else []))
        if not d:
            rows.hidden_rows.append(last)
            rows.seqs.append(seq)
            rows.seen.append(seq.token_ids)
            continue
        n = len(seq.token_ids) - d  # the record's own tokens
        for j in range(d + 1):
            rows.hidden_rows.append(last - d + j)
            rows.seqs.append(seq)
            rows.seen.append(seq.token_ids[: n + j])
        if seq.generator is not None and seq.sampling.temperature > 0:
            rows.draws[i] = (seq.generator, seq.generator.get_state())
    return rows


def accepted_count(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """Tokens a chunk emits: ``sampled`` (``len(drafts) + 1`` tokens, one per row) up to and
    including the first that differs from the proposal at its place (all of them when every
    proposal matched)."""
    n = 1
    while n <= len(drafts) and sampled[n - 1] == drafts[n - 1]:
        n += 1
    return n


def restore_generators(
    draws: dict[int, tuple[torch.Generator, torch.Tensor]], emitted: dict[int, int]
) -> None:
    """Puts each seeded generator of ``draws`` back to its state before the step, then draws
    ``emitted[i]`` uniforms from it (one per token chunk ``i`` emitted, as the sampler draws:
    so that the next step's draws are those of plain decoding)."""
    for i, (gen, state) in draws.items():
        gen.set_state(state)
        n = emitted[i]
        for _ in range(n):
            torch.rand(1, generator=gen, device=gen.device)


def sampled_tokens(
    chunks: Sequence[ScheduledChunk],
    sampling: Sequence[int],
    rows: SamplingRows,
    result: SampleResult,
) -> list[SampledToken]:
    """The step's answer from the sampled rows: a token per sampling chunk, or for a chunk
    with proposals the tokens it emits (:func:`worker.verify.accepted_count`; its seeded
    generator put back to one draw per emitted token), each with its logprobs."""
    tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
    top_ids = top_lps = None
    if result.top_ids is not None and result.top_logprobs is not None:
        top_ids, top_lps = result.top_ids.tolist(), result.top_logprobs.tolist()
    out: list[SampledToken] = []
    emitted: dict[int, int] = {}
    row = 0
    for i in sampling:
        seq, d = chunks[i].seq, chunks[i].num_draft_tokens
        n = accepted_count(seq.token_ids[-d:], tokens[row : row + d + 1]) if d else 1
        emitted[i] = n
        for r in range(row, row + n):
            token = SampledToken(seq.seq_id, tokens[r], logprobs[r])
            k = seq.sampling.logprobs
            if k and top_ids is not None and top_lps is not None:
                # tokens the grammar or min_tokens masked (-inf) are no alternative
                pairs = zip(top_ids[r][:k], top_lps[r][:k], strict=True)
                kept = [(t, lp) for t, lp in pairs if lp != float("-inf")]
                token.top_ids = [t for t, _ in kept]
                token.top_logprobs = [lp for _, lp in kept]
            out.append(token)
        row += d + 1
    restore_generators(rows.draws, emitted)
    return out
