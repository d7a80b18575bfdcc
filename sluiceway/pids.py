"""Whether a process still runs: for files and folders named after the pid that made them."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if a process `pid` exists (ours or another user's; a zombie counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True
