"""Shared helpers of tests/test_cli.py and tests/test_cli_generate.py (not a test module):
`sluiceway` run in a subprocess, and a usage error parsed in this process."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

import pytest

from sluiceway.cli import build_parser


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluiceway.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def usage_error(*argv: str) -> str:
    """Parses `sluiceway *argv` in this process, asserts exit 2 and one stderr line (no usage
    block); returns that line."""
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(err):
        build_parser().parse_args(list(argv))
    assert exit_.value.code == 2
    assert len(err.getvalue().splitlines()) == 1, err.getvalue()
    return err.getvalue().rstrip("\n")
