"""The one thread of a worker process that runs torch: the model's load, every step, every
block copy.

Why one thread, and why a bounded spin (measured on a 2-core AMD EPYC, the embedded SmolLM2
in gguf mode, a decode step of one sequence at context 320, 2 torch threads; docs/performance.md):

- GNU OpenMP (the torch CPU wheel's runtime) gives every thread that opens a parallel region
  a pool of its own. When the model loaded on the main thread and stepped on another one,
  the process held two pools, 4 OpenMP threads on 2 cores, and libgomp then throttles its
  spin-wait to 100 iterations at most: each of the step's ~300 parallel regions woke a
  sleeping thread (a futex and a cross-core wake-up, tens of microseconds in a VM). The step
  took 23.5 ms there against 7.7 ms with one pool.
- With one pool, `OMP_WAIT_POLICY=PASSIVE` (threads sleep at once) costs the same wake-ups:
  24.9 ms; libgomp's default spin (300,000 iterations, milliseconds) keeps a spinning thread
  on a core long after the step, starving the router and scheduler on the same cores: 10.6
  ms; a spin of 30,000 to 100,000 iterations (well under a millisecond; about the gap
  between two operations of a step) 7.7-7.9 ms. `OPENMP_ENV` is that default.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["OPENMP_ENV", "compute_executor", "openmp_defaults", "run_on_compute_thread"]

T = TypeVar("T")

# libgomp's spin-wait, in iterations of its pause loop, before a waiting thread sleeps
# (libgomp reads GOMP_SPINCOUNT first; OMP_WAIT_POLICY sets the spin only without it: a user
# who set OMP_WAIT_POLICY gets no GOMP_SPINCOUNT from us, see openmp_defaults).
OPENMP_ENV = {"GOMP_SPINCOUNT": "30000"}

_executor: ThreadPoolExecutor | None = None


def openmp_defaults(env: MutableMapping[str, str]) -> None:
    """Sets `OPENMP_ENV` in `env` where the user has set neither it nor OMP_WAIT_POLICY
    (whose choice would otherwise lose to our GOMP_SPINCOUNT). Only effective before the
    process loads OpenMP (before `import torch`)."""
    if "OMP_WAIT_POLICY" in env:
        return
    for name, value in OPENMP_ENV.items():
        env.setdefault(name, value)


def compute_executor() -> ThreadPoolExecutor:
    """The process's single compute thread (created on first use; never shut down: it
    lives as long as the process)."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
    return _executor


def run_on_compute_thread(fn: Callable[[], T], num_threads: int | None = None) -> T:
    """Runs `fn` on the compute thread and returns its result (raises what it raises).

    `num_threads`: torch's intra-op threads, set on that thread first (an OpenMP thread
    count is per calling thread).
    """

    def call() -> T:
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        return fn()

    return compute_executor().submit(call).result()
