"""A stream whose replica dies mid-stream goes on on the other replica: resubmitted with the
tokens already sent, it gives the tokens of an uninterrupted run (bfloat16, deterministic
inference), greedy and seeded, with no lost and no repeated token."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from sluiceway.client import Client
from tests.integration.conftest import metric_sum, metrics_urls, start_stack, stop_stack

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about a lighthouse keeper and the ships she saw, one per paragraph."
REQUESTS = {
    "greedy": Client.request(PROMPT, temperature=0, max_tokens=96, ignore_eos=True),
    "seeded": Client.request(
        PROMPT,
        temperature=1.0,
        seed=11,
        top_p=0.9,
        max_tokens=96,
        ignore_eos=True,
        presence_penalty=0.5,
    ),
}


def test_streams_resume_on_the_other_replica_with_the_uninterrupted_tokens() -> None:
    stack = start_stack("--num-replicas", "2")
    try:
        urls = metrics_urls(stack.log)
        deadline = time.monotonic() + 60
        while metric_sum(urls["router"], "sluiceway:router_scheduler_ready") < 2:
            assert time.monotonic() < deadline, "the router never saw both replicas ready"
            time.sleep(0.2)
        with stack.client() as client:
            reference = {k: client.generate(r, timeout=300)[1] for k, r in REQUESTS.items()}
        got: dict[str, list[int]] = {k: [] for k in REQUESTS}
        started = threading.Barrier(len(REQUESTS) + 1)

        def stream(kind: str) -> None:
            with stack.client() as client:
                for k, response in enumerate(client.generate_stream(REQUESTS[kind], 300)):
                    got[kind].extend(response.token_ids)
                    if k == 8:
                        started.wait(timeout=300)

        threads = [threading.Thread(target=stream, args=(k,)) for k in REQUESTS]
        for t in threads:
            t.start()
        started.wait(timeout=300)  # both streams have 9 tokens or more
        running = {
            r: metric_sum(urls[f"scheduler-{r}"], "sluiceway:num_requests_running") for r in (0, 1)
        }
        busy = max(running, key=lambda r: running[r])
        assert running[busy] >= 1, running
        os.kill(stack.pids[f"worker-r{busy}"], signal.SIGKILL)
        for t in threads:
            t.join(timeout=300)
        assert got == reference  # whole, in order, nothing lost or repeated
        resumed = [line for line in stack.log if "request_resumed" in line]
        assert len(resumed) == running[busy], resumed
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
