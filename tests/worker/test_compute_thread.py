"""The worker's compute thread: one thread for the model's load and every step (one OpenMP
pool), and the OpenMP spin default set only where the user has chosen nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

from sluiceway.worker.compute_thread import (
    OPENMP_ENV,
    compute_executor,
    openmp_defaults,
    run_on_compute_thread,
)


def test_openmp_defaults_leave_a_users_choice_alone() -> None:
    env: dict[str, str] = {}
    openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "30000"} == OPENMP_ENV
    env = {"GOMP_SPINCOUNT": "5"}
    openmp_defaults(env)
    assert env == {"GOMP_SPINCOUNT": "5"}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}  # libgomp would let GOMP_SPINCOUNT win: none added
    openmp_defaults(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_every_call_runs_on_the_same_thread_with_its_thread_count() -> None:
    before = torch.get_num_threads()  # torch's count is process-wide: restored at the end
    main = threading.get_ident()
    first = run_on_compute_thread(threading.get_ident, num_threads=1)
    assert first != main
    assert run_on_compute_thread(torch.get_num_threads) == 1
    assert compute_executor().submit(threading.get_ident).result() == first
    assert run_on_compute_thread(torch.get_num_threads, num_threads=2) == 2
    run_on_compute_thread(lambda: None, num_threads=before)
    torch.set_num_threads(before)


def test_the_cli_sets_the_spin_before_torch_loads() -> None:
    """Importing the CLI loads no torch, and a command (here one that fails at once) has
    the spin default in its environment."""
    code = """
import os, sys
from sluiceway.cli import main
assert "torch" not in sys.modules
assert main(["convert", "--model", "/nonexistent.gguf", "--output", "/nonexistent"]) == 2
print(os.environ.get("GOMP_SPINCOUNT"))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.splitlines()[-1] == OPENMP_ENV["GOMP_SPINCOUNT"]
