"""`sluiceway serve` stops as uvicorn and vLLM users expect (issue 28, "Operating it").

On a terminal: the first Ctrl-C prints one line and drains (the streams in flight are still
served), a second one stops at once, every stream cut with an explicit status (gRPC
UNAVAILABLE "server shutting down"; HTTP an SSE error event then ``[DONE]``), no traceback.
SIGTERM drains (a load balancer's stop) and the drain timeout cuts what is left with the same
status. `make serve` hands SIGTERM to serve (GNU make forwards SIGTERM, not SIGINT, to its
recipe: Ctrl-C on a terminal reaches both through the process group).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from sluiceway.client import Client
from sluiceway.ports import free_port
from tests.integration.conftest import START_TIMEOUT_S
from tests.integration.test_lifecycle import alive
from tests.router.test_router_shutdown import SHUTTING_DOWN
from tests.terminal import Terminal

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _serve(*flags: str) -> list[str]:
    return [sys.executable, "-m", "sluiceway.cli", "serve", "--kv-cache-memory", "64MiB",
            "--metrics-port", "-1", *flags]  # fmt: skip


class GrpcStream(threading.Thread):
    """A long greedy gRPC stream: `tokens` so far, then `status` (code, details) and
    `ended_at` (time.monotonic()) at its end."""

    def __init__(self, target: str) -> None:
        super().__init__(daemon=True)
        self.target = target
        self.tokens = 0
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.ended_at = 0.0
        self.progress = threading.Condition()

    def run(self) -> None:
        request = Client.request("Count to a thousand:", temperature=0, max_tokens=2000,
                                 ignore_eos=True)  # fmt: skip
        try:
            with Client(self.target) as client:
                for response in client.stub.Generate(request, timeout=300):
                    with self.progress:
                        self.tokens += len(response.token_ids)
                        self.progress.notify_all()
            self.status = (grpc.StatusCode.OK, "")
        except grpc.RpcError as e:
            self.status = (e.code(), e.details())  # type: ignore[attr-defined]
        self.ended_at = time.monotonic()

    def wait_tokens(self, n: int, timeout_s: float = 120) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: self.tokens >= n, timeout_s), self.tokens


class HttpStream(GrpcStream):
    """A long streamed /v1/completions: `events` (the data payloads), `tokens` (the chunks)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.events: list[str] = []
        self.http_status = 0

    def run(self) -> None:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count to a thousand:",
                "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        with (
            httpx.Client(timeout=300) as client,
            client.stream("POST", self.target + "/completions", json=body) as response,
        ):
            self.http_status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    with self.progress:
                        self.events.append(line.removeprefix("data: "))
                        self.tokens += 1
                        self.progress.notify_all()


def test_ctrl_c_drains_and_a_second_ctrl_c_cuts_every_stream_with_a_status() -> None:
    port = free_port()
    term = Terminal(_serve("--port", str(port), "--http-port", "0"))
    try:
        term.wait_for("OpenAI-compatible API:", START_TIMEOUT_S)
        url = re.findall(r"OpenAI-compatible API: (\S+)", term.text())[0]
        streams = [GrpcStream(f"127.0.0.1:{port}"), HttpStream(url)]
        for s in streams:
            s.start()
        for s in streams:
            s.wait_tokens(2)
        term.ctrl_c()
        term.wait_for("sluiceway: draining 2 streams (up to 30 s); press Ctrl-C again to stop now",
                      timeout_s=10)  # fmt: skip
        for s in streams:  # still served while draining
            s.wait_tokens(s.tokens + 3)
        assert term.process.poll() is None
        term.ctrl_c()
        second = time.monotonic()
        assert term.process.wait(timeout=30) == 0
        stopped_after_s = time.monotonic() - second
        for s in streams:
            s.join(timeout=30)
    finally:
        term.close()
    grpc_stream, http_stream = streams
    assert grpc_stream.status == (grpc.StatusCode.UNAVAILABLE, "server shutting down")
    assert isinstance(http_stream, HttpStream) and http_stream.http_status == 200
    assert [json.loads(e) for e in http_stream.events[-2:-1]] == [SHUTTING_DOWN]
    assert http_stream.events[-1] == "[DONE]"
    assert stopped_after_s < 1.0, f"{stopped_after_s:.2f} s from the second Ctrl-C to exit"
    out = term.text()
    assert "Traceback" not in out
    assert out.count("sluiceway: draining") == 1
    assert "sluiceway: stopping now\n" in out and out.endswith("sluiceway: stopped\n"), out
    # every process logged for a person (serve's terminal decided it), and stopped in order
    for event, process in (("router_cutting_streams", "router"),
                           ("scheduler_stopping", "scheduler"), ("worker_stopping", "worker")):  # fmt: skip
        assert re.search(rf"\[\w+\s*\] {event} .*process={process}", out), event
    assert not re.search(r"^\{", out, re.MULTILINE)  # no JSON line


