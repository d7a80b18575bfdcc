"""`sluiceway serve` leaves no process behind, however it is stopped."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from sluiceway.client import Client
from sluiceway.launcher import remove_stale_run_dirs
from tests.integration.conftest import start_stack

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_no_orphans(sig: signal.Signals) -> None:
    stack = start_stack("--kv-cache-memory", "64MiB")
    children = list(stack.pids.values())
    assert all(alive(p) for p in children)
    stack.process.send_signal(sig)
    rc = stack.process.wait(timeout=60)
    assert rc == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    assert wait_gone(children, timeout_s=20) == []
    run_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"sluiceway-{stack.process.pid}-*"))
    if sig != signal.SIGKILL:
        assert run_dirs == []  # serve removed its socket folder
    else:  # nothing could: the next serve does
        assert len(run_dirs) == 1
        assert run_dirs[0] in remove_stale_run_dirs()
        assert not os.path.exists(run_dirs[0])


def test_a_second_serve_on_a_taken_port_fails_and_the_first_keeps_serving() -> None:
    first = start_stack()
    try:
        port = first.target.rsplit(":", 1)[1]
        second = subprocess.run(
            [sys.executable, "-m", "sluiceway.cli", "serve", "--port", port,
             "--metrics-port", "0", "--http-port", "-1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 2
        assert second.stderr == f"sluiceway: --port {port} is taken (Address already in use)\n"
        with first.client() as client:
            _, ids, _ = client.generate(Client.request("Hi", temperature=0, max_tokens=2))
        assert len(ids) == 2
    finally:
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=60) == 0


def test_a_router_drained_by_sigterm_stops_serve_with_0() -> None:
    stack = start_stack()
    os.kill(stack.pids["router"], signal.SIGTERM)
    assert stack.process.wait(timeout=60) == 0
    assert wait_gone(list(stack.pids.values()), 30) == []
    assert any("router exited with 0; stopping" in line for line in stack.log)


def test_routers_past_port_65535_are_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", "serve", "--port", "65535", "--num-routers", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--num-routers 2 from --port 65535 runs past port 65535" in result.stderr


def test_port_0_routers_and_a_drained_router_left_down_until_the_last() -> None:
    stack = start_stack("--port", "0", "--num-routers", "2")
    try:
        line = next(line for line in stack.log if "serving" in line and "pid" in line)
        ports = re.findall(r"127\.0\.0\.1:(\d+)", line.split(" (", 1)[0])
        assert len(ports) == 2 and "0" not in ports, line
        for port in ports:
            with Client(f"127.0.0.1:{port}") as client:
                _, ids, _ = client.generate(Client.request("Hi", temperature=0, max_tokens=2))
            assert len(ids) == 2
        # A router drained by its own SIGTERM stays down while the other one serves...
        os.kill(stack.pids["router-1"], signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not any("router-1 exited with 0 (drained); leaving it down" in x for x in stack.log):
            assert time.monotonic() < deadline, "".join(stack.log[-20:])
            time.sleep(0.1)
        with Client(f"127.0.0.1:{ports[0]}") as client:
            _, ids, _ = client.generate(Client.request("Hi", temperature=0, max_tokens=2))
        assert len(ids) == 2 and stack.process.poll() is None
        # ...and the last one stops serve.
        os.kill(stack.pids["router-0"], signal.SIGTERM)
        assert stack.process.wait(timeout=60) == 0
        assert any("router-0 exited with 0; stopping" in x for x in stack.log)
        assert wait_gone(list(stack.pids.values()), 30) == []
    finally:
        if stack.process.poll() is None:
            stack.process.send_signal(signal.SIGTERM)
            stack.process.wait(timeout=60)


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive TCP ports nothing listens on right now."""
    import socket

    for base in range(20000 + os.getpid() % 20000, 60000, count):
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket())
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def test_serve_sigkilled_and_started_again_at_once_binds_its_ports() -> None:
    # Fixed ports, as a supervisor restarting serve would reuse: router, HTTP, then the
    # router's, scheduler's and worker's metrics ports.
    base = _free_port_run(5)
    flags = ("--port", str(base), "--http-port", str(base + 1), "--metrics-port", str(base + 2))
    first = start_stack("--kv-cache-memory", "64MiB", *flags)
    children = list(first.pids.values())
    first.process.kill()
    first.process.wait(timeout=10)
    second = start_stack("--kv-cache-memory", "64MiB", *flags)  # raises if it exits
    try:
        assert wait_gone(children, timeout_s=0) == []  # the orphans died with serve
        with Client(f"127.0.0.1:{base}") as client:
            _, ids, _ = client.generate(Client.request("Hi", temperature=0, max_tokens=2))
        assert len(ids) == 2
    finally:
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=60) == 0
