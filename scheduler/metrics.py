"""The scheduler's Prometheus metrics (vLLM's names, `sluiceway:` prefix, `model_name` label).

Histograms are observed by the step loop and `scheduler_requests` by the
service; gauges and counters are read from the live `Engine` at scrape time
by :class:`SchedulerCollector`, so they can never drift from the state
`GetSchedulerInfo` reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluiceway.metrics import COUNT_BUCKETS, PREFIX, STEP_BUCKETS, TOKEN_COUNT_BUCKETS

if TYPE_CHECKING:
    from sluiceway.scheduler.engine import Engine

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
REQUESTS_RECEIVED = Counter(
    f"{PREFIX}scheduler_requests",
    "AddRequest calls accepted (one per sequence: n for a request of n parallel samples).",
    ["model_name"],
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


def init_series(model_name: str) -> None:
    """Creates the series of `model_name` of every metric above at 0, so that they are
    exported before the first request (as vLLM does at start). Idempotent."""
    for metric in (
        SCHEDULER_STEP_SECONDS,
        MODEL_STEP_SECONDS,
        REQUESTS_RECEIVED,
        BATCH_SIZE,
        BATCHED_TOKENS,
    ):
        metric.labels(model_name)


class SchedulerCollector(Collector):
    """Queue lengths, KV cache usage, prefix-cache and preemption counters of `engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        model = self.engine.model_id
        st = self.engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        running, waiting = st.num_running, st.num_waiting
        usage, utilization = st.kv_usage_perc, st.utilization
        queries, hits = st.prefix_cache_queries_total, st.prefix_cache_hits_total
        preemptions = st.num_preemptions_total
        yield gauge("num_requests_running", "Requests in the running batch.", running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "Fraction of KV blocks held by live requests (1 = full); evictable prefix-cache "
            "blocks count as free.",
            usage,
        )
        yield gauge(
            "num_kv_blocks",
            "KV blocks in the pools, every worker group together.",
            st.num_kv_blocks,
        )
        yield gauge(
            "num_free_kv_blocks",
            "KV blocks no live request holds (evictable prefix-cache blocks included), every "
            "worker group together: what admission can still take.",
            st.num_free_kv_blocks,
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
        pools = [g.scheduler.block_manager for g in self.engine.groups if g.scheduler]
        yield gauge(
            "prefix_cache_blocks",
            "Distinct full KV blocks in the prefix cache (owned or evictable), every worker "
            "group together: what the KV events publish.",
            len(set().union(*(bm.cached_hashes for bm in pools))),
        )
        yield counter("num_preemptions", "Sequences preempted (recomputed later).", preemptions)
        spec = st.spec_decode
        yield counter(
            "spec_decode_num_drafts",
            "Decode steps of a sequence with proposed tokens (speculative decoding).",
            spec.num_drafts,
        )
        yield counter(
            "spec_decode_num_draft_tokens", "Tokens proposed (speculative decoding).",
            spec.num_draft_tokens,
        )  # fmt: skip
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Proposed tokens accepted: equal to what the target model sampled.",
            spec.num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by their place in the proposal (0: the first).",
            labels=["model_name", "position"],
        )
        for pos, n in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([model, str(pos)], n)
        yield per_pos
        yield counter(
            "kv_transfers",
            "Sequences whose prompt KV blocks moved from a prefill to a decode worker.",
            self.engine.num_kv_transfers,
        )
        yield counter(
            "kv_transfer_bytes",
            "Bytes of KV blocks copied from prefill to decode workers (all ranks).",
            self.engine.kv_transfer_bytes,
        )
