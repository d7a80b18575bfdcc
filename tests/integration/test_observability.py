"""Metrics, logs, health and drain of the three processes, each started on its own."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import urlopen

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from prometheus_client.parser import text_string_to_metric_families

from sluiceway.client import Client, wait_until_serving
from sluiceway.kernels import cpu_ops
from sluiceway.router.metrics import FAILURE_CODES, PROTOCOLS
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "sluiceway-dashboard.json"


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int

    def log_lines(self) -> list[dict[str, object]]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
        return lines


@dataclass
class Standalone:
    """A scheduler, a worker and a router, each its own `sluiceway <process>`."""

    tmp: Path
    scheduler_address: str
    processes: dict[str, Process] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> Process:
        port = free_port()
        log_path = self.tmp / f"{name}-{len(self.processes)}.log"
        cmd = [sys.executable, "-m", "sluiceway.cli", name, "--metrics-port", str(port),
               "--log-format", "json", *args]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.processes[name] = Process(name, proc, log_path, port)
        return self.processes[name]

    def start_scheduler(self) -> Process:
        return self.start("scheduler", "--listen", self.scheduler_address)

    def start_worker(self) -> Process:
        return self.start(
            "worker", "--scheduler", self.scheduler_address, "--dtype", "float32",
            "--kv-cache-memory", "256MiB",
        )  # fmt: skip

    def start_router(self, port: int, *args: str) -> Process:
        return self.start(
            "router", "--port", str(port), "--scheduler", self.scheduler_address,
            "--http-port", "0", *args,
        )  # fmt: skip

    def stop(self) -> None:
        for p in self.processes.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.processes.values():
            try:
                p.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.proc.kill()


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


def wait_for_status(target: str, status: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while health_status(target) != status:
        assert time.monotonic() < deadline, f"{target} never reached health status {status}"
        time.sleep(0.1)


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of http://127.0.0.1:port/metrics: sample name -> [(labels, value)].

    A declared metric without samples yet (a labelled counter nothing has incremented)
    appears with no samples, under each name a query may use (`_total`, `_bucket`, ...).
    """
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            samples.setdefault(family.name + suffix, [])
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Standalone, str]]:
    s = Standalone(tmp_path_factory.mktemp("standalone"), f"127.0.0.1:{free_port()}")
    router_port = free_port()
    target = f"127.0.0.1:{router_port}"
    try:
        s.start_scheduler()
        s.start_worker()
        s.start_router(router_port, "--drain-timeout", "120")
        wait_until_serving(target, 300)
        yield s, target
    finally:
        s.stop()


