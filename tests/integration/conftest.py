"""A real stack (`sluiceway serve`: worker, scheduler and router processes) for the session."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from sluiceway.client import Client
from sluiceway.ports import free_port
from sluiceway.v1 import inference_pb2

START_TIMEOUT_S = 300


@dataclass
class Stack:
    target: str
    process: subprocess.Popen[str]
    pids: dict[str, int]
    log: list[str]

    def client(self) -> Client:
        return Client(self.target)


def start_stack(*extra: str) -> Stack:
    """Runs `sluiceway serve` on a free port and waits for its "serving" line.

    Raises RuntimeError with the log if it exits or does not come up in time.
    """
    port = free_port()
    cmd = [
        sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(port),
        "--dtype", "float32", "--kv-cache-memory", "1GiB", "--log-format", "console",
        "--metrics-port", "0", "--http-port", "0",
        *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if "serving" in line and "pid" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("sluiceway serve did not start:\n" + "".join(log[-50:]))
    line = next(line for line in log if "serving" in line and "pid" in line)
    pids = {name: int(pid) for name, pid in re.findall(r"([\w-]+) pid (\d+)", line)}
    return Stack(f"127.0.0.1:{port}", proc, pids, log)


def stop_stack(stack: Stack) -> int:
    stack.process.send_signal(signal.SIGTERM)
    return stack.process.wait(timeout=60)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    s = start_stack()
    yield s
    assert stop_stack(s) == 0, "".join(s.log[-30:])


@pytest.fixture(scope="session")
def tokenizer():  # type: ignore[no-untyped-def]
    from sluiceway.model_files import resolve_model
    from sluiceway.router.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session")
def sharegpt_requests(tokenizer) -> list[inference_pb2.GenerateRequest]:  # type: ignore[no-untyped-def]
    """32 real ShareGPT prompts (at most 400 tokens), greedy, 24 tokens each, EOS ignored."""
    from sluiceway.sharegpt import sample_requests

    requests = sample_requests(tokenizer, 32, seed=7, max_prompt_len=400)
    return [
        Client.request(r.prompt, temperature=0, ignore_eos=True, max_tokens=24) for r in requests
    ]


@pytest.fixture(scope="session")
def reference_tokens(
    stack: Stack, sharegpt_requests: list[inference_pb2.GenerateRequest]
) -> list[list[int]]:
    """The tokens of each ShareGPT request sent alone to the default stack."""
    with stack.client() as client:
        return [client.generate(r, timeout=120)[1] for r in sharegpt_requests]


def generate_concurrently(
    client: Client, requests: list[inference_pb2.GenerateRequest]
) -> list[list[int]]:
    """Sends every request at once; returns each one's tokens, in request order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: client.generate(r, timeout=600)[1], requests))


def wait_for_free_blocks(client: Client, timeout_s: float = 5.0) -> inference_pb2.ModelInfo:
    """GetModelInfo once every block is free again (or the last answer after the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.model_info()
        if info.num_free_kv_blocks == info.num_kv_blocks or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def metrics_urls(log: list[str], timeout_s: float = 10.0) -> dict[str, str]:
    """Each process's /metrics URL from `sluiceway serve`'s "metrics:" line, by name (it
    follows the "serving" line that `start_stack` waits for: waits up to `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not (lines := [line for line in list(log) if "metrics:" in line]):
        assert time.monotonic() < deadline, "no metrics line:\n" + "".join(log[-20:])
        time.sleep(0.05)
    return dict(re.findall(r"([\w-]+) (http://\S+/metrics)", lines[0]))


def log_line(stack: Stack, marker: str, timeout_s: float = 10.0) -> str:
    """The first line of `sluiceway serve`'s output holding `marker`, waiting for it up to
    `timeout_s` (the lines after "serving" may still be on their way)."""
    deadline = time.monotonic() + timeout_s
    while not (lines := [line for line in list(stack.log) if marker in line]):
        assert time.monotonic() < deadline, f"no {marker!r} line:\n" + "".join(stack.log[-20:])
        time.sleep(0.05)
    return lines[0]


def http_base_url(stack: Stack, timeout_s: float = 10.0) -> str:
    """The first router's OpenAI-compatible base URL (``http://host:port/v1``) from `sluiceway
    serve`'s "OpenAI-compatible API:" line (printed after the "serving" line)."""
    line = log_line(stack, "OpenAI-compatible API:", timeout_s)
    return line.split("OpenAI-compatible API:", 1)[1].split(",")[0].strip()


def metric_sum(url: str, name: str) -> float:
    """The sum of every sample of metric `name` (all label sets) at `url`."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(name + "{")
    )
