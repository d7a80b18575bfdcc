"""`sluiceway bench step`: times the worker's model step on a synthetic decode batch.

The hot path behind every serving figure, measured alone: `--num-seqs` (or each of
`--batch-sizes`) sequences decoding one token each, through `ModelRunner.execute` (input
tensors, forward, sampling). Their context lengths are drawn like the ShareGPT benchmark's
(prompt length + a uniform share of a 128-token output) or fixed (`--context-len`).

Without `--random-model` the model is a folder or GGUF (default: the embedded SmolLM2) and the
prompt lengths come from the ShareGPT dataset itself. With `--random-model NAME` the model is
a built-in config (:data:`RANDOM_MODELS`: `llama-2-7b`, `tiny`, `tiny-262k`) with random weights made
directly on the device (no files, nothing in host memory), and the prompt lengths come from a
lognormal fitted to ShareGPT (:func:`synthetic_context_lengths`), so no dataset is needed.

On CUDA (Triton backend, one rank) each batch is timed twice: through the captured CUDA graphs
and eagerly (`--enforce-eager` skips the capture and the graph timing). Each figure comes with
the HBM bound of a decode step (every weight read once, plus every context token's K and V, at
`--hbm-bandwidth` bytes/s), and `--json PATH` writes them all. `--profile` adds torch's
operator table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import random
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluiceway.argtypes import byte_size, non_negative_int, positive_int
from sluiceway.bench.random_models import RANDOM_MODELS
from sluiceway.options import add_option
from sluiceway.worker.config import WorkerConfig

if TYPE_CHECKING:
    import torch

    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData

# ShareGPT-shaped prompt lengths without the dataset: a lognormal whose log-space mean and
# standard deviation were fitted to 2000 ShareGPT V3 prompts sampled as vLLM does (seed 0,
# SmolLM2 tokenizer; mean 237 tokens, median 112, P90 655), clipped to [4, 1024] tokens as
# vLLM's filter keeps them (the clipped draw: mean 220, median 92). Each context adds a
# uniform 1..128 tokens generated so far (a uniform share of a 128-token output).
LOGNORMAL_MU = 4.51
LOGNORMAL_SIGMA = 1.60
PROMPT_LEN_RANGE = (4, 1024)
OUTPUT_LEN = 128

HBM_BANDWIDTH = 4.8e12  # bytes/s, the H200 datasheet's
BLOCK_SIZE = 16


def synthetic_context_lengths(num_seqs: int, seed: int) -> list[int]:
    """Context lengths like :func:`context_lengths`' ShareGPT ones, without the dataset: a
    prompt of ``round(lognormal(LOGNORMAL_MU, LOGNORMAL_SIGMA))`` tokens clipped to
    :data:`PROMPT_LEN_RANGE`, plus a uniform 1..:data:`OUTPUT_LEN` tokens generated so far.
    The first ``n`` lengths do not depend on ``num_seqs``."""
    rng = random.Random(seed)
    lo, hi = PROMPT_LEN_RANGE
    out = []
    for _ in range(num_seqs):
        prompt = min(hi, max(lo, round(rng.lognormvariate(LOGNORMAL_MU, LOGNORMAL_SIGMA))))
        out.append(prompt + rng.randint(1, OUTPUT_LEN))
    return out


def context_lengths(num_seqs: int, fixed: int | None, seed: int) -> list[int]:
    """Context length (tokens) of each decoding sequence: `fixed`, or a ShareGPT
    prompt length (vLLM's sampling) plus a uniform 1..128 tokens generated so far."""
    if fixed is not None:
        return [fixed] * num_seqs
    from sluiceway.model_files import resolve_model
    from sluiceway.router.tokenizer import load_tokenizer
    from sluiceway.sharegpt import sample_requests

    requests = sample_requests(load_tokenizer(resolve_model(None)), num_seqs, seed=seed)
    rng = random.Random(seed)
    return [r.prompt_len + rng.randint(1, 128) for r in requests]


def hbm_bound(
    batch: int, weight_bytes: int, kv_bytes: int, bandwidth: float = HBM_BANDWIDTH
) -> dict[str, float]:
    """The memory-bandwidth bound of one decode step of `batch` sequences: reading
    `weight_bytes` (every weight once) alone, and with the `kv_bytes` of the contexts."""
    weights_s = weight_bytes / bandwidth
    with_kv_s = (weight_bytes + kv_bytes) / bandwidth
    return {
        "weights_ms_per_step": 1e3 * weights_s,
        "weights_tokens_per_s": batch / weights_s,
        "with_kv_ms_per_step": 1e3 * with_kv_s,
        "with_kv_tokens_per_s": batch / with_kv_s,
    }


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_seconds(
    runner: ModelRunner, chunks: list[ScheduledChunk], warmup: int, iters: int
) -> tuple[list[float], list[float]]:
    """Seconds of each of `iters` steps after `warmup` ones (each step synchronized), and of
    each one's forward."""
    for _ in range(warmup):
        runner.execute(chunks)
    _sync(runner.device)
    times, forward = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.execute(chunks)
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
        forward.append(runner.last_timings.forward_s)
    return times, forward


def _time_steps(
    runner: ModelRunner, chunks: list[ScheduledChunk], warmup: int, iters: int
) -> dict[str, float]:
    """Mean and median seconds of `iters` steps after `warmup` ones (each step synchronized)."""
    times, forward = _step_seconds(runner, chunks, warmup, iters)
    mean = statistics.fmean(times)
    return {
        "ms_per_step": 1e3 * mean,
        "median_ms_per_step": 1e3 * statistics.median(times),
        "forward_ms": 1e3 * statistics.fmean(forward),
        "tokens_per_s": len(chunks) / mean,
    }


def _batch_sizes(args: argparse.Namespace) -> list[int]:
    if not args.batch_sizes:
        return [args.num_seqs]
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(
            f"--batch-sizes: not a comma list of integers: {args.batch_sizes!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--batch-sizes: positive integers, got {args.batch_sizes!r}")
    return sizes


@dataclass(slots=True)
class _Setup:
    """The runner of a `bench step` run and how its KV pool was sized."""

    runner: ModelRunner
    lens: list[int]  # context length of each sequence of the largest batch
    distribution: dict[str, Any]  # how `lens` were drawn (the JSON's context_lengths)
    bytes_per_block: int
    kv_cache_memory: int
    setup_s: float


def _setup(
    args: argparse.Namespace,
    device: torch.device,
    max_batch: int,
    prompt_lens: list[int] | None = None,
) -> _Setup:
    """The runner on `--model` or `--random-model` with a pool of exactly the blocks of the
    largest batch (or `--kv-cache-memory`), and the context lengths (``prompt_lens`` where
    given: `--prefill-tokens`' prompts).

    Raises:
        SystemExit: the pool holds fewer blocks than the largest batch needs.
    """
    from sluiceway.model_files import resolve_model
    from sluiceway.worker.kv_sizing import kv_bytes_per_block
    from sluiceway.worker.loader import load_config, random_model
    from sluiceway.worker.model import ModelConfig
    from sluiceway.worker.model_runner import ModelRunner
    from sluiceway.worker.model_setup import resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    t_setup = time.perf_counter()
    if args.random_model:
        lens = prompt_lens or (
            [args.context_len] * max_batch
            if args.context_len is not None
            else synthetic_context_lengths(max_batch, args.seed)
        )
        config = ModelConfig.from_hf_dict(RANDOM_MODELS[args.random_model])
        model = random_model(
            config, dtype=dtype, device=device, max_positions=max(lens), seed=args.seed
        )
        model_dir = pathlib.Path(f"random-{args.random_model}")
        distribution: dict[str, Any] = {
            "kind": "lognormal",
            "mu": LOGNORMAL_MU,
            "sigma": LOGNORMAL_SIGMA,
            "prompt_len_range": list(PROMPT_LEN_RANGE),
            "output_share": f"uniform 1..{OUTPUT_LEN}",
        }
    else:
        try:
            lens = prompt_lens or context_lengths(max_batch, args.context_len, args.seed)
        except FileNotFoundError as e:  # no ShareGPT package: --context-len needs none
            raise SystemExit(f"bench step: {e} (or give --context-len)") from None
        model_dir = resolve_model(args.model)
        config = load_config(model_dir)
        model = None
        distribution = {"kind": "sharegpt", "output_share": "uniform 1..128"}
    if args.context_len is not None:
        distribution = {"kind": "fixed", "context_len": args.context_len}
    if prompt_lens is not None:
        distribution = {"kind": "prompts", "prompt_lens": prompt_lens}
    from sluiceway.kernels.kv_quant import kv_cache_torch_dtype

    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    bytes_per_block = kv_bytes_per_block(config, config.num_kv_heads, BLOCK_SIZE, kv_dtype)
    needed = sum(-(-n // BLOCK_SIZE) for n in lens)
    kv_cache_memory = args.kv_cache_memory or needed * bytes_per_block
    try:
        runner = ModelRunner(
            model_dir,
            device=str(device),
            dtype=args.dtype,
            quantization=args.quantization,
            block_size=BLOCK_SIZE,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max(lens),
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            model=model,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    except ValueError as e:  # e.g. a context past the model's max_position_embeddings
        raise SystemExit(f"bench step: {e}") from None
    del model
    setup_s = time.perf_counter() - t_setup
    if needed > runner.num_kv_blocks:
        raise SystemExit(f"{needed} KV blocks needed, the pool has {runner.num_kv_blocks}")
    return _Setup(runner, lens, distribution, bytes_per_block, kv_cache_memory, setup_s)


def _sequences(runner: ModelRunner, lens: list[int], seed: int) -> list[SequenceData]:
    """One greedy sequence of random tokens per context length, its blocks contiguous from
    block 0 on (the pool zeroed first: no NaN or denormals from uninitialized memory in the
    timings)."""
    from sluiceway.sampling_params import SamplingParams

    runner.kv_pool.zero_()
    rng = random.Random(seed)
    seqs, next_block = [], 0
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    for i, n in enumerate(lens):
        seq = runner.make_sequence(i, [rng.randrange(runner.vocab_size) for _ in range(n)], greedy)
        nb = -(-n // BLOCK_SIZE)
        seq.block_table.extend(range(next_block, next_block + nb))
        next_block += nb
        seqs.append(seq)
    return seqs


def _decode_chunks(runner: ModelRunner, lens: list[int], seed: int) -> list[ScheduledChunk]:
    """:func:`_sequences`, each decoding its last token."""
    from sluiceway.worker.model_runner import ScheduledChunk

    return [
        ScheduledChunk(s, n - 1, 1)
        for s, n in zip(_sequences(runner, lens, seed), lens, strict=True)
    ]


def _prompt_chunks(runner: ModelRunner, lens: list[int], seed: int) -> list[ScheduledChunk]:
    """:func:`_sequences`, each computing its whole prompt (`--prefill-tokens`)."""
    from sluiceway.worker.model_runner import ScheduledChunk

    return [
        ScheduledChunk(s, 0, n) for s, n in zip(_sequences(runner, lens, seed), lens, strict=True)
    ]


def _bench_batch(
    runner: ModelRunner,
    chunks: list[ScheduledChunk],
    ctx: list[int],
    args: argparse.Namespace,
    *,
    read_bytes: int,
    bytes_per_token: int,
) -> dict[str, Any]:
    """Times the decode step of `chunks` (contexts `ctx`) through the CUDA graphs where one
    fits, then eagerly; prints its line and returns its figures (a row of the JSON)."""
    b = len(chunks)
    kv_bytes = sum(ctx) * bytes_per_token
    graphs = runner.cuda_graphs
    graph_batch = graphs.batch_size_for(b) if graphs is not None else None
    graph = None
    if graphs is not None and graph_batch is not None:
        graph = _time_steps(runner, chunks, args.warmup, args.iters)
        graph["graph_batch"] = graph_batch
    runner.cuda_graphs = None
    try:
        eager = _time_steps(runner, chunks, args.warmup, args.iters)
    finally:
        runner.cuda_graphs = graphs
    bound = hbm_bound(b, read_bytes, kv_bytes, args.hbm_bandwidth)
    best = max(eager["tokens_per_s"], graph["tokens_per_s"] if graph else 0.0)
    row: dict[str, Any] = {
        "batch_size": b,
        "context_len_mean": statistics.fmean(ctx),
        "context_len_min": min(ctx),
        "context_len_max": max(ctx),
        "kv_blocks_used": sum(-(-n // BLOCK_SIZE) for n in ctx),
        "kv_bytes_read_per_step": kv_bytes,
        "graph": graph,
        "eager": eager,
        "eager_over_graph": eager["ms_per_step"] / graph["ms_per_step"] if graph else None,
        "hbm_bound": bound,
        "fraction_of_hbm_bound": best / bound["with_kv_tokens_per_s"],
    }
    graph_text = (
        f"graphs {graph['ms_per_step']:.2f} ms/step {graph['tokens_per_s']:.0f} tokens/s, "
        f"eager/graphs {row['eager_over_graph']:.2f}x; "
        if graph
        else "graphs n/a; "
    )
    print(
        f"batch {b}: context {min(ctx)}..{max(ctx)} tokens (mean {statistics.fmean(ctx):.0f}),"
        f" {row['kv_blocks_used']} KV blocks; {graph_text}eager {eager['ms_per_step']:.2f} "
        f"ms/step (median {eager['median_ms_per_step']:.2f}, forward "
        f"{eager['forward_ms']:.2f}) {eager['tokens_per_s']:.1f} tokens/s; HBM bound "
        f"{bound['with_kv_ms_per_step']:.3f} ms/step = {bound['with_kv_tokens_per_s']:.0f} "
        f"tokens/s (weights alone {bound['weights_tokens_per_s']:.0f}); "
        f"{100 * row['fraction_of_hbm_bound']:.1f}% of it"
    )
    return row


def _read_bytes(runner: ModelRunner) -> int:
    """Bytes of weights a decode step reads: every weight once, but of an untied embedding
    only the batch's rows (left out)."""
    read_bytes = runner.parameter_bytes
    if runner.model.lm_head_weight is not None:
        emb = runner.model.embed_weight
        read_bytes -= emb.numel() * emb.element_size()
    return read_bytes


def _json_path(text: str | None) -> pathlib.Path | None:
    """`--json`'s file, its folder created now (before the run, not after it).

    Raises:
        SystemExit: a folder, or a folder that cannot be made.
    """
    if text is None:
        return None
    path = pathlib.Path(text)
    if path.is_dir():
        raise SystemExit(f"--json: {text} is a folder, give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--json: cannot make {path.parent}: {e.strerror}") from None
    return path


def _write_json(path: pathlib.Path, report: dict[str, Any]) -> None:
    """Writes `report` as JSON to `path`.

    Raises:
        SystemExit: the file cannot be written.
    """
    try:
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise SystemExit(f"--json: cannot write {path}: {e.strerror}") from None
    print(f"wrote {path}")


def _report(
    args: argparse.Namespace,
    setup: _Setup,
    device: torch.device,
    gpu: str | None,
    read_bytes: int,
    results: list[dict[str, Any]],
) -> dict[str, Any]:
    """Every figure of the run, as the JSON holds them."""
    import torch

    runner = setup.runner
    graphs = runner.cuda_graphs
    return {
        "model": runner.model_id,
        "random_model": args.random_model,
        "device": str(device),
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "attention_backend": runner.attention_backend.name,
        "quantization": runner.quantization,
        "cuda_graphs": graphs is not None,
        "cuda_graph_batch_sizes": graphs.batch_sizes if graphs is not None else None,
        "setup_s": setup.setup_s,
        "num_parameters": sum(p.numel() for p in runner.model.parameters()),
        "weight_bytes": runner.parameter_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "block_size": BLOCK_SIZE,
        "bytes_per_block": setup.bytes_per_block,
        "kv_cache_memory": setup.kv_cache_memory,
        "num_kv_blocks": runner.num_kv_blocks,
        "hbm_bandwidth": args.hbm_bandwidth,
        "context_lengths": {**setup.distribution, "seed": args.seed},
        "warmup": args.warmup,
        "iters": args.iters,
        "threads": torch.get_num_threads(),
        "results": results,
    }


def _print_profile(runner: ModelRunner, chunks: list[ScheduledChunk]) -> None:
    """Prints torch's operator table of three steps of `chunks` (CUDA time on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    device = runner.device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(3):
            runner.execute(chunks)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20))


def step_command(args: argparse.Namespace) -> int:
    """Prints per batch size the mean and median step time and the decode throughput
    (tokens/s), with and without CUDA graphs where they apply, against the HBM bound;
    `--json` writes the same figures."""
    import torch

    from sluiceway.bench import step_prefill

    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    prompts = step_prefill.prompt_lengths_of(args)
    sizes = [len(prompts)] if prompts else _batch_sizes(args)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device")
    json_path = _json_path(args.json)
    setup = _setup(args, device, max(sizes), prompts)
    runner, lens = setup.runner, setup.lens
    if prompts:
        chunks = _prompt_chunks(runner, lens, args.seed)
    else:
        chunks = _decode_chunks(runner, lens, args.seed)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    print(
        f"{runner.model_id}: {runner.dtype} on {device} ({gpu or platform.processor() or 'cpu'}),"
        f" {runner.parameter_bytes / 1e9:.2f} GB of weights (quantization {runner.quantization}),"
        f" {runner.num_kv_blocks} KV blocks of {setup.bytes_per_block} bytes, attention {runner.attention_backend.name}, CUDA graphs "
        f"{'on' if runner.cuda_graphs is not None else 'off'}; ready in {setup.setup_s:.1f} s, "
        f"{torch.get_num_threads()} threads"
    )
    read_bytes = _read_bytes(runner)
    prefill = None
    if prompts:
        times, _ = _step_seconds(runner, chunks, args.warmup, args.iters)
        prefill = step_prefill.prefill_step(runner, chunks, times)
    results = [
        _bench_batch(
            runner,
            chunks[:b],
            lens[:b],
            args,
            read_bytes=read_bytes,
            bytes_per_token=setup.bytes_per_block // BLOCK_SIZE,
        )
        for b in ([] if prompts else sizes)
    ]
    if json_path is not None:
        report = _report(args, setup, device, gpu, read_bytes, results)
        if prefill is not None:
            report["prefill"] = prefill
        _write_json(json_path, report)
    if args.profile:
        _print_profile(runner, chunks)
    return 0


def add_step_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or GGUF (default: embedded)")
    p.add_argument(
        "--random-model",
        choices=sorted(RANDOM_MODELS),
        default=None,
        help="a built-in config with random weights made on the device instead of --model "
        "(llama-2-7b: 32 layers, hidden 4096, 32 heads; tiny: for a CPU); context lengths "
        f"then come from a lognormal fitted to ShareGPT (mu {LOGNORMAL_MU}, sigma "
        f"{LOGNORMAL_SIGMA}, clipped to {PROMPT_LEN_RANGE[0]}..{PROMPT_LEN_RANGE[1]}, plus "
        f"1..{OUTPUT_LEN} generated tokens; default: none)",
    )
    p.add_argument("--num-seqs", type=int, default=200, help="sequences of the decode batch")
    p.add_argument(
        "--prefill-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="time a step of N prompt rows instead of decode batches: prompts of --context-len "
        "tokens (default 256) from position 0; on a CPU with the C++ kernels also its split "
        "(linears, attention, other) and the linears against P, bench roofline's dense GEMM "
        "alone at these shapes (issue 33)",
    )
    p.add_argument(
        "--batch-sizes",
        default=None,
        help="comma list of decode batch sizes, e.g. 1,32,256 (default: --num-seqs); the "
        "batch of n takes the first n sequences of the largest",
    )
    p.add_argument(
        "--context-len",
        type=positive_int,
        default=None,
        help="fixed context (default: ShareGPT-like)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: CUDA when torch sees a GPU",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="as the worker resolves it",
    )

    add_option(p, "quantization", WorkerConfig.options()["quantization"])
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        default="auto",
        help="auto: Triton on CUDA, the C++ kernels (cpu) on CPU",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="capture no CUDA graphs: time the eager steps only",
    )
    add_option(p, "kv_cache_dtype", WorkerConfig.options()["kv_cache_dtype"])
    p.add_argument(
        "--kv-cache-memory",
        type=byte_size("no room for a KV block"),
        default=None,
        help="KV pool size (e.g. 40GiB; default: exactly the blocks of the largest batch)",
    )
    p.add_argument(
        "--hbm-bandwidth",
        type=float,
        default=HBM_BANDWIDTH,
        help="device memory bandwidth for the bound, bytes/s (default: H200's 4.8e12)",
    )
    p.add_argument(
        "--num-threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: every core)",
    )
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first")
    p.add_argument("--iters", type=positive_int, default=10, help="timed steps")
    p.add_argument("--seed", type=int, default=0, help="seed of the context lengths and weights")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="write every figure as JSON (default: none)"
    )
    p.add_argument("--profile", action="store_true", help="print torch's operator table")