def test_right_after_start_every_label_set_is_exported_at_zero(
    stack: tuple[Standalone, str],
) -> None:
    """Runs first in this module: before any request. Every series carries model_name."""
    s, target = stack
    with Client(target) as client:
        model = client.stub.GetModelInfo(inference_pb2.GetModelInfoRequest()).model_id
    router = scrape(s.processes["router"].metrics_port)
    scheduler = scrape(s.processes["scheduler"].metrics_port)
    worker = scrape(s.processes["worker"].metrics_port)

    failures = router["sluiceway:request_failure_total"]
    assert sorted((lab["code"], lab["protocol"]) for lab, _ in failures) == sorted(
        (code, protocol) for code in FAILURE_CODES for protocol in PROTOCOLS
    )
    assert {(lab["model_name"], v) for lab, v in failures} == {(model, 0.0)}
    successes = router["sluiceway:request_success_total"]
    assert sorted((lab["finished_reason"], lab["protocol"], v) for lab, v in successes) == [
        (reason, protocol, 0.0)
        for reason in ("abort", "length", "stop")
        for protocol in ("grpc", "http")
    ]
    assert router["sluiceway:router_scheduler_ready"] == [
        ({"model_name": model, "scheduler": s.scheduler_address}, 1.0)
    ]
    for name in ("e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                 "prompt_tokens_total"):  # fmt: skip
        assert router[f"sluiceway:{name}"] == [({"model_name": model}, 0.0)], name
    for name in ("scheduler_requests_total", "batch_size_count", "model_step_seconds_count"):
        assert scheduler[f"sluiceway:{name}"] == [({"model_name": model}, 0.0)], name
    assert sorted((lab["phase"], v) for lab, v in worker["sluiceway:forward_seconds_count"]) == [
        ("decode", 0.0),
        ("prefill", 0.0),
    ]
    for process in (router, scheduler, worker):
        unlabelled = [
            name
            for name, samples in process.items()
            if name.startswith("sluiceway:")
            for lab, _ in samples
            if lab.get("model_name") != model
        ]
        assert unlabelled == []


def test_metrics_ports_answer_only_metrics_path(stack: tuple[Standalone, str]) -> None:
    s, _ = stack
    for p in s.processes.values():
        base = f"http://127.0.0.1:{p.metrics_port}"
        with pytest.raises(HTTPError) as err:
            urlopen(f"{base}/foo", timeout=5)
        assert err.value.code == 404, p.name
        index = urlopen(f"{base}/", timeout=5).read()
        assert index == b"sluiceway metrics: GET /metrics\n", p.name


def test_router_reflection_v1_and_v1alpha_list_the_same_services(
    stack: tuple[Standalone, str],
) -> None:
    _, target = stack
    listed = {}
    with grpc.insecure_channel(target) as channel:
        for version in ("v1", "v1alpha"):
            call = channel.stream_stream(
                f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            (reply,) = call(iter([request]), timeout=10)
            listed[version] = sorted(x.name for x in reply.list_services_response.service)
    assert (
        listed["v1"]
        == listed["v1alpha"]
        == [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "sluiceway.v1.Inference",
        ]
    )


def test_metrics_of_the_three_processes_add_up(stack: tuple[Standalone, str]) -> None:
    s, target = stack
    prompts = ["The capital of France is", "One, two, three,", "def fib(n):", "Hello"]
    requests = [
        Client.request(p, temperature=0, max_tokens=6 + i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    with Client(target) as client, ThreadPoolExecutor(4) as pool:
        before = client.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        finals = list(pool.map(lambda r: list(client.stub.Generate(r, timeout=120))[-1], requests))
        info = client.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    router = scrape(s.processes["router"].metrics_port)
    scheduler = scrape(s.processes["scheduler"].metrics_port)
    worker = scrape(s.processes["worker"].metrics_port)
    model = info.model_id

    n = len(requests)
    assert total(router, "sluiceway:request_success_total", finished_reason="length") == n
    assert total(router, "sluiceway:request_failure_total") == 0
    assert total(router, "sluiceway:prompt_tokens_total", model_name=model) == sum(
        f.usage.prompt_tokens for f in finals
    )
    assert (
        total(router, "sluiceway:generation_tokens_total")
        == sum(f.usage.completion_tokens for f in finals)
        == 6 + 7 + 8 + 9
    )
    for name in ("time_to_first_token", "e2e_request_latency", "time_per_output_token",
                 "request_queue_time"):  # fmt: skip
        assert total(router, f"sluiceway:{name}_seconds_count") == n, name
    # one gap per token after the first of each request
    assert total(router, "sluiceway:inter_token_latency_seconds_count") == (6 + 7 + 8 + 9) - n

    assert total(scheduler, "sluiceway:num_requests_running", model_name=model) == 0
    assert total(scheduler, "sluiceway:num_requests_waiting") == 0
    assert total(scheduler, "sluiceway:kv_cache_usage_perc") == 0.0  # cached blocks are free
    assert total(scheduler, "sluiceway:num_kv_blocks") == info.num_kv_blocks > 0
    assert total(scheduler, "sluiceway:num_free_kv_blocks") == info.num_kv_blocks
    assert total(scheduler, "sluiceway:prefix_cache_queries_total") == (
        info.prefix_cache_queries_total
    )
    assert total(scheduler, "sluiceway:prefix_cache_hits_total") == info.prefix_cache_hits_total
    assert total(scheduler, "sluiceway:num_preemptions_total") == 0
    # Steps that computed something; the step loop may also send steps that only tell the
    # worker to forget finished sequences (counted in num_steps_total, not in histograms).
    steps = total(scheduler, "sluiceway:batch_size_count")
    assert 9 <= steps <= info.step_times.num_steps_total - before.step_times.num_steps_total
    for name in ("scheduler_step_seconds", "model_step_seconds", "batched_tokens"):
        assert total(scheduler, f"sluiceway:{name}_count") == steps, name
    assert total(scheduler, "sluiceway:batch_size_sum") == sequence_steps(finals)
    # Each prompt token computed once (prompts under one block: nothing cached to hit), then
    # each generated token but the last is computed by the decode step that samples the next.
    assert info.prefix_cache_hits_total == 0
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    assert total(scheduler, "sluiceway:batched_tokens_sum") == prompt_tokens + (6 + 7 + 8 + 9) - n

    assert total(worker, "sluiceway:kv_blocks_total", model_name=model) == info.num_kv_blocks
    assert total(worker, "sluiceway:forward_seconds_count") == steps
    assert total(worker, "sluiceway:forward_seconds_count", phase="prefill") >= 1
    assert total(worker, "sluiceway:device_memory_used_bytes", device="cpu") > 256 * 2**20
    # the embedded GGUF in its Q4_1/Q8_0 blocks where --quantization auto picks gguf (a CPU
    # with AVX512-BF16), against its dequantized weights in bfloat16 (+ the logits' copy)
    bf16_weights = 134_515_008 * 2 + 49_152 * 576 * 2
    if cpu_ops.bf16_gemm_supported():
        assert total(worker, "sluiceway:model_weight_bytes", quantization="gguf") <= (
            0.4 * bf16_weights
        )
    else:
        assert total(worker, "sluiceway:model_weight_bytes", quantization="none") > bf16_weights


def sequence_steps(finals: list[inference_pb2.GenerateResponse]) -> int:
    """Sequences summed over steps: each request is in one step per generated token (its
    prompt fits one step, its first token comes from it, then one decode step per token)."""
    return sum(f.usage.completion_tokens for f in finals)


def test_dashboard_queries_only_exported_metrics(stack: tuple[Standalone, str]) -> None:
    s, _ = stack
    exported: set[str] = set()
    for p in s.processes.values():
        exported |= set(scrape(p.metrics_port))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 16
    named = {m for e in exprs for m in re.findall(r"sluiceway:[a-z0-9_]+", e)}
    assert named, "no sluiceway metric in the dashboard"
    assert named <= exported, f"not exported: {sorted(named - exported)}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("request rate", "time to first token", "e2e", "running", "kv cache",
                  "prefix-cache", "scheduling step", "preemptions"):  # fmt: skip
        assert topic in titles, topic


def test_request_id_in_the_logs_of_all_three_processes(stack: tuple[Standalone, str]) -> None:
    s, target = stack
    request = Client.request("Tell me a joke.", temperature=0, max_tokens=4, ignore_eos=True)
    request.request_id = "trace-me-0123456789"
    with Client(target) as client:
        list(client.stub.Generate(request, timeout=60))
    deadline = time.monotonic() + 10
    while True:
        seen = {
            name
            for name, p in s.processes.items()
            if any(line.get("request_id") == request.request_id for line in p.log_lines())
        }
        if seen == {"router", "scheduler", "worker"} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == {"router", "scheduler", "worker"}
    summary = [
        line for line in s.processes["router"].log_lines()
        if line.get("request_id") == request.request_id and line["event"] == "request_finished"
    ]  # fmt: skip
    assert len(summary) == 1
    assert summary[0]["prompt_tokens"] > 0 and summary[0]["completion_tokens"] == 4
    assert summary[0]["finish_reason"] == "length"
    assert 0 < summary[0]["ttft_s"] <= summary[0]["e2e_s"]
    assert summary[0]["process"] == "router" and summary[0]["level"] == "info"


def test_router_health_follows_its_scheduler(tmp_path: Path) -> None:
    s = Standalone(tmp_path, f"127.0.0.1:{free_port()}")
    target = f"127.0.0.1:{free_port()}"
    try:
        router = s.start_router(int(target.rsplit(":", 1)[1]))
        deadline = time.monotonic() + 120
        while True:  # the router answers health checks long before it has a scheduler
            try:
                status = health_status(target)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline and router.proc.poll() is None
                time.sleep(0.2)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        scheduler = s.start_scheduler()
        time.sleep(2)  # a scheduler without a worker is not ready either
        assert health_status(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        worker = s.start_worker()
        wait_for_status(target, health_pb2.HealthCheckResponse.SERVING, 300)
        scheduler.proc.send_signal(signal.SIGKILL)
        wait_for_status(target, health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        assert scheduler.proc.wait(timeout=10) == -signal.SIGKILL

        # A new scheduler on the same address (a container or pod restart): the worker,
        # still running, registers with it again and the replica serves without a restart.
        s.start_scheduler()  # replaces s.processes["scheduler"]; the old one was reaped above
        wait_for_status(target, health_pb2.HealthCheckResponse.SERVING, 60)
        assert s.processes["worker"] is worker and worker.proc.poll() is None
        request = Client.request("The capital of France is", temperature=0, max_tokens=8,
                                 ignore_eos=True)  # fmt: skip
        with Client(target) as client:
            tokens = sum(len(r.token_ids) for r in client.stub.Generate(request, timeout=60))
        assert tokens == 8
        events = [line["event"] for line in worker.log_lines()]
        assert events.count("worker_reregistered") == 1, events
        assert "scheduler_lost" in events
    finally:
        s.stop()


def test_deadline_ends_the_request_frees_its_blocks_and_counts_it(
    stack: tuple[Standalone, str],
) -> None:
    s, target = stack
    request = Client.request("Count to a thousand:", temperature=0, max_tokens=1000,
                             ignore_eos=True)  # fmt: skip
    with Client(target) as client:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(request, timeout=1.5))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ended = time.monotonic()
        while True:  # freed within a step or two (a decode step alone takes ~0.1 s here)
            info = client.stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
            if info.num_free_kv_blocks == info.num_kv_blocks:
                break
            assert time.monotonic() - ended < 2.0, "blocks still held 2 s after the deadline"
            time.sleep(0.02)
    deadline = time.monotonic() + 5
    while True:
        router = scrape(s.processes["router"].metrics_port)
        if total(router, "sluiceway:request_failure_total", code="DEADLINE_EXCEEDED") == 1:
            break
        assert time.monotonic() < deadline, router.get("sluiceway:request_failure_total")
        time.sleep(0.1)
    scheduler_lines = s.processes["scheduler"].log_lines()
    assert any(line["event"] == "request_aborted" for line in scheduler_lines)


def test_sigterm_drains_the_router(stack: tuple[Standalone, str]) -> None:
    """Runs last in this module: it stops the module's router."""
    s, target = stack
    router = s.processes["router"]
    requests = [
        Client.request(f"Count to {i + 10}:", temperature=0, max_tokens=40, ignore_eos=True)
        for i in range(4)
    ]
    first_tokens = threading.Barrier(5)
    results: list[tuple[int, int] | Exception] = [ValueError("not run")] * 4

    def stream(i: int) -> None:
        try:
            with Client(target) as client:
                tokens, finish = 0, 0
                for k, response in enumerate(client.stub.Generate(requests[i], timeout=300)):
                    if k == 0:
                        first_tokens.wait(timeout=120)
                    tokens += len(response.token_ids)
                    finish = response.finish_reason
                results[i] = (tokens, finish)
        except Exception as e:  # reported by the assertion on results below
            results[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    first_tokens.wait(timeout=120)  # all 4 streams are in flight
    router.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with Client(target) as client, pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(Client.request("Hi", max_tokens=2), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    for t in threads:
        t.join(timeout=300)
    assert results == [(40, inference_pb2.FINISH_REASON_LENGTH)] * 4
    assert router.proc.wait(timeout=60) == 0
    assert any(line["event"] == "router_draining" for line in router.log_lines())
