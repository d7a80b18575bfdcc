"""What one step of the scheduler sends the workers, and what it applies after."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluiceway.scheduler.sequence import Sequence

__all__ = ["KvUsage", "ScheduledSequence", "SchedulerOutput", "TokenUpdate"]


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step.

    The worker computes positions [num_computed_tokens, num_computed_tokens
    + num_new_tokens); `appended_token_ids` are tokens the worker's record
    lacks (all tokens when `is_new`, else the tokens sampled since).
    `new_block_ids` is the whole block table when `is_new` (cached prefix
    included), else the blocks added this step. `draft_token_ids`: proposed tokens
    (speculative decoding) the chunk computes after the sequence's last token; then
    `num_new_tokens` is 1 + their number; `num_draft_model_tokens`: as many proposed by
    the workers' draft model instead (the scheduler never sees them before the answer).
    `append_last_sampled` (async scheduling): the
    sequence's last token is pending (sampled by the step in flight), the worker appends
    the one it sampled. `samples`: whether the chunk reaches the end of the sequence (its
    pending token included), so a token is sampled; fixed when the share is made.
    """

    seq: Sequence
    is_new: bool
    appended_token_ids: list[int]
    num_computed_tokens: int
    num_new_tokens: int
    new_block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    append_last_sampled: bool = False
    num_draft_model_tokens: int = 0
    samples: bool = field(init=False)

    @property
    def is_prompt_chunk(self) -> bool:
        """Whether the share computes prompt positions (a prefill chunk; a preempted
        sequence's recompute too while it covers its prompt)."""
        return self.num_computed_tokens < len(self.seq.prompt_token_ids)

    def __post_init__(self) -> None:
        end = self.num_computed_tokens + self.num_new_tokens - self.num_drafts
        self.samples = end == self.seq.num_tokens_with_pending

    @property
    def num_drafts(self) -> int:
        """Proposed tokens the chunk verifies, the scheduler's or the draft model's."""
        return len(self.draft_token_ids) or self.num_draft_model_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """Everything one step sends to the workers."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # workers forget these first
    # async scheduling: the step's progress was counted when the next one was built
    # (`Scheduler.advance`), before its tokens came
    advanced: bool = False
    # speculative decoding: whether the step ran the speculating policy (`SpeculationGate`);
    # None without a speculative config
    speculating: bool | None = None
    # the gate chose to speculate and `StreamGuard` kept the step plain (speculating False)
    guarded: bool = False

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step computes, every sequence's chunk together."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.finished_seq_ids

    @property
    def is_decode_only(self) -> bool:
        """Whether every share decodes its last token (and its proposals): no prompt chunk."""
        return bool(self.scheduled) and all(
            s.num_new_tokens == 1 + s.num_drafts and s.seq.output_token_ids for s in self.scheduled
        )


@dataclass(slots=True)
class TokenUpdate:
    """A token applied to a sequence; `seq.finish_reason` tells whether it was the last."""

    seq: Sequence
    token_id: int


@dataclass(slots=True)
class KvUsage:
    """KV memory utilization: tokens of live sequences stored / slots of allocated blocks.

    Sampled after every step; the totals are sums over steps, so the mean
    over any window is (difference of `tokens_stored_total`) / (difference
    of `slots_allocated_total`).
    """

    utilization: float = 0.0  # last step
    tokens_stored_total: int = 0
    slots_allocated_total: int = 0
