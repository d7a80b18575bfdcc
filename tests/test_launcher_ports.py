"""The ports `sluiceway serve` picks for `--port 0` and `--metrics-port 0`: distinct from each
other (two separate OS picks can return the same port once the first socket is closed)."""

from __future__ import annotations

import socket

from sluiceway.launcher import _metrics_ports, free_ports


def test_free_ports_are_distinct_and_skip_the_excluded() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        routers = free_ports(3)
        metrics = _metrics_ports(0, 40, exclude=routers)
    assert len(set(routers)) == 3 and held not in routers
    assert len(set(metrics)) == 40 and not set(metrics) & set(routers)
    assert _metrics_ports(9400, 3, exclude=routers) == [9400, 9401, 9402]
    assert _metrics_ports(-1, 2, exclude=[]) == [-1, -1]
