"""`sluiceway serve`: workers, schedulers and routers as OS processes on one machine.

By default three processes: one worker, one scheduler, one router. With
`--tensor-parallel-size N` a model instance is N worker ranks; with
`--num-prefill-workers P --num-decode-workers D` a replica has P prefill and
D decode instances; `--num-replicas R` starts R schedulers, each with its own
workers; `--num-routers K` starts K routers on consecutive ports, each over
every scheduler.

The children talk over Unix sockets in a private temp folder; only the
routers listen on TCP. Children get SIGKILL if this process dies
(PR_SET_PDEATHSIG), so nothing is orphaned and a `serve` started again at once
finds its ports free; on SIGINT/SIGTERM the routers drain and stop first, then
the schedulers and workers. A child that fails is
started again, after a backoff that doubles with each recent restart
(RESTART_BACKOFF_S, 0.5 s, 1 s, 2 s, ...): a restarted scheduler takes its
replica's workers with it (they must register anew), a restarted
tensor-parallel rank takes the other ranks of its instance with it (they
would wait in a collective forever). A child that fails again after
MAX_RESTARTS restarts in RESTART_WINDOW_S is crash-looping (a circuit
breaker): its replica (scheduler and workers) or, for a router, the router
alone is stopped and left down while another replica or router serves, and
`serve` says which; when none would be left, the stack stops. A router that exits 0 (drained by a
SIGTERM of its own) is left down while another router still serves, and
stops the stack when it was the last one; any other process that exits 0, or
one that exits 2 (a usage or configuration error, such as a taken port),
stops the stack.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluiceway.client import wait_until_serving
from sluiceway.pids import dead_owner_paths

STARTUP_TIMEOUT_S = 600.0
RUN_DIR_PREFIX = "sluiceway-"  # + pid + "-": the children's Unix sockets
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """In a child between fork and exec: SIGKILL when the parent `parent_pid` dies.

    SIGKILL, not SIGTERM: with `serve` gone (SIGKILLed, crashed) nobody orders a drain, and a
    child still shutting down holds its ports (a `serve` started again at once would find its
    metrics port in use) and its KV pool's shared memory. What a killed child leaves behind
    is cleaned up by the next one: socket folders (`remove_stale_run_dirs`), CPU KV pool
    files (`worker.kv_pool`), both by dead owner pid. A parent that died before the prctl
    took effect is seen as a new parent pid: the child kills itself.
    """
    with contextlib.suppress(OSError, AttributeError):  # not Linux: rely on the signal handlers
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)


# A child that exits is started again, at most this many times per window, each restart
# RESTART_BACKOFF_S x 2**(restarts in the window - 1) after its exit (the first at once).
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
RESTART_BACKOFF_S = 0.5
RESTART_BACKOFF_MAX_S = 10.0


@dataclass(slots=True)
class Child:
    """One process of the stack. `command` is its `sluiceway` subcommand; `replica` and
    `instance` (its model instance within the replica) say what a failure takes down."""

    name: str
    command: str
    address: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    replica: int = 0
    instance: int = 0
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart
    left_down: bool = False  # exited on purpose, or given up on; not restarted
    exited_at: float | None = None  # time.monotonic() when its exit was seen

    @classmethod
    def start(
        cls,
        name: str,
        command: str,
        address: str,
        argv: list[str],
        replica: int = 0,
        instance: int = 0,
    ) -> Child:
        return cls(name, command, address, argv, _spawn(command, argv), replica, instance)

    def recent_restarts(self, now: float) -> int:
        """Restarts within the last RESTART_WINDOW_S seconds."""
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        return len(self.restarts)

    def restart_due(self, now: float) -> bool:
        """Whether the backoff since this (exited) child's exit has passed: 0 s after no
        recent restart, then RESTART_BACKOFF_S doubled per recent restart, at most
        RESTART_BACKOFF_MAX_S."""
        if self.exited_at is None:
            self.exited_at = now
        recent = self.recent_restarts(now)
        backoff = 0.0 if recent == 0 else RESTART_BACKOFF_S * 2 ** (recent - 1)
        return now - self.exited_at >= min(backoff, RESTART_BACKOFF_MAX_S)

    def restart(self) -> None:
        """Stops the process if it still runs, starts it again with the same flags."""
        self.restarts.append(time.monotonic())
        self.exited_at = None
        if self.process.poll() is None:
            self.process.terminate()
            _wait(self, STOP_TIMEOUT_S)
        self.process = _spawn(self.command, self.argv)
        print(f"sluiceway: {self.name} restarted (pid {self.process.pid})", flush=True)


def _spawn(command: str, argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return subprocess.Popen(
        [sys.executable, "-m", "sluiceway.cli", command, *argv],
        env=env,
        start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
    )


def _flag(name: str, value: object) -> list[str]:
    return [] if value is None else [f"--{name}", str(value)]


def _name(kind: str, *parts: tuple[str, int, int]) -> str:
    """`kind` followed by each (label, index, count) part whose count is above 1:
    ``worker``, ``worker-prefill0``, ``scheduler-1``, ``worker-r1-rank0`` ..."""
    suffix = "".join(f"-{label}{i}" for label, i, n in parts if n > 1)
    return kind + suffix


def serve_command(args: argparse.Namespace) -> int:
    """Starts the stack, waits until each process is SERVING, prints the address, waits for a
    signal. Returns 0 once stopped; 2 with one line on stderr for a configuration error found
    before the start or by a child that exits 2 while starting; 1 for another failure."""
    from sluiceway.logs import configure_logging
    from sluiceway.model_files import resolve_model, served_model_name
    from sluiceway.preflight import check_device, check_max_model_len, check_step_budget
    from sluiceway.scheduler.config import SchedulerConfig

    t0 = time.monotonic()
    configure_logging("serve", args.log_format, args.log_level)
    try:  # what the children would refuse, after importing torch and loading the model
        roles = SchedulerConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            num_prefill_workers=args.num_prefill_workers,
            num_decode_workers=args.num_decode_workers,
            scheduling_policy=args.scheduling_policy,
            static_batch_size=args.static_batch_size,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=args.enable_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
        ).group_roles
        check_step_budget(args.max_num_seqs, args.max_num_batched_tokens)
        check_device(args.device)
        model_dir = resolve_model(args.model)  # a GGUF converted once, before the children
        check_max_model_len(model_dir, args.max_model_len)
    except ValueError as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    model_id = served_model_name(model_dir, args.served_model_name)
    if args.port + args.num_routers - 1 > 65535:
        print(
            f"sluiceway: --num-routers {args.num_routers} from --port {args.port} runs past "
            "port 65535",
            file=sys.stderr,
        )
        return 2
    if args.port:
        router_ports = [args.port + i for i in range(args.num_routers)]
    else:  # picked here, not by the routers: the launcher dials each one's health service
        router_ports = free_ports(args.num_routers, args.host, exclude=())
    http_host = args.http_host or args.host
    http_ports: list[int] = []
    if args.http_port > 0:
        http_ports = [args.http_port + i for i in range(args.num_routers)]
    elif args.http_port == 0:
        http_ports = free_ports(args.num_routers, http_host, exclude=router_ports)
    for host, port in [(args.host, p) for p in router_ports] + [(http_host, p) for p in http_ports]:
        taken = _taken_port(host, port)
        if taken:
            print(f"sluiceway: cannot listen on {host}:{port}: {taken}", file=sys.stderr)
            return 2
    remove_stale_run_dirs()
    tmp = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    tp = args.tensor_parallel_size
    num_replicas = args.num_replicas
    num_workers = num_replicas * len(roles) * tp
    scheduler_addrs = [
        f"unix:{tmp}/{_name('scheduler', ('', r, num_replicas))}.sock" for r in range(num_replicas)
    ]
    common = ["--log-format", args.log_format, "--log-level", args.log_level]
    metrics_ports = _metrics_ports(
        args.metrics_port,
        args.num_routers + num_replicas + num_workers,
        exclude=router_ports + http_ports,
    )
    children: list[Child] = []
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        for r, scheduler_addr in enumerate(scheduler_addrs):
            sched_argv = [
                "--listen", scheduler_addr,
                "--max-num-seqs", str(args.max_num_seqs),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--enable-chunked-prefill" if args.enable_chunked_prefill else "--no-enable-chunked-prefill",
                "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
                "--long-prefill-token-threshold", str(args.long_prefill_token_threshold),
                "--max-num-partial-prefills", str(args.max_num_partial_prefills),
                "--max-long-partial-prefills", str(args.max_long_partial_prefills),
                "--scheduling-policy", args.scheduling_policy,
                "--static-batch-size", str(args.static_batch_size),
                "--max-waiting-requests", str(args.max_waiting_requests),
                "--tensor-parallel-size", str(tp),
                "--num-prefill-workers", str(args.num_prefill_workers),
                "--num-decode-workers", str(args.num_decode_workers),
                *_flag("max-model-len", args.max_model_len),
                "--metrics-port", str(metrics_ports[args.num_routers + r]), "--metrics-host", args.host,
                *common,
            ]  # fmt: skip
            name = _name("scheduler", ("", r, num_replicas))
            children.append(Child.start(name, "scheduler", scheduler_addr, sched_argv, r, -1))
        role_index = {"both": 0, "prefill": 0, "decode": 0}
        instances = []
        for g, role in enumerate(roles):
            instances.append((g, role, role_index[role]))
            role_index[role] += 1
        w = 0
        for r, scheduler_addr in enumerate(scheduler_addrs):
            for g, role, i in instances:
                init_method = None
                if tp > 1:  # not a port another child of this stack was given
                    (rendezvous,) = free_ports(
                        1, exclude=[*router_ports, *http_ports, *metrics_ports]
                    )
                    init_method = f"tcp://127.0.0.1:{rendezvous}"
                for rank in range(tp):
                    name = _name(
                        "worker",
                        ("r", r, num_replicas),
                        (role if role != "both" else "g", i, 2 if role != "both" else 1),
                        ("rank", rank, tp),
                    )
                    worker_addr = f"unix:{tmp}/{name}.sock"
                    port = metrics_ports[args.num_routers + num_replicas + w]
                    w += 1
                    worker_argv = [
                        "--listen", worker_addr,
                        "--scheduler", scheduler_addr,
                        "--worker-group", str(g),
                        "--tensor-parallel-size", str(tp),
                        "--rank", str(rank),
                        *_flag("distributed-init-method", init_method),
                        *(["--share-kv-pool"] if role != "both" else []),
                        "--model", str(model_dir),
                        "--served-model-name", model_id,
                        "--device", args.device,
                        "--dtype", args.dtype,
                        "--block-size", str(args.block_size),
                        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                        "--attention-backend", args.attention_backend,
                        *(["--enforce-eager"] if args.enforce_eager else []),
                        *_flag("kv-cache-memory", args.kv_cache_memory),
                        *_flag("max-model-len", args.max_model_len),
                        *_flag("num-threads", args.num_threads),
                        "--metrics-port", str(port), "--metrics-host", args.host,
                        *common,
                    ]  # fmt: skip
                    children.append(Child.start(name, "worker", worker_addr, worker_argv, r, g))
        for k, port in enumerate(router_ports):
            router_addr = f"{args.host}:{port}"
            router_argv = [
                "--host", args.host,
                "--port", str(port),
                "--scheduler", ",".join(scheduler_addrs),
                "--model", str(model_dir),
                "--metrics-port", str(metrics_ports[k]), "--metrics-host", args.host,
                "--drain-timeout", str(args.drain_timeout),
                "--cache-threshold", str(args.cache_threshold),
                "--balance-abs-threshold", str(args.balance_abs_threshold),
                "--max-message-size", str(args.max_message_size),
                "--http-port", str(http_ports[k] if http_ports else -1), "--http-host", http_host,
                *common,
            ]  # fmt: skip
            name = _name("router", ("", k, args.num_routers))
            children.append(Child.start(name, "router", router_addr, router_argv, -1, -1))

        for child in children:
            _wait_healthy(child, children, lambda: stopping)
        pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
        addrs = ", ".join(c.address for c in children if c.command == "router")
        print(
            f"sluiceway: serving {model_id} on {addrs} ({pids}); "
            f"ready in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        if http_ports:
            urls = ", ".join(f"http://{http_host}:{port}/v1" for port in http_ports)
            print(f"sluiceway: OpenAI-compatible API: {urls}", flush=True)
        if args.metrics_port >= 0:
            urls = ", ".join(
                f"{c.name} http://{args.host}:{port}/metrics"
                for c, port in zip(_metrics_order(children), metrics_ports, strict=True)
            )
            print(f"sluiceway: metrics: {urls}", flush=True)
        while not stopping:
            done = next(
                (c for c in children if not c.left_down and c.process.poll() in (0, 2)), None
            )
            if done is not None and done.process.returncode == 0:  # stopped on purpose
                others = [
                    c
                    for c in children
                    if c.command == "router" and c is not done and not c.left_down
                ]  # running, or failed and about to be restarted
                if done.command != "router" or not others:
                    print(f"sluiceway: {done.name} exited with 0; stopping", flush=True)
                    return 0
                done.left_down = True  # a router drained on its own SIGTERM
                print(
                    f"sluiceway: {done.name} exited with 0 (drained); leaving it down, "
                    f"{len(others)} other router(s) serving",
                    flush=True,
                )
                continue
            if done is not None:  # 2: a usage or configuration error; restarting cannot help
                print(f"sluiceway: {done.name} exited with 2; stopping", file=sys.stderr)
                return 1
            _restart_exited(children)
            time.sleep(0.2)
        return 0
    except StartupConfigError as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, RuntimeError) as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children, router_timeout_s=args.drain_timeout + STOP_TIMEOUT_S)
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_run_dirs(directory: str | None = None) -> list[str]:
    """Deletes the socket folders (`sluiceway-<pid>-*` in the temp dir) of `serve` runs whose
    process is gone (killed before it could clean up); returns the paths removed."""
    removed = []
    for path in dead_owner_paths(pathlib.Path(directory or tempfile.gettempdir()), RUN_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _metrics_order(children: list[Child]) -> list[Child]:
    """The children in the order of their metrics ports: routers, schedulers, workers."""
    rank = {"router": 0, "scheduler": 1, "worker": 2}
    return sorted(children, key=lambda c: rank[c.command])


def _restart_exited(children: list[Child]) -> None:
    """Starts again each child that failed (crashed or killed by a signal) once its backoff
    has passed (`Child.restart_due`), with what depends on it: a restarted scheduler has lost
    its workers' registration, so its replica's workers restart with it; the other ranks of a
    failed tensor-parallel rank's instance are stuck in (or broken by) a collective, so the
    whole instance restarts, on a fresh rendezvous port. A child that failed MAX_RESTARTS
    times within RESTART_WINDOW_S is given up on (`_give_up`).

    Raises RuntimeError: a crash-looping child whose loss leaves no replica or no router.
    """
    now = time.monotonic()
    for child in children:
        if child.left_down or child.process.poll() is None:
            continue
        if child.recent_restarts(now) >= MAX_RESTARTS:
            _give_up(child, children)
            continue
        if not child.restart_due(now):
            continue
        print(
            f"sluiceway: {child.name} exited with {child.process.returncode}; restarting it",
            file=sys.stderr,
            flush=True,
        )
        together = [child]
        for other in children:
            if other is child or other.command != "worker" or other.replica != child.replica:
                continue
            if child.command == "scheduler" or (
                child.command == "worker" and other.instance == child.instance
            ):
                together.append(other)
        _restart_together(together)


def _give_up(child: Child, children: list[Child]) -> None:
    """Stops and leaves down crash-looping `child` with its replica (its scheduler and
    workers; a router alone), printing which, when another replica (router) still runs.

    Raises RuntimeError: none would be left.
    """
    why = f"{child.name} failed {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f} s"
    if child.command == "router":
        unit, what = [child], child.name
        others = [c for c in children if c.command == "router" and c is not child]
    else:
        unit = [c for c in children if c.command != "router" and c.replica == child.replica]
        what = f"replica {child.replica} ({', '.join(c.name for c in unit)})"
        others = [c for c in children if c.command == "scheduler" and c.replica != child.replica]
    if not [c for c in others if not c.left_down]:
        raise RuntimeError(f"{why}; giving up")
    for c in unit:
        c.left_down = True
        if c.process.poll() is None:
            c.process.terminate()
    for c in unit:
        _wait(c, STOP_TIMEOUT_S)
    print(f"sluiceway: {why}; giving up on {what}, the others keep serving",
          file=sys.stderr, flush=True)  # fmt: skip


def _restart_together(group: list[Child]) -> None:
    """Stops every child of `group` that still runs, then starts them all; each tensor-parallel
    instance among them gets a new `--distributed-init-method` port, so that no new rank meets
    an old rank's rendezvous."""
    for child in group:
        if child.process.poll() is None:
            child.process.terminate()
    for child in group:
        _wait(child, STOP_TIMEOUT_S)
    new_ports: dict[tuple[int, int], int] = {}
    for child in group:
        if "--distributed-init-method" in child.argv:
            i = child.argv.index("--distributed-init-method") + 1
            port = new_ports.setdefault((child.replica, child.instance), free_port())
            child.argv[i] = f"tcp://127.0.0.1:{port}"
        child.restart()


