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
the schedulers and workers; a second signal stops them at once, each stream cut with a status
(sluiceway/serve_stop.py). A child that fails is
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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

from sluiceway.client import wait_until_serving
from sluiceway.layout import metrics_order, stack_layout
from sluiceway.pids import dead_owner_paths, process_age_s
from sluiceway.ports import Ports, free_port, free_ports, plan_ports
from sluiceway.router.config import RouterConfig
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.security import api_keys, check_files
from sluiceway.serve_config import ServeConfig
from sluiceway.serve_stop import STOP_TIMEOUT_S, StopSignals, stop_stack
from sluiceway.speculative import SpeculativeConfig
from sluiceway.worker.compute_thread import openmp_defaults
from sluiceway.worker.config import WorkerConfig

STARTUP_TIMEOUT_S = 600.0
RUN_DIR_PREFIX = "sluiceway-"  # + pid + "-": the children's Unix sockets
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


ChildConfig = RouterConfig | SchedulerConfig | WorkerConfig
COMMANDS: dict[type[ChildConfig], str] = {
    RouterConfig: "router",
    SchedulerConfig: "scheduler",
    WorkerConfig: "worker",
}


@dataclass(slots=True)
class Child:
    """One process of the stack: `sluiceway <command> <config.to_argv()>`, healthy when
    `probe` (a router's Unix socket), else `address`, answers SERVING. `replica` and `instance` (its model instance within the
    replica; -1 for a scheduler, both -1 for a router) say what a failure takes down.
    `start` sets `process`."""

    name: str
    address: str
    config: ChildConfig
    replica: int = -1
    instance: int = -1
    probe: str | None = None  # where its health is asked, when not `address` (a router's)
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart
    left_down: bool = False  # exited on purpose, or given up on; not restarted
    exited_at: float | None = None  # time.monotonic() when its exit was seen
    process: subprocess.Popen[bytes] = field(init=False)

    @property
    def command(self) -> str:
        """The `sluiceway` subcommand: router, scheduler or worker."""
        return COMMANDS[type(self.config)]

    def start(self) -> None:
        """Starts the process with the flags of `config`."""
        self.process = _spawn(self.command, self.config.to_argv())

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
        """Stops the process if it still runs, starts it again with the flags of `config`."""
        self.restarts.append(time.monotonic())
        self.exited_at = None
        if self.process.poll() is None:
            self.process.terminate()
            _wait(self, STOP_TIMEOUT_S)
        self.start()
        print(f"sluiceway: {self.name} restarted (pid {self.process.pid})", flush=True)


