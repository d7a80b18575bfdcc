"""The worker's Prometheus metrics (`sluiceway:` prefix, `model_name` label)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Literal, get_args

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluiceway.metrics import PREFIX, STEP_BUCKETS

if TYPE_CHECKING:
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk

Phase = Literal["prefill", "decode"]  # the `phase` label
PHASES: tuple[Phase, ...] = get_args(Phase)

FORWARD_SECONDS = Histogram(
    f"{PREFIX}forward_seconds",
    "Model forward of one step (input tensors, forward, sampling), seconds; phase=decode "
    "when each sequence of the step computes its last sampled token only, else prefill "
    "(prompt tokens, however few, or a preempted sequence's recomputed ones).",
    ["model_name", "phase"],
    buckets=STEP_BUCKETS,
)


def is_decode(chunk: ScheduledChunk) -> bool:
    """Whether `chunk` is a decode: it computes one token, the generated one sampled last
    (with speculative decoding, that token and the proposed ones after it; a draft model's
    counted before they are proposed). Any other chunk
    prefills: prompt tokens, whatever their number (a 1-token prompt's only chunk too), or
    the generated tokens of a preempted sequence, recomputed."""
    start = chunk.num_computed_tokens
    proposed = chunk.num_draft_tokens or chunk.num_model_drafts  # (the draft's: not yet in)
    return (
        chunk.num_new_tokens == 1 + proposed
        and start >= chunk.seq.num_prompt_tokens
        and start + 1 + chunk.num_draft_tokens == len(chunk.seq.token_ids)
    )


def step_phase(chunks: Sequence[ScheduledChunk]) -> Phase:
    """The `phase` label of a step: decode when every chunk decodes, else prefill."""
    return "decode" if all(is_decode(c) for c in chunks) else "prefill"


def init_series(model_name: str) -> None:
    """Creates the `forward_seconds` series of each phase of `model_name` at 0, so that they
    are exported before the first step. Idempotent."""
    for phase in PHASES:
        FORWARD_SECONDS.labels(model_name, phase)


class WorkerCollector(Collector):
    """KV blocks of the pool and the device memory this worker holds."""

    def __init__(self, runner: ModelRunner, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            f"{PREFIX}kv_blocks_total", "KV blocks in this worker's pool.", labels=["model_name"]
        )
        blocks.add_metric([self.model_name], self.runner.num_kv_blocks)
        yield blocks
        memory = GaugeMetricFamily(
            f"{PREFIX}device_memory_used_bytes",
            "Device memory in use by this worker: torch's allocated bytes on CUDA; weights + "
            "KV pool on CPU.",
            labels=["model_name", "device"],
        )
        memory.add_metric(
            [self.model_name, str(self.runner.device)], self.runner.device_memory_used_bytes()
        )
        yield memory
        weights = GaugeMetricFamily(
            f"{PREFIX}model_weight_bytes",
            "Bytes of model weights this worker holds (its shard with tensor parallelism): "
            "parameters, packed copies and, with --quantization gguf, the GGUF blocks.",
            labels=["model_name", "quantization"],
        )
        weights.add_metric([self.model_name, self.runner.quantization], self.runner.weight_bytes())
        yield weights
