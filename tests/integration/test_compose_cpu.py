"""`docker compose -f compose.cpu.yaml up`, for real: the stack of containers on this
machine's CPU (two replicas, two routers, nginx in front), traffic through the balancer,
a worker killed and back, and `down` leaving nothing behind.

Selected only by SLUICEWAY_COMPOSE_CHECK=1 (scripts/compose_check.sh sets it, after it has
built the images): it needs a Docker engine with Compose v2, the images `sluiceway:cpu` and
`sluiceway-nginx:cpu`, and the ports of compose.cpu.yaml free; it takes minutes, and the
image build before it longer (docs/deploy.md has the figures), so CI leaves it out.

Restart policy and `docker kill`: Docker disables a container's restart policy when it is
stopped by hand, and `docker kill` counts as by hand (docker-kill(1): "the restart policy
is disabled until the next time the container is started"). So a crash is a SIGKILL of the
worker's process from the host (what an OOM kill or a segfault looks like to Docker), which
the restart policy answers; a `docker kill`ed worker stays down until `docker compose
start`, and the other replica serves meanwhile. Both are tested.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        os.environ.get("SLUICEWAY_COMPOSE_CHECK") != "1",
        reason="docker compose check: scripts/compose_check.sh (SLUICEWAY_COMPOSE_CHECK=1)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.cpu.yaml"
SPEC = yaml.safe_load(COMPOSE_FILE.read_text())
PROJECT = SPEC["name"]
COMPOSE = ["docker", "compose", "-f", str(COMPOSE_FILE)]
# The router, scheduler and worker services: those with a healthcheck (`cache` exits).
SLUICEWAY_SERVICES = [n for n, s in SPEC["services"].items() if "healthcheck" in s]
# The balancer's listeners, as its start command writes them into nginx.conf.
LB_GRPC, LB_HTTP_PORT = re.findall(
    r"listen (127\.0\.0\.1:\d+)", " ".join(SPEC["services"]["lb"]["command"])
)
HEALTHY_TIMEOUT_S = 300
MAX_TOKENS = 16


def log(message: str) -> None:
    """A line for the record (pytest -s shows it; docs/deploy.md quotes the run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(*args: str, timeout: float = 300, check: bool = True) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)}: exit {result.returncode}\n{result.stderr}")
    return result.stdout


def container(service: str) -> str:
    return sh(*COMPOSE, "ps", "-a", "-q", service).strip()


def inspect(service: str) -> dict[str, Any]:
    (state,) = json.loads(sh("docker", "inspect", container(service)))
    return dict(state)


def states() -> dict[str, str]:
    """Each service's container: its health ("healthy", "starting", "unhealthy"), or its
    state where it has no healthcheck ("running", "exited"). One `docker compose ps`."""
    rows = [json.loads(line) for line in sh(*COMPOSE, "ps", "-a", "--format", "json").splitlines()]
    return {r["Service"]: r["Health"] or r["State"] for r in rows}


def wait_healthy(services: list[str], timeout_s: float = HEALTHY_TIMEOUT_S) -> dict[str, float]:
    """Waits until every service's container is running and its healthcheck healthy;
    returns the seconds each took to turn healthy."""
    start = time.monotonic()
    healthy: dict[str, float] = {}
    while True:
        now = states()
        for s in services:
            if now.get(s) == "healthy":
                healthy.setdefault(s, round(time.monotonic() - start, 1))
        if len(healthy) == len(services):
            return healthy
        if time.monotonic() - start > timeout_s:
            logs = sh(*COMPOSE, "logs", "--tail", "30", check=False)
            raise AssertionError(f"not healthy after {timeout_s} s: {now}\n{logs}")
        time.sleep(1)


def project_containers() -> list[str]:
    """Every container of the project, running or not."""
    out = sh("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}")
    return out.split()


def stream(client: Client, i: int) -> tuple[int, int]:
    """A greedy gRPC stream with EOS ignored: (its token count, its finish reason), or
    (-1, the gRPC status code's value) when it failed."""
    request = Client.request(
        f"Stream {i}: count from one to fifty.", temperature=0, max_tokens=MAX_TOKENS,
        ignore_eos=True,
    )  # fmt: skip
    tokens, finish = 0, 0
    try:
        for response in client.stub.Generate(request, timeout=300):
            tokens += len(response.token_ids)
            finish = response.finish_reason
    except grpc.RpcError as e:
        log(f"stream {i} failed: {e.code().name}: {e.details()}")
        return -1, e.code().value[0]
    return tokens, finish


