"""A dying worker, a worker without its scheduler, and more requests than the scheduler
lets wait."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from sluiceway.client import Client
from tests.integration.conftest import (
    free_port,
    start_stack,
    stop_stack,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow


def test_killed_worker_ends_streams_with_unavailable_and_serve_restarts_it() -> None:
    stack = start_stack()
    try:
        requests = [
            Client.request(f"Count from {i} to 500:", temperature=0, max_tokens=300,
                           ignore_eos=True)
            for i in range(4)
        ]  # fmt: skip
        streaming = threading.Barrier(5)
        outcomes: list[tuple[grpc.StatusCode | None, float]] = [(None, 0.0)] * 4

        def stream(i: int) -> None:
            with stack.client() as client:
                try:
                    for k, _ in enumerate(client.stub.Generate(requests[i], timeout=300)):
                        if k == 0:
                            streaming.wait(timeout=120)
                    outcomes[i] = (grpc.StatusCode.OK, time.monotonic())
                except grpc.RpcError as e:
                    outcomes[i] = (e.code(), time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        streaming.wait(timeout=120)  # every stream has its first token
        killed_at = time.monotonic()
        os.kill(stack.pids["worker"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        assert [code for code, _ in outcomes] == [grpc.StatusCode.UNAVAILABLE] * 4
        assert max(at for _, at in outcomes) - killed_at < 2.0

        # serve starts a new worker; it registers and the stack serves again
        deadline = time.monotonic() + 180
        with stack.client() as client:
            while True:
                try:
                    tokens = client.generate(
                        Client.request("The capital of France is", temperature=0, max_tokens=4),
                        timeout=60,
                    )[1]
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                    assert time.monotonic() < deadline, "the stack never served again"
                    time.sleep(0.5)
            assert len(tokens) == 4
            info = wait_for_free_blocks(client)
            assert info.num_free_kv_blocks == info.num_kv_blocks
        assert any("worker restarted (pid" in line for line in stack.log)
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def test_requests_beyond_max_waiting_requests_get_resource_exhausted() -> None:
    stack = start_stack("--max-num-seqs", "1", "--max-waiting-requests", "1")
    try:
        request = Client.request("Tell me a story.", temperature=0, max_tokens=8, ignore_eos=True)

        def send(_: int) -> tuple[grpc.StatusCode, str]:
            with stack.client() as client:
                try:
                    final = list(client.stub.Generate(request, timeout=120))[-1]
                    assert final.usage.completion_tokens == 8
                    return grpc.StatusCode.OK, ""
                except grpc.RpcError as e:
                    return e.code(), e.details() or ""

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(send, range(6)))
        codes = [code for code, _ in results]
        # one runs, one waits, the others are turned away at once
        assert codes.count(grpc.StatusCode.OK) in (1, 2)
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6 - codes.count(
            grpc.StatusCode.OK
        )
        assert all(
            "--max-waiting-requests 1" in details
            for code, details in results
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        with stack.client() as client:  # and it keeps serving
            assert len(client.generate(request, timeout=120)[1]) == 8
            info = wait_for_free_blocks(client)
            assert info.num_free_kv_blocks == info.num_kv_blocks
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def test_worker_without_a_scheduler_exits_1_with_a_clear_error() -> None:
    # The first registration's wait (60 s) shortened to 2 s, in the real entry point.
    script = (
        "import sys, sluiceway.worker.server as w; w.FIRST_REGISTRATION_TIMEOUT_S = 2.0; "
        "from sluiceway.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    address = f"127.0.0.1:{free_port()}"
    result = subprocess.run(
        [sys.executable, "-c", script, "worker", "--scheduler", address,
         "--kv-cache-memory", "64MiB", "--metrics-port", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"sluiceway: the scheduler at {address} did not accept the registration within 2 s "
        "(DEADLINE_EXCEEDED"
    ), result.stderr
    assert "Traceback" not in result.stderr


def test_a_hung_worker_takes_its_replica_out_until_it_answers_again() -> None:
    from sluiceway.scheduler.faults import IDLE_PROBE_INTERVAL_S, STEP_TIMEOUT_FLOOR_S
    from tests.integration.conftest import metric_sum, metrics_urls

    stack = start_stack("--num-replicas", "2")
    urls = metrics_urls(stack.log)
    ready = lambda: metric_sum(urls["router"], "sluiceway:router_scheduler_ready")  # noqa: E731
    served = lambda name: metric_sum(urls[name], "sluiceway:prefix_cache_queries_total")  # noqa: E731
    stopped = False
    try:
        deadline = time.monotonic() + 60
        while ready() != 2:
            assert time.monotonic() < deadline, "the router never saw both replicas ready"
            time.sleep(0.2)
        os.kill(stack.pids["worker-r0"], signal.SIGSTOP)
        stopped = True
        stopped_at = time.monotonic()
        # idle: the probe's answer is due within the floor; the router polls every 0.5 s
        bound_s = IDLE_PROBE_INTERVAL_S + STEP_TIMEOUT_FLOOR_S + 0.5 + 1.0
        while ready() != 1:
            assert time.monotonic() - stopped_at < bound_s, "the hung replica stayed in rotation"
            time.sleep(0.1)
        before = served("scheduler-0")
        request = Client.request("Say hi.", temperature=0, max_tokens=4, ignore_eos=True)
        with stack.client() as client, ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda _: len(client.generate(request, timeout=60)[1]),
                                    range(6)))  # fmt: skip
        assert results == [4] * 6
        assert served("scheduler-0") == before  # every one went to the other replica
        os.kill(stack.pids["worker-r0"], signal.SIGCONT)
        stopped = False
        deadline = time.monotonic() + 2 * STEP_TIMEOUT_FLOOR_S
        while ready() != 2:
            assert time.monotonic() < deadline, "the replica never rejoined"
            time.sleep(0.1)
        assert any("worker_answers_again" in line for line in stack.log)
        with stack.client() as client, ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: len(client.generate(request, timeout=60)[1]),
                                    range(8)))  # fmt: skip
        assert results == [4] * 8
        assert served("scheduler-0") > before  # it serves again
        assert stopped_at > 0
    finally:
        if stopped:
            os.kill(stack.pids["worker-r0"], signal.SIGCONT)
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def test_a_crash_looping_replica_is_given_up_and_the_other_keeps_serving() -> None:
    """worker-r1 killed each time serve restarts it: after MAX_RESTARTS restarts (with
    backoff) serve gives up on replica 1 and says so; every stream completes (the router
    resumes one whose replica died on the other), and serve goes on serving."""
    from sluiceway.launcher import MAX_RESTARTS

    stack = start_stack("--num-replicas", "2")
    try:
        request = Client.request("Count from one to one hundred.", temperature=0,
                                 max_tokens=48, ignore_eos=True)  # fmt: skip
        with stack.client() as client:
            reference = client.generate(request, timeout=300)[1]
        results: list[list[int] | grpc.StatusCode] = []

        def stream() -> None:
            try:
                with stack.client() as client:
                    results.append(client.generate(request, timeout=300)[1])
            except grpc.RpcError as e:
                results.append(e.code())

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stream) for _ in range(6)]
            killed: set[int] = set()
            deadline = time.monotonic() + 120
            while not any("giving up on replica 1" in line for line in stack.log):
                assert time.monotonic() < deadline, "".join(stack.log[-20:])
                restarted = [
                    int(line.rsplit("pid ", 1)[1].split(")")[0])
                    for line in list(stack.log)
                    if "worker-r1 restarted (pid" in line
                ]
                current = (restarted or [stack.pids["worker-r1"]])[-1]
                if current not in killed:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(current, signal.SIGKILL)
                    killed.add(current)
                time.sleep(0.05)
            for f in futures:
                f.result()
        assert len(killed) == MAX_RESTARTS + 1
        assert results == [reference] * 6
        assert stack.process.poll() is None  # serve still runs
        with stack.client() as client:
            assert client.generate(request, timeout=300)[1] == reference
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def test_streams_on_a_worker_that_hangs_mid_step_go_on_on_the_other_replica() -> None:
    """SIGSTOP of the worker that runs the streams: the watchdog fails their step within its
    bound, and the router resumes each on the other replica with the tokens already sent: the
    streams end whole, with the tokens of an uninterrupted run."""
    from sluiceway.scheduler.faults import STEP_TIMEOUT_FLOOR_S
    from tests.integration.conftest import metric_sum, metrics_urls

    stack = start_stack("--num-replicas", "2")
    urls = metrics_urls(stack.log)
    stopped: int | None = None
    try:
        deadline = time.monotonic() + 60
        while metric_sum(urls["router"], "sluiceway:router_scheduler_ready") != 2:
            assert time.monotonic() < deadline, "the router never saw both replicas ready"
            time.sleep(0.2)
        request = Client.request("Count from one to one hundred.", temperature=0,
                                 max_tokens=64, ignore_eos=True)  # fmt: skip
        with stack.client() as client:
            reference = client.generate(request, timeout=300)[1]
        started = threading.Barrier(5)
        results: list[object] = []

        def stream() -> None:
            got: list[int] = []
            try:
                with stack.client() as client:
                    for k, response in enumerate(client.generate_stream(request, 300)):
                        got.extend(response.token_ids)
                        if k == 4:
                            started.wait(timeout=300)
                results.append(got)
            except grpc.RpcError as e:
                results.append(e.code())

        threads = [threading.Thread(target=stream) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait(timeout=300)
        running = {
            r: metric_sum(urls[f"scheduler-{r}"], "sluiceway:num_requests_running") for r in (0, 1)
        }
        busy = max(running, key=lambda r: running[r])
        stopped = stack.pids[f"worker-r{busy}"]
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        for t in threads:
            t.join(timeout=300)
        waited = time.monotonic() - stopped_at
        assert results == [reference] * 4
        resumed = [line for line in stack.log if "request_resumed" in line]
        assert len(resumed) == running[busy] >= 1
        # a decode step of a few sequences: the bound is the floor plus a fraction of a second
        assert waited < STEP_TIMEOUT_FLOOR_S + 30, waited
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
