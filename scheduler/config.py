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
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