WHOLE = (MAX_TOKENS, inference_pb2.FINISH_REASON_LENGTH)


def streams(n: int) -> list[tuple[int, int]]:
    """n concurrent streams over one client connection to the balancer."""
    with Client(LB_GRPC) as client, ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: stream(client, i), range(n)))


def sse_completion(i: int) -> tuple[int, bool]:
    """A streamed /v1/completions through the balancer: (its text chunks, [DONE] seen)."""
    host, port = LB_HTTP_PORT.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"prompt": f"Stream {i}: count to ten.", "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        assert response.status == 200, response.read()
        chunks, done = 0, False
        while line := response.readline():
            if line.strip() == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                chunks += bool(json.loads(line[6:])["choices"][0]["text"])
        return chunks, done
    finally:
        conn.close()


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(row.rsplit(" ", 1)[1]) for row in text.splitlines() if row.startswith(name))


def metrics_port(service: str) -> int:
    command = [str(a) for a in SPEC["services"][service]["command"]]
    return int(command[command.index("--metrics-port") + 1])


ROUTER_METRICS = {r: metrics_port(r) for r in ("router-0", "router-1")}
SCHEDULER_METRICS = {s: metrics_port(s) for s in ("scheduler-0", "scheduler-1")}


def served() -> dict[str, float]:
    """Requests each router finished and each scheduler took, so far."""
    out = {r: metric(p, "sluiceway:request_success_total{") for r, p in ROUTER_METRICS.items()}
    for s, p in SCHEDULER_METRICS.items():
        out[s] = metric(p, "sluiceway:scheduler_requests_total{")
    return out


Processes = set[tuple[int, str]]  # (host PID, start time)


def start_time(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat, field 22), None once it is gone: with the
    PID, it tells a process from a later one that reuses its PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def host_processes() -> Processes:
    """(host PID, start time) of every process in the project's running containers."""
    found = set()
    for cid in project_containers():
        out = sh("docker", "top", cid, "-eo", "pid", check=False)
        for pid in (int(p) for p in out.split()[1:] if p.isdigit()):
            if (started := start_time(pid)) is not None:
                found.add((pid, started))
    return found


@pytest.fixture(scope="module")
def stack() -> Iterator[Processes]:
    """`docker compose up -d` (no build: compose_check.sh built the images) until every
    container is healthy; yields the host PIDs seen in the containers. `down` at the end,
    whatever happened (the last test checks that it leaves nothing)."""
    for image in ("sluiceway:cpu", "sluiceway-nginx:cpu"):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            pytest.fail(f"no image {image}: scripts/compose_check.sh builds it")
    sh(*COMPOSE, "down", "-v", "--timeout", "60", timeout=300)
    start = time.monotonic()
    sh(*COMPOSE, "up", "-d", "--no-build", timeout=300)
    log(f"docker compose up -d: {time.monotonic() - start:.1f} s")
    healthy = wait_healthy(SLUICEWAY_SERVICES)
    log(f"all {len(SLUICEWAY_SERVICES)} sluiceway containers healthy "
        f"{time.monotonic() - start:.1f} s after `up -d` began; each, s after it returned: "
        f"{healthy}")  # fmt: skip
    pids = host_processes()
    try:
        yield pids
    finally:
        sh(*COMPOSE, "down", "-v", "--timeout", "60", timeout=300, check=False)


def test_twenty_streams_through_the_balancer_end_whole_on_both_replicas(stack: Processes) -> None:
    print(sh(*COMPOSE, "ps", "--format", "table {{.Service}}\t{{.Status}}"))
    workers = sh(*COMPOSE, "logs", "worker-0", "worker-1")
    assert "compiling the C++ CPU kernels" not in workers, "the image's build was not used"
    before = served()
    start = time.monotonic()
    results = streams(20)
    log(f"20 gRPC streams through nginx: {results.count(WHOLE)} whole "
        f"({MAX_TOKENS} tokens, FINISH_REASON_LENGTH) in {time.monotonic() - start:.1f} s")  # fmt: skip
    assert results == [WHOLE] * 20
    with ThreadPoolExecutor(4) as pool:
        sse = list(pool.map(sse_completion, range(4)))
    log(f"4 SSE /v1/completions through nginx: {sse}")
    assert all(chunks > 0 and done for chunks, done in sse), sse
    delta = {k: v - before[k] for k, v in served().items()}
    log(f"requests per router and scheduler: {delta}")
    assert delta["router-0"] + delta["router-1"] == 24, delta
    assert all(delta[r] > 0 for r in ROUTER_METRICS), f"nginx balanced per stream: {delta}"
    assert all(delta[s] > 0 for s in SCHEDULER_METRICS), f"both replicas served: {delta}"


