"""The scheduler's gauges and counters read the live scheduler state at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.engine import Engine
from sluiceway.scheduler.metrics import SchedulerCollector
from sluiceway.scheduler.scheduler import Scheduler
from sluiceway.scheduler.worker_group import WorkerInfo
from tests.scheduler.test_scheduler import make_scheduler, make_seq, run_step


def engine_with(config: SchedulerConfig, *schedulers: Scheduler) -> Engine:
    """An engine whose groups hold `schedulers`, as if their workers had registered."""
    engine = Engine(config)
    for group, sched in zip(engine.groups, schedulers, strict=True):
        group.scheduler = sched
        group.ranks[0] = WorkerInfo("", 0, "m", sched.block_manager.num_blocks, 16, 4096, 100)
    return engine


def test_collector_reports_queues_blocks_and_counters() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=2)
    for i, prompt_len in enumerate((20, 33, 5)):  # 2 + 3 blocks running; the third waits
        sched.add(make_seq(i + 1, prompt_len))
    run_step(sched)
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(engine_with(SchedulerConfig(), sched)))

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("sluiceway:num_requests_running") == 2
    assert value("sluiceway:num_requests_waiting") == 1
    assert value("sluiceway:kv_cache_usage_perc") == 5 / 10
    assert value("sluiceway:num_kv_blocks") == 10
    assert value("sluiceway:num_free_kv_blocks") == 5
    # 20 + 33 prompt tokens and the 2 sampled ones stored in 5 blocks of 16 slots
    assert value("sluiceway:kv_cache_utilization") == sched.kv_usage.utilization
    assert value("sluiceway:prefix_cache_queries_total") == sched.block_manager.prefix_cache_queries
    assert value("sluiceway:prefix_cache_hits_total") == 0
    assert value("sluiceway:num_preemptions_total") == 0


def test_collector_before_a_worker_registers_reports_zeros() -> None:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(Engine(SchedulerConfig())))
    assert registry.get_sample_value("sluiceway:num_requests_running", {"model_name": ""}) == 0
    assert registry.get_sample_value("sluiceway:kv_cache_usage_perc", {"model_name": ""}) == 0


def test_collector_sums_the_groups_of_a_disaggregated_scheduler() -> None:
    prefill = make_scheduler(num_blocks=10)
    decode = make_scheduler(num_blocks=30)
    prefill.add(make_seq(1, 40))  # 3 blocks
    decode.add(make_seq(2, 17))  # 2 blocks
    decode.add(make_seq(3, 1))  # 1 block
    run_step(prefill)
    run_step(decode)
    config = SchedulerConfig(num_prefill_workers=1, num_decode_workers=1)
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(engine_with(config, prefill, decode)))

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("sluiceway:num_requests_running") == 3
    assert value("sluiceway:kv_cache_usage_perc") == 6 / 40
    assert (value("sluiceway:num_kv_blocks"), value("sluiceway:num_free_kv_blocks")) == (40, 34)
    assert value("sluiceway:kv_transfers_total") == 0


def test_init_series_exports_the_step_histograms_and_requests_at_zero() -> None:
    from prometheus_client import REGISTRY

    from sluiceway.scheduler.metrics import init_series

    labels = {"model_name": "unit-scheduler-init"}
    assert REGISTRY.get_sample_value("sluiceway:scheduler_requests_total", labels) is None
    init_series("unit-scheduler-init")
    for name in ("scheduler_requests_total", "scheduler_step_seconds_count",
                 "model_step_seconds_count", "batch_size_count", "batched_tokens_count"):  # fmt: skip
        assert REGISTRY.get_sample_value(f"sluiceway:{name}", labels) == 0.0, name
