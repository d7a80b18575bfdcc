"""compose.cpu.yaml (the stack in containers on a CPU machine, every container on the host's
network) and the Dockerfile's build arguments, against the code, without a Docker engine.
tests/integration/test_compose_cpu.py runs the file for real (scripts/compose_check.sh).

The file follows the Compose specification; every command line parses with the real
`sluiceway` parser; every process listens on 127.0.0.1 on a port no other process of the
file (nor a default `sluiceway serve`) uses; the routers dial every scheduler and each
worker its own; each healthcheck asks its process's gRPC port; the balancer's start
command turns deploy/nginx/nginx.conf into a configuration that names the routers' ports
(checked by `nginx -t` where nginx is installed).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluiceway.router.config import RouterConfig
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.worker.config import WorkerConfig
from tests.deploy_config import (
    APP,
    HEALTHCHECK,
    ROOT,
    _bind_mounts,
    _check_jsonschema,
    _command,
    _grpc_port,
    _hostport,
    _http_address,
    _parse,
)

COMPOSE_CPU = ROOT / "compose.cpu.yaml"
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
LOOPBACK = "127.0.0.1"
# What a `sluiceway serve` with its defaults holds on the same machine.
DEFAULT_PORTS = {
    RouterConfig().port,
    RouterConfig().http_port,
    RouterConfig().metrics_port,
    _hostport(SchedulerConfig().listen)[1],
    SchedulerConfig().metrics_port,
    WorkerConfig().metrics_port,
}
BYTES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _services() -> dict[str, dict[str, Any]]:
    return dict(yaml.safe_load(COMPOSE_CPU.read_text())["services"])


def _sluiceway_services() -> dict[str, argparse.Namespace]:
    """Service name -> its parsed command line, for the router, scheduler and worker
    services (the sluiceway image's, but for `cache`)."""
    return {
        name: _parse(_command(s), f"compose.cpu.yaml service {name}")
        for name, s in _services().items()
        if s["image"] == "sluiceway:cpu" and name != "cache"
    }


def _of(command: str) -> dict[str, argparse.Namespace]:
    return {n: a for n, a in _sluiceway_services().items() if a.command == command}


def _listens(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Every (host, port) the process listens on: gRPC, HTTP (routers), metrics."""
    if args.command == "router":
        grpc = (args.host, args.port)
        out = [grpc, _http_address(args)]
    else:
        out = [_hostport(args.listen)]
    return [*out, (args.metrics_host, args.metrics_port)]


def _size(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kmg]?)b?", str(text).lower()).groups()  # type: ignore[union-attr]
    return int(number) * BYTES.get(unit, 1)


def _render_nginx(tmp_path: Path) -> str:
    """The balancer's start command, run here: its sed over deploy/nginx/nginx.conf."""
    command = _services()["lb"]["command"]
    assert command[:2] == ["sh", "-c"]
    words = shlex.split(command[2])
    assert words[0] == "sed" and "/etc/nginx/sluiceway.conf" in words
    mounted = dict((t, s) for s, t in _bind_mounts(_services()["lb"]))
    assert (ROOT / mounted["/etc/nginx/sluiceway.conf"]).resolve() == NGINX_CONF
    expressions = words[1 : words.index("/etc/nginx/sluiceway.conf")]
    assert "&&" in words and words[words.index("&&") + 1 :][:3] == ["exec", "nginx", "-c"]
    result = subprocess.run(
        ["sed", *expressions, str(NGINX_CONF)], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_compose_cpu_file_follows_the_compose_specification() -> None:
    result = _check_jsonschema(COMPOSE_CPU)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_is_on_the_host_network_without_gpu_or_published_port() -> None:
    for name, service in _services().items():
        assert service["network_mode"] == "host", name
        assert "ports" not in service, f"{name}: nothing to publish on the host's network"
        assert "devices" not in str(service.get("deploy", {})), f"{name}: no GPU here"
        assert service.get("ipc") != "host", f"{name}: the host's /dev/shm holds others' pools"
        assert service["restart"] == ("no" if name == "cache" else "unless-stopped"), name
    for name, args in _of("worker").items():
        assert args.device == "cpu", name
        assert _size(_services()[name]["shm_size"]) > args.kv_cache_memory, (
            f"{name}: /dev/shm holds the KV pool"
        )


def test_every_process_listens_on_loopback_on_a_port_of_its_own() -> None:
    ports: list[int] = []
    for name, args in _sluiceway_services().items():
        for host, port in _listens(args):
            assert host == LOOPBACK, f"{name} listens on {host}"
            assert port > 0, f"{name}: a fixed port, the others dial it"
            ports.append(port)
    lb = " ".join(_services()["lb"]["command"])
    ports += [int(p) for p in re.findall(r"listen 127\.0\.0\.1:(\d+)", lb)]
    assert len(ports) == len(set(ports)), f"a port used twice: {sorted(ports)}"
    assert not set(ports) & DEFAULT_PORTS, "a `sluiceway serve` on the machine would hold it"
    assert all(p < 32768 for p in ports), "below Linux's ephemeral range"


def test_routers_dial_every_scheduler_and_each_worker_its_own() -> None:
    schedulers = {name: args.listen for name, args in _of("scheduler").items()}
    routers, workers = _of("router"), _of("worker")
    assert len(routers) == 2 and len(schedulers) == 2, "two routers, two replicas"
    for name, args in routers.items():
        assert sorted(args.scheduler.split(",")) == sorted(schedulers.values()), name
        depends = _services()[name]["depends_on"]
        assert set(depends) == {"cache", *schedulers}, name
    dialed = []
    for name, args in workers.items():
        assert args.scheduler in schedulers.values(), f"{name}: {args.scheduler}"
        (scheduler,) = [s for s, a in schedulers.items() if a == args.scheduler]
        assert scheduler in _services()[name]["depends_on"], name
        assert (args.advertise or args.listen) == args.listen, f"{name}: dialed where it listens"
        dialed.append(scheduler)
    assert sorted(dialed) == sorted(schedulers), "one worker per replica"


def test_the_cache_volume_is_filled_once_before_a_process_mounts_it() -> None:
    """Containers created at once race on copying the image's /cache into the new volume
    (moby/moby#43068): `cache` copies it alone, and every other mount waits for it."""
    cache = _services()["cache"]
    assert cache["image"] == "sluiceway:cpu" and cache["restart"] == "no"
    assert cache["command"] == ["--version"], "exits 0 at once"
    assert "sluiceway-cache:/cache" in cache["volumes"]
    for name, service in _services().items():
        if name != "cache" and any(
            v.startswith("sluiceway-cache:") for v in service.get("volumes", [])
        ):
            condition = service["depends_on"]["cache"]["condition"]
            assert condition == "service_completed_successfully", name


def test_healthchecks_ask_each_process_on_its_grpc_port() -> None:
    script = f"{APP}/{HEALTHCHECK.relative_to(ROOT).as_posix()}"
    for name, args in _sluiceway_services().items():
        test = _services()[name]["healthcheck"]["test"]
        assert test == ["CMD", "python", script, f"{LOOPBACK}:{_grpc_port(args)}"], name
        assert "start_interval" not in _services()[name]["healthcheck"], (
            f"{name}: Compose refuses start_interval on Docker Engine < 25 (Debian 12: 20.10)"
        )


def test_nginx_start_command_names_every_router(tmp_path: Path) -> None:
    conf = _render_nginx(tmp_path)
    routers = _of("router").values()
    servers = re.findall(r"server ([\d.]+):(\d+) max_fails", conf)
    grpc = [(LOOPBACK, str(a.port)) for a in routers]
    http = [(LOOPBACK, str(_http_address(a)[1])) for a in routers]
    assert servers == grpc + http, "the gRPC upstream, then the HTTP one"
    code = "\n".join(line.split("#", 1)[0] for line in conf.splitlines())
    assert "router:" not in code, "no compose name is left to resolve"
    assert len(re.findall(r"listen 127\.0\.0\.1:\d+ http2;", conf)) == 1
    assert len(re.findall(r"listen 127\.0\.0\.1:\d+;", conf)) == 1
    nginx = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if nginx is None:
        return  # tests/integration/test_load_balancer.py requires nginx in CI
    (tmp_path / "logs").mkdir()
    path = tmp_path / "nginx.conf"
    path.write_text(conf)
    result = subprocess.run(
        [nginx, "-t", "-p", str(tmp_path), "-c", str(path), "-g", f"pid {tmp_path}/nginx.pid;"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_mounted_host_paths_exist() -> None:
    for name, service in _services().items():
        for source, _ in _bind_mounts(service):
            if source == "./models":
                continue
            assert (ROOT / source).exists(), f"{name}: {source} does not exist"


# ------------------------------------------------------------------ the Dockerfile


def _dockerfile_args(path: Path) -> dict[str, str | None]:
    """ARG NAME[=DEFAULT] of a Dockerfile: name -> default (None: no default)."""
    found = re.findall(r"^ARG (\w+)(=(\S*))?$", path.read_text(), flags=re.M)
    return {name: default if eq else None for name, eq, default in found}


def test_dockerfile_defaults_are_the_gpu_image() -> None:
    args = _dockerfile_args(ROOT / "Dockerfile")
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:")  # type: ignore[union-attr]
    assert args["TORCH_INDEX_URL"].startswith("https://download.pytorch.org/whl/cu")  # type: ignore[union-attr]
    assert args["SLUICEWAY_EXTRAS"] == "cuda"
    compose_gpu = yaml.safe_load((ROOT / "compose.yaml").read_text())
    assert compose_gpu["x-sluiceway"]["build"] == ".", "compose.yaml builds the defaults"
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS"):
        assert args[name] is None, f"{name}: unset unless given"


def test_compose_cpu_build_args_are_the_dockerfiles() -> None:
    built = {n: s["build"] for n, s in _services().items() if "build" in s}
    for name, build in built.items():
        dockerfile = ROOT / build["context"] / build.get("dockerfile", "Dockerfile")
        assert build["network"] == "host", f"{name}: no bridge for the RUN steps"
        declared = _dockerfile_args(dockerfile)
        assert set(build.get("args", {})) <= set(declared), f"{name}: {dockerfile}"
    (cpu,) = [b["args"] for b in built.values() if b["context"] == "."]
    assert cpu["TORCH_SPEC"] == "torch==2.13.0" and cpu["SLUICEWAY_EXTRAS"] == ""
    assert cpu["BASE_IMAGE"] == built["lb"]["args"]["BASE_IMAGE"]


def test_the_sluiceway_image_is_built_once_for_every_process() -> None:
    images = {s["image"] for s in _services().values()}
    assert images == {"sluiceway:cpu", "sluiceway-nginx:cpu"}
    ours = {n: s for n, s in _services().items() if s["image"] == "sluiceway:cpu"}
    builders = [n for n, s in ours.items() if "build" in s]
    assert len(builders) == 1, f"one build of sluiceway:cpu, not {builders}"
    assert ours[builders[0]]["build"]["context"] == "."
    for name, service in ours.items():
        assert "entrypoint" not in service, f"{name}: the image's ENTRYPOINT is sluiceway"


@pytest.mark.parametrize("script", ["docker_base_image.sh", "compose_check.sh"])
def test_scripts_parse(script: str) -> None:
    path = ROOT / "scripts" / script
    assert path.stat().st_mode & 0o111, f"{script} is executable"
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
