"""Request latencies as vLLM defines them, recorded on synthetic timestamps."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from sluiceway.router.metrics import RequestRecorder


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_recorder_ttft_itl_tpot_e2e() -> None:
    model = "unit-recorder"
    r = RequestRecorder(model, arrival=100.0)
    r.on_queue_time(0.125)
    for now in (100.5, 100.7, 101.0):  # TTFT 0.5 s, gaps 0.2 and 0.3 s
        r.on_tokens(1, now)
    r.on_success("length", prompt_tokens=11)
    assert (r.ttft, r.e2e, r.num_generated) == (0.5, 1.0, 3)
    assert sample("sluiceway:time_to_first_token_seconds_sum", model_name=model) == 0.5
    assert sample("sluiceway:inter_token_latency_seconds_count", model_name=model) == 2
    assert sample("sluiceway:inter_token_latency_seconds_sum", model_name=model) == pytest.approx(
        0.5
    )
    # TPOT = (E2E - TTFT) / (tokens - 1) = 0.5 / 2
    assert sample("sluiceway:time_per_output_token_seconds_sum", model_name=model) == 0.25
    assert sample("sluiceway:e2e_request_latency_seconds_sum", model_name=model) == 1.0
    assert sample("sluiceway:request_queue_time_seconds_sum", model_name=model) == 0.125
    assert sample("sluiceway:prompt_tokens_total", model_name=model) == 11
    assert sample("sluiceway:generation_tokens_total", model_name=model) == 3
    assert (
        sample(
            "sluiceway:request_success_total",
            model_name=model,
            finished_reason="length",
            protocol="grpc",
        )
        == 1
    )
    # TTFT of 0.5 s falls in the 0.5 bucket (le is inclusive), not the 0.25 one
    assert sample("sluiceway:time_to_first_token_seconds_bucket", model_name=model, le="0.25") == 0
    assert sample("sluiceway:time_to_first_token_seconds_bucket", model_name=model, le="0.5") == 1


def test_recorder_single_token_has_no_tpot_and_failures_count_by_code() -> None:
    model = "unit-recorder-2"
    r = RequestRecorder(model, arrival=0.0)
    r.on_tokens(1, 0.25)
    r.on_success("stop", prompt_tokens=4)
    assert sample("sluiceway:time_per_output_token_seconds_count", model_name=model) == 0
    assert sample("sluiceway:e2e_request_latency_seconds_sum", model_name=model) == 0.25
    RequestRecorder(model, arrival=0.0).on_failure("INVALID_ARGUMENT")
    assert (
        sample(
            "sluiceway:request_failure_total",
            model_name=model,
            code="INVALID_ARGUMENT",
            protocol="grpc",
        )
        == 1
    )


def test_init_series_exports_every_label_set_at_zero() -> None:
    from sluiceway.router.metrics import FAILURE_CODES, FINISHED_REASONS, PROTOCOLS, init_series

    model = "unit-init-series"
    assert sample("sluiceway:request_failure_total", model_name=model) == 0.0  # not yet
    assert REGISTRY.get_sample_value(
        "sluiceway:request_failure_total",
        {"model_name": model, "code": "CANCELLED", "protocol": "grpc"},
    ) is None  # fmt: skip
    init_series(model)
    assert PROTOCOLS == ("grpc", "http")
    assert sorted(FINISHED_REASONS.values()) == ["abort", "length", "stop"]
    assert len(FAILURE_CODES) == 16 and "OK" not in FAILURE_CODES
    failures = successes = 0
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.labels.get("model_name") != model:
                continue
            if s.name == "sluiceway:request_failure_total":
                assert s.value == 0.0 and s.labels["code"] in FAILURE_CODES
                failures += 1
            elif s.name == "sluiceway:request_success_total":
                assert s.value == 0.0
                successes += 1
    assert (failures, successes) == (16 * 2, 3 * 2)
    for protocol in PROTOCOLS:
        labels = {"model_name": model, "protocol": protocol}
        for reason in ("stop", "length", "abort"):
            success = {**labels, "finished_reason": reason}
            assert REGISTRY.get_sample_value("sluiceway:request_success_total", success) == 0.0
        for code in ("CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "UNAVAILABLE"):
            failure = {**labels, "code": code}
            assert REGISTRY.get_sample_value("sluiceway:request_failure_total", failure) == 0.0
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "inter_token_latency_seconds_count",
                 "time_per_output_token_seconds_count"):  # fmt: skip
        assert REGISTRY.get_sample_value(f"sluiceway:{name}", {"model_name": model}) == 0.0, name


def test_e2e_and_queue_time_buckets_resolve_milliseconds() -> None:
    model = "unit-ms-buckets"
    r = RequestRecorder(model, arrival=0.0)
    r.on_queue_time(0.0004)  # 0.4 ms in the queue
    r.on_tokens(1, 0.002)
    r.on_success("stop", prompt_tokens=1)  # E2E 2 ms

    def bucket(name: str, le: str) -> float:
        return sample(f"sluiceway:{name}_seconds_bucket", model_name=model, le=le)

    assert [bucket("request_queue_time", le) for le in ("0.001", "0.0025", "0.05")] == [1, 1, 1]
    assert [bucket("e2e_request_latency", le) for le in ("0.001", "0.0025", "0.05")] == [0, 1, 1]
