"""A router's shutdown (router/server.py `drain`): the streams in flight go on while it drains,
and those it cuts (a second signal, or the drain timeout) end with an explicit status on
each front: gRPC UNAVAILABLE "server shutting down", an SSE error event then ``[DONE]``, a
non-streamed HTTP 503 in OpenAI's error shape. Never a reset connection.

The real `RequestPath`, gRPC front and HTTP front, over one in-process fake scheduler that
streams a token every 20 ms.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
from prometheus_client import REGISTRY

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2_grpc
from sluiceway.router.grpc_api import Router, start_router
from sluiceway.router.openai_api import start_http_server
from sluiceway.router.request_path import RequestPath
from sluiceway.router.server import drain
from sluiceway.v1 import inference_pb2, inference_pb2_grpc
from tests.router.test_router_malformed import MODEL, FakeScheduler

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
LONG = inference_pb2.SamplingParams(max_tokens=2000, ignore_eos=True)  # 40 s at 20 ms a token
SHUTTING_DOWN = {
    "error": {
        "message": "server shutting down",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
}

Scenario = Callable[[Router, str], Awaitable[None]]


def _run(tokenizer: Any, model_dir: pathlib.Path, scenario: Scenario,
         fake: FakeScheduler | None = None) -> None:  # fmt: skip
    """Runs `scenario(router, http_base_url)` against a router over `fake` (default: a fake
    scheduler that streams a token every 20 ms)."""

    async def main() -> None:
        nonlocal fake
        if fake is None:
            fake = FakeScheduler()
            fake.delay_s = 0.02
        scheduler, _ = new_server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, scheduler)
        address = bind(scheduler, "127.0.0.1:0")
        await scheduler.start()
        path = RequestPath(tokenizer, model_dir, address)
        router = await start_router(path, "127.0.0.1:0", poll_s=0.05)
        http = await start_http_server(path, "127.0.0.1", 0)
        try:
            deadline = time.monotonic() + 10
            while not path.serving:
                assert time.monotonic() < deadline, "the router never saw the scheduler ready"
                await asyncio.sleep(0.02)
            await scenario(router, http.url)
        finally:
            await http.stop()
            await router.stop(None)
            await scheduler.stop(None)

    asyncio.run(asyncio.wait_for(main(), 60))


def _failures(code: str, protocol: str) -> float:
    labels = {"model_name": MODEL, "code": code, "protocol": protocol}
    return REGISTRY.get_sample_value("sluiceway:request_failure_total", labels) or 0.0


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _stream(channel: grpc.aio.Channel, prompt: str = "Count") -> Any:
    stub = inference_pb2_grpc.InferenceStub(channel)
    return stub.Generate(inference_pb2.GenerateRequest(prompt=prompt, sampling=LONG), timeout=30)


async def _status(call: Any) -> tuple[grpc.StatusCode, str, int]:
    """Reads `call` to its end: its status code, details and the tokens read meanwhile."""
    tokens = 0
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens += len(response.token_ids)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", tokens
    return grpc.StatusCode.OK, "", tokens


def test_a_grpc_stream_goes_on_while_draining_and_a_second_signal_ends_it_unavailable(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, http_url: str) -> None:
        path = router.path
        async with grpc.aio.insecure_channel(router.address) as channel:
            call = _stream(channel)
            assert list((await call.read()).token_ids) == [100]
            before = _failures("UNAVAILABLE", "grpc")
            stop_now = asyncio.Event()
            draining = asyncio.create_task(drain(router, stop_now, drain_timeout_s=30.0))
            await _until(lambda: path.draining, "the router never started draining")
            # draining: the stream in flight goes on, a new one is refused
            assert [list((await call.read()).token_ids) for _ in range(3)] == [[101], [102], [103]]
            assert await _status(_stream(channel, "Hi")) == (
                UNAVAILABLE, "router is draining; retry another router", 0
            )  # fmt: skip
            assert not draining.done()
            stop_now.set()  # the second Ctrl-C
            code, details, _ = await _status(call)
            assert (code, details) == (UNAVAILABLE, "server shutting down")
            assert await asyncio.wait_for(draining, 5)  # it cut
        assert path.num_in_flight == 0
        assert [r.outstanding for r in path.pool.replicas] == [0]  # the scheduler call ended
        assert _failures("UNAVAILABLE", "grpc") == before + 2  # the refused and the cut one

    _run(tokenizer, tokenizer_dir, scenario)


def test_the_drain_timeout_ends_the_streams_left_unavailable(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, http_url: str) -> None:
        async with grpc.aio.insecure_channel(router.address) as channel:
            calls = [_stream(channel, f"Count to {i}") for i in range(2)]
            for call in calls:
                assert list((await call.read()).token_ids) == [100]
            started = time.monotonic()
            draining = asyncio.create_task(drain(router, asyncio.Event(), drain_timeout_s=0.5))
            results = await asyncio.gather(*(_status(call) for call in calls))
            assert [(code, details) for code, details, _ in results] == [
                (UNAVAILABLE, "server shutting down")
            ] * 2
            assert all(tokens > 0 for _, _, tokens in results)  # served while draining
            assert await asyncio.wait_for(draining, 5)  # it cut
            assert time.monotonic() - started >= 0.5
        assert router.path.num_in_flight == 0

    _run(tokenizer, tokenizer_dir, scenario)


async def _sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, as they come."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_a_cut_http_stream_ends_with_an_sse_error_event_then_done(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, http_url: str) -> None:
        body = {"model": MODEL, "prompt": "Count", "max_tokens": 2000, "stream": True}
        async with (
            httpx.AsyncClient(base_url=http_url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = _sse_events(response)
            first = json.loads(await anext(events))
            assert first["choices"][0]["finish_reason"] is None
            stop_now = asyncio.Event()
            draining = asyncio.create_task(drain(router, stop_now, drain_timeout_s=30.0))
            await _until(lambda: router.path.draining, "the router never started draining")
            chunk = json.loads(await anext(events))  # still served while draining
            assert chunk["choices"][0]["finish_reason"] is None
            refused = await client.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503
            assert refused.json()["error"]["message"] == "router is draining; retry another router"
            stop_now.set()
            rest = [event async for event in events]
            assert await asyncio.wait_for(draining, 5)  # it cut
        assert [json.loads(e) for e in rest[-2:-1]] == [SHUTTING_DOWN]
        assert rest[-1] == "[DONE]"
        assert all("choices" in json.loads(e) for e in rest[:-2])  # tokens, then the error

    _run(tokenizer, tokenizer_dir, scenario)


def test_a_cut_non_streamed_http_request_gets_503_in_openai_shape(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, http_url: str) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}],
                "max_tokens": 2000}  # fmt: skip
        async with httpx.AsyncClient(base_url=http_url, timeout=30) as client:
            request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            replicas = router.path.pool.replicas
            await _until(lambda: replicas[0].outstanding == 1, "the request never started")
            before = _failures("UNAVAILABLE", "http")
            stop_now = asyncio.Event()
            stop_now.set()  # a second signal at once: the drain cuts what is in flight
            assert await asyncio.wait_for(drain(router, stop_now, drain_timeout_s=30.0), 5)
            response = await request
        assert (response.status_code, response.json()) == (503, SHUTTING_DOWN)
        assert _failures("UNAVAILABLE", "http") == before + 1

    _run(tokenizer, tokenizer_dir, scenario)


def test_a_drain_with_nothing_in_flight_returns_at_once(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(router: Router, http_url: str) -> None:
        # not the 30 s (wait_for raises TimeoutError after 5), and nothing to cut
        assert not await asyncio.wait_for(drain(router, asyncio.Event(), drain_timeout_s=30.0), 5)
        assert router.path.draining and not router.path.serving

    _run(tokenizer, tokenizer_dir, scenario)
