"""`priority` through the one request path: from the gRPC request and the HTTP bodies to every
scheduler request of it (each of its n samples, a stream resumed on another replica), and a
scheduler's refusal (a policy other than priority) presented as INVALID_ARGUMENT / HTTP 400
naming `priority`. The schedulers are fakes (tests/router/test_balancer.py)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.grpc_api import Router
from sluiceway.router.openai_api import start_http_server
from sluiceway.status import FieldError, abort
from tests.router.test_balancer import (
    TOKENS,
    FakeScheduler,
    _generate,
    _request,
    _with_router,
    prompt,
    run,
)

REFUSAL = "priority scheduling is not enabled (--scheduling-policy fcfs)"


class RecordingScheduler(FakeScheduler):
    """Records (request_id, priority, output_token_ids) of every AddRequest; with `fcfs`,
    refuses a priority other than 0 as a scheduler under fcfs does."""

    def __init__(self) -> None:
        super().__init__()
        self.added: list[tuple[str, int, list[int]]] = []
        self.fcfs = False

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.added.append((request.request_id, request.priority, list(request.output_token_ids)))
        if self.fcfs and request.priority:
            await abort(context, FieldError("priority", REFUSAL))
        async for event in super().AddRequest(request, context):
            yield event


def test_every_sample_and_both_http_endpoints_carry_the_priority(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        (fake,) = fakes
        assert isinstance(fake, RecordingScheduler)
        request = _request(0, rid="g")
        request.priority = -3
        request.sampling.n = 3
        tokens = await _generate(ch, request)
        assert isinstance(tokens, list) and sorted(tokens) == sorted(TOKENS * 3)
        assert sorted(fake.added) == [("g-0", -3, []), ("g-1", -3, []), ("g-2", -3, [])]

        http = await start_http_server(router.path, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=http.url, timeout=30) as client:
                fake.added.clear()
                body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                        "n": 2, "priority": 5, "request_id": "c"}  # fmt: skip
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert sorted(fake.added) == [("c-0", 5, []), ("c-1", 5, [])]
                fake.added.clear()
                body = {"prompt": ["a", "b"], "max_tokens": 2, "priority": -2**31,
                        "request_id": "p"}  # fmt: skip
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert sorted(fake.added) == [("p-0", -(2**31), []), ("p-1", -(2**31), [])]
                fake.added.clear()
                # past int32: refused before any scheduler hears of it
                for value in (2**31, -(2**31) - 1):
                    r = await client.post(
                        "/v1/completions", json={"prompt": "a", "priority": value}
                    )
                    assert r.status_code == 400
                    assert r.json()["error"]["param"] == "priority"
                    assert r.json()["error"]["message"] == (
                        f"priority: must be in [-2147483648, 2147483647] (int32); got {value}"
                    )
                r = await client.post("/v1/completions", json={"prompt": "a", "priority": "high"})
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
                assert fake.added == []

                # a scheduler under fcfs refuses it: 400 / INVALID_ARGUMENT naming priority
                fake.fcfs = True
                r = await client.post("/v1/completions", json={"prompt": "a", "priority": 1})
                assert r.status_code == 400
                assert r.json()["error"] == {
                    "message": f"priority: {REFUSAL}", "type": "BadRequestError",
                    "param": "priority", "code": 400,
                }  # fmt: skip
                body = {"messages": [{"role": "user", "content": "Hi"}], "priority": 1,
                        "stream": True}  # fmt: skip
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
                r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert r.status_code == 200  # 0, the default, is what fcfs takes
        finally:
            await http.stop()
        request = _request(1)
        request.priority = 1
        assert await _generate(ch, request) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"priority: {REFUSAL}",
        )

    run(_with_router(tokenizer, tokenizer_dir, [RecordingScheduler()], scenario))


def test_a_stream_resumed_on_another_replica_keeps_its_priority(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, fakes: list[FakeScheduler], ch: grpc.aio.Channel) -> None:
        a, b = fakes
        assert isinstance(a, RecordingScheduler) and isinstance(b, RecordingScheduler)
        pool = router.path.pool
        while not all(r.ready for r in pool.replicas):
            await asyncio.sleep(0.02)
        i = next(i for i in range(1000) if pool.pick(prompt(i)) is pool.replicas[0])
        a.gate = asyncio.Event()
        first = asyncio.Event()
        request = _request(i, rid="moved")
        request.priority = 7
        stream = asyncio.create_task(_generate(ch, request, first))
        await first.wait()
        await a.stop()  # fails mid-stream: it goes on on b after the token sent
        assert await stream == TOKENS
        assert a.added == [("moved", 7, [])]
        assert b.added == [("moved", 7, [100])]

    fakes: list[FakeScheduler] = [RecordingScheduler(), RecordingScheduler()]
    run(_with_router(tokenizer, tokenizer_dir, fakes, scenario))


def test_the_python_client_and_generate_cli_set_the_priority() -> None:
    from sluiceway.cli import build_parser
    from sluiceway.client import Client
    from sluiceway.generate_cli import build_request

    assert Client.request("hi", priority=-4, max_tokens=3).priority == -4
    assert Client.request("hi").priority == 0
    args = build_parser().parse_args(["generate", "hi", "--priority", "2"])
    assert build_request(args, "hi").priority == 2
    assert build_request(build_parser().parse_args(["generate", "hi"]), "hi").priority == 0
