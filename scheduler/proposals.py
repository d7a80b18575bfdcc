"""Each decoding sequence's proposal for a step the speculation gate chose to speculate, and
the per-step check (:class:`~sluiceway.spec_gate.StreamGuard`) that every stream gains."""

from __future__ import annotations

from collections.abc import Iterable

from sluiceway.scheduler.sequence import Sequence
from sluiceway.spec_gate import StreamGuard
from sluiceway.speculative import AdaptiveLength, NgramProposer

__all__ = ["Proposal", "propose", "step_proposals"]

Proposal = tuple[list[int], int]  # (n-gram tokens, or [] for the draft model's), their number


def propose(seq: Sequence, budget: int, pace: AdaptiveLength, proposer: NgramProposer | None,
            max_model_len: int) -> Proposal:  # fmt: skip
    """Tokens to verify after decoding `seq`'s last token and their number: the n-gram
    proposal (`proposer`), or ([], n) for n tokens of the workers' draft model (`proposer`
    None); at most `budget` and what `pace` allows, never past `max_tokens` or
    `max_model_len` (the last emitted token is sampled after them); none for a first token
    (a prompt's step: it carries the prompt logprobs and the queue time)."""
    if not seq.output_token_ids:
        return [], 0
    room = min(
        pace.allowed(seq.seq_id),
        budget,
        seq.sampling.max_tokens - len(seq.output_token_ids) - 1,
        max_model_len - seq.num_tokens,
    )
    if proposer is None:
        return [], max(0, room)
    drafts = proposer.propose(seq.seq_id, seq.prompt_token_ids, seq.output_token_ids, room)
    return drafts, len(drafts)


def step_proposals(running: Iterable[Sequence], budget: int, pace: AdaptiveLength,
                   proposer: NgramProposer | None, guard: StreamGuard,
                   max_model_len: int) -> dict[int, Proposal] | None:  # fmt: skip
    """seq_id -> proposal for each of `running` (in order, each within what is left of the
    step's token `budget` after the earlier ones' 1 + proposal) that decodes its last token
    in a step of no prompt chunk; None when `guard` keeps the step plain (some stream would
    gain less than the step's longer time costs it)."""
    proposals: dict[int, Proposal] = {}
    emitted: list[int] = []
    expected: list[float] = []
    for seq in running:
        if seq.num_pending_tokens or seq.num_tokens - seq.num_computed_tokens != 1:
            continue  # (not decoding: no token of its own to verify after)
        drafts, n = propose(seq, min(pace.k, budget - 1), pace, proposer, max_model_len)
        budget -= 1 + n
        proposals[seq.seq_id] = drafts, n
        emitted.append(len(seq.output_token_ids))
        expected.append(1.0 + pace.expected_accepted(seq.seq_id, n))  # (n 0: 1 token)
    proposed = [n for _, n in proposals.values()]
    if not guard.allows(list(proposals), emitted, proposed, expected):
        return None
    return proposals
