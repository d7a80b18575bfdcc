"""How `sluiceway serve` stops its stack, as uvicorn and vLLM users expect.

The first SIGINT or SIGTERM drains: serve says so in one line on stderr (``draining 1 stream
(up to 30 s); press Ctrl-C again to stop now``) and sends SIGTERM to the routers, which stop
taking requests and let their streams run to their end for up to `--drain-timeout` seconds
(a load balancer's SIGTERM keeps that meaning). A second signal stops now: serve sends the
routers SIGINT (another signal number than the first, so that two signals sent at once are
not merged into one by the kernel), and each router ends its streams at once with UNAVAILABLE
"server shutting down" (an SSE error event on HTTP) and exits; the drain timeout passing does
the same. Then the schedulers and workers get SIGTERM.

Ctrl-C on a terminal signals serve's whole process group; the children run in sessions of
their own (`launcher._spawn`), so only serve sees it and stops them in this order.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["StopSignals", "drain_line", "stop_stack", "streams_in_flight"]

# How long a child may take to stop once told to (then SIGKILL); a router gets its drain
# timeout on top.
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.02  # how often serve looks at its children while they stop


class StopSignals:
    """SIGINT and SIGTERM to `serve`, in the order they came: the first stops the stack (the
    routers drain), a second one stops it now."""

    def __init__(self) -> None:
        self.signals: list[signal.Signals] = []
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signal.Signals(signum))

    @property
    def requested(self) -> bool:
        """A signal came: stop the stack."""
        return bool(self.signals)

    @property
    def now(self) -> bool:
        """A second signal came: stop without waiting for the streams."""
        return len(self.signals) > 1


def streams_in_flight(scheduler_addresses: Sequence[str], timeout_s: float = 0.5) -> int | None:
    """The requests the schedulers hold (running or waiting; a request with ``n`` samples
    counts ``n``), or None when one does not answer within `timeout_s`."""
    import grpc

    from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

    total = 0
    for address in scheduler_addresses:
        with grpc.insecure_channel(address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            try:
                info = stub.GetSchedulerInfo(
                    scheduler_pb2.GetSchedulerInfoRequest(), timeout=timeout_s
                )
            except grpc.RpcError:
                return None
        total += info.num_requests_running + info.num_requests_waiting
    return total


def drain_line(streams: int | None, drain_timeout_s: float, first: signal.Signals) -> str:
    """What serve prints on its first signal: what it waits for, how long, how to stop now."""
    if streams == 0:
        return "sluiceway: stopping (no stream in flight)"
    what = "the streams in flight" if streams is None else f"{streams} stream"
    if streams is not None and streams != 1:
        what += "s"
    if drain_timeout_s <= 0:
        return f"sluiceway: stopping now, cutting {what} (--drain-timeout 0)"
    again = "press Ctrl-C again" if first == signal.SIGINT else "another SIGTERM or Ctrl-C"
    return f"sluiceway: draining {what} (up to {drain_timeout_s:g} s); {again} to stop now"


def _signal(processes: Sequence[subprocess.Popen[bytes]], sig: signal.Signals) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(sig)


def _wait_all(processes: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
    """Waits for every process until `deadline` (time.monotonic()), then SIGKILLs the rest."""
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_stack(
    routers: Sequence[subprocess.Popen[bytes]],
    others: Sequence[subprocess.Popen[bytes]],
    drain_timeout_s: float,
    signals: StopSignals,
    schedulers: Sequence[str] | None = None,
) -> None:
    """SIGTERM to the routers, which drain for up to `drain_timeout_s` (then
    STOP_TIMEOUT_S more before SIGKILL); a second signal to serve meanwhile, or one that came
    already, becomes SIGINT to them (they stop now). Then SIGTERM to `others` (schedulers,
    workers), SIGKILL after STOP_TIMEOUT_S.

    With `schedulers` (their addresses: the stack served, and a signal stops it), says on
    stderr what it waits for (`drain_line`), when it stops now, and when it has stopped."""
    _signal(routers, signal.SIGTERM)
    if schedulers is not None and signals.requested:
        streams = streams_in_flight(schedulers)
        _say(drain_line(streams, drain_timeout_s, signals.signals[0]))
    told_now = False
    deadline = time.monotonic() + drain_timeout_s + STOP_TIMEOUT_S
    while any(p.poll() is None for p in routers) and time.monotonic() < deadline:
        if signals.now and not told_now:
            _signal(routers, signal.SIGINT)
            told_now = True
            if schedulers is not None:
                _say("sluiceway: stopping now")
        time.sleep(_POLL_S)
    _wait_all(routers, deadline)
    _signal(others, signal.SIGTERM)
    _wait_all(others, time.monotonic() + STOP_TIMEOUT_S)
    if schedulers is not None and signals.requested:
        _say("sluiceway: stopped")


def _say(line: str) -> None:
    # one write: print() writes the line and its newline apart, and another process's log
    # line can land between them on the shared stderr
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
