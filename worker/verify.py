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
from dataclasses import dataclass

import torch

from sluiceway.worker.step_inputs import ScheduledChunk, SequenceData

__all__ = ["SamplingRows", "accepted_count", "restore_generators", "sampling_rows"]


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
