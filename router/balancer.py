"""Spreading a router's requests over several schedulers (model replicas).

Each scheduler owns its own KV cache and batching loop; the router keeps, per
scheduler, a gRPC channel, its readiness as last seen (`GetSchedulerInfo`,
polled by the router's health watcher, or an `AddRequest` that failed with
UNAVAILABLE) and its *outstanding requests*: the `Generate` streams this
router forwarded to it that have not ended yet.

The router also follows every scheduler's KV events (`SubscribeKvEvents`: the chained
hashes of the full blocks in its prefix cache, as they are stored and evicted, after a
snapshot) into a `KvIndex` (router/kv_index.py): which replica caches which prompt
prefix. A stream that breaks clears that replica's entries; the next one, within a
second or two, rebuilds them from its snapshot (a restarted replica starts empty).

Policy (`SchedulerPool.pick`), cache-aware as NVIDIA Dynamo's KV router and the SGLang
model gateway's cache-aware policy route:

1. Cache hit: hash the prompt's full blocks as the scheduler does
   (sluiceway/prefix_hash.py) and find, on each ready scheduler, the longest run of them
   from the first that it caches. Among the schedulers whose outstanding requests exceed
   the fewest by at most `balance_abs_threshold` (default 8; a replica loaded past that
   gets no hits, however long), the one with the longest cached prefix gets the request
   when that prefix covers more than `cache_threshold` (default 0.5) of the prompt's full
   blocks. The share keeps a prefix every request has (a chat template's default system
   prompt, one or two blocks) from drawing all traffic to the first replica that cached
   it, as SGLang's `cache_threshold` does; a conversation's next turn, whose prompt is the
   last turn's prompt and answer plus a message, is mostly cached and sticks.
2. Otherwise, and among schedulers tied on the longest prefix: least outstanding
   requests (in flight from this router: Envoy's `LEAST_REQUEST`, the vLLM router's
   default), which stand in for the scheduler's load and adapt at once to a replica that
   runs slower; then the fewest cached blocks (SGLang's "smallest tree": new prefixes go
   where the cache has the most room, so distinct requests sent one after another
   alternate); then rendezvous (highest random weight) hashing of the prompt's last full
   block hash, or its token ids when it has no full block (Thaler & Ravishankar, "Using
   name-based mappings to increase hit rates", IEEE/ACM ToN 1998): stable, and every
   router process makes the same choice (blake2b, not Python's `hash()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import structlog

from sluiceway.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.prefix_hash import prompt_block_hashes
from sluiceway.router.config import DEFAULT_BALANCE_ABS_THRESHOLD, DEFAULT_CACHE_THRESHOLD
from sluiceway.router.kv_index import KvIndex
from sluiceway.router.metrics import (
    KV_INDEX_BLOCKS,
    OUTSTANDING_REQUESTS,
    SCHEDULER_GAUGES,
    SCHEDULER_READY,
    init_series,
)

log = structlog.get_logger("router")

# Block size assumed before any scheduler has reported its own.
DEFAULT_BLOCK_SIZE = 16
# Seconds between attempts to (re)subscribe to a scheduler's KV events, at most.
KV_EVENTS_MAX_BACKOFF_S = 2.0
# ... and from a scheduler without the RPC (an older version), seconds.
KV_EVENTS_UNIMPLEMENTED_RETRY_S = 30.0


@dataclass(slots=True, frozen=True)
class ModelLimits:
    """The static facts about the served model, read once from a ready scheduler."""

    model_id: str
    max_model_len: int
    vocab_size: int
    block_size: int


def parse_scheduler_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Scheduler addresses from a comma-separated string (or a list of them), in order.

    Raises ValueError when there is none, or one is given twice.
    """
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    parsed = [a.strip() for item in items for a in item.split(",") if a.strip()]
    if not parsed:
        raise ValueError("no scheduler address given")
    seen: set[str] = set()
    for a in parsed:
        if a in seen:
            raise ValueError(f"scheduler address {a} given twice")
        seen.add(a)
    return parsed


