"""A router over several schedulers: the pick policy, then the real router over fake schedulers.

The fakes are in-process `Scheduler` gRPC servers that stream a few fixed tokens; the router is
the real `RequestPath` behind `start_router` (its health watcher polling every 0.1 s).
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.router.balancer import (
    SchedulerPool,
    merge_scheduler_infos,
    parse_scheduler_addresses,
)
from sluiceway.router.grpc_api import Router, start_router
from sluiceway.router.request_path import RequestPath
from sluiceway.status import RequestError, abort
from sluiceway.v1 import inference_pb2, inference_pb2_grpc

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
VOCAB_SIZE = 49152  # SmolLM2's


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def prompt(i: int, length: int = 24) -> list[int]:
    """A prompt whose first block (16 ids) differs for every i."""
    return [1000 + 37 * i + k for k in range(length)]


# --- the pick policy -------------------------------------------------------------------------


async def _pool(n: int, **kwargs: Any) -> SchedulerPool:
    pool = SchedulerPool([f"127.0.0.1:{1 + k}" for k in range(n)], **kwargs)
    for r in pool.replicas:
        r.ready = True
    return pool


def test_parse_scheduler_addresses() -> None:
    assert parse_scheduler_addresses("127.0.0.1:50051") == ["127.0.0.1:50051"]
    assert parse_scheduler_addresses("a:1, b:2,unix:/tmp/s.sock,") == [
        "a:1",
        "b:2",
        "unix:/tmp/s.sock",
    ]
    assert parse_scheduler_addresses(["a:1", "b:2,c:3"]) == ["a:1", "b:2", "c:3"]
    with pytest.raises(ValueError, match="no scheduler"):
        parse_scheduler_addresses(" , ")
    with pytest.raises(ValueError, match="twice"):
        parse_scheduler_addresses("a:1,b:2,a:1")


def test_pick_prefers_the_fewest_outstanding_requests_among_the_ready() -> None:
    async def main() -> None:
        pool = await _pool(3)
        a, b, c = pool.replicas
        a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
        for i in range(20):
            assert pool.pick(prompt(i)) is b
        b.ready = False  # not ready: skipped however idle
        b.outstanding = 0
        assert all(pool.pick(prompt(i)) is c for i in range(20))
        pool.begin(c)
        pool.begin(c)  # c: 4 outstanding, a: 3
        assert pool.pick(prompt(0)) is a
        pool.end(c)
        pool.end(c)
        assert pool.pick(prompt(0), exclude=[c]) is a
        assert [r.outstanding for r in pool.replicas] == [3, 0, 2]
        await pool.close()

    run(main())


def test_pick_returns_none_when_no_scheduler_is_ready() -> None:
    async def main() -> None:
        pool = await _pool(2)
        pool.replicas[0].ready = False
        assert pool.pick(prompt(0), exclude=[pool.replicas[1]]) is None
        pool.replicas[1].ready = False
        assert pool.pick(prompt(0)) is None
        assert not pool.any_ready
        await pool.close()

    run(main())


def test_ties_go_by_the_last_full_block_stably_and_spread() -> None:
    async def main() -> None:
        pool = await _pool(2)  # nothing in the KV index: load, then rendezvous
        picks = [pool.pick(prompt(i)) for i in range(100)]
        counts = {r.address: sum(p is r for p in picks) for r in pool.replicas}
        assert all(20 <= n <= 80 for n in counts.values()), counts
        # stable: the same prompt, or one with the same full blocks, goes to the same one
        for i in range(100):
            assert pool.pick(prompt(i)) is picks[i]
            assert pool.pick([*prompt(i)[:16], 7, 8, 9]) is picks[i]
        # a prompt shorter than a block hashes what it has
        assert pool.pick([5, 6]) is pool.pick([5, 6])
        # another pool over the same addresses (another router process) chooses the same
        again = await _pool(2)
        assert [again.pick(prompt(i)).address for i in range(100)] == [  # type: ignore[union-attr]
            p.address  # type: ignore[union-attr]
            for p in picks
        ]
        await pool.close()
        await again.close()

    run(main())


def test_rendezvous_moves_only_the_prompts_of_a_scheduler_that_leaves() -> None:
    async def main() -> None:
        pool = await _pool(3)
        before = [pool.pick(prompt(i)) for i in range(150)]
        assert {p.address for p in before if p is not None} == set(pool.addresses)
        gone = pool.replicas[1]
        gone.ready = False
        after = [pool.pick(prompt(i)) for i in range(150)]
        for b, a in zip(before, after, strict=True):
            assert a is not gone
            if b is not gone:
                assert a is b
        await pool.close()

    run(main())


def test_refresh_without_any_scheduler_is_not_ready() -> None:
    async def main() -> None:
        pool = SchedulerPool("127.0.0.1:1")  # one address, as a plain string
        assert pool.addresses == ["127.0.0.1:1"]
        t0 = time.monotonic()
        assert await pool.refresh(timeout_s=1.0) is False
        assert time.monotonic() - t0 < 2.0
        assert pool.limits is None and pool.pick(prompt(0)) is None
        await pool.close()

    run(main())


def test_merge_scheduler_infos_sums_counters() -> None:
    def info(blocks: int, free: int, util: float, k: int) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            ready=True, model_id="m", max_model_len=2048 * k, block_size=16,
            vocab_size=VOCAB_SIZE, num_kv_blocks=blocks, num_free_kv_blocks=free,
            num_requests_running=k, num_requests_waiting=2 * k,
            kv_cache=scheduler_pb2.KvCacheStats(
                utilization=util, tokens_stored_total=100 * k, slots_allocated_total=200 * k,
                prefix_cache_queries_total=10 * k, prefix_cache_hits_total=k,
                num_preemptions_total=k,
            ),
            step_times=inference_pb2.StepTimes(num_steps_total=5 * k, execute_seconds_total=k),
        )  # fmt: skip

    a, b = info(100, 90, 0.5, 1), info(300, 270, 1.0, 2)
    assert merge_scheduler_infos([a]) == a
    m = merge_scheduler_infos([a, b])
    assert (m.model_id, m.max_model_len, m.block_size, m.vocab_size) == ("m", 2048, 16, VOCAB_SIZE)
    assert (m.num_kv_blocks, m.num_free_kv_blocks) == (400, 360)
    assert (m.num_requests_running, m.num_requests_waiting) == (3, 6)
    assert m.kv_cache.tokens_stored_total == 300 and m.kv_cache.slots_allocated_total == 600
    assert m.kv_cache.prefix_cache_queries_total == 30 and m.kv_cache.prefix_cache_hits_total == 3
    assert m.kv_cache.num_preemptions_total == 3
    assert m.step_times.num_steps_total == 15 and m.step_times.execute_seconds_total == 3
    # weighted by blocks in use: (0.5 x 10 + 1.0 x 30) / 40
    assert m.kv_cache.utilization == pytest.approx(0.875)
    idle = merge_scheduler_infos([info(100, 100, 0.5, 1), info(100, 100, 1.0, 1)])
    assert idle.kv_cache.utilization == pytest.approx(0.75)


# --- the router over fake schedulers ---------------------------------------------------------


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams `max_tokens` events (token 100 + i), one every `delay_s`, after the request's
    `output_token_ids` (a resumed stream); records request ids and those outputs.

    While `gate` is set, every stream waits for it after its first event. With
    `fail_add`, AddRequest fails with UNAVAILABLE before any token.
    """

    def __init__(self, *, num_kv_blocks: int = 100, delay_s: float = 0.01) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.delay_s = delay_s
        self.fail_add = False
        self.gate: asyncio.Event | None = None
        self.requests: list[str] = []
        self.resumed: dict[str, list[int]] = {}  # request id -> its output_token_ids
        self.address = ""
        self.server: grpc.aio.Server | None = None

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.requests.append(request.request_id)
        if request.output_token_ids:
            self.resumed[request.request_id] = list(request.output_token_ids)
        if self.fail_add:
            await abort(context, RequestError(UNAVAILABLE, "no worker is ready"))  # as a scheduler
        for i in range(len(request.output_token_ids), request.sampling.max_tokens):
            if i == 1 and self.gate is not None and not request.output_token_ids:
                await self.gate.wait()
            await asyncio.sleep(self.delay_s)
            last = i == request.sampling.max_tokens - 1
            event = scheduler_pb2.TokenEvent(
                token_ids=[100 + i],
                finish_reason=inference_pb2.FINISH_REASON_LENGTH if last else 0,  # type: ignore[arg-type]
            )
            if i == 0:
                event.queue_seconds = 0.001
            yield event

    async def GetSchedulerInfo(  # type: ignore[override]
        self, request: scheduler_pb2.GetSchedulerInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            ready=True, model_id="fake", max_model_len=4096, block_size=16,
            vocab_size=VOCAB_SIZE, num_kv_blocks=self.num_kv_blocks,
            num_free_kv_blocks=self.num_kv_blocks - 10,
            kv_cache=scheduler_pb2.KvCacheStats(prefix_cache_queries_total=self.num_kv_blocks),
        )  # fmt: skip

    async def start(self) -> None:
        self.server, _ = new_server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self, self.server)
        self.address = bind(self.server, "127.0.0.1:0")
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(None)


