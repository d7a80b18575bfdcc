"""The scheduler process over real gRPC, with a fake worker that samples a fixed token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluiceway.scheduler import step_loop
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.engine import Engine
from sluiceway.scheduler.outputs import SchedulerOutput
from sluiceway.scheduler.server import SchedulerService
from sluiceway.status import FieldError, RequestError, abort, error_from_rpc
from sluiceway.v1 import inference_pb2

NUM_BLOCKS = 32


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """Samples token 100 + len(record) for every sequence that reaches its end; records steps.
    Runs a step after the one it names to run first (async scheduling), putting in the
    token it sampled last where the step says so."""

    def __init__(self, fail: bool = False) -> None:
        self.records: dict[int, list[int]] = {}
        self.steps: list[worker_pb2.StepRequest] = []
        self.fail = fail
        # set: the next step that computes is refused with this (then it is cleared), as a
        # real worker refuses a step it cannot run (worker/server.py)
        self.refuse: RequestError | None = None
        self.address = ""  # set by _serve
        self.server: grpc.aio.Server | None = None  # set by _serve
        self.gate: asyncio.Event | None = None  # when set, steps that compute wait for it
        self.last_sampled: dict[int, int] = {}
        self.started: set[int] = set()  # step ids

    async def ExecuteStep(self, request, context):  # type: ignore[no-untyped-def]
        if self.fail:
            await context.abort(grpc.StatusCode.INTERNAL, "worker exploded")
        if self.refuse is not None and request.scheduled:
            error, self.refuse = self.refuse, None
            await abort(context, error)
        while request.previous_step_id and request.previous_step_id not in self.started:
            await asyncio.sleep(0.001)
        self.started.add(request.step_id)
        self.steps.append(request)
        if self.gate is not None and request.scheduled:
            await self.gate.wait()
        for seq_id in request.finished_seq_ids:
            self.records.pop(seq_id, None)  # as the real worker: a refused step recorded none
        for new in request.new_sequences:
            self.records[new.seq_id] = list(new.prompt_token_ids)
        sampled = []
        for s in request.scheduled:
            rec = self.records[s.seq_id]
            rec.extend(s.appended_token_ids)
            if s.append_last_sampled:
                rec.append(self.last_sampled.pop(s.seq_id))
            if s.num_computed_tokens + s.num_new_tokens == len(rec):
                sampled.append(worker_pb2.SampledToken(seq_id=s.seq_id, token_id=100 + len(rec)))
                self.last_sampled[s.seq_id] = 100 + len(rec)
        await asyncio.sleep(0.001)
        return worker_pb2.StepResponse(step_id=request.step_id, sampled=sampled)


@pytest.fixture
def fake() -> FakeWorker:
    return FakeWorker()


async def _serve(fake: FakeWorker, config: SchedulerConfig):  # type: ignore[no-untyped-def]
    worker_server, _ = new_server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, worker_server)
    worker_addr = bind(worker_server, "127.0.0.1:0")
    fake.address = worker_addr
    fake.server = worker_server
    await worker_server.start()
    engine = Engine(config)
    sched_server, _ = new_server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(engine), sched_server)
    sched_addr = bind(sched_server, "127.0.0.1:0")
    await sched_server.start()
    engine.start()
    channel = grpc.aio.insecure_channel(sched_addr)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    await stub.RegisterWorker(
        scheduler_pb2.RegisterWorkerRequest(
            address=worker_addr, num_kv_blocks=NUM_BLOCKS, block_size=16, max_model_len=4096,
            vocab_size=1000, model_id="fake",
        )
    )  # fmt: skip

    async def close() -> None:
        await channel.close()
        await sched_server.stop(None)
        await engine.stop()
        await worker_server.stop(None)

    return stub, close


def add_request(n_prompt: int, max_tokens: int, rid: str = "r") -> scheduler_pb2.AddRequestRequest:
    return scheduler_pb2.AddRequestRequest(
        request_id=rid,
        prompt_token_ids=list(range(1, n_prompt + 1)),
        sampling=inference_pb2.SamplingParams(
            temperature=0, max_tokens=max_tokens, stop_token_ids=[2]
        ),
    )


async def collect(stub: scheduler_pb2_grpc.SchedulerStub, i: int) -> list[int]:
    """The tokens of request r{i}: a prompt of 5 + i tokens, 6 tokens out."""
    events = await _collect(stub, add_request(5 + i, 6, f"r{i}"))
    return [t for e in events for t in e.token_ids]


async def free_blocks(stub: scheduler_pb2_grpc.SchedulerStub) -> int:
    info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
    return info.num_free_kv_blocks


def test_tokens_stream_back_and_blocks_return(fake: FakeWorker) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        events = [e async for e in stub.AddRequest(add_request(20, 5))]
        assert [list(e.token_ids) for e in events] == [[120], [121], [122], [123], [124]]
        assert [e.finish_reason for e in events][-1] == inference_pb2.FINISH_REASON_LENGTH
        assert await free_blocks(stub) == NUM_BLOCKS
        await close()

    asyncio.run(main())


def test_cancelled_stream_frees_blocks_and_worker_forgets(fake: FakeWorker) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        call = stub.AddRequest(add_request(40, 200))
        it = call.__aiter__()
        await it.__anext__()
        await it.__anext__()
        assert await free_blocks(stub) < NUM_BLOCKS
        call.cancel()
        for _ in range(100):
            if await free_blocks(stub) == NUM_BLOCKS and not fake.records:
                break
            await asyncio.sleep(0.01)
        assert await free_blocks(stub) == NUM_BLOCKS
        # the next request runs normally after the abort
        events = [e async for e in stub.AddRequest(add_request(3, 2))]
        assert len(events) == 2
        for _ in range(100):  # the step after the last one tells the worker to forget it
            if not fake.records:
                break
            await asyncio.sleep(0.01)
        assert fake.records == {}
        assert fake.steps[-1].finished_seq_ids and not fake.steps[-1].scheduled
        await close()

    asyncio.run(main())


def test_async_scheduling_sends_each_step_while_the_one_before_runs(fake: FakeWorker) -> None:
    """The same tokens as the synchronous loop; decoding steps name the step before them
    and take the token it sampled; a stream cancelled meanwhile gives its blocks back."""

    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig(max_num_seqs=8, async_scheduling=True))

        outs = await asyncio.gather(*(collect(stub, i) for i in range(8)))
        assert outs == [[100 + 5 + i + k for k in range(6)] for i in range(8)]
        overlapped = [s for s in fake.steps if s.previous_step_id]
        assert len(overlapped) >= 5  # 6 tokens: the steps after the prompts' one
        # every decode but the first after a prompt's step (sent with it) or a later one
        taken = sum(x.append_last_sampled for s in overlapped for x in s.scheduled)
        assert 8 * 4 <= taken <= 8 * 5
        # max_tokens known in advance: no step computes past a sequence's 6th token
        assert sum(len(s.scheduled) for s in fake.steps) == 8 * 6
        assert await free_blocks(stub) == NUM_BLOCKS

        call = stub.AddRequest(add_request(40, 200))
        it = call.__aiter__()
        for _ in range(3):
            await it.__anext__()
        call.cancel()
        for _ in range(200):
            if await free_blocks(stub) == NUM_BLOCKS and not fake.records:
                break
            await asyncio.sleep(0.01)
        assert await free_blocks(stub) == NUM_BLOCKS
        assert fake.records == {}
        await close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("shares", "bound_s"),
    [
        ([(2048, 0)], 10 + 20.48 + 0.01 + 5e-6 * 2048 * 2048),  # a chunk from position 0
        ([(2048, 6143)], 10 + 20.48 + 0.01 + 5e-6 * 2048 * 8191),  # an 8,191-token prompt's last
        ([(1, 320)] * 200, 10 + 2.0 + 2.0 + 5e-6 * 200 * 321),  # 200 decodes at context 320
    ],
)
def test_the_watchdog_bound_grows_with_the_pairs_a_step_attends(
    shares: list[tuple[int, int]], bound_s: float
) -> None:
    """A step's bound: 10 s + 10 ms a token + 10 ms a sequence + 5 us an attended (query, key)
    pair (a chunk of n tokens after c computed: n * (c + n)). Without the pairs' term the last
    chunk of a long prompt (16 s measured on a slow host) timed out on a starved one."""
    out = SchedulerOutput(scheduled=[
        SimpleNamespace(num_new_tokens=n, num_computed_tokens=c)  # type: ignore[misc]
        for n, c in shares
    ])  # fmt: skip
    assert step_loop.step_timeout_s(out) == pytest.approx(bound_s, rel=1e-12)


def test_an_overlapped_steps_watchdog_bound_is_its_own_plus_the_step_before_it(
    fake: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Async scheduling: the bound of a step sent while another runs covers both steps,
    not every step before them (a bound that grew by ~10 s a step would never catch a
    hung worker)."""
    bounds: list[tuple[float, float]] = []  # (the step's bound, what it should be)
    send = step_loop.StepLoop._send

    def recording_send(self, sched, out, t0, previous=None):  # type: ignore[no-untyped-def]
        sent = send(self, sched, out, t0, previous)
        own = step_loop.step_timeout_s(out)
        bounds.append((sent.timeout_s, own + (step_loop.step_timeout_s(previous.out)
                                               if previous else 0.0)))  # fmt: skip
        return sent

    monkeypatch.setattr(step_loop.StepLoop, "_send", recording_send)

    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig(max_num_seqs=8, async_scheduling=True))
        events = [e async for e in stub.AddRequest(add_request(5, 40))]
        assert sum(len(e.token_ids) for e in events) == 40
        await close()

    asyncio.run(main())
    assert len(bounds) >= 39
    assert all(got == pytest.approx(want) for got, want in bounds), bounds
    assert max(got for got, _ in bounds) < 2 * step_loop.STEP_TIMEOUT_FLOOR_S + 1


