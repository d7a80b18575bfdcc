"""Routers are independent: one that dies takes no other router's streams with it."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from sluiceway.client import Client, wait_until_serving
from tests.integration.conftest import free_port, wait_for_free_blocks
from tests.integration.test_observability import Standalone

pytestmark = pytest.mark.slow


def test_a_dead_router_leaves_the_other_routers_streams_alone(tmp_path: Path) -> None:
    s = Standalone(tmp_path, f"127.0.0.1:{free_port()}")
    targets = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    try:
        s.start_scheduler()
        s.start_worker()
        routers = []
        for t in targets:
            routers.append(s.start_router(int(t.rsplit(":", 1)[1])))
            s.processes[f"router-{t}"] = routers[-1]  # keep both (start() files them as router)
        for t in targets:
            wait_until_serving(t, 300)
        request = Client.request("Count to one hundred:", temperature=0, max_tokens=60,
                                 ignore_eos=True)  # fmt: skip
        streaming = threading.Barrier(3)
        outcome: dict[str, object] = {}

        def stream(target: str) -> None:
            try:
                with Client(target) as client:
                    n = 0
                    for k, r in enumerate(client.stub.Generate(request, timeout=300)):
                        if k == 0:
                            streaming.wait(timeout=120)
                        n += len(r.token_ids)
                    outcome[target] = n
            except grpc.RpcError as e:
                outcome[target] = e.code()

        threads = [threading.Thread(target=stream, args=(t,)) for t in targets]
        for t in threads:
            t.start()
        streaming.wait(timeout=120)
        routers[0].proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        assert outcome[targets[0]] == grpc.StatusCode.UNAVAILABLE
        assert outcome[targets[1]] == 60
        with Client(targets[1]) as client:  # the dead router's sequence was aborted
            info = wait_for_free_blocks(client, timeout_s=10)
            assert info.num_free_kv_blocks == info.num_kv_blocks
        deadline = time.monotonic() + 10
        while not any(
            line["event"] == "request_aborted" for line in s.processes["scheduler"].log_lines()
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        s.stop()
