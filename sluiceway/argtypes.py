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