def test_max_model_len_is_capped_by_the_pool_and_longer_prompts_are_invalid(
    fake: FakeWorker,
) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
            assert info.max_model_len == NUM_BLOCKS * 16  # the worker said 4096
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.AddRequest(add_request(NUM_BLOCKS * 16, 4)):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_model_len is 512" in (err.value.details() or "")
        finally:
            await close()

    asyncio.run(main())


def test_worker_failure_ends_requests_with_unavailable() -> None:
    async def main() -> None:
        stub, close = await _serve(FakeWorker(fail=True), SchedulerConfig())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.AddRequest(add_request(10, 4)):
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await free_blocks(stub) == NUM_BLOCKS
        await close()

    asyncio.run(main())


def test_concurrent_requests_share_steps(fake: FakeWorker) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig(max_num_seqs=8))

        outs = await asyncio.gather(*(collect(stub, i) for i in range(8)))
        for i, out in enumerate(outs):
            n = 5 + i
            assert out == [100 + n + k for k in range(6)]
        assert max(len(s.scheduled) for s in fake.steps) == 8
        assert await free_blocks(stub) == NUM_BLOCKS
        await close()

    asyncio.run(main())


def test_a_sequence_that_outgrows_the_pool_ends_with_length(fake: FakeWorker) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            prompt_len = NUM_BLOCKS * 16 - 8
            events = [e async for e in stub.AddRequest(add_request(prompt_len, 50))]
            assert sum(len(e.token_ids) for e in events) == 8  # up to the pool's 512 tokens
            assert events[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
            assert await free_blocks(stub) == NUM_BLOCKS
        finally:
            await close()

    asyncio.run(main())


def register(address: str) -> scheduler_pb2.RegisterWorkerRequest:
    return scheduler_pb2.RegisterWorkerRequest(
        address=address, num_kv_blocks=NUM_BLOCKS, block_size=16, max_model_len=4096,
        vocab_size=1000, model_id="fake",
    )  # fmt: skip


def test_after_a_worker_failure_the_scheduler_is_unready_until_one_registers() -> None:
    async def main() -> None:
        fake = FakeWorker(fail=True)
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.AddRequest(add_request(10, 4)):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
            assert not info.ready and info.num_free_kv_blocks == NUM_BLOCKS
            queries = info.kv_cache.prefix_cache_queries_total
            assert queries == 10  # the failed request's prompt was looked up
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.AddRequest(add_request(10, 4)):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "waiting for a worker" in (err.value.details() or "")
            fake.fail = False
            await stub.RegisterWorker(register(fake.address))  # the worker is back
            info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
            assert info.ready
            assert info.kv_cache.prefix_cache_queries_total == queries  # not reset by the worker
            events = [e async for e in stub.AddRequest(add_request(10, 4))]
            assert [t for e in events for t in e.token_ids] == [110, 111, 112, 113]
        finally:
            await close()

    asyncio.run(main())


def test_the_same_worker_registering_again_keeps_its_streams_a_restarted_one_ends_them(
    fake: FakeWorker,
) -> None:
    async def stream_across(stub, registration) -> list[int] | grpc.StatusCode:  # type: ignore[no-untyped-def]
        """A request's tokens (or its error code) when `registration` arrives mid-stream."""
        fake.gate = asyncio.Event()
        tokens: list[int] = []

        async def consume() -> list[int] | grpc.StatusCode:
            try:
                async for e in stub.AddRequest(add_request(10, 4)):
                    tokens.extend(e.token_ids)
            except grpc.aio.AioRpcError as err:
                return err.code()
            return tokens

        before = len(fake.steps)
        task = asyncio.create_task(consume())
        while not any(step.scheduled for step in fake.steps[before:]):  # held at the gate
            await asyncio.sleep(0.01)
        await stub.RegisterWorker(registration)
        fake.gate.set()
        return await task

    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            first = register(fake.address)
            first.worker_id = "process-a"
            await stub.RegisterWorker(first)  # a new id: taken as a restart (no request yet)
            assert await stream_across(stub, first) == [110, 111, 112, 113]
            restarted = register(fake.address)
            restarted.worker_id = "process-b"
            assert await stream_across(stub, restarted) == grpc.StatusCode.UNAVAILABLE
            info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
            assert info.ready and info.num_free_kv_blocks == NUM_BLOCKS
        finally:
            await close()

    asyncio.run(main())


def test_requests_beyond_max_waiting_requests_get_resource_exhausted(fake: FakeWorker) -> None:
    async def main() -> None:
        fake.gate = asyncio.Event()
        stub, close = await _serve(fake, SchedulerConfig(max_num_seqs=1, max_waiting_requests=2))
        try:

            async def run(i: int) -> list[int]:
                req = add_request(10 + i, 3, f"r{i}")
                return [t async for e in stub.AddRequest(req) for t in e.token_ids]

            running = [asyncio.create_task(run(0))]
            while not fake.steps:  # r0's first step is in flight, held by the gate
                await asyncio.sleep(0.01)
            running += [asyncio.create_task(run(i)) for i in (1, 2)]
            while True:
                info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
                if info.num_requests_waiting == 2:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await run(3)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details() == (
                "2 requests are waiting (--max-waiting-requests 2); retry later"
            )

            async def second_sample_of_r1() -> list[int]:  # n = 2: counted with r1, once
                req = add_request(20, 3, "r1-1")
                req.parent_request_id = "r1"
                return [t async for e in stub.AddRequest(req) for t in e.token_ids]

            running.append(asyncio.create_task(second_sample_of_r1()))
            while (await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())).num_requests_waiting < 3:  # fmt: skip
                await asyncio.sleep(0.01)
            fake.gate.set()
            outs = await asyncio.gather(*running)
            assert outs == [[100 + 10 + i + k for k in range(3)] for i in range(3)] + [
                [100 + 20 + k for k in range(3)]
            ]
            assert await free_blocks(stub) == NUM_BLOCKS
        finally:
            await close()

    asyncio.run(main())


