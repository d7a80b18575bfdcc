"""The scheduler's gauges and counters read the live scheduler state at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from scheduler.metrics import SchedulerCollector
from tests.scheduler.test_scheduler import make_scheduler, make_seq, run_step


def test_collector_reports_queues_blocks_and_counters() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=2)
    for i, prompt_len in enumerate((20, 33, 5)):  # 2 + 3 blocks running; the third waits
        sched.add(make_seq(i + 1, prompt_len))
    run_step(sched)
    engine = SimpleNamespace(scheduler=sched, worker=SimpleNamespace(model_id="m"))
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(engine))  # type: ignore[arg-type]

    def value(name: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("sluiceway:num_requests_running") == 2
    assert value("sluiceway:num_requests_waiting") == 1
    assert value("sluiceway:kv_cache_usage_perc") == 5 / 10
    # 20 + 33 prompt tokens and the 2 sampled ones stored in 5 blocks of 16 slots
    assert value("sluiceway:kv_cache_utilization") == sched.kv_usage.utilization
    assert value("sluiceway:prefix_cache_queries_total") == sched.block_manager.prefix_cache_queries
    assert value("sluiceway:prefix_cache_hits_total") == 0
    assert value("sluiceway:num_preemptions_total") == 0


def test_collector_before_a_worker_registers_reports_zeros() -> None:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(SimpleNamespace(scheduler=None, worker=None)))  # type: ignore[arg-type]
    assert registry.get_sample_value("sluiceway:num_requests_running", {"model_name": ""}) == 0
    assert registry.get_sample_value("sluiceway:kv_cache_usage_perc", {"model_name": ""}) == 0
