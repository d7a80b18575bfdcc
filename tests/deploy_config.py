"""Shared helpers of tests/test_deploy.py, tests/test_deploy_k8s.py and
tests/test_deploy_healthcheck.py (not a test module): the repository's deployment files
(compose.yaml, deploy/envoy, deploy/k8s) read and parsed, each command line with the real
`sluiceway` parser, and the processes' default ports.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from sluiceway import cli
from sluiceway.options import ProcessConfig
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


# The Compose specification's JSON schema ships inside check-jsonschema: no network.
CHECK_JSONSCHEMA = [
    sys.executable,
    "-m",
    "check_jsonschema",
    "--builtin-schema",
    "vendor.compose-spec",
]


def _check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CHECK_JSONSCHEMA, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
