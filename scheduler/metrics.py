"""The scheduler's Prometheus metrics (vLLM's names, `sluiceway:` prefix, `model_name` label).

Histograms are observed by the step loop; gauges and counters are read from
the live `Engine` at scrape time by :class:`SchedulerCollector`, so they can
never drift from the state `GetSchedulerInfo` reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluiceway.metrics import COUNT_BUCKETS, PREFIX, STEP_BUCKETS, TOKEN_COUNT_BUCKETS

if TYPE_CHECKING:
    from scheduler.engine import Engine

SCHEDULER_STEP_SECONDS = Histogram(
    f"{PREFIX}scheduler_step_seconds",
    "Time to build one step (Scheduler.schedule), seconds.",
    ["model_name"],
    buckets=STEP_BUCKETS,
)
MODEL_STEP_SECONDS = Histogram(
    f"{PREFIX}model_step_seconds",
    "Time waiting for the workers to execute one step (RPC + forward + sampling), seconds.",
    ["model_name"],
    buckets=STEP_BUCKETS,
)
BATCH_SIZE = Histogram(
    f"{PREFIX}batch_size",
    "Sequences per step.",
    ["model_name"],
    buckets=COUNT_BUCKETS,
)
BATCHED_TOKENS = Histogram(
    f"{PREFIX}batched_tokens",
    "Tokens computed per step (decodes + prefill chunks).",
    ["model_name"],
    buckets=TOKEN_COUNT_BUCKETS,
)


class SchedulerCollector(Collector):
    """Queue lengths, KV cache usage, prefix-cache and preemption counters of `engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        sched, worker = self.engine.scheduler, self.engine.worker
        model = worker.model_id if worker is not None else ""

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        if sched is None:
            running = waiting = 0
            usage = utilization = queries = hits = preemptions = 0.0
        else:
            bm = sched.block_manager
            running, waiting = len(sched.running), len(sched.waiting)
            usage = 1.0 - bm.num_free_blocks / bm.num_blocks
            utilization = sched.kv_usage.utilization
            queries, hits = bm.prefix_cache_queries, bm.prefix_cache_hits
            preemptions = sched.num_preemptions
        yield gauge("num_requests_running", "Requests in the running batch.", running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks held by live requests (1 = full); evictable prefix-cache "
            "blocks count as free.",
            usage,
        )
        yield gauge(
            "kv_cache_utilization",
            "Tokens stored / token slots of the allocated KV blocks, at the last step.",
            utilization,
        )
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", preemptions)
