"""Which replica caches which prompt prefix: the router's index of KV events.

Each scheduler publishes the chained hashes of the full blocks in its prefix cache as they
are stored and evicted (`Scheduler.SubscribeKvEvents`, scheduler/kv_events.py); the router
applies them here, per replica, as NVIDIA Dynamo's KV router keeps its index of worker
KV events. Because a block's hash names its whole prefix
(sluiceway/prefix_hash.py), the longest cached prefix of a prompt on a replica is the
longest run of the prompt's block hashes, from the first, that the replica holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluiceway.internal.v1 import scheduler_pb2


class KvIndex:
    """Block hash -> the replicas (by address) that cache it. Single-threaded."""

    def __init__(self) -> None:
        self._replicas_of: dict[bytes, set[str]] = {}
        self._held: dict[str, set[bytes]] = {}  # replica -> its hashes

    def num_blocks(self, replica: str) -> int:
        """Blocks `replica` caches, as last reported."""
        return len(self._held.get(replica, ()))

    def apply(self, replica: str, events: scheduler_pb2.KvEvents) -> None:
        """One `KvEvents` message from `replica`: forget its blocks first if `reset`, then
        add `stored`, then drop `removed`."""
        if events.reset:
            self.clear(replica)
        self.store(replica, events.stored)
        self.remove(replica, events.removed)

    def store(self, replica: str, hashes: Iterable[bytes]) -> None:
        held = self._held.setdefault(replica, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._replicas_of.setdefault(h, set()).add(replica)

    def remove(self, replica: str, hashes: Iterable[bytes]) -> None:
        held = self._held.get(replica)
        if not held:
            return
        for h in hashes:
            if h in held:
                held.remove(h)
                holders = self._replicas_of[h]
                holders.discard(replica)
                if not holders:
                    del self._replicas_of[h]

    def clear(self, replica: str) -> None:
        """Forgets every block of `replica` (its stream broke: its cache is unknown)."""
        self.remove(replica, list(self._held.get(replica, ())))
        self._held.pop(replica, None)

    def longest_prefix(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """For each replica holding the first block: how many of `block_hashes`, from the
        first on, it caches (blocks). Replicas holding none are absent. O(blocks matched)."""
        matched: dict[str, int] = {}
        active: set[str] | None = None
        for i, h in enumerate(block_hashes):
            holders = self._replicas_of.get(h)
            if not holders:
                break
            active = set(holders) if active is None else active & holders
            if not active:
                break
            for replica in active:
                matched[replica] = i + 1
        return matched
