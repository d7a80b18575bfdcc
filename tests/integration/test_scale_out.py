"""Scale-out on one machine: `sluiceway serve --num-replicas 2 --num-routers 2`. Requests
through both routers spread over both replicas; a router killed mid-run takes only its own
streams with it."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from sluiceway.client import Client
from tests.integration.conftest import metric_sum, metrics_urls, start_stack, stop_stack

pytestmark = pytest.mark.slow

NUM_REQUESTS = 40
MAX_TOKENS = 32


def test_two_routers_spread_requests_over_two_replicas_and_survive_a_dead_router() -> None:
    stack = start_stack("--num-replicas", "2", "--num-routers", "2")
    try:
        names = {"router-0", "router-1", "scheduler-0", "scheduler-1", "worker-r0", "worker-r1"}
        assert names == set(stack.pids)
        host, port = stack.target.rsplit(":", 1)
        targets = [stack.target, f"{host}:{int(port) + 1}"]
        urls = metrics_urls(stack.log)
        # A router serves once one replica is ready; it sees the other at its next poll.
        deadline = time.monotonic() + 60
        while not all(
            metric_sum(urls[r], "sluiceway:router_scheduler_ready") == 2
            for r in ("router-0", "router-1")
        ):
            assert time.monotonic() < deadline, "the routers never saw both replicas ready"
            time.sleep(0.2)
        outcome: dict[int, object] = {}
        started = threading.Semaphore(0)

        def stream(i: int) -> None:
            request = Client.request(
                f"Request {i}: list the numbers from one to fifty.",
                temperature=0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
            )
            try:
                with Client(targets[i % 2]) as client:
                    n = 0
                    for k, r in enumerate(client.stub.Generate(request, timeout=300)):
                        if k == 0:
                            started.release()
                        n += len(r.token_ids)
                    outcome[i] = n
            except grpc.RpcError as e:
                outcome[i] = e.code()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        for _ in range(4):  # streams are under way through both routers
            assert started.acquire(timeout=300)
        os.kill(stack.pids["router-1"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=600)
        through_survivor = [outcome[i] for i in range(0, NUM_REQUESTS, 2)]
        assert through_survivor == [MAX_TOKENS] * (NUM_REQUESTS // 2)
        through_dead = [outcome[i] for i in range(1, NUM_REQUESTS, 2)]
        assert all(o in (MAX_TOKENS, grpc.StatusCode.UNAVAILABLE) for o in through_dead)

        served = {
            name: metric_sum(urls[name], "sluiceway:prefix_cache_queries_total")
            for name in ("scheduler-0", "scheduler-1")
        }
        assert all(v > 0 for v in served.values()), served  # both replicas computed prompts
        ok = metric_sum(urls["router-0"], "sluiceway:request_success_total")
        assert ok == NUM_REQUESTS // 2
        with Client(targets[0]) as client:  # the router adds up both replicas' step loops
            assert client.model_info().step_times.num_step_loops == 2
        deadline = time.monotonic() + 30  # the killed router is restarted by serve
        while not any("router-1 restarted" in line for line in stack.log):
            assert time.monotonic() < deadline, "".join(stack.log[-20:])
            time.sleep(0.2)
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
