"""Disaggregated prefill in the scheduler, over real gRPC, with fake paged workers.

Each fake worker keeps a "KV pool" that maps a slot to the token whose K/V it holds, checks
before every step that the blocks of each sequence hold exactly its tokens, and implements
`CopyBlocks` by copying slots from the peer fake named by the handle. So a wrong block id
anywhere in the hand-off (a block not copied, copied to the wrong place, freed too early)
fails the step.
"""

from __future__ import annotations

import asyncio
import io
import sys
import warnings
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.scheduler.engine import Engine
from sluiceway.scheduler.server import SchedulerService
from tests.scheduler.test_engine import add_request

BLOCK = 16
FAKES: dict[str, FakePagedWorker] = {}
HANG_S = 60.0
TEARDOWN_S = 10.0


def run_bounded(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``asyncio.run(main())``, failing after HANG_S with every task's stack (a lost wakeup or
    a lost request would otherwise idle until pytest's 600 s timeout, which shows no task)."""

    async def bounded() -> None:
        task = asyncio.ensure_future(main())
        done, _ = await asyncio.wait({task}, timeout=HANG_S)
        if not done:
            stacks = io.StringIO()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    frames = [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                              for f in t.get_stack()]  # fmt: skip
                    print(t.get_name(), t.get_coro(), *frames, sep="\n  ", file=stacks)
            print(stacks.getvalue(), file=sys.stderr)
            task.cancel()
            raise AssertionError(f"no progress in {HANG_S:.0f} s; the tasks' stacks are above")
        task.result()

    asyncio.run(bounded())


class FakePagedWorker(worker_pb2_grpc.WorkerServicer):
    """Samples 100 + len(record); its pool maps slot -> token id."""

    def __init__(self, name: str, num_blocks: int) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.pool: dict[int, int] = {}
        self.records: dict[int, tuple[list[int], list[int]]] = {}  # seq -> (tokens, blocks)
        self.steps: list[worker_pb2.StepRequest] = []
        self.copies: list[worker_pb2.CopyBlocksRequest] = []
        self.fail_copies = False
        self.address = ""
        FAKES[name] = self

    def handle(self) -> scheduler_pb2.KvPoolHandle:
        """As a real pool's: [layers, K/V, blocks, KV heads, block_size * head_dim]."""
        return scheduler_pb2.KvPoolHandle(
            shm_path=f"/fake/{self.name}",
            owner=self.name,
            shape=[2, 2, self.num_blocks, 4, BLOCK * 8],
            dtype="bfloat16",
        )

    async def ExecuteStep(self, request, context):  # type: ignore[no-untyped-def]
        self.steps.append(request)
        for seq_id in request.finished_seq_ids:
            self.records.pop(seq_id)
        for new in request.new_sequences:
            self.records[new.seq_id] = (list(new.prompt_token_ids), [])
        sampled = []
        for s in request.scheduled:
            tokens, blocks = self.records[s.seq_id]
            tokens.extend(s.appended_token_ids)
            blocks.extend(s.new_block_ids)
            for p in range(s.num_computed_tokens):
                slot = blocks[p // BLOCK] * BLOCK + p % BLOCK
                if self.pool.get(slot) != tokens[p]:
                    await context.abort(
                        grpc.StatusCode.INTERNAL, f"seq {s.seq_id}: wrong KV at position {p}"
                    )
            for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.pool[blocks[p // BLOCK] * BLOCK + p % BLOCK] = tokens[p]
            if s.num_computed_tokens + s.num_new_tokens == len(tokens):
                sampled.append(worker_pb2.SampledToken(seq_id=s.seq_id, token_id=100 + len(tokens)))
        await asyncio.sleep(0.001)
        return worker_pb2.StepResponse(step_id=request.step_id, sampled=sampled)

    async def CopyBlocks(self, request, context):  # type: ignore[no-untyped-def]
        if self.fail_copies:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "peer pool gone")
        self.copies.append(request)
        peer = FAKES[request.source.owner]
        for src, dst in zip(request.src_block_ids, request.dst_block_ids, strict=True):
            for off in range(BLOCK):
                if src * BLOCK + off in peer.pool:
                    self.pool[dst * BLOCK + off] = peer.pool[src * BLOCK + off]
                else:
                    self.pool.pop(dst * BLOCK + off, None)
        return worker_pb2.CopyBlocksResponse(num_bytes=len(request.src_block_ids) * 1000)


async def _serve_disaggregated(prefill: FakePagedWorker, decode: FakePagedWorker, **config):  # type: ignore[no-untyped-def]
    servers = []
    for fake in (prefill, decode):
        server, _ = new_server()
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
        fake.address = bind(server, "127.0.0.1:0")
        await server.start()
        servers.append(server)
    engine = Engine(SchedulerConfig(num_prefill_workers=1, num_decode_workers=1, **config))
    sched_server, _ = new_server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerService(engine), sched_server)
    sched_addr = bind(sched_server, "127.0.0.1:0")
    await sched_server.start()
    engine.start()
    channel = grpc.aio.insecure_channel(sched_addr)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    for group, fake in enumerate((prefill, decode)):
        await stub.RegisterWorker(registration(fake, group))

    async def close() -> None:
        # each bounded: a teardown that does not return is reported, not waited for (seen
        # once in a few hundred runs under load, after every assertion had passed)
        steps = [("channel.close()", channel.close()), ("scheduler server.stop()",
                 sched_server.stop(None)), ("engine.stop()", engine.stop()),
                 *((f"worker server {i}.stop()", s.stop(None)) for i, s in enumerate(servers))]  # fmt: skip
        for what, step in steps:
            try:
                await asyncio.wait_for(step, TEARDOWN_S)
            except TimeoutError:
                warnings.warn(
                    f"teardown: {what} did not return in {TEARDOWN_S:.0f} s", stacklevel=1
                )

    return stub, engine, close


def registration(
    fake: FakePagedWorker, group: int, **fields
) -> scheduler_pb2.RegisterWorkerRequest:  # type: ignore[no-untyped-def]
    request = scheduler_pb2.RegisterWorkerRequest(
        address=fake.address, num_kv_blocks=fake.num_blocks, block_size=BLOCK,
        max_model_len=4096, vocab_size=100_000, model_id="fake", worker_group=group,
        tensor_parallel_size=1, kv_pool=fake.handle(),
    )  # fmt: skip
    for name, value in fields.items():
        setattr(request, name, value)
    return request


async def _generate_all(stub, lens: list[int], max_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    async def one(i: int, n: int) -> list[int]:
        req = add_request(n, max_tokens, f"r{i}")
        req.prompt_token_ids[:] = [1000 * (i + 1) + k for k in range(n)]  # no shared prefix
        return [t async for e in stub.AddRequest(req) for t in e.token_ids]

    return await asyncio.gather(*(one(i, n) for i, n in enumerate(lens)))


async def _info(stub) -> scheduler_pb2.SchedulerInfo:  # type: ignore[no-untyped-def]
    return await stub.GetSchedulerInfo(scheduler_pb2.GetSchedulerInfoRequest(), timeout=10)


LENS = [5, 16, 17, 40, 64, 3, 33, 100]


def test_prompts_prefill_on_one_worker_and_decode_on_the_other() -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p0", 64), FakePagedWorker("d0", 64)
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:
            outs = await _generate_all(stub, LENS, 6)
            assert outs == [[100 + n + k for k in range(6)] for n in LENS]
            assert engine.num_kv_transfers == len(LENS)
            # every prompt's blocks moved: ceil(n / 16) each
            assert sum(len(c.src_block_ids) for c in decode.copies) == sum(
                -(-n // BLOCK) for n in LENS
            )
            # the prefill worker computed prompts only: no step decoded there
            assert all(s.num_new_tokens > 1 or s.num_computed_tokens == 0 for st in prefill.steps for s in st.scheduled)  # fmt: skip
            # the decode worker computed no prompt: it started each at its prompt's end
            new_on_decode = {n.seq_id: len(n.prompt_token_ids) for st in decode.steps for n in st.new_sequences}  # fmt: skip
            assert sorted(new_on_decode.values()) == sorted(n + 1 for n in LENS)
            assert all(s.num_new_tokens == 1 for st in decode.steps for s in st.scheduled)
            for _ in range(100):
                info = await _info(stub)
                if info.num_free_kv_blocks == 128 and not prefill.records and not decode.records:
                    break
                await asyncio.sleep(0.02)
            assert info.num_kv_blocks == 128 and info.num_free_kv_blocks == 128
            assert prefill.records == {} and decode.records == {}
        finally:
            await close()

    run_bounded(main)


def test_a_full_decode_pool_leaves_sequences_decoding_where_they_were_prefilled() -> None:
    async def main() -> None:
        # 7 blocks: the 100-token prompt (7 blocks) fits only while nothing else is there
        prefill, decode = FakePagedWorker("p1", 64), FakePagedWorker("d1", 7)
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:
            outs = await _generate_all(stub, LENS, 8)
            assert outs == [[100 + n + k for k in range(8)] for n in LENS]
            assert 1 <= engine.num_kv_transfers < len(LENS)
            assert any(
                s.num_new_tokens == 1 and s.num_computed_tokens > 0
                for st in prefill.steps
                for s in st.scheduled
            )  # some decoded on the prefill worker
            info = await _info(stub)
            for _ in range(100):
                if info.num_free_kv_blocks == 71:
                    break
                await asyncio.sleep(0.02)
                info = await _info(stub)
            assert info.num_free_kv_blocks == 71
        finally:
            await close()

    run_bounded(main)


def test_a_failed_copy_keeps_the_sequence_on_the_prefill_worker() -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p2", 64), FakePagedWorker("d2", 64)
        decode.fail_copies = True
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:
            outs = await _generate_all(stub, LENS[:4], 4)
            assert outs == [[100 + n + k for k in range(4)] for n in LENS[:4]]
            assert engine.num_kv_transfers == 0
            assert not any(st.scheduled for st in decode.steps)
            info = await _info(stub)
            assert info.num_kv_blocks - info.num_free_kv_blocks <= 64  # decode pool all free
            assert engine.groups[1].scheduler is not None
            assert engine.groups[1].scheduler.block_manager.num_free_blocks == 64
        finally:
            await close()

    run_bounded(main)


@pytest.mark.parametrize(
    ("group", "fields", "message"),
    [
        (2, {}, "worker_group 2 does not exist"),
        (0, {"tensor_parallel_size": 2}, "--tensor-parallel-size 2, the scheduler with 1"),
        (1, {"model_id": "other"}, "serves 'other'"),
    ],
)
def test_workers_the_layout_does_not_have_are_refused(
    group: int, fields: dict[str, object], message: str
) -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p3", 64), FakePagedWorker("d3", 64)
        stub, _, close = await _serve_disaggregated(prefill, decode)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterWorker(registration(decode, group, **fields))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert message in (err.value.details() or "")
            assert (await _info(stub)).ready  # the refusal changed nothing
        finally:
            await close()

    run_bounded(main)


COPY_HINT = (
    ": KV blocks cannot be copied between them (start every worker with the same model, "
    "--dtype, --block-size and --tensor-parallel-size)"
)


@pytest.mark.parametrize(
    ("group", "change", "field", "mine", "theirs"),
    [
        (1, {"dtype": "float32"}, "dtype", "float32", "bfloat16"),
        (1, {3: 2}, "num_kv_heads per rank", "2", "4"),
        (1, {4: BLOCK * 16}, "block_size * head_dim", "256", "128"),
        (1, {0: 3}, "num_layers", "3", "2"),
        (1, {"shape": [2, 2, 64, 4]}, "shape", "[2, 2, 64, 4]", "[2, 2, 64, 4, 128]"),
        (0, {"dtype": "float16"}, "dtype", "float16", "bfloat16"),  # the prefill side too
    ],
    ids=["dtype", "kv-heads", "head-dim", "layers", "shape", "prefill-dtype"],
)
def test_a_worker_whose_kv_pool_does_not_match_the_other_groups_is_refused(
    group: int, change: dict[object, object], field: str, mine: str, theirs: str
) -> None:
    # (A different number of blocks is fine: d1 in the test above has 7, p1 64.)
    async def main() -> None:
        prefill, decode = FakePagedWorker("p6", 64), FakePagedWorker("d6", 64)
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:
            me, peer = (decode, prefill) if group == 1 else (prefill, decode)
            request = registration(me, group)
            for key, value in change.items():
                if key == "dtype":
                    request.kv_pool.dtype = value
                elif key == "shape":
                    request.kv_pool.ClearField("shape")
                    request.kv_pool.shape.extend(value)
                else:
                    request.kv_pool.shape[key] = value
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterWorker(request)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            names = {prefill: "prefill-0", decode: "decode-1"}
            assert err.value.details() == (
                f"worker {me.address} ({names[me]} rank 0) has a KV pool with {field} {mine}, "
                f"worker {peer.address} ({names[peer]} rank 0) one with {field} {theirs}"
                + COPY_HINT
            )
            assert (await _info(stub)).ready  # the refusal changed nothing
            assert engine.groups[group].ranks[0].kv_pool == me.handle()
        finally:
            await close()

    run_bounded(main)


def test_a_worker_without_a_shared_pool_is_refused_in_disaggregated_mode() -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p4", 64), FakePagedWorker("d4", 64)
        stub, _, close = await _serve_disaggregated(prefill, decode)
        try:
            request = registration(decode, 1)
            request.ClearField("kv_pool")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterWorker(request)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--share-kv-pool" in (err.value.details() or "")
        finally:
            await close()

    run_bounded(main)


def test_blocks_the_decode_pool_has_cached_are_reused_not_copied() -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p5", 64), FakePagedWorker("d5", 64)
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:

            async def run(prompt: list[int]) -> list[int]:
                req = add_request(1, 3)
                req.prompt_token_ids[:] = prompt
                return [t async for e in stub.AddRequest(req) for t in e.token_ids]

            shared = list(range(1, 49))  # three full blocks
            assert await run([*shared, 500, 501]) == [150, 151, 152]
            assert await run([*shared, 777, 778]) == [150, 151, 152]  # checked KV: right
            assert [len(c.src_block_ids) for c in decode.copies] == [4, 1]
            assert engine.num_kv_transfers == 2 and engine.kv_transfer_bytes == 5000
        finally:
            await close()

    run_bounded(main)


def test_parallel_samples_take_the_prompt_from_the_prefill_cache_and_all_move() -> None:
    async def main() -> None:
        prefill, decode = FakePagedWorker("p6", 64), FakePagedWorker("d6", 64)
        stub, engine, close = await _serve_disaggregated(prefill, decode)
        try:

            async def sample(i: int) -> list[int]:
                req = add_request(40, 4, f"s{i}")  # 40 tokens: 2 full blocks and 8
                req.parent_request_id = "parallel"
                return [t async for e in stub.AddRequest(req) for t in e.token_ids]

            outs = await asyncio.gather(*(sample(i) for i in range(3)))
            assert outs == [[140, 141, 142, 143]] * 3
            # the first computed the prompt; the others its last 8 tokens only, after its
            # full blocks were cached (the first one has moved on by then)
            assert sum(s.num_new_tokens for st in prefill.steps for s in st.scheduled) == 40 + 2 * 8
            assert engine.num_kv_transfers == 3
            # the decode pool caches the first one's full blocks: the others copy 1 block each
            assert sum(len(c.src_block_ids) for c in decode.copies) == 3 + 1 + 1
            for _ in range(100):
                info = await _info(stub)
                if info.num_free_kv_blocks == 128 and not prefill.records and not decode.records:
                    break
                await asyncio.sleep(0.02)
            assert info.num_free_kv_blocks == 128
        finally:
            await close()

    run_bounded(main)