def _spawn(command: str, argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    openmp_defaults(env)
    return subprocess.Popen(
        [sys.executable, "-m", "sluiceway.cli", command, *argv],
        env=env,
        start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        preexec_fn=functools.partial(_die_with_parent, os.getpid()),
    )


def serve_command(args: argparse.Namespace) -> int:
    """Starts the stack, waits until each process is SERVING, prints the address, waits for a
    signal. Returns 0 once stopped; 2 with one line on stderr for a configuration error found
    before the start or by a child that exits 2 while starting; 1 for another failure."""
    from sluiceway.logs import configure_logging, resolve_log_format

    t0 = time.monotonic() - process_age_s()  # "ready in" counts from the command's start
    # decided once, from serve's stderr, and given to every child as --log-format json or
    # console: one format for the whole stack, whatever a child's stderr is
    args.log_format = resolve_log_format(args.log_format)
    configure_logging("serve", args.log_format, args.log_level)
    try:  # what the children would refuse, after importing torch and loading the model
        config = ServeConfig.from_namespace(args)
        ports = plan_ports(config)  # first: a taken port is found at once, not after a conversion
        check_files(config.router)  # the key file and the TLS files the routers will read
        model_dir, model_id = _resolve_model(config)
    except ValueError as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    return _run_stack(config, ports, model_dir, model_id, t0)


def _resolve_model(config: ServeConfig) -> tuple[pathlib.Path, str]:
    """The model folder (a GGUF converted once, before the children) and the name clients see.

    Raises:
        ValueError: `--device cuda` without a GPU, a model path that is not one, an
            architecture the worker does not implement, a `--max-model-len` above the
            model's context (`sluiceway.preflight`), a `--chat-template` that cannot be read
            or parsed, a draft model (`--speculative-config`) that is none of those.
    """
    from sluiceway.model_files import resolve_model, served_model_name
    from sluiceway.preflight import check_architecture, check_device, check_max_model_len
    from sluiceway.router.tokenizer import load_chat_template

    check_device(config.worker.device)
    if config.router.chat_template is not None:  # read by each router again
        load_chat_template(config.router.chat_template)
    model_dir = resolve_model(config.worker.model)
    check_architecture(model_dir)
    check_max_model_len(model_dir, config.worker.max_model_len)
    _check_draft_model(config.scheduler.speculative, model_dir)
    return model_dir, served_model_name(model_dir, config.worker.served_model_name)


def _check_draft_model(spec: SpeculativeConfig | None, model_dir: pathlib.Path) -> None:
    """A ``draft_model`` config's model resolved (a GGUF converted once, before the workers),
    its architecture checked as the model's, and its vocabulary the model's (`model_dir`).

    Raises:
        ValueError: the message prefixed ``speculative_config.model: ``.
    """
    from sluiceway.model_files import resolve_model
    from sluiceway.preflight import check_architecture, check_draft_vocabulary

    if spec is None or spec.draft_model_path is None:
        return
    try:
        draft_dir = resolve_model(spec.draft_model_path)
        check_architecture(draft_dir)
        check_draft_vocabulary(model_dir, draft_dir)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None


def build_children(
    config: ServeConfig, ports: Ports, run_dir: str, model_dir: pathlib.Path, model_id: str
) -> list[Child]:
    """The children of the stack, not started, in start order (`stack_layout`: the
    schedulers, their workers, the routers). Each child's config is serve's
    (`ServeConfig.router`, ...) with the child's own addresses and ports (Unix sockets in
    `run_dir`; the routers on TCP, each probed on a Unix socket of its own there) and the
    resolved model; the ranks of a tensor-parallel instance share a rendezvous port picked
    here."""
    slots = stack_layout(config)
    metrics = {s.name: port for s, port in zip(metrics_order(slots), ports.metrics, strict=True)}
    schedulers = [f"unix:{run_dir}/{s.name}.sock" for s in slots if s.command == "scheduler"]
    router_ports = iter(zip(ports.routers, ports.http or [-1] * len(ports.routers), strict=True))
    rendezvous: dict[tuple[int, int], str] = {}
    children: list[Child] = []
    for slot in slots:
        address = f"unix:{run_dir}/{slot.name}.sock"
        mport, mhost = metrics[slot.name], config.host
        child_config: ChildConfig
        if slot.command == "scheduler":
            child_config = replace(
                config.scheduler, listen=address, metrics_port=mport, metrics_host=mhost
            )
        elif slot.command == "router":
            port, http_port = next(router_ports)
            # probed on a Unix socket of its own, without TLS: the public port may ask for a
            # client certificate, or have one serve cannot verify
            probe, address = address, f"{config.host}:{port}"
            child_config = replace(
                config.router, host=config.host, port=port, scheduler=",".join(schedulers),
                model=str(model_dir), http_port=http_port, metrics_port=mport, metrics_host=mhost,
                internal_listen=probe,
            )  # fmt: skip
            children.append(Child(slot.name, address, child_config, probe=probe))
            continue
        else:
            init_method = None
            if config.scheduler.tensor_parallel_size > 1:  # not a port of another child
                key = (slot.replica, slot.instance)
                if key not in rendezvous:
                    (free,) = free_ports(1, exclude=ports.all())
                    rendezvous[key] = f"tcp://127.0.0.1:{free}"
                init_method = rendezvous[key]
            child_config = replace(
                config.worker, listen=address, scheduler=schedulers[slot.replica],
                worker_group=slot.instance, rank=slot.rank,
                distributed_init_method=init_method, share_kv_pool=slot.role != "both",
                model=str(model_dir), served_model_name=model_id, metrics_port=mport,
                metrics_host=mhost,
            )  # fmt: skip
        children.append(Child(slot.name, address, child_config, slot.replica, slot.instance))
    return children


def _run_stack(
    config: ServeConfig, ports: Ports, model_dir: pathlib.Path, model_id: str, t0: float
) -> int:
    """Starts the children, waits until each is healthy, prints the addresses, supervises
    them until a signal or a failure; stops them all on the way out. Returns serve's exit
    status (`serve_command`)."""
    remove_stale_run_dirs()
    run_dir = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-")
    stop = StopSignals()
    children: list[Child] = []  # those started
    served = False
    try:
        for child in build_children(config, ports, run_dir, model_dir, model_id):
            child.start()
            children.append(child)
        for child in children:
            _wait_healthy(child, children, lambda: stop.requested)
        _print_ready(config, children, ports, model_id, t0)
        served = True
        return _supervise(children, stop)
    except StartupConfigError as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    except StartupInterrupted as e:  # as a Ctrl-C before any child started: 128 + SIGINT
        print(f"sluiceway: {e}", file=sys.stderr)
        return 130
    except (TimeoutError, RuntimeError) as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 1
    finally:
        routers = [c.process for c in children if c.command == "router"]
        others = [c.process for c in children if c.command != "router"]
        schedulers = [c.address for c in children if c.command == "scheduler"]
        stop_stack(
            routers, others, config.router.drain_timeout, stop, schedulers if served else None
        )
        shutil.rmtree(run_dir, ignore_errors=True)


def _print_ready(
    config: ServeConfig, children: list[Child], ports: Ports, model_id: str, t0: float
) -> None:
    """Prints what serves where: the routers, the OpenAI-compatible API, the metrics."""
    pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
    addrs = ", ".join(c.address for c in children if c.command == "router")
    print(
        f"sluiceway: serving {model_id} on {addrs} ({pids}); "
        f"ready in {time.monotonic() - t0:.1f} s",
        flush=True,
    )
    if ports.http:
        http_host = config.router.http_host or config.host
        scheme = "https" if config.router.tls else "http"
        urls = ", ".join(f"{scheme}://{http_host}:{port}/v1" for port in ports.http)
        print(f"sluiceway: OpenAI-compatible API: {urls}", flush=True)
    print(f"sluiceway: {_security_line(config)}", flush=True)
    if config.metrics_port >= 0:
        urls = ", ".join(
            f"{c.name} http://{config.host}:{port}/metrics"
            for c, port in zip(metrics_order(children), ports.metrics, strict=True)
        )
        print(f"sluiceway: metrics: {urls}", flush=True)


def _security_line(config: ServeConfig) -> str:
    """What protects the public ports, and where the internal ones are (docs/security.md)."""
    router = config.router
    tls = "plaintext (no TLS)"
    if router.tls:
        tls = "TLS" + (", client certificates required" if router.client_cert_required else "")
    keys = "API key required (health, /version and /metrics open)"
    if not api_keys(router):
        keys = "no API key"
    return (
        f"public ports (gRPC, HTTP): {tls}, {keys}; "
        "schedulers and workers: Unix sockets of this machine, no TLS"
    )


def _supervise(children: list[Child], stop: StopSignals) -> int:
    """Restarts failed children (`_restart_exited`) until a signal (returns 0), a child that
    exits 0 on purpose (0; a drained router is left down while another router serves) or
    exits 2 (1: a configuration error that a restart cannot mend)."""
    while not stop.requested:
        done = next((c for c in children if not c.left_down and c.process.poll() in (0, 2)), None)
        if done is not None and done.process.returncode == 0:  # stopped on purpose
            others = [
                c for c in children if c.command == "router" and c is not done and not c.left_down
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


def remove_stale_run_dirs(directory: str | None = None) -> list[str]:
    """Deletes the socket folders (`sluiceway-<pid>-*` in the temp dir) of `serve` runs whose
    process is gone (killed before it could clean up); returns the paths removed."""
    removed = []
    for path in dead_owner_paths(pathlib.Path(directory or tempfile.gettempdir()), RUN_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


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
        if isinstance(child.config, WorkerConfig) and child.config.distributed_init_method:
            port = new_ports.setdefault((child.replica, child.instance), free_port())
            child.config = replace(child.config, distributed_init_method=f"tcp://127.0.0.1:{port}")
        child.restart()


class StartupInterrupted(RuntimeError):
    """A signal came while the children were starting: the stack stops, exit 130."""


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
            raise StartupInterrupted("interrupted during start-up")
        try:
            wait_until_serving(child.probe or child.address, timeout_s=1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s"
                ) from None


def _wait(child: Child, timeout_s: float) -> None:
    try:
        child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()
