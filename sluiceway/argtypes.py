"""argparse types that reject out-of-range numbers with a usage error (exit 2), not a traceback."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An int >= 1. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A float > 0 (``inf`` allowed, NaN not). Raises argparse.ArgumentTypeError otherwise."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: one the OS picks). Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {value}")
    return value


def metrics_port_number(text: str) -> int:
    """A TCP port for /metrics, or -1 for none. Raises argparse.ArgumentTypeError otherwise."""
    value = int(text)
    if not -1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535 or -1 (off), got {value}")
    return value
