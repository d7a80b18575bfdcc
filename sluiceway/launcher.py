"""`sluiceway serve`: worker, scheduler and router as three OS processes on one machine.

The children talk over Unix sockets in a private temp folder; only the router
listens on TCP. Children get SIGTERM if this process dies (PR_SET_PDEATHSIG),
so nothing is orphaned; on SIGINT/SIGTERM the router drains and stops first,
then the scheduler and the worker. A child that fails is started again (a
restarted scheduler takes the worker with it, which must register anew), at
most MAX_RESTARTS times a minute; one that exits 0 (a router drained by
SIGTERM) stops the stack, and so does one that exits 2 (a usage or
configuration error, such as a taken port).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from sluiceway.client import wait_until_serving

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    with contextlib.suppress(OSError):  # not Linux: rely on the signal handlers
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# A child that exits is started again, at most this many times per window.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


@dataclass(slots=True)
class Child:
    name: str
    address: str
    argv: list[str]
    process: subprocess.Popen[bytes]
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart

    @classmethod
    def start(cls, name: str, address: str, argv: list[str]) -> Child:
        return cls(name, address, argv, _spawn(name, argv))

    def restart(self) -> None:
        """Stops the process if it still runs, starts it again with the same flags.

        Raises RuntimeError after MAX_RESTARTS restarts within RESTART_WINDOW_S seconds.
        """
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= MAX_RESTARTS:
            raise RuntimeError(
                f"{self.name} restarted {MAX_RESTARTS} times in {RESTART_WINDOW_S:.0f} s; giving up"
            )
        self.restarts.append(now)
        if self.process.poll() is None:
            self.process.terminate()
            _wait(self, STOP_TIMEOUT_S)
        self.process = _spawn(self.name, self.argv)
        print(f"sluiceway: {self.name} restarted (pid {self.process.pid})", flush=True)


def _spawn(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return subprocess.Popen(
        [sys.executable, "-m", "sluiceway.cli", name, *argv],
        env=env,
        start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        preexec_fn=_die_with_parent,
    )


def _flag(name: str, value: object) -> list[str]:
    return [] if value is None else [f"--{name}", str(value)]


def serve_command(args: argparse.Namespace) -> int:
    """Starts the stack, waits until each process is SERVING, prints the address, waits for a signal."""
    from sluiceway.model_files import resolve_model

    t0 = time.monotonic()
    model_dir = resolve_model(args.model)  # convert a GGUF once, before the children race for it
    model_id = args.served_model_name or args.model or "SmolLM2-135M-Instruct"
    taken = _taken_port(args.host, args.port)
    if taken:
        print(f"sluiceway: cannot listen on {args.host}:{args.port}: {taken}", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="sluiceway-")
    scheduler_addr = f"unix:{tmp}/scheduler.sock"
    worker_addr = f"unix:{tmp}/worker.sock"
    router_addr = f"{args.host}:{args.port}"
    common = ["--log-format", args.log_format, "--log-level", args.log_level]
    metrics_ports = _metrics_ports(args.metrics_port)
    children: list[Child] = []
    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        sched_argv = [
            "--listen", scheduler_addr,
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--enable-chunked-prefill" if args.enable_chunked_prefill else "--no-enable-chunked-prefill",
            "--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching",
            "--scheduling-policy", args.scheduling_policy,
            "--static-batch-size", str(args.static_batch_size),
            "--max-waiting-requests", str(args.max_waiting_requests),
            *_flag("max-model-len", args.max_model_len),
            "--metrics-port", str(metrics_ports["scheduler"]), "--metrics-host", args.host,
            *common,
        ]  # fmt: skip
        children.append(Child.start("scheduler", scheduler_addr, sched_argv))
        worker_argv = [
            "--listen", worker_addr,
            "--scheduler", scheduler_addr,
            "--model", str(model_dir),
            "--served-model-name", model_id,
            "--device", args.device,
            "--dtype", args.dtype,
            "--block-size", str(args.block_size),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *_flag("kv-cache-memory", args.kv_cache_memory),
            *_flag("max-model-len", args.max_model_len),
            *_flag("num-threads", args.num_threads),
            "--metrics-port", str(metrics_ports["worker"]), "--metrics-host", args.host,
            *common,
        ]  # fmt: skip
        children.append(Child.start("worker", worker_addr, worker_argv))
        router_argv = [
            "--host", args.host,
            "--port", str(args.port),
            "--scheduler", scheduler_addr,
            "--model", str(model_dir),
            "--metrics-port", str(metrics_ports["router"]), "--metrics-host", args.host,
            "--drain-timeout", str(args.drain_timeout),
            "--max-message-size", str(args.max_message_size),
            *common,
        ]  # fmt: skip
        children.append(Child.start("router", router_addr, router_argv))

        for child in children:
            _wait_healthy(child, children, lambda: stopping)
        pids = ", ".join(f"{c.name} pid {c.process.pid}" for c in children)
        print(
            f"sluiceway: serving {model_id} on {router_addr} ({pids}); "
            f"ready in {time.monotonic() - t0:.1f} s",
            flush=True,
        )
        if args.metrics_port >= 0:
            urls = ", ".join(
                f"{name} http://{args.host}:{port}/metrics" for name, port in metrics_ports.items()
            )
            print(f"sluiceway: metrics: {urls}", flush=True)
        while not stopping:
            done = next((c for c in children if c.process.poll() in (0, 2)), None)
            if done is not None and done.process.returncode == 0:
                # stopped on purpose (e.g. a router drained on SIGTERM)
                print(f"sluiceway: {done.name} exited with 0; stopping", flush=True)
                return 0
            if done is not None:  # 2: a usage or configuration error; restarting cannot help
                print(f"sluiceway: {done.name} exited with 2; stopping", file=sys.stderr)
                return 1
            _restart_exited(children)
            time.sleep(0.2)
        return 0
    except (TimeoutError, RuntimeError) as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 1
    finally:
        _stop_all(children, router_timeout_s=args.drain_timeout + STOP_TIMEOUT_S)
        shutil.rmtree(tmp, ignore_errors=True)


def _restart_exited(children: list[Child]) -> None:
    """Starts again each child that failed (crashed or killed by a signal); a
    restarted scheduler has lost its workers' registration, so the worker restarts with it.
    Raises RuntimeError (see `Child.restart`)."""
    by_name = {c.name: c for c in children}
    for child in children:
        if child.process.poll() is None:
            continue
        print(
            f"sluiceway: {child.name} exited with {child.process.returncode}; restarting it",
            file=sys.stderr,
            flush=True,
        )
        child.restart()
        if child.name == "scheduler":
            by_name["worker"].restart()


def _wait_healthy(child: Child, children: list[Child], stopping) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        for c in children:
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


def _metrics_ports(first: int) -> dict[str, int]:
    """Metrics port of each process: `first`, `first + 1`, `first + 2`; free ports for 0;
    -1 (off) for every process when `first` is negative."""
    names = ("router", "scheduler", "worker")
    if first < 0:
        return dict.fromkeys(names, -1)
    if first > 0:
        return {name: first + i for i, name in enumerate(names)}
    return {name: free_port() for name in names}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS's pick; another process may take it
    before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _stop_all(children: list[Child], router_timeout_s: float) -> None:
    """SIGTERM the router first and let it drain (up to `router_timeout_s`), then the rest;
    SIGKILL whatever is left after the timeout."""
    order = sorted(children, key=lambda c: c.name != "router")
    for child in order:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
        if child.name == "router":
            _wait(child, router_timeout_s)
    for child in order:
        _wait(child, STOP_TIMEOUT_S)


def _wait(child: Child, timeout_s: float) -> None:
    try:
        child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.process.kill()
        child.process.wait()
