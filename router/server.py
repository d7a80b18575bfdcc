"""The router process: the gRPC front and the OpenAI-compatible HTTP front over one request path.

Stateless: tokenizes, validates, forwards token ids to a scheduler, and turns the token stream
that comes back into text deltas (router/request_path.py). Any number of routers can serve the
same schedulers; a router given several schedulers (model replicas) spreads its requests over
them (router/balancer.py). The fronts are peers: router/grpc_api.py and router/openai_api.py
each call the path and neither imports the other.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from sluiceway.grpc_server import on_shutdown_signal, set_health
from sluiceway.options import port_or_none
from sluiceway.router.config import RouterConfig
from sluiceway.router.grpc_api import start_router
from sluiceway.router.request_path import RequestPath
from sluiceway.router.tokenizer import load_tokenizer

log = structlog.get_logger("router")


async def serve(config: RouterConfig, model_dir: Path) -> None:
    """Serves the public API on `config.host:config.port` until SIGINT/SIGTERM, then drains;
    the OpenAI-compatible HTTP API (router/openai_api.py) on `config.http_host` (default:
    `config.host`) `:config.http_port` too unless the port is -1 (0: a free port; OSError if
    it is taken). `model_dir`: the resolved `config.model`, whose tokenizer is loaded.

    `config.scheduler`: one scheduler address or several comma-separated; requests are
    spread over them (router/balancer.py, with `config.cache_threshold` and
    `config.balance_abs_threshold`).
    Raises ValueError when there is none or one is given twice.

    A request or response over `config.max_message_size` bytes gets RESOURCE_EXHAUSTED.

    Health is NOT_SERVING until a scheduler reports ready, and again whenever
    none does. On a signal the router drains: health NOT_SERVING, new
    `Generate` streams get UNAVAILABLE, the streams in flight run to their end
    for at most `config.drain_timeout` seconds, then the server stops. Prometheus
    metrics on `config.metrics_host:config.metrics_port` unless the port is -1 (OSError if
    it is taken).
    """
    address = f"{config.host}:{config.port}"
    drain_timeout_s = config.drain_timeout
    metrics_port, http_port = port_or_none(config.metrics_port), port_or_none(config.http_port)
    if metrics_port is not None:
        from sluiceway.metrics import serve_metrics

        serve_metrics(metrics_port, config.metrics_host)
    tokenizer = load_tokenizer(model_dir)
    path = RequestPath(
        tokenizer,
        model_dir,
        config.scheduler,
        cache_threshold=config.cache_threshold,
        balance_abs_threshold=config.balance_abs_threshold,
    )
    router = await start_router(path, address, max_message_bytes=config.max_message_size)
    http = None
    if http_port is not None:
        from sluiceway.router.openai_api import start_http_server

        http = await start_http_server(path, config.http_host or config.host, http_port)
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
