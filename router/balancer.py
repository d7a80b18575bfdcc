"""Spreading a router's requests over several schedulers (model replicas).

Each scheduler owns its own KV cache and batching loop; the router keeps, per
scheduler, a gRPC channel, its readiness as last seen (`GetSchedulerInfo`,
polled by the router's health watcher, or an `AddRequest` that failed with
UNAVAILABLE) and its *outstanding requests*: the `Generate` streams this
router forwarded to it that have not ended yet.

Policy (`SchedulerPool.pick`):

1. Least outstanding requests: among the ready schedulers, the one with the
   fewest requests in flight from this router, as Envoy's `LEAST_REQUEST`
   load balancer and the vLLM router do. Outstanding requests stand in for
   the scheduler's load (queued prompt tokens and running sequences) without
   asking it, and adapt at once to a replica that runs slower.
2. Prefix affinity as the tie-break: among the tied schedulers, the one
   that rendezvous (highest random weight) hashing of the prompt's first KV
   block selects (Thaler & Ravishankar, "Using name-based mappings to
   increase hit rates", IEEE/ACM ToN 1998). Requests that share a system
   prompt then land on the same replica and hit its prefix cache, the
   choice moves only for the prompts of a replica that leaves or joins, and
   distinct prompts still spread evenly. The hash is blake2b, not Python's
   `hash()`, so every router process makes the same choice.
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

from router.metrics import OUTSTANDING_REQUESTS, SCHEDULER_READY
from sluiceway.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

log = structlog.get_logger("router")

# Tokens hashed for prefix affinity: the prompt's first KV block (block size 16, the
# scheduler's default; a full block is what the prefix cache can share).
AFFINITY_TOKENS = 16


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


def affinity_key(prompt_token_ids: Sequence[int], num_tokens: int = AFFINITY_TOKENS) -> bytes:
    """The bytes prefix affinity hashes: the first `num_tokens` ids, little-endian uint32."""
    head = list(prompt_token_ids[:num_tokens])
    return struct.pack(f"<{len(head)}I", *head)


class SchedulerPool:
    """The schedulers a router spreads requests over (see the module docstring).

    Single-threaded (the router's event loop): no locks.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        affinity_tokens: int = AFFINITY_TOKENS,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        # Reconnect within a second once a scheduler (re)appears: health follows it closely.
        options = [
            *channel_options(max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.affinity_tokens = affinity_tokens
        self.replicas: list[SchedulerReplica] = []
        for address in parse_scheduler_addresses(addresses):
            channel = grpc.aio.insecure_channel(address, options=options)
            self.replicas.append(
                SchedulerReplica(address, channel, scheduler_pb2_grpc.SchedulerStub(channel))
            )
            OUTSTANDING_REQUESTS.labels(address).set(0)
            SCHEDULER_READY.labels(address).set(0)
        self._changed = asyncio.Event()
        self._limits: ModelLimits | None = None
        self._warned_mismatch = False

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

    @property
    def num_outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    def pick(
        self, prompt_token_ids: Sequence[int], exclude: Sequence[SchedulerReplica] = ()
    ) -> SchedulerReplica | None:
        """The ready scheduler with the fewest outstanding requests; ties broken by
        rendezvous hashing of the prompt's first block. None when no scheduler (but those
        in `exclude`) is ready."""
        candidates = [r for r in self.replicas if r.ready and r not in exclude]
        if not candidates:
            return None
        fewest = min(r.outstanding for r in candidates)
        tied = [r for r in candidates if r.outstanding == fewest]
        if len(tied) == 1:
            return tied[0]
        key = affinity_key(prompt_token_ids, self.affinity_tokens)
        return max(tied, key=lambda r: rendezvous_weight(key, r.address))

    def begin(self, replica: SchedulerReplica) -> None:
        """A request was forwarded to `replica`."""
        replica.outstanding += 1
        OUTSTANDING_REQUESTS.labels(replica.address).set(replica.outstanding)

    def end(self, replica: SchedulerReplica) -> None:
        """A request forwarded to `replica` ended (finished, failed or cancelled)."""
        replica.outstanding -= 1
        OUTSTANDING_REQUESTS.labels(replica.address).set(replica.outstanding)

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
        SCHEDULER_READY.labels(replica.address).set(int(ready))
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
        self._limits = ModelLimits(
            first.model_id,
            min(lim.max_model_len for lim in ready),
            first.vocab_size,
            first.block_size,
        )

    async def wait_changed(self, timeout_s: float) -> None:
        """Returns after `timeout_s` seconds, or sooner once a scheduler is marked
        unavailable (the health watcher then polls at once)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def close(self) -> None:
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
