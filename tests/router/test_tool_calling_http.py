"""tool_choice "auto" through the whole router (the HTTP front, the request path, the hermes
parser) over a scripted scheduler that streams a recorded model output token by token: the
calls come out as `message.tool_calls` with finish_reason "tool_calls", the text before them
as content, the same whether streamed or not; a malformed call is text."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import openai

from sluiceway.grpc_server import bind, new_server
from sluiceway.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from sluiceway.router.openai_api import start_http_server
from sluiceway.router.request_path import RequestPath
from sluiceway.v1 import inference_pb2

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
OUTPUT = f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>"
MALFORMED = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
EOS = 2  # SmolLM2's <|im_end|>


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Streams `token_ids` one per event, then EOS with finish reason STOP."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.sampling: list[scheduler_pb2.AddRequestRequest] = []

    async def AddRequest(  # type: ignore[override]
        self, request: scheduler_pb2.AddRequestRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.TokenEvent]:
        self.sampling.append(request)
        for t in self.token_ids:
            yield scheduler_pb2.TokenEvent(token_ids=[t])
        yield scheduler_pb2.TokenEvent(
            token_ids=[EOS], finish_reason=inference_pb2.FINISH_REASON_STOP
        )

    async def GetSchedulerInfo(  # type: ignore[override]
        self, request: scheduler_pb2.GetSchedulerInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(ready=True, model_id="fake", max_model_len=4096,
                                           block_size=16, vocab_size=49152, num_kv_blocks=100)  # fmt: skip


def run_with_router(
    tokenizer: Any,
    model_dir: pathlib.Path,
    output: str,
    scenario: Callable[[openai.AsyncOpenAI, ScriptedScheduler], Awaitable[None]],
) -> None:
    """Runs `scenario` with an SDK client of a router (hermes, auto enabled) over a scheduler
    that streams `output`'s tokens."""
    run_with_router_url(tokenizer, model_dir, output, lambda c, s, _: scenario(c, s))


def run_with_router_url(
    tokenizer: Any,
    model_dir: pathlib.Path,
    output: str,
    scenario: Callable[[openai.AsyncOpenAI, ScriptedScheduler, str], Awaitable[None]],
) -> None:
    async def main() -> None:
        scheduler = ScriptedScheduler(tokenizer.encode(output))
        server, _ = new_server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
        address = bind(server, "127.0.0.1:0")
        await server.start()
        path = RequestPath(tokenizer, model_dir, address, tool_call_parser="hermes",
                           enable_auto_tool_choice=True)  # fmt: skip
        assert await path.scheduler_ready(5.0)
        http = await start_http_server(path, "127.0.0.1", 0)
        try:
            async with openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="x") as client:
                await scenario(client, scheduler, http.url)
        finally:
            await http.stop()
            await path.close()
            await server.stop(None)

    asyncio.run(main())


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_auto_parses_the_call_whole_and_streamed(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(client: openai.AsyncOpenAI, scheduler: ScriptedScheduler) -> None:
        whole = (await client.chat.completions.create(model="fake", messages=QUESTION,
                                                      tools=TOOLS)).choices[0]  # fmt: skip
        assert whole.finish_reason == "tool_calls"
        assert whole.message.content == "Let me check.\n"
        [call] = whole.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})  # fmt: skip
        # hermes reads <tool_call> markers: special tokens stay in the text (vLLM's)
        assert scheduler.sampling[0].sampling.skip_special_tokens is False
        content, args, finish = "", "", ""
        stream = await client.chat.completions.create(model="fake", messages=QUESTION,
                                                      tools=TOOLS, stream=True)  # fmt: skip
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        for chunk in chunks[1:-1]:  # no empty delta while the call is buffered (vLLM's)
            assert chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls, chunk
        # the role chunk, "Let me check.\n" token by token, the call, the finish chunk
        assert len(chunks) <= 2 + len(tokenizer.encode("Let me check.\n")) + 1
        for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                assert piece.index == 0
                args += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert (content, args, finish) == (
            whole.message.content,
            call.function.arguments,
            "tool_calls",
        )

    run_with_router(tokenizer, tokenizer_dir, OUTPUT, scenario)


def test_auto_returns_a_malformed_call_as_text(tokenizer: Any, tokenizer_dir: pathlib.Path) -> None:
    async def scenario(client: openai.AsyncOpenAI, scheduler: ScriptedScheduler) -> None:
        choice = (await client.chat.completions.create(model="fake", messages=QUESTION,
                                                       tools=TOOLS)).choices[0]  # fmt: skip
        assert choice.finish_reason == "stop"
        assert choice.message.content == MALFORMED and not choice.message.tool_calls

    run_with_router(tokenizer, tokenizer_dir, MALFORMED, scenario)


def test_tokenize_renders_the_tools_as_chat_does(
    tokenizer: Any, tokenizer_dir: pathlib.Path
) -> None:
    async def scenario(client: openai.AsyncOpenAI, scheduler: ScriptedScheduler, url: str) -> None:
        await client.chat.completions.create(model="fake", messages=QUESTION, tools=TOOLS,
                                             tool_choice="none")  # fmt: skip
        async with httpx.AsyncClient(base_url=url) as http:
            r = await http.post("/tokenize", json={"messages": QUESTION, "tools": TOOLS})
        prompt = list(scheduler.sampling[0].prompt_token_ids)
        assert r.json()["tokens"] == prompt
        assert "<tools>" in tokenizer.decode(prompt)

    run_with_router_url(tokenizer, tokenizer_dir, "Sunny.", scenario)