def test_a_worker_that_dies_idle_is_noticed_without_a_request(fake: FakeWorker) -> None:
    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            events = [e async for e in stub.AddRequest(add_request(10, 2))]
            assert len(events) == 2
            await asyncio.sleep(0.5)  # the step that tells the worker to forget it has run
            assert fake.server is not None
            await fake.server.stop(None)  # the worker goes away while nothing runs
            for _ in range(100):  # probed every second while idle
                info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
                if not info.ready:
                    break
                await asyncio.sleep(0.1)
            assert not info.ready
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.AddRequest(add_request(10, 2)):
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unreachable" in (err.value.details() or "")
        finally:
            await close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "refusal",
    [
        FieldError("sampling.logit_bias[7]", "must be in [-100, 100]; got 500.0"),
        RequestError(grpc.StatusCode.FAILED_PRECONDITION, "no such block"),
        RequestError(grpc.StatusCode.INTERNAL, "the worker failed the step: IndexError: x"),
    ],
    ids=["invalid-argument-with-field", "failed-precondition", "internal-marked"],
)
def test_a_step_the_worker_refuses_fails_its_requests_and_the_replica_serves_on(
    fake: FakeWorker, refusal: RequestError
) -> None:
    """A worker that refuses one step with a status it chose ends that step's requests with
    the status (the field as data), and the next request is served at once: the replica is
    not taken for lost (it used to wait for a registration a live worker never sends)."""

    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            fake.refuse = refusal
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.AddRequest(add_request(10, 4)):
                    pass
            got = error_from_rpc(err.value)
            assert (got.code, got.field, got.message) == (
                refusal.code,
                refusal.field,
                refusal.message,
            )
            assert err.value.details() == refusal.details
            info = await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest())
            assert info.ready and info.num_free_kv_blocks == NUM_BLOCKS
            events = await asyncio.wait_for(_collect(stub, add_request(10, 4, "next")), 2.0)
            assert [t for e in events for t in e.token_ids] == [110, 111, 112, 113]
            assert fake.steps[0].finished_seq_ids == [1]  # the refused sequence is forgotten
        finally:
            await close()

    asyncio.run(main())


