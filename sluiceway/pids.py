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


def process_age_s() -> float:
    """Seconds since this process started (its interpreter start and imports included), from
    /proc/self/stat's start time (field 22, clock ticks after boot) and /proc/uptime; 0.0
    where /proc is not Linux's."""
    try:
        stat = pathlib.Path("/proc/self/stat").read_text()
        uptime = float(pathlib.Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return 0.0
    # the command name (field 2) may hold spaces and parentheses: count after its last ')'
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
