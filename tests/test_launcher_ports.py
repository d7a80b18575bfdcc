"""`sluiceway serve`'s flags: the ports it picks for `--port 0` and `--metrics-port 0` are
distinct (two separate OS picks can return the same port once the first socket is closed);
out-of-range sizes are usage errors."""

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


def test_block_size_below_1_is_a_usage_error() -> None:
    import contextlib
    import io

    import pytest

    from sluiceway.cli import build_parser

    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(io.StringIO()) as err:
            build_parser().parse_args(["serve", "--block-size", value])
        assert exit_.value.code == 2
        assert f"argument --block-size: must be >= 1, got {value}" in err.getvalue()
