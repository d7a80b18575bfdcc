"""`--scheduling-policy priority` end to end through the HTTP API (the openai SDK, vLLM's
extra-body `priority`): with two slots (`--max-num-seqs 2`) held by low-priority requests
and six more waiting, a high-priority request that arrives last takes the first slot that
frees and is done before any of the six starts; a server under the default fcfs refuses a
priority with 400 naming it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai
import pytest

from tests.integration.conftest import (
    Stack,
    http_base_url,
    metric_sum,
    metrics_urls,
    start_stack,
    stop_stack,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Timed:
    """One streamed completion: when its first text and its end reached the client."""

    priority: int
    max_tokens: int
    first: float = 0.0
    done: float = 0.0
    tokens: int = 0
    started: threading.Event = field(default_factory=threading.Event)


def _complete(api: openai.OpenAI, run: Timed, prompt: str) -> None:
    stream = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=run.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"priority": run.priority, "ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and not run.first:
            run.first = time.monotonic()
            run.started.set()
        if chunk.usage is not None:
            run.tokens = chunk.usage.completion_tokens
    run.done = time.monotonic()


def _start(api: openai.OpenAI, run: Timed, prompt: str) -> threading.Thread:
    thread = threading.Thread(target=_complete, args=(api, run, prompt), daemon=True)
    thread.start()
    return thread


def _until(condition, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_high_priority_request_behind_six_low_ones_is_served_first() -> None:
    stack = start_stack("--scheduling-policy", "priority", "--max-num-seqs", "2")
    try:
        api = openai.OpenAI(base_url=http_base_url(stack), api_key="-", max_retries=0)
        scheduler = next(u for n, u in metrics_urls(stack.log).items() if "scheduler" in n)
        # the two slots: one frees after 32 tokens, the other holds on for 160
        blockers = [Timed(1, 32), Timed(1, 160)]
        threads = [_start(api, r, f"Story {i}:") for i, r in enumerate(blockers)]
        for r in blockers:
            assert r.started.wait(120), "a blocker never started"
        low = [Timed(1, 8) for _ in range(6)]
        threads += [_start(api, r, f"Fact {i}:") for i, r in enumerate(low)]
        waiting = "sluiceway:num_requests_waiting"
        _until(lambda: metric_sum(scheduler, waiting) == 6, "the six never queued")
        high = Timed(0, 8)
        threads.append(_start(api, high, "Urgent:"))
        for t in threads:
            t.join(300)
        with stack.client() as client:
            info = wait_for_free_blocks(client)
    finally:
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])
    assert [r.tokens for r in (*blockers, *low, high)] == [32, 160] + [8] * 7
    # the first slot to free went to the high one (the six arrived before it); the next
    # freed when it finished: it was done before any of the six had a token
    assert high.first > blockers[0].first
    assert high.done < min(r.first for r in low), (high, low)
    assert blockers[1].done > high.done
    assert info.num_free_kv_blocks == info.num_kv_blocks
    assert info.num_preemptions_total == 0


def test_a_fcfs_server_refuses_a_priority_naming_it(stack: Stack) -> None:
    api = openai.OpenAI(base_url=http_base_url(stack), api_key="-", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict)  # the SDK hands over the `error` object
    assert body["param"] == "priority"
    assert body["message"] == (
        "priority: priority scheduling is not enabled (this server runs --scheduling-policy "
        "fcfs; start it with --scheduling-policy priority); got 1, only 0 is accepted"
    )
    ok = api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 0})
    assert ok.usage is not None and ok.usage.completion_tokens >= 1
