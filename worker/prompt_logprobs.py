"""Prompt log-probabilities (vLLM's ``prompt_logprobs``): the log-probability of each prompt
token given the tokens before it, and the N most likely tokens at its position.

The forward computes the final hidden state of every row of a step; the model runner takes
logits only at the rows that sample (the last of a sequence). For a chunk of a sequence that
asks for prompt logprobs, the rows at positions ``p`` with ``p + 1 < num_prompt_tokens``
predict prompt token ``p + 1``: :func:`plan_prompt_logprobs` finds them, and
:func:`compute_prompt_logprobs` takes their logits, in slices, and the float32 log-softmax of
each, with no penalty, bias or grammar mask (vLLM's raw prompt logprobs). With chunked prefill
each chunk gives its own share; the scheduler puts them together. A step where no sequence
asks does none of this (one pass over the chunks' sampling fields).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sluiceway.worker.model import LlamaForCausalLM
from sluiceway.worker.sampler import SamplerBuffers, log_softmax_
from sluiceway.worker.step_inputs import ScheduledChunk

__all__ = ["PromptLogprobs", "PromptPlan", "compute_prompt_logprobs", "plan_prompt_logprobs"]

#: Rows whose logits are taken at once: a slice's float32 logits are ``[ROWS, V]`` (64 MiB
#: for Gemma 3's 262k vocabulary), whatever the chunk's length.
ROWS_PER_SLICE = 64


@dataclass(slots=True)
class PromptLogprobs:
    """One chunk's share of a sequence's prompt logprobs: entry ``i`` is prompt token
    ``first_token_index + i`` (``>= 1``). ``top_ids`` / ``top_logprobs``: the ``N`` most
    likely at each position, most likely first; ``ranks``: 1-based rank of the prompt token."""

    seq_id: int
    first_token_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)


@dataclass(slots=True)
class PromptPlan:
    """Which flattened rows of a step give prompt logprobs: ``rows`` (``[R]``), the prompt
    token each predicts (``targets``), and per asking chunk ``(seq_id, first token index,
    number of rows, N)`` in row order."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)


def plan_prompt_logprobs(
    chunks: Sequence[ScheduledChunk], row_start: Sequence[int]
) -> PromptPlan | None:
    """The rows of the step's chunks that give prompt logprobs (``row_start[i]``: chunk i's
    first flattened row), or None when no chunk has any (the step's cost is then this loop)."""
    plan: PromptPlan | None = None
    for i, c in enumerate(chunks):
        n = c.seq.sampling.prompt_logprobs
        if n is None:
            continue
        start = c.num_computed_tokens
        stop = min(start + c.num_new_tokens, c.seq.num_prompt_tokens - 1)
        if stop <= start:
            continue
        plan = plan or PromptPlan()
        first_row = row_start[i]
        plan.rows.extend(range(first_row, first_row + stop - start))
        plan.targets.extend(c.seq.token_ids[start + 1 : stop + 1])
        plan.spans.append((c.seq.seq_id, start + 1, stop - start, n))
    return plan


def compute_prompt_logprobs(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    plan: PromptPlan,
    buffers: SamplerBuffers | None = None,
) -> list[PromptLogprobs]:
    """The prompt logprobs of ``plan``'s rows of ``hidden`` (``[T, H]``, the step's final
    hidden states): logits through ``model.compute_logits`` (gathered to rank 0 with tensor
    parallelism: every rank calls this with the same plan) into the model's kept logits
    buffer, float32 log-softmax written over them, the ranks' comparisons in ``buffers``'
    kept scratch (None: a new one). Returns one :class:`PromptLogprobs` per span on
    rank 0, an empty list on the other ranks."""
    device = hidden.device
    buffers = SamplerBuffers() if buffers is None else buffers
    top_n = max(span[3] for span in plan.spans)
    chosen: list[torch.Tensor] = []
    ranks: list[torch.Tensor] = []
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    for lo in range(0, len(plan.rows), ROWS_PER_SLICE):
        rows = torch.tensor(plan.rows[lo : lo + ROWS_PER_SLICE], dtype=torch.int64, device=device)
        logits = model.compute_logits(
            hidden.index_select(0, rows), dst=0, float32=True, reuse_buffer=True
        )
        if logits is None:  # a tensor-parallel rank other than 0
            continue
        # [r, V] float32 over the logits (a copy only of a tensor-parallel gather's slice)
        log_probs = log_softmax_(logits if logits.is_contiguous() else logits.contiguous())
        targets = torch.tensor(plan.targets[lo : lo + ROWS_PER_SLICE], device=device)
        lp = log_probs.gather(1, targets[:, None])  # [r, 1]
        chosen.append(lp[:, 0])
        # 1.0 where above the prompt token, counted in float32 (exact below 2**24): a bool
        # tensor's sum would first widen it to an [r, V] int64 copy
        above = buffers.scratch(log_probs.shape[0], log_probs.shape[1], device)
        ranks.append(torch.gt(log_probs, lp, out=above).sum(dim=-1).long() + 1)
        if top_n:
            tops.append(torch.topk(log_probs, top_n, dim=-1))
    if not chosen:
        return []
    lps = torch.cat(chosen).tolist()
    rank_list = torch.cat(ranks).tolist()
    top_lps = torch.cat([t[0] for t in tops]).tolist() if tops else []
    top_ids = torch.cat([t[1] for t in tops]).tolist() if tops else []
    out: list[PromptLogprobs] = []
    at = 0
    for seq_id, first, count, n in plan.spans:
        part = PromptLogprobs(seq_id, first, plan.targets[at : at + count])
        part.logprobs = lps[at : at + count]
        part.ranks = rank_list[at : at + count]
        if n:
            part.top_ids = [ids[:n] for ids in top_ids[at : at + count]]
            part.top_logprobs = [v[:n] for v in top_lps[at : at + count]]
        out.append(part)
        at += count
    return out
