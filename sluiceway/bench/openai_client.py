"""`sluiceway bench serve --backend openai`: the serving benchmark through an OpenAI-compatible
HTTP API (sluiceway's router, `vllm serve`, SGLang, TGI...), so that one client measures
several servers side by side.

Each request is a streamed ``POST {base_url}/v1/completions`` (greedy, ``max_tokens`` the
sampled output length, vLLM's ``ignore_eos`` extra field, ``stream_options.include_usage``), as
`vllm bench serve --backend openai` sends it: the first chunk with text is the first token,
the gaps between text chunks are the inter-token latencies, and the final usage chunk gives
the output token count. ``keep_alive=False`` (``--no-keep-alive``) opens a connection per
request: llama.cpp's ``llama-server`` closes the connection after each streamed response while
its headers say keep-alive, so a request sent on the pooled connection just after can meet
the close and fail ("Server disconnected without sending a response").
"""

from __future__ import annotations

import json
import os
import ssl
import time
from typing import Any

import httpx

from sluiceway.bench.metrics import RequestResult, summarize
from sluiceway.bench.workload import send_workload
from sluiceway.router.config import API_KEY_ENV
from sluiceway.sharegpt import SampledRequest

__all__ = ["run_openai_workload", "served_model"]


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of ``GET {base_url}/v1/models``.

    Raises:
        RuntimeError: the server cannot be reached or lists no model.
    """
    try:
        r = await client.get(f"{base_url}/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"no model at {base_url}/v1/models: {e}") from e


async def _one(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    request: SampledRequest,
    ignore_eos: bool,
) -> RequestResult:
    body: dict[str, object] = {
        "model": model,
        "prompt": request.prompt_token_ids or request.prompt,
        "temperature": 0.0,
        "max_tokens": request.output_len,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(ok=False, prompt_len=request.prompt_len)
    t0 = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"].get("message"))
                    return result
                if event.get("usage"):
                    result.output_len = int(event["usage"]["completion_tokens"])
                if not any(c.get("text") for c in event.get("choices", [])):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - t0
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
        if result.output_len == 0:
            result.output_len = chunks  # a server without usage chunks: one token a chunk
        result.e2e = time.perf_counter() - t0
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _http_connection(connection: dict[str, Any]) -> dict[str, Any]:
    """httpx.AsyncClient's arguments for `connection` (see `run_openai_workload`)."""
    out: dict[str, Any] = {}
    key = connection.get("api_key") or os.environ.get(API_KEY_ENV)
    if key:
        out["headers"] = {"Authorization": f"Bearer {key}"}
    if connection.get("ssl_ca_certs") or connection.get("ssl_certfile"):
        context = ssl.create_default_context(cafile=connection.get("ssl_ca_certs"))
        if connection.get("ssl_certfile"):  # a client certificate
            context.load_cert_chain(connection["ssl_certfile"], connection.get("ssl_keyfile"))
        out["verify"] = context
    return out


async def run_openai_workload(
    base_url: str,
    model: str | None,
    requests: list[SampledRequest],
    intervals: list[float],
    max_concurrency: int | None,
    ignore_eos: bool,
    desc: str = "requests",
    *,
    connection: dict[str, Any] | None = None,
    keep_alive: bool = True,
) -> tuple[list[RequestResult], dict[str, float]]:
    """Like :func:`sluiceway.bench.serve.run_workload` through the HTTP API at ``base_url``
    (``http://host:port``, no ``/v1``), with ``model`` (None: the server's first). The
    server-side figures (KV utilization, step times) are the gRPC API's: not here.

    `connection`: `sluiceway.client.connection`'s keyword arguments (an API key, sent as
    ``Authorization: Bearer``; TLS files for an https:// `base_url`). `keep_alive`: False
    closes each request's connection after its response (one connection per request).

    Raises:
        RuntimeError: no model listed, or the warm-up request failed.
    """
    base_url = base_url.rstrip("/").removesuffix("/v1")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None if keep_alive else 0)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None), limits=limits, **_http_connection(connection or {})
    ) as client:
        model = model or await served_model(client, base_url)
        if requests:  # vLLM's initial test run
            warmup = await _one(client, base_url, model, requests[0], ignore_eos)
            if not warmup.ok:
                raise RuntimeError(f"warm-up request failed: {warmup.error}")
        results, duration = await send_workload(
            lambda _, r: _one(client, base_url, model, r, ignore_eos),
            requests, intervals, max_concurrency, desc,
        )  # fmt: skip
    return results, summarize(results, duration)
