"""Each live request's event queue, and the worker group that holds its sequence.

A request's `AddRequest` stream reads its queue (`Engine.stream`); the step loops put the
request's token events on it, or the `RequestError` that ends it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.scheduler.sequence import Sequence
from sluiceway.status import RequestError

if TYPE_CHECKING:
    from sluiceway.scheduler.worker_group import WorkerGroup

__all__ = ["Event", "RequestTable"]

Event = scheduler_pb2.TokenEvent | RequestError


class RequestTable:
    """seq_id -> the request's event queue and the group whose scheduler holds the sequence."""

    def __init__(self) -> None:
        self._queues: dict[int, asyncio.Queue[Event]] = {}
        self._group_of: dict[int, WorkerGroup] = {}

    def add(self, seq: Sequence, group: WorkerGroup) -> None:
        """Registers a new request held by `group`."""
        self._queues[seq.seq_id] = asyncio.Queue()
        self._group_of[seq.seq_id] = group

    def queue(self, seq: Sequence) -> asyncio.Queue[Event]:
        """The request's queue. Raises KeyError for a request not added."""
        return self._queues[seq.seq_id]

    def move(self, seq: Sequence, group: WorkerGroup) -> None:
        """`seq` is held by `group` from now on (a disaggregated hand-off)."""
        self._group_of[seq.seq_id] = group

    def remove(self, seq: Sequence) -> WorkerGroup | None:
        """Forgets the request; returns the group that held it (None if already gone)."""
        self._queues.pop(seq.seq_id, None)
        return self._group_of.pop(seq.seq_id, None)

    def send(self, seq: Sequence, event: Event) -> None:
        """Puts `event` on the request's queue (nothing if it is gone: aborted)."""
        queue = self._queues.get(seq.seq_id)
        if queue is not None:
            queue.put_nowait(event)

    def is_live(self, seq: Sequence) -> bool:
        """Whether the request still has a reader."""
        return seq.seq_id in self._queues
