"""`sluiceway serve`'s flags: the ports it picks for `--port 0` and `--metrics-port 0` are
distinct (two separate OS picks can return the same port once the first socket is closed);
out-of-range sizes are usage errors; each child's config is serve's forwarded flags plus its
own addresses and ports, and its command line gives that config back; a taken port is one
line naming its flag, exit 2, before any child starts (and before `make serve`'s install)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from sluiceway.ports import free_ports, metrics_ports

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_free_ports_are_distinct_and_skip_the_excluded() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        routers = free_ports(3)
        metrics = metrics_ports(0, 40, exclude=routers)
    assert len(set(routers)) == 3 and held not in routers
    assert len(set(metrics)) == 40 and not set(metrics) & set(routers)
    assert metrics_ports(9400, 3, exclude=routers) == [9400, 9401, 9402]
    assert metrics_ports(-1, 2, exclude=[]) == [-1, -1]


def test_block_size_below_1_is_a_usage_error() -> None:
    import contextlib
    import io

    from sluiceway.cli import build_parser

    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit_, contextlib.redirect_stderr(io.StringIO()) as err:
            build_parser().parse_args(["serve", "--block-size", value])
        assert exit_.value.code == 2
        assert f"argument --block-size: must be >= 1, got {value}" in err.getvalue()


# Child config fields serve sets per child (addresses, ports, ranks, the resolved model); every
# other field is one serve forwards (sluiceway/serve_config.py FLAGS) or left at its default.
SET_PER_CHILD = {
    "router": {"host", "port", "scheduler", "model", "metrics_port", "metrics_host", "http_port",
               "internal_listen"},
    "scheduler": {"listen", "metrics_port", "metrics_host"},
    "worker": {"listen", "scheduler", "worker_group", "rank", "distributed_init_method",
               "share_kv_pool", "model", "served_model_name", "metrics_port", "metrics_host"},
}  # fmt: skip
LEFT_AT_DEFAULT = {"worker": {"advertise"}}  # the bound Unix socket is what the scheduler dials


def test_every_child_flag_is_forwarded_or_set_by_the_launcher() -> None:
    from sluiceway.serve_config import PARTS, forwarded_to

    for part, cls in PARTS.items():
        forwarded = set(forwarded_to(part)) - SET_PER_CHILD[part]
        left = LEFT_AT_DEFAULT.get(part, set())
        assert forwarded | SET_PER_CHILD[part] | left == set(cls.options()), part
        assert not left & (forwarded | SET_PER_CHILD[part]), part


def test_the_children_get_serves_flags_and_their_own_addresses() -> None:
    from dataclasses import replace

    from sluiceway.cli import build_parser
    from sluiceway.launcher import build_children
    from sluiceway.ports import Ports
    from sluiceway.serve_config import ServeConfig, forwarded_to

    args = build_parser().parse_args(
        ["serve", "--host", "0.0.0.0", "--num-replicas", "2", "--num-routers", "2", "-tp", "2",
         "--num-prefill-workers", "1", "--num-decode-workers", "1", "--max-num-seqs", "8",
         "--drain-timeout", "3", "--dtype", "float32", "--log-format", "console",
         "--served-model-name", "ignored-by-the-router", "--no-enable-prefix-caching"]
    )  # fmt: skip
    config = ServeConfig.from_namespace(args)
    ports = Ports(routers=[7000, 7001], http=[8000, 8001], metrics=list(range(9400, 9412)))
    children = build_children(config, ports, "/run", pathlib.Path("/models/m"), "m")
    assert [c.name for c in children] == [
        "scheduler-0", "scheduler-1",
        *(f"worker-r{r}-{role}0-rank{k}" for r in (0, 1) for role in ("prefill", "decode")
          for k in (0, 1)),
        "router-0", "router-1",
    ]  # fmt: skip
    for child in children:
        # the child's command line gives its config back
        argv = [child.command, *child.config.to_argv()]
        assert type(child.config).from_namespace(build_parser().parse_args(argv)) == child.config
        # the flags serve forwards, as given to serve
        serve_part = getattr(config, child.command)
        own = SET_PER_CHILD[child.command]
        expected = replace(serve_part, **{n: getattr(child.config, n) for n in own})
        assert child.config == expected, child.name
        assert all(getattr(child.config, n) == getattr(serve_part, n)
                   for n in forwarded_to(child.command) if n not in own)  # fmt: skip
    by_name = {c.name: c.config for c in children}
    assert by_name["scheduler-1"].listen == "unix:/run/scheduler-1.sock"
    assert (by_name["scheduler-1"].metrics_port, by_name["router-1"].metrics_port) == (9403, 9401)
    assert by_name["router-1"].scheduler == "unix:/run/scheduler-0.sock,unix:/run/scheduler-1.sock"
    assert (by_name["router-1"].port, by_name["router-1"].http_port) == (7001, 8001)
    # probed on its own Unix socket (no TLS there), its public address printed
    router = children[-1]
    assert (router.address, router.probe) == ("0.0.0.0:7001", "unix:/run/router-1.sock")
    assert by_name["router-1"].internal_listen == "unix:/run/router-1.sock"
    assert by_name["router-1"].drain_timeout == 3.0
    worker = by_name["worker-r1-decode0-rank1"]
    assert (worker.scheduler, worker.worker_group, worker.rank) == (
        "unix:/run/scheduler-1.sock",
        1,
        1,
    )
    assert (worker.model, worker.served_model_name, worker.share_kv_pool) == (
        "/models/m",
        "m",
        True,
    )
    assert (worker.dtype, worker.metrics_port, worker.log_format) == ("float32", 9411, "console")
    # the ranks of one instance share a rendezvous; instances do not
    inits = {n: c.distributed_init_method for n, c in by_name.items() if n.startswith("worker")}
    assert inits["worker-r1-decode0-rank0"] == inits["worker-r1-decode0-rank1"]
    assert len(set(inits.values())) == 4


def _children_of(pid: int) -> set[int]:
    """The pids whose parent is `pid` now (from /proc)."""
    found = set()
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


# (serve's port flags with the taken port at P, or at P-1 for the flag's first port, the line)
TAKEN = [
    (["--port", "0", "--http-port", "-1", "--metrics-port", "{P-1}"],
     "sluiceway: --metrics-port {P-1}: port {P} (scheduler's metrics) is taken "
     "(Address already in use)"),
    (["--port", "0", "--http-port", "{P}", "--metrics-port", "-1"],
     "sluiceway: --http-port {P} is taken (Address already in use)"),
    (["--port", "{P}", "--http-port", "-1", "--metrics-port", "-1"],
     "sluiceway: --port {P} is taken (Address already in use)"),
]  # fmt: skip


def _fill(text: str, port: int) -> str:
    return text.replace("{P-1}", str(port - 1)).replace("{P}", str(port))


@pytest.mark.parametrize(("flags", "line"), TAKEN, ids=["metrics", "http", "grpc"])
def test_a_taken_port_is_one_line_naming_its_flag_before_any_child_starts(
    flags: list[str], line: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        serve = subprocess.Popen(
            [sys.executable, "-m", "sluiceway.cli", "serve", *(_fill(f, port) for f in flags)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        children: set[int] = set()
        while serve.poll() is None and time.monotonic() - t0 < 5:
            children |= _children_of(serve.pid)
            time.sleep(0.01)
        out, err = serve.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    assert (serve.returncode, out, err) == (2, "", _fill(line, port) + "\n")
    assert elapsed < 5
    assert children == set()  # no worker, scheduler or router was started


def test_make_serve_finds_a_taken_port_before_the_install_with_the_standard_library(
    tmp_path: pathlib.Path,
) -> None:
    """`make serve` runs sluiceway/serve_check.py with `python3 -S` before it builds the venv:
    without site-packages, the same parser and checks give serve's line (a taken port, a bad
    flag, a model path or a draft model's path that is not a model)."""
    free = ["--port", "0", "--http-port", "0", "--metrics-port", "0"]
    draft = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 3}'
    missing = tmp_path / "missing.gguf"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argvs = [
            [_fill(f, port) for f in TAKEN[0][0]],
            ["--port", str(port - 1), "--num-routers", "2", "--http-port", "-1"],
            ["--max-num-seqs", "0"],
            free,
            ["--help"],
            [*free, "--model", str(missing)],
            [*free, "--model", str(tmp_path)],
            [*free, "--speculative-config", draft % missing],
            [*free, "--model", "gemma3-270m", "--speculative-config", draft % "gemma3-270m"],
        ]
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
        results = [
            subprocess.run(
                [sys.executable, "-S", "-m", "sluiceway.serve_check", *argv],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=ROOT,
                env=env,
            )
            for argv in argvs
        ]
    assert [(r.returncode, r.stdout, r.stderr) for r in results] == [
        (2, "", _fill(TAKEN[0][1], port) + "\n"),
        (2, "", f"sluiceway: --port {port - 1}: port {port} (router-1's gRPC) is taken "
                "(Address already in use)\n"),
        (2, "", "sluiceway serve: error: argument --max-num-seqs: must be >= 1, got 0 "
                "(see sluiceway serve --help)\n"),
        (0, "", ""),
        (0, "", ""),  # the installed serve prints the help
        (2, "", f"sluiceway: model path {missing} does not exist\n"),
        (2, "", f"sluiceway: {tmp_path} is a folder without config.json: not an HF model "
                "folder\n"),
        (2, "", f"sluiceway: speculative_config.model: model path {missing} does not exist\n"),
        (0, "", ""),  # a short name: its package is looked up after the install
    ]  # fmt: skip


def test_ready_in_counts_from_the_process_start() -> None:
    """`serve`'s "ready in" starts its clock at the process's start (the interpreter and the
    imports before serve_command were left out: 2-7 s on a loaded machine)."""
    code = "import time; time.sleep(1.0); from sluiceway.pids import process_age_s; print(process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 1.0 <= float(out.stdout) < 30.0
