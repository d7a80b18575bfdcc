"""`sluiceway bench compare`: one workload against several configurations.

Starts `sluiceway serve` once per configuration (scheduling policy,
`--max-num-seqs`), and optionally runs the `transformers` baseline
(:mod:`sluiceway.bench.transformers_baseline`), sends each the same requests
at the same arrival times, then prints one table in the shape of the seed
article's (rows: throughput, P50/P99 latency, KV memory utilization; a column
per configuration and the reference's improvement over each other one),
saves JSON and draws one PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import IO

from sluiceway.bench.machine_rates import cpu_model
from sluiceway.bench.serve import BenchRun, json_safe, per_request, print_figures, run_workload
from sluiceway.bench.workload import load_requests, request_intervals
from sluiceway.ports import free_port

SERVER_START_TIMEOUT_S = 600.0

# (row label, figure, higher is better)
TABLE_ROWS = (
    ("Throughput (output tokens/s)", "output_throughput", True),
    ("P50 latency (E2E, ms)", "median_e2el_ms", False),
    ("P99 latency (E2E, ms)", "p99_e2el_ms", False),
    ("P50 TTFT (ms)", "median_ttft_ms", False),
    ("P50 TPOT (ms)", "median_tpot_ms", False),
    ("P99 TPOT (ms)", "p99_tpot_ms", False),
    ("KV memory utilization (%)", "kv_cache_utilization_pct", True),
)


@dataclass(slots=True)
class Configuration:
    """One column of the comparison.

    `serve_args` are the `sluiceway serve` flags of a sluiceway configuration;
    `batch_size` is the static batch of the transformers baseline.
    """

    label: str
    backend: str  # "sluiceway" or "transformers"
    serve_args: list[str] = field(default_factory=list)
    batch_size: int = 0


def configurations(
    backends: list[str],
    policies: list[str],
    max_num_seqs: list[int],
    static_batch_size: int,
    speculative_config: str = "",
) -> list[Configuration]:
    """The columns, in order: each policy of sluiceway (continuous once per
    `max_num_seqs` value, and once more with `speculative_config` when given: "... + spec"),
    then the transformers baseline.

    Raises ValueError for an unknown backend or policy, or no configuration.
    """
    configs: list[Configuration] = []
    for backend in backends:
        if backend == "transformers":
            configs.append(
                Configuration(
                    f"transformers (batch {static_batch_size})",
                    "transformers",
                    batch_size=static_batch_size,
                )
            )
            continue
        if backend != "sluiceway":
            raise ValueError(f"--backend: unknown backend {backend!r} (sluiceway, transformers)")
        for policy in policies:
            if policy == "static":
                static_args = ["--scheduling-policy", "static"]
                static_args += ["--static-batch-size", str(static_batch_size)]
                configs.append(
                    Configuration(f"static (batch {static_batch_size})", "sluiceway", static_args)
                )
            elif policy == "continuous":
                for m in max_num_seqs:
                    label = "continuous" if len(max_num_seqs) == 1 else f"continuous ({m} seqs)"
                    flags = ["--scheduling-policy", "fcfs", "--max-num-seqs", str(m)]
                    configs.append(Configuration(label, "sluiceway", flags))
                    if speculative_config:
                        spec = [*flags, "--speculative-config", speculative_config]
                        configs.append(Configuration(f"{label} + spec", "sluiceway", spec))
            else:
                raise ValueError(f"--policies: unknown policy {policy!r} (static, continuous)")
    if not configs:
        raise ValueError("no configuration to run")
    return configs


def improvement(reference: float, other: float, higher_is_better: bool) -> float:
    """How many times better the reference is than `other` (throughput: ref / other;
    latency: other / ref), as the seed article's ratios; 0.0 when undefined."""
    num, den = (reference, other) if higher_is_better else (other, reference)
    return num / den if den else 0.0


def comparison_table(
    labels: list[str], figures: dict[str, dict[str, float]], reference: str
) -> tuple[str, dict[str, dict[str, float]]]:
    """The printed table and its ratios ({other label: {figure: improvement}})."""
    others = [label for label in labels if label != reference]
    ratios = {
        o: {key: improvement(figures[reference][key], figures[o][key], hib)
            for _, key, hib in TABLE_ROWS}
        for o in others
    }  # fmt: skip
    header = ["Metric", *labels, *(f"{reference} vs {o}" for o in others)]
    rows = [
        [name, *(f"{figures[label][key]:.1f}" for label in labels),
         *(f"{ratios[o][key]:.2f}x" for o in others)]
        for name, key, _ in TABLE_ROWS
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)]), ratios


def match_label(labels: list[str], wanted: str) -> str | None:
    """The configuration label `wanted` names: itself, else the only label that starts with
    it; None when none or several do."""
    if wanted in labels:
        return wanted
    matching = [label for label in labels if label.startswith(wanted)]
    return matching[0] if len(matching) == 1 else None


def server_log_path(log_dir: pathlib.Path, label: str) -> pathlib.Path:
    """`--server-log-dir`'s file of a configuration: `log_dir`/LABEL.log, the label's
    characters other than letters, digits, '_', '.' and '-' as '-'."""
    return log_dir / (re.sub(r"[^\w.-]+", "-", label) + ".log")


def server_log(label: str, log_dir: pathlib.Path | None) -> IO[str]:
    """Where a configuration's server writes its log: `server_log_path` (the directory
    made), else a temporary file."""
    if log_dir is None:
        return tempfile.TemporaryFile("w+")
    log_dir.mkdir(parents=True, exist_ok=True)
    return open(server_log_path(log_dir, label), "w+")


