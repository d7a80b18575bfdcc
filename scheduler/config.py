"""Scheduler limits, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Limits of one step of the batching loop.

    max_num_seqs: sequences in one step at most (vLLM's `max_num_seqs`).
    max_num_batched_tokens: tokens (prefill + decode) in one step at most.
    max_model_len: prompt + output tokens of one sequence at most; `None`
        takes the model's own context length as the worker reports it.
    enable_chunked_prefill: split prompts longer than the remaining token
        budget into chunks over several steps (vLLM v1's default). Without
        it a prompt is scheduled whole or not at all.
    enable_prefix_caching: reuse the KV blocks of cached prompt prefixes.
    scheduling_policy: "continuous" (iteration-level batching, Orca) or
        "static" (batches of `static_batch_size` that enter together and run
        until their longest member finishes; the baseline).
    static_batch_size: requests per static batch.
    max_waiting_requests: requests that may wait for their first step at
        once; more are rejected at once with RESOURCE_EXHAUSTED (backpressure
        instead of a queue that grows without end).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "continuous"
    static_batch_size: int = 8
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be continuous or static, got {self.scheduling_policy!r}"
            )
        if self.scheduling_policy == "static" and not (
            1 <= self.static_batch_size <= self.max_num_seqs
        ):
            raise ValueError(
                f"static_batch_size must be in [1, max_num_seqs={self.max_num_seqs}], "
                f"got {self.static_batch_size}"
            )
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