def test_sigterm_drains_and_the_drain_timeout_cuts_the_stream_with_a_status() -> None:
    port = free_port()
    process = subprocess.Popen(
        _serve("--port", str(port), "--http-port", "-1", "--drain-timeout", "1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        assert "serving" in process.stdout.readline()  # the ready line (slow: bounded above)
        stream = GrpcStream(f"127.0.0.1:{port}")
        stream.start()
        stream.wait_tokens(2)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        stream.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert stream.status == (grpc.StatusCode.UNAVAILABLE, "server shutting down")
    assert stream.ended_at - sent >= 1.0  # at the drain timeout, not at once
    lines = err.splitlines()
    human = [line for line in lines if line.startswith("sluiceway:")]
    assert human == [
        "sluiceway: draining 1 stream (up to 1 s); another SIGTERM or Ctrl-C to stop now",
        "sluiceway: stopped",
    ]
    # on a pipe, every process logs JSON (serve's stderr decided it for all)
    events = [json.loads(line) for line in lines if not line.startswith("sluiceway:")]
    cut = [e for e in events if e["event"] == "router_cutting_streams"]
    assert [(e["reason"], e["streams"]) for e in cut] == [("drain timeout", 1)]
    assert {e["process"] for e in events} == {"router", "scheduler", "worker"}
    assert "Traceback" not in err


def _make_serve_argv(venv: Path, port: int) -> list[str]:
    # -o: the venv is there; never reinstall into it (the recipe's install step)
    return ["make", "-C", str(ROOT), "-o", f"{venv}/bin/sluiceway", "serve", f"VENV={venv}",
            f"ARGS=--port {port} --http-port -1 --metrics-port -1 --kv-cache-memory '64MiB'"]  # fmt: skip


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_make_serve_runs_serve_itself_and_passes_it_sigterm() -> None:
    venv = Path(sys.executable).parent.parent
    if shutil.which("make") is None or not (venv / "bin" / "sluiceway").exists():
        pytest.skip("needs make and the sluiceway command in the running venv")
    process = subprocess.Popen(
        _make_serve_argv(venv, free_port()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert process.stdout is not None
        lines: list[str] = []
        while not any("serving" in line for line in lines):
            line = process.stdout.readline()
            assert line, "make serve exited:\n" + "".join(lines)
            lines.append(line)
        # the recipe's shell (quotes in ARGS need one) execs serve: no shell in between that
        # would take make's SIGTERM and leave serve running
        (serve,) = _children(process.pid)
        with open(f"/proc/{serve}/cmdline", "rb") as f:
            script, command = f.read().split(b"\0")[1:3]  # after the shebang's python
        assert (script, command) == (str(venv / "bin" / "sluiceway").encode(), b"serve")
        process.send_signal(signal.SIGTERM)  # to make alone
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert [line for line in err.splitlines() if line.startswith("sluiceway:")] == [
        "sluiceway: stopping (no stream in flight)",
        "sluiceway: stopped",
    ]
    assert not alive(serve)
    assert "Traceback" not in err
    assert process.returncode == -signal.SIGTERM, err  # make re-raises it once serve is done