def run_sluiceway(
    config: Configuration,
    extra_serve_args: list[str],
    args: argparse.Namespace,
    requests,
    intervals,
) -> BenchRun:  # type: ignore[no-untyped-def]
    """Starts `sluiceway serve` with the configuration's flags, runs the workload, stops it.

    Raises RuntimeError (with the server's log tail) if the server does not come up.
    """
    from sluiceway.client import wait_until_serving

    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sluiceway.cli", "serve", "--port", str(port), "--metrics-port", "0",
           "--http-port", "-1",
           "--log-format", "console", *config.serve_args, *extra_serve_args]  # fmt: skip
    print(f"[{config.label}] {shlex.join(cmd[2:])}", flush=True)
    with server_log(config.label, args.server_log_dir) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while True:
                try:
                    wait_until_serving(target, 1.0)
                    break
                except TimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        why = (
                            f"exited with {proc.returncode}"
                            if proc.poll() is not None
                            else (f"not serving after {SERVER_START_TIMEOUT_S:.0f} s")
                        )
                        raise RuntimeError(
                            f"{config.label}: the server {why}:\n{log.read()[-4000:]}"
                        ) from None
            return asyncio.run(
                run_workload(
                    target, requests, intervals, args.max_concurrency, args.ignore_eos,
                    desc=config.label,
                )
            )  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def machine_description() -> dict[str, object]:
    """CPU model, core count, OS and torch build, for the saved results."""
    import torch

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def compare_command(args: argparse.Namespace) -> int:
    """`bench compare`: runs every configuration, prints the table, saves JSON and PNG."""
    try:
        configs = configurations(
            _split(args.backend), _split(args.policies),
            [int(m) for m in _split(args.max_num_seqs)], args.static_batch_size,
            args.speculative_config,
        )  # fmt: skip
    except ValueError as e:
        print(f"sluiceway bench compare: {e}", file=sys.stderr)
        return 2
    labels = [c.label for c in configs]
    reference = match_label(labels, args.reference or "continuous")
    if reference is None and args.reference is None:
        reference = labels[0]
    if reference is None:
        print(
            f"sluiceway bench compare: --reference {args.reference!r} not in {labels}",
            file=sys.stderr,
        )
        return 2
    try:
        requests = load_requests(args)
    except ValueError as e:
        print(f"sluiceway bench compare: {e}", file=sys.stderr)
        return 2
    intervals = request_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    extra = shlex.split(args.serve_args)
    runs: dict[str, BenchRun] = {}
    try:
        for config in configs:
            runs[config.label] = _run_config(config, args, extra, requests, intervals)
    except RuntimeError as e:
        print(f"sluiceway bench compare: {e}", file=sys.stderr)
        return 1
    figures = {label: run.figures for label, run in runs.items()}
    table, ratios = comparison_table(labels, figures, reference)
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate} req/s"
    if args.max_concurrency:
        rate += f", at most {args.max_concurrency} in flight"
    print(f"\n{len(requests)} {args.dataset_name} prompts, {rate}")
    print(table)
    roofline = None
    if args.roofline:
        from sluiceway.bench.roofline import roofline_of_results

        roofline = roofline_of_results(
            args, [(label, run.results, run.figures["duration_s"]) for label, run in runs.items()]
        )
    if args.save_result:
        _save(args, configs, runs, reference, ratios, table, roofline)
        print(f"results saved to {args.save_result}")
    if args.plot:
        from sluiceway.bench.plot import PlotSeries, plot_runs

        plot_runs(
            [PlotSeries.from_run(label, run) for label, run in runs.items()],
            args.plot,
            title=f"{len(requests)} {args.dataset_name} prompts, {rate}",
        )
        print(f"plot saved to {args.plot}")
    return 1 if any(run.figures["failed_requests"] for run in runs.values()) else 0


def _run_config(config: Configuration, args, extra, requests, intervals) -> BenchRun:  # type: ignore[no-untyped-def]
    """One column: the transformers baseline in this process, or a sluiceway server."""
    if config.backend == "transformers":
        from sluiceway.bench.transformers_baseline import run_transformers

        print(f"[{config.label}] transformers generate, static batches of {config.batch_size}")
        run = run_transformers(
            requests, intervals, model=args.model, batch_size=config.batch_size,
            ignore_eos=args.ignore_eos, dtype=args.dtype,
        )  # fmt: skip
    else:
        run = run_sluiceway(config, extra, args, requests, intervals)
    print(f"[{config.label}]")
    print_figures(run.figures, run.errors)
    return run


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _save(args, configs, runs, reference, ratios, table, roofline=None) -> None:  # type: ignore[no-untyped-def]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(["sluiceway", *sys.argv[1:]]),
        "machine": machine_description(),
        "args": vars(args),
        "reference": reference,
        "table": table,
        "ratios": ratios,
        "configurations": [
            {
                **asdict(c),
                "figures": runs[c.label].figures,
                "errors": runs[c.label].errors,
                "e2e_ms": [r.e2e * 1e3 for r in runs[c.label].results if r.ok],
                "ttft_ms": [r.ttft * 1e3 for r in runs[c.label].results if r.ok],
                "requests": per_request(runs[c.label].results),
            }
            for c in configs
        ],
        **({"roofline": roofline} if roofline else {}),
    }
    with open(args.save_result, "w") as f:
        json.dump(json_safe(result), f, indent=2, default=str)
