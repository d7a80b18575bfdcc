"""The scheduler process's config: its step limits, with vLLM's names and meanings, and where
it listens and logs. Each field is the flag of the same name (`sluiceway scheduler --help`;
`sluiceway.options`)."""

from __future__ import annotations

from dataclasses import dataclass

from sluiceway.argtypes import non_negative_int, positive_int
from sluiceway.options import (
    DEFAULT_SCHEDULER,
    LOG_FORMAT,
    LOG_LEVEL,
    MAX_MODEL_LEN,
    METRICS_HOST,
    SPECULATIVE_CONFIG,
    TENSOR_PARALLEL_SIZE,
    ProcessConfig,
    metrics_port,
    option,
)
from sluiceway.speculative import SpeculativeConfig


@dataclass(slots=True, kw_only=True)
class SchedulerConfig(ProcessConfig):
    """Limits of one step of the batching loop, and the process's flags.

    listen: the gRPC address (host:port or unix:PATH) routers and workers dial.

    max_num_seqs: sequences in one step at most (vLLM's `max_num_seqs`).
    max_num_batched_tokens: tokens (prefill + decode) in one step at most; at least
        `max_num_seqs` (each sequence of a step needs a token; vLLM's rule).
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
    scheduling_policy: vLLM's `--scheduling-policy` with its values and iteration-level
        batching (Orca) under both: "fcfs" (the waiting queue in arrival order; when a
        running sequence needs a block and none is free, the latest admitted is preempted)
        or "priority" (the waiting queue by each request's `priority`, lower first, then
        arrival; the preempted one is the running sequence with the highest priority value,
        the latest-arrived among equals); or "static" (batches of `static_batch_size` that
        enter together and run until their longest member finishes; the baseline). A
        request with a priority other than 0 is refused unless the policy is "priority".
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
    speculative_config: vLLM's `--speculative-config` JSON (`sluiceway.speculative`; ""
        off): proposed tokens verified in one forward, the plain run's tokens bitwise.
    async_scheduling: build step N+1 while the workers run step N (vLLM's
        `--async-scheduling`): a sequence decoding in step N decodes in N+1 the token N
        samples, which the worker puts in itself (`append_last_sampled`); one that step N
        ends by a stop token has computed one token for nothing. Single-rank groups that
        both prefill and decode; not with speculative decoding (a proposal follows the
        last token). The tokens are those of the synchronous loop.
    metrics_port, metrics_host: Prometheus /metrics (port -1: off, 0: a free port).
    log_format, log_level: the process's log lines (`sluiceway.logs`).

    Raises ValueError (naming the field) for a value out of its flag's range or a combination
    of fields that cannot be served.
    """

    listen: str = option(DEFAULT_SCHEDULER, "host:port or unix:PATH")
    max_num_seqs: int = option(256, "sequences in one step at most", type=positive_int)
    max_num_batched_tokens: int = option(
        2048,
        "tokens in one step at most (decodes + prefill chunks; >= --max-num-seqs)",
        type=positive_int,
    )
    enable_chunked_prefill: bool = option(
        True, "split prompts longer than the step's token budget over several steps"
    )
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of cached prompt prefixes")
    long_prefill_token_threshold: int = option(
        0,
        "a prompt with more uncomputed tokens than this is a long prefill: its chunk per "
        "step is capped at this many tokens, the rest of the budget goes to other requests "
        "(0: no cap, or 4%% of max_model_len with --max-num-partial-prefills > 1; vLLM's)",
        type=non_negative_int,
    )
    max_num_partial_prefills: int = option(
        1,
        "prompts being prefilled over several steps at once at most (vLLM's)",
        type=positive_int,
    )
    max_long_partial_prefills: int = option(
        1,
        "of those, long ones at most: shorter prompts may pass a waiting long one (vLLM's)",
        type=positive_int,
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs: first come, first served; priority: by each request's priority (lower "
        "first, then arrival; the highest value is preempted first; vLLM's); static: fixed "
        "batches of --static-batch-size that enter and leave together (the baseline)",
        choices=("fcfs", "priority", "static"),
    )
    static_batch_size: int = option(8, "requests per batch of the static policy", type=positive_int)
    max_waiting_requests: int = option(
        1024,
        "requests waiting for their first step at most; more get RESOURCE_EXHAUSTED",
        type=positive_int,
    )
    tensor_parallel_size: int = TENSOR_PARALLEL_SIZE.field()
    num_prefill_workers: int = option(
        0,
        "disaggregated prefill: model instances that only prefill (with "
        "--num-decode-workers; 0 = one instance does both)",
        type=non_negative_int,
    )
    num_decode_workers: int = option(
        0,
        "disaggregated prefill: model instances that decode sequences whose prompt KV "
        "blocks were copied to them from a prefill instance",
        type=non_negative_int,
    )
    speculative_config: str = SPECULATIVE_CONFIG.field()
    async_scheduling: bool = option(
        False,
        "build the next step while the workers run this one (vLLM's); single-rank "
        "instances that prefill and decode, not with --speculative-config",
    )
    max_model_len: int | None = MAX_MODEL_LEN.field()
    metrics_port: int = metrics_port(9401)
    metrics_host: str = METRICS_HOST.field()
    log_format: str = LOG_FORMAT.field()
    log_level: str = LOG_LEVEL.field()

    def __post_init__(self) -> None:
        self.check_options()
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's check and words
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs})"
            )
        if self.scheduling_policy == "static" and self.static_batch_size > self.max_num_seqs:
            raise ValueError(
                f"static_batch_size must be in [1, max_num_seqs={self.max_num_seqs}], "
                f"got {self.static_batch_size}"
            )
        if (self.num_prefill_workers == 0) != (self.num_decode_workers == 0):
            raise ValueError(
                "disaggregated prefill needs both num_prefill_workers and num_decode_workers "
                f">= 1, got {self.num_prefill_workers} and {self.num_decode_workers}"
            )
        if self.is_disaggregated and self.scheduling_policy == "static":
            raise ValueError("the static policy cannot be combined with disaggregated prefill")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                "need 1 <= max_long_partial_prefills <= max_num_partial_prefills, got "
                f"{self.max_long_partial_prefills} and {self.max_num_partial_prefills}"
            )
        if self.async_scheduling:
            self._check_async_scheduling()
        spec = self.speculative
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config: draft_model needs tensor_parallel_size 1 (not built: a "
                "draft split across ranks)"
            )
        if not self.enable_chunked_prefill and (
            self.long_prefill_token_threshold > 0 or self.max_num_partial_prefills > 1
        ):
            raise ValueError(
                "long_prefill_token_threshold and max_num_partial_prefills > 1 need "
                "enable_chunked_prefill"
            )

    def _check_async_scheduling(self) -> None:
        """Raises ValueError for what async scheduling does not serve (only rank 0 samples,
        so only a lone rank has the token it puts in itself)."""
        if self.speculative_config:
            raise ValueError(
                "async_scheduling cannot be combined with speculative_config (a proposal "
                "follows the last token, which async scheduling does not have yet)"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling needs tensor_parallel_size 1 (only rank 0 samples: the other "
                "ranks would need each step's tokens before they could put them in themselves)"
            )
        if self.is_disaggregated:
            raise ValueError("async_scheduling cannot be combined with disaggregated prefill")
        if self.scheduling_policy == "static":
            raise ValueError("async_scheduling cannot be combined with the static policy")

    def resolved_long_prefill_token_threshold(self, max_model_len: int) -> int:
        """The chunk cap of a long prefill, tokens (0: none): `long_prefill_token_threshold`,
        or 4% of `max_model_len` when that is 0 and `max_num_partial_prefills` > 1 (as vLLM
        resolves it; at least 1)."""
        if self.long_prefill_token_threshold == 0 and self.max_num_partial_prefills > 1:
            return max(1, int(max_model_len * 0.04))
        return self.long_prefill_token_threshold

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config` (None: off)."""
        return SpeculativeConfig.parse(self.speculative_config) if self.speculative_config else None

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
