"""A request as the scheduler sees it: token ids, progress and its KV block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluiceway.sampling_params import SamplingParams
from sluiceway.v1 import inference_pb2

if TYPE_CHECKING:
    from sluiceway.v1.inference_pb2 import FinishReason


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"  # done, aborted or failed; holds no block


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation request.

    `sampling` is resolved (the router's `SamplingParams.resolve`): its `max_tokens`,
    `stop_token_ids` and `min_tokens` end the sequence. `num_computed_tokens` counts the
    tokens whose K/V are in the KV pool; the next token is sampled once it equals
    `num_tokens`. `num_tokens_on_worker` is how many of `token_ids` the worker's own record
    holds (0 = the worker has not heard of this sequence, or forgot it on preemption).
    `num_pending_tokens` (async scheduling) counts tokens a step in flight samples for it,
    not yet received: scheduling counts them in its length, `num_computed_tokens` and
    `num_tokens_on_worker` already include their positions.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # time.monotonic() of its first step
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_tokens_on_worker: int = 0
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of each full block of token_ids
    finish_reason: FinishReason = inference_pb2.FINISH_REASON_UNSPECIFIED
    num_preemptions: int = 0
    # the request whose n samples this sequence is one of (parallel sampling), else None
    parent_request_id: str | None = None
    # lower is served first under the priority policy (AddRequestRequest.priority); 0 else
    priority: int = 0

    # prompt logprobs the workers computed so far (prompt tokens 1.. in order), sent with the
    # first token (TokenEvent.prompt_logprobs)
    prompt_logprobs: list[inference_pb2.TokenLogprobs] = field(default_factory=list)

    # sampling.stop_token_ids as a set: looked up for every sampled token
    stop_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.sampling.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """`num_tokens` plus the pending ones: the length scheduling counts with."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the request asked for prompt logprobs and has not had them yet (they go
        out with the first token): its prompt is computed, never taken from the cache."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
