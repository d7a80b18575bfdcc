"""The worker's Prometheus metrics (`sluiceway:` prefix, `model_name` label)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluiceway.metrics import PREFIX, STEP_BUCKETS

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner

FORWARD_SECONDS = Histogram(
    f"{PREFIX}forward_seconds",
    "Model forward of one step (input tensors, forward, sampling), seconds; phase=prefill "
    "when the step has a chunk of more than one token, else decode.",
    ["model_name", "phase"],
    buckets=STEP_BUCKETS,
)


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