def test_a_crashed_worker_is_restarted_and_its_replica_serves_again(stack: Processes) -> None:
    """SIGKILL of worker-0's process from the host: the restart policy starts it again,
    its healthcheck turns healthy, and replica 0 takes requests again."""
    state = inspect("worker-0")["State"]
    restarts = inspect("worker-0")["RestartCount"]
    os.kill(state["Pid"], 9)
    start = time.monotonic()
    log(f"worker-0: SIGKILL to its process (host pid {state['Pid']})")
    # Meanwhile the other replica serves whatever comes.
    during = streams(10)
    log(f"10 streams while worker-0 is down or loading: {during.count(WHOLE)} whole")
    assert during == [WHOLE] * 10
    while inspect("worker-0")["RestartCount"] == restarts:
        assert time.monotonic() - start < 60, "the restart policy did not restart worker-0"
        time.sleep(0.5)
    restarted = time.monotonic() - start
    wait_healthy(["worker-0", "scheduler-0"])
    log(f"worker-0 restarted by Docker {restarted:.1f} s after the kill (RestartCount "
        f"{restarts} -> {inspect('worker-0')['RestartCount']}); it and scheduler-0 healthy "
        f"again {time.monotonic() - start:.1f} s after the kill")  # fmt: skip
    twenty_streams_reach("scheduler-0")
    stack |= host_processes()


def twenty_streams_reach(scheduler: str) -> None:
    """20 streams through the balancer end whole, and `scheduler`'s replica serves some."""
    before = served()
    after = streams(20)
    delta = {k: v - before[k] for k, v in served().items()}
    log(f"20 streams after: {after.count(WHOLE)} whole; per scheduler {delta}")
    assert after == [WHOLE] * 20
    assert delta[scheduler] > 0, f"{scheduler}'s replica serves again: {delta}"


def test_a_docker_killed_worker_stays_down_until_started(stack: Processes) -> None:
    """`docker kill worker-1`: stopped by hand, so no restart (Docker's rule); replica 0
    serves everything; `docker compose start worker-1` brings replica 1 back."""
    restarts = inspect("worker-1")["RestartCount"]
    sh("docker", "kill", container("worker-1"))
    start = time.monotonic()
    log("docker kill worker-1")
    during = streams(10)
    log(f"10 streams with worker-1 killed: {during.count(WHOLE)} whole")
    assert during == [WHOLE] * 10
    time.sleep(max(0.0, 5 - (time.monotonic() - start)))
    state = inspect("worker-1")
    log(f"worker-1 after {time.monotonic() - start:.0f} s: {state['State']['Status']}, "
        f"RestartCount {state['RestartCount']}")  # fmt: skip
    assert state["State"]["Status"] == "exited" and state["RestartCount"] == restarts
    sh(*COMPOSE, "start", "worker-1")
    healthy = wait_healthy(["worker-1", "scheduler-1"])
    log(f"docker compose start worker-1: healthy again in {max(healthy.values()):.1f} s")
    twenty_streams_reach("scheduler-1")
    stack |= host_processes()


def test_down_leaves_no_container_volume_or_process(stack: Processes) -> None:
    start = time.monotonic()
    sh(*COMPOSE, "down", "-v", "--timeout", "60", timeout=300)
    log(f"docker compose down -v: {time.monotonic() - start:.1f} s")
    assert project_containers() == [], sh("docker", "ps", "-a")
    volumes = sh(
        "docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"
    )
    assert volumes.split() == []
    alive = sorted(pid for pid, started in stack if start_time(pid) == started)
    log(f"{len(stack)} container processes seen during the run, alive after down: {alive}")
    assert alive == []
