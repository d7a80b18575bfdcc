"""KV events: the full blocks a replica's prefix cache holds, published as they change.

Routers route by cache (router/kv_index.py, router/balancer.py) from these events, as
NVIDIA Dynamo's KV router builds its index from the "stored"/"removed" block events its
workers publish, and the SGLang model gateway keeps a prefix tree per worker. Here the
block manager logs every hash that enters or leaves its cache
(`BlockManager.kv_event_log`); `KvEventPublisher.poll`, run every few milliseconds by the
scheduler process, collects those logs from every worker group of the replica and sends
each subscriber (one `SubscribeKvEvents` stream per router) the net change of the
replica's set of hashes: a hash held by two groups (disaggregated prefill) is removed
only when neither holds it. A new subscriber first gets a snapshot of the whole set, so a
router that (re)connects, or the replica after a restart, rebuilds its index from scratch;
a group whose block manager is replaced (its worker registered again with a new KV pool)
has all of its old hashes removed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.scheduler.block_manager import BlockManager

# Hashes per message at most: a snapshot of a large pool is split (32 bytes per hash).
MAX_HASHES_PER_MESSAGE = 8192
# Messages a subscriber may leave unread; past this it is dropped (it reconnects and gets a
# new snapshot) rather than letting the scheduler's memory grow.
MAX_QUEUED_MESSAGES = 1024


class SubscriberOverflow(Exception):
    """A subscriber left more than `MAX_QUEUED_MESSAGES` messages unread."""


class KvEventPublisher:
    """Fans a replica's prefix-cache changes out to subscribers. Single-threaded (the
    scheduler's event loop), like the block managers it reads."""

    def __init__(
        self,
        block_managers: Callable[[], list[BlockManager | None]],
        block_size: Callable[[], int],
        *,
        max_hashes_per_message: int = MAX_HASHES_PER_MESSAGE,
        max_queued_messages: int = MAX_QUEUED_MESSAGES,
    ) -> None:
        """`block_managers()`: the current block manager of each worker group, by group
        index (None before the group has one); `block_size()`: tokens per block (0 unknown)."""
        self._block_managers = block_managers
        self._block_size = block_size
        self.max_hashes_per_message = max_hashes_per_message
        self.max_queued_messages = max_queued_messages
        self._tracked: list[BlockManager | None] = []  # per group: whose log is read
        self._held: list[set[bytes]] = []  # per group: its hashes as last read
        self._count: Counter[bytes] = Counter()  # hash -> groups holding it
        self._subscribers: set[asyncio.Queue[scheduler_pb2.KvEvents | Exception]] = set()

    @property
    def hashes(self) -> set[bytes]:
        """The replica's cached block hashes as of the last `poll`."""
        return set(self._count)

    def poll(self) -> None:
        """Reads every group's changes since the last poll and sends their net effect on
        the replica's set of hashes to every subscriber (nothing when there is none)."""
        changes: dict[bytes, bool] = {}  # hash -> stored (True) / removed (False), net

        def add(h: bytes) -> None:
            self._count[h] += 1
            if self._count[h] == 1:
                if changes.get(h) is False:
                    del changes[h]  # removed then stored again within one poll
                else:
                    changes[h] = True

        def drop(h: bytes) -> None:
            self._count[h] -= 1
            if self._count[h] == 0:
                del self._count[h]
                if changes.get(h) is True:
                    del changes[h]
                else:
                    changes[h] = False

        for i, bm in enumerate(self._block_managers()):
            if i == len(self._tracked):
                self._tracked.append(None)
                self._held.append(set())
            held = self._held[i]
            if bm is not self._tracked[i]:  # a new pool: diff the whole sets once
                old = self._tracked[i]
                if old is not None:
                    old.kv_event_log = None
                new = set(bm.cached_hashes) if bm is not None else set()
                for h in held - new:
                    drop(h)
                for h in new - held:
                    add(h)
                self._held[i] = new
                self._tracked[i] = bm
                if bm is not None:
                    bm.kv_event_log = []
                continue
            if bm is None or not bm.kv_event_log:
                continue
            events, bm.kv_event_log = bm.kv_event_log, []
            for h, stored in events:
                if stored and h not in held:
                    held.add(h)
                    add(h)
                elif not stored and h in held:
                    held.remove(h)
                    drop(h)
        if changes and self._subscribers:
            stored_hashes = [h for h, s in changes.items() if s]
            removed_hashes = [h for h, s in changes.items() if not s]
            for message in self._messages(stored_hashes, removed_hashes, reset=False):
                for queue in list(self._subscribers):
                    self._put(queue, message)

    def subscribe(self) -> asyncio.Queue[scheduler_pb2.KvEvents | Exception]:
        """A queue that gets a snapshot of the replica's hashes (first message `reset`),
        then every change; a `SubscriberOverflow` in it ends the subscription. Give it back
        with `unsubscribe`."""
        self.poll()  # earlier subscribers get what happened before the snapshot
        queue: asyncio.Queue[scheduler_pb2.KvEvents | Exception] = asyncio.Queue()
        for message in self._messages(list(self._count), [], reset=True):
            queue.put_nowait(message)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[scheduler_pb2.KvEvents | Exception]) -> None:
        self._subscribers.discard(queue)

    def _put(
        self,
        queue: asyncio.Queue[scheduler_pb2.KvEvents | Exception],
        message: scheduler_pb2.KvEvents,
    ) -> None:
        if queue.qsize() >= self.max_queued_messages:
            self._subscribers.discard(queue)
            queue.put_nowait(
                SubscriberOverflow(f"more than {self.max_queued_messages} KV event messages unread")
            )
            return
        queue.put_nowait(message)

    def _messages(
        self, stored: list[bytes], removed: list[bytes], *, reset: bool
    ) -> list[scheduler_pb2.KvEvents]:
        """`stored` then `removed` in messages of at most `max_hashes_per_message` hashes;
        the first has `reset` (at least one message when `reset`)."""
        n = self.max_hashes_per_message
        block_size = self._block_size()
        messages = [
            scheduler_pb2.KvEvents(stored=stored[i : i + n], block_size=block_size)
            for i in range(0, len(stored), n)
        ]
        messages += [
            scheduler_pb2.KvEvents(removed=removed[i : i + n], block_size=block_size)
            for i in range(0, len(removed), n)
        ]
        if reset:
            if not messages:
                messages.append(scheduler_pb2.KvEvents(block_size=block_size))
            messages[0].reset = True
        return messages


async def run_publisher(publisher: KvEventPublisher, interval_s: float = 0.02) -> None:
    """Polls `publisher` every `interval_s` seconds, forever (cancel to stop)."""
    while True:
        publisher.poll()
        await asyncio.sleep(interval_s)
