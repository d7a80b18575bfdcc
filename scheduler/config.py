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
    long_prefill_token_threshold: a sequence with more uncomputed tokens than this is a
        *long* prefill, and its chunk per step is capped at this many tokens, so the rest of
        the step's budget goes to other requests (vLLM's `long_prefill_token_threshold`, as
        its v1 scheduler applies it). 0: no cap, unless `max_num_partial_prefills` > 1, where
        it becomes 4% of `max_model_len` (vLLM's rule; `resolved_long_prefill_token_threshold`).
    max_num_partial_prefills: sequences whose prompt is prefilled over several steps
        (chunked and not finished by this step's chunk) at once at most: a waiting request
        that would be a further one waits, one whose whole prompt fits in the step is still
        admitted (vLLM's `max_num_partial_prefills`).
    max_long_partial_prefills: of those, long prefills at most (at most
        `max_num_partial_prefills`); below it a shorter prompt may pass a long one that waits
        (vLLM's `max_long_partial_prefills`).
    scheduling_policy: "continuous" (iteration-level batching, Orca) or
        "static" (batches of `static_batch_size` that enter together and run
        until their longest member finishes; the baseline).
    static_batch_size: requests per static batch.
    max_waiting_requests: requests that may wait for their first step at
        once; more are rejected at once with RESOURCE_EXHAUSTED (backpressure
        instead of a queue that grows without end).
    tensor_parallel_size: worker ranks per model instance (vLLM's name); each step goes to
        every rank, rank 0 answers.
    num_prefill_workers, num_decode_workers: disaggregated prefill. Both 0 (the default): one
        model instance prefills and decodes. Otherwise that many instances only prefill and
        that many only decode; a prompt is prefilled on a prefill instance, its KV blocks
        are copied to a decode instance (device to device), which continues the sequence.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    scheduling_policy: str = "continuous"
    static_batch_size: int = 8
    max_waiting_requests: int = 1024
    tensor_parallel_size: int = 1
    num_prefill_workers: int = 0
    num_decode_workers: int = 0

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
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_prefill_workers < 0 or self.num_decode_workers < 0:
            raise ValueError("num_prefill_workers and num_decode_workers must be >= 0")
        if (self.num_prefill_workers == 0) != (self.num_decode_workers == 0):
            raise ValueError(
                "disaggregated prefill needs both num_prefill_workers and num_decode_workers "
                f">= 1, got {self.num_prefill_workers} and {self.num_decode_workers}"
            )
        if self.is_disaggregated and self.scheduling_policy == "static":
            raise ValueError("the static policy cannot be combined with disaggregated prefill")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(
                "need 1 <= max_long_partial_prefills <= max_num_partial_prefills, got "
                f"{self.max_long_partial_prefills} and {self.max_num_partial_prefills}"
            )
        if not self.enable_chunked_prefill and (
            self.long_prefill_token_threshold > 0 or self.max_num_partial_prefills > 1
        ):
            raise ValueError(
                "long_prefill_token_threshold and max_num_partial_prefills > 1 need "
                "enable_chunked_prefill"
            )

    def resolved_long_prefill_token_threshold(self, max_model_len: int) -> int:
        """The chunk cap of a long prefill, tokens (0: none): `long_prefill_token_threshold`,
        or 4% of `max_model_len` when that is 0 and `max_num_partial_prefills` > 1 (as vLLM
        resolves it; at least 1)."""
        if self.long_prefill_token_threshold == 0 and self.max_num_partial_prefills > 1:
            return max(1, int(max_model_len * 0.04))
        return self.long_prefill_token_threshold

    @property
    def is_disaggregated(self) -> bool:
        """Whether prefill and decode run on different worker groups."""
        return self.num_prefill_workers > 0

    @property
    def group_roles(self) -> list[str]:
        """The role of each worker group, by index: ``["both"]``, or P "prefill" then D
        "decode"."""
        if not self.is_disaggregated:
            return ["both"]
        return ["prefill"] * self.num_prefill_workers + ["decode"] * self.num_decode_workers
