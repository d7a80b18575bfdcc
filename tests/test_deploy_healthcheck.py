"""deploy/healthcheck.py (the containers' healthcheck) run against a real gRPC health
service, in plaintext and over TLS, and deploy/nginx/nginx.conf (the alternative to Envoy)
against compose.yaml's routers and Envoy's listeners.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy_config import (
    HEALTHCHECK,
    ROOT,
    ROUTER,
    _by_process,
    _envoy,
    _grpc_port,
    _http_address,
)


def _run_healthcheck(*args: str) -> int:
    result = subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, timeout=30
    )
    return result.returncode


def test_healthcheck_exits_0_only_when_serving() -> None:
    async def main() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        codes = []
        try:
            serving = health_pb2.HealthCheckResponse.SERVING
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            for status, extra in [
                (serving, ()),
                (not_serving, ()),
                (serving, ("--service", "sluiceway.v1.Inference")),  # unknown: NOT_FOUND
            ]:
                await servicer.set("", status)
                codes.append(await asyncio.to_thread(_run_healthcheck, address, *extra))
        finally:
            await server.stop(None)
        return codes

    assert asyncio.run(main()) == [0, 1, 1]


def test_healthcheck_exits_1_when_nothing_listens() -> None:
    from sluiceway.ports import free_port

    assert _run_healthcheck(f"127.0.0.1:{free_port()}", "--timeout", "1") == 1


def test_nginx_conf_listens_and_balances_like_envoy() -> None:
    """deploy/nginx/nginx.conf, the alternative to Envoy (run for real by
    tests/integration/test_load_balancer.py): the same public ports, the compose routers'
    ports upstream, nothing that would hold a stream back or cut it."""
    text = (ROOT / "deploy" / "nginx" / "nginx.conf").read_text()
    conf = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    (router_name,) = _by_process()["router"]
    args = _by_process()["router"][router_name]
    _, http_port = _http_address(args)
    assert re.findall(r"listen (\d+) http2;", conf) == [str(ROUTER.port)]
    assert re.findall(r"listen (\d+);", conf) == [str(ROUTER.http_port)]
    servers = re.findall(r"server ([\w.-]+):(\d+) ", conf)
    assert servers == [(router_name, str(_grpc_port(args))), (router_name, str(http_port))]
    assert "grpc_pass grpc://routers_grpc;" in conf
    assert "proxy_pass http://routers_http;" in conf
    assert "proxy_buffering off;" in conf and "gzip on" not in conf
    for directive in ("grpc_read_timeout", "grpc_send_timeout", "proxy_read_timeout"):
        assert re.search(rf"{directive} \d+d;", conf), directive
    # Envoy listens on the same two ports.
    listen = sorted(
        listener["address"]["socket_address"]["port_value"]
        for listener in _envoy()["static_resources"]["listeners"]
    )
    assert listen == sorted([ROUTER.port, ROUTER.http_port])


def test_healthcheck_asks_a_tls_router_over_tls(tmp_path: Path) -> None:
    """A router serving TLS (--ssl-certfile; a client certificate required with
    --ssl-ca-certs) is asked with --ssl-ca-certs (and the client certificate); plaintext fails."""
    from tests.tls_certs import make_certs

    certs = make_certs(tmp_path)
    credentials = grpc.ssl_server_credentials(
        [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(),
        require_client_auth=True,
    )

    async def main() -> list[int]:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
        await server.start()
        tls = ["--ssl-ca-certs", str(certs.ca)]
        client = ["--ssl-certfile", str(certs.client_cert), "--ssl-keyfile", str(certs.client_key)]
        try:
            return [
                await asyncio.to_thread(_run_healthcheck, address, *args, "--timeout", "2")
                for args in ([*tls, *client], tls, [])
            ]
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == [0, 1, 1]