@dataclass(eq=False)
class SchedulerReplica:
    """One scheduler as this router sees it."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    ready: bool = False  # as last seen: GetSchedulerInfo answered ready, no failure since
    outstanding: int = 0  # Generate streams forwarded to it, not yet ended
    limits: ModelLimits | None = None  # from its last ready GetSchedulerInfo
    # Bumped when a request sees the scheduler fail: a readiness poll that was already
    # under way then cannot mark it ready again.
    generation: int = field(default=0, repr=False)


def rendezvous_weight(key: bytes, address: str) -> int:
    """The highest-random-weight score of `address` for `key` (64 bits of blake2b)."""
    digest = hashlib.blake2b(key + b"\0" + address.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def tie_key(prompt_token_ids: Sequence[int], block_hashes: Sequence[bytes]) -> bytes:
    """The bytes rendezvous hashing breaks ties with: the prompt's last full block hash
    (which names the prompt up to there), or its ids (little-endian uint32) without one."""
    if block_hashes:
        return block_hashes[-1]
    return struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)


class SchedulerPool:
    """The schedulers a router spreads requests over (see the module docstring).

    Single-threaded (the router's event loop): no locks.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """Raises ValueError for a `cache_threshold` outside [0, 1] or a negative
        `balance_abs_threshold`, or bad `addresses` (`parse_scheduler_addresses`)."""
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        # Reconnect within a second once a scheduler (re)appears: health follows it closely.
        options = [
            *channel_options(max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.kv_index = KvIndex()
        self._kv_tasks: list[asyncio.Task[None]] = []
        self.replicas: list[SchedulerReplica] = []
        for address in parse_scheduler_addresses(addresses):
            channel = grpc.aio.insecure_channel(address, options=options)
            self.replicas.append(
                SchedulerReplica(address, channel, scheduler_pb2_grpc.SchedulerStub(channel))
            )
        self._changed = asyncio.Event()
        self._limits: ModelLimits | None = None
        self._warned_mismatch = False
        for replica in self.replicas:
            self._export(replica)

    @property
    def model_name(self) -> str:
        """The `model_name` label of this router's metrics: the model id of `limits`, ""
        until a scheduler has been ready."""
        return self._limits.model_id if self._limits is not None else ""

    def _export(self, replica: SchedulerReplica) -> None:
        """Sets `replica`'s gauges (outstanding requests, KV index blocks, readiness)."""
        labels = (self.model_name, replica.address)
        OUTSTANDING_REQUESTS.labels(*labels).set(replica.outstanding)
        KV_INDEX_BLOCKS.labels(*labels).set(self.kv_index.num_blocks(replica.address))
        SCHEDULER_READY.labels(*labels).set(int(replica.ready))

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self.replicas]

    @property
    def limits(self) -> ModelLimits | None:
        """The model's limits, once any scheduler has been ready (kept while none is).

        Taken from the first ready scheduler in address order, with the smallest
        `max_model_len` of the ready ones: every replica must accept every request.
        """
        return self._limits

    def ready_replicas(self) -> list[SchedulerReplica]:
        return [r for r in self.replicas if r.ready]

    @property
    def any_ready(self) -> bool:
        return any(r.ready for r in self.replicas)

    def pick(
        self, prompt_token_ids: Sequence[int], exclude: Sequence[SchedulerReplica] = ()
    ) -> SchedulerReplica | None:
        """The ready scheduler (not in `exclude`) that the module docstring's policy
        chooses for this prompt; None when there is none."""
        candidates = [r for r in self.replicas if r.ready and r not in exclude]
        if len(candidates) < 2:
            return candidates[0] if candidates else None  # no hashing for one replica
        block_size = self._limits.block_size if self._limits else DEFAULT_BLOCK_SIZE
        hashes = prompt_block_hashes(prompt_token_ids, block_size)
        fewest = min(r.outstanding for r in candidates)
        matched = self.kv_index.longest_prefix(hashes) if hashes else {}
        eligible = [r for r in candidates if r.outstanding <= fewest + self.balance_abs_threshold]
        best = max((matched.get(r.address, 0) for r in eligible), default=0)
        if best and best > self.cache_threshold * len(hashes):
            candidates = [r for r in eligible if matched.get(r.address, 0) == best]
        if len(candidates) == 1:
            return candidates[0]
        key = tie_key(prompt_token_ids, hashes)
        return min(
            candidates,
            key=lambda r: (
                r.outstanding,
                self.kv_index.num_blocks(r.address),
                -rendezvous_weight(key, r.address),
            ),
        )

    def start_kv_events(self) -> None:
        """Follows every scheduler's KV events into `kv_index` (one task each) until
        `close`. Call from the router's event loop."""
        if not self._kv_tasks:
            self._kv_tasks = [asyncio.create_task(self._follow_kv_events(r)) for r in self.replicas]

    async def _follow_kv_events(self, replica: SchedulerReplica) -> None:
        """Applies `replica`'s KV events to the index; when the stream breaks (the
        scheduler stopped, restarted, or has no such RPC), forgets its entries and
        subscribes again after a backoff (0.1 s doubling to `KV_EVENTS_MAX_BACKOFF_S`;
        `KV_EVENTS_UNIMPLEMENTED_RETRY_S` for a scheduler without the RPC)."""
        backoff = 0.1
        while True:
            try:
                call = replica.stub.SubscribeKvEvents(scheduler_pb2.SubscribeKvEventsRequest())
                async for events in call:
                    self.kv_index.apply(replica.address, events)
                    self._export(replica)
                    backoff = 0.1
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNIMPLEMENTED:  # an older scheduler: load only
                    backoff = KV_EVENTS_UNIMPLEMENTED_RETRY_S
                if code != grpc.StatusCode.UNAVAILABLE:
                    log.warning("kv_events_failed", scheduler=replica.address, error=code.name)
            self.kv_index.clear(replica.address)
            self._export(replica)
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, max(backoff, KV_EVENTS_MAX_BACKOFF_S))

    def begin(self, replica: SchedulerReplica) -> None:
        """A request was forwarded to `replica`."""
        replica.outstanding += 1
        self._export(replica)

    def end(self, replica: SchedulerReplica) -> None:
        """A request forwarded to `replica` ended (finished, failed or cancelled)."""
        replica.outstanding -= 1
        self._export(replica)

    def mark_unavailable(self, replica: SchedulerReplica, reason: str) -> None:
        """`replica` failed a request with UNAVAILABLE: no new requests go to it until a
        readiness poll started after now sees it ready again."""
        replica.generation += 1
        self._set_ready(replica, False, reason)
        self._changed.set()

    async def refresh(self, timeout_s: float) -> bool:
        """Asks every scheduler at once whether it is ready (`GetSchedulerInfo`); records the
        answers and the model limits. True when at least one is ready.

        A scheduler that does not answer within `timeout_s` seconds is not ready.
        """
        self._changed.clear()
        await asyncio.gather(*(self._poll(r, timeout_s) for r in self.replicas))
        self._update_limits()
        return self.any_ready

    async def _poll(self, replica: SchedulerReplica, timeout_s: float) -> None:
        generation = replica.generation
        try:
            info = await replica.stub.GetSchedulerInfo(
                scheduler_pb2.GetSchedulerInfoRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            self._set_ready(replica, False, e.details() or e.code().name)
            return
        if not info.ready:
            self._set_ready(replica, False, "scheduler not ready")
            return
        replica.limits = ModelLimits(
            info.model_id, info.max_model_len, info.vocab_size, info.block_size
        )
        if replica.generation == generation:  # no failure seen while the poll was out
            self._set_ready(replica, True, "")

    def _set_ready(self, replica: SchedulerReplica, ready: bool, reason: str) -> None:
        if replica.ready == ready:
            return
        replica.ready = ready
        self._export(replica)
        if ready:
            log.info("scheduler_ready", scheduler=replica.address)
        else:
            log.warning("scheduler_unavailable", scheduler=replica.address, error=reason)

    def _update_limits(self) -> None:
        ready = [r.limits for r in self.replicas if r.ready and r.limits is not None]
        if not ready:
            return
        first = ready[0]
        differ = any(
            (lim.model_id, lim.vocab_size, lim.block_size)
            != (first.model_id, first.vocab_size, first.block_size)
            for lim in ready
        )
        if differ and not self._warned_mismatch:
            log.warning(
                "schedulers_disagree",
                schedulers=[r.address for r in self.replicas if r.ready],
                model_ids=sorted({lim.model_id for lim in ready}),
            )
        self._warned_mismatch = differ
        previous = self.model_name
        self._limits = ModelLimits(
            first.model_id,
            min(lim.max_model_len for lim in ready),
            first.vocab_size,
            first.block_size,
        )
        if self.model_name != previous:  # the first ready scheduler, or another model
            init_series(self.model_name)
            for replica in self.replicas:
                for gauge in SCHEDULER_GAUGES:
                    with contextlib.suppress(KeyError):  # gone: another pool of this process
                        gauge.remove(previous, replica.address)
                self._export(replica)

    async def wait_changed(self, timeout_s: float) -> None:
        """Returns after `timeout_s` seconds, or sooner once a scheduler is marked
        unavailable (the health watcher then polls at once)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def close(self) -> None:
        for task in self._kv_tasks:
            task.cancel()
        for task in self._kv_tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._kv_tasks = []
        for r in self.replicas:
            await r.channel.close()


def merge_scheduler_infos(
    infos: Sequence[scheduler_pb2.SchedulerInfo],
) -> scheduler_pb2.SchedulerInfo:
    """One `SchedulerInfo` for several ready schedulers of the same model.

    Model facts (model id, vocab size, block size) are the first one's;
    `max_model_len` is the smallest. Sizes, queue lengths and every `_total`
    counter (KV blocks, free blocks, requests running and waiting, KV and
    prefix-cache counters, preemptions, step times) are summed over the
    schedulers. `kv_cache.utilization`, a ratio, is the mean weighted by each
    scheduler's blocks held by live requests (its plain mean when none holds
    any), so it stays tokens stored / slots allocated over all of them. With one
    scheduler the result equals its own info.
    """
    if not infos:
        raise ValueError("no scheduler info to merge")
    first = infos[0]
    merged = scheduler_pb2.SchedulerInfo(
        ready=True,
        model_id=first.model_id,
        max_model_len=min(i.max_model_len for i in infos),
        block_size=first.block_size,
        vocab_size=first.vocab_size,
    )
    if len(infos) == 1:
        merged.CopyFrom(first)
        return merged
    for name in ("num_kv_blocks", "num_free_kv_blocks", "num_requests_running",
                 "num_requests_waiting"):  # fmt: skip
        setattr(merged, name, sum(getattr(i, name) for i in infos))
    for fd in scheduler_pb2.KvCacheStats.DESCRIPTOR.fields:
        if fd.name != "utilization":
            setattr(merged.kv_cache, fd.name, sum(getattr(i.kv_cache, fd.name) for i in infos))
    held = [max(i.num_kv_blocks - i.num_free_kv_blocks, 0) for i in infos]
    if sum(held):
        merged.kv_cache.utilization = sum(
            i.kv_cache.utilization * h for i, h in zip(infos, held, strict=True)
        ) / sum(held)
    else:
        merged.kv_cache.utilization = sum(i.kv_cache.utilization for i in infos) / len(infos)
    for fd in merged.step_times.DESCRIPTOR.fields:
        setattr(merged.step_times, fd.name, sum(getattr(i.step_times, fd.name) for i in infos))
    return merged
