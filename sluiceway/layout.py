"""The processes of a `serve` stack and their names, before anything has an address: what
the launcher starts (sluiceway/launcher.py) and what the port check names
(sluiceway/ports.py), from one definition."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sluiceway.serve_config import ServeConfig

# The order of the metrics ports (`--metrics-port` N, N+1, ...) and of serve's metrics line.
METRICS_ORDER = ("router", "scheduler", "worker")


class _Process(Protocol):
    @property
    def command(self) -> str: ...


P = TypeVar("P", bound=_Process)


@dataclass(frozen=True, slots=True)
class Slot:
    """One process of the stack: its `sluiceway` subcommand, its name (``scheduler``,
    ``worker-r1-prefill0-rank1``, ``router-1`` ...), its replica and model instance (worker
    group; -1 where none), the instance's role and the worker's tensor-parallel rank."""

    command: str
    name: str
    replica: int = -1
    instance: int = -1
    role: str = "both"
    rank: int = 0


def _name(kind: str, *parts: tuple[str, int, int]) -> str:
    """`kind` followed by each (label, index, count) part whose count is above 1:
    ``worker``, ``worker-prefill0``, ``scheduler-1``, ``worker-r1-rank0`` ..."""
    suffix = "".join(f"-{label}{i}" for label, i, n in parts if n > 1)
    return kind + suffix


def stack_layout(config: ServeConfig) -> list[Slot]:
    """The processes of the stack in start order: the schedulers, every replica's workers
    (per model instance of the scheduler's layout, its tensor-parallel ranks), the routers."""
    replicas, tp = config.num_replicas, config.scheduler.tensor_parallel_size
    slots = [Slot("scheduler", _name("scheduler", ("", r, replicas)), r) for r in range(replicas)]
    seen = {"both": 0, "prefill": 0, "decode": 0}
    instances = []  # (worker group, role, index among the groups of that role)
    for g, role in enumerate(config.scheduler.group_roles):
        instances.append((g, role, seen[role]))
        seen[role] += 1
    for r in range(replicas):
        for g, role, i in instances:
            for rank in range(tp):
                name = _name(
                    "worker",
                    ("r", r, replicas),
                    (role if role != "both" else "g", i, 2 if role != "both" else 1),
                    ("rank", rank, tp),
                )
                slots.append(Slot("worker", name, r, g, role, rank))
    routers = config.num_routers
    return slots + [Slot("router", _name("router", ("", k, routers))) for k in range(routers)]


def metrics_order(processes: Sequence[P]) -> list[P]:
    """`processes` (slots, or the launcher's children) in the order of their metrics ports:
    the routers, then the schedulers, then the workers."""
    return sorted(processes, key=lambda p: METRICS_ORDER.index(p.command))
