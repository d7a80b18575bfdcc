"""The `sluiceway` command: serve, generate, and one entry point per process."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from sluiceway.argtypes import ArgumentParser
from sluiceway.generate_cli import add_parser as add_generate_parser
from sluiceway.options import LOG_FORMAT, LOG_LEVEL, add_option
from sluiceway.router.config import RouterConfig
from sluiceway.scheduler.config import SchedulerConfig
from sluiceway.serve_config import ServeConfig
from sluiceway.worker.compute_thread import openmp_defaults
from sluiceway.worker.config import WorkerConfig


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluiceway")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def add_convert_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    convert = sub.add_parser(
        "convert",
        help="write an HF model folder (config.json, safetensors, tokenizer) from a GGUF file",
        description="Write the HF folder `serve` makes of a GGUF file (float32 safetensors, "
        "config.json, tokenizer files with the chat template, generation_config.json, and "
        "gguf/blocks.safetensors: the quantized weights' own blocks, which `serve "
        "--quantization gguf` serves) into --output, for `serve --model DIR`, transformers or "
        "another server.",
    )
    convert.add_argument(
        "--model",
        default=None,
        help="the .gguf file, or a short name such as gemma3-270m (default: the embedded "
        "SmolLM2-135M-Instruct Q4_1 GGUF)",
    )
    convert.add_argument(
        "--output", required=True, help="the folder to write; must not exist or be empty"
    )
    add_option(convert, "log_format", LOG_FORMAT)
    add_option(convert, "log_level", LOG_LEVEL)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="sluiceway",
        description="LLM inference server: continuous batching over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    ServeConfig.add_arguments(
        sub.add_parser("serve", help="start worker, scheduler and router as separate processes")
    )
    add_generate_parser(sub)
    add_convert_parser(sub)
    RouterConfig.add_arguments(
        sub.add_parser("router", help="run the router process (public gRPC API)")
    )
    SchedulerConfig.add_arguments(sub.add_parser("scheduler", help="run the scheduler process"))
    WorkerConfig.add_arguments(sub.add_parser("worker", help="run one worker process"))
    from sluiceway.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _command(args)
    except KeyboardInterrupt:  # Ctrl-C before a command's own handlers: no traceback
        print(f"sluiceway {args.command}: interrupted", file=sys.stderr)
        return 130


def _command(args: argparse.Namespace) -> int:
    # Before torch loads OpenMP (no import above loads torch): how long idle OpenMP threads
    # spin, the same for a worker, `bench step` and `generate` (compute_thread.py).
    openmp_defaults(os.environ)
    if args.command == "generate":
        from sluiceway.generate_cli import generate_command

        return generate_command(args)
    if args.command == "bench":
        from sluiceway.bench.cli import bench_command

        return bench_command(args)
    if args.command == "serve":
        from sluiceway.launcher import serve_command

        _exit_now(serve_command(args))  # its children stopped: nothing left to tear down
    if args.command == "convert":
        return _convert(args)

    from sluiceway.logs import configure_logging

    configure_logging(args.command, args.log_format, args.log_level)
    if args.command == "router":
        return _run_router(args)
    if args.command == "scheduler":
        return _run_scheduler(args)
    return _run_worker(args)


def _convert(args: argparse.Namespace) -> int:
    from sluiceway.logs import configure_logging
    from sluiceway.model_files import ModelFilesError, export_hf_folder

    configure_logging("convert", args.log_format, args.log_level)
    try:
        folder = export_hf_folder(args.model, args.output)
    except ModelFilesError as e:
        print(f"sluiceway convert: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # reading the GGUF, or the conversion cache
        print(f"sluiceway convert: {e.filename or args.model}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"sluiceway convert: wrote {folder}; serve it with: sluiceway serve --model {folder}")
    return 0


def _run_async(coro) -> int:  # type: ignore[no-untyped-def]
    """Runs a process's main coroutine; a port it cannot bind or a refused registration is
    a clear error (exit 2), an unreachable scheduler too (exit 1: a restart may help). After
    a clean stop the process exits 0 at once (no return)."""
    from sluiceway.grpc_server import BindError, RegistrationRefused, SchedulerUnreachable
    from sluiceway.metrics import MetricsPortError

    async def run_then_exit() -> None:
        await coro
        # Stopped cleanly (servers stopped, streams ended, pools closed): exit from inside the
        # loop, whose teardown would cancel gRPC's tasks of the calls just ended (grpc logs
        # each as an unhandled CancelledError, traceback and all).
        _exit_now(0)

    try:
        try:
            import uvloop
        except ImportError:  # uvloop has no Windows build
            import asyncio

            asyncio.run(run_then_exit())
        else:
            uvloop.run(run_then_exit())
    except (MetricsPortError, BindError, RegistrationRefused) as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    except SchedulerUnreachable as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 1
    raise AssertionError("run_then_exit returned")


def _exit_now(status: int) -> NoReturn:
    """Exits with `status` without the interpreter's teardown of the modules (torch,
    transformers, grpc: 0.5-1.6 s on a busy 2-core machine, which would hold a second Ctrl-C
    to `serve` past a second). Only once the process has released what it holds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_router(args: argparse.Namespace) -> int:
    from sluiceway.model_files import resolve_model
    from sluiceway.router.balancer import parse_scheduler_addresses
    from sluiceway.router.server import serve
    from sluiceway.router.tokenizer import load_chat_template
    from sluiceway.security import check_files

    try:  # a TLS flag without its pair, an unreadable key or certificate file
        config = RouterConfig.from_namespace(args)
        check_files(config)
    except ValueError as e:
        print(f"sluiceway router: {e}", file=sys.stderr)
        return 2
    try:
        parse_scheduler_addresses(config.scheduler)
    except ValueError as e:
        print(f"sluiceway router: --scheduler: {e}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(config.model)
        if config.chat_template is not None:
            load_chat_template(config.chat_template)
    except ValueError as e:
        print(f"sluiceway router: {e}", file=sys.stderr)
        return 2
    return _run_async(serve(config, model_dir))


def _run_scheduler(args: argparse.Namespace) -> int:
    from sluiceway.scheduler.server import serve

    try:
        config = SchedulerConfig.from_namespace(args)
    except ValueError as e:
        print(f"sluiceway scheduler: {e}", file=sys.stderr)
        return 2
    return _run_async(serve(config))


def _run_worker(args: argparse.Namespace) -> int:
    import torch

    from sluiceway.model_files import resolve_model, served_model_name
    from sluiceway.preflight import check_device
    from sluiceway.speculative import SpeculativeConfig
    from sluiceway.worker.compute_thread import run_on_compute_thread
    from sluiceway.worker.kv_pool import SharedKvPool, allocate_shared_kv_pool
    from sluiceway.worker.model_runner import ModelRunner
    from sluiceway.worker.server import serve

    config = WorkerConfig.from_namespace(args)
    try:
        check_device(config.device)
        model_dir = resolve_model(config.model)
    except ValueError as e:
        print(f"sluiceway worker: {e}", file=sys.stderr)
        return 2
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tp, rank = config.tensor_parallel_size, config.rank
    if tp > 1:
        from sluiceway.worker.parallel import init_tensor_parallel

        if not config.distributed_init_method:
            print("sluiceway worker: --tensor-parallel-size > 1 needs --distributed-init-method "
                  "tcp://HOST:PORT (the same on every rank)", file=sys.stderr)  # fmt: skip
            return 2
        if device == "cuda" and torch.cuda.device_count() > 1:
            device = f"cuda:{rank % torch.cuda.device_count()}"  # one GPU per rank
        method = config.distributed_init_method
        try:
            # On the compute thread: its current CUDA device (set_device) is per thread.
            # A collective waits for peers that compute the same layer: a minute is skew
            # enough; longer only delays noticing a rank that will never come.
            run_on_compute_thread(
                lambda: init_tensor_parallel(rank, tp, method, device, timeout_s=60)
            )
        except ValueError as e:
            print(f"sluiceway worker: {e}", file=sys.stderr)
            return 2
    shared: list[SharedKvPool] = []

    def shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
        shared.append(allocate_shared_kv_pool(shape, dtype, device))
        return shared[0].tensor

    try:
        # on the thread that runs every step: one OpenMP pool (compute_thread.py)
        runner = run_on_compute_thread(
            lambda: ModelRunner(
                model_dir,
                device=device,
                dtype=config.dtype,
                quantization=config.quantization,
                block_size=config.block_size,
                kv_cache_memory=config.kv_cache_memory,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_model_len=config.max_model_len,
                kv_pool_factory=shared_pool if config.share_kv_pool else None,
                attention_backend=config.attention_backend,
                tensor_parallel_rank=rank,
                tensor_parallel_size=tp,
                enforce_eager=config.enforce_eager,
                kv_cache_dtype=config.kv_cache_dtype,
                speculative=SpeculativeConfig.parse(config.speculative_config)
                if config.speculative_config
                else None,
            ),
            num_threads=config.num_threads or os.cpu_count() or 1,
        )
    except (ValueError, ImportError, OSError) as e:  # a model, device or /dev/shm problem
        print(f"sluiceway worker: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the load goes on on the compute thread: do not wait for it
        print("sluiceway worker: interrupted", file=sys.stderr)
        _exit_now(130)
    model_id = served_model_name(model_dir, config.served_model_name)
    return _run_async(serve(config, runner, model_id, shared[0] if shared else None))


if __name__ == "__main__":
    sys.exit(main())
