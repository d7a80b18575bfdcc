"""`--log-format auto` (the default): console lines for a person at a terminal, JSON lines for
a pipe or a file; `json` and `console` force one. A real `sluiceway scheduler` (no model, up
in about 2 s) on a pseudo-terminal and on a pipe."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluiceway.logs import resolve_log_format
from tests.terminal import Terminal

# ConsoleRenderer's line: an ISO timestamp, the level in brackets, the event, key=value pairs
CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[(\w+)\s*\] (\w+)\s+(.*)$")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_is_console_on_a_terminal_and_json_otherwise() -> None:
    assert resolve_log_format("auto", _Tty()) == "console"
    assert resolve_log_format("auto", io.StringIO()) == "json"
    for forced in ("json", "console"):
        assert resolve_log_format(forced, _Tty()) == forced
        assert resolve_log_format(forced, io.StringIO()) == forced
    with pytest.raises(ValueError) as error:
        resolve_log_format("xml")
    assert str(error.value) == "log_format must be auto, json or console, got 'xml'"


def _scheduler_lines(socket: Path, *flags: str, terminal: bool) -> list[str]:
    """The lines a `sluiceway scheduler` with `flags` writes from its start to its stop (by
    Ctrl-C on a terminal, SIGTERM on a pipe), on a terminal of its own or on a pipe."""
    argv = [sys.executable, "-m", "sluiceway.cli", "scheduler", "--listen", f"unix:{socket}",
            "--metrics-port", "-1", *flags]  # fmt: skip
    if terminal:
        term = Terminal(argv)
        try:
            term.wait_for("scheduler_listening", timeout_s=60)
            term.ctrl_c()
            assert term.process.wait(timeout=30) == 0
        finally:
            term.close()
        output = term.text()
    else:
        process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        assert process.stderr is not None
        first = process.stderr.readline()
        process.send_signal(signal.SIGTERM)
        output = first + process.communicate(timeout=30)[1]
        assert process.returncode == 0
    output = output.replace("^C", "")  # the terminal's echo of Ctrl-C
    return [line for line in output.splitlines() if line]


def _console_events(lines: list[str]) -> list[tuple[str, str]]:
    """(level, event) of each line; AssertionError naming the first that is not a console
    line."""
    events = []
    for line in lines:
        match = CONSOLE_LINE.match(line)
        assert match, f"not a console line: {line!r}"
        events.append((match[1], match[2]))
    return events


def _json_events(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in lines]  # every line one JSON object


def test_a_process_on_a_terminal_logs_console_lines(tmp_path: Path) -> None:
    lines = _scheduler_lines(tmp_path / "s.sock", terminal=True)
    assert _console_events(lines) == [("info", "scheduler_listening"),
                                      ("info", "scheduler_stopping")]  # fmt: skip
    assert f"address=unix:{tmp_path / 's.sock'}" in lines[0]
    assert "process=scheduler" in lines[0]


def test_a_process_on_a_pipe_logs_json_lines(tmp_path: Path) -> None:
    events = _json_events(_scheduler_lines(tmp_path / "s.sock", terminal=False))
    assert [(e["event"], e["level"], e["process"]) for e in events] == [
        ("scheduler_listening", "info", "scheduler"),
        ("scheduler_stopping", "info", "scheduler"),
    ]
    assert events[0]["address"] == f"unix:{tmp_path / 's.sock'}"


def test_a_forced_format_wins_over_the_terminal_or_pipe(tmp_path: Path) -> None:
    on_a_pipe = _scheduler_lines(tmp_path / "s.sock", "--log-format", "console", terminal=False)
    assert _console_events(on_a_pipe) == [("info", "scheduler_listening"),
                                          ("info", "scheduler_stopping")]  # fmt: skip
    on_a_terminal = _scheduler_lines(tmp_path / "s.sock", "--log-format", "json", terminal=True)
    assert [e["event"] for e in _json_events(on_a_terminal)] == [
        "scheduler_listening",
        "scheduler_stopping",
    ]