async def _collect(
    stub: scheduler_pb2_grpc.SchedulerStub, request: scheduler_pb2.AddRequestRequest
) -> list[scheduler_pb2.TokenEvent]:
    return [e async for e in stub.AddRequest(request)]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"prompt_token_ids": [1] * (NUM_BLOCKS * 16)}, "input"),
        ({"prompt_token_ids": [1, 1000]}, "prompt_token_ids.ids[1]"),
        ({"prompt_token_ids": []}, "input"),
        ({"sampling": inference_pb2.SamplingParams(top_p=0)}, "sampling.top_p"),
        ({"sampling": inference_pb2.SamplingParams(stop_token_ids=[1000])}, "sampling.stop_token_ids[0]"),
        ({"sampling": inference_pb2.SamplingParams(max_tokens=2), "output_token_ids": [5, 6]}, "sampling.max_tokens"),
    ],
)  # fmt: skip
def test_the_replicas_gate_refuses_what_a_worker_could_not_run(
    fake: FakeWorker, change: dict[str, object], field: str
) -> None:
    """The scheduler checks every request it is sent, through the same contract as the router
    (sluiceway/sampling_params.py): INVALID_ARGUMENT naming the field, nothing queued."""

    async def main() -> None:
        stub, close = await _serve(fake, SchedulerConfig())
        try:
            request = add_request(10, 4)
            for name, value in change.items():
                if isinstance(value, list):
                    getattr(request, name)[:] = value
                else:
                    getattr(request, name).CopyFrom(value)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _collect(stub, request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_from_rpc(err.value).field == field
            assert not fake.steps
        finally:
            await close()

    asyncio.run(main())
