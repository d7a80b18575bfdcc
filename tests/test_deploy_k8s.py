"""deploy/k8s against the code and against each other, without a cluster: the manifests
parse and kustomization.yaml lists them all; every container's command line parses with the
real `sluiceway` parser; the routers serve on the default ports behind their Service and dial
each replica pod's scheduler through the headless Service; each replica pod holds its
scheduler and one worker per GPU (ranks 0..N-1, one rendezvous, no port used twice), each
probed on its gRPC port.
"""

from __future__ import annotations

from collections import Counter
from urllib.parse import urlsplit

from tests.deploy_config import (
    ANY_HOST,
    K8S,
    ROUTER,
    SCHEDULER,
    _check_model_splits,
    _check_ranks,
    _container_ports,
    _grpc_port,
    _hostport,
    _http_address,
    _k8s,
    _k8s_docs,
    _pod_args,
    _selects,
    _yaml,
)


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
