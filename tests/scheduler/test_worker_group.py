"""Which registrations a tensor-parallel group keeps: the same process registering again
keeps its peers, a restarted rank (a new worker_id) starts a new generation."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluiceway.ports import free_port
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.worker_group import WorkerGroup, WorkerInfo


def rank(r: int, worker_id: str) -> WorkerInfo:
    return WorkerInfo(
        address=f"127.0.0.1:{50061 + r}", rank=r, model_id="m", num_kv_blocks=8, block_size=16,
        max_model_len=128, vocab_size=100, tensor_parallel_size=2, worker_id=worker_id,
    )  # fmt: skip


def test_same_process_keeps_its_peers_a_restarted_rank_starts_a_new_generation() -> None:
    async def main() -> list[tuple[bool, list[str]]]:
        group = WorkerGroup(0, "both", 2, SchedulerConfig(tensor_parallel_size=2))
        seen = []
        for info in [rank(0, "a"), rank(1, "b"), rank(0, "a"), rank(0, "c"), rank(1, "b"),
                     rank(1, "")]:  # fmt: skip
            complete = await group.add_rank(info)
            seen.append((complete, [group.ranks[r].worker_id for r in sorted(group.ranks)]))
        for channel in group._channels.values():
            await channel.close()
        return seen

    assert asyncio.run(main()) == [
        (False, ["a"]),
        (True, ["a", "b"]),
        (True, ["a", "b"]),  # rank 0 registered again without restarting
        (False, ["c"]),  # rank 0 restarted: rank 1's process group broke with it
        (True, ["c", "b"]),
        (False, [""]),  # no id: taken as a restart
    ]


async def _health_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server


def test_a_rank_back_at_its_old_address_answers_the_first_probe() -> None:
    """A worker restarted at the address it had (a container's fixed port), after its
    scheduler failed to reach the dead one: the group's new channel must not share the old
    channel's connection and its reconnect backoff (gRPC shares them between channels of
    one target and options), or the first idle probe fails UNAVAILABLE at once and the
    scheduler drops the worker it has just registered, for good; the worker, registered,
    never registers again (found by tests/integration/test_compose_cpu.py)."""

    async def main() -> None:
        port = free_port()
        group = WorkerGroup(0, "both", 1, SchedulerConfig())
        info = WorkerInfo(address=f"127.0.0.1:{port}", rank=0, model_id="m", num_kv_blocks=8,
                          block_size=16, max_model_len=128, vocab_size=100, worker_id="a")  # fmt: skip
        server = await _health_server(port)
        await group.add_rank(info)
        await group.probe(5)
        await server.stop(None)  # the worker dies
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await group.probe(5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        server = await _health_server(port)  # back, at the same address
        await group.add_rank(dataclasses.replace(info, worker_id="b"))
        try:
            await group.probe(5)
        finally:
            await group.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_draft_that_reads_the_models_kv_is_explored_again_where_plain_decoding_won() -> None:
    """A draft model's explored step catches its K/V up (a new sequence's whole prompt), so
    where plain decoding won it is not tried again; a draft of the model's own weights reads
    the model's K/V (worker.draft) and is explored as n-gram lookup is. Speculation needs a
    batch-invariant worker with the draft loaded, else it is off."""
    draft = '{"method": "draft_model", "model": "d", "num_speculative_tokens": 3}'
    config = SchedulerConfig(speculative_config=draft)
    one = dataclasses.replace(rank(0, "a"), tensor_parallel_size=1, batch_invariant=True)

    def explore_every(**fields: bool) -> int | None:
        group = WorkerGroup(0, "both", 1, config)
        group.ranks[0] = dataclasses.replace(one, **fields)
        scheduler = group.new_scheduler(128)
        if scheduler.speculative is None:
            return None
        return scheduler.gate.explore_speculation_every

    assert explore_every(has_draft_model=True) == 0
    assert explore_every(has_draft_model=True, draft_reads_model_kv=True) == 32
    assert explore_every(has_draft_model=False) is None
    assert explore_every(has_draft_model=True, batch_invariant=False) is None