class StartupConfigError(RuntimeError):
    """A child exited 2 (a configuration error, its own line on stderr) while starting."""


def _wait_healthy(child: Child, children: list[Child], stopping) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        for c in children:
            if c.process.poll() == 2:
                raise StartupConfigError(
                    f"{c.name} refused its configuration (exit 2, its reason above); stopping"
                )
            if c.process.poll() is not None:
                raise RuntimeError(f"{c.name} exited with {c.process.returncode} during start-up")
        if stopping():
            raise RuntimeError("interrupted during start-up")
        try:
            wait_until_serving(child.address, timeout_s=1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s"
                ) from None


def _taken_port(host: str, port: int) -> str:
    """Why `host:port` cannot be listened on ("" when it can): checked before the children
    start, so that another server answering health checks there is never taken for ours."""
    if port == 0:
        return ""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # as gRPC does: a port left in TIME_WAIT by a server just stopped is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return ""


def _metrics_ports(first: int, count: int, exclude: list[int]) -> list[int]:
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


def _stop_all(children: list[Child], router_timeout_s: float) -> None:
    """SIGTERM the routers first and let them drain (up to `router_timeout_s`), then the rest;
    SIGKILL whatever is left after the timeout."""
    routers = [c for c in children if c.command == "router"]
    for group, timeout_s in ((routers, router_timeout_s), (children, STOP_TIMEOUT_S)):
        for child in group:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        for child in group:
            _wait(child, timeout_s)


def _wait(child: Child, timeout_s: float) -> None:
    try:
        child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()