Scenario = Callable[[Router, list[FakeScheduler], grpc.aio.Channel], Awaitable[None]]


async def _with_router(
    tokenizer: Any, model_dir: pathlib.Path, fakes: list[FakeScheduler], scenario: Scenario
) -> None:
    """Starts `fakes` and a router over them, runs `scenario` with a channel to the router."""
    for f in fakes:
        await f.start()
    path = RequestPath(tokenizer, model_dir, [f.address for f in fakes])
    router = await start_router(path, "127.0.0.1:0", poll_s=0.1)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await _wait_health(channel, SERVING)
        await scenario(router, fakes, channel)
    finally:
        await channel.close()
        await router.stop(None)
        for f in fakes:
            await f.stop()


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return reply.status  # type: ignore[no-any-return]


async def _wait_health(channel: grpc.aio.Channel, status: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await _health(channel) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        await asyncio.sleep(0.02)


def _request(i: int, max_tokens: int = 4, rid: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=inference_pb2.TokenIds(ids=prompt(i)),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def _generate(
    channel: grpc.aio.Channel,
    request: inference_pb2.GenerateRequest,
    first: asyncio.Event | None = None,
) -> list[int] | tuple[grpc.StatusCode, str]:
    """The token ids streamed back, or the status code and details the stream ended with."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    ids: list[int] = []
    try:
        async for r in stub.Generate(request, timeout=30):
            ids.extend(r.token_ids)
            if first is not None:
                first.set()
        assert r.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        return ids
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


async def _model_info(channel: grpc.aio.Channel) -> inference_pb2.ModelInfo:
    stub = inference_pb2_grpc.InferenceStub(channel)
    return await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=5)


def _gauge(name: str, scheduler: str, model_name: str = "fake") -> float | None:
    labels = {"model_name": model_name, "scheduler": scheduler}
    return REGISTRY.get_sample_value(f"sluiceway:{name}", labels)


TOKENS = [100, 101, 102, 103]


def test_concurrent_requests_spread_over_both_schedulers(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        results = await asyncio.gather(*(_generate(ch, _request(i)) for i in range(20)))
        assert results == [TOKENS] * 20
        a, b = fakes
        assert len(a.requests) >= 3 and len(b.requests) >= 3
        assert len(a.requests) + len(b.requests) == 20
        assert [r.outstanding for r in router.path.pool.replicas] == [0, 0]
        assert router.path.num_in_flight == 0
        for f in fakes:
            assert _gauge("router_outstanding_requests", f.address) == 0
            assert _gauge("router_scheduler_ready", f.address) == 1
            # exported under model_name "" until the first ready scheduler named the model
            assert _gauge("router_scheduler_ready", f.address, model_name="") is None
        # the request series of the model, created when the first scheduler was ready
        unseen = {"model_name": "fake", "code": "DATA_LOSS", "protocol": "http"}
        assert REGISTRY.get_sample_value("sluiceway:request_failure_total", unseen) == 0.0
        # model facts from one, counters summed over both
        info = await _model_info(ch)
        assert (info.model_id, info.max_model_len, info.block_size) == ("fake", 4096, 16)
        assert info.num_kv_blocks == a.num_kv_blocks + b.num_kv_blocks == 100 + 300
        assert info.num_free_kv_blocks == 90 + 290
        assert info.prefix_cache_queries_total == 400
        assert info.step_times.detokenized_tokens_total == 20 * 4

    fakes = [FakeScheduler(), FakeScheduler(num_kv_blocks=300)]
    run(_with_router(tokenizer, tokenizer_dir, fakes, scenario))


def test_a_failed_scheduler_s_streams_resume_on_the_other_which_takes_over(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        a, b = fakes
        a.gate, b.gate = asyncio.Event(), asyncio.Event()
        firsts = [asyncio.Event() for _ in range(10)]
        rids = [f"held-{i}" for i in range(10)]
        streams = [
            asyncio.create_task(_generate(ch, _request(i, rid=rids[i]), firsts[i]))
            for i in range(10)
        ]
        await asyncio.gather(*(e.wait() for e in firsts))  # every stream has sent a token
        assert len(a.requests) == 5 and len(b.requests) == 5  # held: outstanding alternates
        pool = router.path.pool
        assert [r.outstanding for r in pool.replicas] == [5, 5]
        assert _gauge("router_outstanding_requests", a.address) == 5
        on_a = list(a.requests)
        await a.stop()  # fails mid-request: its streams go on on b after the token sent
        b.gate.set()
        results = dict(zip(rids, await asyncio.gather(*streams), strict=True))
        assert all(results[rid] == TOKENS for rid in rids), results  # none lost or repeated
        assert b.resumed == {rid: [100] for rid in on_a}
        assert len(a.requests) == 5 and len(b.requests) == 10
        assert not pool.replicas[0].ready and pool.replicas[1].ready
        assert _gauge("router_scheduler_ready", a.address) == 0
        assert await _health(ch) == SERVING  # one scheduler is still ready
        # later requests all go to the other scheduler, and succeed
        later = await asyncio.gather(*(_generate(ch, _request(100 + i)) for i in range(6)))
        assert later == [TOKENS] * 6
        assert len(b.requests) == 10 + 6 and len(a.requests) == 5
        info = await _model_info(ch)
        assert info.num_kv_blocks == b.num_kv_blocks  # from the ready one only
        assert [r.outstanding for r in pool.replicas] == [0, 0]
        assert router.path.num_in_flight == 0
        # none ready: NOT_SERVING, and requests get UNAVAILABLE at once
        await b.stop()
        await _wait_health(ch, NOT_SERVING, timeout_s=3)
        assert await _generate(ch, _request(0)) == (UNAVAILABLE, "no scheduler is ready")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _model_info(ch)
        assert err.value.code() == UNAVAILABLE
        assert "no scheduler is ready" in (err.value.details() or "")

    fakes = [FakeScheduler(), FakeScheduler(num_kv_blocks=300)]
    run(_with_router(tokenizer, tokenizer_dir, fakes, scenario))


def test_unavailable_before_the_first_token_is_retried_once_on_another_scheduler(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        a, b = fakes
        a.fail_add = True  # answers ready, but fails every AddRequest before a token
        await _wait_health(ch, SERVING)
        pool = router.path.pool
        while not all(r.ready for r in pool.replicas):
            await asyncio.sleep(0.02)
        i = next(i for i in range(1000) if pool.pick(prompt(i)) is pool.replicas[0])
        assert await _generate(ch, _request(i, rid="retried")) == TOKENS
        assert a.requests == ["retried"] and b.requests == ["retried"]
        assert [r.outstanding for r in pool.replicas] == [0, 0]
        # with no other ready scheduler to retry on, the client gets the error
        b.fail_add = True
        while not all(r.ready for r in pool.replicas):  # the watcher sees `a` ready again
            await asyncio.sleep(0.02)
        code, details = await _generate(ch, _request(i, rid="failed"))  # type: ignore[misc]
        assert code == UNAVAILABLE and details == "no worker is ready"
        assert a.requests.count("failed") + b.requests.count("failed") == 2  # tried once each
        assert router.path.num_in_flight == 0

    run(_with_router(tokenizer, tokenizer_dir, [FakeScheduler(), FakeScheduler()], scenario))


def test_a_single_scheduler_address_still_works(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def main() -> None:
        fake = FakeScheduler()
        await fake.start()
        path = RequestPath(tokenizer, tokenizer_dir, fake.address)  # a plain string
        assert path.pool.addresses == [fake.address]
        router = await start_router(path, "127.0.0.1:0", poll_s=0.1)
        channel = grpc.aio.insecure_channel(router.address)
        try:
            await _wait_health(channel, SERVING)
            assert await _generate(channel, _request(1)) == TOKENS
            info = await _model_info(channel)
            assert (info.num_kv_blocks, info.num_free_kv_blocks) == (100, 90)
            await fake.stop()
            await _wait_health(channel, NOT_SERVING, timeout_s=3)
        finally:
            await channel.close()
            await router.stop(None)

    run(main())
