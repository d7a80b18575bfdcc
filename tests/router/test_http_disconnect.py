"""An HTTP client that goes before its first token (its request queued, or its prompt being
computed): the router cancels the request at the scheduler within its 0.2 s poll, streamed or
not, instead of computing the prompt for nobody (a fresh user's 7.5k-token prompt ran 61 s
after its client had gone, until its first token failed to write)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from sluiceway.internal.v1 import scheduler_pb2
from sluiceway.router.grpc_api import Router
from tests.router.test_router_malformed import MODEL, FakeScheduler
from tests.router.test_router_shutdown import _run, _until


class _SlowPrompt(FakeScheduler):
    """A scheduler whose first token would come after 30 s; counts the requests cancelled
    before it."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        yield scheduler_pb2.TokenEvent(token_ids=[100])


def test_a_client_gone_before_its_first_token_cancels_its_request(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    fake = _SlowPrompt()

    async def scenario(router: Router, http_url: str) -> None:
        replicas = router.path.pool.replicas
        for n, stream in enumerate((True, False), 1):
            body = {"model": MODEL, "prompt": "Count", "max_tokens": 5, "stream": stream}
            async with httpx.AsyncClient(base_url=http_url, timeout=0.5) as client:
                with pytest.raises(httpx.ReadTimeout):  # no status line before the first token
                    await client.post("/v1/completions", json=body)
            await _until(lambda n=n: fake.cancelled == n, f"stream={stream}: not cancelled", 3.0)
            await _until(lambda: replicas[0].outstanding == 0, "the scheduler call goes on", 3.0)
        assert router.path.num_in_flight == 0

    _run(tokenizer, tokenizer_dir, scenario, fake)
