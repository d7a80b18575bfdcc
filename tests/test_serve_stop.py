"""How `serve` stops its stack (sluiceway/serve_stop.py): what it says, and the signals each
child gets in which order. The children are stand-in Python processes that write down the
signals they get."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluiceway.serve_stop import StopSignals, drain_line, stop_stack

# Writes "ready", then each signal's name and time.monotonic() to its file; exits 0 after
# `exit_after` signals. It exits from its main loop, not from a handler: a second signal's
# handler may run inside the first one's, and exiting there would lose the first one's line.
CHILD = """
import signal, sys, time
path, exit_after = sys.argv[1], int(sys.argv[2])
got = []
def on_signal(signum, frame):
    got.append(signum)
    with open(path, "a") as f:
        f.write(f"{signal.Signals(signum).name} {time.monotonic()}\\n")
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
while len(got) < exit_after:
    time.sleep(0.01)
"""


def _child(path: Path, exit_after: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(exit_after)], stdout=subprocess.PIPE
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def _got(path: Path) -> list[tuple[str, float]]:
    """The signals a stand-in child got: (name, time.monotonic()) each."""
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(name, float(t)) for name, t in rows]


def _signals(*received: signal.Signals) -> StopSignals:
    """What `StopSignals` holds after `received` (without taking this process's handlers)."""
    signals = StopSignals.__new__(StopSignals)
    signals.signals = list(received)
    return signals


def test_what_serve_says_on_its_first_signal() -> None:
    sigint, sigterm = signal.SIGINT, signal.SIGTERM
    assert drain_line(1, 30.0, sigint) == (
        "sluiceway: draining 1 stream (up to 30 s); press Ctrl-C again to stop now"
    )
    assert drain_line(3, 2.5, sigterm) == (
        "sluiceway: draining 3 streams (up to 2.5 s); another SIGTERM or Ctrl-C to stop now"
    )
    assert drain_line(None, 30.0, sigint) == (
        "sluiceway: draining the streams in flight (up to 30 s); press Ctrl-C again to stop now"
    )
    assert drain_line(0, 30.0, sigint) == "sluiceway: stopping (no stream in flight)"
    assert drain_line(2, 0.0, sigterm) == (
        "sluiceway: stopping now, cutting 2 streams (--drain-timeout 0)"
    )


def test_a_second_signal_becomes_sigint_to_the_routers_then_the_rest_get_sigterm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both signals came before the stop began (two quick Ctrl-C): the routers still get
    # SIGTERM then SIGINT (two signal numbers: the kernel merges two pending SIGTERMs).
    router = _child(tmp_path / "router", exit_after=2)
    worker = _child(tmp_path / "worker", exit_after=1)
    stop_stack([router], [worker], 30.0, _signals(signal.SIGINT, signal.SIGINT), schedulers=[])
    assert (router.returncode, worker.returncode) == (0, 0)
    router_got, worker_got = _got(tmp_path / "router"), _got(tmp_path / "worker")
    # sent in that order; a child that had not run between them gets them by number (Linux
    # delivers pending signals lowest first): either way two signals, a drain then a stop
    assert sorted(name for name, _ in router_got) == ["SIGINT", "SIGTERM"]
    assert [name for name, _ in worker_got] == ["SIGTERM"]
    assert worker_got[0][1] > router_got[-1][1]  # the rest only once the routers are done
    assert capsys.readouterr().err == (
        "sluiceway: stopping (no stream in flight)\n"  # no scheduler to ask: none held any
        "sluiceway: stopping now\n"
        "sluiceway: stopped\n"
    )


def test_routers_that_drain_on_sigterm_get_nothing_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    routers = [_child(tmp_path / f"router-{i}", exit_after=1) for i in range(2)]
    scheduler = _child(tmp_path / "scheduler", exit_after=1)
    stop_stack(routers, [scheduler], 30.0, _signals(signal.SIGTERM))  # not serving: no lines
    for i in range(2):
        assert [name for name, _ in _got(tmp_path / f"router-{i}")] == ["SIGTERM"]
    assert [name for name, _ in _got(tmp_path / "scheduler")] == ["SIGTERM"]
    assert capsys.readouterr().err == ""
