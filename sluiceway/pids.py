"""Whether a process still runs: for files and folders named after the pid that made them."""

from __future__ import annotations

import os
import pathlib


def pid_alive(pid: int) -> bool:
    """True if a process `pid` exists (ours or another user's; a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


def dead_owner_paths(directory: pathlib.Path, prefix: str) -> list[pathlib.Path]:
    """Entries of `directory` named ``<prefix><pid>-...`` whose process `pid` no longer runs
    (left behind by a process killed before it could remove them)."""
    found = []
    for path in directory.glob(f"{prefix}*"):
        pid = path.name.removeprefix(prefix).split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            found.append(path)
    return found
