"""`sluiceway serve` leaves no process behind, however it is stopped."""

from __future__ import annotations

import os
import signal
import time

import pytest

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
