"""The router process: the gRPC front and the OpenAI-compatible HTTP front over one request path.

Stateless: tokenizes, validates, forwards token ids to a scheduler, and turns the token stream
that comes back into text deltas (router/request_path.py). Any number of routers can serve the
same schedulers; a router given several schedulers (model replicas) spreads its requests over
them (router/balancer.py). The fronts are peers: router/grpc_api.py and router/openai_api.py
each call the path and neither imports the other.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import structlog

from sluiceway.grpc_server import ShutdownSignals, set_health
from sluiceway.options import port_or_none
from sluiceway.router.auth import ApiKeys, server_credentials
from sluiceway.router.config import RouterConfig
from sluiceway.router.grpc_api import Router, start_router
from sluiceway.router.request_path import RequestPath
from sluiceway.router.tokenizer import load_chat_template, load_tokenizer
from sluiceway.security import api_keys

log = structlog.get_logger("router")

# Once the streams are cut, how long they may take to end (each ends at its next event:
# milliseconds).
CUT_WAIT_S = 1.0
# How long the gRPC server lets its other calls (Tokenize, a health watch) finish when it
# stops after a drain, and after a cut (stop now).
STOP_GRACE_S = 1.0
STOP_NOW_GRACE_S = 0.2


async def serve(config: RouterConfig, model_dir: Path) -> None:
    """Serves the public API on `config.host:config.port` until SIGINT/SIGTERM, then drains;
    the OpenAI-compatible HTTP API (router/openai_api.py) on `config.http_host` (default:
    `config.host`) `:config.http_port` too unless the port is -1 (0: a free port; OSError if
    it is taken). `model_dir`: the resolved `config.model`, whose tokenizer is loaded (with
    `config.chat_template` instead of its own template when given; ValueError if that cannot
    be read or parsed: `router.tokenizer.load_chat_template`).

    `config.scheduler`: one scheduler address or several comma-separated; requests are
    spread over them (router/balancer.py, with `config.cache_threshold` and
    `config.balance_abs_threshold`).
    Raises ValueError when there is none or one is given twice.

    A request or response over `config.max_message_size` bytes gets RESOURCE_EXHAUSTED.

    Both ports take TLS and API keys from the config's `ssl_*` and `api_key*` fields (and
    $SLUICEWAY_API_KEY: `sluiceway.security.api_keys`; docs/security.md). ValueError for a
    key file that cannot be read; OSError for a certificate file.

    Health is NOT_SERVING until a scheduler reports ready, and again whenever
    none does. On a signal the router drains: health NOT_SERVING, new
    `Generate` streams get UNAVAILABLE, the streams in flight run to their end
    for at most `config.drain_timeout` seconds or until a second signal, then those left
    end with UNAVAILABLE "server shutting down" (`drain`) and the server stops. Prometheus
    metrics on `config.metrics_host:config.metrics_port` unless the port is -1 (OSError if
    it is taken).
    """
    address = f"{config.host}:{config.port}"
    drain_timeout_s = config.drain_timeout
    metrics_port, http_port = port_or_none(config.metrics_port), port_or_none(config.http_port)
    if metrics_port is not None:
        from sluiceway.metrics import serve_metrics

        serve_metrics(metrics_port, config.metrics_host)
    template = None if config.chat_template is None else load_chat_template(config.chat_template)
    tokenizer = load_tokenizer(model_dir, chat_template=template)
    path = RequestPath(
        tokenizer,
        model_dir,
        config.scheduler,
        tool_call_parser=config.tool_call_parser,
        enable_auto_tool_choice=config.enable_auto_tool_choice,
        cache_threshold=config.cache_threshold,
        balance_abs_threshold=config.balance_abs_threshold,
    )
    keys = api_keys(config)
    auth = ApiKeys(keys) if keys else None
    router = await start_router(
        path, address, max_message_bytes=config.max_message_size, api_keys=auth,
        credentials=server_credentials(config), internal_address=config.internal_listen,
    )  # fmt: skip
    http = None
    if http_port is not None:
        from sluiceway.router.openai_api import start_http_server

        http = await start_http_server(
            path, config.http_host or config.host, http_port, api_keys=auth, tls=config,
            max_body_bytes=config.max_message_size,
        )  # fmt: skip
    signals = ShutdownSignals()  # before saying so: a signal from then on drains
    log.info(
        "router_listening",
        address=router.address,
        http=http.url if http is not None else None,
        schedulers=path.pool.addresses,
        tls=config.tls,
        client_certificates=config.client_cert_required,
        api_keys=len(keys),
    )
    await signals.first.wait()
    cut = await drain(router, signals.second, drain_timeout_s)
    log.info("router_stopping", unfinished=path.num_in_flight)
    grace = STOP_NOW_GRACE_S if cut else STOP_GRACE_S
    await asyncio.gather(router.stop(grace), *([http.stop()] if http is not None else []))


async def drain(router: Router, stop_now: asyncio.Event, drain_timeout_s: float) -> bool:
    """Takes the router out of service (health NOT_SERVING, new generations UNAVAILABLE) and
    lets the streams in flight run to their end, for at most `drain_timeout_s` seconds or
    until `stop_now` is set; then cuts those left (UNAVAILABLE "server shutting down", which
    each front presents: `RequestPath.cut_streams`) and waits up to CUT_WAIT_S for them to
    end, so that no stream is left to a server's stop to reset. Returns whether it cut."""
    path = router.path
    path.draining = True
    await set_health(router.health, router.names, serving=False)
    log.info("router_draining", in_flight=path.num_in_flight, drain_timeout_s=drain_timeout_s)
    idle = asyncio.create_task(path.wait_idle())
    now = asyncio.create_task(stop_now.wait())
    done, _ = await asyncio.wait(
        {idle, now}, timeout=drain_timeout_s, return_when=asyncio.FIRST_COMPLETED
    )
    now.cancel()
    if idle in done:
        return False
    reason = "second signal" if now in done else "drain timeout"
    log.warning("router_cutting_streams", streams=path.num_in_flight, reason=reason)
    path.cut_streams()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(idle, CUT_WAIT_S)
    return True
