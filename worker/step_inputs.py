"""What one step of the model runner is made of, and its flattening into the forward's inputs.

A step is a list of :class:`ScheduledChunk`: for each scheduled sequence (a
:class:`SequenceData` the worker keeps between steps), the range of its tokens to compute.
:func:`prepare_step_inputs` checks the chunks and flattens them, decode chunks (one new token)
first, into one varlen batch of ``T`` rows: token ids and positions (``[T]`` int64 on the
device) and the attention backend's metadata. It runs on every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sluiceway.kernels.backend import AttentionBackend
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.structured_output import ConstraintMatcher

if TYPE_CHECKING:
    from sluiceway.worker.draft import DraftState

__all__ = [
    "ScheduledChunk",
    "SequenceData",
    "StepInputs",
    "check_chunks",
    "prepare_step_inputs",
]


@dataclass(slots=True)
class SequenceData:
    """Persistent per-sequence state the worker keeps between steps."""

    seq_id: int
    token_ids: list[int]  # prompt + generated so far
    block_table: list[int]  # physical KV block ids, in order
    sampling: SamplingParams  # resolved by the router
    generator: torch.Generator | None = None  # created by ModelRunner when sampling.seed is set
    num_prompt_tokens: int = 0  # the original prompt's length; the rest of token_ids is output
    constraint: ConstraintMatcher | None = None  # structured outputs: its grammar's state
    # the tokens this worker's last step emitted for it, until the scheduler confirms them
    # (async scheduling: `ScheduledSequence.append_last_sampled`)
    last_sampled: list[int] | None = None
    draft: DraftState | None = None  # the draft model's K/V of it (worker.draft)

    def append(self, token_ids: Sequence[int]) -> None:
        """Appends tokens generated since the last step (and moves the constraint on)."""
        self.token_ids.extend(token_ids)
        if self.constraint is not None:
            self.constraint.accept(token_ids)


@dataclass(slots=True)
class ScheduledChunk:
    """One sequence's share of a step.

    The runner computes positions ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``
    and samples for this chunk iff that range reaches ``len(seq.token_ids)``.
    """

    seq: SequenceData
    num_computed_tokens: int  # tokens of seq.token_ids whose K/V are already in the pool
    num_new_tokens: int  # compute positions [num_computed, num_computed + num_new)
    # speculative decoding: the last num_draft_tokens of seq.token_ids (for this step) are
    # proposed tokens, each position sampled and verified (worker.verify)
    num_draft_tokens: int = 0
    # draft-model speculation: tokens the worker's draft proposes before the step (it
    # appends them to the record and counts them in num_draft_tokens: worker.draft)
    num_model_drafts: int = 0


@dataclass(slots=True)
class StepInputs:
    """One step flattened: ``T`` rows, decode chunks first, then the others in chunk order."""

    input_ids: torch.Tensor  # [T] int64, on the device
    positions: torch.Tensor  # [T] int64, on the device
    metadata: Any  # from the attention backend's build_metadata
    row_start: list[int]  # first flattened row of each chunk (chunk order)
    sampling: list[int]  # chunk indices that sample, in chunk order


def check_chunks(chunks: Sequence[ScheduledChunk], *, block_size: int, max_model_len: int) -> None:
    """Checks that each chunk can run.

    Raises:
        ValueError: a sequence scheduled twice, an empty or out-of-range chunk, a position
            at or beyond ``max_model_len`` or a block table too short.
    """
    seen: set[int] = set()
    for c in chunks:
        seq = c.seq
        end = c.num_computed_tokens + c.num_new_tokens
        if seq.seq_id in seen:
            raise ValueError(f"sequence {seq.seq_id} scheduled twice in one step")
        seen.add(seq.seq_id)
        if c.num_new_tokens < 1 or c.num_computed_tokens < 0 or end > len(seq.token_ids):
            raise ValueError(
                f"sequence {seq.seq_id}: chunk [{c.num_computed_tokens}, {end}) outside its "
                f"{len(seq.token_ids)} tokens"
            )
        if end > max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id}: {end} tokens exceed max_model_len {max_model_len}"
            )
        if len(seq.block_table) * block_size < end:
            raise ValueError(
                f"sequence {seq.seq_id}: {len(seq.block_table)} blocks cannot hold {end} tokens"
            )


def prepare_step_inputs(
    chunks: Sequence[ScheduledChunk],
    backend: AttentionBackend,
    *,
    block_size: int,
    max_model_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> StepInputs:
    """Flattens the chunks (decode chunks first) into ids, positions and ``backend``'s
    attention metadata (``num_heads`` / ``num_kv_heads``: the rank's), all on ``device``.

    Raises:
        ValueError: a bad chunk (:func:`check_chunks`).
    """
    check_chunks(chunks, block_size=block_size, max_model_len=max_model_len)
    order = [i for i, c in enumerate(chunks) if c.num_new_tokens == 1]
    order += [i for i, c in enumerate(chunks) if c.num_new_tokens != 1]
    ids: list[int] = []
    positions: list[int] = []
    row_start = [0] * len(chunks)
    for i in order:
        c = chunks[i]
        row_start[i] = len(ids)
        start = c.num_computed_tokens
        stop = start + c.num_new_tokens
        if c.num_new_tokens == 1:
            ids.append(c.seq.token_ids[start])
            positions.append(start)
        else:
            ids.extend(c.seq.token_ids[start:stop])
            positions.extend(range(start, stop))
    ordered = [chunks[i] for i in order]
    metadata = backend.build_metadata(
        [c.num_new_tokens for c in ordered],
        [c.num_computed_tokens + c.num_new_tokens for c in ordered],
        [c.seq.block_table for c in ordered],
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        device=device,
    )
    sampling = [
        i
        for i, c in enumerate(chunks)
        if c.num_computed_tokens + c.num_new_tokens == len(c.seq.token_ids)
    ]
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64).to(device),
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        metadata=metadata,
        row_start=row_start,
        sampling=sampling,
    )
