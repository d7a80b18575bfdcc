"""`bench serve --backend openai` against a server that streams as llama.cpp's `llama-server`
does: one SSE chunk per token, a final chunk with the usage, then the connection closed while
the headers said keep-alive."""

from __future__ import annotations

import asyncio
import json

from sluiceway.bench.openai_client import run_openai_workload
from sluiceway.sharegpt import SampledRequest

# How long the fake server waits after its last chunk before it closes the connection: a
# client that reuses the connection sends its next request within it.
CLOSE_DELAY_S = 1.0


class FakeLlamaServer:
    """An HTTP/1.1 server on 127.0.0.1 that answers each connection's first
    ``POST /v1/completions`` with ``max_tokens`` text chunks ("t0 ", "t1 ", ...), a usage chunk
    and ``[DONE]`` (chunked transfer), then closes the connection after CLOSE_DELAY_S without
    reading further: a request sent on it meanwhile gets no response."""

    def __init__(self) -> None:
        self.connections = 0
        self.bodies: list[dict[str, object]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> FakeLlamaServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = next(
            int(line.split(":", 1)[1])
            for line in head.split("\r\n")
            if line.lower().startswith("content-length:")
        )
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        n = int(body["max_tokens"])
        writer.write(
            b"HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5, max=100\r\n"
            b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        events = [{"choices": [{"text": f"t{i} ", "index": 0}]} for i in range(n)]
        events.append(
            {
                "choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                "usage": {"completion_tokens": n, "prompt_tokens": len(body["prompt"])},  # type: ignore[arg-type]
            }
        )
        for event in [*map(json.dumps, events), "[DONE]"]:
            data = f"data: {event}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(CLOSE_DELAY_S)
        writer.close()


def _requests() -> list[SampledRequest]:
    return [
        SampledRequest("", prompt_len=3, output_len=n, prompt_token_ids=(5, 6, 7))
        for n in (4, 2, 3)
    ]


def _run(keep_alive: bool) -> tuple[FakeLlamaServer, list]:  # type: ignore[type-arg]
    async def go() -> tuple[FakeLlamaServer, list]:  # type: ignore[type-arg]
        async with FakeLlamaServer() as server:
            results, _ = await run_openai_workload(
                f"http://127.0.0.1:{server.port}", "m", _requests(), [0.0] * 3,
                max_concurrency=1, ignore_eos=True, keep_alive=keep_alive,
            )  # fmt: skip
        return server, results

    return asyncio.run(go())


def test_no_keep_alive_opens_a_connection_per_request_and_counts_every_token() -> None:
    server, results = _run(keep_alive=False)
    assert [(r.ok, r.output_len, r.error) for r in results] == [
        (True, 4, ""), (True, 2, ""), (True, 3, "")
    ]  # fmt: skip
    assert [len(r.itl) for r in results] == [3, 1, 2]  # a text chunk per token
    assert server.connections == 4  # the warm-up and the three requests
    assert server.bodies[1] == {
        "model": "m", "prompt": [5, 6, 7], "temperature": 0.0, "max_tokens": 4,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


def test_keep_alive_meets_the_servers_close() -> None:
    # why --no-keep-alive exists: the pooled connection is reused while the server closes it
    server, results = _run(keep_alive=True)
    failed = [r for r in results if not r.ok]
    assert failed and all("disconnected" in r.error.lower() for r in failed)
    assert server.connections < 4
