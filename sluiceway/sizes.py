"""Byte sizes on the command line: `4GiB`, `512MiB`, `2GB`, `1073741824`."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, allow_zero: bool = False) -> int:
    """Bytes in `text`: a number with an optional unit (KiB/MiB/GiB/TiB powers of 1024,
    KB/MB/GB/TB powers of 1000, K/M/G/T as binary, as vLLM's `--kv-cache-memory`).

    Raises ValueError for anything else, or a size under one byte (0 with ``allow_zero``).
    """
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"not a size: {text!r} (bytes, or a number with KiB, MiB, GiB, TiB or KB, MB, GB, "
            "TB, e.g. 4GiB, 512MiB, 2000000000)"
        )
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size < (0 if allow_zero else 1) or (size == 0 and float(m.group(1)) > 0):
        raise ValueError(f"size must be at least 1 byte, got {text!r}")
    return size
