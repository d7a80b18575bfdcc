"""The TCP ports of a `serve` stack: planned before any child starts (the routers' gRPC and
HTTP ports, every process's metrics port), and the OS's free ports for the `0`s."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from sluiceway.layout import metrics_order, stack_layout
from sluiceway.preflight import ConfigError
from sluiceway.serve_config import ServeConfig


@dataclass(slots=True)
class Ports:
    """The TCP ports of one stack: each router's gRPC and HTTP (empty: off) port, and the
    metrics ports of the routers, then the schedulers, then the workers (-1 each: off)."""

    routers: list[int]
    http: list[int]
    metrics: list[int]

    def all(self) -> list[int]:
        """Every port of the plan (-1 too)."""
        return [*self.routers, *self.http, *self.metrics]


def num_workers(config: ServeConfig) -> int:
    """Worker processes of the stack: replicas x model instances x tensor-parallel ranks."""
    sched = config.scheduler
    return config.num_replicas * len(sched.group_roles) * sched.tensor_parallel_size


def plan_ports(config: ServeConfig) -> Ports:
    """The ports of the stack `config` describes: consecutive ones from each first port, or
    distinct free ones for 0 (picked here, not by the children: the launcher dials each
    router's health service and prints the metrics addresses), each checked free.

    Raises:
        ConfigError: a port of the plan cannot be listened on (`check_ports`).
    """
    n = config.num_routers
    routers = [config.port + i for i in range(n)] if config.port else free_ports(n, config.host)
    http_host = config.router.http_host or config.host
    http: list[int] = []
    if config.http_port > 0:
        http = [config.http_port + i for i in range(n)]
    elif config.http_port == 0:
        http = free_ports(n, http_host, exclude=routers)
    count = n + config.num_replicas + num_workers(config)
    ports = Ports(routers, http, metrics_ports(config.metrics_port, count, [*routers, *http]))
    check_ports(config, ports)
    return ports


def check_ports(config: ServeConfig, ports: Ports) -> None:
    """Checks that every port of `ports` can be listened on, before any child starts.

    Raises:
        ConfigError: the first that cannot, naming the flag it comes from and, for a port
            derived from it (the next routers, every process's metrics), whose port it is:
            ``--http-port 8000 is taken (Address already in use)``, ``--metrics-port 9400:
            port 9401 (scheduler's metrics) is taken (Address already in use)``.
    """
    processes = metrics_order(stack_layout(config))
    routers = [p.name for p in processes if p.command == "router"]
    http_host = config.router.http_host or config.host
    planned = [
        *[("--port", config.port, config.host, port, f"{name}'s gRPC")
          for name, port in zip(routers, ports.routers, strict=True)],
        *[("--http-port", config.http_port, http_host, port, f"{name}'s HTTP")
          for name, port in zip(routers, ports.http, strict=False)],
        *[("--metrics-port", config.metrics_port, config.host, port, f"{p.name}'s metrics")
          for p, port in zip(processes, ports.metrics, strict=True) if port >= 0],
    ]  # fmt: skip
    for flag, value, host, port, whose in planned:
        error = bind_error(host, port)
        if error is None:
            continue
        where = f"{flag} {value}" if port == value else f"{flag} {value}: port {port} ({whose})"
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"{where} is taken ({error.strerror})")
        raise ConfigError(f"{where}: cannot listen on {host}:{port} ({error.strerror or error})")


def bind_error(host: str, port: int) -> OSError | None:
    """Why `host:port` cannot be listened on (None when it can): checked before the children
    start, so that another server answering health checks there is never taken for ours."""
    if port == 0:
        return None
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # as gRPC does: a port left in TIME_WAIT by a server just stopped is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e
    return None


def metrics_ports(first: int, count: int, exclude: list[int]) -> list[int]:
    """Metrics ports of `count` processes (routers, schedulers, workers, in that order):
    `first`, `first + 1`, ...; distinct free ports, none in `exclude`, for 0; -1 (off) for
    every process when `first` is negative."""
    if first < 0:
        return [-1] * count
    if first > 0:
        return [first + i for i in range(count)]
    return free_ports(count, exclude=exclude)


def free_ports(count: int, host: str = "127.0.0.1", exclude: Sequence[int] = ()) -> list[int]:
    """`count` distinct TCP ports nothing listens on right now, none in `exclude` (the OS's
    picks, all held open until every one is picked; another process may take one before it
    is used)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < count:
            s = held.enter_context(socket.socket(family))
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (see `free_ports`)."""
    return free_ports(1, host)[0]
