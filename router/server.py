"""The router process: the gRPC front and the OpenAI-compatible HTTP front over one request path.

Stateless: tokenizes, validates, forwards token ids to a scheduler, and turns the token stream
that comes back into text deltas (router/request_path.py). Any number of routers can serve the
same schedulers; a router given several schedulers (model replicas) spreads its requests over
them (router/balancer.py). The fronts are peers: router/grpc_api.py and router/openai_api.py
each call the path and neither imports the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import structlog

from sluiceway.grpc_server import DEFAULT_MAX_MESSAGE_BYTES, on_shutdown_signal, set_health
from sluiceway.router.balancer import DEFAULT_BALANCE_ABS_THRESHOLD, DEFAULT_CACHE_THRESHOLD
from sluiceway.router.grpc_api import start_router
from sluiceway.router.request_path import RequestPath
from sluiceway.router.tokenizer import load_tokenizer

log = structlog.get_logger("router")


async def serve(
    address: str,
    scheduler_addresses: str | Sequence[str],
    model_dir: Path,
    *,
    drain_timeout_s: float = 30.0,
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
    balance_abs_threshold: int = DEFAULT_BALANCE_ABS_THRESHOLD,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    http_port: int | None = None,
    http_host: str = "127.0.0.1",
) -> None:
    """Serves the public API on `address` until SIGINT/SIGTERM, then drains; the
    OpenAI-compatible HTTP API (router/openai_api.py) on `http_host:http_port` too unless
    the port is None (0: a free port; OSError if it is taken).

    `scheduler_addresses`: one scheduler address, several comma-separated in a
    string, or a list; requests are spread over them (router/balancer.py, with
    `cache_threshold` and `balance_abs_threshold`).
    Raises ValueError when there is none or one is given twice.

    A request or response over `max_message_bytes` bytes gets RESOURCE_EXHAUSTED.

    Health is NOT_SERVING until a scheduler reports ready, and again whenever
    none does. On a signal the router drains: health NOT_SERVING, new
    `Generate` streams get UNAVAILABLE, the streams in flight run to their end
    for at most `drain_timeout_s` seconds, then the server stops. Prometheus
    metrics on `metrics_host:metrics_port` unless the port is None (OSError if
    it is taken).
    """
    if metrics_port is not None:
        from sluiceway.metrics import serve_metrics

        serve_metrics(metrics_port, metrics_host)
    tokenizer = load_tokenizer(model_dir)
    path = RequestPath(
        tokenizer,
        model_dir,
        scheduler_addresses,
        cache_threshold=cache_threshold,
        balance_abs_threshold=balance_abs_threshold,
    )
    router = await start_router(path, address, max_message_bytes=max_message_bytes)
    http = None
    if http_port is not None:
        from sluiceway.router.openai_api import start_http_server

        http = await start_http_server(path, http_host, http_port)
    log.info(
        "router_listening",
        address=router.address,
        http=http.url if http is not None else None,
        schedulers=path.pool.addresses,
    )
    stop = asyncio.Event()
    on_shutdown_signal(stop.set)
    await stop.wait()
    path.draining = True
    await set_health(router.health, router.names, serving=False)
    log.info("router_draining", in_flight=path.num_in_flight, drain_timeout_s=drain_timeout_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + drain_timeout_s
    while path.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    log.info("router_stopping", unfinished=path.num_in_flight)
    if http is not None:
        await http.stop()
    await router.stop(grace=1.0)
