"""A command run on a pseudo-terminal of its own, as from an interactive shell: the terminal is
its stdin, stdout and stderr and its controlling terminal, its process group is the
foreground one, and Ctrl-C typed on it (`Terminal.ctrl_c`) signals that whole group."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import signal
import subprocess
import termios
import threading
import time
from collections.abc import Sequence

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # ConsoleRenderer's colours


def _take_terminal() -> None:
    # in the child, after setsid (start_new_session): stdin becomes the controlling
    # terminal, and this new process group its foreground group
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """`argv` running on a new pseudo-terminal; what it writes is read as it comes (a full
    terminal buffer would block the writer)."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        master, slave = pty.openpty()
        self.master = master
        self.process = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=_take_terminal,
        )
        os.close(slave)
        self._output = bytearray()
        self._changed = threading.Condition()
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                chunk = b""
            with self._changed:
                self._output.extend(chunk)
                self._changed.notify_all()
            if not chunk:
                return

    def text(self) -> str:
        """Everything written so far, colours and carriage returns removed."""
        with self._changed:
            raw = self._output.decode(errors="replace")
        return ANSI.sub("", raw).replace("\r\n", "\n")

    def wait_for(self, needle: str, timeout_s: float) -> None:
        """Returns once `needle` was written; AssertionError (with the output) after
        `timeout_s` seconds or when the process exits without writing it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while needle not in self.text():
                left = deadline - time.monotonic()
                assert left > 0 and self.process.poll() is None, (
                    f"{needle!r} not written:\n{self.text()[-5000:]}"
                )
                self._changed.wait(min(left, 0.5))

    def ctrl_c(self) -> None:
        """Ctrl-C typed on the terminal: SIGINT to its foreground process group."""
        os.write(self.master, b"\x03")

    def close(self) -> None:
        """Kills the process group if it still runs, reads what it wrote up to the terminal's
        end (its last lines may still be in the terminal after it exited), closes the
        terminal."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._pump_thread.join(timeout=10)  # EIO once every writer has closed the terminal
        os.close(self.master)
