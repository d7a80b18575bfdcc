"""What a client is told when a scheduler call fails: the scheduler's own details, or a
fixed text per code for gRPC's transport failures (which name internal addresses)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.grpc_api import Router
from sluiceway.status import INTERNAL_DETAILS, TRANSPORT_DETAILS
from tests.router.test_balancer import FakeScheduler, _generate, _request, _with_router, run

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class RawFailure(FakeScheduler):
    """Fails every AddRequest with `code` and gRPC-looking details, not through
    `sluiceway.status.abort` (as an uncaught exception or a transport failure would)."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self.code = code

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.requests.append(request.request_id)
        await context.abort(
            self.code,
            "failed to connect to all addresses; last error: UNKNOWN: "
            "unix:/tmp/sluiceway-1-x/worker.sock: No such file or directory",
        )
        yield scheduler_pb2.TokenEvent()  # never reached: a generator, as the real one


def test_a_scheduler_dying_mid_stream_gives_unavailable_with_no_transport_text(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        (a,) = fakes
        a.gate = asyncio.Event()
        first = asyncio.Event()
        stream = asyncio.create_task(_generate(ch, _request(0), first))
        await first.wait()
        await a.stop()  # the connection breaks under the stream: gRPC's own status
        assert await stream == (UNAVAILABLE, "the model replica is unavailable; retry")

    run(_with_router(tokenizer, tokenizer_dir, [FakeScheduler()], scenario))


def test_unmarked_scheduler_statuses_are_replaced_and_marked_ones_kept(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    for code, expected in [
        (UNAVAILABLE, TRANSPORT_DETAILS[UNAVAILABLE]),
        (grpc.StatusCode.UNKNOWN, INTERNAL_DETAILS),
        (grpc.StatusCode.INTERNAL, INTERNAL_DETAILS),
    ]:

        async def scenario(
            router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel
        ) -> None:
            assert await _generate(ch, _request(0)) == (code, expected)  # noqa: B023

        run(_with_router(tokenizer, tokenizer_dir, [RawFailure(code)], scenario))

    async def marked(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        fakes[0].fail_add = True  # through sluiceway.status.abort, as the scheduler does
        assert await _generate(ch, _request(0)) == (UNAVAILABLE, "no worker is ready")

    run(_with_router(tokenizer, tokenizer_dir, [FakeScheduler()], marked))
