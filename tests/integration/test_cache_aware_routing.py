"""Cache-aware routing over `sluiceway serve --num-replicas 2 --num-routers 2`: distinct chat
requests spread over both replicas, a conversation's turns all land on one even when they
alternate between the routers (each router keeps its own index of every replica), and a
restarted replica's entries in both indexes are rebuilt from its KV events."""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from sluiceway.client import Client
from tests.integration.conftest import metric_sum, metrics_urls, start_stack, stop_stack

pytestmark = pytest.mark.slow

TOPICS = [
    "volcanoes", "glaciers", "comets", "bees", "tides", "deserts", "coral reefs", "bridges",
    "lighthouses", "violins", "chess openings", "sourdough", "rainbows", "owls", "canals",
    "windmills", "tea ceremonies", "submarines", "origami", "auroras",
]  # fmt: skip
ROUTERS = ("router-0", "router-1")
TURNS = ["Tell me about the river Nile.", "Which countries?", "How long is it?", "And why?"]


def requests_per_replica(urls: dict[str, str]) -> dict[str, float]:
    return {
        name: metric_sum(urls[name], "sluiceway:scheduler_requests_total")
        for name in ("scheduler-0", "scheduler-1")
    }


def wait_until(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def metrics_answer(url: str) -> bool:
    """Whether the /metrics endpoint at `url` answers."""
    try:
        metric_sum(url, "sluiceway:prefix_cache_blocks")
    except OSError:  # URLError: not listening yet
        return False
    return True


def index_matches_schedulers(urls: dict[str, str]) -> bool:
    """Each router's index holds, per replica, as many blocks as that scheduler caches."""
    cached = sorted(
        metric_sum(urls[f"scheduler-{r}"], "sluiceway:prefix_cache_blocks") for r in (0, 1)
    )
    for router in ROUTERS:
        with urllib.request.urlopen(urls[router], timeout=10) as response:
            rows = response.read().decode().splitlines()
        indexed = sorted(
            float(row.rsplit(" ", 1)[1])
            for row in rows
            if row.startswith("sluiceway:router_kv_index_blocks{")
        )
        if cached != indexed:
            return False
    return True


def routers_see_both_replicas(urls: dict[str, str]) -> bool:
    return all(metric_sum(urls[r], "sluiceway:router_scheduler_ready") == 2 for r in ROUTERS)


def test_chat_requests_spread_conversations_stick_and_the_index_survives_a_restart() -> None:
    stack = start_stack("--num-replicas", "2", "--num-routers", "2")
    try:
        host, port = stack.target.rsplit(":", 1)
        second_router = Client(f"{host}:{int(port) + 1}")
        urls = metrics_urls(stack.log)
        wait_until(
            lambda: routers_see_both_replicas(urls), 60, "a router never saw both replicas ready"
        )
        with stack.client() as client, second_router:
            before = requests_per_replica(urls)
            for topic in TOPICS:  # one after another: no load to tell the replicas apart
                message = f"{topic.capitalize()}: write two sentences about {topic}."
                client.generate(
                    Client.request(messages=[("user", message)], temperature=0, max_tokens=4),
                    timeout=120,
                )
            after = requests_per_replica(urls)
            spread = {k: after[k] - before[k] for k in after}
            assert sum(spread.values()) == len(TOPICS)
            assert min(spread.values()) >= 8, spread  # not all on one (main: 20 and 0)

            messages: list[tuple[str, str]] = []
            before = after
            for i, turn in enumerate(TURNS):  # router-0, router-1, router-0, ...
                messages.append(("user", turn))
                text, _, _ = (client, second_router)[i % 2].generate(
                    Client.request(messages=messages, temperature=0, max_tokens=24), timeout=120
                )
                messages.append(("assistant", text))
            after = requests_per_replica(urls)
            turns = sorted(after[k] - before[k] for k in after)
            assert turns == [0, len(TURNS)], turns
            wait_until(lambda: index_matches_schedulers(urls), 10, "index out of step")

        # a replica restarted: the router forgets its blocks and rebuilds them from its events
        os.kill(stack.pids["scheduler-1"], signal.SIGKILL)
        wait_until(
            lambda: any("scheduler-1 restarted" in line for line in stack.log),
            30,
            "scheduler-1 was not restarted",
        )
        wait_until(
            lambda: routers_see_both_replicas(urls), 120, "the restarted replica never came back"
        )
        urls = metrics_urls(stack.log)
        # its gRPC port answers (the routers see it ready) a moment before its metrics port
        wait_until(lambda: metrics_answer(urls["scheduler-1"]), 30, "no metrics after restart")
        assert metric_sum(urls["scheduler-1"], "sluiceway:prefix_cache_blocks") == 0
        wait_until(lambda: index_matches_schedulers(urls), 10, "stale index")
        # A router that had not yet seen the restart sends its first request into the dead
        # channel, retries it on scheduler-0 and skips scheduler-1 until its next readiness
        # poll: new prompts (which go to the replica with the fewest blocks) until one lands.
        with stack.client() as client:
            for topic in TOPICS:
                client.generate(
                    Client.request(
                        messages=[("user", f"{topic}, once more, in other words.")], max_tokens=4
                    ),
                    timeout=120,
                )
                if requests_per_replica(urls)["scheduler-1"] > 0:
                    break
                time.sleep(0.5)
        assert requests_per_replica(urls)["scheduler-1"] > 0, "no request reached scheduler-1"
        assert metric_sum(urls["scheduler-1"], "sluiceway:prefix_cache_blocks") > 0
        wait_until(lambda: index_matches_schedulers(urls), 10, "index not rebuilt")
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
